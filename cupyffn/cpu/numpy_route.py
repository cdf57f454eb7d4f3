"""The NumPy route (cupyffn/api/routes.py): the block on the CPU, for NumPy arrays, emulating every GPU route.

* float32 activations (the float32 engine's route): each GEMM runs in the form the precision's recipe gives it
  (precision.effective_forms: same rounding of every operand to bf16 / fp16 / e4m3, same bf16x3 split and
  f16+e4m3 encoding, fp32 products and accumulation), so each precision's accuracy can be checked on a machine
  without a GPU. Rounding is round to nearest even, done on float32 bit patterns (bf16), by NumPy's float16 cast
  (fp16) or exactly in float64 (e4m3); only the summation order of the products may differ from cuBLAS's.
* bfloat16 / float16 activations (the cuBLASLt route): NumPy in float32 with the GPU plan's roundings (fp32 weights
  and biases to the activation dtype, as autocast casts them; GELU from the fp32 pre-activation, as cuBLASLt's
  epilogue; grad_linear1 rounded to the activation dtype once before GEMM3 and GEMM4), so the two agree: `half_forward`,
  `half_backward`.

`NumpyEngine` is this backend behind the engines' protocol (bind, enqueue: cupyffn/api/execute.py runs it).
"""

import numpy

from ..core import activation, arrays as _arrays, precision as _precision
from ..core.views import numpy_dtype

gelu_grad = activation.grad
tanh_inner = activation.tanh_inner


class NumpyEngine:
    """The NumPy backend behind the engines' protocol: `bind(call, outputs)` (cupyffn/core/results.py `Outputs`),
    `enqueue()` computes on the host."""

    def bind(self, call, outputs):
        # outputs are C-contiguous (reshaped to 2-D without a copy) or transposed 2-D weight gradients (kept as they
        # are)
        self._call = call
        self._views = [None if a is None else a.reshape(-1, a.shape[-1]) for a in outputs.arrays]

    def enqueue(self, stream_ptr=None, serial=False, ready=0):
        call, views = self._call, self._views
        arrays = [None if a is None else _view(a, m, call, n)
                  for n, (a, m) in enumerate(zip(call.arrays, call.inputs))]
        if call.act != "float32":
            run = half_forward if call.kind == "forward" else half_backward
            run(call, arrays, views)
        elif call.kind == "forward":
            x, w1, w2, b1, b2 = arrays
            forward(x, w1, w2, call.precision, views, None if b1 is None else b1[0],
                    None if b2 is None else b2[0])
        else:
            r = call.request
            backward_2d(*arrays, call.precision, r.need_grad_hidden, r.need_weight_grads, r.accumulate, views)


def _view(array, m, call, index):
    """Input `index` of `call` as the 2-D array the formulas take (a weight stored transposed: its transpose)."""
    v = _arrays.view2d(array, m)
    weight = index in ((1, 2) if call.kind == "forward" else (2, 3))
    return v.T if weight and call.weights_transposed else v


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


def e4m3_round(x):
    """float32 array -> float32 array of E4M3 "fn" values (bias 7, 3 mantissa bits, subnormals k*2^-9):
    round to nearest even, satfinite (|v| > 448 -> +-448, infinities too); NaN stays NaN and -0 stays -0.
    Exact: the quantum of |x| is 2^max(k - 4, -9) with frexp's k, and float64 holds every step."""
    x = numpy.asarray(x, dtype=numpy.float32).astype(numpy.float64)
    with numpy.errstate(invalid="ignore", over="ignore"):
        _, k = numpy.frexp(x)
        q = numpy.maximum(k - 4, -9)
        r = numpy.ldexp(numpy.rint(numpy.ldexp(x, -q)), q)
        r = numpy.clip(r, -448.0, 448.0)  # NaN passes through clip
    return r.astype(numpy.float32)


def f16e4m3_split(x, e):
    """The f16+e4m3 form's encoding of the fp32 array x at scale exponent e (kernels_cu/split_e4m3.cu's):
    (hi, H8, L8) as float32 arrays with s = x 2^e, hi = fp16(s), lo = s - hi (exact),
    H8 = e4m3(s 2^-7), L8 = e4m3(lo 2^4); where s or hi is not finite, hi carries it and H8 = L8 = 0."""
    x = numpy.asarray(x, dtype=numpy.float32)
    with numpy.errstate(all="ignore"):
        s = numpy.ldexp(x, e).astype(numpy.float32)
        hi = s.astype(numpy.float16).astype(numpy.float32)
        fin = numpy.isfinite(s) & numpy.isfinite(hi)
        zero = numpy.float32(0)
        lo = numpy.where(fin, s - hi, zero)
        h8 = numpy.where(fin, e4m3_round(numpy.ldexp(s, -7).astype(numpy.float32)), zero)
        l8 = numpy.where(fin, e4m3_round(numpy.ldexp(lo, 4).astype(numpy.float32)), zero)
    return hi, h8.astype(numpy.float32), l8.astype(numpy.float32)


def pair_matmul(a, b, ea=None, eb=None):
    """The f16+e4m3 product: 2^-(e_a+e_b) (hi_a @ hi_b + 8 (L8_a @ H8_b + H8_a @ L8_b)), fp32 throughout.
    Exponents default to f16_exponent's (max |s| in [2^13, 2^14)); the GPU's delayed scaling may land
    the max anywhere in [2^8, 2^15), which tests reach through ea / eb."""
    ea = f16_exponent(a) if ea is None else ea
    eb = f16_exponent(b) if eb is None else eb
    (ah, ah8, al8), (bh, bh8, bl8) = f16e4m3_split(a, ea), f16e4m3_split(b, eb)
    with numpy.errstate(all="ignore"):  # Inf/NaN in hi propagate as in fp32
        cross = al8 @ bh8 + ah8 @ bl8  # the GPU's one e4m3 GEMM with K doubled: [L8_a | H8_a] @ [H8_b ; L8_b]
        c = ah @ bh + numpy.float32(_precision.E4M3_PAIR_SCALE) * cross
        return numpy.ldexp(c, -(ea + eb)).astype(numpy.float32)


def _operands(x, form):
    """The (planes, exponent) a GEMM of `form` reads for the fp32 matrix x: fp32 arrays and 2^-exponent."""
    if form.name == "f32":
        return [x], 0
    if form.name == "bf16":
        return [bf16_round(x)], 0
    if form.name == "bf16x3":
        return list(bf16_split(x)), 0
    if form.name == "f16s":
        e = f16_exponent(x)
        return [f16_round_scaled(x, e)], e
    raise ValueError(f"form must be one of {', '.join(map(repr, _precision.FORMS))}; got {form.name!r}")


def _matmul(a, b, form):
    """a @ b (float32) with the operand treatment of `form` (a _precision.Form); accumulation in fp32."""
    with numpy.errstate(all="ignore"):
        if form.name == "f16+e4m3":
            return pair_matmul(a, b)
        (pa, ea), (pb, eb) = _operands(a, form), _operands(b, form)
        if form.name == "bf16x3":
            (ah, al), (bh, bl) = pa, pb
            c = ah @ bh + ah @ bl + al @ bh  # lo * lo is not formed, as on the GPU
        else:
            c = pa[0] @ pb[0]
        if ea or eb:
            c = numpy.ldexp(c, -(ea + eb)).astype(numpy.float32)
    return c


def backward_2d(dy, x, w1, w2, l1, t, g, precision, need_grad_hidden, need_weight_grads, accumulate, outputs):
    """backward on 2-D fp32 arrays ([T, D], [T, D], [H, D], [D, H], [T, H], [T, H] or None, [T, H] or None);
    each GEMM in the form `precision`'s recipe gives it at this shape (_precision.effective_forms). `outputs`:
    grad_hidden, grad_w1, grad_w2 (2-D views or None), and with bias gradients grad_b1 [H] and grad_b2 [D]: column
    sums of grad_linear1 (as formed in fp32 before its GEMMs' rounding) and of grad_output."""
    grad_hidden, grad_w1, grad_w2 = outputs[:3]
    grad_b1, grad_b2 = outputs[3:] if len(outputs) == 5 else (None, None)
    forms = _precision.effective_forms(precision, dy.shape[0], dy.shape[1], w1.shape[0])
    with numpy.errstate(all="ignore"):
        if t is None:
            t = tanh_inner(l1)
        if g is None and need_weight_grads:
            g = activation.value(l1, t)
        grad_gelu = _matmul(dy, w2, forms["gemm1"])
        if need_weight_grads:
            _store(grad_w2, _matmul(dy.T, g, forms["gemm2"]), accumulate)
        grad_linear1 = grad_gelu * gelu_grad(l1, t)
        if grad_b1 is not None:
            _store(grad_b1, grad_linear1.sum(axis=0, dtype=numpy.float32), accumulate)
            _store(grad_b2, dy.sum(axis=0, dtype=numpy.float32), accumulate)
        if need_grad_hidden:
            _store(grad_hidden, _matmul(grad_linear1, w1, forms["gemm3"]), False)
        if need_weight_grads:
            _store(grad_w1, _matmul(grad_linear1.T, x, forms["gemm4"]), accumulate)


def forward(x, w1, w2, precision, outputs, bias1=None, bias2=None):
    """output, linear1_out, tanh_inner, gelu_out of the 2-D fp32 arrays x, w1, w2 (and the fp32 biases, each
    optional) into `outputs` (2-D views)."""
    y, z_out, t_out, g_out = outputs
    with numpy.errstate(all="ignore"):
        z = _matmul(x, w1.T, precision.forward)
        if bias1 is not None:
            z = z + bias1
        t = tanh_inner(z)
        g = activation.value(z, t)
        z_out[...], t_out[...], g_out[...] = z, t, g
        y[...] = _matmul(g, w2.T, precision.forward)
        if bias2 is not None:
            y += bias2


def _store(dst, value, accumulate):
    if accumulate:
        dst += value
    else:
        dst[...] = value


# ---------------------------------------------------------------------- 16-bit activations (the cuBLASLt route)
def _as_act(a, act):
    """fp32 copy of `a` after rounding to the activation dtype (what the GPU multiplies)."""
    return a.astype(numpy_dtype(act)).astype(numpy.float32)


def half_forward(call, arrays, views):
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


def half_backward(call, arrays, views):
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
