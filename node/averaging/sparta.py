"""AsyncSPARTA and streaming DiLoCo, the pure parts: which elements, which round, what to add.

Everything here is deterministic arithmetic on tensors and integers, tested without a network;
the averaging loop (node/averaging/loop.py) and the all-reduce (dht/averaging.py) use it.

Design choices:
- Partition: every tensor's elements are shuffled by a permutation drawn from the run seed and
  the tensor's position, then cut into `n_slices` contiguous runs of that permutation. So each
  slice holds the same share (within one element) of *every* tensor, every element is in
  exactly one slice, and every replica computes the same slices with no communication. The
  permutation is a seeded Feistel network evaluated only at the positions of the slice a round
  needs, on the tensor's device, so no index per parameter is ever stored; each slice's indices
  are sorted, so gathering and scattering walk memory in order.
- The averaged buffer has one fixed length (the largest slice, zero padded): hivemind refuses
  to group peers whose tensor schema differs, so a stable schema keeps every round joinable.
- Rounds are counted on the local optimizer step: round r is due at step r * every_steps (or
  when another replica of the stage announced it: the fastest one sets the pace) and averages
  slice r mod n_slices. A round that came due while another was running is skipped (counted),
  not queued: a late round would look for peers that have already moved on.
- Groups: the averager (dht/averaging.py) writes the round number into hivemind's group bits,
  so only replicas averaging the same slice of the same round meet.
- Delta rule: the slice is snapshotted when the round starts; when the average arrives the
  replica adds `average - snapshot`, keeping the local steps it took meanwhile.
- Weight: samples processed since the previous round; exactly 0 while the worker syncs.
  Members get a tiny floor so that a group of idle members averages evenly instead of
  dividing zero by zero; it is negligible next to any real sample count.
- DiLoCo fragments are slices of the same partition (the outer optimizer is elementwise, so
  which elements form a fragment does not change its math, and the buffer stays fixed-size).
  Each replica keeps an anchor (the last agreed value) and an outer momentum per element; a
  round averages (anchor, local) with token weights, so the outer gradient is the weighted mean
  of the deltas `anchor - local`, and a replica whose anchor drifted (a missed round) heals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from agora.pipeline.config import ModelConfig, SyncConfig

__all__ = [
    "SlicePartition",
    "RoundDecision",
    "next_round",
    "round_slice",
    "peer_weight",
    "MEMBER_WEIGHT_FLOOR",
    "outer_nesterov_step",
    "stage_parameter_numels",
    "averaged_vector_size",
    "second_moment_offset",
    "max_round_weight",
]

# See the module docstring: only matters when every member of a group is idle.
MEMBER_WEIGHT_FLOOR = 1e-3
# Mixes the tensor position into the run seed (a large odd constant keeps streams apart).
_SEED_STRIDE = 0x9E3779B97F4A7C15


def _mix32(value: int) -> int:
    """A 32-bit hash of a Python integer (splitmix64's finaliser, truncated): round keys."""
    value = (value + 0x9E3779B97F4A7C15) % 2**64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) % 2**64
    return (value ^ (value >> 31)) & 0xFFFFFFFF


class _SeededPermutation:
    """A bijection of [0, n) drawn from a seed, evaluated at any positions without building it.

    A Feistel network over the smallest number of bits that covers n (halves of unequal width when
    that number is odd, which trade places each round; 3 rounds of a multiply-xorshift hash),
    cycle-walked into [0, n): every position maps to a distinct element, in int64 arithmetic
    that is exact on any device (no product exceeds 2^59), so every replica, on a CPU or a GPU,
    draws the same permutation. The domain is under 2n, so a walk re-enters [0, n) within a few
    steps.
    """

    _MULTIPLIER = 0x45D9F3B
    _ROUNDS = 3  # Luby and Rackoff's three rounds

    def __init__(self, n: int, seed: int):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.left_bits, self.right_bits = bits - bits // 2, bits // 2
        self.keys = [_mix32(seed * self._ROUNDS + r) for r in range(self._ROUNDS)]

    def _hash(self, right: torch.Tensor, key: int, bits: int) -> torch.Tensor:
        # right < 2^31 and key < 2^32, so the product stays below 2^59; the shift folds its high bits,
        # which depend on every input bit, into the low ones the mask keeps.
        x = (right ^ key) * self._MULTIPLIER
        return (x ^ (x >> 29)) & ((1 << bits) - 1)

    def _encrypt(self, positions: torch.Tensor) -> torch.Tensor:
        left_bits, right_bits = self.left_bits, self.right_bits
        left, right = positions >> right_bits, positions & ((1 << right_bits) - 1)
        for key in self.keys:
            left, right = right, left ^ self._hash(right, key, left_bits)
            left_bits, right_bits = right_bits, left_bits
        return (left << right_bits) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The elements at `positions` (int64) of the permutation."""
        out = self._encrypt(positions)
        outside = out >= self.n
        while bool(outside.any()):  # walk the cycle until it re-enters [0, n): a bijection of [0, n) still
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out


class SlicePartition:
    """Seeded partition of the elements of `numels` tensors into `n_slices` slices.

    A slice's indices are generated when a round gathers or scatters it, one tensor at a time, on
    that tensor's device, and dropped after: nothing per parameter is kept (a cached order cost 4
    bytes per parameter, plus 8 transiently: about 10 GiB for an 850M-parameter stage)."""

    def __init__(self, numels: Sequence[int], n_slices: int, seed: int):
        if n_slices <= 0:
            raise ValueError(f"n_slices must be positive, got {n_slices}")
        if any(n < 0 for n in numels):
            raise ValueError("tensor sizes must be non-negative")
        self.numels = tuple(int(n) for n in numels)
        self.n_slices = n_slices
        self.seed = seed
        # bounds[t][s]: where slice s of tensor t starts in its permutation
        self._bounds = [[(s * n) // n_slices for s in range(n_slices + 1)] for n in self.numels]
        self._permutations = [_SeededPermutation(n, (seed * _SEED_STRIDE + t) % 2**63)
                              for t, n in enumerate(self.numels)]
        self.slice_sizes = tuple(sum(b[s + 1] - b[s] for b in self._bounds) for s in range(n_slices))
        self.buffer_size = max(self.slice_sizes) if self.slice_sizes else 0

    def _indices(self, t: int, slice_index: int, device: torch.device | str = "cpu") -> torch.Tensor:
        bounds = self._bounds[t]
        positions = torch.arange(bounds[slice_index], bounds[slice_index + 1], dtype=torch.int64, device=device)
        return self._permutations[t](positions).sort().values

    def indices(self, slice_index: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Flat indices of slice `slice_index` in each tensor (sorted int64, generated now)."""
        self._check(slice_index)
        return [self._indices(t, slice_index, device) for t in range(len(self.numels))]

    def gather(self, tensors: Sequence[torch.Tensor], slice_index: int) -> torch.Tensor:
        """The slice's values as one flat float32 CPU vector of `buffer_size` (zero padded); each
        tensor's share is picked on its own device."""
        self._check(slice_index)
        self._check_tensors(tensors)
        out = torch.zeros(self.buffer_size, dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for t, tensor in enumerate(tensors):
                index = self._indices(t, slice_index, tensor.device)
                n = index.numel()
                out[offset:offset + n] = tensor.detach().reshape(-1).index_select(0, index).to("cpu", torch.float32)
                offset += n
        return out

    def scatter_add(self, tensors: Sequence[torch.Tensor], slice_index: int, flat: torch.Tensor) -> None:
        """`tensor[slice] += flat` for every tensor, in place (the delta rule's write)."""
        self._write(tensors, slice_index, flat, add=True)

    def scatter(self, tensors: Sequence[torch.Tensor], slice_index: int, flat: torch.Tensor) -> None:
        """`tensor[slice] = flat` for every tensor, in place."""
        self._write(tensors, slice_index, flat, add=False)

    def _write(self, tensors: Sequence[torch.Tensor], slice_index: int, flat: torch.Tensor, add: bool) -> None:
        self._check(slice_index)
        self._check_tensors(tensors)
        self._check_flat(flat)
        offset = 0
        with torch.no_grad():
            for t, tensor in enumerate(tensors):
                view = tensor.detach().view(-1)  # parameters are contiguous; view() refuses a copy
                index = self._indices(t, slice_index, view.device)
                n = index.numel()
                values = flat[offset:offset + n].to(device=view.device, dtype=view.dtype)
                if add:
                    view.index_add_(0, index, values)
                else:
                    view.index_copy_(0, index, values)
                offset += n

    def _check(self, slice_index: int) -> None:
        if not 0 <= slice_index < self.n_slices:
            raise IndexError(f"slice {slice_index} out of range for {self.n_slices} slices")

    def _check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        if tuple(t.numel() for t in tensors) != self.numels:
            raise ValueError("tensors do not match the partition's sizes")

    def _check_flat(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.buffer_size:
            raise ValueError(f"expected a flat vector of {self.buffer_size} values, got shape {tuple(flat.shape)}")


@dataclass(frozen=True)
class RoundDecision:
    round: int | None  # the round to run now, or None
    skipped: int  # rounds that came due and will never run


def next_round(steps: int, every_steps: int, last_round: int, announced: int | None = None) -> RoundDecision:
    """The round to start now: due at local step `steps`, or announced by another replica.

    `last_round` is the last round started (or due at start-up); rounds in between are skipped.
    """
    due = steps // every_steps
    if announced is not None:
        due = max(due, announced)
    if due <= last_round:
        return RoundDecision(None, 0)
    return RoundDecision(due, due - last_round - 1)


def round_slice(round_number: int, n_slices: int) -> int:
    return round_number % n_slices


def peer_weight(samples_since_last_round: int, member: bool) -> float:
    """Averaging weight: samples since the previous round; 0 while syncing (see the module docstring)."""
    if not member:
        return 0.0
    return max(float(samples_since_last_round), MEMBER_WEIGHT_FLOOR)


def max_round_weight(sync: SyncConfig, batch_size: int, local_batch: int | None = None) -> float:
    """The most samples one replica can honestly have trained since its previous round of a key: every
    sample of every global batch (or local batch) in the steps between, twice over for one round it
    missed. The agreed weight cap of dht/robust.py; a round's weight above it is taken as this."""
    per_step = max(batch_size, local_batch or 0)
    rounds_per_key = sync.n_slices if sync.method == "diloco" else 1  # diloco weighs per fragment
    return float(2 * rounds_per_key * sync.every_steps * per_step)


def outer_nesterov_step(averaged_anchor: torch.Tensor, averaged_local: torch.Tensor, momentum: torch.Tensor,
                        lr: float, mu: float) -> torch.Tensor:
    """DiLoCo's outer SGD with Nesterov momentum on the pseudo-gradient `anchor - local`.

    Updates `momentum` in place and returns the new anchor; equals `torch.optim.SGD(nesterov=True)`
    on a parameter at `averaged_anchor` whose gradient is the averaged delta.
    """
    gradient = averaged_anchor - averaged_local
    momentum.mul_(mu).add_(gradient)
    return averaged_anchor - lr * (gradient + mu * momentum)


def averaged_vector_size(sync: SyncConfig, buffer_size: int) -> int:
    """Length of the vector a round averages: the slice, plus what the method carries with it.

    sparta: the slice (and its two Adam moments if `average_optimizer_state`); diloco: the
    fragment's anchor and its local values.
    """
    if sync.method == "diloco":
        return 2 * buffer_size
    return (3 if sync.average_optimizer_state else 1) * buffer_size


def second_moment_offset(sync: SyncConfig, buffer_size: int) -> Optional[int]:
    """Where Adam's second moment (never negative) begins in the averaged vector, or None when it is
    not averaged: sparta with `average_optimizer_state` averages [slice, exp_avg, exp_avg_sq]."""
    return 2 * buffer_size if sync.method == "sparta" and sync.average_optimizer_state else None


def stage_parameter_numels(model: ModelConfig, index: int) -> list[int]:
    """Sizes of a stage's trainable tensors, in the optimizer's order, without allocating them."""
    from agora.pipeline.stages import build_stage

    with torch.device("meta"):  # shapes only: the averager is sized before the stage is built
        stage = build_stage(model, index)
    return [p.numel() for p in stage.parameters() if p.requires_grad]

