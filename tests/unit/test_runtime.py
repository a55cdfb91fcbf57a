"""Device and precision ([runtime], --device, --dtype; pipeline/runtime.py) on a machine without CUDA.

What a GPU adds is in tests/integration/test_cuda.py (marked `cuda`, skipped here) and bench/gpu.py."""

import math
from dataclasses import replace

import pytest
import torch

from agora.node.cli import main
from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS, ConfigError, RuntimeConfig, config_from_dict
from agora.pipeline.data import build_data
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.optim import RoundedAdamW
from agora.pipeline.runtime import CPU_FP32, Runtime, resolve_device
from agora.protos.stage_adapter import BackwardRequest, ForwardRequest

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _config(stages=3, **runtime):
    config = PRESETS["tiny"].with_stages(stages)
    config = replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=64, eval_every=0),
                     runtime=RuntimeConfig(**runtime))
    return config


def test_runtime_section_of_a_config_file_is_typed_and_checked():
    config = config_from_dict({"preset": "tiny", "runtime": {"device": "cpu", "dtype": "bf16"}})
    assert config.runtime == RuntimeConfig(device="cpu", dtype="bf16")
    for values, field in (({"device": "gpu0"}, "runtime.device"), ({"dtype": "fp16"}, "runtime.dtype"),
                          ({"weights": "bf16"}, "runtime.weights"), ({"cores": 4}, "runtime.cores")):
        with pytest.raises(ConfigError) as raised:
            config_from_dict({"preset": "tiny", "runtime": values})
        message = str(raised.value)
        assert message.startswith(field) and "\n" not in message


def test_runtime_is_not_part_of_the_run_fingerprint():
    """A CPU worker and a GPU worker, fp32 or bf16, serve the same run."""
    base = run_fingerprint(PRESETS["tiny"])
    assert run_fingerprint(replace(PRESETS["tiny"], runtime=RuntimeConfig(device="cuda:1", dtype="bf16"))) == base


def test_a_checkpoint_trained_on_a_gpu_loads_its_config_for_this_machines_device(tmp_path):
    """`--config CKPT` on another machine: the training machine's device stays behind, its precision
    recipe travels with the weights."""
    from agora.pipeline.checkpoint import save_checkpoint
    from agora.pipeline.config import load_config

    trained = replace(PRESETS["tiny"], runtime=RuntimeConfig(device="cuda:1", dtype="bf16"))
    save_checkpoint(tmp_path, 3, trained, [])
    loaded = load_config(tmp_path / "step-00000003")
    assert loaded.runtime == RuntimeConfig(device="auto", dtype="bf16") and loaded.model == trained.model


def test_auto_resolves_to_the_cpu_without_cuda():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert Runtime.from_config(RuntimeConfig()).device == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("command", [["train-local", "--steps", "1"], ["join", "--insecure", "--stage", "0"],
                                     ["trainer", "--insecure"], ["demo", "--insecure"]])
def test_device_cuda_without_cuda_is_one_line_and_exit_2(command, capsys):
    code = main([*command, "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "--device" in err and "cuda" in err and "--device cpu" in err


@no_cuda
def test_a_config_asking_for_cuda_is_refused_the_same_way(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n[runtime]\ndevice = "cuda:0"\n')
    assert main(["train-local", "--config", str(path), "--steps", "1"]) == 2
    assert "runtime.device: cuda:0 requested" in capsys.readouterr().err


def test_frames_decode_into_the_staging_buffer_the_runtime_hands_out():
    """The path a GPU worker takes (decode into a pinned buffer, copy without waiting), on the CPU:
    the same calls, with a plain buffer and no copy."""
    codec = WireCodec("bf16")
    values = torch.randn(2, 3, 16)
    given = []

    def staging(shape):
        given.append(CPU_FP32.host_buffer(shape))
        return given[-1]

    decoded = CPU_FP32.to_device(codec.decode(codec.encode(values), out=staging))
    assert decoded is given[0] and not decoded.is_pinned()  # pinned only where a device copies from it
    torch.testing.assert_close(decoded, values.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert CPU_FP32.to_host(decoded) is decoded
    with pytest.raises(ValueError, match="out must give"):
        codec.decode(codec.encode(values), out=lambda shape: torch.empty(shape, dtype=torch.float64))


def test_bf16_keeps_fp32_master_weights_and_optimizer_state_and_a_fp32_wire():
    config = _config(dtype="bf16")
    runtime = Runtime.from_config(config.runtime)
    body = StageCompute(config, 1, run_id="r", codec=WireCodec(), stash=ForwardStash(8, 60.0), synchronous=True,
                        runtime=runtime)
    assert all(p.dtype == torch.float32 for p in body.stage.parameters())
    assert body.stage.basis.T.dtype == torch.bfloat16 and body.stage.basis.U.dtype == torch.bfloat16
    tokens = torch.randint(0, 256, (2, 64))
    wire = torch.randn(2, 64, config.model.wire_dim)
    codec = WireCodec()
    reply = body.forward(ForwardRequest(run_id="r", stage=1, microbatch_id="m", tokens=encode_tokens(tokens, 256),
                                        wire=codec.encode(wire)))
    output = codec.decode(reply.wire)
    assert output.shape == wire.shape
    body.backward(BackwardRequest(run_id="r", stage=1, microbatch_id="m", output_grad=codec.encode(torch.ones_like(output))))
    assert all(p.grad.dtype == torch.float32 for p in body.optimizer.parameters)
    body.step(replace_step(1))
    states = body.optimizer.optimizer.state.values()
    assert states and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_a_compiled_stage_computes_what_the_eager_one_does():
    """`--compile`: a body stage's Forward output and Backward gradients match the eager stage's
    (same weights), and the compiled wrappers add no modules (a checkpoint's names are unchanged)."""
    config = _config(stages=3)
    computes = []
    for compile in (False, True):
        torch.manual_seed(0)
        computes.append(StageCompute(config, 1, run_id="r", codec=WireCodec(), stash=ForwardStash(8, 60.0),
                                     synchronous=True, runtime=Runtime.from_config(RuntimeConfig(compile=compile))))
    eager, compiled = computes
    compiled.stage.load_state_dict(eager.stage.state_dict())
    assert compiled.runtime.describe().endswith("compiled") and len(compiled.stage._compiled_blocks) == 2
    # Traced as inductor would trace them, minus its kernel compiler (a GPU run measures that: bench/gpu.py).
    compiled.stage.compile_blocks(backend="aot_eager")
    assert not eager.stage._compiled_blocks
    assert all(not name.startswith("_compiled") for name, _ in compiled.stage.named_modules())  # nothing doubled
    codec = WireCodec()
    tokens = encode_tokens(torch.randint(0, 256, (2, 64)), 256)
    wire = codec.encode(torch.randn(2, 64, config.model.wire_dim))
    outputs, grads = [], []
    for compute in computes:
        reply = compute.forward(ForwardRequest(run_id="r", stage=1, microbatch_id="m", tokens=tokens, wire=wire))
        outputs.append(codec.decode(reply.wire))
        compute.backward(BackwardRequest(run_id="r", stage=1, microbatch_id="m",
                                         output_grad=codec.encode(torch.ones_like(outputs[-1]))))
        grads.append([p.grad.clone() for p in compute.optimizer.parameters])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-5)


def replace_step(microbatches):
    from agora.protos.stage_adapter import StepRequest

    return StepRequest(run_id="r", stage=1, step=0, microbatches=microbatches)


def test_rounded_adamw_is_adamw_and_keeps_its_moments_in_fp32():
    torch.manual_seed(0)
    weights = [torch.randn(8, 4), torch.randn(4)]
    ours = [w.clone().requires_grad_(True) for w in weights]
    theirs = [w.clone().requires_grad_(True) for w in weights]
    mine = RoundedAdamW([{"params": ours, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW([{"params": theirs, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  foreach=False)
    for _ in range(5):
        grads = [torch.randn_like(w) for w in weights]
        for params in (ours, theirs):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    bf16 = [w.to(torch.bfloat16).requires_grad_(True) for w in weights]
    rounded = RoundedAdamW([{"params": bf16}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for p in bf16:
        p.grad = torch.ones_like(p)
    rounded.step()
    again = RoundedAdamW([{"params": bf16}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    again.load_state_dict(rounded.state_dict())  # torch would cast loaded moments to the weights' bf16
    assert all(p.dtype == torch.bfloat16 for p in bf16)
    assert all(again.state[p]["exp_avg"].dtype == torch.float32 for p in bf16)


def test_bf16_on_tiny_learns_like_fp32():
    """bf16 autocast over fp32 master weights: held-out loss within 2% of fp32's at equal steps."""
    config = _config(stages=2)
    config = replace(config, train=replace(config.train, microbatches=1))
    data = build_data(config)
    heldout = {}
    for dtype in ("fp32", "bf16"):
        trainer = CentralizedTrainer(replace(config, runtime=RuntimeConfig(dtype=dtype)), data)
        trainer.run(30)
        heldout[dtype] = trainer.evaluate()
    assert math.isfinite(heldout["bf16"]) and heldout["bf16"] < 4.0  # it learned (ln 256 = 5.5 at the start)
    assert abs(heldout["bf16"] / heldout["fp32"] - 1) < 0.02, heldout
