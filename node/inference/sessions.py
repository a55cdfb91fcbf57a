"""`SessionTable`: the inference sessions a worker holds for its callers, bounded five ways.

A session is one generation's attention cache on this stage (pipeline/inference.StageCache),
opened by a Prefill and extended by Decodes. Caches cost memory in proportion to their tokens
(`2 * layers * rows * kv_heads * head_dim * 4` bytes per position in fp32), and a caller that
vanishes mid-generation never closes its session, hence the bounds:

- `max_sessions` open at once; opening one more evicts the least recently used session, taken
  fairly among owners (as the forward stash does): the LRU session of the owner holding the
  most, the caller's own when it is one of them. A caller holding at most `max_sessions / n` of
  n callers' sessions loses none to another's flood; whoever floods evicts its own.
- `max_tokens` positions per session, declared at Prefill (the prompt plus what it will
  generate) and refused there when over the worker's limit, so a generation is not cut halfway.
- `ttl_s`: a session idle that long is gone (checked lazily on every access: no timer thread).
- `max_cache_bytes`: what the caches hold in all, the budget the worker's memory plan counts
  (node/inference/options.py). The caller says what a session will hold after its call (the
  engine measures a position's cost); a Prefill or Decode that would take the caches past the
  budget is `SessionsFull` (RESOURCE_EXHAUSTED) and changes nothing: unlike the count, the bytes
  evict nobody, since the session refused is the one asking for more, and a budget shared by
  long sessions would otherwise let one caller's growth cut everyone's generations short. What a
  Prefill replaces (the caller's session of that id) and the session its opening evicts for the
  count are not counted against it: with single-row sessions the default budget refuses none.
- Ownership: a session is bound to the caller that opened it (the credential's peer id, or
  `anonymous@host` under --insecure); anyone else's call for it is refused, and cannot close it.

An evicted, expired or never-opened session is `UnknownSession`, whose message names the
session and says to replay it: the client then replays the session's inputs with a Prefill,
here or on another replica, and generation goes on unchanged.

Pure bookkeeping with an injected clock (tested without sockets, tests/unit/test_inference_sessions.py);
not thread-safe by design: only the worker's compute thread touches it.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Session", "SessionTable", "SessionError", "UnknownSession", "SessionRefused", "SessionsFull",
           "NotSessionOwner", "CACHE_FULL_MARK"]

# In every SessionsFull message: what tells a client that a replica's caches, not its queue, are full.
CACHE_FULL_MARK = "--max-kv-cache-gib"


class SessionError(Exception):
    """A session call that cannot be served; the message is meant for the calling peer."""


class UnknownSession(SessionError):
    """Not held here (never opened, closed, idle past the TTL, or evicted): replay it (NOT_FOUND)."""


class SessionRefused(SessionError):
    """Beyond this worker's per-session bound (OUT_OF_RANGE)."""


class SessionsFull(SessionError):
    """The sessions' caches would pass this worker's budget for them (RESOURCE_EXHAUSTED: retry later,
    or on another replica). `needed`: the bytes they would hold; `budget`: what they may."""

    def __init__(self, message: str, needed: int, budget: int):
        super().__init__(message)
        self.needed, self.budget = needed, budget


class NotSessionOwner(SessionError):
    """Another caller's session (PERMISSION_DENIED)."""


@dataclass
class Session:
    session_id: str
    owner: str
    cache: Any  # pipeline.inference.StageCache
    max_tokens: int  # positions it may hold
    started_step: int  # the worker's optimizer step when it opened
    last_used: float


class SessionTable:
    def __init__(self, max_sessions: int, max_tokens: int, ttl_s: float, *, max_cache_bytes: int | None = None,
                 where: str = "this worker", clock: Callable[[], float] = time.monotonic):
        """`max_cache_bytes` None: the caches' bytes unbounded (until the engine sets the budget)."""
        if max_sessions <= 0 or max_tokens <= 0 or not ttl_s > 0:
            raise ValueError(f"need max_sessions, max_tokens and ttl_s > 0, got {max_sessions}, {max_tokens}, {ttl_s}")
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self.where = where  # "stage 1", for messages
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.evictions: Counter[str] = Counter()  # by reason: "capacity", "ttl"

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def cache_bytes(self) -> int:
        return sum(session.cache.nbytes for session in self._sessions.values())

    def _expire(self, now: float) -> None:
        for session_id in [s.session_id for s in self._sessions.values() if now - s.last_used > self.ttl_s]:
            del self._sessions[session_id]
            self.evictions["ttl"] += 1

    def _unknown(self, session_id: str) -> UnknownSession:
        return UnknownSession(
            f"session {session_id!r} is not open on {self.where} (never opened here, closed, idle over "
            f"{self.ttl_s:g} s, or evicted for room: {self.max_sessions} sessions at most); replay its tokens "
            "with Prefill")

    def _check_owner(self, session: Session, owner: str) -> None:
        if session.owner != owner:
            raise NotSessionOwner(f"session {session.session_id!r} belongs to another caller; only the caller that "
                                  "opened it may use or close it")

    def open(self, session_id: str, owner: str, max_tokens: int, cache: Any, step: int, *,
             cache_bytes: int = 0) -> Session:
        """A new session (`max_tokens` 0: this worker's limit), replacing the caller's own of that id;
        evicts to make room (see the module docstring). `cache_bytes`: what it will hold after its
        first call; SessionsFull, nothing changed, when that passes the budget."""
        if max_tokens > self.max_tokens:
            raise SessionRefused(f"max_tokens: {max_tokens} positions, {self.where} holds at most {self.max_tokens} "
                                 "per session (--max-session-tokens)")
        now = self._clock()
        self._expire(now)
        existing = self._sessions.get(session_id)
        if existing is not None:
            self._check_owner(existing, owner)
        victim = self._victim_for(owner) if existing is None and len(self._sessions) >= self.max_sessions else None
        leaving = [s for s in (existing, victim) if s is not None]
        self._check_cache(session_id, cache_bytes, self.cache_bytes - sum(s.cache.nbytes for s in leaving))
        if existing is not None:
            del self._sessions[session_id]  # a replay: the caller starts it again
        if victim is not None:
            del self._sessions[victim.session_id]
            self.evictions["capacity"] += 1
        session = Session(session_id, owner, cache, max_tokens or self.max_tokens, step, now)
        self._sessions[session_id] = session
        return session

    def _victim_for(self, owner: str) -> Session:
        held = Counter(session.owner for session in self._sessions.values())
        most = max(held.values())
        victim_owner = owner if held.get(owner, 0) == most else next(o for o, n in held.items() if n == most)
        return next(s for s in self._sessions.values() if s.owner == victim_owner)  # its least recently used

    def _check_cache(self, session_id: str, cache_bytes: int, others: int) -> None:
        """SessionsFull when `others` bytes held by the sessions staying plus the session's `cache_bytes`
        pass the budget."""
        needed, budget = others + cache_bytes, self.max_cache_bytes
        if budget is not None and needed > budget:
            raise SessionsFull(
                f"session {session_id!r} would take the attention caches on {self.where} to {needed:,} bytes, past "
                f"the {budget:,} this worker allows them ({CACHE_FULL_MARK}); the open sessions keep theirs: retry "
                "once one ends, or on another replica", needed, budget)

    def get(self, session_id: str, owner: str) -> Session:
        """The caller's open session, now the most recently used; UnknownSession / NotSessionOwner."""
        now = self._clock()
        self._expire(now)
        session = self._sessions.get(session_id)
        if session is None:
            raise self._unknown(session_id)
        self._check_owner(session, owner)
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return session

    def check_room(self, session: Session, position: int, new_tokens: int, *, cache_bytes: int = 0) -> None:
        """SessionRefused when `new_tokens` after `position` pass the session's declared bound;
        SessionsFull when the session holding `cache_bytes` after the call passes the budget."""
        if position + new_tokens > session.max_tokens:
            raise SessionRefused(f"tokens: positions up to {position + new_tokens} exceed the {session.max_tokens} "
                                 f"this session declared at Prefill (max_tokens) on {self.where}")
        self._check_cache(session.session_id, cache_bytes, self.cache_bytes - session.cache.nbytes)

    def close(self, session_id: str, owner: str) -> bool:
        """Drop the caller's session; False when it is not held (closing twice is fine)."""
        self._expire(self._clock())
        session = self._sessions.get(session_id)
        if session is None:
            return False
        self._check_owner(session, owner)
        del self._sessions[session_id]
        return True

    def drop(self, session_id: str) -> None:
        """Forget a session whatever its owner (its first call failed before it held anything)."""
        self._sessions.pop(session_id, None)
