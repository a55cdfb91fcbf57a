"""The inference commands: `join --serve-only` flags, `agora-node generate` and `agora-node serve`.

`generate` and `serve` are clients of the swarm (role `client`): admitted like every node
(node/admission.py; or --insecure), a read-only DHT peer in client mode to find the serving
replicas, and a `SwarmGenerator` over them. Their run config is the one the workers serve: name
the same checkpoint (`--checkpoint C`, or `--config C`), or the same run flags.

`serve`'s address, model name, API keys and bounds on load are `ServeOptions`, and both commands'
call deadline and `--checkpoint` (another name for `--config`) are `ClientOptions`
(node/inference/options.py); the key file is read before anything starts, so a bad one is a
one-line error and exit 2. `generate`'s length and sampling flags are `GenerateOptions`, the
request's parameters, with the bounds the HTTP API's requests have.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import Awaitable, Callable, TypeVar

from agora.node.admission import (AdmissionOptions, add_admission_arguments, admit_node, config_chooser,
                                  starting_dht_security)
from agora.node.inference.options import ClientOptions, GenerateOptions, ServeOptions
from agora.node.rpc.server import is_loopback_host
from agora.node.run_flags import add_run_arguments, run_config
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import add_option_flags, options_from_args

__all__ = ["add_client_commands", "run_client", "serve_only_config_flags"]

logger = logging.getLogger("agora.node.inference")

T = TypeVar("T")


def serve_only_config_flags(args: argparse.Namespace) -> None:
    """Check `join --serve-only`'s flags; the checkpoint is the run config unless --config names one."""
    if not args.serve_only:
        if args.checkpoint is not None:
            raise ConfigError("--checkpoint: only with --serve-only (a training worker resumes from --checkpoint-dir)")
        return
    if args.checkpoint is None:
        raise ConfigError("--serve-only: needs --checkpoint C, the weights to serve")
    if args.checkpoint_dir is not None or args.sync:
        raise ConfigError("--serve-only: a serving worker never trains: drop --checkpoint-dir and --sync")
    if args.config is None:
        args.config = args.checkpoint


# ---------------------------------------------------------------------------------------------- clients


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    # --seed is the sampling seed here (as in OpenAI's API); the run's seed is --run-seed.
    add_run_arguments(parser, steps_help="the run's --steps (part of its config, hence of its fingerprint)",
                      seed_flag="--run-seed")
    add_swarm_flags(parser)
    add_option_flags(parser.add_argument_group("client", "the run config it serves, how it calls the workers"),
                     ClientOptions)
    add_admission_arguments(parser)


def add_client_commands(commands) -> None:
    generate = commands.add_parser("generate", help="generate text through the swarm's serving workers",
                                   description="Route a generation through one worker per stage (prefill, then "
                                               "one decode per token); a failed worker's session moves to "
                                               "another replica and the output is unchanged.")
    _add_client_arguments(generate)
    generate.add_argument("--prompt", required=True, help="the text to continue")
    add_option_flags(generate.add_argument_group("generation", "how long, and how each token is drawn"),
                     GenerateOptions)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    generate.set_defaults(handler=cmd_generate)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP API in front of the swarm",
                                description="Serve /v1/completions, /v1/chat/completions (server-sent events "
                                            "with stream=true) and /v1/models over the swarm's serving workers. "
                                            "Without --api-key-file the API is open to anyone who reaches "
                                            "--host:--port; with it, each request needs 'Authorization: Bearer "
                                            "KEY' (OpenAI's clients: api_key=KEY).")
    _add_client_arguments(serve)
    add_option_flags(serve.add_argument_group("the API", "where it listens, who may use it, and how much at once"),
                     ServeOptions)
    serve.set_defaults(handler=cmd_serve)


def _client_config(args: argparse.Namespace, client: ClientOptions):
    if client.checkpoint is not None:
        if args.config is not None:
            raise ConfigError("--checkpoint and --config both name the run config: give one")
        args.config = client.checkpoint
    swarm = options_from_args(SwarmOptions, args, "swarm")
    admission_options = options_from_args(AdmissionOptions, args, "admission")
    return admit_node(admission_options, role="client", run_id=swarm.run_id, stage=None,
                      config_for=config_chooser(args, run_config), initial_peers=swarm.initial_peers)


def run_client(admission, call_timeout_s: float, main: Callable[..., Awaitable[T]]) -> T:
    """Blocking: a client-mode DHT peer, the swarm generator, `main(generator)`; then everything closed."""
    from agora.auth.admission import CredentialRenewer
    from agora.dht.swarm import SwarmDHT
    from agora.node.inference.discovery import DHTReplicas
    from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
    from agora.node.rpc.server import run as run_loop
    from agora.node.rpc.tls import TlsChannels
    from agora.pipeline.fingerprint import run_fingerprint

    config, credentials = admission.config, admission.credentials
    if credentials is not None and credentials.identity().role not in ("client", "trainer", "operator"):
        raise ConfigError(f"credential in {credentials.directory}: inference needs a client, trainer or operator "
                          f"credential, this one is a {credentials.identity().role} credential")
    # hivemind forks its DHT process: start it before the event loop and gRPC channels exist.
    security = starting_dht_security(admission.authorizer, credentials)
    swarm = SwarmDHT.start(initial_peers=admission.initial_peers, client_mode=True, security=security)
    discovery = DHTReplicas(swarm, admission.run_id, len(config.layer_split), fingerprint=run_fingerprint(config))

    async def body() -> T:
        channels = TlsChannels(credentials) if credentials is not None else None
        task = asyncio.current_task()
        revoked: list[str] = []

        def on_revoked(reason: str) -> None:  # banned, or the credential ran out: stop serving
            revoked.append(reason)
            task.cancel()

        try:
            async with contextlib.AsyncExitStack() as stack:
                if credentials is not None and admission.authorizer:
                    await stack.enter_async_context(CredentialRenewer(admission.authorizer, credentials,
                                                                      on_revoked=on_revoked))
                options = GeneratorOptions(run_id=admission.run_id, call_timeout_s=call_timeout_s)
                generator = await stack.enter_async_context(SwarmGenerator(config, discovery, options,
                                                                           channels=channels))
                return await main(generator)
        except asyncio.CancelledError:
            if revoked:
                raise ConfigError(f"the credential was revoked: {revoked[0]}") from None
            raise

    try:
        return run_loop(body())
    finally:
        swarm.shutdown()


def cmd_generate(args: argparse.Namespace) -> int:
    from agora.node.inference.generator import Generation, GenerationFailed
    from agora.node.inference.text import TextStream
    from agora.pipeline.inference import Sampling
    from agora.pipeline.tokenizer import load_tokenizer

    client = options_from_args(ClientOptions, args, "client")
    request = options_from_args(GenerateOptions, args, "generate")
    sampling = Sampling(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
    admission = _client_config(args, client)
    tokenizer = load_tokenizer(admission.config.data.tokenizer)
    prompt = [int(t) for t in tokenizer.encode(args.prompt)]

    async def main(generator) -> int:
        outcome = Generation()
        text = TextStream(tokenizer)
        try:
            async for token in generator.stream(prompt, request.max_new_tokens, sampling, (tokenizer.eos_id,), outcome):
                delta = text.add(token)
                if not args.json:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
        except GenerationFailed as error:
            raise ConfigError(f"generation failed: {error}") from None
        tail = text.finish()
        if args.json:
            print(json.dumps({"text": text.text, "tokens": outcome.tokens, "finish_reason": outcome.finish_reason,
                              "retries": outcome.retries, "route": outcome.route}))
        else:
            print(tail)
            stats = generator.stats
            print(f"generate: {len(outcome.tokens)} tokens, finish {outcome.finish_reason}, retries {stats.retries}, "
                  f"replays {stats.replays}", file=sys.stderr)
        return 0

    return run_client(admission, client.call_timeout_s, main)


def cmd_serve(args: argparse.Namespace) -> int:
    from agora.dht.bootstrap import write_ready_file
    from agora.node.inference.api_keys import load_api_keys
    from agora.node.inference.openai_api import OpenAIServer

    options = options_from_args(ServeOptions, args, "serve")
    client = options_from_args(ClientOptions, args, "client")
    keys = load_api_keys(options.api_key_file) if options.api_key_file is not None else None
    if keys is None and not is_loopback_host(options.host):
        print(f"serve: WARNING: no --api-key-file: anyone who reaches {options.host}:{options.port} can use the API",
              file=sys.stderr, flush=True)
    admission = _client_config(args, client)
    from agora.pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(admission.config.data.tokenizer)
    model_name = options.model_name or f"agora-{admission.config.name}"

    async def main(generator) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        server = OpenAIServer(generator, tokenizer, model_name=model_name, keys=keys, options=options)
        url = await server.start(options.host, options.port)
        if options.ready_file:
            write_ready_file(options.ready_file, [url])
        access = f"{len(keys.names)} API keys" if keys is not None else "no API key needed"
        print(f"serve: OpenAI-compatible API at {url} (model {model_name!r}, {access}, at most "
              f"{options.max_concurrent_requests} completions at once); Ctrl-C stops", file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop()
        return 0

    return run_client(admission, client.call_timeout_s, main)

