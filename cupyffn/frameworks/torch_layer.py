"""The torch layer: ``GeluFFN`` (an nn.Module), the functional ``gelu_ffn``, and `block`, the one function both (and
the MLPs `replace_mlps` swaps, cupyffn/frameworks/torch_swap.py) run: it picks the activation dtype as ``nn.Linear``
would and calls the operators (cupyffn/frameworks/torch_ops.py).

Dtypes, as torch's autocast treats ``Linear -> GELU(tanh) -> Linear``: under autocast the block computes in the
autocast dtype (the input is cast to it; fp32 master weights and biases go to cupyffn as they are and are rounded
inside, their gradients come back in fp32 straight from the GEMMs); outside autocast a 16-bit input or 16-bit
parameters decide, else float32. The output is in the activation dtype. float32 computation takes every precision
(None: the device's default), 16-bit computation multiplies its operands as they are.
"""

import math

import torch

from ..core.precision import checked_name
from . import torch_ops
from .torch_ops import HALF, check_save, check_tensors


def activation_dtype(x, weight):
    """The dtype the block computes in for input `x` and parameters of dtype `weight.dtype` (module docstring)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if x.dtype in HALF:
        return x.dtype
    return weight.dtype


def block(x, w1, w2, b1=None, b2=None, precision=None, save="all", act=None):
    """``gelu_tanh(x w1^T + b1) w2^T + b2`` in `act` (None: `activation_dtype`), differentiable. `w1` [H, D] and `w2`
    [D, H]: Parameters or views of them (transposes of transformers' Conv1D weights: read as stored on the
    cuBLASLt route). `precision`: a name or None, for float32 computation."""
    if x.dtype not in HALF + (torch.float32,):  # nn.Linear refuses a float64 input for float32 weights as well
        raise TypeError(f"hidden_states must be float32 (or bfloat16 / float16); got {x.dtype}")
    act = activation_dtype(x, w1) if act is None else act
    if act not in HALF + (torch.float32,):
        raise TypeError(f"cupyffn computes in bfloat16, float16 or float32; got {act}")
    if act is torch.float32:
        w1, w2, b1, b2 = (t if t is None or t.dtype is act else t.float() for t in (w1, w2, b1, b2))
    else:
        # parameters in another 16-bit dtype than the activations are cast first (fp32 ones go in as they are)
        w1, w2, b1, b2 = (t if t is None or t.dtype in (act, torch.float32) else t.to(act) for t in (w1, w2, b1, b2))
        if w1.dtype != w2.dtype:
            w1, w2 = w1.to(act), w2.to(act)
        b1, b2 = (t if t is None or t.dtype is w1.dtype else t.to(w1.dtype) for t in (b1, b2))
        precision = None  # 16-bit operands are multiplied as they are
    return torch_ops.apply(x.to(act), w1, w2, b1, b2, precision, save)


def gelu_ffn(x, weight1, weight2, precision=None, save="all", *, bias1=None, bias2=None):
    """``gelu_tanh(x @ weight1.T + bias1) @ weight2.T + bias2`` in float32, differentiable; see ``GeluFFNFunction``.

    x ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]`` (``[out_features, in_features]``), bias1 ``[H]``, bias2
    ``[D]`` (optional), float32 on one CPU or CUDA device (any floating dtype under ``torch.autocast``: cast to
    float32). Returns a ``[..., D]`` float32 tensor. Traceable by ``torch.compile`` (``fullgraph=True``) and
    capturable in CUDA graphs. (``GeluFFN`` computes in the autocast dtype instead, as ``nn.Linear`` does.)
    """
    precision, save = checked_name(precision), check_save(save)
    named = [("hidden_states", x), ("weight1", weight1), ("weight2", weight2)]
    named += [(n, b) for n, b in (("bias1", bias1), ("bias2", bias2)) if b is not None]
    if torch.is_autocast_enabled(x.device.type if isinstance(x, torch.Tensor) else "cpu"):
        cast = [(n, t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() and
                 t.dtype != torch.float64 else t) for n, t in named]
        named = cast
    check_tensors(named)
    given = dict(named)
    return block(given["hidden_states"], given["weight1"], given["weight2"], given.get("bias1"), given.get("bias2"),
                 precision, save, act=torch.float32)


def linear_weights(layer):
    """(weight, bias, transposed) of an nn.Linear (weight [out, in]) or a transformers Conv1D (weight [in, out]:
    transposed True)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.weight, layer.bias, False
    if type(layer).__name__ == "Conv1D":
        return layer.weight, layer.bias, True
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(layer).__name__}")



class GeluFFNFunction:
    """``output = gelu_tanh(hidden_states @ weight1.T) @ weight2.T`` with cupyffn's forward and backward.

    ``GeluFFNFunction.apply(hidden_states, weight1, weight2, precision, save)`` (kept for code written against the
    earlier ``torch.autograd.Function``; it is ``gelu_ffn``):

    * hidden_states ``[..., D]``, weight1 ``[H, D]``, weight2 ``[D, H]``: float32, one CPU or CUDA device.
      A tensor whose layout cupyffn cannot read (last dimension not unit-stride, or leading dimensions
      that do not flatten to one row stride) is copied with ``.contiguous()``; every other tensor is passed as
      it is (zero-copy).
    * precision: ``"fp16+fp8"``, ``"bf16x3"``, ``"ieee"``, ``"tf32"`` or ``"bf16"`` (``cupyffn.PRECISIONS``), or
      None (the default): the tensors' device's default, ``"fp16+fp8"`` on CUDA and ``"ieee"`` (plain fp32,
      the fastest on the CPU) on the CPU; the others remain valid on the CPU, reproducing the GPU's numerics.
    * save: what is kept for the backward. ``"all"``: hidden_states, the weights, linear1_out
      (``z = x @ weight1.T``), tanh_inner and gelu_out (3 x [..., H] floats). ``"linear1_out"``
      (memory mode): hidden_states, the weights and z only; the backward recomputes tanh_inner and
      gelu_out from z inside its kernels (same results within the contract).

    The backward runs ``cupyffn.gelu_ffn_backward`` with ``need_grad_hidden`` / ``need_weight_grads``
    from ``ctx.needs_input_grad``.
    """

    @staticmethod
    def apply(hidden_states, weight1, weight2, precision=None, save="all"):
        return gelu_ffn(hidden_states, weight1, weight2, precision, save)


class GeluFFN(torch.nn.Module):
    """``Linear(dim -> hidden_dim) -> GELU(tanh) -> Linear(hidden_dim -> dim)`` on cupyffn, a drop-in for a model's MLP.

    Parameters ``weight1 [hidden_dim, dim]``, ``weight2 [dim, hidden_dim]`` (``[out_features, in_features]``) and,
    with ``bias=True``, ``bias1 [hidden_dim]``, ``bias2 [dim]``, initialized like ``torch.nn.Linear``; ``dtype``
    float32 (default), bfloat16 or float16. ``precision`` (float32 computation: any of ``cupyffn.PRECISIONS``, None
    the device's default) and ``save`` as in ``GeluFFNFunction``. Computes as ``nn.Linear`` would under the same
    autocast (module docstring): in the autocast dtype, else the input's 16-bit dtype, else the parameters'
    dtype; returns that dtype and gives gradients in the parameters' dtypes. Every configuration runs the
    operators ``torch.ops.cupyffn.forward`` / ``backward``: ``torch.compile(fullgraph=True)`` traces it without a
    graph break, CUDA graphs capture it.

    ``GeluFFN.from_linears(linear1, linear2)`` wraps two existing layers (their very Parameters; a transformers
    Conv1D's ``[in, out]`` weight is used as stored: ``weights_transposed``); ``cupyffn.torch.replace_mlps(model)``
    runs a model's MLPs on cupyffn without changing its modules.
    """

    def __init__(self, dim, hidden_dim, *, bias=False, precision=None, save="all", device=None,
                 dtype=torch.float32):
        super().__init__()
        if dtype not in (torch.float32,) + HALF:
            raise TypeError(f"GeluFFN supports dtype float32, bfloat16 or float16; got {dtype}")
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        self.dim, self.hidden_dim = dim, hidden_dim
        self.precision = checked_name(precision)
        self.save = check_save(save)
        self.weights_transposed = False
        factory = {"device": device, "dtype": dtype}
        self.weight1 = torch.nn.Parameter(torch.empty((hidden_dim, dim), **factory))
        self.weight2 = torch.nn.Parameter(torch.empty((dim, hidden_dim), **factory))
        self.bias1 = torch.nn.Parameter(torch.empty(hidden_dim, **factory)) if bias else None
        self.bias2 = torch.nn.Parameter(torch.empty(dim, **factory)) if bias else None
        self.reset_parameters()

    @classmethod
    def from_linears(cls, linear1, linear2, **options):
        """A GeluFFN computing ``linear2(gelu_tanh(linear1(x)))`` with these very Parameters (nn.Linear, or a
        transformers Conv1D, whose [in, out] weight is used as stored)."""
        (w1, b1, t1), (w2, b2, t2) = linear_weights(linear1), linear_weights(linear2)
        if t1 != t2:
            raise TypeError("linear1 and linear2 must both be nn.Linear or both transformers Conv1D")
        H, D = (w1.shape[1], w1.shape[0]) if t1 else tuple(w1.shape)
        w2_shape = tuple(w2.shape[::-1]) if t1 else tuple(w2.shape)
        if w2_shape != (D, H):
            raise ValueError(f"linear2 must map hidden_dim {H} back to dim {D}; its weight is {w2_shape} "
                             f"([out_features, in_features])")
        # built on the meta device (nothing allocated, nothing initialized), then given the layers' Parameters
        ffn = cls(D, H, bias=b1 is not None or b2 is not None, device="meta", **options)
        ffn.weight1, ffn.weight2 = w1, w2
        ffn.bias1, ffn.bias2 = b1, b2
        ffn.weights_transposed = t1
        return ffn

    def reset_parameters(self):
        """``torch.nn.Linear``'s initialization: kaiming_uniform_(a=sqrt(5)) weights, U(+-1/sqrt(fan_in)) biases."""
        for w, b in ((self.weight1, self.bias1), (self.weight2, self.bias2)):
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if b is not None:
                bound = 1 / math.sqrt(w.shape[1])
                torch.nn.init.uniform_(b, -bound, bound)

    def forward(self, x):
        # At the layer the weights are the layer's: an input of another width is what is at fault (the functions'
        # own check, cupyffn/core/rules.py, cannot tell which of the two is wrong and names weight1)
        if x.ndim < 1 or x.shape[-1] != self.dim:
            got = f"{tuple(x.shape)}, last dimension {x.shape[-1]}" if x.ndim else "a 0-d tensor"
            raise ValueError(f"the input of GeluFFN(dim={self.dim}, hidden_dim={self.hidden_dim}) must have shape "
                             f"[..., {self.dim}] (the layer's dim); got {got}")
        w1, w2 = self.weight1, self.weight2
        if self.weights_transposed:
            w1, w2 = w1.t(), w2.t()
        return block(x, w1, w2, self.bias1, self.bias2, self.precision, self.save)

    def extra_repr(self):
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, bias={self.bias1 is not None}, "
                f"dtype={self.weight1.dtype}, precision={self.precision!r}, save={self.save!r}")
