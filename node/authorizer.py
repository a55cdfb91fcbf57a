"""`agora-node authorizer`: the operator's role. Serve admission, ban and unban, list, mint credentials.

    agora-node authorizer serve --state-dir D --run-id R [--host H --port P] [--ready-file F] ...
    agora-node authorizer ban PEER_ID [--reason R] --state-dir D
    agora-node authorizer unban PEER_ID --state-dir D
    agora-node authorizer list [--json] --state-dir D
    agora-node authorizer issue --role R [--stage I] --out DIR [--lifetime S] --state-dir D

Design choices:

- The state directory is the authorizer: the CA (auth/authority.py), the ban list, the admitted
  nodes (auth/service.py) and ``serving.json`` (the run config and bootstrap peers ``serve`` was
  given, so ``issue`` mints credentials that carry them). ``ban``/``unban`` write the ban list
  under its file lock; the serving process re-reads it on its next admission or renewal, and
  publishes it, signed, in the DHT within a second (node/ban_publisher.py), where every node
  reads it each heartbeat: a ban needs no restart and no RPC, and reaches the whole swarm.
- ``issue --run-id R`` may create the CA, like ``serve`` does on first start: a DHT bootstrap peer
  needs a credential before it starts, and ``serve`` needs its address (``--initial-peers``).
- ``serve`` runs the service behind the shared server plumbing (node/rpc: interceptor chain,
  health, reflection) on one uvloop loop; it prints the address and the root fingerprint and
  writes ``join.json`` (both, plus the run id: what a node is given as ``--join-file``), then the
  ready file (address and fingerprint, one per line) once serving. SIGTERM/SIGINT stop it.
- A user's mistake ends in one line and exit 2 (``ConfigError``, handled by node/cli.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import logging
import re
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import grpc
from prometheus_client import Counter

from agora.auth.admission import JoinFile
from agora.auth.admitted import read_admitted
from agora.auth.authority import DEFAULT_CREDENTIAL_LIFETIME_S, RunAuthority
from agora.auth.authorizer_tls import authorizer_server_credentials
from agora.auth.keys import write_private_file
from agora.auth.node_state import NodeCredentials
from agora.auth.settings import AuthorizerSettings
from agora.dht.records import Phase
from agora.monitor.worker_metrics import RpcServerMetrics
from agora.node.authorizer_options import AuthorityFolder, AuthorizerServeOptions, IssueOptions
from agora.node.observability import MetricsOptions, NodeMetrics, add_metrics_arguments, package_version
from agora.node.rpc.call_slots import CallSlots
from agora.node.rpc.interceptors import interceptor_chain
from agora.node.rpc.metrics_hook import MetricsHook
from agora.node.rpc.server import add_health_and_reflection, bind, create_server, run, set_serving
from agora.node.run_flags import add_run_arguments, run_config
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import add_option_flags, options_from_args
from agora.pipeline.schema import checked
from agora.protos.authorizer_adapter import SERVICE_NAME, add_authorizer_service

if TYPE_CHECKING:  # agora.auth.service imports torch (the run fingerprint): the serving commands import it
    from agora.auth.service import AuthorizerService

__all__ = ["add_authorizer_commands", "issue_credential", "AuthorizerServer", "start_authorizer_server",
           "serve_authorizer", "read_stage_members", "SERVING_FILE", "JOIN_FILE", "LOCAL_RUN_FLAGS"]

logger = logging.getLogger(__name__)

SERVING_FILE = "serving.json"
JOIN_FILE = "join.json"
_MAX_MESSAGE_BYTES = 1 << 20  # preflight chunks are 64 KiB; credentials a few KiB
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{10,128}")
# `serve` flags for a run on one machine or a private network (the demo, tests): its nodes share one
# address and network, so the limits per address and network are wide, and the dial-back may reach
# loopback and private addresses.
LOCAL_RUN_FLAGS = ("--local-network", "--join-rate", "20", "--join-burst", "64", "--network-join-rate", "20",
                   "--network-join-burst", "64", "--renew-rate", "20", "--renew-burst", "64")


@dataclass(frozen=True)
class AuthorizerServer:
    """A started authorizer: its grpc.aio server, the port it listens on, its health servicer."""

    server: grpc.aio.Server
    port: int
    health: Any

    async def stop(self, grace: Optional[float]) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace)


async def start_authorizer_server(service: AuthorizerService, host: str, port: int,
                                  interceptors: tuple = ()) -> AuthorizerServer:
    """The service on a started grpc.aio server behind the shared interceptor chain (plus
    `interceptors`: metrics), with health and reflection, over TLS under the run's root
    (auth/authorizer_tls.py) and serving `max_concurrent_rpcs` calls at once. The port is exclusive
    (no SO_REUSEPORT): a second authorizer on it fails to start."""
    server = create_server(interceptors=interceptor_chain(outer=interceptors), max_message_bytes=_MAX_MESSAGE_BYTES,
                           options=[("grpc.so_reuseport", 0)],
                           slots=CallSlots(calls=service.settings.max_concurrent_rpcs))
    add_authorizer_service(server, service)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    try:
        bound = bind(server, host, port, authorizer_server_credentials(service.authority))
    except RuntimeError as error:  # grpc reports a failed bind as RuntimeError
        raise OSError(str(error).split(";")[0]) from None
    await server.start()
    await set_serving(health, [SERVICE_NAME], True)
    return AuthorizerServer(server, bound, health)


async def serve_authorizer(service: AuthorizerService, host: str, port: int, *, public_host: str,
                           ready: Callable[[str], None], stop: asyncio.Event, interceptors: tuple = ()) -> None:
    """Serve until ``stop`` is set; ``ready(address)`` runs once the service answers."""
    started = await start_authorizer_server(service, host, port, interceptors)
    try:
        ready(_join_address(public_host, started.port))
        await stop.wait()
        logger.info("authorizer shutting down")
    finally:
        await started.stop(grace=2.0)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _state_dir(args: argparse.Namespace) -> str:
    return options_from_args(AuthorityFolder, args, "authorizer").state_dir


def _open_authority(state_dir: str, run_id: Optional[str] = None, *, create: bool = False) -> RunAuthority:
    directory = Path(state_dir)
    if not create and not (directory / "authority.json").exists():
        raise ConfigError(f"--state-dir {state_dir} holds no authorizer: start `agora-node authorizer serve "
                          f"--state-dir {state_dir} --run-id RUN` first")
    checked(AuthorizerServeOptions, "authorizer", run_id=run_id)  # (the flags are checked: the demo's calls)
    try:
        return RunAuthority(directory, run_id=run_id)
    except ValueError as error:
        raise ConfigError(str(error).replace("give the run id", "give --run-id")) from None


def _public_host(settings: AuthorizerSettings) -> str:
    if settings.public_host:
        return settings.public_host
    try:
        unspecified = ipaddress.ip_address(settings.host).is_unspecified
    except ValueError:
        unspecified = False
    return socket.getfqdn() if unspecified else settings.host


def _cmd_serve(args: argparse.Namespace) -> int:
    from agora.auth.service import AuthorizerService
    from agora.node.ban_publisher import BanPublisher
    from agora.pipeline.config import config_to_dict
    from agora.pipeline.fingerprint import run_fingerprint

    state_dir = _state_dir(args)
    serving = options_from_args(AuthorizerServeOptions, args, "authorizer")  # a bad one: one line naming it
    settings = options_from_args(AuthorizerSettings, args, "authorizer")
    metrics_settings = options_from_args(MetricsOptions, args, "metrics")
    config = run_config(args)
    authority = _open_authority(state_dir, serving.run_id, create=True)
    fingerprint = run_fingerprint(config)
    plain = config_to_dict(config)
    # With the swarm's address, the authorizer reads the workers' announced throughput from the DHT
    # (as an operator peer it credentials itself) and assigns a joining worker the least covered stage.
    own = authority.mint(Path(state_dir) / "self", role="operator",
                         lifetime_s=authority.issuing_lifetime_s) if serving.initial_peers else None
    swarm = _coverage_peer(own, initial_peers=serving.initial_peers) if own is not None else None
    coverage = members = publisher = None

    def keep_own_credential() -> None:
        if own.remaining_s() < authority.issuing_lifetime_s / 4:  # the DHT process re-reads the file
            authority.mint(own.directory, role="operator", lifetime_s=authority.issuing_lifetime_s)

    if swarm is not None:
        publisher = BanPublisher(authority, swarm)

        async def read_coverage() -> dict[int, float]:
            keep_own_credential()
            return await _read_coverage(swarm, authority.run_id, fingerprint, service.admitted())

        async def read_members(stage: int) -> list:
            keep_own_credential()
            return await read_stage_members(swarm, authority.run_id, fingerprint, stage, config.train.seq_len)
        coverage, members = read_coverage, read_members
    else:
        logger.warning("no DHT peer (serve with --initial-peers): bans will only refuse renewals, not reach the swarm")
    # Admissions and renewals by status code (and the bytes they cost) are its gRPC metrics; a refused
    # join is a reply, not a status: counted by the floor or field it names.
    metrics = NodeMetrics.for_role(metrics_settings, role="authorizer", run_id=authority.run_id,
                                   version=package_version())
    hooks = (MetricsHook(RpcServerMetrics(metrics.registry)),)
    refusals = Counter("agora_authorizer_refusals", "Joins refused with a reason, by the floor or field it names",
                       ["field"], registry=metrics.registry)
    # Trainers' reports of flagged workers: accepted, accepted and banning the worker, or the status that
    # refused them (permission_denied: a caller without a trainer credential).
    reports = Counter("agora_authorizer_worker_reports", "Trainers' reports of flagged workers, by outcome",
                      ["outcome"], registry=metrics.registry)
    # Clean leaves: freed (a worker's slot), left (a node without one), or the status that refused them.
    leaves = Counter("agora_authorizer_leaves", "Nodes that said they leave, by outcome", ["outcome"],
                     registry=metrics.registry)
    # Joins' dry runs (`agora-node doctor`): reachable, unreachable (the dial-back failed), or refused before it.
    join_checks = Counter("agora_authorizer_join_checks", "Joins' dry runs (CheckJoin), by outcome", ["outcome"],
                          registry=metrics.registry)
    service = AuthorizerService(authority, settings, run_config=plain, fingerprint=fingerprint,
                                initial_peers=serving.initial_peers, stage_throughput=coverage,
                                stage_members=members,
                                on_refused=lambda field: refusals.labels(field=field).inc(),
                                on_report=lambda outcome: reports.labels(outcome=outcome).inc(),
                                on_leave=lambda outcome: leaves.labels(outcome=outcome).inc(),
                                on_join_check=lambda outcome: join_checks.labels(outcome=outcome).inc())
    state = Path(state_dir)
    join_path = Path(serving.join_file) if serving.join_file else state / JOIN_FILE

    def ready(address: str) -> None:
        write_private_file(state / SERVING_FILE, json.dumps({
            "authorizer": address, "config": plain, "initial_peers": list(serving.initial_peers),
            "stages": fingerprint.stages, "fingerprint": fingerprint.text()}, indent=1).encode(), mode=0o644)
        ticket = JoinFile(authorizer=address, root_fingerprint=authority.root_fingerprint, run_id=authority.run_id)
        ticket.write(join_path)
        print(f"authorizer of run {authority.run_id!r} serving at {address}")
        print(f"root fingerprint (nodes pin it): {authority.root_fingerprint}")
        print(f"join file: {join_path}", flush=True)
        if serving.ready_file:
            from agora.dht.bootstrap import write_ready_file

            write_ready_file(serving.ready_file, [address, authority.root_fingerprint])

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        publishing = None if publisher is None else asyncio.create_task(publisher.run(keep_own_credential))
        try:
            await serve_authorizer(service, settings.host, settings.port, public_host=_public_host(settings),
                                   ready=ready, stop=stop, interceptors=hooks)
        finally:
            if publishing is not None:
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)

    metrics.serve()  # after the coverage peer forked its DHT process
    try:
        run(main())
    except OSError as error:
        raise ConfigError(f"--host/--port: cannot listen on {settings.host}:{settings.port} ({error})") from None
    finally:
        if serving.ready_file:
            Path(serving.ready_file).unlink(missing_ok=True)
        if swarm is not None:
            swarm.shutdown()
        service.close()
        metrics.close()
    return 0


def _coverage_peer(own: NodeCredentials, *, initial_peers: tuple[str, ...]):
    """A client-mode DHT peer under the operator credential the authorizer minted for itself (it
    holds the CA; the credential lives as long as the issuing CA), or None if it cannot join."""
    from agora.dht.security import DHTSecurity
    from agora.dht.swarm import DHTRequestError, SwarmDHT

    try:
        return SwarmDHT.start(initial_peers=initial_peers, client_mode=True,
                              security=DHTSecurity.from_state_dir(own.directory))
    except DHTRequestError as error:
        logger.warning("cannot read the swarm (%s): assigning stages by admitted workers only", error)
        return None


def stage_coverage(n_stages: int, workers: dict, admitted) -> dict[int, float]:
    """Per stage: the announced throughput of its live workers (``workers``: stage -> WorkerRecords,
    from the DHT), plus a millionth per admitted worker so that among stages nobody has measured yet
    (all 0) the one with fewer workers comes first."""
    coverage = {stage: 0.0 for stage in range(n_stages)}
    for node in admitted:
        if node.role == "worker" and node.stage in coverage:
            coverage[node.stage] += 1e-6
    for stage, records in workers.items():
        if stage in coverage:
            coverage[stage] += sum(record.throughput for record in records if record.phase != Phase.LEAVING)
    return coverage


async def _read_coverage(swarm, run_id: str, fingerprint, admitted) -> dict[int, float]:
    from agora.dht.swarm import DHTRequestError

    try:
        workers = await swarm.all_workers_async(run_id, fingerprint.stages, fingerprint=fingerprint)
    except DHTRequestError as error:
        logger.warning("reading worker records failed (%s): assigning by admitted workers", error)
        workers = {}
    return stage_coverage(fingerprint.stages, workers, admitted)


async def read_stage_members(swarm, run_id: str, fingerprint, stage: int, seq_len: int) -> list:
    """The live workers of ``stage`` as a Join's dry run shows them (auth/join_check.py): each one's
    announced endpoint, compute in samples/s (its record's tokens/s over the run's sequence
    length, as trainers read it) and peer id; none when the DHT cannot be read."""
    from agora.dht.swarm import DHTRequestError
    from agora.protos.authorizer_adapter import StageMember

    try:
        records = await swarm.live_workers_async(run_id, stage, fingerprint=fingerprint)
    except DHTRequestError as error:
        logger.warning("reading worker records failed (%s): a dry run shows no members", error)
        return []
    return [StageMember(record.endpoint, record.throughput / seq_len, record.peer_id) for record in records
            if record.phase != Phase.LEAVING]


def _peer_id(text: str) -> str:
    if not _PEER_ID.fullmatch(text):
        raise ConfigError(f"PEER_ID: expected a base58 libp2p peer id, got {text[:80]!r}")
    return text


def _cmd_ban(args: argparse.Namespace) -> int:
    entry = _open_authority(_state_dir(args)).ban(_peer_id(args.peer_id), args.reason)
    print(f"banned {entry.peer_id}: {entry.reason or '(no reason given)'}; the serving authorizer publishes the ban "
          f"list to the swarm, whose nodes refuse it from their next heartbeat, and refuses its renewal")
    return 0


def _cmd_unban(args: argparse.Namespace) -> int:
    found = _open_authority(_state_dir(args)).unban(_peer_id(args.peer_id))
    print(f"unbanned {args.peer_id}" if found else f"{args.peer_id} was not banned")
    return 0


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).isoformat(timespec="seconds")


def _cmd_list(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    authority = _open_authority(state_dir)
    bans = sorted(authority.bans().values(), key=lambda entry: entry.banned_at)
    # Still holding a credential, and not banned since (a ban takes effect at the node's next renewal).
    banned = {entry.peer_id for entry in bans}
    admitted = [node for node in read_admitted(state_dir, time.time()) if node.peer_id not in banned]
    if args.json:
        print(json.dumps({"run_id": authority.run_id, "root_fingerprint": authority.root_fingerprint,
                          "bans": [asdict(entry) for entry in bans],
                          "admitted": [asdict(node) for node in admitted]}, indent=1))
        return 0
    print(f"run {authority.run_id!r}, root fingerprint {authority.root_fingerprint}")
    print(f"admitted ({len(admitted)}):")
    for node in admitted:
        stage = "-" if node.stage is None else node.stage
        print(f"  {node.peer_id}  {node.role:<7} stage {stage}  {node.address}  {node.device}  "
              f"expires {_when(node.expires_at)}")
    print(f"banned ({len(bans)}):")
    for entry in bans:
        print(f"  {entry.peer_id}  since {_when(entry.banned_at)}  {entry.reason}")
    return 0


def issue_credential(state_dir: str, out: str, *, role: str, run_id: Optional[str] = None, stage: Optional[int] = None,
                     lifetime_s: float = DEFAULT_CREDENTIAL_LIFETIME_S) -> NodeCredentials:
    """`agora-node authorizer issue`: a credential minted offline by the run's CA in `state_dir`
    (created with `run_id` if given), written to `out`; it names the run's config, DHT peers and
    authorizer once `serve` has recorded them. ConfigError in one line for a bad role or stage."""
    authority = _open_authority(state_dir, run_id, create=run_id is not None)
    serving_path = Path(state_dir) / SERVING_FILE
    serving: dict[str, Any] = json.loads(serving_path.read_text()) if serving_path.exists() else {}
    stages = serving.get("stages")
    if stage is not None and stages is not None and not 0 <= stage < stages:
        raise ConfigError(f"--stage: {stage} is out of range for this {stages}-stage run")
    try:
        return authority.mint(out, role=role, stage=stage, lifetime_s=lifetime_s, config=serving.get("config"),
                              initial_peers=tuple(serving.get("initial_peers", ())),
                              authorizer=serving.get("authorizer", ""))
    except ValueError as error:
        raise ConfigError(f"--{str(error)}" if str(error).startswith(("role", "stage")) else str(error)) from None


def _cmd_issue(args: argparse.Namespace) -> int:
    folder = options_from_args(AuthorityFolder, args, "authorizer")
    options = options_from_args(IssueOptions, args, "issue")
    identity = issue_credential(folder.state_dir, options.out, role=options.role, run_id=options.run_id,
                                stage=options.stage, lifetime_s=options.lifetime_s).identity()
    print(f"issued a {identity.describe()} credential in {options.out}, valid until {_when(identity.not_after)}")
    return 0


def add_authorizer_commands(commands: argparse._SubParsersAction) -> None:
    """Mount `authorizer serve|ban|unban|list|issue` on the top-level subcommands of agora-node."""
    parser = commands.add_parser("authorizer", help="the run's authorizer: admission, credentials, bans (operator)",
                                 description="Admit nodes to a run and issue their short-lived credentials; ban, "
                                             "list and mint credentials for the operator's own machines.")
    actions = parser.add_subparsers(dest="authorizer_command", required=True, metavar="ACTION")

    def state_dir(sub: argparse.ArgumentParser) -> None:
        add_option_flags(sub, AuthorityFolder)

    serve = actions.add_parser("serve", help="serve admission and renewal (creates the run's CA on first start)",
                               description="Serve agora.v1.Authorizer (gRPC over TLS under the run's root CA, health, "
                                           "reflection). Prints the address and the root fingerprint nodes pin; "
                                           "writes STATE_DIR/join.json.")
    state_dir(serve)
    add_option_flags(serve, AuthorizerServeOptions)
    add_metrics_arguments(serve)
    add_option_flags(serve.add_argument_group("authorizer", "where it listens; whom it admits, how fast, and when "
                                                            "trainers' reports ban a worker"), AuthorizerSettings)
    add_run_arguments(serve, steps_help="planned run length in global batches (sets the lr schedule)")
    serve.set_defaults(handler=_cmd_serve)

    ban = actions.add_parser("ban", help="ban a peer: its joins and renewals are refused",
                             description="Ban a peer id. The serving authorizer publishes the signed ban list in "
                                         "the DHT (with --initial-peers), and every node refuses the peer from its "
                                         "next heartbeat: its DHT requests, records, averaging and calls; its "
                                         "renewal is refused too.")
    ban.add_argument("peer_id", metavar="PEER_ID")
    ban.add_argument("--reason", default="", help="told to the peer when it is refused")
    state_dir(ban)
    ban.set_defaults(handler=_cmd_ban)

    unban = actions.add_parser("unban", help="lift a ban")
    unban.add_argument("peer_id", metavar="PEER_ID")
    state_dir(unban)
    unban.set_defaults(handler=_cmd_unban)

    listing = actions.add_parser("list", help="banned peers and admitted nodes")
    listing.add_argument("--json", action="store_true", help="one JSON object")
    state_dir(listing)
    listing.set_defaults(handler=_cmd_list)

    issue = actions.add_parser("issue", help="mint a credential for a machine of the operator's (offline)",
                               description="Create (or reuse) a node key in --out and write a credential for it, "
                                           "with the run config and bootstrap peers the serving authorizer was given.")
    add_option_flags(issue, IssueOptions)
    state_dir(issue)
    issue.set_defaults(handler=_cmd_issue)
