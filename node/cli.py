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

from agora.pipeline.checkpoint import CheckpointError
from agora.pipeline.config import ConfigError, RunConfig, load_config

__all__ = ["main", "build_parser"]


def _run_config(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config)
    if getattr(args, "seed", None) is not None:
        config = replace(config, seed=args.seed, model=replace(config.model, basis_seed=args.seed),
                         data=replace(config.data, seed=args.seed))
    if getattr(args, "stages", None) is not None:
        config = config.with_stages(args.stages)
    if getattr(args, "microbatches", None) is not None:
        config = replace(config, train=replace(config.train, microbatches=args.microbatches))
    if getattr(args, "steps", None) is not None and args.steps > config.optim.total_steps:
        # A run longer than the schedule would sit at the floor lr; stretch the schedule instead.
        config = replace(config, optim=replace(config.optim, total_steps=args.steps))
    return config.validate()


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora-node", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train-local", help="centralized reference run, stage by stage in one process",
                                description="Train the model centrally through the same stages and wire codec "
                                            "the swarm uses; the reference the swarm is compared with.")
    train.add_argument("--config", default="tiny", help="preset name (tiny, small, pythia-14m, pluralis-8b) or TOML file")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps (global batches) in total")
    train.add_argument("--seed", type=int, default=None, help="run seed (basis, init and data order)")
    train.add_argument("--stages", type=int, default=None, help="split the blocks evenly over this many stages")
    train.add_argument("--microbatches", type=int, default=None, help="microbatches per global batch")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
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
