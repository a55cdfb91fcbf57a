"""Global batches through a tail-stage worker, for the weight-sync tests
(tests/integration/test_state_transfer.py, tests/integration/test_state_poisoning.py): replicas that
train, so that their states differ from their initialisation and from each other."""

from __future__ import annotations

import torch

from agora.pipeline.config import ModelConfig

__all__ = ["tail_batch", "train_tail"]


def tail_batch(model: ModelConfig, seed: int):
    """(tokens, wire input, targets) of one microbatch of 2 rows of 32 positions."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size, (2, 33), generator=generator)
    wire = torch.randn(2, 32, model.wire_dim, generator=generator)
    return tokens[:, :-1], wire, tokens[:, 1:]


async def train_tail(client, model: ModelConfig, first_batch: int, batches: int, first_report: int) -> None:
    """`batches` global batches of one microbatch each, the data of batches `first_batch`, ...,
    reported done as global batches `first_report`, ... (the step the worker counts)."""
    for index in range(batches):
        tokens, wire, targets = tail_batch(model, first_batch + index)
        await client.forward(f"b{first_batch + index}", tokens, wire, targets)
        await client.batch_done(first_report + index, 1, 1)
