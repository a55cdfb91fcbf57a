"""What a downloaded stage state must pass before a joiner applies it or an export writes it. Pure:
tensors in, a verdict out (node/membership/state_verify.py asks the second members over the network).

A donor is an admitted peer, not a trusted one, and the SHA-256 its stream carries is its own: it
says the bytes arrived as sent, nothing about what they are. Replicas of a stage are never bitwise
equal (asynchronous steps, partial averaging), so no hash can say whether a state is the stage's.
What is checked, cheapest first:

- Locally (`local_refusal`): every floating value finite (parameters, Adam moments, averaging
  state); the state's step within the plan's `max_gap` of the step the members agree on; and Adam
  moments that no Adam run reaches. AdamW moves an element by lr * m / (sqrt(v) + eps), and from
  m = v = 0 Cauchy-Schwarz bounds |m| by c * sqrt(v), c = (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2))
  (1.17 for the default betas; averaging either moment keeps it, sqrt being concave). Moments
  beyond `MOMENT_SLACK` * c would move an element by that many learning rates in one step
  (m = 1e6 with v = 0 moves it by 1e14). Negative second moments and step counts are refused too
  (the next step takes their square root, or divides by zero in the bias correction).
- Against second members (`judge`), by sketches each computes over its own state:
  - The sketch of a tensor w of n elements: k = min(sketch_size, n) numbers
    s_j = sum over i = j mod k of sign_i * w_i, the signs hashed from a seed the joiner draws for
    each check and the tensor's name (`sketch_state`). It is linear, s(a) - s(b) = s(a - b), and
    E|s(d)|^2 = |d|^2 for every d: k numbers tell how far two replicas' tensors lie apart (to
    about sqrt(2/k)). The seed is what the donor cannot know: for a fixed one a change in the
    sketch's kernel (n - k dimensions) would pass unseen. The signs are an integer hash, not a
    torch generator, so every device and version computes the same ones.
  - Scale: the exact RMS of every downloaded tensor within `scale_factor` of the second member's
    (it sends its exact norms), both ways: a tensor scaled x10, or zeroed, fails here.
  - Distance: |s_d - s_v| / (sqrt(n) * max(rms_v, floor)), the distance as a share of the second
    member's tensor's norm (a flipped sign lies at 2, random values of the same size at 1.41, noise
    added at a times the norm at a); `floor` (`FLOOR_SHARE` of the second member's median RMS)
    keeps a tensor that starts at zero (a bias) from dividing by nothing.
  - The bound is the stage's drift: with two second members, their own distance is what honest
    replicas drift apart now, and each tensor may lie `drift_factor` times as far, clamped to
    [`min_drift`, `max_drift`]; with one, `max_drift`. With more, the largest distance between two
    of them: a second member that lies can then loosen the bound to `max_drift`, what one second
    member gives anyway, but not tighten it (by answering with a sketch of the other's state,
    which it may download) until honest donors fail.
  - A state is accepted when it agrees with at least one second member in every tensor. A second
    member that lies then refuses nothing while an honest one answers too, and a donor that lies
    needs a second member to lie for it. In a stage of two members that disagree, each one's
    state is checked against the other's sketch and both are refused: the joiner cannot tell
    which one lies, so it takes neither and asks again (safety before liveness; both are reported).
- Alone (the donor is the stage's only member): no cross-check is possible. The local checks and
  the scale against this replica's own tensors (`judge_alone`: its initialisation, which every
  replica of the stage started from, or an older state of its own) within `alone_scale_factor`
  are all there is; the verdict says so.
"""

from __future__ import annotations

import math
import statistics
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from agora.node.membership.check_options import StateCheckOptions
from agora.pipeline.state_wire import StateWireError

__all__ = ["StateSketch", "Verdict", "sketch_state", "norms_of", "local_refusal", "param_group_refusal",
           "adam_moment_bound", "judge", "judge_alone", "MOMENT_SLACK", "FLOOR_SHARE"]

# How far past the most an honest Adam state reaches its moments may lie (see the module docstring).
MOMENT_SLACK = 4.0
# A tensor's size is never taken below this share of the stage's median tensor RMS.
FLOOR_SHARE = 0.1
# Elements hashed and summed at once: bounds the temporaries of a sketch (8 bytes each, a few of them).
_BLOCK = 2**20
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(value: int) -> int:
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


@dataclass(frozen=True)
class StateSketch:
    """Per tensor of a stage's parameters: its exact norm, its size, and its sketch (`vectors`; empty
    when only the norms are wanted, as a scale reference)."""

    step: int
    norms: Mapping[str, float]
    numels: Mapping[str, int]
    vectors: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def rms(self, name: str) -> float:
        return self.norms[name] / math.sqrt(self.numels[name]) if self.numels[name] else 0.0

    def tree(self) -> dict:
        """What travels (pipeline/state_wire.py's tree)."""
        return {"step": self.step, "norms": dict(self.norms), "numels": dict(self.numels),
                "vectors": dict(self.vectors)}

    @classmethod
    def from_tree(cls, tree: Any, numels: Mapping[str, int], size: int) -> "StateSketch":
        """A second member's sketch, which must cover exactly the tensors `numels` names (this stage's,
        of these sizes) with sketches of `size` numbers (fewer for a smaller tensor); StateWireError
        naming what differs."""
        if not isinstance(tree, dict) or not isinstance(tree.get("step"), int) \
                or not all(isinstance(tree.get(key), dict) for key in ("norms", "numels", "vectors")):
            raise StateWireError("the sketch is malformed")
        norms, vectors = tree["norms"], tree["vectors"]
        if tree["numels"] != dict(numels) or set(norms) != set(numels) or set(vectors) != set(norms):
            raise StateWireError("the sketch does not cover this stage's tensors")
        for name, value in norms.items():
            vector = vectors[name]
            if not isinstance(value, float) or not math.isfinite(value) or value < 0 \
                    or not isinstance(vector, torch.Tensor) or vector.shape != (min(size, numels[name]),) \
                    or vector.dtype != torch.float32 or not bool(torch.isfinite(vector).all()):
                raise StateWireError(f"the sketch of {name} is malformed")
        return cls(tree["step"], norms, dict(numels), vectors)


def _signs(start: int, count: int, key: int, device: torch.device) -> torch.Tensor:
    """+1/-1 for elements start..start+count of a tensor: a SplitMix64-style hash of (index, key)."""
    z = torch.arange(start, start + count, dtype=torch.int64, device=device) * _int64(_GOLDEN) + key
    z = (z ^ (z >> 30)) * _int64(_MIX1)
    z = (z ^ (z >> 27)) * _int64(_MIX2)
    z = z ^ (z >> 31)
    return ((z >> 17) & 1).to(torch.float64) * 2 - 1


def _sketch(tensor: torch.Tensor, key: int, size: int) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    k = min(size, flat.numel())
    total = torch.zeros(k, dtype=torch.float64, device=flat.device)
    block = k * max(1, _BLOCK // max(1, k))
    for start in range(0, flat.numel(), block):
        piece = flat[start:start + block].to(torch.float64)
        signed = piece * _signs(start, piece.numel(), key, flat.device)
        signed = torch.cat([signed, signed.new_zeros((-piece.numel()) % k)])
        total += signed.view(-1, k).sum(0)
    return total.to("cpu", torch.float32)


def _floating(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}


def norms_of(tensors: Mapping[str, Any], step: int = 0) -> StateSketch:
    """The exact norm and size of every floating tensor (a scale reference; no sketch)."""
    floating = _floating(tensors)
    return StateSketch(step, {name: float(torch.linalg.vector_norm(t.detach().to(torch.float64)))
                              for name, t in floating.items()}, {name: t.numel() for name, t in floating.items()})


def sketch_state(tensors: Mapping[str, Any], seed: int, size: int, step: int = 0) -> StateSketch:
    """Norms and sketches of every floating tensor of `tensors` (a stage's parameters), computed where
    each tensor lies (see the module docstring)."""
    plain = norms_of(tensors, step)
    vectors = {name: _sketch(t, _int64(seed + zlib.crc32(name.encode()) * _GOLDEN), size)
               for name, t in _floating(tensors).items()}
    return StateSketch(step, plain.norms, plain.numels, vectors)


# ------------------------------------------------------------------------------------------- local


def _first_nonfinite(value: Any, path: str) -> Optional[str]:
    if isinstance(value, torch.Tensor):
        return path if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_nonfinite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def adam_moment_bound(betas: Sequence[float]) -> Optional[float]:
    """The largest |m| / sqrt(v) an Adam run with `betas` reaches from zero moments (None: no bound,
    b1^2 >= b2)."""
    beta1, beta2 = betas
    if beta1 ** 2 >= beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))


def _moments_refusal(optimizer: Any, betas: Sequence[float], eps: float) -> Optional[str]:
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        return None  # malformed: apply_state says so
    bound = adam_moment_bound(betas)
    for index, entry in state.items():
        if not isinstance(entry, dict):
            continue
        step, m, v = entry.get("step"), entry.get("exp_avg"), entry.get("exp_avg_sq")
        if isinstance(step, torch.Tensor) and step.numel() and float(step.min()) < 0:
            return f"parameter {index}'s Adam step count is negative (the bias correction divides by zero)"
        if not isinstance(v, torch.Tensor):
            continue
        if v.numel() and float(v.min()) < 0:
            return f"parameter {index}'s second moment is negative (the next step takes its square root)"
        if bound is None or not isinstance(m, torch.Tensor) or m.shape != v.shape or not m.numel():
            continue
        ratio = float((m.abs().to(torch.float64) / (v.to(torch.float64).sqrt() + eps)).max())
        if ratio > MOMENT_SLACK * bound:
            return (f"parameter {index}'s moments would move it by {ratio:.3g} learning rates in one step; Adam with "
                    f"betas {tuple(betas)} reaches at most {bound:.3g}")
    return None


def local_refusal(tree: Any, *, stage: int, far_from_agreement: Callable[[int], bool], betas: Sequence[float],
                  eps: float) -> Optional[tuple[str, str]]:
    """(reason, detail) when a downloaded state fails what needs no second member (see the module
    docstring), else None. Reasons: state, nonfinite, step, moments."""
    if not isinstance(tree, dict) or tree.get("stage") != stage or not isinstance(tree.get("model"), dict):
        return "state", f"it is not stage {stage}'s state"
    where = _first_nonfinite(tree, "")
    if where is not None:
        return "nonfinite", f"{where} holds a value that is not finite"
    optimizer = tree.get("optimizer")
    steps = optimizer.get("steps") if isinstance(optimizer, dict) else None
    if not isinstance(steps, int) or far_from_agreement(steps):
        return "step", f"its own step count {steps!r} is far from the step the stage's members agree on"
    moments = _moments_refusal(optimizer, betas, eps)
    return None if moments is None else ("moments", moments)


def param_group_refusal(optimizer: Any, expected: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """Why the state's optimizer settings are not `expected` (this replica's own groups), or None. The
    learning rate is set from the schedule at every step; every other setting (betas, eps, weight
    decay, maximize, ...) is taken from the state by torch's `load_state_dict`, so a donor must not
    choose it."""
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or len(groups) != len(expected):
        return "the optimizer's parameter groups are not this stage's"
    for index, (group, own) in enumerate(zip(groups, expected)):
        settings = {key: value for key, value in own.items() if key not in ("params", "lr")}
        theirs = {key: value for key, value in group.items() if key not in ("params", "lr")} \
            if isinstance(group, dict) else None
        if theirs != settings:
            differ = sorted(key for key in set(settings) | set(theirs or {})
                            if (theirs or {}).get(key) != settings.get(key))
            return f"optimizer group {index} sets {', '.join(differ) or 'its settings'} unlike this run"
    return None


# --------------------------------------------------------------------------------------- the judge


@dataclass(frozen=True)
class Verdict:
    """`refusal`: the reason (scale, sketch) or None; `detail`: what was found; `ratio`: the largest
    share of its bound any tensor used against the second member it was judged by (at most 1 when
    accepted); `agreeing`: the indices of the second members it agrees with."""

    refusal: Optional[str]
    detail: str
    ratio: float = 0.0
    agreeing: tuple[int, ...] = ()


def _distance(a: StateSketch, b: StateSketch, name: str, floor: float) -> float:
    """|s_a - s_b| as a share of `b`'s tensor's norm, the reference (see the module docstring)."""
    scale = math.sqrt(b.numels[name]) * max(b.rms(name), floor)
    if scale == 0:
        return 0.0
    return float(torch.linalg.vector_norm((a.vectors[name] - b.vectors[name]).to(torch.float64))) / scale


def _floor(reference: StateSketch) -> float:
    return FLOOR_SHARE * statistics.median([reference.rms(name) for name in reference.norms] or [0.0])


def _scale_miss(state: StateSketch, reference: StateSketch, factor: float, floor: float) -> Optional[tuple[str, float]]:
    """The first tensor whose RMS lies beyond `factor` of the reference's (the floor below it), with how
    far (a share of the factor), or None."""
    for name in state.norms:
        own, theirs = max(state.rms(name), floor), max(reference.rms(name), floor)
        ratio = max(own / theirs, theirs / own) if own and theirs else (1.0 if own == theirs else math.inf)
        if ratio > factor:
            return name, ratio
    return None


def _drift_bounds(seconds: Sequence[StateSketch], options: StateCheckOptions) -> dict[str, float]:
    """Each tensor's bound on the distance to a second member: the stage's drift (see the module)."""
    names = list(seconds[0].norms)
    if len(seconds) < 2:
        return {name: options.max_drift for name in names}
    floor = _floor(seconds[0])
    pairs = [(a, b) for i, a in enumerate(seconds) for b in seconds[i + 1:]]
    return {name: min(options.max_drift, max(options.min_drift, options.drift_factor * max(
        _distance(a, b, name, floor) for a, b in pairs))) for name in names}


def judge(state: StateSketch, seconds: Sequence[StateSketch], options: StateCheckOptions) -> Verdict:
    """Whether the downloaded state (`state`, sketched with the same seed) agrees with at least one of
    the second members' sketches `seconds` (at least one), within scale and the stage's drift."""
    bounds = _drift_bounds(seconds, options)
    agreeing, misses = [], []
    worst_accepted = 0.0
    for index, second in enumerate(seconds):
        floor = _floor(second)
        scale = _scale_miss(state, second, options.scale_factor, floor)
        if scale is not None:
            misses.append((math.inf, "scale", f"{scale[0]}'s RMS lies {scale[1]:.3g}x from second member {index}'s "
                                             f"(at most {options.scale_factor:g}x)"))
            continue
        shares = {name: _distance(state, second, name, floor) / bounds[name] for name in state.norms}
        name = max(shares, key=shares.get, default=None)
        share = shares.get(name, 0.0)
        if share <= 1.0:
            agreeing.append(index)
            worst_accepted = max(worst_accepted, share)
        else:
            misses.append((share, "sketch", f"{name} lies {share * bounds[name]:.3g} of its norm from second member "
                                            f"{index}'s, beyond the stage's drift bound {bounds[name]:.3g}"))
    if agreeing:
        return Verdict(None, f"agrees with {len(agreeing)} of {len(seconds)} second members", worst_accepted,
                       tuple(agreeing))
    share, reason, detail = min(misses, key=lambda miss: miss[0])
    return Verdict(reason, "; ".join(miss[2] for miss in misses), share)


def judge_alone(state: StateSketch, own: StateSketch, options: StateCheckOptions) -> Verdict:
    """The donor is the stage's only member: the state's scale against this replica's own tensors
    (`own`, norms only), within `alone_scale_factor`; nothing to cross-check against."""
    if set(own.norms) != set(state.norms):
        return Verdict("state", "its parameters are not this stage's")
    miss = _scale_miss(state, own, options.alone_scale_factor, _floor(own))
    if miss is not None:
        return Verdict("scale", f"{miss[0]}'s RMS lies {miss[1]:.3g}x from this replica's own (at most "
                                f"{options.alone_scale_factor:g}x; no second member to compare with)", miss[1])
    return Verdict(None, "finite and in scale; no second member to cross-check it with (the donor is the stage's "
                         "only member)")
