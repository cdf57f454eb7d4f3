"""PyTorch layer: ``y = gelu_tanh(x @ weight1.T + b1) @ weight2.T + b2`` with cupyffn's forward and backward.

    from cupyffn.torch import GeluFFN
    ffn = GeluFFN(dim=512, hidden_dim=2048, device="cuda")       # precision: fp16+fp8 on CUDA, save="all"
    y = ffn(x)                                                     # x: float32 [..., 512]
    y.sum().backward()                                             # ffn.weight1.grad, ffn.weight2.grad, x.grad

``weight1`` is ``[hidden_dim, dim]`` and ``weight2`` is ``[dim, hidden_dim]``, both
``[out_features, in_features]`` like ``torch.nn.Linear.weight``; the result equals
``F.linear(F.gelu(F.linear(x, weight1), approximate="tanh"), weight2)`` within the accuracy contract
of the precision (``cupyffn.PRECISIONS[precision].contract``, relative L2 error per output).

Operators: the forward and the backward are ``torch.library.custom_op``s, ``torch.ops.cupyffn.forward``
and ``torch.ops.cupyffn.backward`` (cupyffn/frameworks/torch_ops.py), one pair for every configuration (float32,
bfloat16 or float16; biases or not; every precision), with fake (meta) implementations and an autograd formula
(``register_autograd``). So ``torch.compile(model, fullgraph=True)`` traces a model using ``GeluFFN`` (or
swapped by ``replace_mlps``) without a graph break (the ops stay opaque calls in the compiled graph, forward and
backward), and ``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.graph`` capture them: every result is
allocated by torch (``torch.empty``, inside the op) and handed to cupyffn as ``out=``, so under capture
it comes from the graph's memory pool. Capture needs the call's plan built first: run the step once
(the usual warm-up iterations) before capturing.

Eager fast path: outside tracing (``torch.compiler.is_compiling()`` False, no torch dispatch mode such
as FakeTensorMode, no functorch transform, plain tensors) the layer runs the same implementation through a
plain ``torch.autograd.Function`` instead of the operators, skipping the custom-op dispatcher's Python
layers (host time per call; ``_eager`` says why that check is sufficient). ``gelu_ffn_backward`` is that eager backward as a function (no autograd).

Autocast: ``gelu_ffn`` casts its floating-point inputs to float32 under ``torch.autocast`` and returns float32;
outside autocast only float32 tensors are accepted (TypeError naming the tensor). The ``GeluFFN`` module (and a
swapped MLP) instead computes under autocast as ``nn.Linear`` would, in the autocast dtype, as it does with 16-bit
parameters (cupyffn/frameworks/torch_layer.py).

Models: ``replace_mlps(model)`` runs a model's MLPs (nn.Sequential, diffusers' FeedForward, transformers' GPT-2,
GPTBigCode, GPT-Neo, GPT-J, CodeGen and Phi MLPs, timm's Mlp; their dropout as they place it) on cupyffn without
changing its modules, parameters or state_dict keys; ``restore_mlps`` undoes it (cupyffn/frameworks/torch_swap.py).
Under torch.compile with 16-bit activations a swapped MLP runs the module's own forward by default
(``compiled="module"``: the compiler's fused code, as in the plain model, no Python per call; ``compiled="cupyffn"``
keeps the operators in the graph; ``COMPILED`` lists the choices; docs/decisions/065-swap-in-a-compiled-step.md).

Devices and streams: the work is enqueued on torch's current stream of the tensors' device
(``torch.cuda.current_stream(device)``), so it is ordered like any torch op and the host is never
synchronized. CPU tensors in "ieee" and bf16 / fp16 run on torch's own GEMMs with the GELU in NumPy
(cupyffn/cpu/torch_route.py), the emulated GPU precisions on cupyffn's NumPy backend (zero-copy views).
cupyffn's own scratch buffers and cuBLAS workspaces come from CuPy's memory pool, not torch's.

Host fast path: no DLPack import. CUDA tensors are read by pointer (data_ptr(), shape, stride(), device:
cupyffn/core/arrays.py), on torch's current stream, and repeated tensors take the validated-call fast path keyed
by pointers, shapes and strides (docs/decisions/048-dlpack-free-import.md).

Tensor parallelism: autograd hands grad_input on only when this op's backward returns, so this layer cannot
start the all-reduce of grad_hidden_states early; ``TensorParallelGeluFFN`` (cupyffn/frameworks/torch_parallel.py)
does, through ``cupyffn.gelu_ffn_backward(..., grad_hidden_ready=event)``.

Limitations: no double backward (the backward operator has no autograd formula); no ``torch.func``
rules (vmap), untested with ``torch.func``; all three tensors on one device.

This module imports torch; ``import cupyffn`` does not import it.
"""

from .core.precision import checked_name as _checked_precision
from .frameworks import torch_ops as _ops
from .frameworks.torch_layer import GeluFFN, GeluFFNFunction, gelu_ffn
from .frameworks.torch_parallel import (TensorParallelGeluFFN, TensorParallelGeluFFNFunction, shard_weights,
                                        tensor_parallel_gelu_ffn)
from .frameworks.torch_swap import COMPILED, replace_mlps, restore_mlps, swapped_mlps

__all__ = ["GeluFFN", "GeluFFNFunction", "gelu_ffn", "gelu_ffn_backward", "replace_mlps", "restore_mlps",
           "swapped_mlps", "TensorParallelGeluFFN", "TensorParallelGeluFFNFunction", "shard_weights",
           "tensor_parallel_gelu_ffn", "COMPILED"]


def gelu_ffn_backward(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None,
                      precision=None, need_grad_hidden=True, need_weight_grads=True):
    """The layer's backward as eager autograd runs it, without autograd: (grad_hidden_states, grad_weight1,
    grad_weight2), None for what is not needed; new tensors from torch, on torch's current stream.

    The tensors are float32 on one CPU or CUDA device; linear1_out, tanh_inner, gelu_out as
    ``cupyffn.gelu_ffn_backward`` takes them (None for tanh_inner and gelu_out: memory mode); precision as in
    ``GeluFFNFunction`` (None: the default of the tensors' device). Not traceable by torch.compile
    (``torch.ops.cupyffn.backward`` is the traceable operator, with placeholders in place of None).
    """
    _ops.check_tensors((("grad_output", grad_output), ("hidden_states", hidden_states), ("weight1", weight1),
                        ("weight2", weight2)))
    precision = _checked_precision(precision)  # None: the default of the tensors' device, resolved by the door
    return _ops.backward_impl(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out,
                              precision, need_grad_hidden, need_weight_grads, False)[:3]
