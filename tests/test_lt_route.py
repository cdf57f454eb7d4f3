"""CPU: biases and 16-bit activations through the front door (cupyffn/api/validate.py, the NumPy backend's emulation
of the cuBLASLt route in cupyffn/cpu/numpy_route.py and of the float32 engine): numerics against float64, argument checks,
and the FFNGrads bias attributes."""

import math

import numpy
import pytest

import cupyffn

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = numpy.dtype(ml_dtypes.bfloat16)
C = math.sqrt(2 / math.pi)


def make(T=48, D=16, H=64, act=numpy.float32, seed=0):
    r = numpy.random.default_rng(seed)
    x, dy = (r.standard_normal((T, D)).astype(act) for _ in range(2))
    w1, w2 = (0.2 * r.standard_normal((H, D))).astype(numpy.float32), (0.2 * r.standard_normal((D, H))).astype(
        numpy.float32)
    b1, b2 = r.standard_normal(H).astype(numpy.float32), r.standard_normal(D).astype(numpy.float32)
    return x, dy, w1, w2, b1, b2


def reference(x, dy, w1, w2, b1, b2):
    x, dy, w1, w2, b1, b2 = (numpy.asarray(a, numpy.float64) for a in (x, dy, w1, w2, b1, b2))
    z = x @ w1.T + b1
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    gl = (dy @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z))
    return g @ w2.T + b2, z, g, (gl @ w1, gl.T @ x, dy.T @ g, gl.sum(0), dy.sum(0))


def rel(a, r):
    a = numpy.asarray(a, numpy.float64)
    assert numpy.isfinite(a).all()
    return numpy.linalg.norm(a - r) / numpy.linalg.norm(r)


@pytest.mark.parametrize("act,tol", [(numpy.float32, 1e-6), (numpy.float16, 3e-3), (BF16, 2e-2)])
def test_numpy_route_matches_float64(act, tol):
    x, dy, w1, w2, b1, b2 = make(act=act)
    y, z, g, grads = reference(x, dy, w1, w2, b1, b2)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    # 16-bit activations keep no tanh_inner (their backward recomputes it); float32 ones run the float32 engine's
    # forward, which returns it as without biases
    assert f.output.dtype == act and (f.tanh_inner is None) == (act != numpy.float32)
    for got, want in ((f.output, y), (f.linear1_out, z), (f.gelu_out, g)):
        assert rel(got, want) < tol
    res = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, need_bias_grads=True)
    dx, dw1, dw2 = res  # unpacks as three, bias gradients are attributes
    assert dx.dtype == act and dw1.dtype == numpy.float32 and res.grad_bias1.dtype == numpy.float32
    for got, want in zip((dx, dw1, dw2, res.grad_bias1, res.grad_bias2), grads):
        assert rel(got, want) < 2 * tol
    assert "grad_bias1=" in repr(res)


def test_bias_gradients_accumulate_and_out():
    x, dy, w1, w2, b1, b2 = make()
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    _, _, _, grads = reference(x, dy, w1, w2, b1, b2)
    start = [numpy.full(s, 0.5, numpy.float32) for s in ((64, 16), (16, 64), (64,), (16,))]
    out = [numpy.full((48, 16), numpy.nan, numpy.float32)] + [a.copy() for a in start]
    res = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out, need_bias_grads=True,
                                    accumulate=True, out=out)
    assert res[0] is out[0] and res.grad_bias2 is out[4]
    for a, s0, want in zip(out[1:], start, grads[1:]):
        assert rel(a, s0 + want) < 1e-6
    none = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out)
    assert none.grad_bias1 is None and none.grad_bias2 is None


def test_memory_mode_recomputes_gelu_out():
    x, dy, w1, w2, b1, b2 = make(act=BF16)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    _, _, _, grads = reference(x, dy, w1, w2, b1, b2)
    res = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, None, need_bias_grads=True)
    assert rel(res[2], grads[2]) < 3e-2


@pytest.mark.parametrize("change,match", [
    (dict(tanh_inner=numpy.zeros((48, 64), BF16)), "tanh_inner must be None"),
    (dict(precision="tf32"), "precision=None"),
    (dict(hidden_states=numpy.zeros((48, 16), numpy.float16)), "hidden_states must be bfloat16"),
    (dict(weight2=numpy.zeros((16, 64), numpy.float16)), "weight2 must be float32"),
    (dict(linear1_out=numpy.zeros((48, 63), BF16)), r"linear1_out must have shape \(48, 64\)"),
    (dict(out=[None] * 4), "out must be a sequence of three or five arrays"),
    (dict(accumulate=True), "accumulate=True adds into existing gradients: pass out="),
])
def test_backward_arguments_are_checked(change, match):
    x, dy, w1, w2, b1, b2 = make(act=BF16)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1)
    kw = dict(grad_output=dy, hidden_states=x, weight1=w1, weight2=w2, linear1_out=f.linear1_out, tanh_inner=None,
              gelu_out=f.gelu_out, need_bias_grads=True)
    kw.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        cupyffn.gelu_ffn_backward(**kw)


def test_forward_arguments_are_checked():
    x, dy, w1, w2, b1, b2 = make()
    with pytest.raises(ValueError, match=r"bias1 must have shape \(64,\)"):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b2)
    x16 = x.astype(numpy.float16)
    with pytest.raises(ValueError, match=r"out\[2\] \(tanh_inner\) must be None"):
        cupyffn.gelu_ffn_forward(x16, w1, w2, bias1=b1, out=[None, None, numpy.zeros((48, 64), numpy.float16), None])
    with pytest.raises(ValueError, match="precision=None"):
        cupyffn.gelu_ffn_forward(x16, w1, w2, precision="bf16x3")
    with pytest.raises(TypeError, match="weight2 must be float32"):
        cupyffn.gelu_ffn_forward(x16, w1, w2.astype(numpy.float16))
    before = x.copy()
    cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, precision="ieee")
    assert numpy.array_equal(before, x)  # inputs are never modified


@pytest.mark.parametrize("precision", list(cupyffn.PRECISIONS))
def test_float32_with_biases_in_every_precision(precision):
    """float32 activations with biases run the float32 engine's recipe of the precision (here its NumPy model): "tf32"
    means the same scaled-fp16 operands with biases as without (one meaning per name), within each contract."""
    x, dy, w1, w2, b1, b2 = make(T=96, D=32, H=128)
    y, z, g, grads = reference(x, dy, w1, w2, b1, b2)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    res = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, need_bias_grads=True,
                                    precision=precision)
    got = (f.output, res[0], res[1], res[2], res.grad_bias1, res.grad_bias2)
    errors = [rel(a, r) for a, r in zip(got, (y,) + grads)]
    assert max(errors) <= cupyffn.PRECISIONS[precision].contract, errors
    plain = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, precision=precision)
    for a, b in zip(res, plain):
        assert numpy.array_equal(a, b)  # the bias gradients change nothing else
