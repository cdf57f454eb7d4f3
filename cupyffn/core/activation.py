"""The block's activation, described once: GELU with the tanh approximation.

    tanh_inner = tanh(sqrt(2/pi) * (z + 0.044715 z^3))                 z = linear1_out, the pre-activation
    gelu_out   = 0.5 z (1 + tanh_inner)
    d gelu_out / dz = 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2)        t = tanh_inner

Every route reads the math from the description below, in its language:

* Python / NumPy (here): `tanh_inner`, `value`, `grad` in the kernels' evaluation order (fp32 in, fp32 out: the
  NumPy backend reproduces the GPU's arithmetic), and `grad_reference` in the order of the problem statement
  (PyTorch's formula: the benchmark's plain-fp32 reference, and the float64 references of the tests);
* CUDA: `CUDA_HEADER`, pasted into every kernel by cupyffn/cuda/kernels.py (``tanh_inner_of``, ``gelu_of``,
  ``gelu_grad``);
* cuBLASLt: the epilogues that compute it inside a GEMM (`LT_FORWARD`, `LT_FORWARD_BIAS`, `LT_BACKWARD`; cuBLASLt's
  GELU is this tanh form, checked against both formulas in docs/decisions/049).

`SAVED` names the forward tensors the backward takes (the float32 engine uses all three; the cuBLASLt route keeps
linear1_out and gelu_out and recomputes tanh_inner inside its DGELU epilogue). A second activation (erf GELU,
SwiGLU) would be a second description of this shape plus its CUDA header: docs/architecture.md says what else it
touches.
"""

import math

import numpy

NAME = "gelu_tanh"
#: The tensors the forward saves for the backward, in the order the backward takes them.
SAVED = ("linear1_out", "tanh_inner", "gelu_out")
#: kernels_cu/ header holding the CUDA form (tanh_inner_of, gelu_of, gelu_grad).
CUDA_HEADER = "activation.cuh"
#: cuBLASLt epilogue names (cupyffn/gemm/cublaslt.py EPILOGUE_*): forward GEMM1 without and with bias1 (gelu_out
#: as D, linear1_out as the aux output), backward GEMM1 (grad_linear1 = D * GELU'(aux)).
LT_FORWARD, LT_FORWARD_BIAS, LT_BACKWARD = "GELU_AUX", "GELU_AUX_BIAS", "DGELU"

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715
_F32 = numpy.float32
_C = _F32(SQRT_2_OVER_PI)
_CUBIC = _F32(CUBIC)
_C0 = _F32(SQRT_2_OVER_PI / 2)             # the kernels' gelu_grad constants
_C1 = _F32(SQRT_2_OVER_PI / 2 * 3 * CUBIC)


def tanh_inner(z, xp=numpy):
    """tanh(sqrt(2/pi) (z + 0.044715 z^3)); fp32 for fp32 z, as ``tanh_inner_of`` evaluates it. `xp`: the array
    module of z (NumPy, or CuPy for the benchmark's inputs made on the GPU)."""
    if z.dtype == numpy.float32:
        return xp.tanh(_C * (z + _CUBIC * z * z * z)).astype(numpy.float32, copy=False)
    return xp.tanh(SQRT_2_OVER_PI * (z + CUBIC * z ** 3))


def value(z, t):
    """gelu_out = 0.5 z (1 + t), in the order of ``gelu_of`` (every kernel forming gelu_out uses it)."""
    half, one = z.dtype.type(0.5), z.dtype.type(1.0)
    return half * z * (one + t)


def grad(z, t):
    """d gelu_out / dz from z and t in the kernels' form z (1 - t^2) (c0 + c1 z^2) + (0.5 + 0.5 t) (``gelu_grad``,
    there with fmas): fp32 in, fp32 out."""
    half, one = _F32(0.5), _F32(1.0)
    return z * (one - t * t) * (_C0 + _C1 * (z * z)) + (half + half * t)


def grad_reference(z, t):
    """d gelu_out / dz in the problem statement's order, in z's dtype (the benchmark's plain-fp32 reference, and the
    float64 accuracy reference): 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 0.134145 z^2)."""
    d = z.dtype.type
    half, one = d(0.5), d(1.0)
    return half * (one + t) + half * z * (one - t * t) * d(SQRT_2_OVER_PI) * (one + d(0.134145) * z * z)


def forward(z, xp=numpy):
    """(tanh_inner, gelu_out) of z (fp32 or float64)."""
    t = tanh_inner(z, xp)
    return t, value(z, t)
