"""The NumPy (CPU) backend: accuracy of every precision, the derivative formula, call semantics.

Everything is checked against a float64 reference written from scratch in this file (not
cupyffn.workloads.reference), and the reference itself is checked against finite differences of
the forward pass.
"""

import math

import numpy
import pytest

import cupyffn
from cupyffn.cpu import numpy_route as _backend
from cupyffn.core import precision as P
from cupyffn import workloads as W

F32 = numpy.float32
F64 = numpy.float64
D, H = 64, 256
PRECISION_NAMES = tuple(cupyffn.PRECISIONS)
INPUT_NAMES = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
OUTPUT_NAMES = ("grad_hidden_states", "grad_weight1", "grad_weight2")
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------------------------------------
# Independent float64 reference
# ---------------------------------------------------------------------------------------------
def gelu_tanh64(x):
    return 0.5 * x * (1.0 + numpy.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def tanh_inner64(x):
    return numpy.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))


def gelu_grad64(x, t):
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 0.134145 * x * x)


def reference64(inp):
    """(grad_hidden [lead..., D], grad_w1 [H, D], grad_w2 [D, H]) in float64; saved tensors used as given."""
    w1 = numpy.asarray(inp["weight1"], dtype=F64)
    w2 = numpy.asarray(inp["weight2"], dtype=F64)
    hidden, dim = w1.shape
    dy = numpy.asarray(inp["grad_output"], dtype=F64).reshape(-1, dim)
    x = numpy.asarray(inp["hidden_states"], dtype=F64).reshape(-1, dim)
    z = numpy.asarray(inp["linear1_out"], dtype=F64).reshape(-1, hidden)
    t = numpy.asarray(inp["tanh_inner"], dtype=F64).reshape(-1, hidden)
    g = numpy.asarray(inp["gelu_out"], dtype=F64).reshape(-1, hidden)
    grad_gelu = dy @ w2
    grad_w2 = dy.T @ g
    dz = grad_gelu * gelu_grad64(z, t)
    grad_hidden = dz @ w1
    grad_w1 = dz.T @ x
    return grad_hidden.reshape(numpy.shape(inp["grad_output"])), grad_w1, grad_w2


def rel_l2(out, ref):
    out = numpy.asarray(out, dtype=F64).reshape(ref.shape)
    return float(numpy.linalg.norm(out - ref) / numpy.linalg.norm(ref))


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def seed_from(rng):
    return int(rng.integers(2 ** 31))


def make(rng, lead=(40,), dim=D, hidden=H):
    """The benchmark's input distribution (normal data, weights 0.02 N(0, 1)), seeded from rng."""
    return W.make_inputs(lead, dim, hidden, xp=numpy, seed=seed_from(rng))


def args_of(inp):
    return [inp[n] for n in INPUT_NAMES]


def run(inp, **kwargs):
    return cupyffn.gelu_ffn_backward(*args_of(inp), **kwargs)


def random_like(rng, shape, fill=None):
    a = rng.standard_normal(shape).astype(F32)
    if fill is not None:
        a[...] = fill
    return a


def grad_shapes(inp):
    dim = inp["weight1"].shape[1]
    hidden = inp["weight1"].shape[0]
    return (tuple(inp["grad_output"].shape), (hidden, dim), (dim, hidden))


def assert_close_to_reference(out, inp, bound):
    ref = reference64(inp)
    for o, r, name in zip(out, ref, OUTPUT_NAMES):
        assert o is not None, name
        assert o.dtype == F32, name
        assert o.shape == r.shape, name
        err = rel_l2(o, r)
        assert err <= bound, f"{name}: relative L2 error {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# Precision contracts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [((3, 67), 64, 256), ((50,), 37, 53), ((2, 2, 40), 96, 160)],
                         ids=lambda s: f"lead{s[0]}-D{s[1]}-H{s[2]}")
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_precision_meets_contract(rng, precision, shape):
    lead, dim, hidden = shape
    inp = make(rng, lead, dim, hidden)
    out = run(inp, precision=precision)
    assert_close_to_reference(out, inp, cupyffn.PRECISIONS[precision].contract)


# Lower bounds: the precision really changes the operands (errors measured ~4e-6, 3e-4, 3e-3 for
# bf16x3 / tf32 / bf16 on these inputs, 3e-7 for ieee; fp16+fp8 runs the pair on GEMM1 at T = 192:
# ~4e-6 (grad_weight2, bf16x3's GEMM2) to 1.2e-5), so an accidental fall-back to plain fp32 fails.
FLOOR = {"bf16x3": 1e-6, "fp16+fp8": 1e-6, "tf32": 3e-5, "bf16": 1e-4}


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_precision_is_not_better_than_its_operands_allow(rng, precision):
    inp = make(rng, (4, 48))
    ref = reference64(inp)
    errs = [rel_l2(o, r) for o, r in zip(run(inp, precision=precision), ref)]
    if precision == "ieee":
        assert max(errs) < 1e-6, errs
    else:
        assert min(errs) > FLOOR[precision], errs


def test_precisions_are_ordered_by_accuracy(rng):
    inp = make(rng, (120,))
    ref = reference64(inp)
    err = {p: max(rel_l2(o, r) for o, r in zip(run(inp, precision=p), ref)) for p in PRECISION_NAMES}
    assert err["ieee"] < err["bf16x3"] < err["tf32"] < err["bf16"], err


def test_default_precision_is_fp16fp8_on_the_gpu_and_ieee_on_the_cpu(rng):
    """No precision argument means the device's default: "fp16+fp8" on a GPU (DEFAULT_PRECISION), plain fp32
    ("ieee", CPU_DEFAULT_PRECISION) for NumPy arrays, where emulating the GPU's rounding is slower and less
    accurate; the emulating precisions stay selectable on the CPU."""
    assert cupyffn.DEFAULT_PRECISION == "fp16+fp8"
    assert cupyffn.CPU_DEFAULT_PRECISION == "ieee"
    assert P.resolve(None, cpu=False).name == "fp16+fp8" and P.resolve(None, cpu=True).name == "ieee"
    assert P.resolve("bf16", cpu=True).name == "bf16"
    inp = make(rng, (20,))
    default = run(inp)
    for a, b in zip(default, run(inp, precision="ieee")):
        numpy.testing.assert_array_equal(a, b)  # bit for bit
    for a, b in zip(default, run(inp, precision=None)):
        numpy.testing.assert_array_equal(a, b)
    emulated = run(inp, precision="fp16+fp8")
    assert not numpy.array_equal(default[1], emulated[1])  # the GPU's default, emulated, is another computation
    # the forward and the plan object follow the same rule
    x, w1, w2 = inp["hidden_states"], inp["weight1"], inp["weight2"]
    fwd = cupyffn.gelu_ffn_forward(x, w1, w2)
    for a, b in zip(fwd, cupyffn.gelu_ffn_forward(x, w1, w2, precision="ieee")):
        numpy.testing.assert_array_equal(a, b)
    assert not numpy.array_equal(fwd.output, cupyffn.gelu_ffn_forward(x, w1, w2, precision="fp16+fp8").output)
    plan = cupyffn.GeluFFNBackward(20, D, H, device="cpu")
    assert plan.precision.name == "ieee" and "precision='ieee'" in repr(plan)
    for a, b in zip(plan(*args_of(inp)), default):
        numpy.testing.assert_array_equal(a, b)
    assert cupyffn.GeluFFNBackward(20, D, H, device="cpu", precision="fp16+fp8").precision.name == "fp16+fp8"
    with pytest.raises(ValueError, match="precision must be one of"):
        run(inp, precision="fp32")
    with pytest.raises(ValueError, match="precision must be one of"):
        cupyffn.GeluFFNBackward(20, D, H, device="cpu", precision="fp32")


@pytest.mark.parametrize("precision", PRECISION_NAMES)
@pytest.mark.parametrize("exponent", [-30, 20])
def test_power_of_two_scaling_is_exact(rng, precision, exponent):
    """Scaling grad_output by 2^k scales every gradient by exactly 2^k: the bf16 roundings are
    scale-invariant and tf32's per-tensor fp16 scale absorbs the factor (no fp16 under/overflow)."""
    inp = make(rng, (30,), 37, 53)
    base = run(inp, precision=precision)
    scaled_inp = dict(inp, grad_output=numpy.ldexp(inp["grad_output"], exponent).astype(F32))
    scaled = run(scaled_inp, precision=precision)
    for s, b, name in zip(scaled, base, OUTPUT_NAMES):
        numpy.testing.assert_array_equal(s, numpy.ldexp(b, exponent).astype(F32), err_msg=name)


# ---------------------------------------------------------------------------------------------
# Operand rounding helpers of the CPU emulation
# ---------------------------------------------------------------------------------------------
def test_bf16_round_is_nearest_even(rng):
    x = (rng.standard_normal(20000) * numpy.exp2(rng.integers(-40, 40, 20000))).astype(F32)
    r = _backend.bf16_round(x)
    assert r.dtype == F32
    assert not (r.view(numpy.uint32) & 0xFFFF).any()  # representable in bf16
    bits = x.view(numpy.uint32).astype(numpy.int64)
    down = (bits & ~0xFFFF).astype(numpy.uint32).view(F32).astype(F64)
    up = ((bits & ~0xFFFF) + 0x10000).astype(numpy.uint32).view(F32).astype(F64)
    x64 = x.astype(F64)
    err = numpy.abs(r.astype(F64) - x64)
    assert (err <= numpy.minimum(numpy.abs(x64 - down), numpy.abs(up - x64))).all()
    # ties go to the even significand
    ties = numpy.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8)], dtype=F32)
    numpy.testing.assert_array_equal(_backend.bf16_round(ties),
                                     numpy.array([1.0, 1.0 + 2.0 ** -6, -1.0], dtype=F32))


def test_bf16_round_keeps_specials_and_does_not_overflow():
    fmax = numpy.finfo(F32).max
    x = numpy.array([numpy.inf, -numpy.inf, numpy.nan, fmax, -fmax, 0.5], dtype=F32)
    r = _backend.bf16_round(x)
    assert r[0] == numpy.inf and r[1] == -numpy.inf and numpy.isnan(r[2])
    assert numpy.isfinite(r[3]) and numpy.isfinite(r[4]) and r[3] > 3.38e38 and r[4] < -3.38e38
    assert r[5] == 0.5


def test_bf16_split_represents_x_to_17_bits(rng):
    x = (rng.standard_normal(20000) * numpy.exp2(rng.integers(-30, 30, 20000))).astype(F32)
    hi, lo = _backend.bf16_split(x)
    assert not (hi.view(numpy.uint32) & 0xFFFF).any() and not (lo.view(numpy.uint32) & 0xFFFF).any()
    rel = numpy.abs(hi.astype(F64) + lo.astype(F64) - x.astype(F64)) / numpy.abs(x.astype(F64))
    assert rel.max() <= 2.0 ** -17
    assert (lo != 0).mean() > 0.9  # the low part carries information
    hi_s, lo_s = _backend.bf16_split(numpy.array([numpy.inf, numpy.nan], dtype=F32))
    assert hi_s[0] == numpy.inf and numpy.isnan(hi_s[1]) and (lo_s == 0).all()


# ---------------------------------------------------------------------------------------------
# The GELU derivative
# ---------------------------------------------------------------------------------------------
def test_gelu_derivative_formula_matches_finite_differences():
    x = numpy.linspace(-6.0, 6.0, 4001)
    h = 1e-5
    fd = (gelu_tanh64(x + h) - gelu_tanh64(x - h)) / (2 * h)
    formula = gelu_grad64(x, tanh_inner64(x))
    # the derivative is O(1) on this range (it crosses 0 near x = -0.75): absolute 1e-9, relative 1e-8
    numpy.testing.assert_allclose(formula, fd, rtol=1e-8, atol=1e-9)
    assert formula.min() < -0.1 and formula.max() > 1.1  # the range covers the non-linear part


def test_numpy_gelu_grad_float32_matches_float64_formula(rng):
    x = rng.uniform(-6.0, 6.0, 100000).astype(F32)
    t = tanh_inner64(x.astype(F64)).astype(F32)
    got = _backend.gelu_grad(x, t)
    assert got.dtype == F32
    want = gelu_grad64(x.astype(F64), t.astype(F64))
    numpy.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The whole backward against finite differences of the forward pass
# ---------------------------------------------------------------------------------------------
def consistent_inputs(rng, lead, dim, hidden, x_scale):
    """float32 inputs whose saved tensors come from a float64 forward, plus the float64 versions
    (the float32 parameters upcast and the saved tensors unrounded)."""
    p32 = {
        "grad_output": rng.standard_normal(lead + (dim,)).astype(F32),
        "hidden_states": (x_scale * rng.standard_normal(lead + (dim,))).astype(F32),
        "weight1": (0.02 * rng.standard_normal((hidden, dim))).astype(F32),
        "weight2": (0.02 * rng.standard_normal((dim, hidden))).astype(F32),
    }
    p64 = {k: v.astype(F64) for k, v in p32.items()}
    z = (p64["hidden_states"].reshape(-1, dim) @ p64["weight1"].T).reshape(lead + (hidden,))
    t = tanh_inner64(z)
    g = 0.5 * z * (1.0 + t)
    p64.update(linear1_out=z, tanh_inner=t, gelu_out=g)
    p32.update(linear1_out=z.astype(F32), tanh_inner=t.astype(F32), gelu_out=g.astype(F32))
    return p32, p64


def loss64(dy, x, w1, w2):
    dim = w1.shape[1]
    y = gelu_tanh64(x.reshape(-1, dim) @ w1.T) @ w2.T
    return float(numpy.sum(dy.reshape(-1, dim) * y))


@pytest.mark.parametrize("x_scale", [1.0, 8.0])
@pytest.mark.parametrize("direction", ["hidden_states", "weight1", "weight2", "all"])
def test_backward_matches_finite_differences(rng, direction, x_scale):
    lead = (3, 17)
    p32, p64 = consistent_inputs(rng, lead, D, H, x_scale)
    dy, x, w1, w2 = (p64[n] for n in ("grad_output", "hidden_states", "weight1", "weight2"))
    dirs = {"hidden_states": rng.standard_normal(x.shape),
            "weight1": 0.02 * rng.standard_normal(w1.shape),
            "weight2": 0.02 * rng.standard_normal(w2.shape)}
    used = list(dirs) if direction == "all" else [direction]
    step = {n: (dirs[n] if n in used else numpy.zeros_like(dirs[n])) for n in dirs}

    h = 1e-6

    def loss_at(s):
        return loss64(dy, x + s * step["hidden_states"], w1 + s * step["weight1"], w2 + s * step["weight2"])

    fd = (loss_at(h) - loss_at(-h)) / (2 * h)

    def directional(grads):
        index = {"hidden_states": 0, "weight1": 1, "weight2": 2}
        return sum(float(numpy.vdot(numpy.asarray(grads[index[n]], dtype=F64).ravel(), dirs[n].ravel()))
                   for n in used)

    # measured: ~1e-9 for the float64 reference, ~1e-7..2e-6 for the float32 ieee outputs
    d_ref = directional(reference64(p64))
    assert abs(d_ref - fd) <= 1e-7 * abs(fd), (d_ref, fd)
    d_ieee = directional(run(p32, precision="ieee"))
    assert abs(d_ieee - fd) <= 1e-4 * abs(fd), (d_ieee, fd)


# ---------------------------------------------------------------------------------------------
# The benchmark's check
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["ieee", "bf16x3"])
def test_benchmark_check_passes(rng, precision):
    inp = make(rng, (2, 64))
    ref32 = W.reference(inp, dtype=F32)
    ref64 = reference64(inp)
    out = run(inp, precision=precision)
    for o, r32, r64, name in zip(out, ref32, ref64, OUTPUT_NAMES):
        c = W.check(o, r32, r64.reshape(r32.shape), atol=W.max_atol(128, nearest=True))
        assert c.passed and c.finite, (name, c)
        assert c.matched == 1.0, (name, c)
        assert c.rel_l2 <= cupyffn.PRECISIONS[precision].contract, (name, c)


def test_benchmark_check_can_fail(rng):
    inp = make(rng, (2, 64))
    ref32 = W.reference(inp, dtype=F32)
    good = run(inp, precision="ieee")[1]
    atol = W.max_atol(128, nearest=True)  # T = 128 is not official: the nearest official T's bound
    assert W.check(good, ref32[1], atol=atol).passed
    assert not W.check(good * F32(1.5), ref32[1], atol=atol).passed
    poisoned = good.copy()
    poisoned[3, 4] = numpy.nan
    c = W.check(poisoned, ref32[1], atol=atol)
    assert not c.passed and not c.finite


# ---------------------------------------------------------------------------------------------
# Call semantics
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead", [(2, 3, 5), (7,), (), (1,), (4, 1, 3)], ids=repr)
def test_leading_dimensions(rng, lead):
    inp = make(rng, lead)
    out = run(inp, precision="ieee")
    assert out.grad_hidden_states.shape == lead + (D,)
    assert out.grad_weight1.shape == (H, D) and out.grad_weight2.shape == (D, H)
    assert all(o.dtype == F32 and isinstance(o, numpy.ndarray) for o in out)
    assert_close_to_reference(out, inp, 5e-6)
    # the same rows as a plain [T, D] / [T, H] call give the same bits
    flat = {n: (a.reshape(-1, a.shape[-1]) if n not in ("weight1", "weight2") else a) for n, a in inp.items()}
    flat_out = run(flat, precision="ieee")
    numpy.testing.assert_array_equal(out.grad_hidden_states.reshape(-1, D), flat_out.grad_hidden_states)
    numpy.testing.assert_array_equal(out.grad_weight1, flat_out.grad_weight1)
    numpy.testing.assert_array_equal(out.grad_weight2, flat_out.grad_weight2)


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_single_row_without_leading_dims(rng, precision):
    inp = make(rng, ())
    assert inp["grad_output"].shape == (D,)
    out = run(inp, precision=precision)
    assert out.grad_hidden_states.shape == (D,)
    assert_close_to_reference(out, inp, cupyffn.PRECISIONS[precision].contract)


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_single_token(rng, precision):
    inp = make(rng, (1,))
    out = run(inp, precision=precision)
    assert out.grad_hidden_states.shape == (1, D)
    assert_close_to_reference(out, inp, cupyffn.PRECISIONS[precision].contract)


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_odd_sizes(rng, precision):
    inp = make(rng, (3, 11), 37, 53)
    out = run(inp, precision=precision)
    assert out.grad_weight1.shape == (53, 37) and out.grad_weight2.shape == (37, 53)
    assert_close_to_reference(out, inp, cupyffn.PRECISIONS[precision].contract)


@pytest.mark.parametrize("lead", [(0,), (2, 0, 3)], ids=repr)
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_zero_tokens(rng, precision, lead):
    inp = make(rng, lead)
    out = run(inp, precision=precision)
    assert out.grad_hidden_states.shape == lead + (D,)
    assert out.grad_weight1.shape == (H, D) and out.grad_weight2.shape == (D, H)
    assert (out.grad_weight1 == 0).all() and (out.grad_weight2 == 0).all()
    # given outputs full of NaN are overwritten with zeros ...
    given = [random_like(rng, s, numpy.nan) for s in grad_shapes(inp)]
    out = run(inp, precision=precision, out=given)
    assert all(o is g for o, g in zip(out, given))
    assert (given[1] == 0).all() and (given[2] == 0).all()
    # ... and accumulate=True leaves them as they were
    given = [random_like(rng, s) for s in grad_shapes(inp)]
    before = [g.copy() for g in given]
    run(inp, precision=precision, out=given, accumulate=True)
    numpy.testing.assert_array_equal(given[1], before[1])
    numpy.testing.assert_array_equal(given[2], before[2])


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_out_arrays_are_written_and_returned(rng, precision):
    inp = make(rng, (2, 25))
    fresh = run(inp, precision=precision)
    given = [random_like(rng, s) for s in grad_shapes(inp)]
    out = run(inp, precision=precision, out=given)
    assert isinstance(out, cupyffn.FFNGrads)
    for o, g, f, name in zip(out, given, fresh, OUTPUT_NAMES):
        assert o is g, name
        numpy.testing.assert_array_equal(g, f, err_msg=name)
    # a list works as well as a tuple, and unpacking gives the same objects
    gh, gw1, gw2 = run(inp, precision=precision, out=list(given))
    assert gh is given[0] and gw1 is given[1] and gw2 is given[2]


@pytest.mark.parametrize("missing", [0, 1, 2, (0, 2), (0, 1, 2)], ids=repr)
def test_out_entries_may_be_none(rng, missing):
    inp = make(rng, (30,))
    fresh = run(inp, precision="ieee")
    missing = (missing,) if isinstance(missing, int) else missing
    given = [None if i in missing else random_like(rng, s) for i, s in enumerate(grad_shapes(inp))]
    out = run(inp, precision="ieee", out=given)
    for i, (o, g, f) in enumerate(zip(out, given, fresh)):
        if i in missing:
            assert isinstance(o, numpy.ndarray) and o.dtype == F32 and o.flags.c_contiguous
            assert all(o is not x for x in given if x is not None)
        else:
            assert o is g
        numpy.testing.assert_array_equal(o, f)


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_accumulate_adds_into_weight_grads_and_overwrites_grad_hidden(rng, precision):
    inp = make(rng, (40,))
    fresh = run(inp, precision=precision)
    given = [random_like(rng, s) for s in grad_shapes(inp)]
    prior = [g.copy() for g in given]
    out = run(inp, precision=precision, out=given, accumulate=True)
    assert all(o is g for o, g in zip(out, given))
    numpy.testing.assert_array_equal(given[0], fresh[0])  # overwritten
    numpy.testing.assert_array_equal(given[1], prior[1] + fresh[1])
    numpy.testing.assert_array_equal(given[2], prior[2] + fresh[2])
    assert not numpy.allclose(given[1], fresh[1])  # the prior contents mattered


def test_accumulate_twice_doubles(rng):
    inp = make(rng, (40,))
    fresh = run(inp, precision="bf16x3")
    given = [None, fresh[1].copy(), fresh[2].copy()]
    out = run(inp, precision="bf16x3", out=given, accumulate=True)
    assert out.grad_weight1 is given[1] and out.grad_weight2 is given[2]
    assert isinstance(out.grad_hidden_states, numpy.ndarray)
    numpy.testing.assert_array_equal(out.grad_hidden_states, fresh[0])
    numpy.testing.assert_array_equal(given[1], 2 * fresh[1])
    numpy.testing.assert_array_equal(given[2], 2 * fresh[2])


def test_accumulate_without_grad_hidden(rng):
    inp = make(rng, (40,))
    fresh = run(inp, precision="ieee")
    given = [None, random_like(rng, (H, D)), random_like(rng, (D, H))]
    prior = [None, given[1].copy(), given[2].copy()]
    out = run(inp, precision="ieee", out=given, accumulate=True, need_grad_hidden=False)
    assert out.grad_hidden_states is None
    numpy.testing.assert_array_equal(given[1], prior[1] + fresh[1])
    numpy.testing.assert_array_equal(given[2], prior[2] + fresh[2])


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_need_grad_hidden_false(rng, precision):
    inp = make(rng, (40,))
    full = run(inp, precision=precision)
    out = run(inp, precision=precision, need_grad_hidden=False)
    assert out.grad_hidden_states is None
    numpy.testing.assert_array_equal(out.grad_weight1, full.grad_weight1)
    numpy.testing.assert_array_equal(out.grad_weight2, full.grad_weight2)
    ref = reference64(inp)
    bound = cupyffn.PRECISIONS[precision].contract
    assert rel_l2(out.grad_weight1, ref[1]) <= bound and rel_l2(out.grad_weight2, ref[2]) <= bound


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_need_weight_grads_false(rng, precision):
    inp = make(rng, (40,))
    full = run(inp, precision=precision)
    given = random_like(rng, (40, D), numpy.nan)
    out = run(inp, precision=precision, need_weight_grads=False, out=(given, None, None))
    assert out.grad_weight1 is None and out.grad_weight2 is None
    assert out.grad_hidden_states is given
    numpy.testing.assert_array_equal(given, full.grad_hidden_states)
    assert rel_l2(given, reference64(inp)[0]) <= cupyffn.PRECISIONS[precision].contract


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_inputs_are_not_modified(rng, precision, accumulate):
    inp = make(rng, (3, 13))
    before = {n: a.copy() for n, a in inp.items()}
    out = [random_like(rng, s) for s in grad_shapes(inp)] if accumulate else None
    run(inp, precision=precision, out=out, accumulate=accumulate)
    for n in INPUT_NAMES:
        assert inp[n].tobytes() == before[n].tobytes(), n


@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_nan_poisoned_outputs_are_fully_overwritten(rng, precision):
    inp = make(rng, (2, 20))
    fresh = run(inp, precision=precision)
    given = [random_like(rng, s, numpy.nan) for s in grad_shapes(inp)]
    run(inp, precision=precision, out=given)
    for g, f, name in zip(given, fresh, OUTPUT_NAMES):
        assert numpy.isfinite(g).all(), name
        numpy.testing.assert_array_equal(g, f, err_msg=name)


def embed(rng, a, layout):
    """A view of new memory holding a's values with a row-strided layout; the other elements of
    the backing array are random garbage that must not be read."""
    cols = a.shape[-1]
    rows = a.size // cols
    if layout == "column_slice":  # big[:, :C] of a wider array
        big = random_like(rng, (rows, cols + 13))
        view = big[:, :cols]
    elif layout == "row_slice":  # a block of rows inside a taller array (contiguous, offset start)
        big = random_like(rng, (rows + 9, cols))
        view = big[5: 5 + rows]
    elif layout == "row_step":  # every other row
        big = random_like(rng, (2 * rows, cols))
        view = big[::2]
    else:
        raise AssertionError(layout)
    view = view.reshape(a.shape)
    assert numpy.shares_memory(view, big)  # still a view, not a copy
    view[...] = a
    return view


@pytest.mark.parametrize("lead", [(30,), (2, 3, 5)], ids=repr)
@pytest.mark.parametrize("layout", ["column_slice", "row_slice", "row_step"])
@pytest.mark.parametrize("precision", ["ieee", "bf16x3", "tf32"])
def test_row_strided_inputs_match_contiguous(rng, precision, layout, lead):
    inp = make(rng, lead)
    strided = {n: embed(rng, a, layout) for n, a in inp.items()}
    for n in INPUT_NAMES:
        assert strided[n].flags.c_contiguous == (layout == "row_slice"), n
        numpy.testing.assert_array_equal(strided[n], inp[n])
    expected = run(inp, precision=precision)
    got = run(strided, precision=precision)
    for g, e, name in zip(got, expected, OUTPUT_NAMES):
        assert g.flags.c_contiguous and g.shape == e.shape
        numpy.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6 * float(numpy.abs(e).max()), err_msg=name)
    for n in INPUT_NAMES:  # the views (and the garbage around them) were only read
        numpy.testing.assert_array_equal(strided[n], inp[n])


# ---------------------------------------------------------------------------------------------
# NaN / Inf propagation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["nan_grad_output", "inf_hidden_states", "both", "nan_tanh_inner",
                                  "inf_weight1"])
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_nonfinite_values_propagate_like_fp32_reference(rng, precision, case):
    T = 30
    inp = make(rng, (T,))
    r, c = int(rng.integers(T)), int(rng.integers(D))
    if case in ("nan_grad_output", "both"):
        inp["grad_output"][r, c] = numpy.nan
    if case in ("inf_hidden_states", "both"):
        inp["hidden_states"][int(rng.integers(T)), int(rng.integers(D))] = numpy.inf
    if case == "nan_tanh_inner":
        inp["tanh_inner"][r, int(rng.integers(H))] = numpy.nan
    if case == "inf_weight1":
        inp["weight1"][int(rng.integers(H)), c] = -numpy.inf
    with numpy.errstate(all="ignore"):
        ref32 = W.reference(inp, dtype=F32)
    out = run(inp, precision=precision)
    any_bad = any_good = False
    for o, ref, name in zip(out, ref32, OUTPUT_NAMES):
        want = ~numpy.isfinite(ref)
        got = ~numpy.isfinite(o.reshape(ref.shape))
        assert numpy.array_equal(got, want), (
            f"{name}: {int(got.sum())} non-finite, reference {int(want.sum())}, "
            f"{int((got != want).sum())} differ")
        any_bad |= bool(want.any())
        any_good |= bool((~want).any())
    assert any_bad and any_good  # the masks are not trivial


def test_nan_in_grad_output_row_stays_in_that_row(rng):
    inp = make(rng, (30,))
    inp["grad_output"][7, 3] = numpy.nan
    for precision in PRECISION_NAMES:
        gh = run(inp, precision=precision).grad_hidden_states
        bad_rows = numpy.flatnonzero(~numpy.isfinite(gh).all(axis=1))
        assert bad_rows.tolist() == [7], precision
        assert numpy.isnan(gh[7]).all(), precision


# ---------------------------------------------------------------------------------------------
# The plan class on the CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_plan_matches_function(rng, precision):
    inp = make(rng, (2, 21))
    plan = cupyffn.GeluFFNBackward(42, D, H, precision=precision, device="cpu")
    assert plan.device == "cpu" and plan.precision.name == precision
    assert plan.scratch_bytes == 0 and plan.workspace_bytes == 0
    want = run(inp, precision=precision)
    for attempt in range(2):  # a plan is reusable
        got = plan(*args_of(inp))
        for g, w, name in zip(got, want, OUTPUT_NAMES):
            numpy.testing.assert_array_equal(g, w, err_msg=name)
    # the same number of tokens with other leading dimensions
    flat = {n: (a.reshape(42, -1) if n not in ("weight1", "weight2") else a) for n, a in inp.items()}
    numpy.testing.assert_array_equal(plan(*args_of(flat)).grad_weight1, want.grad_weight1)
    # out= and accumulate through the plan
    given = [random_like(rng, s) for s in grad_shapes(inp)]
    prior = [g.copy() for g in given]
    got = plan(*args_of(inp), out=given, accumulate=True)
    assert all(o is g for o, g in zip(got, given))
    numpy.testing.assert_array_equal(given[0], want[0])
    numpy.testing.assert_array_equal(given[1], prior[1] + want[1])


def test_plan_need_flags(rng):
    inp = make(rng, (20,))
    want = run(inp, precision="ieee")
    only_w = cupyffn.GeluFFNBackward(20, D, H, precision="ieee", device="cpu", need_grad_hidden=False)(*args_of(inp))
    assert only_w.grad_hidden_states is None
    numpy.testing.assert_array_equal(only_w.grad_weight2, want.grad_weight2)
    only_h = cupyffn.GeluFFNBackward(20, D, H, precision="ieee", device="cpu", need_weight_grads=False)(*args_of(inp))
    assert only_h.grad_weight1 is None and only_h.grad_weight2 is None
    numpy.testing.assert_array_equal(only_h.grad_hidden_states, want.grad_hidden_states)


@pytest.mark.parametrize("other", [(21, D, H), (20, 32, H), (20, D, 128)], ids=repr)
def test_plan_rejects_other_sizes(rng, other):
    plan = cupyffn.GeluFFNBackward(20, D, H, device="cpu")
    inp = make(rng, (other[0],), other[1], other[2])
    before = {n: a.copy() for n, a in inp.items()}
    with pytest.raises(ValueError, match=rf"this plan is for \(tokens, dim, hidden_dim\) = \(20, {D}, {H}\); "
                                         rf"the arrays give \({other[0]}, {other[1]}, {other[2]}\)"):
        plan(*args_of(inp))
    for n in INPUT_NAMES:
        assert inp[n].tobytes() == before[n].tobytes()


def test_plan_rejects_graph_on_cpu():
    with pytest.raises(ValueError, match=r"graph=True needs a GPU plan; device='cpu'"):
        cupyffn.GeluFFNBackward(20, D, H, device="cpu", graph=True)


def test_plan_with_zero_tokens(rng):
    inp = make(rng, (0,))
    plan = cupyffn.GeluFFNBackward(0, D, H, device="cpu")
    out = plan(*args_of(inp))
    assert out.grad_hidden_states.shape == (0, D)
    assert (out.grad_weight1 == 0).all() and (out.grad_weight2 == 0).all()
