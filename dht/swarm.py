"""SwarmDHT: the one owner of the hivemind DHT process, with typed reads and writes.

The process itself (started, watched, stopped) is dht/dht_process.py's, and what a read makes
of the values it found (parsed, believed, or skipped and counted) is dht/entry_reader.py's; this
module sends the requests and keeps the bookkeeping of what this peer wrote.

Design choices:

- hivemind runs its DHT node in a forked process and answers through ``MPFuture``s.
  Every such future is created and resolved in this module, with a timeout; callers get
  plain values or one exception type, ``DHTRequestError``. Blocking methods suit
  threads and scripts; each has an ``*_async`` twin (dht/swarm_async.py) that runs it in a
  thread (``asyncio.to_thread``) so an event loop never blocks on the DHT.
- Requests go down one pipe to the DHT process; ``multiprocessing.Connection.send``
  is not safe from several threads at once, so sends are serialized by a lock (waiting
  for the answer happens outside it).
- A stage's workers share one key, ``{run_id}.stage{i}.workers``, each under its own
  subkey, so a worker's announce never overwrites another's. With admission on
  (``start(security=...)``, dht/security.py) the DHT process runs hivemind's token
  authorizer and record validators, and a subkey is ``<peer id>[owner:<node key>]``: only
  this node can write or tombstone its entries, and the peer id is its credential's (the
  libp2p identity is the node key). Without it (``--insecure``) subkeys are bare peer ids,
  exactly as before admission existed.
- hivemind cannot delete. A store wins only if its expiration is *later* than the one
  held, and a store whose expiration is already past is refused. So withdrawing writes a
  tombstone (``None``) whose expiration is just after the withdrawn entry's; readers skip
  tombstones (``EntryReader``). To make this (and re-announcing after a withdraw) always win, every
  expiration this peer writes to an entry is strictly later than the last one it wrote.
- Reads of a key with subkeys alternate: a latest read over ``READ_BEAM`` peers (8: hivemind stores
  a value on the 5 nearest, every writer re-stores its entry each heartbeat, so 8 holds them with
  room for peers that joined nearer since; hivemind's default of 20 made every node serve every
  read: bench/idle_cpu.py), then a quick one that stops at the first holder as new as what this peer
  saw, each answer merged into what the earlier ones returned: dht/reads.py says why and what a quick
  read can miss (an entry new to this peer, for one read). Plain keys are always read latest.
- A store searches for its key's nearest peers without being sent the key's value (hivemind's search
  is answered with the whole dictionary by every holder it asks): dht/stores.py.
- The run's ban list (dht/bans.py) is read at most once per ``ban_refresh_s`` (``BAN_REFRESH_S``;
  a bench that stretches time stretches it too), or a heartbeat, which asks for it each beat, with
  one get in the DHT process, which also hands it to that process's validators; readers then skip
  a banned peer's entries like any other they do not believe, whatever their expiry, and ``bans``
  answers the node's other checks.
- The clock is injectable (default ``hivemind.utils.get_dht_time``) and is used for the
  expirations this peer writes and to drop entries that expired by its reading. It must
  stay within a few seconds of DHT time: hivemind's own storage prunes and refuses by
  the real clock.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, TypeVar

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.bans import BAN_REFRESH_S, BanList, NodeBans, fetch_ban_list
from agora.dht.dht_process import (READ_BEAM, OwnedDHT, node_caches_locally, node_client_mode, node_peer_id,
                                   node_visible_maddrs, stop_process)
from agora.dht.entry_traffic import dht_traffic
from agora.dht.entry_reader import EntryReader, Stored, is_subkey_dict
from agora.dht.changed_finds import Seen, attach as attach_changed_finds
from agora.dht.holder_reads import read_entry
from agora.dht.keys import check_run_id, owned_subkey, worker_key
from agora.dht.op_timings import RequestTimings, key_family
from agora.dht.ownership import EntryOwnership
from agora.dht.reads import CACHE_OPTIONS, ReadMemory
from agora.dht.records import Record, WorkerRecord
from agora.dht.stores import store_entry
from agora.dht.swarm_async import AsyncTwins
from agora.dht.token_authorizer import use_peer_stubs

if TYPE_CHECKING:
    from agora.dht.security import DHTSecurity
    from agora.pipeline.fingerprint import RunFingerprint

__all__ = [
    "DEFAULT_HOST_MADDRS",
    "Clock",
    "DHTRequestError",
    "SwarmDHT",
]

logger = logging.getLogger(__name__)
# What hivemind says when no initial peer answered: its bootstrap ping, or p2pd's own dial.
_NO_ANSWER = ("none of the initial_peers responded", "failed to connect to bootstrap peers")

Clock = Callable[[], float]
R = TypeVar("R", bound=Record)

DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
# Each write to an entry expires at least this much later than the previous one (see above).
_EXPIRATION_STEP = 1e-3
# Bounds on per-instance bookkeeping, so a long-lived peer's memory stays flat.
_MAX_TRACKED_ENTRIES = 4096


class DHTRequestError(RuntimeError):
    """A DHT request failed: timed out, the DHT process is gone, or hivemind raised."""


class SwarmDHT(AsyncTwins):
    """Typed access to one hivemind DHT peer. Create with ``SwarmDHT.start(...)``.

    Wrapping an already started ``hivemind.DHT`` through the constructor hands it over:
    ``shutdown()`` shuts it down. ``owner_public_key`` (OpenSSH text of the node key, which
    the DHT's ``RSASignatureValidator`` signs with) turns on owned subkeys and makes readers
    skip unsigned entries; ``start(security=...)`` sets it.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        clock: Clock = get_dht_time,
        request_timeout: float = 10.0,
        owner_public_key: Optional[str] = None,
    ) -> None:
        self._dht = dht
        self._owner_public_key = owner_public_key
        self._clock = clock
        self.request_timeout = request_timeout
        self._send_lock = threading.Lock()
        self._closed = False
        # (key, subkey) -> latest expiration this peer wrote there; see the module docstring.
        self._written: dict[tuple[str, Optional[str]], float] = {}
        self.timings = RequestTimings()  # every request's latency, by operation and key family
        self.bans = NodeBans()  # the run's ban list, as this peer's DHT process last read it
        # How old that list may be when a read checks entries against it (read again first if older).
        self.ban_refresh_s = BAN_REFRESH_S
        self._reader = EntryReader(clock=clock, ownership=EntryOwnership(require_owner=owner_public_key is not None),
                                   bans=self.bans)
        self._peer_id: str = self._run_coroutine(node_peer_id, "peer id")
        self._run_coroutine(use_peer_stubs, "peer stubs")  # tokens made for their peer (dht/token_authorizer.py)
        self._run_coroutine(attach_changed_finds, "changed finds")  # reads answered with changes (dht/changed_finds.py)
        # A client-mode peer serves nothing, so its own storage counts for no reader: its
        # writes go to serving peers only, and "accepted" means one of them took it.
        self._client_mode: bool = self._run_coroutine(node_client_mode, "client mode")
        # Quick reads need hivemind's local cache off (``start`` turns it off): it would answer them alone.
        self._quick_reads = not self._run_coroutine(node_caches_locally, "cache option")
        self._memory = ReadMemory(clock)  # what reads of each key with subkeys returned (dht/reads.py)

    @classmethod
    def start(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        announce_maddrs: Optional[Sequence[str]] = None,
        identity_path: Optional[str] = None,
        client_mode: bool = False,
        record_validators: Iterable[Any] = (),
        security: Optional[DHTSecurity] = None,
        clock: Clock = get_dht_time,
        request_timeout: float = 10.0,
        startup_timeout: float = 30.0,
        join_attempts: int = 3,
        **dht_kwargs: Any,
    ) -> SwarmDHT:
        """Start a DHT peer: a new swarm if ``initial_peers`` is empty, else join through them.

        Start it before creating gRPC servers or torch threads: hivemind forks its process.
        ``record_validators`` (hivemind ``RecordValidatorBase``) and ``dht_kwargs`` pass
        through to ``hivemind.DHT``; hivemind's local cache is off unless they turn it on (then
        every read is a full one: dht/reads.py). ``security`` (``agora.dht.security.DHTSecurity``) is the
        node's admission: identity, token authorizer, signed and checked records; None is
        ``--insecure``. Failing to join raises ``DHTRequestError`` (so does joining an admitted
        swarm without a credential it accepts: nobody answers). hivemind pings the initial peers
        once, with a 3 s deadline for the dial, the handshake and the token check together (and p2pd
        dials them once before that); a busy peer (a loaded machine, a slow link) misses it, so a
        join none of them answered, or a peer that did not come up within ``startup_timeout`` (its
        process and p2pd starting on a busy machine), is tried ``join_attempts`` times in all, 2 s
        and then 4 s apart, saying so each time.
        """
        options = {**CACHE_OPTIONS, **dht_kwargs}
        validators = list(record_validators)
        if announce_maddrs:
            options["announce_maddrs"] = list(announce_maddrs)
        if security is not None:
            # A read-only credential (monitor) serves nothing: its stores are refused anyway.
            client_mode = client_mode or not security.may_store
            if identity_path is not None:
                raise ValueError("identity_path: the node's state directory holds its identity; give one or the other")
            secured = security.hivemind_options()
            validators += secured.pop("record_validators")
            options.update(secured)
        elif identity_path is not None:
            options["identity_path"] = identity_path
        for attempt in itertools.count(1):  # every pass returns, raises or waits for the next
            dht = OwnedDHT(
                initial_peers=list(initial_peers) or None,
                start=False,
                host_maddrs=list(host_maddrs),
                client_mode=client_mode,
                record_validators=validators,
                **options,
            )
            try:
                dht.run_in_background(await_ready=True, timeout=startup_timeout)
                swarm = cls(dht, clock=clock, request_timeout=request_timeout,
                            owner_public_key=None if security is None else security.owner_public_key)
                if security is not None and swarm.peer_id != security.peer_id:
                    raise DHTRequestError(f"the DHT peer id {swarm.peer_id} is not the credential's {security.peer_id}")
                return swarm
            except BaseException as error:
                stop_process(dht)
                if not isinstance(error, Exception):
                    raise
                unanswered = bool(initial_peers) and any(words in str(error) for words in _NO_ANSWER)
                slow = isinstance(error, TimeoutError)
                if not (unanswered or slow) or attempt >= join_attempts:
                    if slow:
                        hint = f"it did not come up within {startup_timeout:g} s (startup_timeout)"
                    elif unanswered:
                        hint = (" (nobody answered: the initial peers are down or unreachable from here, or they "
                                "do not admit this node's credential)")
                    else:
                        hint = ""
                    raise DHTRequestError(f"DHT peer failed to start: {error}{hint}") from error
                pause = 2.0 * attempt
                if slow:
                    logger.warning("the DHT peer did not come up within %g s (attempt %d of %d); trying again in %.0f s",
                                   startup_timeout, attempt, join_attempts, pause)
                else:
                    logger.warning("none of the %d initial peers answered (attempt %d of %d); trying again in %.0f s",
                                   len(initial_peers), attempt, join_attempts, pause)
                time.sleep(pause)

    # ---- identity and lifecycle -------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """This peer's libp2p id (base58), the natural subkey for its own entries."""
        return self._peer_id

    @property
    def secured(self) -> bool:
        """Whether entries are owned and signed (admission on), i.e. not ``--insecure``."""
        return self._owner_public_key is not None

    def subkey_of(self, peer_id: str) -> str:
        """The subkey this peer writes an entry of ``peer_id`` under (only its own is accepted
        when secured: the owner key must be the key of that peer id)."""
        if self._owner_public_key is None:
            return peer_id
        return owned_subkey(peer_id, self._owner_public_key)

    @property
    def hivemind_dht(self) -> hivemind.DHT:
        """The wrapped ``hivemind.DHT``, only for hivemind classes that take one (the averager)."""
        return self._dht

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Whether the DHT process is running and not shut down."""
        return not self._closed and self._dht.is_alive()

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with ``/p2p/<peer id>``) that other peers pass as initial peers."""
        return self._run_coroutine(node_visible_maddrs, "visible multiaddrs")

    def shutdown(self) -> None:
        """Stop the DHT process and its p2pd. Idempotent; later requests raise."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        stop_process(self._dht)

    def __enter__(self) -> SwarmDHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"SwarmDHT(peer_id={self._peer_id!r}, {state})"

    # ---- workers ------------------------------------------------------------------------

    def announce_worker(self, record: WorkerRecord, ttl: float) -> bool:
        """Store ``record`` under its stage's key, subkey = ``subkey_of(record.peer_id)``, for
        ``ttl`` seconds.

        Returns False if no DHT peer accepted it (it held a later expiration, or, secured, the
        record is not this node's).
        """
        key = worker_key(record.run_id, record.stage)
        return self.store(key, record, ttl, subkey=self.subkey_of(record.peer_id))

    def live_workers(
        self, run_id: str, stage: int, *, latest: bool = True, fingerprint: Optional[RunFingerprint] = None
    ) -> list[WorkerRecord]:
        """Valid, unexpired, not withdrawn workers of one stage, sorted by peer id.

        With ``fingerprint`` (this reader's run fingerprint), workers announcing another one
        are skipped and counted; the first skip of each is logged naming the differing field.
        """
        key = worker_key(run_id, stage)
        entries = self.owned_entries(key, WorkerRecord, latest=latest)
        return self._reader.workers(key, entries, run_id, stage, fingerprint)

    def all_workers(
        self, run_id: str, n_stages: int, *, latest: bool = True, fingerprint: Optional[RunFingerprint] = None
    ) -> dict[int, list[WorkerRecord]]:
        """``live_workers`` of every stage in ``range(n_stages)`` (empty stages included).

        The stages are looked up concurrently inside the DHT process, each get timed into ``timings``
        from its send to its own answer (not to when this thread got to it).
        """
        check_run_id(run_id)
        keys = [worker_key(run_id, stage) for stage in range(n_stages)]
        deadline = time.monotonic() + self.request_timeout
        futures = [self._timed(self._submit(self._dict_get(key, latest)), "get", key_family(key)) for key in keys]
        found = [self._remember(key, latest, self._wait(future, f"get {key!r}", deadline))
                 for key, future in zip(keys, futures)]
        result: dict[int, list[WorkerRecord]] = {}
        for stage, (key, value) in enumerate(zip(keys, found)):
            entries = self._owned(key, self._reader.entries(key, value, WorkerRecord))
            result[stage] = self._reader.workers(key, entries, run_id, stage, fingerprint)
        return result

    def withdraw(self, run_id: str, stage: int, peer_id: str) -> bool:
        """Make a worker's entry disappear for every reader now (tombstone, see module doc).
        Secured, only this node's own entry can be withdrawn."""
        return self.delete(worker_key(run_id, stage), subkey=self.subkey_of(peer_id))

    # ---- the ban list ---------------------------------------------------------------------

    def refresh_bans(self, max_age_s: float = BAN_REFRESH_S) -> Optional[BanList]:
        """The run's newest ban list (``self.bans``), read again if the last read is older than
        ``max_age_s``; None: none published, or ``--insecure``. ``DHTRequestError`` if it fails."""
        if self.secured and self.bans.due(max_age_s):
            self.bans.update(self._run_coroutine(fetch_ban_list, "ban list", family="bans"))
        return self.bans.ban_list

    def _bans_for_reading(self) -> None:
        try:
            self.refresh_bans(self.ban_refresh_s)
        except DHTRequestError as error:  # the read goes on with the list held
            logger.debug("could not read the ban list: %s", error)

    # ---- generic typed access -----------------------------------------------------------

    def store(self, key: str, record: Record, ttl: float, *, subkey: Optional[str] = None,
              await_all: bool = True) -> bool:
        """Store a record for ``ttl`` seconds of DHT time; returns whether any peer accepted it.
        ``await_all=False``: return at the first holder that accepts, the others sent on in the
        background (an entry readers merge from any holder; dht/stores.py)."""
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        expiration = self._claim_expiration(key, subkey, self._clock() + ttl)
        wire = record.to_wire()
        accepted = self._request(self._send_store(key, subkey, wire, expiration, await_all), f"store {key!r}",
                                 operation="store", family=key_family(key))
        return bool(accepted)

    def delete(self, key: str, *, subkey: Optional[str] = None) -> bool:
        """Hide an entry from readers by outliving it with a tombstone; True if none remains.

        The expiration to outlive is the last one this peer wrote there or, if it wrote
        none, the one found in the DHT.
        """
        target = self._written.get((key, subkey))
        if target is None:
            found = self._get_raw(key, latest=True)
            target = _entry_expiration(found, subkey)
        if target is None or target < self._clock():
            return True  # nothing unexpired to hide
        expiration = self._claim_expiration(key, subkey, target + _EXPIRATION_STEP)
        accepted = self._request(self._send_store(key, subkey, None, expiration), f"delete {key!r}",
                                 operation="delete", family=key_family(key))
        return bool(accepted)

    def get_record(self, key: str, record_type: type[R], *, latest: bool = True) -> Optional[Stored[R]]:
        """The record stored under a plain key (no subkeys), or None if absent or invalid."""
        return self._reader.record(key, self._get_raw(key, latest), record_type)

    def get_entries(self, key: str, record_type: type[R], *, latest: bool = True,
                    full: bool = False) -> dict[str, Stored[R]]:
        """Valid, unexpired, not deleted records under a key's subkeys, sorted by subkey.

        ``full``: read the whole beam this time, never a quick read (dht/reads.py), for a decision
        that must not miss an entry some holder lacks (a lease's claim: dht/leases.py)."""
        found = self._remember(key, latest, self._request(self._dict_get(key, latest, full), f"get {key!r}",
                                                          operation="get", family=key_family(key)))
        return self._reader.entries(key, found, record_type)

    def owned_entries(self, key: str, record_type: type[R], *, latest: bool = True,
                      full: bool = False) -> dict[str, Stored[R]]:
        """``get_entries`` keyed by peer id, keeping only entries whose subkey is their record's
        ``peer_id`` (and, owned, whose owner key is that peer's; secured, owned at all)."""
        return self._owned(key, self.get_entries(key, record_type, latest=latest, full=full))

    def traffic(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """What this peer's DHT process carried so far (dht/entry_traffic.py): "received", (entries,
        bytes) by record family; "sent", (calls, request bytes, response bytes) by "method family".
        Both empty under ``--insecure``. Not timed: it is no request to the swarm."""
        future = self._submit(lambda: self._dht.run_coroutine(dht_traffic, return_future=True))
        found = self._wait(future, "DHT traffic", time.monotonic() + self.request_timeout)
        return {part: {name: tuple(counts) for name, counts in found[part].items()} for part in ("received", "sent")}

    def rejections(self) -> dict[str, int]:
        """How many invalid values each key has yielded to this peer's reads so far."""
        return self._reader.rejections()

    # ---- internals -------------------------------------------------------------------------

    def _submit(self, send: Callable[[], concurrent.futures.Future]) -> concurrent.futures.Future:
        with self._send_lock:
            if self._closed:
                raise DHTRequestError("the DHT peer is shut down")
            if not self._dht.is_alive():
                raise DHTRequestError("the DHT process is not running")
            return send()

    def _wait(self, future: concurrent.futures.Future, what: str, deadline: float) -> Any:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DHTRequestError(f"{what}: no answer within {self.request_timeout:g} s") from None
        except Exception as error:
            raise DHTRequestError(f"{what}: {type(error).__name__}: {error}") from error

    def _request(self, send: Callable[[], concurrent.futures.Future], what: str, *,
                 operation: str = "call", family: str = "other") -> Any:
        """Send one request and wait for its answer, timed into ``timings`` whatever the outcome."""
        started = time.monotonic()
        failed = True
        try:
            future = self._submit(send)
            answer = self._wait(future, what, started + self.request_timeout)
            failed = False
            return answer
        finally:
            self.timings.record(operation, family, time.monotonic() - started, failed=failed)

    def _timed(self, future: concurrent.futures.Future, operation: str, family: str) -> concurrent.futures.Future:
        """`future`, timed into ``timings`` when it ends (answered, failed, or cancelled past its deadline)."""
        started = time.monotonic()

        def ended(done: concurrent.futures.Future) -> None:
            failed = done.cancelled() or done.exception() is not None
            self.timings.record(operation, family, time.monotonic() - started, failed=failed)

        future.add_done_callback(ended)
        return future

    def _send_store(self, key: str, subkey: Optional[str], value: Any, expiration: float,
                    await_all: bool = True) -> Callable[[], concurrent.futures.Future]:
        """The send of a store: hivemind's, but its search is not sent the key's value (dht/stores.py)."""
        store = functools.partial(store_entry, key=key, subkey=subkey, value=value, expiration=expiration,
                                  exclude_self=self._client_mode, await_all=await_all)
        return lambda: self._dht.run_coroutine(store, return_future=True)

    def _get_raw(self, key: str, latest: bool) -> Optional[ValueWithExpiration[Any]]:
        return self._request(self._read(key, latest, None), f"get {key!r}", operation="get", family=key_family(key))

    def _dict_get(self, key: str, latest: bool, full: bool = False) -> Callable[[], concurrent.futures.Future]:
        """The send of a read of a key with subkeys: latest over the beam, or quick (dht/reads.py)."""
        bar = self._memory.next_bar(key) if latest and self._quick_reads and not full else None
        held = self._memory.held(key) if latest and self._quick_reads else None
        return self._read(key, latest, bar, wait_all=full, held=held)

    def _read(self, key: str, latest: bool, bar: Optional[float], wait_all: bool = False,
              held: Optional[Seen] = None) -> Callable[[], concurrent.futures.Future]:
        """The send of a read: to the key's remembered holders (dht/holder_reads.py), or hivemind's own
        read where hivemind caches found values itself or any unexpired value will do."""
        if not (latest and self._quick_reads):
            return lambda: self._dht.get(key, latest=latest, return_future=True, beam_size=READ_BEAM)
        read = functools.partial(read_entry, key=key, bar=bar, exclude_self=self._client_mode, wait_all=wait_all,
                                 held=held)
        return lambda: self._dht.run_coroutine(read, return_future=True)

    def _remember(self, key: str, latest: bool, found: Any) -> Any:
        return self._memory.merge(key, found) if latest and self._quick_reads else found

    def _run_coroutine(self, coroutine: Callable[..., Any], what: str, *, family: str = "other") -> Any:
        return self._request(lambda: self._dht.run_coroutine(coroutine, return_future=True), what, family=family)

    def _claim_expiration(self, key: str, subkey: Optional[str], wanted: float) -> float:
        with self._send_lock:
            previous = self._written.get((key, subkey))
            expiration = wanted if previous is None else max(wanted, previous + _EXPIRATION_STEP)
            if len(self._written) >= _MAX_TRACKED_ENTRIES:
                now = self._clock()
                self._written = {entry: when for entry, when in self._written.items() if when >= now}
            self._written[(key, subkey)] = expiration
            return expiration

    def _owned(self, key: str, entries: dict[str, Stored[R]]) -> dict[str, Stored[R]]:
        """``EntryReader.owned`` under the run's ban list, read again first if it is due."""
        self._bans_for_reading()
        return self._reader.owned(key, entries)


def _entry_expiration(found: Any, subkey: Optional[str]) -> Optional[float]:
    if found is None:
        return None
    if subkey is None:
        return found.expiration_time
    if is_subkey_dict(found.value) and subkey in found.value:
        return found.value[subkey].expiration_time
    return None
