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
