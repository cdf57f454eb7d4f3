"""The cuBLASLt route on the CPU (bfloat16 / float16 activations): NumPy in float32 with the GPU plan's roundings
(fp32 weights and biases to the activation dtype, as autocast casts them; GELU from the fp32 pre-activation, as
cuBLASLt's epilogue; grad_linear1 rounded to the activation dtype once before GEMM3 and GEMM4), so the two agree.
Called by cupyffn/cpu/backend.py's NumpyEngine with 2-D input views (weights as [out, in]) and 2-D output views."""

import numpy

from ..core import activation
from ..core.views import numpy_dtype


def _as_act(a, act):
    """fp32 copy of `a` after rounding to the activation dtype (what the GPU multiplies)."""
    return a.astype(numpy_dtype(act)).astype(numpy.float32)


def forward(call, arrays, views):
    """views: output, linear1_out, (tanh_inner: None), gelu_out."""
    x, w1, w2, b1, b2 = arrays
    act = call.act
    xf, w1f, w2f = (_as_act(a, act) for a in (x, w1, w2))
    zf = xf @ w1f.T
    if b1 is not None:
        zf += _as_act(b1[0], act)
    gf = activation.forward(zf)[1]  # from the fp32 value, as cuBLASLt's epilogue
    yf = _as_act(gf, act) @ w2f.T
    if b2 is not None:
        yf += _as_act(b2[0], act)
    y, z, _, g = views
    y[...], z[...], g[...] = yf.astype(y.dtype), zf.astype(z.dtype), gf.astype(g.dtype)


def backward(call, arrays, views):
    """views: grad_hidden_states, grad_weight1, grad_weight2[, grad_bias1, grad_bias2] (None where not computed)."""
    dy, x, w1, w2, z, _, g = arrays
    act, accumulate = call.act, call.request.accumulate
    dyf, xf, zf = (a.astype(numpy.float32) for a in (dy, x, z))
    gf = g.astype(numpy.float32) if g is not None else _as_act(activation.forward(zf)[1], act)
    w1f, w2f = _as_act(w1, act), _as_act(w2, act)
    t = activation.tanh_inner(zf)
    gl = _as_act((dyf @ w2f) * activation.grad(zf, t), act)
    values = (lambda: gl @ w1f, lambda: gl.T @ xf, lambda: dyf.T @ gf, lambda: gl.sum(0), lambda: dyf.sum(0))
    for i, (view, value) in enumerate(zip(views, values)):
        if view is None:
            continue
        v = value().reshape(view.shape)
        if accumulate and i > 0:
            v = view.astype(numpy.float32) + v
        view[...] = v.astype(view.dtype)
