"""A node's side of the authorizer: joining a run (``admit``), keeping its credential fresh
(``CredentialRenewer``) and saying it leaves (``CredentialRenewer.leave``).

Design choices:

- The authorizer speaks TLS under the run's root (auth/authorizer_tls.py). A joining node takes
  the root from the server's handshake only if it hashes to the pinned fingerprint, then talks over
  a channel that trusts that root alone; a renewing node uses the root in its state directory. So
  a status (a refusal, a ban) comes from the authorizer, never from whoever sits on the path.
- Trust nothing the authorizer says until it checks out against the pinned root as well: the
  root PEM in the reply must hash to the pinned fingerprint, the credential chain must verify
  against it and certify this node's own key for the role (and stage) asked for, and the run
  description must carry the issuing CA's signature. Only then is anything written
  (``NodeCredentials.save`` re-checks the first two).
- The preflight is run, not reported: the node echoes the authorizer's latency probes and moves
  the bytes the challenge asks for; the authorizer times them. A worker also keeps a plain TCP
  listener on its announced port for the length of the admission (``reachability_listener``)
  that answers the authorizer's dial-back with the challenge's token; its real gRPC server takes
  the same port once it holds a credential.
- A queued node polls with a fresh challenge each time (the authorizer keeps its measurements,
  so polls carry no transfers) and reports its position through ``on_queued``.
- Renewal follows SPIRE: at half the lifetime, jittered earlier by up to 10%; an unreachable
  authorizer is retried with exponential backoff, never past expiry. A definitive refusal
  (banned, or a credential the authorizer no longer accepts) calls ``on_revoked(reason)`` once
  and the renewer ends: the node then stops, so a banned node leaves within one lifetime.
- A clean leave tells the authorizer (Leave, signed like a renewal), so a worker's slot frees at
  once. It is a courtesy with a short timeout: an authorizer that does not answer never holds up
  the leave, the slot then frees when the credential expires.
- asyncio only, no threads; the renewer is one task with explicit cancellation
  (``async with CredentialRenewer(...)`` or ``start``/``stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

import grpc

if TYPE_CHECKING:  # torch is imported where the hardware is read: the authorizer never needs it
    import torch

from agora.auth.credentials import (Clock, CredentialError, CredentialVerifier, Identity, certificate_fingerprint,
                                    load_chain)
from agora.auth.authorizer_tls import authorizer_channel, pinned_root, presented_chain
from agora.auth.keys import write_private_file
from agora.auth.node_state import NodeCredentials, RunInfo, public_key_pem
from agora.auth.policy import (dialback_answer, proof_is_valid, renewal_delay_s, retry_delay_s, run_payload,
                               sign_proof)
from agora.protos.authorizer_adapter import (Admitted, AuthorizerStub, Challenge, ChallengeRequest, Hardware,
                                             JoinRequest,
                                             LeaveRequest, RenewRequest, signed_payload)

__all__ = [
    "AdmissionError",
    "AdmissionRefused",
    "AuthorizerUntrusted",
    "RenewalRefused",
    "renew_if_past_half_life",
    "JoinFile",
    "ReachabilityListener",
    "reachability_listener",
    "hardware_report",
    "admit",
    "authorizer_root",
    "check_root",
    "rpc_error",
    "run_preflight",
    "CredentialRenewer",
]

logger = logging.getLogger(__name__)

_RATE_LIMITED_TRIES = 8  # consecutive RESOURCE_EXHAUSTED answers before giving up


class AdmissionError(RuntimeError):
    """Admission did not complete (authorizer unreachable, or a protocol error); one readable line."""


class AdmissionRefused(AdmissionError):
    """The authorizer refused this node; ``reason`` names the floor or field and the measured value."""

    def __init__(self, reason: str, field: str = ""):
        super().__init__(f"admission refused: {reason}")
        self.reason, self.field = reason, field


class AuthorizerUntrusted(AdmissionError):
    """The reply does not verify against the pinned root: this node refuses the authorizer."""


class RenewalRefused(AdmissionError):
    """The authorizer will not renew this credential (banned, expired, not this run's)."""

    def __init__(self, reason: str, code: grpc.StatusCode):
        super().__init__(reason)
        self.reason, self.code = reason, code


@dataclass(frozen=True)
class JoinFile:
    """What a node needs to join (``--join-file``): written by ``agora-node authorizer serve``."""

    authorizer: str  # host:port
    root_fingerprint: str
    run_id: str

    def write(self, path: str | Path) -> None:
        write_private_file(Path(path), json.dumps(self.__dict__, indent=1).encode() + b"\n", mode=0o644)

    @classmethod
    def read(cls, path: str | Path) -> "JoinFile":
        try:
            data = json.loads(Path(path).read_text())
            return cls(authorizer=str(data["authorizer"]), root_fingerprint=str(data["root_fingerprint"]),
                       run_id=str(data["run_id"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"--join-file {path}: not a join file ({error})") from None


def hardware_report(device: Optional["torch.device"] = None) -> Hardware:
    """This machine: the accelerator the node computes on (`device`; default the one torch picks,
    "cpu" and 0 without one) and its RAM, read as the memory plan reads them (pipeline/runtime.py)."""
    import torch

    from agora.pipeline.runtime import device_memory

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ram = device_memory(torch.device("cpu")).total_bytes
    if device.type != "cuda":
        return Hardware(device="cpu", accelerator_memory_bytes=0, ram_bytes=ram)
    accelerator = device_memory(device)
    return Hardware(device=accelerator.name, accelerator_memory_bytes=accelerator.total_bytes, ram_bytes=ram)


class ReachabilityListener:
    """Answers every connection with the current challenge's dial token, then hangs up."""

    def __init__(self, host: str):
        self.host = host
        self.port = 0
        self._answer = dialback_answer(b"")

    def answer(self, token: bytes) -> None:
        self._answer = dialback_answer(token)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self._answer)
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def reachability_listener(host: str, port: int) -> AsyncIterator[ReachabilityListener]:
    """A plain TCP listener on ``host:port`` (0 picks a port: read ``.port``) while admission runs."""
    listener = ReachabilityListener(host)
    try:
        server = await asyncio.start_server(listener._handle, host, port)
    except OSError as error:
        raise AdmissionError(f"cannot listen on {host}:{port} for the authorizer's dial-back: {error}") from None
    listener.port = server.sockets[0].getsockname()[1]
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


def _retry_after(error: grpc.aio.AioRpcError, default: float) -> float:
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                break
    return default


def rpc_error(address: str, error: grpc.aio.AioRpcError) -> AdmissionError:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return AdmissionError(f"the authorizer at {address} is unreachable ({error.code().name}: {error.details()})")
    return AdmissionError(f"the authorizer at {address} answered {error.code().name}: {error.details()}")


async def admit(address: str, root_fingerprint: str, node: NodeCredentials, *, role: str,
                fingerprint: str | Callable[[dict], str], hardware: Optional[Hardware] = None,
                stage: Optional[int] = None, announce: Optional[tuple[str, int]] = None,
                listen_host: Optional[str] = None, listener: Optional[ReachabilityListener] = None,
                on_queued: Optional[Callable[[int], Any]] = None, clock: Clock = time.time,
                rpc_timeout_s: float = 60.0) -> RunInfo:
    """Join the run served at ``address`` and store the credential in ``node``; returns the run.

    ``fingerprint``: this node's run fingerprint text, or a function from the run config the
    authorizer serves (``config_to_dict`` form) to it. Workers pass ``announce=(host, port)``: the
    address peers will dial; the dial-back listener binds ``listen_host`` (default: the announced
    host) on that port, or the caller passes its own open ``listener`` (then a port of 0 in
    ``announce`` means the listener's). Raises ``AdmissionRefused`` when refused,
    ``AuthorizerUntrusted`` when the reply does not verify against ``root_fingerprint``, and
    ``AdmissionError`` when the authorizer cannot be reached.
    """
    if role == "worker":
        if announce is None:
            raise ValueError("announce: a worker must give the host:port peers will reach it on")
        if listener is None and announce[1] == 0:
            raise ValueError("announce: pick the port before admission (the dial-back listener and the gRPC "
                             "server share it), or pass an open listener")
    if role != "worker":
        announce, opened = None, contextlib.nullcontext(None)
    elif listener is not None:
        announce, opened = (announce[0], announce[1] or listener.port), contextlib.nullcontext(listener)
    else:
        opened = reachability_listener(listen_host or announce[0], announce[1])
    hardware = hardware or hardware_report()
    root_pem = await authorizer_root(address, root_fingerprint, rpc_timeout_s)
    async with authorizer_channel(address, root_pem) as channel:
        stub = AuthorizerStub(channel)
        try:
            # The root first: a node never joins (nor takes a slot at) an authorizer it does not trust.
            run = await stub.get_run(timeout=rpc_timeout_s)
            check_root(run.root_pem, address, root_fingerprint)
            if callable(fingerprint):
                fingerprint = fingerprint(json.loads(run.config_json))
            async with opened as open_listener:
                return await _join_loop(stub, address, root_fingerprint, node, role=role, fingerprint=fingerprint,
                                        hardware=hardware, stage=stage, announce=announce, listener=open_listener,
                                        on_queued=on_queued, clock=clock, timeout=rpc_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise rpc_error(address, error) from None


async def _join_loop(stub: AuthorizerStub, address: str, root_fingerprint: str, node: NodeCredentials, *, role: str,
                     fingerprint: str, hardware: Hardware, stage: Optional[int],
                     announce: Optional[tuple[str, int]], listener: Optional[ReachabilityListener],
                     on_queued: Optional[Callable[[int], Any]], clock: Clock, timeout: float) -> RunInfo:
    public_pem = public_key_pem(node.key)
    limited = 0
    while True:
        try:
            challenge = await stub.get_challenge(ChallengeRequest(peer_id=node.peer_id, role=role), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or limited >= _RATE_LIMITED_TRIES:
                raise
            limited += 1
            await asyncio.sleep(_retry_after(error, 1.0))
            continue
        limited = 0
        if listener is not None:
            listener.answer(challenge.dial_token)
        await run_preflight(stub, challenge, address, timeout)
        request = JoinRequest(nonce=challenge.nonce, public_key_pem=public_pem, role=role, fingerprint=fingerprint,
                              hardware=hardware, stage=stage, announce_host=announce[0] if announce else "",
                              announce_port=announce[1] if announce else 0)
        request = replace(request, signature=sign_proof(node.key, signed_payload(request)))
        reply = await stub.join(request, timeout=timeout)
        if reply.admitted is not None:
            return _accept(reply.admitted, address, root_fingerprint, node, role=role, stage=stage, clock=clock)
        if reply.refused is not None:
            raise AdmissionRefused(reply.refused.reason, reply.refused.field)
        if reply.queued is None:
            raise AdmissionError(f"the authorizer at {address} answered an empty Join reply")
        if on_queued is not None:
            outcome = on_queued(reply.queued.position)
            if inspect.isawaitable(outcome):
                await outcome
        logger.info("admission: queued at position %d; asking again in %.1f s", reply.queued.position,
                    reply.queued.retry_after_s)
        await asyncio.sleep(min(max(reply.queued.retry_after_s, 0.05), 300.0))


async def run_preflight(stub: AuthorizerStub, challenge: Challenge, address: str, timeout: float) -> None:
    """The transfers ``challenge`` asks for: echo the latency probes, take the download, send the
    upload (the authorizer times each on its own clock)."""
    if challenge.latency_probes:
        await stub.echo_latency(challenge.nonce, timeout=timeout)
    if challenge.download_bytes:
        try:
            await stub.download(challenge.nonce, max_bytes=challenge.download_bytes, timeout=timeout)
        except ValueError as error:  # more bytes than announced
            raise AdmissionError(f"the authorizer at {address}: {error}") from None
    if challenge.upload_bytes:
        await stub.upload(challenge.nonce, size=challenge.upload_bytes, timeout=timeout)


async def authorizer_root(address: str, root_fingerprint: str, timeout_s: float) -> bytes:
    """The root CA the authorizer at ``address`` presents in its TLS handshake, if it is the pinned one."""
    try:
        chain = await presented_chain(address, timeout_s)
    except (OSError, asyncio.TimeoutError) as error:
        raise AdmissionError(f"the authorizer at {address} is unreachable over TLS "
                             f"({error or type(error).__name__})") from None
    root = pinned_root(chain, root_fingerprint)
    if root is None:
        check_root(chain[-1] if chain else b"", address, root_fingerprint)  # says what was presented instead
    return root


def check_root(root_pem: bytes, address: str, root_fingerprint: str) -> None:
    try:
        presented = certificate_fingerprint(root_pem)
    except ValueError:
        raise AuthorizerUntrusted(f"the authorizer at {address} presented no valid root CA: refusing it") from None
    if presented != root_fingerprint:
        raise AuthorizerUntrusted(f"the authorizer at {address} presented root CA {presented[:16]}..., not the "
                                  f"pinned {root_fingerprint[:16]}...: refusing it")


def _accept(admitted: Admitted, address: str, root_fingerprint: str, node: NodeCredentials, *, role: str,
            stage: Optional[int], clock: Clock) -> RunInfo:
    """Check an admission against the pinned root, then store it."""
    try:
        check_root(admitted.root_pem, address, root_fingerprint)
        verifier = CredentialVerifier(admitted.root_pem, admitted.run_id, clock=clock)
        identity = verifier.verify(admitted.credential_pem, roles=(role,), stage=stage,
                                   public_key=node.key.public_key())
        chain = load_chain(admitted.credential_pem)
        payload = run_payload(admitted.run_id, admitted.config_json, admitted.initial_peers, admitted.credential_pem)
        if len(chain) < 2 or not proof_is_valid(chain[1].public_key(), payload, admitted.run_signature):
            raise AuthorizerUntrusted(f"the run description from {address} is not signed by the issuing CA of "
                                      "its credential: refusing it")
        run = RunInfo(run_id=admitted.run_id, role=identity.role, stage=identity.stage,
                      root_fingerprint=root_fingerprint, authorizer=address,
                      config=json.loads(admitted.config_json), initial_peers=tuple(admitted.initial_peers))
        node.save(admitted.credential_pem, admitted.root_pem, run)
    except (CredentialError, ValueError) as error:
        if isinstance(error, AdmissionError):
            raise
        raise AuthorizerUntrusted(f"the admission from {address} does not verify against the pinned root: "
                                  f"{error}") from None
    logger.info("admission: admitted as %s, credential valid for %.0f s", identity.describe(), admitted.lifetime_s)
    return run


class CredentialRenewer:
    """Renews ``node``'s credential at the authorizer ``address`` at half life, until revoked or stopped."""

    def __init__(self, address: str, node: NodeCredentials, *, on_revoked: Callable[[str], Any],
                 clock: Clock = time.time, rng: Optional[random.Random] = None, jitter_fraction: float = 0.1,
                 retry_initial_s: float = 1.0, retry_max_s: float = 60.0, rpc_timeout_s: float = 30.0):
        self.address, self.node = address, node
        self._on_revoked = on_revoked
        self._clock = clock
        self._rng = rng or random.Random()
        self._jitter_fraction = jitter_fraction
        self._retry_initial_s, self._retry_max_s = retry_initial_s, retry_max_s
        self._rpc_timeout_s = rpc_timeout_s
        self._task: Optional[asyncio.Task] = None
        self.renewals = 0
        self.failures = 0  # consecutive renewals that did not reach a verdict (the watchdog reads it)
        self.revoked: Optional[str] = None  # the reason, once revoked

    async def renew_once(self) -> Identity:
        """One renewal now; raises RenewalRefused (definitive) or AdmissionError (try again later)."""
        chain, before = self.node.current()
        async with authorizer_channel(self.address, self.node.root_pem()) as channel:
            stub = AuthorizerStub(channel)
            try:
                challenge = await stub.get_challenge(ChallengeRequest(peer_id=self.node.peer_id, role=before.role,
                                                                      renewal=True), timeout=self._rpc_timeout_s)
                request = RenewRequest(nonce=challenge.nonce, credential_pem=chain)
                request = replace(request, signature=sign_proof(self.node.key, signed_payload(request)))
                reply = await stub.renew(request, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                                    grpc.StatusCode.INVALID_ARGUMENT):
                    raise RenewalRefused(error.details() or error.code().name, error.code()) from None
                raise rpc_error(self.address, error) from None
        run = self.node.run_info()
        try:
            identity = CredentialVerifier(self.node.root_pem(), run.run_id, clock=self._clock).verify(
                reply.credential_pem, roles=(before.role,), stage=before.stage, public_key=self.node.key.public_key())
        except CredentialError as error:
            raise AuthorizerUntrusted(f"the renewal from {self.address} does not verify: {error}") from None
        self.node.save(reply.credential_pem, self.node.root_pem(), run)
        self.renewals += 1
        logger.info("renewed the credential of %s: valid for %.0f s", identity.describe(),
                    identity.remaining_s(self._clock()),
                    extra={"milestone": "credential_renewed",
                           "fields": {"role": identity.role, "remaining_s": round(identity.remaining_s(self._clock()))}})
        return identity

    async def run(self) -> None:
        """Renew at half life until revoked (then ``on_revoked`` has been called) or cancelled."""
        self.failures = 0
        while True:
            try:
                _, identity = self.node.current()
            except CredentialError as error:
                return await self._revoke(f"no valid credential to renew: {error}")
            now = self._clock()
            if self.failures == 0:
                delay = renewal_delay_s(identity.not_before, identity.not_after, now, self._rng, self._jitter_fraction)
            else:
                delay = retry_delay_s(self.failures - 1, self._rng, initial_s=self._retry_initial_s,
                                      maximum_s=self._retry_max_s)
            await asyncio.sleep(min(delay, max(0.0, identity.not_after - now)))
            if self._clock() >= identity.not_after:
                return await self._revoke(f"credential expired: the authorizer at {self.address} could not renew it "
                                          f"in time")
            try:
                await self.renew_once()
                self.failures = 0
            except RenewalRefused as refused:
                return await self._revoke(refused.reason)
            except AdmissionError as error:
                self.failures += 1
                logger.warning("credential renewal failed (%s); retrying", error)

    async def leave(self, reason: str, timeout_s: float = 5.0) -> Optional[bool]:
        """Tell the authorizer this node leaves (its slot frees at once): whether a worker's slot was
        freed, or None when the authorizer did not answer within ``timeout_s`` (said in one line)."""
        try:
            return await asyncio.wait_for(self._leave(reason), timeout_s)
        except Exception as error:  # a courtesy: nothing it meets may stop the leave
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error) or "no answer"
            logger.warning("could not tell the authorizer at %s that this node leaves (%s); its slot frees when "
                           "the credential expires", self.address, detail)
            return None

    async def _leave(self, reason: str) -> bool:
        chain, identity = self.node.current()
        async with authorizer_channel(self.address, self.node.root_pem()) as channel:
            stub = AuthorizerStub(channel)
            challenge = await stub.get_challenge(ChallengeRequest(peer_id=self.node.peer_id, role=identity.role,
                                                                  renewal=True))
            request = LeaveRequest(nonce=challenge.nonce, credential_pem=chain, reason=reason)
            request = replace(request, signature=sign_proof(self.node.key, signed_payload(request)))
            receipt = await stub.leave(request)
        logger.info("told the authorizer this node leaves (%s)%s", reason, ": its slot is free" if receipt.freed else "",
                    extra={"milestone": "left_authorizer", "fields": {"reason": reason, "freed": receipt.freed}})
        return receipt.freed

    async def _revoke(self, reason: str) -> None:
        self.revoked = reason
        logger.error("credential revoked: %s", reason)
        outcome = self._on_revoked(reason)
        if inspect.isawaitable(outcome):
            await outcome

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="credential-renewer")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> "CredentialRenewer":
        self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()


def renew_if_past_half_life(authorizer: Optional[str], node: Optional[NodeCredentials], *,
                            clock: Clock = time.time) -> None:
    """Blocking: renew ``node``'s credential now if it is past half its life, before a start that
    needs it valid (a DHT peer's first pings carry it).

    The renewer that keeps a credential fresh starts only once the node serves, and a start can
    take long (a big stage's memory check, a loaded machine): a short-lived credential, admitted
    before it, then expires under the DHT's bootstrap, and the node's peers refuse it. An
    authorizer that does not answer is said in one line and the start goes on with what it holds
    (valid still, or its peers say so); a definitive refusal raises ``RenewalRefused``.
    """
    if node is None or not authorizer:
        return
    _, identity = node.current()  # CredentialError: nothing valid to start with, said by the caller
    if clock() < identity.not_before + (identity.not_after - identity.not_before) / 2:
        return
    try:
        asyncio.run(CredentialRenewer(authorizer, node, on_revoked=lambda reason: None, clock=clock).renew_once())
    except RenewalRefused:
        raise
    except AdmissionError as error:
        logger.warning("could not renew the credential before starting (%s); starting with the one held, valid "
                       "for %.0f s more", error, identity.remaining_s(clock()))
