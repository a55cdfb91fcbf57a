"""Shared test setup: one torch thread (2-core machine), token cache in a per-session folder."""

import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    # Tokenized corpora are cached per test session so tests never touch the user's cache.
    os.environ.setdefault("AGORA_CACHE_DIR", str(tmp_path_factory.mktemp("agora-cache")))
    yield
