"""The per-call check on a node's gRPC server: who calls, may they call this, is it for this run.

TLS (node/rpc/tls.py) has already refused anyone without a credential chained to the run's root,
and proved that the caller holds the credential's key, but only at the handshake. A connection
outlives a 1-hour credential, and the handshake knows nothing of methods, so on every call
`CallerCheck` (a `CallHook`, node/rpc/interceptors.py):

1. looks the method up in the access policy (auth/grpc_policy.py); a method the table does not
   name is refused (PERMISSION_DENIED);
2. reads the caller's leaf certificate from the TLS auth context (``x509_pem_cert``) and checks
   it with the node's `CredentialVerifier` (`identity_of_leaf`, a parse cached by the
   certificate's bytes, and `check`: time, run, role): an expired or not-yet-valid credential, or
   one of another run, is UNAUTHENTICATED with the verifier's message; a role the method does not
   allow is PERMISSION_DENIED naming the role and the method;
3. refuses a caller the run's ban list names (PERMISSION_DENIED "banned"; `banned`, the list as
   the node's DHT last read it, dht/bans.py): its credential may still be valid for an hour,
   the ban holds from the node's next heartbeat;
4. checks the run fingerprint the request carries (``agora-run-fingerprint`` metadata) where the
   policy asks for it, also under ``--insecure``: a mismatch is FAILED_PRECONDITION naming the
   first differing field, a malformed one INVALID_ARGUMENT;
5. makes the caller known to the handler: `current_caller()` returns the `Caller` (its
   ``owner`` is what microbatches are bound to: the credential's peer id).

Under ``--insecure`` there is no credential: the caller is an explicit anonymous identity,
``anonymous@<ip>`` from the connection's peer address. It is keyed on the host, not the port,
so a trainer whose channel reconnects between a Forward and its Backward still owns its
microbatch; two trainers on one host share it, which is what "insecure" means.

The caller is passed to handlers in a context variable: grpc.aio runs every call in its own
task, so the value set ahead of a handler is seen by that handler only (and by hooks after this
one in the chain), never by another call.

Refusals are counted by reason (`RefusalCounts`), for the worker's status and later metrics.
Handshake failures never reach this check (grpc refuses them in its core); they are logged by
grpc, not counted here.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import grpc

from agora.auth.credentials import CredentialError, Identity
from agora.auth.grpc_policy import FINGERPRINT_METADATA, NODE_POLICY, MethodRule, rule_for
from agora.auth.node_state import NodeCredentials
from agora.node.rpc.interceptors import CallHook, CallInfo, Clock, peer_host
from agora.pipeline.fingerprint import FingerprintMismatch, RunFingerprint
from agora.protos.serving import drain

__all__ = ["Caller", "CallerCheck", "RefusalCounts", "current_caller", "caller_owner", "nobody_banned",
           "ANONYMOUS_ROLE"]

ANONYMOUS_ROLE = "anonymous"

# Per call (see the module docstring): set by CallerCheck.before, read by handlers.
_CALLER: contextvars.ContextVar[Optional["Caller"]] = contextvars.ContextVar("agora_rpc_caller", default=None)


@dataclass(frozen=True)
class Caller:
    """Who is calling: a verified credential's identity, or anonymous under --insecure."""

    owner: str  # what work is bound to: the credential's peer id, or "anonymous@<ip>"
    role: str  # the credential's role, or "anonymous"
    identity: Optional[Identity] = None

    @property
    def anonymous(self) -> bool:
        return self.identity is None

    @classmethod
    def of_identity(cls, identity: Identity) -> "Caller":
        return cls(owner=identity.peer_id, role=identity.role, identity=identity)

    @classmethod
    def anonymous_from_peer(cls, peer: str) -> "Caller":
        """``ipv4:10.0.0.5:53122`` -> ``anonymous@10.0.0.5`` (the host, not the port: see above)."""
        return cls(owner=f"anonymous@{peer_host(peer)}", role=ANONYMOUS_ROLE)


def nobody_banned(peer_id: str) -> bool:
    """The ban list of a node that reads none (--insecure, tests without a DHT)."""
    return False


def current_caller() -> Optional[Caller]:
    """The caller of the gRPC call being handled (None outside a checked call)."""
    return _CALLER.get()


def caller_owner(call: CallInfo) -> str:
    """Who `call` counts for in a hook after `CallerCheck` (node/rpc/call_slots.py's pools): the
    checked caller's owner, or the anonymous identity of its host where no check ran."""
    caller = _CALLER.get()
    return caller.owner if caller is not None else Caller.anonymous_from_peer(call.peer).owner


class RefusalCounts:
    """Refused calls by reason; thread-safe (the compute thread's refusals are counted too)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


# A stream refused at the door is read to its end before the status goes out (protos/serving.py),
# but no further than this many parts.
_DRAIN_PARTS = 4096


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class CallerCheck(CallHook):
    """Checks every call against `policy`; `credentials=None` is the --insecure mode (anonymous
    callers, fingerprint still checked). `banned(peer_id)`: whether the run's ban list names a caller."""

    def __init__(self, *, fingerprint: RunFingerprint, credentials: Optional[NodeCredentials] = None,
                 policy: Mapping[str, Mapping[str, MethodRule]] = NODE_POLICY,
                 refusals: Optional[RefusalCounts] = None, clock: Clock = time.monotonic,
                 banned: Callable[[str], bool] = nobody_banned):
        super().__init__(clock=clock)
        self.banned = banned
        self.fingerprint = fingerprint
        self._fingerprint_text = fingerprint.text()
        self.credentials = credentials
        self.policy = policy
        self.refusals = refusals if refusals is not None else RefusalCounts()

    async def before(self, call: CallInfo, context: Any) -> None:
        try:
            rule = rule_for(call.method, self.policy)
            if rule is None:
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "unknown_method",
                               f"{call.method} is not in this node's access policy")
            caller = self._identify(call, context, rule)
            if rule.fingerprint:
                self._check_fingerprint(call, context)
        except _Refused as refused:
            self.refusals.add(refused.reason)
            if call.request_stream is not None:
                await drain(call.request_stream, max_parts=_DRAIN_PARTS)
            await context.abort(refused.code, refused.message)  # raises: the handler never runs
            return
        _CALLER.set(caller)

    def _identify(self, call: CallInfo, context: Any, rule: MethodRule) -> Caller:
        if self.credentials is None:
            return Caller.anonymous_from_peer(call.peer)
        leaf = (context.auth_context() or {}).get("x509_pem_cert") or []
        if not leaf:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "no_certificate",
                           f"{call.method}: the connection presents no client certificate; connect with a "
                           "credential of this run")
        verifier = self.credentials.verifier()
        identity: Optional[Identity] = None
        try:
            identity = verifier.identity_of_leaf(leaf[0])
            verifier.check(identity, roles=tuple(sorted(rule.roles)))
        except CredentialError as error:
            if error.reason == "wrong_role" and identity is not None:
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "wrong_role",
                               f"{call.method} needs a {' or '.join(sorted(rule.roles))} credential; the caller "
                               f"holds a {identity.role} credential ({identity.describe()})") from None
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, error.reason, f"{call.method}: {error}") from None
        if self.banned(identity.peer_id):
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "banned",
                           f"{call.method}: banned: {identity.describe()} is on the run's ban list")
        return Caller.of_identity(identity)

    def _check_fingerprint(self, call: CallInfo, context: Any) -> None:
        sent = [value for key, value in (context.invocation_metadata() or ()) if key == FINGERPRINT_METADATA]
        if not sent:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "no_fingerprint",
                           f"{call.method}: the request carries no run fingerprint ({FINGERPRINT_METADATA} "
                           "metadata); every agora-node sends it, so the caller is not one of this run's")
        text = sent[0] if isinstance(sent[0], str) else bytes(sent[0]).decode("ascii", "replace")
        if text == self._fingerprint_text:
            return  # the common case, without parsing
        try:
            self.fingerprint.check(text)
        except FingerprintMismatch as mismatch:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "fingerprint_mismatch",
                           f"{call.method}: {mismatch}") from None
        except ValueError as error:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "bad_fingerprint", f"{call.method}: {error}") from None
        # Same fields, other text (a reordering): the fingerprints agree.
