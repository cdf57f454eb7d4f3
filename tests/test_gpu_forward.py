"""GPU: gelu_ffn_forward, the backward's memory mode and check_activations."""

import math

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

PRECISIONS = list(cupyffn.PRECISIONS)


@pytest.mark.parametrize("shape", [(2, 4096, 1536, 6144), (1, 613, 77, 301), (1, 0, 64, 256)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_matches_float64(precision, shape):
    b, s, dim, hidden = shape
    inputs = W.make_inputs((b, s), dim, hidden, xp=cupy, seed=s + dim)
    x, w1, w2 = inputs["hidden_states"], inputs["weight1"], inputs["weight2"]
    out = [cupy.full(sh, numpy.nan, dtype=cupy.float32) for sh in
           ((b, s, dim), (b, s, hidden), (b, s, hidden), (b, s, hidden))]
    got = cupyffn.gelu_ffn_forward(x, w1, w2, precision=precision, out=out)
    assert all(g is o for g, o in zip(got, out))
    if s == 0:
        return
    limit = cupyffn.PRECISIONS[precision].contract
    for name, g, r in zip(cupyffn.FFNForward._fields, got, W.forward_reference(x, w1, w2, xp=cupy)):
        assert bool(cupy.isfinite(g).all()), name
        err = W.relative_l2(g, r, xp=cupy)
        assert err <= limit, (name, err)


def test_forward_then_backward_with_check_activations():
    inputs = W.make_inputs((1024,), 1536, 6144, xp=cupy, seed=3)
    f = cupyffn.gelu_ffn_forward(inputs["hidden_states"], inputs["weight1"], inputs["weight2"])
    dy = inputs["grad_output"]
    g = cupyffn.gelu_ffn_backward(dy, inputs["hidden_states"], inputs["weight1"], inputs["weight2"], *f[1:],
                                  check_activations=True)
    saved = dict(inputs, linear1_out=f.linear1_out, tanh_inner=f.tanh_inner, gelu_out=f.gelu_out)
    for got, ref in zip(g, W.reference(saved, xp=cupy)):
        assert W.relative_l2(got, ref, xp=cupy) <= 1e-4


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("drop", ["tanh_inner", "gelu_out", "both"])
@pytest.mark.parametrize("tokens", [613, 8192])
def test_memory_mode(precision, drop, tokens):
    inputs = W.make_inputs((tokens,), 1536, 6144, xp=cupy, seed=tokens)
    args = [inputs[n] for n in W.INPUT_NAMES]
    if drop in ("tanh_inner", "both"):
        args[5] = None
    if drop in ("gelu_out", "both"):
        args[6] = None
    out = tuple(cupy.full(a.shape, numpy.nan, dtype=cupy.float32) for a in (args[1], args[2], args[3]))
    got = cupyffn.gelu_ffn_backward(*args, precision=precision, out=out)
    limit = cupyffn.PRECISIONS[precision].contract
    for g, r in zip(got, W.reference(inputs, xp=cupy)):
        assert bool(cupy.isfinite(g).all())
        assert W.relative_l2(g, r, xp=cupy) <= limit


def test_check_activations_on_gpu_detects_erf_gelu():
    inputs = W.make_inputs((256,), 1536, 6144, xp=cupy, seed=4)
    args = [inputs[n] for n in W.INPUT_NAMES]
    cupyffn.gelu_ffn_backward(*args, check_activations=True)
    z = inputs["linear1_out"].astype(cupy.float64)
    from cupyx.scipy.special import erf

    args[6] = (0.5 * z * (1 + erf(z / math.sqrt(2)))).astype(cupy.float32)
    with pytest.raises(cupyffn.ActivationMismatchError, match=r"exact \(erf\) GELU"):
        cupyffn.gelu_ffn_backward(*args, check_activations=True)


@pytest.mark.parametrize("where", ["linear1_out", "tanh_inner", "gelu_out", "linear1_out (memory mode)"])
def test_check_activations_on_gpu_reports_non_finite(where):
    """One NaN among 256 x 6144 elements: the whole-tensor test on the device finds it, names the tensor and where."""
    inputs = W.make_inputs((256,), 1536, 6144, xp=cupy, seed=5)
    args = [inputs[n].copy() for n in W.INPUT_NAMES]
    if where.endswith("(memory mode)"):
        args[5] = args[6] = None
    name = where.split()[0]
    cupyffn.gelu_ffn_backward(*args, check_activations=True)
    args[W.INPUT_NAMES.index(name)][200, 4000] = numpy.nan
    with pytest.raises(cupyffn.ActivationMismatchError,
                       match=rf"{name} holds 1 non-finite element \(the first, nan, at row 200, column 4000"):
        cupyffn.gelu_ffn_backward(*args, check_activations=True)
