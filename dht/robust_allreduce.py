"""The robust rules of dht/robust.py inside hivemind's butterfly all-reduce, on both of its sides.

hivemind's ``AllReduceRunner`` splits the averaged vector into parts, each reduced by one peer of
the group: every sender streams its values of a part to that part's reducer, which averages them
(``TensorPartReducer``: a weighted mean, each message carrying the weight its sender declares)
and streams the average back. Two seams, one per side, and nothing else of hivemind's changes:

- ``RobustPartReducer`` takes the place of ``TensorPartReducer`` (same interface: parts in order,
  a part done when every sender still in the round has sent it, a failed sender's later parts
  not waited for). It keeps the senders' values of the current part instead of a running sum
  and combines them with ``aggregate_part`` under the weights *agreed* from the gathered
  metadata (``agreed_group``); the weight field of each message is ignored. It tells
  ``aggregate_part`` where in the part the policy's non-negative section (``exp_avg_sq``) begins.
- ``GuardedPartContainer`` wraps the runner's ``TensorPartContainer`` and judges every average
  another reducer sends back before it is registered: a move beyond the bound
  (``DeviationHistory``) or a non-finite one is dropped and the part keeps its local values,
  exactly as for a reducer that failed (it counts in the round's received fraction); an accepted
  one has each coordinate's move bounded as a pair's is (``coordinate_move_bound``), so a reducer
  cannot spend the whole norm bound on one coordinate either.
- Clipped coordinates, by the reducer and by the guard, are summed in ``clipped_coordinates``,
  apart from the rejections by reason.
- ``agreed_group`` also makes the part split independent of what peers declare: every
  member's declared bandwidth is replaced by the same value before hivemind's load balancing,
  so a peer cannot claim the whole vector to reduce by declaring a huge bandwidth. All honest
  members rewrite alike, so they still agree on who reduces what.

The averaged vector is one flat float32 tensor without compression (dht/averaging.py averages
nothing else), so a part's position and its local values follow from the part size alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from typing import Any, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.utils.serializer import MSGPackSerializer

from agora.dht.records import Phase
from agora.dht.robust import (
    DeviationHistory,
    RobustAggregation,
    aggregate_part,
    agreed_weights,
    clip_offset,
    coordinate_move_bound,
    deviation,
    relative_move,
)

__all__ = ["AgreedGroup", "agreed_group", "RobustAllReduceRunner", "RobustPartReducer", "GuardedPartContainer",
           "nonnegative_in_part"]

logger = logging.getLogger(__name__)

# A receiver with less of the round's weight than this lags its group (it trained on next to
# nothing, or syncs): the group's average is judged by the ceiling alone, not by its own history.
_LOW_SHARE = 0.01


class AgreedGroup:
    """What every member derives alike from a group's gathered metadata."""

    def __init__(self, group_info: GroupInfo, weights: dict[Any, float], counts: Counter):
        self.group_info = group_info  # with the bandwidths made equal
        self.weights = weights  # by peer id
        self.counts = counts  # weight reasons (syncing, weight_capped, nonfinite)


def agreed_group(group_info: GroupInfo, policy: RobustAggregation) -> AgreedGroup:
    """Agreed weights (dht/robust.py) from each member's gathered ``weight`` and ``phase``, and the group
    with every declared bandwidth replaced by hivemind's default (split by equal shares)."""
    declared, members, gathered = [], [], []
    for entry in group_info.gathered:
        try:
            bandwidth, mode, user_bytes = MSGPackSerializer.loads(entry)
            user = MSGPackSerializer.loads(user_bytes)
            weight = user.get("weight", 0.0) if isinstance(user, dict) else 0.0
            phase = user.get("phase", Phase.MEMBER) if isinstance(user, dict) else None
        except Exception:  # noqa: BLE001 - a peer's bytes: anything unreadable counts 0
            declared.append(0.0)
            members.append(False)
            gathered.append(entry)
            continue
        declared.append(weight if isinstance(weight, (int, float)) else math.nan)
        members.append(phase == Phase.MEMBER)
        gathered.append(MSGPackSerializer.dumps([None, mode, user_bytes]) if policy.robust else entry)
    weights, counts = agreed_weights(declared, members, policy)
    equalised = GroupInfo(group_id=group_info.group_id, peer_ids=group_info.peer_ids, gathered=tuple(gathered))
    return AgreedGroup(equalised, dict(zip(group_info.peer_ids, weights)), counts)


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's runner with ``RobustPartReducer`` and ``GuardedPartContainer`` put in (see the
    module docstring); everything else, the protocol included, is hivemind's."""

    def __init__(self, *, agreed: AgreedGroup, policy: RobustAggregation, history: DeviationHistory,
                 part_size_bytes: int, **kwargs: Any):
        super().__init__(part_size_bytes=part_size_bytes, **kwargs)
        self.counts: Counter = Counter(agreed.counts)
        self.clipped = Counter()  # "coordinates": clipped by this peer's reducer and guard
        self.weight = agreed.weights.get(self.peer_id, 0.0)
        tensors = kwargs["tensors"]
        if len(tensors) != 1 or tensors[0].dtype != torch.float32:
            raise ValueError("the robust all-reduce averages exactly one flat float32 tensor")
        flat = tensors[0].view(-1)
        part_numel = int(part_size_bytes / flat.element_size())
        container = self.tensor_part_container
        if sum(container.num_parts_by_peer) != math.ceil(flat.numel() / part_numel):
            raise ValueError("hivemind's part split no longer matches the part size: the guards cannot place parts")
        offsets = [0]
        for parts in container.num_parts_by_peer:
            offsets.append(offsets[-1] + parts)
        own_index = self.ordered_peer_ids.index(self.peer_id)
        total = sum(agreed.weights.values())
        self.tensor_part_container = GuardedPartContainer(
            container, local=flat, part_numel=part_numel, offsets=offsets, own_index=own_index,
            peer_ids=self.ordered_peer_ids, history=history, counts=self.counts, clipped=self.clipped,
            policy=policy, own_share=self.weight / total if total > 0 else 0.0)
        hivemind_reducer = self.tensor_part_reducer
        hivemind_reducer.finished.set()  # retired unused: its finalize would report 0% received
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
            weights=[agreed.weights.get(peer, 0.0) for peer in self.sender_peer_ids],
            own_sender=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
            sender_names=[str(peer) for peer in self.sender_peer_ids], first_position=offsets[own_index],
            part_numel=part_numel, policy=policy, history=history, counts=self.counts, clipped=self.clipped)

    @property
    def clipped_coordinates(self) -> int:
        return self.clipped["coordinates"]


class RobustPartReducer:
    """Reduces this peer's parts with ``aggregate_part``; the interface of hivemind's reducer."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, weights: Sequence[float],
                 own_sender: Optional[int], sender_names: Sequence[str], first_position: int, part_numel: int,
                 policy: RobustAggregation, history: DeviationHistory, counts: Counter, clipped: Counter):
        self.part_shapes, self.num_senders, self.num_parts = tuple(part_shapes), num_senders, len(part_shapes)
        self.weights, self.own_sender, self.sender_names = list(weights), own_sender, list(sender_names)
        self.first_position, self.policy, self.history, self.counts = first_position, policy, history, counts
        self.part_numel, self.clipped = part_numel, clipped
        self.current_part_index = 0
        self.num_parts_received = [0] * num_senders
        self.sender_failed_after = [math.inf] * num_senders
        self.finished = asyncio.Event()
        self._values: dict[int, torch.Tensor] = {}  # sender -> its values of the current part
        self._future: asyncio.Future = asyncio.get_event_loop().create_future()
        if self.num_parts == 0:
            self.finalize()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """Hand in a sender's values of a part (``weight`` is ignored: weights are agreed); wait for
        the part's result."""
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"sender {sender_index} sent part {part_index} of {self.num_parts}")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            waiter = asyncio.ensure_future(self.finished.wait())
            await asyncio.wait({self._future, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if self.finished.is_set():
                raise AllreduceException("aggregated a part after the reducer finished")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.current_part_index or self.finished.is_set():
            raise AllreduceException(f"sender {sender_index} sent part {part_index} out of order")
        future = self._future
        if tensor_part.shape != self.part_shapes[part_index]:
            raise AllreduceException(f"sender {sender_index} sent part {part_index} of shape "
                                     f"{tuple(tensor_part.shape)}, expected {tuple(self.part_shapes[part_index])}")
        self._values[sender_index] = tensor_part
        self._finish_part_if_complete()
        return await future

    def on_sender_failed(self, sender_index: int) -> None:
        """A sender left: parts it has not handed in are no longer waited for."""
        self.sender_failed_after[sender_index] = self.num_parts_received[sender_index]
        if not self.finished.is_set():
            self._finish_part_if_complete()

    def _finish_part_if_complete(self) -> None:
        index = self.current_part_index
        expected = [s for s in range(self.num_senders) if index < self.sender_failed_after[s]]
        if any(s not in self._values for s in expected):
            return
        senders = expected
        position = self.first_position + index
        if senders:
            own = senders.index(self.own_sender) if self.own_sender in senders else None
            result = aggregate_part([self._values[s] for s in senders], [self.weights[s] for s in senders],
                                    self.policy, own=own, bound=self.history.bound(position),
                                    nonnegative_from=nonnegative_in_part(self.policy.nonnegative_from, position,
                                                                         self.part_numel))
            self.counts.update(result.counts)
            self.clipped["coordinates"] += result.clipped_coordinates
            for sender, verdict, coordinates in zip(senders, result.verdicts, result.coordinates):
                if verdict in ("outlier", "clipped", "nonfinite"):
                    logger.info("averaging part %d: %s from %s", position, verdict, self.sender_names[sender])
                if coordinates:
                    logger.info("averaging part %d: %d coordinates from %s clipped to their band", position,
                                coordinates, self.sender_names[sender])
            value = result.value
        else:  # nobody is left to send this part: it is nobody's any more
            value = torch.full(self.part_shapes[index], math.nan)
        self._values = {}
        future, self._future = self._future, asyncio.get_event_loop().create_future()
        self.current_part_index += 1
        if self.current_part_index >= self.num_parts:
            self.finished.set()
        future.set_result(value)

    def finalize(self) -> None:
        if not self.finished.is_set():
            self._future.cancel()
            self.finished.set()


def nonnegative_in_part(nonnegative_from: Optional[int], position: int, part_numel: int) -> Optional[int]:
    """Where the averaged vector's non-negative section (from its flat offset ``nonnegative_from``)
    begins in the part at ``position``: 0 for a part inside it, None for a part before it."""
    if nonnegative_from is None or nonnegative_from >= (position + 1) * part_numel:
        return None
    return max(0, nonnegative_from - position * part_numel)


class GuardedPartContainer:
    """hivemind's ``TensorPartContainer`` with every average another reducer returns judged first."""

    def __init__(self, inner: Any, *, local: torch.Tensor, part_numel: int, offsets: Sequence[int], own_index: int,
                 peer_ids: Sequence[Any], history: DeviationHistory, counts: Counter, clipped: Counter,
                 policy: RobustAggregation, own_share: float):
        self._inner, self._local, self._part_numel, self._own_share = inner, local, part_numel, own_share
        self._offsets, self._own_index, self._peer_ids = list(offsets), own_index, list(peer_ids)
        self._history, self._counts, self._clipped, self._policy = history, counts, clipped, policy

    def __getattr__(self, name: str) -> Any:  # everything but the registration is hivemind's
        return getattr(self._inner, name)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        position = self._offsets[peer_index] + part_index
        start = position * self._part_numel
        local = self._local[start:start + part.numel()]
        distance = deviation(relative_move(part, local), self._own_share)
        trusted_history = self._own_share >= _LOW_SHARE
        bound = self._history.bound(position) if trusted_history else self._policy.max_relative_delta
        if peer_index == self._own_index or not self._policy.robust:
            self._history.record(position, distance)  # this peer's own reducer is honest to it
        elif not self._history.accept(position, distance, trusted_history=trusted_history):
            self._counts["reducer_outlier"] += 1
            logger.info("averaging part %d: the average from %s puts the group %.3g of its norm away (bound %.3g): "
                        "kept local values", position, self._peer_ids[peer_index], distance,
                        self._history.bound(position))
            part = torch.zeros_like(part)
            self._inner.failed_size += part.numel()
        else:
            per_coordinate = coordinate_move_bound(local, bound, self._policy)
            part, clipped = clip_offset(part, per_coordinate)
            if clipped:
                self._clipped["coordinates"] += clipped
                logger.info("averaging part %d: %d coordinates of the average from %s clipped to the move bound",
                            position, clipped, self._peer_ids[peer_index])
        self._inner.register_processed_part(peer_index, part_index, part)

