"""Shared test setup: one torch thread (2-core machine), token cache in a per-session folder, the
helpers (tests/helpers/) importable by name from every tier's tests, and how the suite is split
over its two pytest-xdist workers (setup.cfg's ``-n 2 --dist loadscope``):

- A module is one unit of work: its module-scoped fixture (a live demo, a DHT swarm) starts once.
- The whole-system tests (tests/system) are one unit, run one after another by one worker while the
  other takes every other module: two whole demos side by side on two cores each took three to five
  times as long as alone (the live monitor's 40 s demo 200 s, lm-eval through a swarm past its
  240 s), and the budgets that made them fail were load-bound. The modules that build network
  namespaces with the WAN harness (bench/wan/) are among them: they share the host's network settings
  and remove each other's leftovers, so they must take turns anyway.
- That unit is handed out first and the many short modules fill the other worker, so the run does
  not end waiting on one long module started last.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


# The modules one worker runs one after another (the module docstring), the WAN harness's among them.
SERIAL_DIR = "tests/system/"
_SERIAL = "serial"


def serial_scope(module: str) -> str:
    """The unit of work a test module belongs to: the serial one, or its own."""
    return _SERIAL if module.startswith(SERIAL_DIR) else module


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(SERIAL_DIR))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only where the suite runs under xdist

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_scope(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # collection order (above), not the modules' test counts
    return ByModule(config, log)


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    # Tokenized corpora are cached per test session so tests never touch the user's cache.
    os.environ.setdefault("AGORA_CACHE_DIR", str(tmp_path_factory.mktemp("agora-cache")))
    yield


@pytest.fixture(scope="module")
def dht_pair():
    """Two real DHT peers on loopback, the second bootstrapped from the first; shared by a module's
    tests (each start spawns a p2pd and takes a second or two)."""
    from agora.dht.swarm import SwarmDHT

    first = SwarmDHT.start()
    try:
        second = SwarmDHT.start(initial_peers=first.visible_maddrs())
        try:
            yield first, second
        finally:
            second.shutdown()
    finally:
        first.shutdown()
