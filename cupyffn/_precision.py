"""The precision plans: what each `precision=` value means, in one place.

Every plan computes the GELU derivative in fp32 and accumulates every GEMM in fp32; they differ
in the operands the four GEMMs read:

=========  ====================================================================  ==============
name       GEMM operands                                                         contract (*)
=========  ====================================================================  ==============
ieee       the fp32 inputs as given (cuBLAS SGEMM, no TF32)                      5e-6
bf16x3     each fp32 operand split into hi = bf16(x), lo = bf16(x - hi);         1e-4
           hi*hi' + hi*lo' + lo*hi' as one GEMM with the planes stacked along K
tf32       fp16(x * 2^e) with a per-tensor power-of-two scale 2^e (11-bit         6e-4
           significand like TF32, at fp16 tensor-core rate); alpha undoes it
bf16       bf16(x), one pass                                                     5e-3
=========  ====================================================================  ==============

(*) relative L2 error ||out - ref64|| / ||ref64|| of every output against a float64 reference, on
the benchmark's inputs (normal data, weights 0.02 * N(0, 1)). `passes_check`: the benchmark's own
check (cupyffn.workloads.check: per-workload max_atol, 99% of the elements) against the plain-fp32
reference, measured on the H200 on all 16 workloads over rounds of fresh inputs: ieee, bf16x3 and
tf32 pass it (tf32 with every element inside max_atol, worst max|err|/atol 0.90); bf16 fails it on
every workload (max|err| up to 7x atol).
"""

from typing import NamedTuple

# Operand formats; the numbers are FMT_* in kernels_cu/common.cuh.
FMT_F32 = 0
FMT_BF16 = 1
FMT_BF16X3 = 2
FMT_F16S = 3

# bf16x3 plane patterns: bit j set means plane j holds lo. A GEMM pairs plane j of its A operand with
# plane j of its B operand, so A = (hi, lo, hi) against B = (hi, hi, lo) gives hi*hi + lo*hi + hi*lo.
PATTERN_HLH = 0b010
PATTERN_HHL = 0b100

# fp16 scale slots (kSlots entries of the device state; kGemmSlots in kernels_cu/common.cuh pairs them).
SLOT = {"grad_output": 0, "weight2": 1, "gelu_out": 2, "hidden_states": 3, "weight1": 4, "grad_linear1": 5}

# Pattern of each bf16x3 operand, following the pairing above: grad_output and grad_linear1 are the
# A side of two GEMMs each, everything else is a B side.
PATTERN = {"grad_output": PATTERN_HLH, "grad_linear1": PATTERN_HLH, "weight2": PATTERN_HHL,
           "gelu_out": PATTERN_HHL, "hidden_states": PATTERN_HHL, "weight1": PATTERN_HHL}


class Precision(NamedTuple):
    name: str
    fmt: int           # operand format written by the conversion kernels
    planes: int        # 16-bit planes per operand (0: the fp32 inputs are used as they are)
    contract: float    # relative L2 error bound per output (see module docstring)
    passes_check: bool  # passes the benchmark's own check against the fp32 reference on every workload (measured)
    summary: str


PRECISIONS = {
    "bf16x3": Precision("bf16x3", FMT_BF16X3, 3, 1e-4, True,
                        "3 bf16 tensor-core products per GEMM (hi*hi + hi*lo + lo*hi), fp32 accumulation"),
    "ieee": Precision("ieee", FMT_F32, 0, 5e-6, True, "plain fp32 arithmetic (cuBLAS SGEMM, no TF32)"),
    "tf32": Precision("tf32", FMT_F16S, 1, 6e-4, True,
                      "TF32-class: fp16 operands with per-tensor power-of-two scales, fp32 accumulation"),
    "bf16": Precision("bf16", FMT_BF16, 1, 5e-3, False, "one bf16 tensor-core pass, fp32 accumulation"),
}

DEFAULT = "bf16x3"


def lookup(precision):
    """The Precision named `precision`, or a ValueError that lists the valid names."""
    if isinstance(precision, Precision) and PRECISIONS.get(precision.name) == precision:
        return precision
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        valid = ", ".join(repr(p) for p in PRECISIONS)
        raise ValueError(f"precision must be one of {valid}; got {precision!r}") from None
