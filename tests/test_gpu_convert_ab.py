"""convert A and B as one launch (tf32, cupyffn/f32/plan.py CONVERT_AB_TOKENS): the same bits as two launches on two streams.

Both routes convert with the same delayed scales and decide them in the same order (grad_output's exponent before
the exponents capped by it), so outputs must be bit-identical, also when magnitudes jump between calls and the
rescue pass reconverts. Inputs are fresh every call and outputs NaN-poisoned; the contract against float64 too.
"""

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W
from cupyffn.api.backward_plan import plan_with_options
from cupyffn.f32.options import EngineOptions

from test_gpu_api import _scaled_inputs  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
from gpu_inputs import poisoned  # noqa: E402  (tests/gpu_inputs.py)


def twin_plans(tokens, dim, hidden, **kw):
    """(one-launch plan, two-launch plan) of one shape (EngineOptions(convert_ab=True) and False)."""
    apart = plan_with_options(tokens, dim, hidden, EngineOptions(convert_ab=False), precision="tf32", **kw)
    merged = plan_with_options(tokens, dim, hidden, EngineOptions(convert_ab=True), precision="tf32", **kw)
    assert merged.engine.plan.convert_ab and not apart.engine.plan.convert_ab
    return merged, apart


def assert_same_bits(got, want, what):
    for label, g, w in zip(W.OUTPUT_NAMES, got, want):
        if g is None:
            continue
        assert bool(cupy.isfinite(g).all()), f"{what} {label}: non-finite"
        assert bool((g.view(cupy.uint32) == w.view(cupy.uint32)).all()), f"{what} {label}: bits differ"


@pytest.mark.parametrize("memory_mode", [False, True])
@pytest.mark.parametrize("tokens,dim,hidden", [(1, 64, 256), (300, 128, 520), (2048, 1536, 6144)])
def test_one_launch_matches_two(tokens, dim, hidden, memory_mode):
    merged, apart = twin_plans(tokens, dim, hidden)
    for step in range(2):
        inputs = W.make_inputs((tokens,), dim, hidden, xp=cupy, seed=200 + step)
        args = [inputs[n] for n in W.INPUT_NAMES]
        if memory_mode:
            args[5] = args[6] = None
        got = merged(*args, out=poisoned(tokens, dim, hidden))
        want = apart(*args, out=poisoned(tokens, dim, hidden))
        assert_same_bits(got, want, f"T={tokens} step {step}")
        for label, g, r in zip(W.OUTPUT_NAMES, got, W.reference(inputs, xp=cupy)):
            assert W.relative_l2(g, r, xp=cupy) <= cupyffn.PRECISIONS["tf32"].contract, label


def test_magnitude_jumps_rescue_the_same_way():
    """Each call's magnitudes far from the last call's: the delayed scales miss, the rescue pass converts again
    (and, for grad_linear1, reruns GEMM1); both routes end with the same scales and bits."""
    merged, apart = twin_plans(256, 128, 512)
    for scales in [(1, 1, 1, 1), (1e20, 1, 1, 1e-15), (1e-20, 1e10, 1e-10, 1), (1e-30, 1, 1, 1e25), (1, 1, 1, 1)]:
        args, inputs = _scaled_inputs(scales, seed=52)
        got = merged(*args, out=poisoned(256, 128, 512))
        want = apart(*args, out=poisoned(256, 128, 512))
        assert_same_bits(got, want, f"scales {scales}")
        same_state = bool((merged.engine.scale_state == apart.engine.scale_state).all())
        assert same_state, f"scales {scales}: scale states differ"
        for label, g, r in zip(W.OUTPUT_NAMES, got, W.reference(inputs, xp=cupy)):
            assert W.relative_l2(g, r, xp=cupy) <= cupyffn.PRECISIONS["tf32"].contract, f"{scales} {label}"


def test_partial_gradients():
    merged, apart = twin_plans(129, 64, 256, need_weight_grads=False)
    assert merged.engine.stage.cvt_a == ["grad_output", "weight2", "weight1"] and merged.engine.stage.cvt_b == []
    inputs = W.make_inputs((129,), 64, 256, xp=cupy, seed=230)
    args = [inputs[n] for n in W.INPUT_NAMES]
    out = (cupy.full((129, 64), numpy.nan, cupy.float32), None, None)
    got = merged(*args, out=out)
    want = apart(*args, out=(cupy.full((129, 64), numpy.nan, cupy.float32), None, None))
    assert_same_bits(got, want, "need_weight_grads=False")


def test_default_window_and_the_option():
    """auto: tf32 at T <= 512 (CONVERT_AB_TOKENS); EngineOptions(convert_ab=False) turns it off."""
    for tokens, precision, merged in ((512, "tf32", True), (513, "tf32", False), (256, "bf16x3", False)):
        plan = cupyffn.GeluFFNBackward(tokens, 64, 256, precision=precision)
        assert plan.engine.plan.convert_ab == merged, (tokens, precision)
        plan = plan_with_options(tokens, 64, 256, EngineOptions(), precision=precision)
        assert plan.engine.plan.convert_ab == merged, (tokens, precision)
    assert not plan_with_options(512, 64, 256, EngineOptions(convert_ab=False),
                                 precision="tf32").engine.plan.convert_ab
