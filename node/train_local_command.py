"""`agora-node train-local`: the centralized reference run, stage by stage in one process, with
the wire codec the swarm uses between stages, so that a swarm's run can be compared with it."""

from __future__ import annotations

import argparse
import logging

from agora.node.run_flags import add_run_arguments, run_config
from agora.node.trainer.options import TrainLocalOptions
from agora.pipeline.files import hold_folder
from agora.pipeline.option_flags import add_option_flags, options_from_args

__all__ = ["add_train_local_command"]


def add_train_local_command(commands) -> None:
    train = commands.add_parser("train-local", help="centralized reference run, stage by stage in one process",
                                description="Train the model centrally through the same stages and wire codec "
                                            "the swarm uses; the reference the swarm is compared with.")
    add_run_arguments(train, steps_help="optimizer steps (global batches) in total", computes=True)
    add_option_flags(train.add_argument_group("train-local", "how the reference run computes, and its files"),
                     TrainLocalOptions)
    train.set_defaults(handler=_cmd_train_local)


def _cmd_train_local(args: argparse.Namespace) -> int:
    from agora.node.progress import Progress
    from agora.pipeline.centralized import CentralizedTrainer
    from agora.pipeline.data import build_data

    options = options_from_args(TrainLocalOptions, args, "train_local")
    config = run_config(args)
    held = None
    if options.checkpoint_dir:  # one writer per checkpoint folder, as for a worker's
        held = hold_folder(options.checkpoint_dir, "--checkpoint-dir")
    data = build_data(config)
    log_json = open(options.log_json, "a" if options.resume else "w") if options.log_json else None
    bar = Progress(args.steps, "train-local")

    def progress(record, total: int) -> None:
        evaluation = f" eval {record.eval_loss:.3f}" if record.eval_loss is not None else ""
        bar.update(record.step, f"loss {record.loss:.4f}{evaluation} lr {record.lr:.2e} "
                                f"{record.tokens_per_s:,.0f} tok/s", force=record.step >= total)

    try:
        trainer = CentralizedTrainer(config, data, wire_dtype=options.wire_dtype,
                                     checkpoint_dir=options.checkpoint_dir, log_json=log_json, progress=progress)
        if options.resume and trainer.resume():
            logging.info("resumed from step %d", trainer.step)
        records = trainer.run(args.steps)
        final = trainer.evaluate()
    finally:
        bar.close()
        if log_json is not None:
            log_json.close()
        del held
    last = records[-1].loss if records else float("nan")
    tokens_per_s = records[-1].tokens_per_s if records else 0.0
    print(f"train-local: {config.name} stages={len(config.layer_split)} steps={trainer.step} "
          f"loss={last:.4f} heldout={final:.4f} tokens/s={tokens_per_s:,.0f} on {trainer.runtime.describe()}")
    return 0
