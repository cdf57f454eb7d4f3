"""cupyffn: the backward pass of a GELU(tanh) feed-forward block on NVIDIA GPUs, for CuPy.

    import cupyffn
    g = cupyffn.gelu_ffn_backward(grad_output, hidden_states, weight1, weight2,
                                  linear1_out, tanh_inner, gelu_out, precision="fp16+fp8")
    g.grad_hidden_states, g.grad_weight1, g.grad_weight2

See README.md for the formulas, the precision contracts and measured speed.
"""

from ._backward import FFNGrads, GeluFFNBackward, clear_cache, gelu_ffn_backward, release_captured_plans
from ._checks import ActivationMismatchError
from ._cublas import CublasError
from ._forward import FFNForward, gelu_ffn_forward
from ._precision import DEFAULT as DEFAULT_PRECISION
from ._precision import PRECISIONS, Precision

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
    "CublasError",
    "clear_cache",
    "release_captured_plans",
    "__version__",
]
