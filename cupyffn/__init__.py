"""cupyffn: the forward and backward pass of a GELU(tanh) feed-forward block, fast on NVIDIA GPUs (CuPy),
with a NumPy backend of the same semantics for the CPU.

    y = gelu_tanh(x @ weight1.T + bias1) @ weight2.T + bias2     x, y [..., D], weight1 [H, D], weight2 [D, H]

    import cupyffn
    f = cupyffn.gelu_ffn_forward(x, weight1, weight2)      # output, linear1_out, tanh_inner, gelu_out
    g = cupyffn.gelu_ffn_backward(grad_output, x, weight1, weight2, f.linear1_out, f.tanh_inner, f.gelu_out)
    g.grad_hidden_states, g.grad_weight1, g.grad_weight2

Arrays: NumPy (computed on the CPU), CuPy, or any DLPack / CUDA Array Interface producer (torch, JAX); float32
activations in any precision, bfloat16 / float16 ones on cuBLASLt's fused epilogues; biases with either
(bias1=, need_bias_grads=; docs/precisions.md).

Functions  gelu_ffn_forward, gelu_ffn_backward; clear_cache and release_captured_plans (cached plans);
           gpu_unavailable_reason (None, or why no GPU can be used here)
Classes    GeluFFNBackward (a reusable plan for one shape), FFNForward and FFNGrads (the results),
           Precision, ActivationMismatchError, CublasError
Precisions PRECISIONS (name -> Precision with its accuracy contract), DEFAULT_PRECISION (GPU),
           CPU_DEFAULT_PRECISION (CPU)
Modules    cupyffn.torch (torch.nn layer, custom ops, replace_mlps, tensor parallel), cupyffn.jax (JAX function),
           cupyffn.workloads (the benchmark's shapes, inputs and check); the subpackages are internal

Each name's own help() gives the details.
"""

from .api.backward_plan import GeluFFNBackward
from .api.functional import clear_cache, gelu_ffn_backward, gelu_ffn_forward
from .core.checks import ActivationMismatchError
from .core.plans import release_captured_plans
from .core.precision import CPU_DEFAULT as CPU_DEFAULT_PRECISION
from .core.precision import DEFAULT as DEFAULT_PRECISION
from .core.precision import PRECISIONS, Precision
from .core.results import FFNForward, FFNGrads
from .cuda.device import gpu_unavailable_reason
from .gemm.cublas import CublasError

__version__ = "0.1.0"

__all__ = [
    "gelu_ffn_backward",
    "gelu_ffn_forward",
    "GeluFFNBackward",
    "FFNGrads",
    "FFNForward",
    "ActivationMismatchError",
    "PRECISIONS",
    "Precision",
    "DEFAULT_PRECISION",
    "CPU_DEFAULT_PRECISION",
    "CublasError",
    "clear_cache",
    "release_captured_plans",
    "gpu_unavailable_reason",
    "__version__",
]
