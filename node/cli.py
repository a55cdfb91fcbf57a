"""`agora-node`: one console script, one subcommand per role.

Each subcommand parses its flags, builds its objects and runs; the work lives in the modules it
calls. A user's mistake (bad config, missing file) ends in one readable line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from agora.node.admission import add_admission_arguments
from agora.pipeline.checkpoint import CheckpointError
from agora.pipeline.config import ConfigError, RunConfig, load_config

__all__ = ["main", "build_parser"]


def _run_config(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The run flags applied to `--config` (default tiny), or to `base` (the config an authorizer serves)."""
    config = base if base is not None and args.config is None else load_config(args.config or "tiny")
    if getattr(args, "seed", None) is not None:
        config = replace(config, seed=args.seed, model=replace(config.model, basis_seed=args.seed),
                         data=replace(config.data, seed=args.seed))
    if getattr(args, "stages", None) is not None:
        config = config.with_stages(args.stages)
    if getattr(args, "batch_size", None) is not None:
        config = replace(config, train=replace(config.train, batch_size=args.batch_size))
    if getattr(args, "microbatches", None) is not None:
        config = replace(config, train=replace(config.train, microbatches=args.microbatches))
    if getattr(args, "schedule_steps", None) is not None:
        config = replace(config, optim=replace(config.optim, total_steps=args.schedule_steps))
    elif getattr(args, "steps", None) is not None and args.steps > config.optim.total_steps:
        # A run longer than the schedule would sit at the floor lr; stretch the schedule instead.
        config = replace(config, optim=replace(config.optim, total_steps=args.steps))
    sync = {name: getattr(args, flag) for name, flag in _SYNC_FLAGS.items() if getattr(args, flag, None) is not None}
    if sync:
        config = replace(config, sync=replace(config.sync, **sync))
    return config.validate()


# config.sync fields set by `join`/`demo` flags (argparse destination of each flag).
_SYNC_FLAGS = {"method": "averaging", "every_steps": "averaging_every", "fraction": "averaging_fraction",
               "average_optimizer_state": "average_optimizer_state", "aggregation": "aggregation"}


def _add_pinned_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pinned-weights", type=int, default=None, metavar="N",
                        help="earlier weight versions a worker keeps so that each backward runs on the weights "
                             "its forward used (one copy of the stage's parameters each; 0: recompute on the "
                             "current weights; default 2)")
    parser.add_argument("--keep-graphs", type=int, default=None, metavar="N",
                        help="head and body workers keep up to N forward autograd graphs, so a Backward skips "
                             "recomputing its forward while the weights are unchanged (memory: the forward's "
                             "activations each; default 0: recompute every Backward)")


def _add_in_flight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                        help="a fixed number of microbatches in the pipeline at once (default: adaptive, enough to "
                             "hide the measured round trips behind the busiest stage's compute)")
    parser.add_argument("--max-staleness", type=float, default=None, metavar="BATCHES",
                        help="adaptive depth: at most this many global batches' microbatches in flight (default 1; "
                             "more in flight is faster over long round trips and converges worse)")


def _add_time_budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="trainers start no global batch after S seconds of training (those in flight "
                             "finish, then the held-out evaluation); --steps still sets the schedule")


def _add_averaging_arguments(parser: argparse.ArgumentParser) -> None:
    """How replicas of a stage stay together; must be identical on every worker of the run."""
    parser.add_argument("--averaging", default=None, choices=["sparta", "diloco", "none"],
                        help="sync method between replicas of a stage (default: the config's sync.method)")
    parser.add_argument("--averaging-every", type=int, default=None, metavar="STEPS",
                        help="local steps between averaging rounds (default: the config's sync.every_steps)")
    parser.add_argument("--averaging-fraction", type=float, default=None, metavar="P",
                        help="sparta: share of the stage averaged per round (default: sync.fraction)")
    parser.add_argument("--average-optimizer-state", action="store_true", default=None,
                        help="sparta: also average the Adam moments of the slice")
    parser.add_argument("--aggregation", default=None, choices=["centered_clip", "mean"],
                        help="how a reducer combines its group: centered_clip (weight caps, outliers rejected, "
                             "CenteredClip, bounded moves; the default) or mean (hivemind's plain weighted mean, "
                             "for trusted machines only)")


def _cmd_train_local(args: argparse.Namespace) -> int:
    from agora.pipeline.centralized import CentralizedTrainer, terminal_progress
    from agora.pipeline.data import build_data

    config = _run_config(args)
    data = build_data(config)
    log_json = open(args.log_json, "a" if args.resume else "w") if args.log_json else None
    try:
        trainer = CentralizedTrainer(config, data, wire_dtype=args.wire_dtype, checkpoint_dir=args.checkpoint_dir,
                                     log_json=log_json, progress=terminal_progress())
        if args.resume:
            if not args.checkpoint_dir:
                raise ConfigError("--resume needs --checkpoint-dir")
            if trainer.resume():
                logging.info("resumed from step %d", trainer.step)
        records = trainer.run(args.steps)
        final = trainer.evaluate()
    finally:
        if log_json is not None:
            log_json.close()
    last = records[-1].loss if records else float("nan")
    tokens_per_s = records[-1].tokens_per_s if records else 0.0
    print(f"train-local: {config.name} stages={len(config.layer_split)} steps={trainer.step} "
          f"loss={last:.4f} heldout={final:.4f} tokens/s={tokens_per_s:,.0f}")
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from agora.pipeline.checkpoint import load_checkpoint
    from agora.pipeline.interop import save_pretrained
    from agora.pipeline.stages import assemble_model

    step, config, states, _ = load_checkpoint(args.checkpoint)
    if sorted(s.index for s in states) != list(range(len(config.layer_split))):
        raise ConfigError(f"--checkpoint: {args.checkpoint} does not hold every stage (has {[s.index for s in states]})")
    model = assemble_model(config.model, [s.model for s in states])
    save_pretrained(model, args.out)
    print(f"export-hf: step {step} -> {args.out}")
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from agora.dht.bootstrap import run_bootstrap
    from agora.dht.swarm import DHTRequestError

    try:
        return run_bootstrap(args.host, args.port, tuple(args.initial_peers), args.identity_path, args.ready_file,
                             state_dir=args.state_dir, insecure=args.insecure)
    except (ValueError, DHTRequestError) as error:
        raise ConfigError(str(error)) from None


def _cmd_join(args: argparse.Namespace) -> int:
    from agora.node.worker.join import JoinOptions, run_worker

    from agora.node.admission import AdmissionOptions, admit_node, config_chooser, free_port
    from agora.node.inference.commands import serve_only_config_flags
    from agora.node.rpc.server import announced_host

    serve_only_config_flags(args)  # --serve-only: the checkpoint is the run config unless --config
    worker_options = _worker_options(args)
    if worker_options.port == 0:  # the authorizer's dial-back and then the gRPC server take this port
        worker_options = replace(worker_options, port=free_port(worker_options.host))
    announce = (announced_host(worker_options.host, worker_options.announce_host), worker_options.port)
    admission = admit_node(AdmissionOptions.from_args(args), role="worker", run_id=args.run_id, stage=args.stage,
                           config_for=config_chooser(args, _run_config), initial_peers=tuple(args.initial_peers),
                           announce=announce, listen_host=worker_options.host)
    options = JoinOptions(stage=admission.stage, run_id=admission.run_id, initial_peers=admission.initial_peers,
                          dht_host=args.dht_host, dht_port=args.dht_port, heartbeat_s=args.heartbeat,
                          ready_file=args.ready_file, checkpoint_dir=args.checkpoint_dir,
                          stats_file=args.stats_file, authorizer=admission.authorizer,
                          serve_checkpoint=args.checkpoint if args.serve_only else None)
    return run_worker(admission.config, options, worker_options, credentials=admission.credentials)


def _worker_options(args: argparse.Namespace):
    from agora.node.inference.commands import inference_options
    from agora.node.worker.worker import WorkerOptions

    pinned = {} if args.pinned_weights is None else {"pinned_weights": args.pinned_weights}
    if args.keep_graphs is not None:
        pinned["keep_graphs"] = args.keep_graphs
    return WorkerOptions(host=args.host, port=args.port, announce_host=args.announce_host, synchronous=args.sync,
                         local_batch=args.local_batch, max_queue=args.max_queue, wire_dtype=args.wire_dtype,
                         max_rows=args.max_rows, serve_only=args.serve_only, inference=inference_options(args),
                         **pinned).validate()


def _cmd_trainer(args: argparse.Namespace) -> int:
    import json

    from agora.node.trainer.trainer import TrainerOptions, run_swarm_trainer

    from agora.node.admission import AdmissionOptions, admit_node, config_chooser

    if not 0 <= args.trainer_index < args.trainers:
        raise ConfigError(f"--trainer-index: {args.trainer_index} out of range for --trainers {args.trainers}")
    admission = admit_node(AdmissionOptions.from_args(args), role="trainer", run_id=args.run_id, stage=None,
                           config_for=config_chooser(args, _run_config), initial_peers=tuple(args.initial_peers))
    options = TrainerOptions(run_id=admission.run_id, trainer_index=args.trainer_index, trainers=args.trainers,
                             synchronous=args.sync, max_in_flight=args.max_in_flight, wire_dtype=args.wire_dtype,
                             time_budget_s=args.time_budget,
                             **({} if args.max_staleness is None else {"max_staleness": args.max_staleness}))
    if args.time_budget is not None and not args.time_budget > 0:
        raise ConfigError(f"--time-budget: must be positive, got {args.time_budget:g}")
    if options.max_staleness <= 0:
        raise ConfigError(f"--max-staleness: must be positive, got {options.max_staleness:g}")
    log_json = open(args.log_json, "w") if args.log_json else None
    try:
        summary = run_swarm_trainer(admission.config, options, initial_peers=admission.initial_peers,
                                    steps=args.steps, log_json=log_json, evaluate=not args.no_eval,
                                    credentials=admission.credentials, authorizer=admission.authorizer)
    finally:
        if log_json is not None:
            log_json.close()
    text = json.dumps(summary)
    if args.summary_json:
        Path(args.summary_json).write_text(text + "\n")
    print(text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from agora.bench.suite import main as bench_main

    try:
        return bench_main(args)
    except ValueError as error:  # an unknown profile or preset, in one line
        raise ConfigError(str(error)) from None


def _cmd_demo(args: argparse.Namespace) -> int:
    from agora.node.demo.demo import DemoOptions, run_demo

    if args.checkpoint is not None:
        args.checkpoint = str(Path(args.checkpoint).resolve())  # the children run in the demo's workdir
    if args.serve and args.config is None and args.checkpoint is not None:
        args.config = args.checkpoint  # a serving swarm runs the checkpoint's config
    _run_config(args)  # refuse a bad config before starting any process
    return run_demo(DemoOptions.from_args(args))


def _add_run_arguments(parser: argparse.ArgumentParser, *, steps_help: str, averaging: bool = True,
                       seed_flag: str = "--seed") -> None:
    """Flags that must be identical on every process of one run (they are all in its fingerprint,
    the averaging ones included: a trainer or an authorizer with other sync settings is another run)."""
    parser.add_argument("--config", default=None,
                        help="preset name (tiny, small, pythia-14m, pluralis-8b), TOML file or checkpoint folder "
                             "(default: the run config the authorizer serves, else tiny)")
    parser.add_argument(seed_flag, dest="seed", type=int, default=None, help="run seed (basis, init and data order)")
    parser.add_argument("--stages", type=int, default=None, help="split the blocks evenly over this many stages")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per global batch")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per global batch")
    parser.add_argument("--steps", type=int, default=100, help=steps_help)
    parser.add_argument("--schedule-steps", type=int, default=None, metavar="STEPS",
                        help="length of the learning-rate schedule in global batches (default: the config's "
                             "optim.total_steps, stretched to --steps when shorter)")
    if averaging:
        _add_averaging_arguments(parser)


def _add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", default="agora", help="run identifier shared by every peer of the run")
    parser.add_argument("--initial-peers", nargs="+", action="extend", default=[], metavar="MADDR",
                        help="DHT multiaddrs to join through (printed by `agora-node bootstrap`)")
    parser.add_argument("--sync", action="store_true",
                        help="synchronous mode: one replica per stage, step barrier after every global batch")
    parser.add_argument("--wire-dtype", default="fp32", choices=["fp32", "bf16", "fp16", "int8"],
                        help="encoding of the boundary tensors this process sends (default fp32)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora-node", description="Agora node: peer-to-peer pipeline-parallel training of subspace-compressed transformers.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train-local", help="centralized reference run, stage by stage in one process",
                                description="Train the model centrally through the same stages and wire codec "
                                            "the swarm uses; the reference the swarm is compared with.")
    _add_run_arguments(train, steps_help="optimizer steps (global batches) in total", averaging=False)
    train.add_argument("--wire-dtype", default="fp32", choices=["fp32", "bf16", "fp16", "int8"],
                       help="encoding of boundary tensors (default fp32, lossless)")
    train.add_argument("--log-json", default=None, help="write one JSON object per step to this file")
    train.add_argument("--checkpoint-dir", default=None, help="write atomic checkpoints here")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    train.set_defaults(handler=_cmd_train_local)

    export = commands.add_parser("export-hf", help="write a transformers checkpoint (config.json + safetensors)",
                                 description="Assemble every stage of a checkpoint into one model and save it so "
                                             "AutoModelForCausalLM.from_pretrained loads it.")
    export.add_argument("--checkpoint", required=True, help="checkpoint folder (or a folder with 'latest')")
    export.add_argument("--out", required=True, help="output folder")
    export.set_defaults(handler=_cmd_export_hf)

    from agora.dht.bootstrap import add_bootstrap_arguments

    bootstrap = commands.add_parser("bootstrap", help="start a DHT peer that others join first",
                                    description="Start a hivemind DHT peer and print the multiaddrs that other "
                                                "peers pass as --initial-peers; serves until SIGINT/SIGTERM.")
    add_bootstrap_arguments(bootstrap)
    bootstrap.set_defaults(handler=_cmd_bootstrap)

    join = commands.add_parser("join", help="host one replica of one pipeline stage (contributor)",
                               description="Serve one pipeline stage over gRPC, announce it in the DHT, train it; "
                                           "SIGTERM leaves cleanly (withdraw, finish in-flight, checkpoint).")
    _add_run_arguments(join, steps_help="planned run length in global batches (sets the lr schedule)")
    _add_swarm_arguments(join)
    join.add_argument("--stage", type=int, default=None,
                      help="pipeline stage index to host (default: the authorizer assigns the stage least covered "
                           "by announced throughput; required with --insecure)")
    join.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on")
    join.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
    join.add_argument("--announce-host", default=None, metavar="H",
                      help="address peers dial for the gRPC server, when it differs from --host (a proxy, NAT, a "
                           "public address); default: --host, or for 0.0.0.0/:: the outbound interface's address")
    join.add_argument("--dht-host", default="127.0.0.1", help="address the DHT peer listens on")
    join.add_argument("--dht-port", type=int, default=0, help="DHT port (0: pick a free one)")
    join.add_argument("--heartbeat", type=float, default=5.0, help="seconds between DHT announces")
    join.add_argument("--local-batch", type=int, default=None,
                      help="asynchronous mode: step on this replica's own samples, every this many, instead of "
                           "on the trainers' completed-batch reports (the default: one step per global batch, "
                           "shared by the stage's replicas)")
    join.add_argument("--max-queue", type=int, default=8, help="requests in flight before RESOURCE_EXHAUSTED")
    join.add_argument("--max-rows", type=int, default=None, metavar="N",
                      help="rows a request may carry (default: the run's train.microbatch_size; only raises it)")
    _add_pinned_weights_argument(join)
    join.add_argument("--ready-file", default=None, help="write the gRPC endpoint and peer id here once serving")
    join.add_argument("--checkpoint-dir", default=None, help="resume from and checkpoint into this folder")
    join.add_argument("--stats-file", default=None, help="write the averaging counters here (JSON) on exit")
    from agora.node.inference.commands import add_client_commands, add_serving_arguments

    add_serving_arguments(join)
    add_admission_arguments(join)
    join.set_defaults(handler=_cmd_join)

    trainer = commands.add_parser("trainer", help="push microbatches through the swarm",
                                  description="Take data units, route microbatches through one worker per stage, "
                                              "reroute on failure; logs the train-local JSON schema.")
    _add_run_arguments(trainer, steps_help="global batches of the whole run (over all trainers)")
    _add_swarm_arguments(trainer)
    trainer.add_argument("--trainer-index", type=int, default=0, help="this trainer's index among --trainers")
    trainer.add_argument("--trainers", type=int, default=1, help="trainers sharing the run's global batches")
    _add_in_flight_arguments(trainer)
    _add_time_budget_argument(trainer)
    trainer.add_argument("--log-json", default=None, help="write one JSON object per global batch here")
    trainer.add_argument("--summary-json", default=None, help="write the final summary here")
    trainer.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    add_admission_arguments(trainer)
    trainer.set_defaults(handler=_cmd_trainer)

    demo = commands.add_parser("demo", help="a whole swarm on this machine, one process per role",
                               description="Start bootstrap, workers and trainers on loopback, each as the "
                                           "`agora-node <role>` command a user would run, train, and summarize.")
    _add_run_arguments(demo, steps_help="global batches in total (over all trainers)")
    demo.add_argument("--replicas", type=int, default=1, help="workers per stage")
    demo.add_argument("--trainers", type=int, default=1, help="trainer processes")
    demo.add_argument("--sync", action="store_true",
                      help="synchronous mode (needs --replicas 1 --trainers 1): must equal train-local")
    _add_in_flight_arguments(demo)
    _add_pinned_weights_argument(demo)
    _add_time_budget_argument(demo)
    demo.add_argument("--log-json", default=None, help="one JSON line per global batch, run-wide step")
    demo.add_argument("--summary-json", default=None, help="write the run summary here")
    demo.add_argument("--workdir", default=None, help="keep logs and ready files here (default: a temp folder)")
    demo.add_argument("--kill-worker-at", type=int, default=None, metavar="STEP",
                      help="fault drill: kill -9 one worker of the last stage after STEP global batches")
    demo.add_argument("--heartbeat", type=float, default=1.0, metavar="S",
                      help="seconds between the workers' DHT announces (default 1: quick failure detection; "
                           "`join` defaults to 5)")
    demo.add_argument("--insecure", action="store_true",
                      help="run without the authorizer: no admission, no TLS, no signed DHT records")
    demo.add_argument("--credential-lifetime", type=float, default=None, metavar="S",
                      help="seconds each credential is valid (nodes renew at half life; default: the authorizer's, "
                           "1 hour)")
    demo.add_argument("--serve", action="store_true",
                      help="serve --checkpoint instead of training: serve-only workers and the OpenAI-compatible "
                           "API, up until Ctrl-C")
    demo.add_argument("--checkpoint", default=None, metavar="C", help="with --serve: the checkpoint to serve")
    demo.add_argument("--http-port", type=int, default=8000, metavar="P", help="with --serve: the API's port")
    demo.set_defaults(handler=_cmd_demo, stages=3, steps=200)

    bench = commands.add_parser("bench", help="the benchmark suite: one run, one results table (bench/RESULTS.md)",
                                description="Run the benchmark suite (wire bytes, swarm vs train-local, the WAN "
                                            "profiles, averaging at equal time and equal tokens) and write its "
                                            "table; the WAN rows need root.")
    bench.add_argument("--quick", action="store_true",
                       help="every row with a few steps each (minutes): checks the suite runs, not its figures; "
                            "writes to a temporary folder unless --out")
    bench.add_argument("--profile", action="append", default=None, metavar="P",
                       help="WAN profile for row 3 (repeatable; default: every profile, --quick: lan and "
                            "agora-floor)")
    bench.add_argument("--config", action="append", default=None, metavar="PRESET",
                       help="preset for rows 2 and 3 (repeatable; default tiny and small, --quick: tiny)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default=None, help="the results file (default bench/RESULTS.md)")
    bench.add_argument("--json", default=None, metavar="F", help="also write every raw figure here")
    bench.add_argument("--workdir", default=None, help="keep every run's logs here (default: a temp folder)")
    bench.set_defaults(handler=_cmd_bench)

    from agora.node.authorizer import add_authorizer_commands

    add_authorizer_commands(commands)
    add_client_commands(commands, add_run_arguments=_add_run_arguments, run_config=_run_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, CheckpointError) as error:
        print(f"agora-node {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"agora-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
