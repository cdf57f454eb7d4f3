"""The precision plans ("recipes"): what each `precision=` value means, as data, in one place.

A precision says, for each GEMM of the backward (and of the forward), which *form* multiplies its
fp32 operands; the GPU engine, the forward and the NumPy backend all read it from here. Every form
accumulates in fp32 and every plan computes the GELU derivative in fp32.

============  =====================================================================================
form          GEMM operands and products
============  =====================================================================================
f32           the fp32 inputs as given (cuBLAS SGEMM, no TF32)
bf16          bf16(x), one product
bf16x3        hi = bf16(x), lo = bf16(x - hi); hi*hi' + hi*lo' + lo*hi' as ONE GEMM with the three
              planes stacked along K
f16s          fp16(x * 2^e) with a per-tensor power-of-two scale 2^e decided on the device (11-bit
              significand like TF32, at fp16 tensor-core rate); alpha = 2^-(e + e') undoes it
f16+e4m3      f16s's product hi*hi' plus ONE e4m3 GEMM with K doubled forming the cross terms
              lo*hi' + hi*lo' (lo = x*2^e - hi), both adding into one fp32 output (two passes;
              encoding: kernels_cu/split_e4m3.cu, cupyffn/cpu/numpy_route.py f16e4m3_split)
============  =====================================================================================

=========  =========================================================  ===========
precision  forms                                                      contract(*)
=========  =========================================================  ===========
ieee       f32 everywhere                                             5e-6
bf16x3     bf16x3 everywhere                                          1e-4
fp16+fp8   per GEMM the cheaper of f16+e4m3 and bf16x3 at the call's  1e-4
           token count (FORM_TABLE, measured on the H100); bf16x3
           where fp8's constraints fail; forward: bf16x3
tf32       f16s everywhere                                            6e-4
bf16       bf16 everywhere                                            5e-3
=========  =========================================================  ===========

(*) relative L2 error ||out - ref64|| / ||ref64|| of every output against a float64 reference, on
the benchmark's inputs (normal data, weights 0.02 * N(0, 1)), at any T, D and H: a GEMM sums at
most cupyffn/gemm/ksplit.py's MAX_K products in one accumulator and adds longer sums' chunks in fp32
(measured up to T = 352,000: results/accuracy-vs-tokens-nvidia-h200.md). `passes_check`: the benchmark's own
check (cupyffn.workloads.check: per-workload max_atol, 99% of the elements) against the plain-fp32
reference, measured on the H200 on all 16 workloads over rounds of fresh inputs: ieee, bf16x3,
fp16+fp8 and tf32 pass it; bf16 fails it on every workload (max|err| up to 7x atol).
"""

from dataclasses import dataclass
from typing import NamedTuple

# Operand formats the conversion kernels write; the numbers are FMT_* in kernels_cu/common.cuh.
# FMT_F16E4M3 is the fp16+fp8 plan's: each operand in whatever encodings its GEMMs' forms need
# (fp16, e4m3 pairs, bf16x3 planes), written by split_e4m3.cu.
FMT_F32 = 0
FMT_BF16 = 1
FMT_BF16X3 = 2
FMT_F16S = 3
FMT_F16E4M3 = 4

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

#: The backward's GEMMs: name -> (output, A operand, B operand); A is [M, K], B is [K, N] row-major
#: products of the fp32 tensors (weights are [out_features, in_features]).
GEMMS = {
    "gemm1": ("grad_gelu", "grad_output", "weight2"),             # [T,H] = [T,D] @ [D,H]
    "gemm2": ("grad_weight2", "grad_output^T", "gelu_out"),       # [D,H] = [D,T] @ [T,H]
    "gemm3": ("grad_hidden_states", "grad_linear1", "weight1"),   # [T,D] = [T,H] @ [H,D]
    "gemm4": ("grad_weight1", "grad_linear1^T", "hidden_states"),  # [H,D] = [H,T] @ [T,D]
}

#: e4m3 correction scale: the pair forms 2^-3 (lo*hi' + hi*lo') (f16e4m3_split), so its GEMM's
#: A scale is 2^3. Kept on the device (the engine's consts[8]) for cuBLASLt's A_SCALE_POINTER.
E4M3_PAIR_SCALE = 8.0


class Form(NamedTuple):
    name: str
    fmt: int        # operand format of this form's conversion (FMT_*)
    planes: int     # 16-bit planes per operand of its (main) GEMM; 0: the fp32 inputs as they are
    summary: str


FORMS = {
    "f32": Form("f32", FMT_F32, 0, "fp32 SGEMM"),
    "bf16": Form("bf16", FMT_BF16, 1, "one bf16 product"),
    "bf16x3": Form("bf16x3", FMT_BF16X3, 3, "hi*hi + hi*lo + lo*hi in bf16, one GEMM with K tripled"),
    "f16s": Form("f16s", FMT_F16S, 1, "one fp16 product of per-tensor power-of-two scaled operands"),
    "f16+e4m3": Form("f16+e4m3", FMT_F16E4M3, 1,
                     "fp16 hi*hi plus one e4m3 GEMM (K doubled) for lo*hi + hi*lo, one fp32 output"),
}

#: fp16+fp8: per GEMM, (from this many tokens on, this form) steps: the pair from T = 1024 on, bf16x3 below.
#: Measured on the H100, whole calls against the bf16x3 plan (dev/pair_plan_ab.py; GEMMs alone:
#: dev/gemm_forms_bench.py; docs/decisions/064-pair-kernel-for-every-gemm.md, 023): with the pairs of GEMM1, GEMM2
#: and GEMM4 as one sm90 kernel launch each (128 x 192 tiles for the weight gradients), 0.90x at T = 1024; at T = 256
#: and 512 within 0.2% either way, so bf16x3 stays there (and below, unmeasured). Where that kernel cannot run, the
#: GPU engine keeps bf16x3 for the GEMMs whose cuBLAS pair is slower (cupyffn/f32/plan.py CUBLAS_PAIR_TOKENS: GEMM1
#: everywhere, GEMM2 and GEMM4 below T = 2048); GeluFFNBackward.gemm_forms reports what ran.
FORM_TABLE = {g: ((0, "bf16x3"), (1024, "f16+e4m3")) for g in ("gemm1", "gemm2", "gemm3", "gemm4")}


def _uniform(form):
    return {g: ((0, form),) for g in GEMMS}


@dataclass(frozen=True)
class Precision:
    """One precision plan: per backward GEMM a table of (min_tokens, form) steps, the forward's form,
    the accuracy contract and the benchmark verdict."""

    name: str
    contract: float     # relative L2 error bound per output (module docstring)
    passes_check: bool  # passes the benchmark's own check against the fp32 reference on every workload (measured)
    summary: str
    steps: tuple        # ((gemm, ((min_tokens, form name), ...)), ...) for gemm1..gemm4
    forward_form: str   # form of both forward GEMMs

    def form(self, gemm, tokens):
        """The Form that GEMM `gemm` ("gemm1".."gemm4") uses at `tokens` tokens (before fp8 fallbacks)."""
        chosen = None
        for min_tokens, name in dict(self.steps)[gemm]:
            if tokens >= min_tokens:
                chosen = name
        return FORMS[chosen]

    def forms(self, tokens):
        """{gemm: Form} at `tokens` tokens."""
        return {g: self.form(g, tokens) for g in GEMMS}

    @property
    def uniform(self):
        """The Form of every backward GEMM if they all share one (whatever the token count), else None."""
        names = {name for _, table in self.steps for _, name in table}
        return FORMS[names.pop()] if len(names) == 1 else None

    @property
    def fmt(self):
        """Operand format of the float32 engine's conversions: the uniform form's, or FMT_F16E4M3 for the fp16+fp8 mix
        (f16+e4m3 and its bf16x3 fallback: the one mix the engine converts for); any other mix is refused, not run as
        that one."""
        u = self.uniform
        if u is not None:
            return u.fmt
        names = {name for _, table in self.steps for _, name in table}
        if names <= {"f16+e4m3", "bf16x3"}:
            return FMT_F16E4M3
        raise ValueError(f"precision {self.name!r} mixes the forms {', '.join(sorted(names))}: the float32 engine "
                         f"runs one form in every GEMM, or f16+e4m3 with bf16x3 (fp16+fp8)")

    @property
    def planes(self):
        u = self.uniform
        return u.planes if u is not None else 1

    @property
    def forward(self):
        """The Form of the forward's two GEMMs."""
        return FORMS[self.forward_form]


def _plan(name, contract, passes_check, summary, table, forward_form):
    return Precision(name, contract, passes_check, summary, tuple(sorted(table.items())), forward_form)


PRECISIONS = {
    "bf16x3": _plan("bf16x3", 1e-4, True,
                    "3 bf16 tensor-core products per GEMM (hi*hi + hi*lo + lo*hi), fp32 accumulation",
                    _uniform("bf16x3"), "bf16x3"),
    "fp16+fp8": _plan("fp16+fp8", 1e-4, True,
                      "per GEMM the cheaper of fp16 hi*hi + one e4m3 GEMM for the cross terms, and bf16x3 "
                      "(measured per token count); fp32 accumulation", FORM_TABLE, "bf16x3"),
    "ieee": _plan("ieee", 5e-6, True, "plain fp32 arithmetic (cuBLAS SGEMM, no TF32)", _uniform("f32"), "f32"),
    "tf32": _plan("tf32", 6e-4, True,
                  "TF32-class: fp16 operands with per-tensor power-of-two scales, fp32 accumulation",
                  _uniform("f16s"), "f16s"),
    "bf16": _plan("bf16", 5e-3, False, "one bf16 tensor-core pass, fp32 accumulation", _uniform("bf16"), "bf16"),
}

#: The default on a GPU: fp32-class gradients (contract 1e-4) at the lowest cost measured; below T = 1024 it is the
#: bf16x3 plan bit for bit, from T = 1024 on every GEMM runs the fp16 + e4m3 pair (FORM_TABLE).
DEFAULT = "fp16+fp8"

#: The default on the CPU (NumPy arrays, device="cpu", CPU tensors): plain fp32, the fastest precision there and
#: the most accurate. The NumPy backend reproduces the other precisions by rounding every operand as the GPU does,
#: which on the CPU buys no speed and costs time and accuracy (the benchmark's shape at T = 2048 on 2 CPU cores:
#: "fp16+fp8" 13.0 s, relative L2 error 1.5e-5; "ieee" 3.4 s, 5.3e-7); they stay selectable by name, to
#: reproduce a GPU's numerics.
CPU_DEFAULT = "ieee"


def resolve(precision, cpu):
    """The Precision that `precision` names for a call on the CPU (cpu=True) or a GPU; None means that device's
    default (CPU_DEFAULT or DEFAULT). Invalid names raise lookup's ValueError."""
    if precision is None:
        precision = CPU_DEFAULT if cpu else DEFAULT
    return lookup(precision)


def lookup(precision):
    """The Precision named `precision`, or a ValueError that lists the valid names."""
    if isinstance(precision, Precision) and PRECISIONS.get(precision.name) == precision:
        return precision
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        valid = ", ".join(repr(p) for p in PRECISIONS)
        raise ValueError(f"precision must be one of {valid}; got {precision!r}") from None


def checked_name(precision):
    """The name of the precision `precision` names (a bad name raises lookup's ValueError before any array is looked
    at), or None: the default of the arrays' device, resolved by the validator (cupyffn/api/validate.py). Every entry
    point (functions, plans, torch and JAX layers) checks a user's precision through this, once."""
    return None if precision is None else lookup(precision).name


#: (M, N, K) of each backward GEMM (GEMMS) as letters of T (tokens), D (dim), H (hidden).
GEMM_MNK = {"gemm1": "THD", "gemm2": "DHT", "gemm3": "TDH", "gemm4": "HDT"}


def dims(letters, tokens, dim, hidden):
    """The sizes named by `letters` (e.g. GEMM_MNK[g], or "TH"): T = tokens, D = dim, H = hidden."""
    size = {"T": tokens, "D": dim, "H": hidden}
    return tuple(size[c] for c in letters)


def pair_fits(gemm, tokens, dim, hidden):
    """Whether the f16+e4m3 form's e4m3 GEMM meets cuBLASLt's FP8 constraints at this shape: N (and so ldc)
    a multiple of 16 (measured on the H200: any M runs; K is padded to a multiple of 16 by the conversion's
    layout, so it always fits). N is H for GEMM1/GEMM2 and D for GEMM3/GEMM4: T never matters.
    Where it does not, the plan runs bf16x3 for that GEMM (the GPU engine may also fall back when
    cuBLASLt's heuristic offers no algorithm; GeluFFNBackward.gemm_forms reports what ran)."""
    _, n, _ = dims(GEMM_MNK[gemm], tokens, dim, hidden)
    return n % 16 == 0


def effective_forms(precision, tokens, dim, hidden):
    """{gemm: Form} that `precision` runs at this shape: its table, with bf16x3 where the pair does not fit."""
    forms = precision.forms(tokens)
    for g, f in forms.items():
        if f.name == "f16+e4m3" and not pair_fits(g, tokens, dim, hidden):
            forms[g] = FORMS["bf16x3"]
    return forms
