"""gelu_ffn_forward, the backward's memory mode and check_activations (NumPy backend here; the GPU
versions of the same checks are in test_gpu_forward.py)."""

import math

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W

PRECISIONS = list(cupyffn.PRECISIONS)


def rel(a, b):
    a = numpy.asarray(a, dtype=numpy.float64).reshape(b.shape)
    return float(numpy.linalg.norm(a - b) / numpy.linalg.norm(b))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_matches_float64(precision):
    inputs = W.make_inputs((3, 41), 96, 384, seed=5)
    x, w1, w2 = inputs["hidden_states"], inputs["weight1"], inputs["weight2"]
    copies = [a.copy() for a in (x, w1, w2)]
    got = cupyffn.gelu_ffn_forward(x, w1, w2, precision=precision)
    assert isinstance(got, cupyffn.FFNForward)
    assert got.output.shape == (3, 41, 96) and got.linear1_out.shape == (3, 41, 384)
    ref = W.forward_reference(x, w1, w2)
    limit = cupyffn.PRECISIONS[precision].contract
    for name, g, r in zip(cupyffn.FFNForward._fields, got, ref):
        assert numpy.isfinite(g).all(), name
        assert rel(g, r) <= limit, (name, rel(g, r))
    for a, c in zip((x, w1, w2), copies):
        assert numpy.array_equal(a, c)


def test_forward_saved_tensors_are_consistent_and_feed_the_backward():
    """tanh_inner and gelu_out are the tanh-GELU of the returned linear1_out, in fp32."""
    inputs = W.make_inputs((64,), 128, 512, seed=6)
    f = cupyffn.gelu_ffn_forward(inputs["hidden_states"], inputs["weight1"], inputs["weight2"], precision="ieee")
    z = f.linear1_out.astype(numpy.float64)
    t = numpy.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))
    assert numpy.abs(f.tanh_inner - t).max() < 1e-6
    assert numpy.abs(f.gelu_out - 0.5 * z * (1 + t)).max() < 1e-6
    dy = numpy.random.default_rng(1).standard_normal(f.output.shape).astype(numpy.float32)
    cupyffn.gelu_ffn_backward(dy, inputs["hidden_states"], inputs["weight1"], inputs["weight2"], *f[1:],
                              check_activations=True)


def test_forward_out_and_errors():
    inputs = W.make_inputs((16,), 32, 64, seed=7)
    x, w1, w2 = inputs["hidden_states"], inputs["weight1"], inputs["weight2"]
    out = [numpy.full(s, numpy.nan, numpy.float32) for s in ((16, 32), (16, 64), (16, 64), (16, 64))]
    got = cupyffn.gelu_ffn_forward(x, w1, w2, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert all(numpy.isfinite(o).all() for o in out)
    with pytest.raises(TypeError, match=r"hidden_states must be float32 \(or bfloat16 / float16.*\); got float64"):
        cupyffn.gelu_ffn_forward(x.astype(numpy.float64), w1, w2)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(dim, hidden_dim\) = \(32, 64\) to match .*; "
                                         r"got \(64, 32\)"):
        cupyffn.gelu_ffn_forward(x, w1, w2.T.copy())
    big = numpy.random.default_rng(2).standard_normal(16 * 32 + 16 * 64).astype(numpy.float32)
    x_view = big[:16 * 32].reshape(16, 32)
    overlapping = big[100:100 + 16 * 64].reshape(16, 64)
    with pytest.raises(ValueError, match=r"out\[1\] \(linear1_out\) overlaps the memory of hidden_states"):
        cupyffn.gelu_ffn_forward(x_view, w1, w2, out=(None, overlapping, None, None))
    bad = numpy.empty((16, 64), numpy.float32)
    with pytest.raises(ValueError, match=r"out\[2\] \(tanh_inner\) overlaps out\[1\] \(linear1_out\)"):
        cupyffn.gelu_ffn_forward(x, w1, w2, out=(None, bad, bad, None))
    with pytest.raises(ValueError, match="precision must be one of"):
        cupyffn.gelu_ffn_forward(x, w1, w2, precision="fp8")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("drop", ["tanh_inner", "gelu_out", "both"])
def test_memory_mode_matches_full_mode(precision, drop):
    inputs = W.make_inputs((2, 37), 64, 256, seed=8)
    args = [inputs[n] for n in W.INPUT_NAMES]
    full = cupyffn.gelu_ffn_backward(*args, precision=precision)
    if drop in ("tanh_inner", "both"):
        args[5] = None
    if drop in ("gelu_out", "both"):
        args[6] = None
    lean = cupyffn.gelu_ffn_backward(*args, precision=precision)
    ref = W.reference(inputs)
    limit = cupyffn.PRECISIONS[precision].contract
    for f, m, r in zip(full, lean, ref):
        assert rel(m, r) <= limit
        # recomputing tanh in fp32 changes inputs by ulps only: results agree far inside the contract
        assert rel(m, f.astype(numpy.float64).reshape(r.shape)) <= limit / 4


def test_memory_mode_validation():
    inputs = W.make_inputs((8,), 16, 32, seed=9)
    args = [inputs[n] for n in W.INPUT_NAMES]
    args[4] = None
    with pytest.raises(TypeError, match="linear1_out is required; only tanh_inner and gelu_out may be None"):
        cupyffn.gelu_ffn_backward(*args)


def _erf_gelu(z):
    return (0.5 * z * (1 + numpy.vectorize(math.erf)(z / math.sqrt(2)))).astype(numpy.float32)


@pytest.mark.parametrize("case,message", [
    ("erf", "exact \\(erf\\) GELU"),
    ("argument", "holds the argument of tanh"),
    ("swapped", "look swapped"),
    ("stale", "stale or mismatched buffers"),
])
def test_check_activations_names_the_cause(case, message):
    inputs = W.make_inputs((64,), 1536, 256, seed=10)  # D = 1536: pre-activations of realistic size
    args = [inputs[n] for n in W.INPUT_NAMES]
    cupyffn.gelu_ffn_backward(*args, check_activations=True)  # consistent: no error
    z, t, g = inputs["linear1_out"], inputs["tanh_inner"], inputs["gelu_out"]
    if case == "erf":
        args[6] = _erf_gelu(z)
    elif case == "argument":
        args[5] = (math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)).astype(numpy.float32)
    elif case == "swapped":
        args[5], args[6] = g, t
    else:
        args[5] = numpy.roll(t, 1, axis=0)
    with pytest.raises(cupyffn.ActivationMismatchError, match=message):
        cupyffn.gelu_ffn_backward(*args, check_activations=True)


@pytest.mark.parametrize("where,bad,saved", [
    ("linear1_out", numpy.nan, "full"), ("linear1_out", numpy.inf, "full"), ("linear1_out", numpy.nan, "memory mode"),
    ("tanh_inner", numpy.nan, "full"), ("gelu_out", -numpy.inf, "full"),
])
def test_check_activations_reports_non_finite(where, bad, saved):
    """One NaN / Inf is far below the sampled comparison's 1%, yet makes the gradients NaN: every element of the
    saved activations given is tested, linear1_out in memory mode too, and the message names the tensor and where."""
    inputs = W.make_inputs((3, 41), 96, 384, seed=11)
    args = [inputs[n].copy() if n in ("linear1_out", "tanh_inner", "gelu_out") else inputs[n]
            for n in W.INPUT_NAMES]
    if saved == "memory mode":
        args[5] = args[6] = None
    cupyffn.gelu_ffn_backward(*args, check_activations=True)  # finite and consistent: no error
    args[W.INPUT_NAMES.index(where)][2, 17, 100] = bad  # row 2 * 41 + 17 = 99 of the [123, 384] token rows
    kept = [None if a is None else a.copy() for a in args]
    value = "nan" if numpy.isnan(bad) else str(float(bad))
    with pytest.raises(cupyffn.ActivationMismatchError,
                       match=rf"{where} holds 1 non-finite element \(the first, {value}, at row 99, column 100 of its "
                             rf"\[123, 384\] view\)"):
        cupyffn.gelu_ffn_backward(*args, check_activations=True)
    for a, k in zip(args, kept):
        assert a is None or numpy.array_equal(a, k, equal_nan=True)  # the inputs as given
    unchecked = cupyffn.gelu_ffn_backward(*args)
    assert not all(numpy.isfinite(g).all() for g in unchecked)  # what the check saves the caller from


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_check_activations_reports_non_finite_16_bit(dtype):
    """The test reads the exponent bits, so 16-bit saved tensors (bfloat16 through ml_dtypes) are covered alike."""
    ml_dtypes = pytest.importorskip("ml_dtypes") if dtype == "bfloat16" else None
    dt = numpy.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = numpy.random.default_rng(12)
    x = rng.standard_normal((16, 64)).astype(dt)
    w1, w2 = (0.05 * rng.standard_normal(s, dtype=numpy.float32) for s in ((128, 64), (64, 128)))
    f = cupyffn.gelu_ffn_forward(x, w1, w2)
    dy = numpy.ones_like(f.output)
    cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out, check_activations=True)
    gelu_out = f.gelu_out.copy()
    gelu_out[5, 3] = numpy.nan
    with pytest.raises(cupyffn.ActivationMismatchError, match=r"gelu_out holds 1 non-finite element \(the first, "
                                                              r"nan, at row 5, column 3"):
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, gelu_out, check_activations=True)
