"""Shared test setup: one torch thread (2-core machine), token cache in a per-session folder, and
the helpers (tests/helpers/) importable by name from every tier's tests."""

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


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
