"""GPU: the fp16+fp8 plan (fp16 hi*hi + one e4m3 GEMM for the cross terms, or bf16x3, per GEMM).

The shapes are chosen so that the recipe's table puts the e4m3 pair on each of the four GEMMs in
some case (cupyffn/core/precision.py FORM_TABLE), and the plan must report it ran them (a cuBLASLt
refusal would silently fall back to bf16x3: the expected forms catch that). The accuracy test is
relative to the tf32 plan on the same inputs: the pair's correction must remove most of fp16's
error (a missing, doubled or mis-scaled correction leaves tf32-sized or larger errors).
"""

import numpy
import pytest

import cupyffn
from cupyffn.core import precision as _precision
from cupyffn.gemm import sm90
from cupyffn.f32 import plan as engine_plan
from cupyffn import workloads as W
from cupyffn.api.backward_plan import plan_with_options
from cupyffn.f32.options import EngineOptions

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
from gpu_inputs import make  # noqa: E402  (tests/gpu_inputs.py)

PLAN = "fp16+fp8"
CONTRACT = cupyffn.PRECISIONS[PLAN].contract


def poisoned(args):
    return tuple(cupy.full(a.shape, numpy.nan, dtype=cupy.float32) for a in args[1:4])


def errors(grads, ref64):
    return [W.relative_l2(g, r, xp=cupy) for g, r in zip(grads, ref64)]


def on_sm90():
    return sm90.device_supported(cupy.cuda.Device().id)


def _in(windows, tokens):
    return any(first <= tokens <= last for first, last in windows)


def expected_sm90(tokens):
    """The pair GEMMs the engine runs as the sm90 pair kernel at `tokens` (SM90_PAIR_TOKENS), on a cc 9.0 GPU."""
    if not on_sm90():
        return set()
    return {g for g, windows in engine_plan.SM90_PAIR_TOKENS.items() if _in(windows, tokens)}


def expected_forms(tokens, dim, hidden):
    """The table's forms, with bf16x3 for a pair that neither the sm90 pair kernel (SM90_PAIR_TOKENS) nor cuBLAS
    (CUBLAS_PAIR_TOKENS: where its two products beat bf16x3) runs at this T."""
    expected = {g: f.name for g, f in _precision.effective_forms(cupyffn.PRECISIONS[PLAN], tokens, dim, hidden).items()}
    sm90_gemms = expected_sm90(tokens)
    for g, form in expected.items():
        window = engine_plan.CUBLAS_PAIR_TOKENS[g]
        if form == "f16+e4m3" and g not in sm90_gemms and (window is None or not _in((window,), tokens)):
            expected[g] = "bf16x3"
    return expected


CASES = [  # (T, D, H): the table gives the pair to every GEMM from T = 1024 on
    (1024, 64, 256),     # GEMM1, GEMM2, GEMM4 as the sm90 pair kernel, GEMM3 as cuBLAS's
    (2048, 64, 256),     # all four as the sm90 pair kernel
    (2048, 1536, 6144),  # official sizes
    (3142, 64, 256),     # GEMM1 as the sm90 pair kernel, GEMM2-4 as cuBLAS's
    (4096, 1536, 6144),  # all four as the sm90 pair kernel, on one stream (TWO_STREAMS_TOKENS)
    (8192, 64, 256),     # all four as the sm90 pair kernel again, K = T = 8192 for GEMM2 and GEMM4
    (2056, 64, 256),     # M = T not a multiple of 16: runs (measured), the pair on gemm2-4 still
]


@pytest.mark.parametrize("tokens,dim,hidden", CASES)
def test_forms_ran_and_accuracy_beats_fp16_alone(tokens, dim, hidden):
    args, inputs = make(tokens, dim, hidden, seed=tokens + dim)
    ref64 = W.reference(inputs, xp=cupy)
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision=PLAN)
    expected = expected_forms(tokens, dim, hidden)
    assert "f16+e4m3" in expected.values(), expected  # the case exercises the pair
    notes = plan.engine.plan.form_notes
    assert plan.gemm_forms == expected, f"ran {plan.gemm_forms}, table says {expected}; fallbacks: {notes}"
    # the pairs of SM90_PAIR_TOKENS as the sm90 kernel, the others as cuBLAS's two products
    assert plan.engine.plan.sm90_pair == {g for g in expected_sm90(tokens) if expected[g] == "f16+e4m3"}
    grads = plan(*args, out=poisoned(args))
    tf32 = cupyffn.gelu_ffn_backward(*args, precision="tf32", out=poisoned(args))
    e_pair, e_tf32 = errors(grads, ref64), errors(tf32, ref64)
    for label, g, e, e16 in zip(W.OUTPUT_NAMES, grads, e_pair, e_tf32):
        assert bool(cupy.isfinite(g).all()), label
        assert e <= CONTRACT, f"T={tokens} {label}: rel L2 {e:.3g} > {CONTRACT}"
        assert e <= e16 / 8, f"T={tokens} {label}: rel L2 {e:.3g} vs fp16 alone {e16:.3g}: the correction is not working"
    if dim == W.DIM:  # an official shape: the benchmark's own check as well
        ref32 = W.reference(inputs, xp=cupy, dtype=numpy.float32)
        for label, g, r32, r64 in zip(W.OUTPUT_NAMES, grads, ref32, ref64):
            verdict = W.check(g, r32, r64, xp=cupy, tokens=tokens)
            assert verdict.passed, (label, verdict)


def test_memory_mode_and_accumulate_with_the_pair():
    tokens, dim, hidden = 2048, 64, 256
    args, inputs = make(tokens, dim, hidden, seed=11)
    ref64 = W.reference(inputs, xp=cupy)
    memory = cupyffn.gelu_ffn_backward(*args[:5], None, None, precision=PLAN, out=poisoned(args))
    for label, e in zip(W.OUTPUT_NAMES, errors(memory, ref64)):
        assert e <= CONTRACT, f"memory mode {label}: {e:.3g}"
    rng = numpy.random.default_rng(5)
    start_w1 = cupy.asarray(rng.standard_normal(args[2].shape, dtype=numpy.float32))
    start_w2 = cupy.asarray(rng.standard_normal(args[3].shape, dtype=numpy.float32))
    out = (cupy.full(args[1].shape, numpy.nan, dtype=cupy.float32), start_w1.copy(), start_w2.copy())
    grads = cupyffn.gelu_ffn_backward(*args, precision=PLAN, out=out, accumulate=True)
    for got, start, ref, label in ((grads[1], start_w1, ref64[1], "grad_weight1"),
                                   (grads[2], start_w2, ref64[2], "grad_weight2")):
        e = W.relative_l2(got - start, ref, xp=cupy)
        assert e <= 2 * CONTRACT, f"accumulate {label}: {e:.3g}"


@pytest.mark.parametrize("switch", [False, True])
def test_sm90_pair_switch(switch):
    """EngineOptions(sm90_pair=False): GEMM1 bf16x3 on cuBLAS (the plan before the sm90 pair kernel), GEMM2-4
    cuBLAS's pair; True: all four pairs on the sm90 kernel (GEMM2/GEMM4 read their A MN-major, and accumulate).
    Either is a correct plan; the default (None) runs GEMM1 alone there (T = 3142), so its gradients downstream of
    GEMM1 differ from both."""
    if not on_sm90():
        pytest.skip("the sm90 pair kernel needs a compute capability 9.0 GPU")
    tokens, dim, hidden = 3142, 64, 256
    assert expected_sm90(tokens) == {"gemm1"}
    args, inputs = make(tokens, dim, hidden, seed=21)
    ref64 = W.reference(inputs, xp=cupy)
    default = plan_with_options(tokens, dim, hidden, EngineOptions(), precision=PLAN)(
        *args, out=poisoned(args))
    plan = plan_with_options(tokens, dim, hidden, EngineOptions(sm90_pair=switch), precision=PLAN)
    if not switch:
        assert plan.gemm_forms["gemm1"] == "bf16x3" and plan.engine.plan.sm90_pair == set()
        assert "EngineOptions(sm90_pair=False)" in plan.engine.plan.form_notes["gemm1"]
    else:
        assert set(plan.gemm_forms.values()) == {"f16+e4m3"} and plan.engine.plan.sm90_pair == set(_precision.GEMMS)
    rng = numpy.random.default_rng(6)
    start_w1 = cupy.asarray(rng.standard_normal(args[2].shape, dtype=numpy.float32))
    start_w2 = cupy.asarray(rng.standard_normal(args[3].shape, dtype=numpy.float32))
    for accumulate in (False, True):
        out = poisoned(args) if not accumulate else (poisoned(args)[0], start_w1.copy(), start_w2.copy())
        grads = plan(*args, out=out, accumulate=accumulate)
        starts = (0, start_w1, start_w2) if accumulate else (0, 0, 0)
        for label, g, start, r in zip(W.OUTPUT_NAMES, grads, starts, ref64):
            assert bool(cupy.isfinite(g).all()), label
            e = W.relative_l2(g - start, r, xp=cupy)
            assert e <= 2 * CONTRACT if accumulate else e <= CONTRACT, f"{switch} accumulate={accumulate} {label}: {e:.3g}"
        if not accumulate:
            # grad_hidden_states and grad_weight1 are downstream of GEMM1 (which the switch moves); grad_weight2 is
            # GEMM2's: the same cuBLAS pair as the default's with False, the sm90 one with True
            assert not bool((grads[0] == default[0]).all()) and not bool((grads[1] == default[1]).all())
            assert bool((grads[2] == default[2]).all()) == (not switch)


@pytest.mark.parametrize("tokens", [1024, 4096])
def test_one_stream_and_two_give_the_same_bits(tokens):
    """EngineOptions(two_streams=...): the same launches in another order of streams, so bit for bit the same
    gradients (fp16+fp8 runs one stream from T = 4096 on by default, two below: TWO_STREAMS_TOKENS)."""
    dim, hidden = 64, 256
    args, _ = make(tokens, dim, hidden, seed=31)
    plans = {two: plan_with_options(tokens, dim, hidden, EngineOptions(two_streams=two), precision=PLAN)
             for two in (False, True)}
    default = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision=PLAN)
    assert default.engine.plan.two_streams == (tokens < 4096)
    got = {two: plan(*args, out=poisoned(args)) for two, plan in plans.items()}
    for label, a, b in zip(W.OUTPUT_NAMES, got[False], got[True]):
        assert bool(cupy.isfinite(a).all()) and bool((a == b).all()), label


def test_below_the_pair_threshold_the_plan_is_bf16x3():
    # every GEMM bf16x3 (T < 1024): the engine runs the bf16x3 plan's kernels, so the results are its bits
    tokens, dim, hidden = 1000, 64, 256
    args, _ = make(tokens, dim, hidden, seed=9)
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision=PLAN)
    assert set(plan.gemm_forms.values()) == {"bf16x3"}, plan.gemm_forms
    got = plan(*args, out=poisoned(args))
    want = cupyffn.gelu_ffn_backward(*args, precision="bf16x3", out=poisoned(args))
    for label, g, w in zip(W.OUTPUT_NAMES, got, want):
        assert bool((g == w).all()), label


def test_fallback_where_the_e4m3_gemm_does_not_fit():
    # N = H = 200 of GEMM2 is not a multiple of 16: it runs bf16x3, GEMM3/GEMM4 (N = D) keep the pair
    tokens, dim, hidden = 2048, 64, 200
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision=PLAN)
    assert plan.gemm_forms == {"gemm1": "bf16x3", "gemm2": "bf16x3", "gemm3": "f16+e4m3", "gemm4": "f16+e4m3"}, \
        plan.gemm_forms  # GEMM1 too: N = H (pair_fits)
    args, inputs = make(tokens, dim, hidden, seed=3)
    grads = plan(*args, out=poisoned(args))
    for label, e in zip(W.OUTPUT_NAMES, errors(grads, W.reference(inputs, xp=cupy))):
        assert e <= CONTRACT, f"{label}: {e:.3g}"


def test_scale_state_follows_a_change_of_magnitude():
    # the fp16 exponents are decided on the device; a 2^20 jump of one input must be rescued, not overflow
    tokens, dim, hidden = 2048, 64, 256
    args, inputs = make(tokens, dim, hidden, seed=21)
    plan = cupyffn.GeluFFNBackward(tokens, dim, hidden, precision=PLAN)
    plan(*args, out=poisoned(args))
    scaled = dict(inputs)
    scaled["grad_output"] = inputs["grad_output"] * numpy.float32(2.0 ** 20)
    args2 = [scaled[n] for n in W.INPUT_NAMES]
    grads = plan(*args2, out=poisoned(args2))
    for label, e in zip(W.OUTPUT_NAMES, errors(grads, W.reference(scaled, xp=cupy))):
        assert e <= CONTRACT, f"after a 2^20 jump, {label}: {e:.3g}"


@pytest.mark.parametrize("which", range(4), ids=("grad_output", "hidden_states", "weight1", "weight2"))
@pytest.mark.parametrize("scale", [1e-6, 1e12])
def test_one_input_scaled_with_the_pair(which, scale):
    # T = 2048: GEMM2-4 run the pair; each of the four inputs scaled alone (the forward recomputed)
    from test_gpu_api import _scaled_inputs  # tests/ is on sys.path

    scales = [1, 1, 1, 1]
    scales[which] = scale
    args, inputs = _scaled_inputs(tuple(scales), seed=70 + which, tokens=2048)
    plan = cupyffn.GeluFFNBackward(2048, 128, 512, precision=PLAN)
    assert plan.gemm_forms["gemm3"] == "f16+e4m3", plan.gemm_forms
    grads = plan(*args, out=poisoned(args))
    for label, e in zip(W.OUTPUT_NAMES, errors(grads, W.reference(inputs, xp=cupy))):
        assert e <= CONTRACT, f"{label} with input {which} x {scale:g}: {e:.3g}"
