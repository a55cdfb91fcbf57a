"""`StateCheckOptions`: how a joining replica (and `export`) checks a downloaded stage state before
using it (node/membership/state_check.py says what each bound means). A section of the settings
schema (pipeline/schema.py), nested in `WorkerOptions` as `worker.state_check`. Light (no torch):
the CLI builds its parser from it.

Each replica chooses its own: these bound what it accepts, not what it sends, so replicas that
differ in them still serve one run.
"""

from __future__ import annotations

import math

from pydantic import StrictFloat, StrictInt, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.schema import SECTION, setting

__all__ = ["StateCheckOptions"]


@dataclass(frozen=True, config=SECTION)
class StateCheckOptions:
    sketch_size: StrictInt = setting(
        256, "numbers per tensor in the seeded random projection (sketch) a second member computes over its own "
        "state; a distance read from it is off by about sqrt(2/N)", ge=16, le=65536)
    second_members: StrictInt = setting(
        2, "members other than the donor asked for a sketch; with two, their own distance measures how far the "
        "stage's replicas drift apart now", ge=1, le=8)
    scale_factor: StrictFloat = setting(
        4.0, "a downloaded tensor's RMS must lie within this factor of a second member's", gt=1)
    alone_scale_factor: StrictFloat = setting(
        16.0, "without a second member (the donor is the stage's only one): within this factor of this replica's "
        "own tensors, its initialisation or an older state (training moves a tensor's size that far)", gt=1)
    drift_factor: StrictFloat = setting(
        4.0, "a tensor may lie this many times as far from a second member as two second members lie apart", gt=1)
    min_drift: StrictFloat = setting(
        0.25, "floor of that bound, as a share of the tensor's norm: two second members that are near copies (a "
        "member and its recent joiner) show no drift, while a third replica that trained apart between averaging "
        "rounds lies farther (three steps of the tiny preset on other batches: 0.19)", gt=0)
    max_drift: StrictFloat = setting(
        1.0, "ceiling of that bound, and the bound itself with one second member, as a share of the tensor's norm "
        "(random values of the same size lie at 1.41 of it, a flipped sign at 2)", gt=0, lt=math.sqrt(2))

    @model_validator(mode="after")
    def _agree(self) -> "StateCheckOptions":
        if self.min_drift > self.max_drift:
            raise ValueError(f"min_drift: {self.min_drift} is above max_drift={self.max_drift}")
        return self
