"""Checkpoints (pipeline/checkpoint.py): complete, durable before visible, weights only, a fallback."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from agora.pipeline.checkpoint import (
    CheckpointError,
    StageState,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.optim import StageOptimizer
from agora.pipeline.stages import build_stage

CONFIG = PRESETS["tiny"].with_stages(3)


def trained_state(index: int = 1, steps: int = 3) -> StageState:
    stage = build_stage(CONFIG.model, index)
    optimizer = StageOptimizer(stage, CONFIG.optim, index, 3)
    for _ in range(steps):
        for p in optimizer.parameters:
            p.grad = torch.randn_like(p)
        optimizer.step(1)
    averaging = {"method": "sparta", "n_slices": 4, "last_round": 7, "samples_since_round": {"-1": 12},
                 "anchor": [torch.ones(3)], "momentum": []}
    return StageState(index, stage.state_dict(), optimizer.state_dict(), averaging)


def test_a_checkpoint_holds_everything_and_loads_back_equal(tmp_path):
    state = trained_state()
    torch.manual_seed(123)
    expected_rng = torch.get_rng_state()
    save_checkpoint(tmp_path, 3, CONFIG, [state], extra={"phase": "member"})
    step, config, (loaded,), extra = load_checkpoint(tmp_path)
    assert (step, config.model, extra) == (3, CONFIG.model, {"phase": "member"})
    assert loaded.model.keys() == state.model.keys()
    assert all(torch.equal(loaded.model[k], state.model[k]) for k in state.model)
    assert loaded.optimizer["steps"] == 3
    moments = loaded.optimizer["optimizer"]["state"]
    original = state.optimizer["optimizer"]["state"]
    assert all(torch.equal(moments[i]["exp_avg_sq"], original[i]["exp_avg_sq"]) for i in original)
    assert loaded.averaging["last_round"] == 7 and torch.equal(loaded.averaging["anchor"][0], torch.ones(3))
    torch.rand(5)  # move the generator on; restoring puts it back where the checkpoint was taken
    restore_rng(loaded.rng)
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_the_newest_two_are_kept_and_a_broken_newest_falls_back_to_the_previous(tmp_path, caplog):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, CONFIG, [trained_state(steps=1)])
    assert checkpoint_steps(tmp_path) == [20, 30] and latest_checkpoint(tmp_path).name == "step-00000030"
    (tmp_path / "step-00000030" / "stage-1.pt").write_bytes(b"torn")  # a disk that lost the newest write
    with caplog.at_level(logging.WARNING, logger="agora.pipeline.checkpoint"):
        step, _, _, _ = load_checkpoint(tmp_path)
    assert step == 20 and "loaded step-00000020 instead" in caplog.text
    assert load_checkpoint(tmp_path, step=20)[0] == 20
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path / "step-00000030")  # one named checkpoint: exactly that one


def test_a_checkpoint_that_would_run_code_on_load_is_refused(tmp_path):
    save_checkpoint(tmp_path, 1, CONFIG, [trained_state(steps=1)])

    class Payload:
        def __reduce__(self):
            return (print, ("this ran on load",))

    target = tmp_path / "step-00000001" / "stage-1.pt"
    target.write_bytes(pickle.dumps({"model": Payload()}, protocol=2))
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path / "step-00000001")


def test_a_write_that_dies_midway_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 5, CONFIG, [trained_state(steps=1)])

    def die(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("agora.pipeline.checkpoint._write_synced", die)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 6, CONFIG, [trained_state(steps=1)])
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step-00000005" and checkpoint_steps(tmp_path) == [5]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    assert load_checkpoint(tmp_path)[0] == 5


def test_a_step_written_again_replaces_the_old_one_and_a_killed_writes_leftovers_go(tmp_path, caplog):
    save_checkpoint(tmp_path, 4, CONFIG, [trained_state(steps=1)])
    # What a writer killed with -9 leaves: a staging folder (a whole stage's state, on a real model).
    leftover = tmp_path / ".step-00000005.k1ll3d"
    leftover.mkdir()
    (leftover / "stage-1.pt").write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING, logger="agora.pipeline.checkpoint"):
        save_checkpoint(tmp_path, 5, CONFIG, [trained_state(steps=1)])
    assert not leftover.exists() and any("k1ll3d" in r.getMessage() for r in caplog.records)
    # The same step again (a worker's last checkpoint as it leaves): the new one replaces it whole.
    save_checkpoint(tmp_path, 5, CONFIG, [trained_state(steps=2)], extra={"phase": "leaving"})
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".step-")]
    assert checkpoint_steps(tmp_path) == [4, 5] and latest_checkpoint(tmp_path).name == "step-00000005"
    step, _, states, extra = load_checkpoint(tmp_path)
    assert step == 5 and extra == {"phase": "leaving"} and states[0].optimizer["steps"] == 2


def test_rng_state_round_trips_and_a_legacy_bare_state_is_accepted():
    state = rng_state()
    first = torch.rand(3)
    restore_rng(state)
    assert torch.equal(torch.rand(3), first)
    restore_rng(state["cpu"])
    assert torch.equal(torch.rand(3), first)


def test_a_worker_checkpoints_every_n_steps_off_its_compute_thread_and_resumes_exactly(tmp_path):
    from agora.node.rpc.server import run
    from agora.node.replica.checkpoints import StageCheckpointer, restore_stage
    from agora.pipeline.codec import encode_tokens
    from agora.protos.stage_adapter import ForwardRequest
    from agora.node.replica.local_replica import LocalReplica

    config = PRESETS["tiny"].with_stages(1)
    vocab = config.model.vocab_size

    def forward(replica, i):
        batch = torch.randint(0, vocab, (config.train.batch_size, 17), generator=torch.Generator().manual_seed(i))
        request = ForwardRequest(run_id="test", microbatch_id=f"m{i}", stage=0, tokens=encode_tokens(batch[:, :-1], vocab),
                                 wire=b"", targets=encode_tokens(batch[:, 1:], vocab))
        return replica.on_compute(lambda c: c.forward(request))  # a whole local batch: one step each

    async def main():
        replica = LocalReplica(config, 0)
        checkpoints = StageCheckpointer(replica, tmp_path, config, every=2)
        await checkpoints.start()
        for i in range(5):
            await forward(replica, i)
        await checkpoints.stop()
        at_four = checkpoints.written[-1]
        final = await checkpoints.final(replica.compute, phase="member")
        state = await replica.on_compute(lambda c: ([p.detach().clone() for p in c.stage.parameters()],
                                                    c.optimizer.steps, c.samples_total))
        await replica.stop()
        return at_four, final, state

    at_four, final, (weights, steps, samples) = run(main())
    assert at_four.name == "step-00000004" and final.name == "step-00000005" and steps == 5
    fresh = LocalReplica(config, 0)

    def restore(**kwargs):
        return fresh._executor.submit(restore_stage, fresh.compute, tmp_path, config, **kwargs).result()

    try:
        step, _, extra = restore()
        assert (step, extra["phase"], fresh.compute.optimizer.steps) == (5, "member", 5)
        assert fresh.compute.samples_total == samples
        assert all(torch.equal(a, b) for a, b in zip(fresh.compute.stage.parameters(), weights))
        assert restore(step=4)[0] == 4 and fresh.compute.optimizer.steps == 4
        with pytest.raises(ConfigError, match="--checkpoint-dir"):
            restore(step=3)
    finally:
        fresh._executor.shutdown()


def test_a_folder_held_by_another_process_is_refused_in_one_line_naming_it(tmp_path, capsys):
    import subprocess
    import sys

    from agora.node.cli import main
    from agora.pipeline.files import FolderInUse, hold_folder

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from agora.pipeline.files import hold_folder; "
                               "held = hold_folder(sys.argv[1], 'x'); print('held', flush=True); sys.stdin.read()",
         str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the holder's readiness
        with pytest.raises(FolderInUse, match=f"in use by another agora-node process \\(pid {holder.pid}\\)"):
            hold_folder(tmp_path, "--checkpoint-dir")
        assert main(["train-local", "--steps", "1", "--checkpoint-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"agora-node train-local: error: --checkpoint-dir {tmp_path} is in use by another agora-node "
                       f"process (pid {holder.pid}); stop it first, or give this one a folder of its own"], err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    hold_folder(tmp_path, "--checkpoint-dir").release()  # free again once the holder is gone (raises if not)
