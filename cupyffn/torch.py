"""PyTorch layer: ``y = gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases) with cupyffn's forward and backward.

    from cupyffn.torch import GeluFFN
    ffn = GeluFFN(dim=512, hidden_dim=2048, device="cuda")       # precision="bf16x3", save="all"
    y = ffn(x)                                                     # x: float32 [..., 512]
    y.sum().backward()                                             # ffn.weight1.grad, ffn.weight2.grad, x.grad

``weight1`` is ``[hidden_dim, dim]`` and ``weight2`` is ``[dim, hidden_dim]``, both
``[out_features, in_features]`` like ``torch.nn.Linear.weight``; the result equals
``F.linear(F.gelu(F.linear(x, weight1), approximate="tanh"), weight2)`` within the accuracy contract
of the precision (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Devices and streams: CUDA tensors are handed to cupyffn zero-copy (DLPack) and the work is enqueued on
torch's current stream of the tensors' device (``torch.cuda.current_stream(device)``), so it is ordered
like any torch op and the host is never synchronized. CPU tensors run on cupyffn's NumPy backend
(zero-copy ``Tensor.numpy()`` views). Every result (output, saved activations, gradients) is a tensor
allocated by torch with ``torch.empty`` and written by cupyffn through ``out=``, so torch's caching
allocator owns it. cupyffn's own scratch buffers and cuBLAS workspaces (kept per shape and stream, see
``cupyffn.clear_cache``) come from CuPy's memory pool, not torch's.

Limitations: float32 only (other dtypes, including autocast's bf16/fp16 activations, raise TypeError
naming the tensor); no double backward; the call is opaque to ``torch.compile`` (graph break) and to
``torch.func`` transforms; all three tensors on one device.

This module imports torch; ``import cupyffn`` does not import it.
"""

import math

import torch

from . import _arrays
from ._backward import gelu_ffn_backward as _gelu_ffn_backward
from ._forward import gelu_ffn_forward as _gelu_ffn_forward
from ._precision import DEFAULT as _DEFAULT_PRECISION
from ._precision import lookup as _lookup_precision

__all__ = ["GeluFFN", "GeluFFNFunction", "gelu_ffn"]

SAVE_MODES = ("all", "linear1_out")


class _StreamHandle:
    """A raw CUDA stream pointer behind the CUDA stream protocol (for ``cupy.cuda.Stream.from_external``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cupy_stream(device):
    """torch's current stream on `device` as a CuPy stream that does not own (or destroy) it.

    CuPy >= 14: ``cupy.cuda.Stream.from_external``; older CuPy: ``cupy.cuda.ExternalStream`` (deprecated in 14).
    Call with `device` current in CuPy (``cupy.cuda.Device(index)``): the stream belongs to it.
    """
    import cupy

    ptr = int(torch.cuda.current_stream(device).cuda_stream)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device.index)


def _readable(tensor):
    """`tensor`, or a contiguous copy where cupyffn cannot read its layout.

    cupyffn reads any tensor whose last dimension is unit-stride and whose leading dimensions flatten to
    one row stride (C-contiguous tensors, slices of rows or columns of one); anything else (a transpose,
    an expanded gradient) is copied with ``.contiguous()``.
    """
    if tensor.dim() == 0 or tensor.numel() == 0:
        return tensor
    strides = tuple(4 * s for s in tensor.stride())
    if _arrays.row_stride(tuple(tensor.shape), strides, 4) is None:
        return tensor.contiguous()
    return tensor


def _check_tensors(named):
    """float32 torch tensors on one CPU or CUDA device; returns that device."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__module__}.{type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (cupyffn computes in float32); got {t.dtype}")
    device = named[0][1].device
    for name, t in named:
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {t.device}; cupyffn.torch runs CPU and CUDA tensors")
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; {named[0][0]} is on {device} but {name} is on "
                             f"{t.device}")
    return device


class _Call:
    """How a call reaches cupyffn on `device`: the arrays to pass and the stream (None on the CPU)."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            import cupy

            self._device = cupy.cuda.Device(self.device.index)
            self._device.__enter__()
            self.stream = _cupy_stream(self.device)
        else:
            self.stream = None
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._device.__exit__(*exc)
        return False

    def arg(self, tensor):
        """What cupyffn gets for `tensor`: the detached tensor (DLPack) on CUDA, a NumPy view on the CPU."""
        if tensor is None:
            return None
        tensor = tensor.detach()
        return tensor if self.cuda else tensor.numpy()

    def empty(self, shape):
        return torch.empty(shape, dtype=torch.float32, device=self.device)


def _check_save(save):
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {', '.join(repr(s) for s in SAVE_MODES)}; got {save!r}")
    return save


class GeluFFNFunction(torch.autograd.Function):
    """``output = gelu_tanh(hidden_states @ weight1.T) @ weight2.T`` with cupyffn's forward and backward.

    ``GeluFFNFunction.apply(hidden_states, weight1, weight2, precision, save)``:

    * hidden_states ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``: float32, one CPU or CUDA device.
      A tensor whose layout cupyffn cannot read (last dimension not unit-stride, or leading dimensions
      that do not flatten to one row stride, e.g. ``weight.t()``) is copied with ``.contiguous()``;
      every other tensor is passed as it is (zero-copy).
    * precision: ``"bf16x3"`` (default), ``"ieee"``, ``"tf32"`` or ``"bf16"`` (``cupyffn.PRECISIONS``).
    * save: what is kept for the backward. ``"all"``: hidden_states, the weights, linear1_out
      (``z = x @ weight1.T``), tanh_inner and gelu_out (3 x [..., H] floats). ``"linear1_out"``
      (memory mode): hidden_states, the weights and z only; the backward recomputes tanh_inner and
      gelu_out from z inside its kernels (same results within the contract). The forward computes all
      three either way; in memory mode tanh_inner and gelu_out are freed when it returns.

    The backward runs ``cupyffn.gelu_ffn_backward`` with ``need_grad_hidden`` / ``need_weight_grads``
    from ``ctx.needs_input_grad`` (a weight gradient that is computed but not needed is dropped).
    Streams, memory and limitations: see the module docstring.
    """

    @staticmethod
    def forward(ctx, hidden_states, weight1, weight2, precision=_DEFAULT_PRECISION, save="all"):
        prec = _lookup_precision(precision)
        _check_save(save)
        device = _check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
        x, w1, w2 = (_readable(t) for t in (hidden_states, weight1, weight2))
        lead = tuple(x.shape[:-1]) if x.dim() else ()
        hidden = w1.shape[0] if w1.dim() == 2 else 0
        with _Call(device) as call:
            outs = None
            if x.dim() >= 1 and w1.dim() == 2:  # else cupyffn raises the shape error
                outs = (call.empty(lead + (x.shape[-1],)),) + tuple(call.empty(lead + (hidden,)) for _ in range(3))
            _gelu_ffn_forward(call.arg(x), call.arg(w1), call.arg(w2), precision=prec.name,
                              out=None if outs is None else [call.arg(o) for o in outs], stream=call.stream)
        output, z, t, g = outs
        ctx.precision = prec.name
        if save == "all":
            ctx.save_for_backward(x, w1, w2, z, t, g)
        else:
            ctx.save_for_backward(x, w1, w2, z)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
        need_weights = need_w1 or need_w2
        if not (need_x or need_weights):
            return None, None, None, None, None
        saved = ctx.saved_tensors
        x, w1, w2, z = saved[:4]
        t, g = saved[4:] if len(saved) == 6 else (None, None)
        if grad_output.dtype != torch.float32:  # autograd hands back the output's dtype unless a hook changed it
            raise TypeError(f"grad_output must be float32; got {grad_output.dtype}")
        dy = _readable(grad_output)
        with _Call(x.device) as call:
            out = (call.empty(x.shape) if need_x else None,
                   call.empty(w1.shape) if need_weights else None,
                   call.empty(w2.shape) if need_weights else None)
            _gelu_ffn_backward(call.arg(dy), call.arg(x), call.arg(w1), call.arg(w2), call.arg(z), call.arg(t),
                               call.arg(g), precision=ctx.precision, out=[call.arg(o) for o in out],
                               stream=call.stream, need_grad_hidden=need_x, need_weight_grads=need_weights)
        grad_x, grad_w1, grad_w2 = out
        return (grad_x, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None, None, None)


def gelu_ffn(x, weight1, weight2, precision=_DEFAULT_PRECISION, save="all"):
    """``gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases), differentiable; see ``GeluFFNFunction``.

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]`` (``[out_features, in_features]``), float32 on one
    CPU or CUDA device. Returns a ``[..., D]`` float32 tensor.
    """
    return GeluFFNFunction.apply(x, weight1, weight2, precision, save)


class GeluFFN(torch.nn.Module):
    """``Linear(dim -> hidden_dim, no bias) -> GELU(tanh) -> Linear(hidden_dim -> dim, no bias)`` on cupyffn.

    Parameters ``weight1 [hidden_dim, dim]`` and ``weight2 [dim, hidden_dim]`` (``[out_features,
    in_features]``), initialized like ``torch.nn.Linear`` (``kaiming_uniform_(a=sqrt(5))``, i.e.
    U(-1/sqrt(in_features), 1/sqrt(in_features))). ``precision`` and ``save`` as in ``GeluFFNFunction``.
    Only float32 is supported (``dtype`` other than torch.float32 raises TypeError). Input ``[..., dim]``,
    output ``[..., dim]``, on the parameters' device.
    """

    def __init__(self, dim, hidden_dim, *, precision=_DEFAULT_PRECISION, save="all", device=None,
                 dtype=torch.float32):
        super().__init__()
        if dtype != torch.float32:
            raise TypeError(f"GeluFFN supports dtype=torch.float32 only; got {dtype}")
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.precision = _lookup_precision(precision).name
        self.save = _check_save(save)
        factory = {"device": device, "dtype": dtype}
        self.weight1 = torch.nn.Parameter(torch.empty((hidden_dim, dim), **factory))
        self.weight2 = torch.nn.Parameter(torch.empty((dim, hidden_dim), **factory))
        self.reset_parameters()

    def reset_parameters(self):
        """``torch.nn.Linear``'s weight initialization for both weights."""
        torch.nn.init.kaiming_uniform_(self.weight1, a=math.sqrt(5))
        torch.nn.init.kaiming_uniform_(self.weight2, a=math.sqrt(5))

    def forward(self, x):
        return GeluFFNFunction.apply(x, self.weight1, self.weight2, self.precision, self.save)

    def extra_repr(self):
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, precision={self.precision!r}, save={self.save!r}"
