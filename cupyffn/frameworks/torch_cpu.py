"""The torch layer's CPU route: CPU tensors computed with torch's own ops where the precision's numerics are torch's,
so the layer runs on torch's GEMMs in its thread pool (docs/decisions/059-torch-cpu-route.md; its time against plain
torch's, which depends on the host: docs/performance.md 8):

* float32 activations, precision "ieee" (the CPU's default): plain fp32 GEMMs, torch's ``F.linear`` and ``mm``;
* bfloat16 activations: torch's bf16 GEMMs, fp32 accumulation with every result rounded to bf16, as torch's autocast
  computes ``nn.Linear`` (linear1_out, grad_gelu and the weight gradients included, which the cuBLASLt route keeps
  in fp32: the errors are autocast's, within the 16-bit contract of 1.25x them); the GELU of the rounded
  linear1_out, its derivative in fp32, grad_linear1 rounded once;
* float16 activations: fp32 GEMMs of the fp16 operands (each product exact in fp32, fp32 accumulation: the cuBLASLt
  route's numbers, as the NumPy backend computes them; torch's CPU fp16 GEMM was 6-50x slower here, 059).

Every other precision ("tf32", "bf16", "bf16x3", "fp16+fp8" on float32 activations) keeps the NumPy backend, which
reproduces the GPU's roundings (cupyffn/cpu/backend.py). The GELU and its derivative are cupyffn/core/activation.py's
NumPy functions, the NumPy backend's own arithmetic, on NumPy views of the tensors a block of rows at a time, so that
their temporaries stay in the cache (torch's elementwise ops were slower, 059); NumPy's elementwise work runs on the
calling thread and uses no thread pool of its own. A call is validated by the door's validator
(cupyffn/api/validate.py) on NumPy views of the tensors, so a bad call reads the same on every route; the validated
geometries are remembered (`_checked`), as the door remembers the calls of GPU arrays.
"""

import numpy
import torch

from ..api import validate as _validate
from ..core import activation
from ..core import precision as _precision
from ..core import views as _views

F = torch.nn.functional
_F32 = torch.float32
_NOTHING = (0,)  # a placeholder's shape (the operators return tensors, never None)
#: the GELU's block of rows: its few fp32 temporaries stay in a core's L2 (059)
BLOCK_BYTES = 256 * 1024
#: validated geometries (shapes, strides, dtypes of every argument, and the request); cleared when full
_CHECKED_SIZE = 1024
_checked = set()


def takes(act, precision):
    """Whether torch's ops compute a CPU call of activation dtype `act` at `precision` (a name, or None: the CPU's
    default, as the door would resolve it; module docstring)."""
    return act is not _F32 or _precision.resolve(precision, cpu=True).name == "ieee"


def numpy_view(tensor):
    """A NumPy view of CPU `tensor` (bfloat16 through ml_dtypes' type, which NumPy lacks), None for None."""
    if tensor is None:
        return None
    if tensor.dtype is torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy().view(_views.numpy_dtype("bfloat16"))
    return tensor.detach().numpy()


def _check(request, tensors):
    """The door's validation of `tensors` for `request`, once per geometry (it depends on nothing else: no out=)."""
    key = (request,) + tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in tensors)
    if key in _checked:
        return
    _validate.validate(request, [numpy_view(t) for t in tensors])
    if len(_checked) >= _CHECKED_SIZE:
        _checked.clear()
    _checked.add(key)


class _Fp32:
    """Autocast off inside the route: its GEMMs run in the dtypes chosen here (gelu_ffn's float32 under autocast)."""

    __slots__ = ("ctx",)

    def __enter__(self):
        self.ctx = torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else None
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False


def _operand(w, act):
    """A weight or bias as the GEMMs of activation dtype `act` read it (module docstring)."""
    if w is None or act is _F32:
        return w
    w = w.to(act)  # rounded to the activation dtype, as autocast rounds fp32 master weights
    return w.float() if act is torch.float16 else w


def _gemm(a, act):
    """An activation as the GEMMs of dtype `act` read it: fp16 in fp32 (exact), else as it is."""
    return a.float() if act is torch.float16 else a


def _blocks(rows, hidden):
    """Row slices of a [rows, hidden] array, each about BLOCK_BYTES of fp32."""
    step = max(1, BLOCK_BYTES // (4 * hidden))
    return [slice(i, i + step) for i in range(0, rows, step)]


def _gelu(z, t_out, g_out):
    """tanh_inner into t_out (None: not kept) and gelu_out into g_out (may be z itself) of z: fp32 [T, H] tensors."""
    zn, gn, tn = numpy_view(z), numpy_view(g_out), numpy_view(t_out)
    with numpy.errstate(all="ignore"):  # inf and NaN propagate, as in torch's ops, without NumPy's warnings
        for s in _blocks(*zn.shape):
            zs = zn[s]
            t = activation.tanh_inner(zs)
            if tn is not None:
                tn[s] = t
            gn[s] = activation.value(zs, t)


def _dgelu(gl, z, t, g_out):
    """grad_linear1 = grad_gelu * gelu'(z) in place in gl (grad_gelu), from z and t (None: recomputed from z), and
    gelu_out into g_out where given (memory mode): fp32 [T, H] tensors."""
    gn, zn, tn, on = numpy_view(gl), numpy_view(z), numpy_view(t), numpy_view(g_out)
    with numpy.errstate(all="ignore"):
        for s in _blocks(*zn.shape):
            zs = zn[s]
            ts = activation.tanh_inner(zs) if tn is None else tn[s]
            numpy.multiply(gn[s], activation.grad(zs, ts), out=gn[s])
            if on is not None:
                on[s] = activation.value(zs, ts)


def forward(x, w1, w2, b1, b2, precision):
    """(output, linear1_out, tanh_inner (a placeholder for 16-bit x), gelu_out), new tensors of x's dtype."""
    _check(_validate.Request("forward", precision), (x, w1, w2, b1, b2))
    act = x.dtype
    lead, dim, hidden = tuple(x.shape[:-1]), x.shape[-1], w1.shape[0]
    with _Fp32():
        w1, w2, b1, b2 = (_operand(w, act) for w in (w1, w2, b1, b2))
        z = F.linear(_gemm(x.reshape(-1, dim), act), w1, b1)  # fp16: fp32, the GELU's input before rounding
        if act is _F32:
            t, g = torch.empty_like(z), torch.empty_like(z)
            _gelu(z, t, g)
        else:  # bf16: the GELU of the rounded linear1_out, as autocast's; fp16: of the fp32 one, as cuBLASLt's
            zf, t = z.float(), None
            g = zf if zf is not z else torch.empty_like(z)  # in place in a copy, never in linear1_out
            _gelu(zf, None, g)
            z, g = z.to(act), g.to(act)
        y = F.linear(_gemm(g, act), w2, b2).to(act)
    t = x.new_empty(_NOTHING) if t is None else t.view(lead + (hidden,))
    return y.view(lead + (dim,)), z.view(lead + (hidden,)), t, g.view(lead + (hidden,))


def backward(dy, x, w1, w2, z, t, g, precision, need_x, need_w, need_b):
    """(grad_hidden_states, grad_weight1, grad_weight2, grad_bias1, grad_bias2), None where not needed; weight and
    bias gradients in the weights' dtype."""
    _check(_validate.Request("backward", precision, need_x, need_w, need_b), (dy, x, w1, w2, z, t, g))
    act, wt = x.dtype, w1.dtype
    dim, hidden = x.shape[-1], w1.shape[0]
    with _Fp32():
        dy2, x2 = _gemm(dy.reshape(-1, dim), act), _gemm(x.reshape(-1, dim), act)
        w1, w2 = _operand(w1, act), _operand(w2, act)
        gl = (dy2 @ w2).float()  # grad_gelu, then grad_linear1 in place
        g_out = torch.empty_like(gl) if g is None and need_w else None
        z = z.reshape(-1, hidden)
        _dgelu(gl, z.float(), None if t is None else t.reshape(-1, hidden), g_out)
        gl = gl.to(act)  # 16-bit: rounded once, before GEMM3 and GEMM4 (where autocast rounds it)
        g = g_out.to(act) if g is None and need_w else g
        gl2 = _gemm(gl, act)
        gx = (gl2 @ w1).to(act).view(x.shape) if need_x else None
        gw1 = (gl2.t() @ x2).to(wt) if need_w else None
        gw2 = (dy2.t() @ _gemm(g.reshape(-1, hidden), act)).to(wt) if need_w else None
        gb1 = gl.sum(0, dtype=_F32).to(wt) if need_b else None
        gb2 = dy.reshape(-1, dim).sum(0, dtype=_F32).to(wt) if need_b else None
    return gx, gw1, gw2, gb1, gb2
