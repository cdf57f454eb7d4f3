"""PyTorch layer: ``y = gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases) with cupyffn's forward and backward.

    from cupyffn.torch import GeluFFN
    ffn = GeluFFN(dim=512, hidden_dim=2048, device="cuda")       # precision="bf16x3", save="all"
    y = ffn(x)                                                     # x: float32 [..., 512]
    y.sum().backward()                                             # ffn.weight1.grad, ffn.weight2.grad, x.grad

``weight1`` is ``[hidden_dim, dim]`` and ``weight2`` is ``[dim, hidden_dim]``, both
``[out_features, in_features]`` like ``torch.nn.Linear.weight``; the result equals
``F.linear(F.gelu(F.linear(x, weight1), approximate="tanh"), weight2)`` within the accuracy contract
of the precision (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Operators: the forward and the backward are ``torch.library.custom_op``s, ``torch.ops.cupyffn.forward``
and ``torch.ops.cupyffn.backward``, with fake (meta) implementations and an autograd formula
(``register_autograd``). So ``torch.compile(model, fullgraph=True)`` traces a model using ``GeluFFN``
without a graph break (the ops stay opaque calls in the compiled graph, forward and backward), and
``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.graph`` capture them: every result is
allocated by torch (``torch.empty``, inside the op) and handed to cupyffn as ``out=``, so under capture
it comes from the graph's memory pool. Capture needs the call's plan built first: run the step once
(the usual warm-up iterations) before capturing.

Autocast: under ``torch.autocast`` (CUDA or CPU) the forward casts its floating-point inputs to float32
(``torch.library.register_autocast``) and computes in float32: the output is always float32, whatever
the autocast dtype; gradients come back in the inputs' dtypes (autograd casts them). Outside autocast
only float32 tensors are accepted (TypeError naming the tensor).

Devices and streams: the work is enqueued on torch's current stream of the tensors' device
(``torch.cuda.current_stream(device)``), so it is ordered like any torch op and the host is never
synchronized. CPU tensors run on cupyffn's NumPy backend (zero-copy ``Tensor.numpy()`` views).
cupyffn's own scratch buffers and cuBLAS workspaces come from CuPy's memory pool, not torch's.

Host fast path: a CUDA tensor reaches cupyffn as a CuPy view built from its pointer, shape and strides
(no DLPack import; the stream handshake DLPack would do is empty since cupyffn works on the stream
torch is using), cached by (pointer, shape, strides, device) as ``cupyffn._views`` explains (why a
freed and reused address is safe). Repeated tensors (a training loop under torch's caching
allocator) then take cupyffn's validated-call fast path.

Tensor parallelism: autograd hands grad_input to the previous layer only when this op's backward
returns (after both weight-gradient GEMMs), so the torch layer cannot start an all-reduce of
grad_hidden_states early. A caller that wants to overlap it uses the functional API,
``cupyffn.gelu_ffn_backward(..., grad_hidden_ready=event)`` (a ``cupy.cuda.Event`` recorded on the
stream right after grad_hidden_states is written, before the weight gradients finish), in its own
``torch.autograd.Function``: ``TensorParallelGeluFFN`` (cupyffn/_torch_parallel.py) does, starting the
all-reduce on a side stream that waits on the event.

Limitations: no double backward (the backward operator has no autograd formula); no ``torch.func``
rules (vmap), untested with ``torch.func``; all three tensors on one device.

This module imports torch; ``import cupyffn`` does not import it.
"""

import math
from typing import Optional, Tuple

import torch

from . import _arrays, _views
from ._backward import gelu_ffn_backward as _gelu_ffn_backward
from ._forward import gelu_ffn_forward as _gelu_ffn_forward
from ._precision import DEFAULT as _DEFAULT_PRECISION
from ._precision import lookup as _lookup_precision

__all__ = ["GeluFFN", "GeluFFNFunction", "gelu_ffn"]

SAVE_MODES = ("all", "linear1_out")


# torch's current raw stream without building a torch.cuda.Stream object per call (the call inductor's
# generated code makes); the public spelling where this torch lacks it
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cupy_stream(device):
    """torch's current stream on `device` as a CuPy stream that does not own it (call with `device` current)."""
    if _raw_stream is not None:
        ptr = int(_raw_stream(device.index))
    else:  # pragma: no cover
        ptr = int(torch.cuda.current_stream(device).cuda_stream)
    return _views.external_stream(ptr, device.index)


def _cuda_view(tensor):
    """A CuPy ndarray over a float32 CUDA tensor's memory: no DLPack import, owns nothing (cupyffn._views)."""
    return _views.float32_view(tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.device.index)


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
            raise TypeError(f"{name} must be float32 (cupyffn computes in float32; under torch.autocast the inputs "
                            f"are cast to float32 for you); got {t.dtype}")
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

    __slots__ = ("device", "cuda", "stream", "_switch")

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def __enter__(self):
        self._switch = None
        self.stream = None
        if self.cuda:
            import cupy

            if cupy.cuda.runtime.getDevice() != self.device.index:
                self._switch = cupy.cuda.Device(self.device.index)
                self._switch.__enter__()
            self.stream = _cupy_stream(self.device)
        return self

    def __exit__(self, *exc):
        if self._switch is not None:
            self._switch.__exit__(*exc)
        return False

    def arg(self, tensor):
        """What cupyffn gets for `tensor`: a CuPy view on CUDA, a NumPy view on the CPU."""
        if tensor is None:
            return None
        if self.cuda:
            return _cuda_view(tensor)
        return tensor.detach().numpy()

    def empty(self, shape):
        return torch.empty(shape, dtype=torch.float32, device=self.device)


def _check_save(save):
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {', '.join(repr(s) for s in SAVE_MODES)}; got {save!r}")
    return save


# ---------------------------------------------------------------------- the operators
_NOTHING = (0,)  # shape of the placeholder a not-needed gradient is returned as (ops cannot return None)


@torch.library.custom_op("cupyffn::forward", mutates_args=())
def _forward_op(hidden_states: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor, precision: str,
                save: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, linear1_out, tanh_inner, gelu_out); `save` only matters to the autograd formula."""
    device = _check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
    x, w1, w2 = (_readable(t) for t in (hidden_states, weight1, weight2))
    lead = tuple(x.shape[:-1]) if x.dim() else ()
    hidden = w1.shape[0] if w1.dim() == 2 else 0
    with _Call(device) as call:
        outs = None
        if x.dim() >= 1 and w1.dim() == 2:  # else cupyffn raises the shape error
            outs = (call.empty(lead + (x.shape[-1],)),) + tuple(call.empty(lead + (hidden,)) for _ in range(3))
        _gelu_ffn_forward(call.arg(x), call.arg(w1), call.arg(w2), precision=precision,
                          out=None if outs is None else [call.arg(o) for o in outs], stream=call.stream)
    return outs


@_forward_op.register_fake
def _forward_fake(hidden_states, weight1, weight2, precision, save):
    # the checks the real op makes first, so a compiled graph fails at trace time as eager does
    _check_tensors((("hidden_states", hidden_states), ("weight1", weight1), ("weight2", weight2)))
    if hidden_states.dim() < 1 or weight1.dim() != 2:
        raise ValueError(f"hidden_states must be [..., dim] and weight1 [hidden_dim, dim]; got "
                         f"{tuple(hidden_states.shape)} and {tuple(weight1.shape)}")
    lead = tuple(hidden_states.shape[:-1])
    hidden = weight1.shape[0]
    return (hidden_states.new_empty(tuple(hidden_states.shape), dtype=torch.float32),) + tuple(
        hidden_states.new_empty(lead + (hidden,), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("cupyffn::backward", mutates_args=())
def _backward_op(grad_output: torch.Tensor, hidden_states: torch.Tensor, weight1: torch.Tensor,
                 weight2: torch.Tensor, linear1_out: torch.Tensor, tanh_inner: Optional[torch.Tensor],
                 gelu_out: Optional[torch.Tensor], precision: str, need_grad_hidden: bool,
                 need_weight_grads: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden_states, grad_weight1, grad_weight2); one not needed is an empty [0] tensor."""
    # the saved inputs are the caller's tensors, as the forward got them: the same layouts are copied again
    dy, x, weight1, weight2 = (_readable(t) for t in (grad_output, hidden_states, weight1, weight2))
    with _Call(x.device) as call:
        out = (call.empty(x.shape) if need_grad_hidden else None,
               call.empty(weight1.shape) if need_weight_grads else None,
               call.empty(weight2.shape) if need_weight_grads else None)
        _gelu_ffn_backward(call.arg(dy), call.arg(x), call.arg(weight1), call.arg(weight2), call.arg(linear1_out),
                           call.arg(tanh_inner), call.arg(gelu_out), precision=precision,
                           out=[call.arg(o) for o in out], stream=call.stream, need_grad_hidden=need_grad_hidden,
                           need_weight_grads=need_weight_grads)
    return tuple(o if o is not None else call.empty(_NOTHING) for o in out)


@_backward_op.register_fake
def _backward_fake(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out, precision,
                   need_grad_hidden, need_weight_grads):
    def empty(shape, needed):
        return hidden_states.new_empty(tuple(shape) if needed else _NOTHING, dtype=torch.float32)

    return (empty(hidden_states.shape, need_grad_hidden), empty(weight1.shape, need_weight_grads),
            empty(weight2.shape, need_weight_grads))


def _setup_context(ctx, inputs, output):
    x, w1, w2, precision, save = inputs
    _, z, t, g = output
    ctx.precision = precision
    if save == "all":
        ctx.save_for_backward(x, w1, w2, z, t, g)
    else:  # memory mode: tanh_inner and gelu_out are recomputed from z inside the backward's kernels
        ctx.save_for_backward(x, w1, w2, z)


def _autograd_backward(ctx, grad_output, *unused_grads):
    """Gradients of (hidden_states, weight1, weight2); the other forward results are internal (not returned)."""
    need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
    need_weights = need_w1 or need_w2
    if not (need_x or need_weights):
        return None, None, None, None, None
    saved = ctx.saved_tensors
    x, w1, w2, z = saved[:4]
    t, g = saved[4:] if len(saved) == 6 else (None, None)
    if grad_output.dtype != torch.float32:  # a hook changed it; the math is float32 anyway
        grad_output = grad_output.float()
    grad_x, grad_w1, grad_w2 = _backward_op(grad_output, x, w1, w2, z, t, g, ctx.precision, need_x, need_weights)
    return (grad_x if need_x else None, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None, None, None)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)
for _device_type in ("cuda", "cpu"):
    torch.library.register_autocast("cupyffn::forward", _device_type, torch.float32)
del _device_type


# ---------------------------------------------------------------------- public API
class GeluFFNFunction:
    """``output = gelu_tanh(hidden_states @ weight1.T) @ weight2.T`` with cupyffn's forward and backward.

    ``GeluFFNFunction.apply(hidden_states, weight1, weight2, precision, save)`` (kept for code written
    against the earlier ``torch.autograd.Function``; it is ``gelu_ffn``, the operators with their
    autograd formula):

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
    """

    @staticmethod
    def apply(hidden_states, weight1, weight2, precision=_DEFAULT_PRECISION, save="all"):
        return gelu_ffn(hidden_states, weight1, weight2, precision, save)


def gelu_ffn(x, weight1, weight2, precision=_DEFAULT_PRECISION, save="all"):
    """``gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases), differentiable; see ``GeluFFNFunction``.

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]`` (``[out_features, in_features]``), float32 on one
    CPU or CUDA device (any floating dtype under ``torch.autocast``: cast to float32). Returns a ``[..., D]``
    float32 tensor. Traceable by ``torch.compile`` (``fullgraph=True``) and capturable in CUDA graphs.
    """
    return torch.ops.cupyffn.forward(x, weight1, weight2, _lookup_precision(precision).name, _check_save(save))[0]


class GeluFFN(torch.nn.Module):
    """``Linear(dim -> hidden_dim, no bias) -> GELU(tanh) -> Linear(hidden_dim -> dim, no bias)`` on cupyffn.

    Parameters ``weight1 [hidden_dim, dim]`` and ``weight2 [dim, hidden_dim]`` (``[out_features,
    in_features]``), initialized like ``torch.nn.Linear`` (``kaiming_uniform_(a=sqrt(5))``, i.e.
    U(-1/sqrt(in_features), 1/sqrt(in_features))). ``precision`` and ``save`` as in ``GeluFFNFunction``.
    Only float32 parameters (``dtype`` other than torch.float32 raises TypeError). Input ``[..., dim]``
    (float32, or any floating dtype under autocast), output ``[..., dim]`` float32, on the parameters'
    device. Runs ``gelu_ffn`` (the cupyffn operators): compiles without graph breaks.
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
        return torch.ops.cupyffn.forward(x, self.weight1, self.weight2, self.precision, self.save)[0]

    def extra_repr(self):
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, precision={self.precision!r}, save={self.save!r}"


from ._torch_parallel import (TensorParallelGeluFFN, TensorParallelGeluFFNFunction,  # noqa: E402,F401 (tensor
                              shard_weights, tensor_parallel_gelu_ffn)  # parallelism, cupyffn/_torch_parallel.py)
