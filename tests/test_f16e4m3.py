"""The "fp16+fp8" plan on the CPU: the exact e4m3 rounding, the f16+e4m3 encoding of an operand
(/work brief f16e4m3.md, cupyffn/cpu/numpy_route.py f16e4m3_split), the pair product's accuracy and
the whole backward under the plan's recipe (cupyffn/core/precision.py effective_forms).

ml_dtypes.float8_e4m3fn is the oracle for the rounding (test-only: the package does not use it);
float64 references are computed here from the fp32 inputs.
"""

import dataclasses

import numpy
import pytest

import cupyffn
from cupyffn.cpu import numpy_route as nb
from cupyffn.core import precision as P
from cupyffn import workloads as W

from test_numpy_backend import INPUT_NAMES, OUTPUT_NAMES, reference64, rel_l2

ml_dtypes = pytest.importorskip("ml_dtypes")

F32 = numpy.float32
F64 = numpy.float64
E4M3 = ml_dtypes.float8_e4m3fn
PAIR = P.FORMS["f16+e4m3"]
# A test-only recipe: the fp16+fp8 plan with the pair on all four GEMMs at every token count
# (effective_forms still falls back to bf16x3 where the pair does not fit).
ALL_PAIR = dataclasses.replace(P.PRECISIONS["fp16+fp8"], name="fp16+fp8 (pair everywhere)",
                               steps=tuple((g, ((0, "f16+e4m3"),)) for g in P.GEMMS))
ALL_BF16X3 = P.PRECISIONS["bf16x3"]


def oracle(x):
    """e4m3 "fn" round to nearest even with satfinite, by ml_dtypes (clipping first: its own cast
    turns out-of-range values into NaN)."""
    x = numpy.asarray(x, dtype=F32)
    with numpy.errstate(invalid="ignore"):
        return numpy.clip(x, -448.0, 448.0).astype(F32).astype(E4M3).astype(F32)


def assert_same_bits(got, want):
    """Equal as float32 bit patterns (so -0 != +0), NaN where want is NaN."""
    assert got.dtype == F32 and got.shape == want.shape
    nan = numpy.isnan(want)
    assert numpy.array_equal(numpy.isnan(got), nan)
    bad = numpy.flatnonzero(got[~nan].view(numpy.uint32) != want[~nan].view(numpy.uint32))
    assert bad.size == 0, (f"{bad.size} differ, e.g. x -> got {got[~nan][bad[:5]]}, want {want[~nan][bad[:5]]}")


def all_codes():
    """The float32 values of the 256 e4m3 codes (two are NaN: 0x7F, 0xFF)."""
    return numpy.arange(256, dtype=numpy.uint8).view(E4M3).astype(F32)


# ---------------------------------------------------------------------------------------------
# e4m3_round
# ---------------------------------------------------------------------------------------------
def test_every_code_value_is_kept():
    v = all_codes()
    assert numpy.isnan(v).sum() == 2 and numpy.nanmax(v) == 448 and numpy.nanmin(v) == -448
    assert_same_bits(nb.e4m3_round(v), v)  # includes -0, the 14 subnormals of each sign, +-448
    assert_same_bits(nb.e4m3_round(v), oracle(v))


def test_midpoints_round_to_the_even_neighbour():
    v = numpy.unique(all_codes()[~numpy.isnan(all_codes())].astype(F64))  # ascending, one zero
    lo, hi = v[:-1], v[1:]
    mid = ((lo + hi) / 2).astype(F32)
    assert numpy.array_equal(mid.astype(F64), (lo + hi) / 2)  # midpoints are exact in fp32
    even = numpy.where((lo.astype(F32).astype(E4M3).view(numpy.uint8) & 1) == 0, lo, hi).astype(F32)
    got = nb.e4m3_round(mid)
    numpy.testing.assert_array_equal(got, even)
    assert_same_bits(got, oracle(mid))
    assert (got == lo).any() and (got == hi).any()  # both directions occur
    # one fp32 ulp off the midpoint: the nearer neighbour
    up = numpy.nextafter(mid, F32(numpy.inf))
    down = numpy.nextafter(mid, F32(-numpy.inf))
    numpy.testing.assert_array_equal(nb.e4m3_round(up), hi.astype(F32))
    numpy.testing.assert_array_equal(nb.e4m3_round(down), lo.astype(F32))
    assert_same_bits(nb.e4m3_round(up), oracle(up))
    assert_same_bits(nb.e4m3_round(down), oracle(down))


def test_beyond_448_saturates():
    x = numpy.array([448.0, 448.5, 463.9, 464.0, 464.1, 479.0, 480.0, 500.0, 1e4, 3.4e38, numpy.inf], dtype=F32)
    x = numpy.concatenate([x, -x])
    got = nb.e4m3_round(x)
    numpy.testing.assert_array_equal(got, numpy.sign(x) * F32(448))
    assert_same_bits(got, oracle(x))


def test_subnormals_and_tiny_values():
    sub = numpy.float32(2.0 ** -9)  # the smallest subnormal; normals start at 2^-6
    x = numpy.array([sub / 2, sub / 2 * (1 + 2.0 ** -20), sub * 1.5, sub * 2.5, sub * 7.5, 2.0 ** -6 - 2.0 ** -12,
                     1e-30, 1e-45, 0.0], dtype=F32)
    want = numpy.array([0.0, sub, 2 * sub, 2 * sub, 8 * sub, 2.0 ** -6, 0.0, 0.0, 0.0], dtype=F32)
    numpy.testing.assert_array_equal(nb.e4m3_round(x), want)
    numpy.testing.assert_array_equal(nb.e4m3_round(-x), -want)
    assert_same_bits(nb.e4m3_round(x), oracle(x))
    assert_same_bits(nb.e4m3_round(-x), oracle(-x))  # -tiny -> -0
    assert numpy.signbit(nb.e4m3_round(-x)[[0, 6, 7, 8]]).all()


def test_negative_zero_and_nan():
    got = nb.e4m3_round(numpy.array([-0.0, 0.0, numpy.nan, -numpy.nan], dtype=F32))
    assert numpy.signbit(got[0]) and got[0] == 0 and not numpy.signbit(got[1]) and got[1] == 0
    assert numpy.isnan(got[2:]).all()


def test_random_values_match_the_oracle(rng):
    n = 200000
    x = (rng.standard_normal(n) * numpy.exp2(rng.uniform(-16, 12, n))).astype(F32)
    got = nb.e4m3_round(x)
    assert_same_bits(got, oracle(x))
    # and the error bound of a 4-bit significand where x is normal and in range
    normal = (numpy.abs(x) >= 2.0 ** -6) & (numpy.abs(x) <= 448)
    assert normal.mean() > 0.5
    rel = numpy.abs(got[normal].astype(F64) - x[normal]) / numpy.abs(x[normal].astype(F64))
    assert rel.max() <= 2.0 ** -4


def test_input_is_not_modified_and_shape_kept(rng):
    x = rng.standard_normal((7, 5)).astype(F32) * 100
    before = x.copy()
    got = nb.e4m3_round(x)
    assert got.shape == (7, 5) and got.dtype == F32
    numpy.testing.assert_array_equal(x, before)


# ---------------------------------------------------------------------------------------------
# f16e4m3_split
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [-5, 0, 1])  # the device's scale puts max |s| anywhere in [2^8, 2^15)
def test_split_invariants(rng, shift):
    x = (rng.standard_normal(50000) * numpy.exp2(rng.uniform(-12, 0, 50000))).astype(F32)
    e = nb.f16_exponent(x) + shift
    hi, h8, l8 = nb.f16e4m3_split(x, e)
    s = numpy.ldexp(x.astype(F64), e)
    amax = numpy.abs(s).max()
    assert 2.0 ** (13 + shift) <= amax < 2.0 ** (14 + shift)
    assert all(a.dtype == F32 and a.shape == x.shape for a in (hi, h8, l8))
    numpy.testing.assert_array_equal(hi, s.astype(numpy.float16).astype(F32))  # fp16 rn of s
    lo = s - hi.astype(F64)
    assert numpy.array_equal((hi.astype(F64) + lo).astype(F32).astype(F64), s)  # hi + lo == s exactly ...
    assert numpy.array_equal(lo.astype(F32).astype(F64), lo)  # ... with lo an fp32 value
    assert numpy.abs(lo).max() <= 2.0 ** (3 + shift)  # half an fp16 ulp at the top binade
    # H8 and L8 are the e4m3 roundings of s 2^-7 and lo 2^4 (the oracle's), in range
    numpy.testing.assert_array_equal(h8, oracle(s * 2.0 ** -7))
    numpy.testing.assert_array_equal(l8, oracle(lo * 2.0 ** 4))
    assert numpy.abs(h8).max() < 256 and numpy.abs(l8).max() <= 128
    assert (l8[numpy.abs(s) >= amax / 32] != 0).mean() > 0.9  # the low part carries information
    # hi + L8/16 holds s to 4 more bits than fp16: e4m3's half ulp (2^-4 relative) or half its
    # smallest subnormal (2^-10, i.e. 2^-14 in lo)
    err = numpy.abs(hi.astype(F64) + l8.astype(F64) / 16 - s)
    assert (err <= 2.0 ** -4 * numpy.abs(lo) + 2.0 ** -14).all()
    assert numpy.median(err[s != 0] / numpy.abs(s[s != 0])) < 2.0 ** -15


def test_split_of_non_finite_values():
    x = numpy.array([numpy.inf, -numpy.inf, numpy.nan, 1.0, 70000.0, -70000.0, 65519.0], dtype=F32)
    hi, h8, l8 = nb.f16e4m3_split(x, 0)  # 70000 overflows fp16 (to inf); 65519 rounds to 65504
    assert hi[0] == numpy.inf and hi[1] == -numpy.inf and numpy.isnan(hi[2])
    assert hi[4] == numpy.inf and hi[5] == -numpy.inf and hi[6] == 65504
    bad = [0, 1, 2, 4, 5]
    assert (h8[bad] == 0).all() and (l8[bad] == 0).all()
    assert h8[3] == oracle(numpy.float32(2.0 ** -7)) and l8[3] == 0
    assert h8[6] == 448 and l8[6] == 15 * 16  # 65519/128 saturates (|s| >= 2^15 is outside the plan's range)
    # an fp32 overflow of the scaling itself
    hi, h8, l8 = nb.f16e4m3_split(numpy.array([3e38, 1.0], dtype=F32), 10)
    assert hi[0] == numpy.inf and h8[0] == 0 and l8[0] == 0 and hi[1] == 1024


# ---------------------------------------------------------------------------------------------
# The pair product
# ---------------------------------------------------------------------------------------------
def pair_formula64(a, b, ea, eb):
    """The plan's product in float64 from the oracle's encoding (independent of pair_matmul's sums)."""
    def enc(x, e):
        s = numpy.ldexp(x.astype(F64), e)
        hi = s.astype(numpy.float16).astype(F64)
        return hi, oracle(s * 2.0 ** -7).astype(F64), oracle((s - hi) * 2.0 ** 4).astype(F64)
    (ah, ah8, al8), (bh, bh8, bl8) = enc(a, ea), enc(b, eb)
    return numpy.ldexp(ah @ bh + 8 * (al8 @ bh8 + ah8 @ bl8), -(ea + eb))


@pytest.mark.parametrize("k", [1536, 6144])
def test_pair_gemm_accuracy(rng, k):
    """Measured (seeded): rel. L2 1.0e-5 for the pair, 2.9e-4 for f16s, 4.4e-6 for bf16x3."""
    a = rng.standard_normal((48, k)).astype(F32)
    b = (0.02 * rng.standard_normal((k, 80))).astype(F32)
    ref = a.astype(F64) @ b.astype(F64)
    pair = nb._matmul(a, b, PAIR)
    f16s = nb._matmul(a, b, P.FORMS["f16s"])
    err_pair, err_f16s = rel_l2(pair, ref), rel_l2(f16s, ref)
    assert pair.dtype == F32 and pair.shape == (48, 80)
    assert 2e-6 < err_pair <= 3e-5, err_pair  # the e4m3 rounding is there, and as accurate as planned
    assert err_pair * 10 <= err_f16s, (err_pair, err_f16s)
    # the product is the plan's formula up to fp32 summation
    ea, eb = nb.f16_exponent(a), nb.f16_exponent(b)
    assert rel_l2(pair, pair_formula64(a, b, ea, eb)) <= 1e-6


@pytest.mark.parametrize("shift", [-5, 1])
def test_pair_gemm_accuracy_at_the_ends_of_the_device_scale_range(rng, shift):
    a = rng.standard_normal((32, 1536)).astype(F32)
    b = (0.02 * rng.standard_normal((1536, 48))).astype(F32)
    ea, eb = nb.f16_exponent(a) + shift, nb.f16_exponent(b) + shift
    got = nb.pair_matmul(a, b, ea, eb)
    assert rel_l2(got, a.astype(F64) @ b.astype(F64)) <= 3e-5
    assert rel_l2(got, pair_formula64(a, b, ea, eb)) <= 1e-6


def test_pair_gemm_propagates_non_finite_like_fp32(rng):
    a = rng.standard_normal((16, 64)).astype(F32)
    b = rng.standard_normal((64, 16)).astype(F32)
    a[3, 5], b[7, 2], a[9, 1] = numpy.nan, numpy.inf, -numpy.inf
    with numpy.errstate(invalid="ignore"):
        want = ~numpy.isfinite(a @ b)
    got = nb._matmul(a, b, PAIR)
    assert want.any() and not want.all()
    assert numpy.array_equal(~numpy.isfinite(got), want)


# ---------------------------------------------------------------------------------------------
# The recipe: effective_forms and the whole backward
# ---------------------------------------------------------------------------------------------
def forms_of(precision, T, D, H):
    return {g: f.name for g, f in P.effective_forms(precision, T, D, H).items()}


def test_effective_forms_fall_back_where_the_pair_does_not_fit():
    pair, b3 = "f16+e4m3", "bf16x3"
    assert forms_of(ALL_PAIR, 64, 64, 256) == dict.fromkeys(P.GEMMS, pair)
    # gemm1 [T,H], gemm2 [D,H], gemm3 [T,D], gemm4 [H,D]: N a multiple of 16 (any M runs; K is padded)
    assert forms_of(ALL_PAIR, 40, 64, 256) == dict.fromkeys(P.GEMMS, pair)
    assert forms_of(ALL_PAIR, 64, 40, 256) == {"gemm1": pair, "gemm2": pair, "gemm3": b3, "gemm4": b3}
    assert forms_of(ALL_PAIR, 64, 64, 200) == {"gemm1": b3, "gemm2": b3, "gemm3": pair, "gemm4": pair}
    assert forms_of(ALL_PAIR, 0, 64, 256)["gemm2"] == pair  # K = T = 0 is padded like any K
    plan = P.PRECISIONS["fp16+fp8"]
    assert forms_of(plan, 512, 1536, 6144) == dict.fromkeys(P.GEMMS, b3)  # below T = 1024: the bf16x3 plan
    assert forms_of(plan, 1023, 1536, 6144) == dict.fromkeys(P.GEMMS, b3)
    # from T = 1024 on every GEMM (the GPU engine runs bf16x3 for a GEMM whose pair is slower on cuBLAS where the
    # sm90 pair kernel does not run it: tests/test_engine_plan.py, tests/test_gpu_fp16fp8.py)
    assert forms_of(plan, 1024, 1536, 6144) == dict.fromkeys(P.GEMMS, pair)
    assert forms_of(plan, 8192, 1536, 6144) == dict.fromkeys(P.GEMMS, pair)
    assert forms_of(plan, 3142, 1536, 6144)["gemm3"] == pair  # M = T = 3142 runs (measured)


def run2d(inp, precision, **flags):
    """cupyffn/cpu/numpy_route.py backward_2d on 2-D inputs (the route of a test-only recipe, which lookup() refuses)."""
    dy, x, w1, w2, l1, t, g = (inp[n].reshape(-1, inp[n].shape[-1]) for n in INPUT_NAMES)
    T, D, H = dy.shape[0], dy.shape[1], w1.shape[0]
    outs = [numpy.full(s, numpy.nan, F32) for s in ((T, D), (H, D), (D, H))]
    before = {n: inp[n].copy() for n in INPUT_NAMES}
    nb.backward_2d(dy, x, w1, w2, l1, t, g, precision, True, True, False, outs)
    for n in INPUT_NAMES:
        assert inp[n].tobytes() == before[n].tobytes(), n
    return outs


def test_test_recipe_is_not_a_public_precision():
    with pytest.raises(ValueError, match="precision must be one of"):
        P.lookup(ALL_PAIR)


@pytest.mark.parametrize("shape", [(64, 64, 256), (48, 96, 160)], ids=lambda s: "T{}-D{}-H{}".format(*s))
def test_backward_with_the_pair_on_every_gemm(rng, shape):
    """Measured: 1.4e-5..1.5e-5 (grad_hidden, grad_w1), 1.1e-5 (grad_w2); bf16x3: 6e-6, 6e-6, 4.5e-6."""
    T, D, H = shape
    assert forms_of(ALL_PAIR, T, D, H) == dict.fromkeys(P.GEMMS, "f16+e4m3")
    inp = W.make_inputs((T,), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))
    ref = reference64(inp)
    got, b3 = run2d(inp, ALL_PAIR), run2d(inp, ALL_BF16X3)
    for o, r, b, name in zip(got, ref, b3, OUTPUT_NAMES):
        assert numpy.isfinite(o).all(), name
        err = rel_l2(o, r)
        assert 2e-6 < err <= P.PRECISIONS["fp16+fp8"].contract / 4, (name, err)
        assert not numpy.array_equal(o, b), name  # the pair ran, not bf16x3


def test_backward_runs_bf16x3_where_the_pair_does_not_fit(rng):
    """H = 200: GEMM1 and GEMM2 (N = H) fall back, so grad_weight2 is bf16x3's to the bit; GEMM3/4 keep the pair."""
    inp = W.make_inputs((40,), 64, 200, xp=numpy, seed=int(rng.integers(2 ** 31)))
    got, b3 = run2d(inp, ALL_PAIR), run2d(inp, ALL_BF16X3)
    numpy.testing.assert_array_equal(got[2], b3[2])
    assert not numpy.array_equal(got[0], b3[0]) and not numpy.array_equal(got[1], b3[1])
    ref = reference64(inp)
    assert max(rel_l2(o, r) for o, r in zip(got, ref)) <= P.PRECISIONS["fp16+fp8"].contract


@pytest.mark.parametrize("scale", [1e-6, 1e12])
@pytest.mark.parametrize("name", INPUT_NAMES)
def test_backward_with_one_input_scaled(rng, name, scale):
    """Per-tensor power-of-two scales absorb any magnitude (measured: 1.5e-5 throughout, as unscaled)."""
    inp = W.make_inputs((32,), 64, 128, xp=numpy, seed=int(rng.integers(2 ** 31)))
    inp[name] = (inp[name] * F32(scale)).astype(F32)
    ref = reference64(inp)
    for o, r, out in zip(run2d(inp, ALL_PAIR), ref, OUTPUT_NAMES):
        assert rel_l2(o, r) <= P.PRECISIONS["fp16+fp8"].contract, (out, rel_l2(o, r))


@pytest.mark.parametrize("tokens", [2048, 2056])
def test_public_plan_meets_its_contract(rng, tokens):
    """The fp16+fp8 plan through gelu_ffn_backward at token counts where its table picks the pair
    for every GEMM (2048, and 2056, T not a multiple of 16: any M runs)."""
    D, H = 32, 128
    forms = forms_of(P.PRECISIONS["fp16+fp8"], tokens, D, H)
    assert set(forms.values()) == {"f16+e4m3"}, forms
    inp = W.make_inputs((tokens,), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))
    out = cupyffn.gelu_ffn_backward(*(inp[n] for n in INPUT_NAMES), precision="fp16+fp8")
    b3 = cupyffn.gelu_ffn_backward(*(inp[n] for n in INPUT_NAMES), precision="bf16x3")
    ref = reference64(inp)
    for o, r, name in zip(out, ref, OUTPUT_NAMES):
        assert rel_l2(o, r) <= cupyffn.PRECISIONS["fp16+fp8"].contract, (name, rel_l2(o, r))
    # the outputs downstream of a pair GEMM differ from bf16x3's; the others are bf16x3's bits
    downstream = {"grad_hidden_states": ("gemm1", "gemm3"), "grad_weight1": ("gemm1", "gemm4"),
                  "grad_weight2": ("gemm2",)}
    for o, b, name in zip(out, b3, OUTPUT_NAMES):
        uses_pair = any(forms[g] == "f16+e4m3" for g in downstream[name])
        assert numpy.array_equal(o, b) != uses_pair, (name, forms)


@pytest.mark.parametrize("exponent", [-30, 20])
def test_power_of_two_scaling_is_exact_with_the_pair(rng, exponent):
    """grad_output * 2^k gives gradients * 2^k to the bit: the per-tensor exponent absorbs k and the
    encoding (hi, H8, L8) of the scaled tensor is the same."""
    inp = W.make_inputs((32,), 48, 96, xp=numpy, seed=int(rng.integers(2 ** 31)))
    base = run2d(inp, ALL_PAIR)
    scaled = run2d(dict(inp, grad_output=numpy.ldexp(inp["grad_output"], exponent).astype(F32)), ALL_PAIR)
    for s, b, name in zip(scaled, base, OUTPUT_NAMES):
        numpy.testing.assert_array_equal(s, numpy.ldexp(b, exponent).astype(F32), err_msg=name)


@pytest.mark.parametrize("case", ["nan_grad_output", "inf_hidden_states", "inf_weight1", "nan_gelu_out"])
def test_backward_with_the_pair_propagates_non_finite_like_fp32(rng, case):
    T, D, H = 32, 64, 128
    inp = W.make_inputs((T,), D, H, xp=numpy, seed=int(rng.integers(2 ** 31)))
    name, shape = {"nan_grad_output": ("grad_output", (T, D)), "inf_hidden_states": ("hidden_states", (T, D)),
                   "inf_weight1": ("weight1", (H, D)), "nan_gelu_out": ("gelu_out", (T, H))}[case]
    inp[name][int(rng.integers(shape[0])), int(rng.integers(shape[1]))] = numpy.nan if "nan" in case else numpy.inf
    with numpy.errstate(all="ignore"):
        ref32 = W.reference(inp, dtype=F32)
    masks = []
    for o, r, out in zip(run2d(inp, ALL_PAIR), ref32, OUTPUT_NAMES):
        want = ~numpy.isfinite(r)
        assert numpy.array_equal(~numpy.isfinite(o.reshape(r.shape)), want), out
        masks.append(want)
    assert any(m.any() for m in masks) and any((~m).any() for m in masks)  # not trivial


def test_forward_runs_the_recipes_forward_form(rng):
    """fp16+fp8's forward is bf16x3 (its recipe's forward form): the same bits as the bf16x3 plan's."""
    assert P.PRECISIONS["fp16+fp8"].forward.name == "bf16x3"
    inp = W.make_inputs((48,), 64, 128, xp=numpy, seed=int(rng.integers(2 ** 31)))
    x, w1, w2 = inp["hidden_states"], inp["weight1"], inp["weight2"]
    got = cupyffn.gelu_ffn_forward(x, w1, w2, precision="fp16+fp8")
    want = cupyffn.gelu_ffn_forward(x, w1, w2, precision="bf16x3")
    ieee = cupyffn.gelu_ffn_forward(x, w1, w2, precision="ieee")
    for g, w, i, name in zip(got, want, ieee, cupyffn.FFNForward._fields):
        numpy.testing.assert_array_equal(g, w, err_msg=name)
    assert not numpy.array_equal(got.output, ieee.output)
