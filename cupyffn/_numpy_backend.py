"""The CPU engine: the same backward pass in NumPy, for NumPy inputs.

It follows the GPU plans operand for operand (same rounding of every GEMM operand to bf16 / fp16,
same bf16x3 split, fp32 products and accumulation), so each precision's accuracy can be checked on
a machine without a GPU. Rounding is done on float32 bit patterns (round to nearest even).
"""

import numpy

from . import _arrays, _precision

_SQRT_2_OVER_PI = numpy.float32(0.7978845608028654)
_CUBIC_COEFF = numpy.float32(0.134145)  # 3 * 0.044715


def gelu_grad(x, t):
    """d/dx of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) given t = that tanh (fp32)."""
    half = numpy.float32(0.5)
    one = numpy.float32(1.0)
    return half * (one + t) + half * x * (one - t * t) * _SQRT_2_OVER_PI * (one + _CUBIC_COEFF * x * x)


def tanh_inner(z):
    """tanh(sqrt(2/pi) (z + 0.044715 z^3)) in fp32."""
    return numpy.tanh(_SQRT_2_OVER_PI * (z + numpy.float32(0.044715) * z * z * z)).astype(numpy.float32)


def bf16_round(x):
    """float32 array -> float32 array of bf16 values (nearest even; finite values never round to inf)."""
    x = numpy.asarray(x, dtype=numpy.float32)
    u = x.view(numpy.uint32).astype(numpy.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(numpy.uint32).view(numpy.float32)
    truncated = (u & 0xFFFF0000).astype(numpy.uint32).view(numpy.float32)
    with numpy.errstate(invalid="ignore"):
        overflow = numpy.isinf(rounded) & numpy.isfinite(x)
    out = numpy.where(overflow, truncated, rounded)
    return numpy.where(numpy.isnan(x), x, out)


def bf16_split(x):
    """(hi, lo) with hi = bf16(x), lo = bf16(x - hi); lo = 0 where hi is not finite."""
    hi = bf16_round(x)
    with numpy.errstate(invalid="ignore", over="ignore"):
        lo = numpy.where(numpy.isfinite(hi), bf16_round(x - hi), numpy.float32(0))
    return hi, lo.astype(numpy.float32)


def f16_exponent(x):
    """Power-of-two exponent e so that max |finite x| * 2^e lies in [2^13, 2^14) (0 for an all-zero x)."""
    finite = numpy.abs(x[numpy.isfinite(x)])
    amax = float(finite.max()) if finite.size else 0.0
    if amax == 0.0:
        return 0
    _, k = numpy.frexp(numpy.float32(amax))
    return int(min(max(14 - int(k), -126), 127))


def f16_round_scaled(x, e):
    """fp16(x * 2^e) as float32 values (still scaled)."""
    with numpy.errstate(over="ignore"):
        return numpy.ldexp(x, e).astype(numpy.float32).astype(numpy.float16).astype(numpy.float32)


def _operands(x, precision):
    """The (planes, exponent) a GEMM reads for the fp32 matrix x: a list of fp32 arrays and 2^-exponent."""
    fmt = precision.fmt
    if fmt == _precision.FMT_F32:
        return [x], 0
    if fmt == _precision.FMT_BF16:
        return [bf16_round(x)], 0
    if fmt == _precision.FMT_BF16X3:
        return list(bf16_split(x)), 0
    e = f16_exponent(x)
    return [f16_round_scaled(x, e)], e


def _matmul(a, b, precision):
    """a @ b (float32) with the operand treatment of `precision`; accumulation in fp32."""
    (pa, ea), (pb, eb) = _operands(a, precision), _operands(b, precision)
    with numpy.errstate(all="ignore"):
        if precision.fmt == _precision.FMT_BF16X3:
            (ah, al), (bh, bl) = pa, pb
            c = ah @ bh + ah @ bl + al @ bh  # lo * lo is not formed, as on the GPU
        else:
            c = pa[0] @ pb[0]
        if ea or eb:
            c = numpy.ldexp(c, -(ea + eb)).astype(numpy.float32)
    return c


def backward(call, precision, need_grad_hidden, need_weight_grads, accumulate, outputs):
    """Compute the gradients of `call` (a _validate.Call on NumPy arrays) into `outputs` (2-D views).

    tanh_inner / gelu_out may be absent (memory mode): they are recomputed from linear1_out.
    """
    dy, x, w1, w2, l1, t, g = (None if a is None else _arrays.view2d(a, m) for a, m in zip(call.arrays, call.inputs))
    grad_hidden, grad_w1, grad_w2 = outputs
    with numpy.errstate(all="ignore"):
        if t is None:
            t = tanh_inner(l1)
        if g is None and need_weight_grads:
            g = numpy.float32(0.5) * l1 * (numpy.float32(1) + t)
        grad_gelu = _matmul(dy, w2, precision)
        if need_weight_grads:
            _store(grad_w2, _matmul(dy.T, g, precision), accumulate)
        grad_linear1 = grad_gelu * gelu_grad(l1, t)
        if need_grad_hidden:
            _store(grad_hidden, _matmul(grad_linear1, w1, precision), False)
        if need_weight_grads:
            _store(grad_w1, _matmul(grad_linear1.T, x, precision), accumulate)


def forward(x, w1, w2, precision, outputs):
    """output, linear1_out, tanh_inner, gelu_out of the 2-D fp32 arrays x, w1, w2 into `outputs` (2-D views)."""
    y, z_out, t_out, g_out = outputs
    with numpy.errstate(all="ignore"):
        z = _matmul(x, w1.T, precision)
        t = tanh_inner(z)
        g = numpy.float32(0.5) * z * (numpy.float32(1) + t)
        z_out[...], t_out[...], g_out[...] = z, t, g
        y[...] = _matmul(g, w2.T, precision)


def _store(dst, value, accumulate):
    if accumulate:
        dst += value
    else:
        dst[...] = value
