"""A node's dry run of its Join (``agora-node doctor``): the run's description, and what a Join
would find (the preflight's figures against the run's floors, the dial-back, the stage), without
being admitted.

Design choices:

- The same path as ``admit`` (auth/admission.py), up to the Join: the root taken from the TLS
  handshake only if it matches the pinned fingerprint, GetRun checked against it, a join
  challenge, its preflight (``run_preflight``), the reachability listener on the port the node
  would announce, a signed request. Then CheckJoin instead of Join: the authorizer answers its
  verdicts and admits nobody, issues nothing, holds no slot (auth/service.py says what it costs).
- The request is signed with a key made for the dry run, never the node's own: nothing the dry
  run does touches the state directory, so it runs beside a node of the same identity.
- The authorizer's clock: CheckJoin carries it, read as it answers (after the dial-back, which
  can take seconds); the skew is taken against this node's clock on receipt, less half the
  measured round trip (the reply's way back).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import grpc

from agora.auth.admission import authorizer_root, check_root, reachability_listener, rpc_error, run_preflight
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.credentials import Clock
from agora.auth.keys import generate_key
from agora.auth.node_state import public_key_pem
from agora.auth.policy import sign_proof
from agora.protos.authorizer_adapter import (AuthorizerStub, ChallengeRequest, Hardware, JoinCheck, JoinRequest,
                                             RunDescription, signed_payload)

__all__ = ["JoinCheckResult", "describe_run", "check_join"]


@dataclass(frozen=True)
class JoinCheckResult:
    check: JoinCheck
    skew_s: float  # the authorizer's clock minus this machine's (positive: this machine is behind)


async def describe_run(address: str, root_fingerprint: str, *, rpc_timeout_s: float = 30.0) -> RunDescription:
    """The run served at ``address``, once its root checked out against ``root_fingerprint``;
    AdmissionError (one line) when the authorizer is unreachable or not the pinned one."""
    root_pem = await authorizer_root(address, root_fingerprint, rpc_timeout_s)
    async with authorizer_channel(address, root_pem) as channel:
        try:
            run = await AuthorizerStub(channel).get_run(timeout=rpc_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise rpc_error(address, error) from None
    check_root(run.root_pem, address, root_fingerprint)
    return run


async def check_join(address: str, root_fingerprint: str, *, fingerprint: Callable[[dict], str], hardware: Hardware,
                     announce: tuple[str, int], listen_host: Optional[str] = None, stage: Optional[int] = None,
                     clock: Clock = time.time, rpc_timeout_s: float = 60.0) -> JoinCheckResult:
    """A worker's Join, dry run: the preflight, the dial-back to ``announce`` (a listener on
    ``listen_host``, default the announced host, on that port answers it) and the authorizer's
    verdicts. Raises AdmissionError (one line) when the authorizer is unreachable or refuses the call."""
    key = generate_key()
    root_pem = await authorizer_root(address, root_fingerprint, rpc_timeout_s)
    listening = reachability_listener(listen_host or announce[0], announce[1])
    async with authorizer_channel(address, root_pem) as channel, listening as listener:
        stub = AuthorizerStub(channel)
        try:
            run = await stub.get_run(timeout=rpc_timeout_s)
            check_root(run.root_pem, address, root_fingerprint)
            challenge = await stub.get_challenge(ChallengeRequest(role="worker"), timeout=rpc_timeout_s)
            listener.answer(challenge.dial_token)
            await run_preflight(stub, challenge, address, rpc_timeout_s)
            request = JoinRequest(nonce=challenge.nonce, public_key_pem=public_key_pem(key), role="worker",
                                  fingerprint=fingerprint(json.loads(run.config_json)), hardware=hardware,
                                  stage=stage, announce_host=announce[0], announce_port=announce[1])
            request = replace(request, signature=sign_proof(key, signed_payload(request)))
            before = clock()
            check = await stub.check_join(request, timeout=rpc_timeout_s)
            after = clock()
        except grpc.aio.AioRpcError as error:
            raise rpc_error(address, error) from None
    return JoinCheckResult(check, check.server_time - (after - min(check.rtt_ms / 2e3, (after - before) / 2)))
