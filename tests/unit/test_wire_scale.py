"""The running scale of a stage boundary's values (pipeline/wire_scale.py): what it refuses, and when."""

from __future__ import annotations

import math

import pytest

from agora.pipeline.wire_scale import WireScale


def _warm(scale: WireScale, value: float = 1.0, count: int | None = None) -> None:
    for _ in range(scale.warmup if count is None else count):
        assert scale.admit(value) is None


def test_nothing_is_refused_while_warming_up_then_beyond_factor_times_the_median():
    scale = WireScale(factor=100.0, warmup=4)
    assert scale.bound() is None and not scale.vouches(1.0)
    for value in (1.0, 2.0, 1e30):  # a fresh scale knows nothing: even 1e30 is taken
        assert scale.admit(value) is None
    assert scale.bound() is None
    assert scale.admit(1.5) is None  # the fourth: warm, median of (1, 2, 1e30, 1.5) = 1.75
    assert scale.bound() == pytest.approx(175.0)
    assert scale.admit(175.0) is None and scale.vouches(100.0)
    assert scale.admit(1e6) == pytest.approx(100.0 * scale.scale) and not scale.vouches(1e6)
    assert (scale.accepted, scale.refused) == (5, 1)


def test_refused_frames_never_move_the_scale_and_a_minority_of_liars_cannot():
    scale = WireScale(factor=10.0, warmup=8, window=16)
    _warm(scale, 1.0)
    for _ in range(50):  # a liar that keeps trying
        assert scale.admit(1e6) is not None
    assert scale.scale == 1.0
    honest = WireScale(factor=10.0, warmup=8, window=16)
    _warm(honest, 1.0, count=9)
    for _ in range(7):  # 7 of 16 just under the bound, accepted: the median stays honest
        assert honest.admit(9.9) is None
    assert honest.scale == 1.0 and honest.admit(11.0) is not None


def test_the_scale_follows_an_honest_drift_and_reports_its_headroom():
    """Values that double every 20 frames for 400 frames (a millionfold in all) are never refused;
    the largest accepted over the scale is what is left of the factor."""
    scale = WireScale(factor=100.0, warmup=16)
    for index in range(400):
        assert scale.admit(2 ** (index / 20)) is None
    assert 1.0 < scale.peak_ratio < 100.0


def test_a_frame_judged_then_failing_elsewhere_is_never_counted_in():
    """`refuses` judges without counting a frame in; only `accept` (once the caller took it) moves the scale."""
    scale = WireScale(factor=10.0, warmup=2)
    assert scale.refuses(1e30) is None and (scale.accepted, scale.scale) == (0, None)  # judged, then failed
    scale.accept(1.0)
    scale.accept(1.0)
    assert scale.refuses(5.0) is None and scale.scale == 1.0
    assert scale.refuses(11.0) == 10.0 and (scale.accepted, scale.refused) == (2, 1)
    scale.accept(5.0)
    assert scale.peak_ratio == 5.0


def test_frames_of_zeros_give_no_bound_and_nan_is_refused_once_warm():
    zeros = WireScale(factor=10.0, warmup=2)
    _warm(zeros, 0.0, count=5)
    assert zeros.bound() is None and zeros.admit(1e30) is None
    scale = WireScale(factor=10.0, warmup=2)
    _warm(scale, 1.0)
    assert scale.admit(math.nan) is not None and scale.admit(math.inf) is not None


@pytest.mark.parametrize("factor, warmup, window", [(1.0, 4, 8), (0.5, 4, 8), (10.0, 0, 8), (10.0, 4, 0)])
def test_a_scale_that_could_refuse_honest_values_or_never_start_is_refused(factor, warmup, window):
    with pytest.raises(ValueError):
        WireScale(factor, warmup, window)
