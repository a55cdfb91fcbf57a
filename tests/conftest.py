"""Shared test setup: one torch thread (2-core machine), token cache in a per-session folder, the
helpers (tests/helpers/) importable by name from every tier's tests, and how the suite is split
over its two pytest-xdist workers (setup.cfg's ``-n 2 --dist loadscope``):

- A module is one unit of work: its module-scoped fixture (a live demo, a DHT swarm) starts once.
- The modules that build network namespaces with the WAN harness (bench/wan/) are one unit: they share
  the host's network settings and remove each other's leftovers, so they must take turns.
- Whole demos (tests/system) are handed out first and the many short modules fill the end, so the
  run does not end waiting on one long module started last.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


HOST_NETWORK_MODULES = frozenset({"tests/system/test_bench_quick.py", "tests/system/test_dht_scale_swarm.py",
                                  "tests/system/test_wan_harness.py"})
_HOST_NETWORK = "host-network"


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith("tests/system/"))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only where the suite runs under xdist

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _HOST_NETWORK if module in HOST_NETWORK_MODULES else module

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
