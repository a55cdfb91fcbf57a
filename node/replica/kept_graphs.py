"""`KeptGraphs`: forward autograd graphs a head or body stage keeps for its Backward (memory for compute).

By default a head or body forward runs under `no_grad` and its Backward recomputes the forward
with grad from the stashed input (node/replica/compute.py): the stage runs its forward twice per
microbatch, which on a CPU is about a third of its work. With `keep_graphs = N > 0` the forward
runs with grad instead and up to N of its graphs (output and the input leaf) are kept; a Backward
that finds its graph back-propagates through it and skips the recompute. What a kept graph costs
is the forward's saved activations (batch x seq x d_model floats per saved tensor per block),
which is why it is bounded: a forward beyond N, or one whose graph is gone, recomputes as before.

A graph is only valid on the weights it was built on: every write to the weights (an optimizer
step, an averaging apply) is in place and would make autograd refuse it, and backward pinning
wants the forward's weights anyway. So a graph is used only while the stage's weight version is
the one it was built on, and `clear` drops them all when the weights are about to change (their
microbatches then recompute on the pinned copy, exactly as without this store). The result is
the same arithmetic as the recompute, bit for bit: the same operations on the same values.

Only the compute thread touches it (like everything of StageCompute).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["KeptGraph", "KeptGraphs"]


@dataclass(frozen=True)
class KeptGraph:
    output: torch.Tensor  # the stage's output, still attached to its graph
    wire: torch.Tensor | None  # the input leaf (requires grad); None on the head
    weights_version: int


class KeptGraphs:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"keep_graphs must be >= 0, got {capacity}")
        self.capacity = capacity
        self._graphs: OrderedDict[str, KeptGraph] = OrderedDict()
        self.used = 0  # backwards that skipped their recompute

    def __len__(self) -> int:
        return len(self._graphs)

    def has_room(self) -> bool:
        return len(self._graphs) < self.capacity

    def keep(self, microbatch_id: str, graph: KeptGraph) -> None:
        if not self.has_room():
            raise RuntimeError("no room for another graph: check has_room() first")
        self._graphs[microbatch_id] = graph

    def take(self, microbatch_id: str, weights_version: int) -> KeptGraph | None:
        """The graph of `microbatch_id` if it was built on `weights_version` (it is removed either way)."""
        graph = self._graphs.pop(microbatch_id, None)
        if graph is None or graph.weights_version != weights_version:
            return None
        self.used += 1
        return graph

    def drop(self, microbatch_id: str) -> None:
        self._graphs.pop(microbatch_id, None)

    def retain_only(self, live: set[str]) -> None:
        """Forget graphs whose microbatch left the stash (evicted, expired): their Backward cannot come."""
        for microbatch_id in [m for m in self._graphs if m not in live]:
            del self._graphs[microbatch_id]

    def clear(self) -> None:
        self._graphs.clear()
