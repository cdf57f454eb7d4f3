"""The 16-bit/bias route on the CPU (cupyffn/_lt_api.py): NumPy in float32, with the GPU plan's roundings (weights,
biases and grad_linear1 to the activation dtype; GELU from the fp32 pre-activation; float32 activations in precision
"tf32": every GEMM operand rounded to nearest TF32, as the tensor cores take them), so the two agree."""

import math

import numpy

from ..core.views import numpy_dtype

_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu(z):
    return 0.5 * z * (1.0 + numpy.tanh(numpy.float32(_GELU_C) * (z + numpy.float32(0.044715) * z ** 3)))


def _as_act(a, act):
    """fp32 copy of `a` after rounding to the activation dtype (what the GPU multiplies)."""
    return a.astype(numpy_dtype(act)).astype(numpy.float32)


def _tf32(a):
    """float32 `a` rounded to the nearest TF32 value (10 explicit significand bits, ties to even); NaN stays NaN
    (a payload in the dropped bits alone would otherwise round to inf)."""
    a = numpy.ascontiguousarray(a, numpy.float32)
    bits = a.view(numpy.uint32)
    bits = (bits + numpy.uint32(0xFFF) + ((bits >> numpy.uint32(13)) & numpy.uint32(1))) & numpy.uint32(0xFFFFE000)
    return numpy.where(numpy.isnan(a), a, bits.view(numpy.float32))


def _matmul(precision):
    """a @ b as a GEMM of this float32 precision multiplies (None, "ieee": as given)."""
    if precision == "tf32":
        return lambda a, b: _tf32(a) @ _tf32(b)
    return numpy.matmul


def forward(x, w1, w2, b1, b2, act, res, precision=None):
    xf, w1f, w2f = (_as_act(a, act) for a in (x, w1, w2))
    mm = _matmul(precision)
    zf = mm(xf.reshape(-1, x.shape[-1]), w1f.T)
    if b1 is not None:
        zf += _as_act(b1, act)
    gf = _gelu(zf)  # from the fp32 value, as cuBLASLt's epilogue
    yf = mm(_as_act(gf, act), w2f.T)
    if b2 is not None:
        yf += _as_act(b2, act)
    res[0][...] = yf.reshape(res[0].shape).astype(res[0].dtype)
    res[1][...] = zf.reshape(res[1].shape).astype(res[1].dtype)
    res[3][...] = gf.reshape(res[3].shape).astype(res[3].dtype)


def backward(dy, x, w1, w2, z, g, act, res, accumulate, precision=None):
    D, H = dy.shape[-1], w1.shape[0]
    dyf, xf = dy.reshape(-1, D).astype(numpy.float32), x.reshape(-1, D).astype(numpy.float32)
    zf = z.reshape(-1, H).astype(numpy.float32)
    gf = g.reshape(-1, H).astype(numpy.float32) if g is not None else _as_act(_gelu(zf), act)
    w1f, w2f = _as_act(w1, act), _as_act(w2, act)
    t = numpy.tanh(numpy.float32(_GELU_C) * (zf + numpy.float32(0.044715) * zf ** 3))
    dgelu = 0.5 * (1 + t) + 0.5 * zf * (1 - t * t) * numpy.float32(_GELU_C) * (1 + numpy.float32(3 * 0.044715) * zf * zf)
    mm = _matmul(precision)
    gl = _as_act(mm(dyf, w2f) * dgelu, act)
    values = [mm(gl, w1f) if res[0] is not None else None, mm(gl.T, xf), mm(dyf.T, gf), gl.sum(0), dyf.sum(0)]
    for i, (r, v) in enumerate(zip(res, values)):
        if r is None:
            continue
        v = v.reshape(r.shape)
        if accumulate and i > 0:
            v = r.astype(numpy.float32) + v
        r[...] = v.astype(r.dtype)
