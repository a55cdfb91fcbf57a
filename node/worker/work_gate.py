"""`WorkGate`: where a worker asks who holds a unit (node/worker/unit_holders.py) before it takes
the unit's work or report, and what it answers.

- A training Forward names its unit in its work key; one that names none the run can have is
  INVALID_ARGUMENT. A completed-batch report names its unit as the batch. Evaluation Forwards add
  no gradient and are not asked about.
- The tail adds a Forward's gradient in the Forward itself, so it waits for the check first. A
  head or body adds it only at the microbatch's Backward, so there the check runs while the Forward
  computes and the stages after it work, and the Backward waits for its outcome before anything
  is applied: a unit's first microbatch does not wait on the DHT at every stage in turn. The checks
  in flight are kept per caller and microbatch, bounded (`PendingChecks`); a Backward whose check
  is not there (dropped, or the worker restarted) is refused and rerun, never let through unchecked.
- A caller that does not hold the unit gets PERMISSION_DENIED naming the unit and its holder,
  counted as `not_unit_holder` (`agora_worker_refusals_total`), and a `work_of_unit_not_held`
  milestone the first time that caller does it; a DHT that does not answer is UNAVAILABLE
  (`lease_unavailable`): nothing is decided, the trainer tries again or elsewhere.
- Without caller identities (``--insecure``) nothing is asked: there is no one to bind a unit to.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Awaitable, Optional

import grpc

from agora.node.rpc.auth_check import Caller, RefusalCounts
from agora.node.worker.unit_holders import LeaseUnavailable, UnitHolders, WorkRefused, unit_of_forward
from agora.protos.stage_adapter import UNIT_NOT_HELD_METADATA, BackwardRequest, ForwardRequest, StageRefusal

__all__ = ["PendingChecks", "WorkGate"]

# Callers whose first refusal is a milestone line (beyond it, the rest are logged at debug).
_MAX_LOGGED_CALLERS = 1024


class WorkGate:
    """The lease check of one worker's calls (see the module docstring)."""

    def __init__(self, holders: UnitHolders, *, stage: int, microbatches: int, is_tail: bool, per_caller: int,
                 refusals: RefusalCounts, logger: logging.Logger):
        self.holders = holders
        self.stage = stage
        self.microbatches = microbatches
        self.is_tail = is_tail
        self.refusals = refusals
        self._logger = logger
        self._pending = PendingChecks(per_caller)
        self._logged: set[str] = set()

    async def admit(self, caller: Caller, request: ForwardRequest | BackwardRequest) -> None:
        """A Forward's unit must be its caller's (checked now on the tail, alongside on a head or body);
        a Backward waits for its Forward's check."""
        if caller.anonymous:
            return
        if isinstance(request, BackwardRequest):
            check = self._pending.take(caller.owner, request.microbatch_id)
            if check is None:
                raise self._refused(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"no lease check of microbatch {request.microbatch_id!r}'s Forward is held here "
                                    "(too many pending, or the worker restarted): rerun the microbatch",
                                    "unchecked_backward")
            await check
            return
        if request.evaluate:
            return
        try:
            unit = unit_of_forward(request.work_key, self.microbatches)
        except WorkRefused as error:
            raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, str(error), "bad_work_key") from None
        if self.is_tail:
            await self.check_unit(caller, unit)
        else:
            self._pending.start(caller.owner, request.microbatch_id, self.check_unit(caller, unit))

    async def check_unit(self, caller: Caller, unit: int) -> None:
        """Work or a report of `unit` from `caller`: refused unless the caller holds the unit."""
        if caller.anonymous:
            return
        try:
            await self.holders.check(unit, caller.owner)
        except WorkRefused as error:
            if error.malformed:
                raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, str(error), "bad_work_key") from None
            self._log_refusal(caller.owner, unit, str(error))
            raise self._refused(grpc.StatusCode.PERMISSION_DENIED, str(error), "not_unit_holder",
                                ((UNIT_NOT_HELD_METADATA, str(unit)),)) from None
        except LeaseUnavailable as error:
            raise self._refused(grpc.StatusCode.UNAVAILABLE, str(error), "lease_unavailable") from None

    def aborted(self, caller: Optional[Caller], microbatch_id: str) -> None:
        """The microbatch was abandoned: its Backward will not come."""
        if caller is not None:
            check = self._pending.take(caller.owner, microbatch_id)
            if check is not None:
                check.cancel()

    async def close(self) -> None:
        self._pending.close()
        await self.holders.close()
        self._logger.info("stage %d unit lease checks: %s", self.stage, self.holders.summary())

    def _refused(self, code: grpc.StatusCode, message: str, reason: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> StageRefusal:
        self.refusals.add(reason)
        return StageRefusal(code, message, trailing_metadata)

    def _log_refusal(self, caller: str, unit: int, message: str) -> None:
        """A milestone the first time a caller sends work of a unit it does not hold, debug after."""
        first = caller not in self._logged
        if first and len(self._logged) < _MAX_LOGGED_CALLERS:
            self._logged.add(caller)
        self._logger.log(logging.WARNING if first else logging.DEBUG, "stage %d: refused: %s", self.stage, message,
                         extra={"milestone": "work_of_unit_not_held",
                                "fields": {"stage": self.stage, "caller": caller, "unit": unit}})


class PendingChecks:
    """Checks of head and body Forwards still running, by caller and microbatch id, for their Backward
    to wait on. Each caller keeps at most `per_caller` (its oldest dropped:
    a flood of one trainer's Forwards drops its own checks, never another's), and at most
    `max_callers` callers are kept (the least recently heard from dropped)."""

    def __init__(self, per_caller: int, max_callers: int = 1024):
        self.per_caller = max(1, per_caller)
        self.max_callers = max(1, max_callers)
        self._checks: OrderedDict[str, OrderedDict[str, asyncio.Future]] = OrderedDict()

    def start(self, caller: str, microbatch_id: str, check: Awaitable[None]) -> None:
        future = asyncio.ensure_future(check)
        future.add_done_callback(_retrieved)  # an outcome nobody waits for (no Backward came) is no error
        own = self._checks.setdefault(caller, OrderedDict())
        self._checks.move_to_end(caller)
        _cancel(own.pop(microbatch_id, None))
        own[microbatch_id] = future
        while len(own) > self.per_caller:
            _cancel(own.popitem(last=False)[1])
        while len(self._checks) > self.max_callers:
            for dropped in self._checks.popitem(last=False)[1].values():
                _cancel(dropped)

    def take(self, caller: str, microbatch_id: str) -> Optional[asyncio.Future]:
        """The check of this microbatch's Forward (None: there was none, or it was dropped)."""
        own = self._checks.get(caller)
        return None if own is None else own.pop(microbatch_id, None)

    def close(self) -> None:
        for own in self._checks.values():
            for future in own.values():
                future.cancel()
        self._checks.clear()


def _cancel(future: Optional[asyncio.Future]) -> None:
    if future is not None:
        future.cancel()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
