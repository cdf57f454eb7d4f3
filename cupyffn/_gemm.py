"""GEMMs described once, built by whichever backend supports them.

A :class:`GemmDesc` says what one product is: row-major ``C[M,N] = alpha * op(A) @ op(B) * a_scale
+ beta * C`` with its shape, operand types and majorness (``a_trans``: A stored as its transpose
[K, M]; ``b_trans``: B stored as [N, K]), leading dimensions, an optional device A-scale and the
epilogue. A backend answers ``supports(desc)`` with (ok, reason) and builds a plan object with
ctypes pointer fields ``a b c alpha beta`` that the engine rewrites per call, called as
``plan(handle)`` on a :class:`cupyffn._cublas.Handle` bound to the stream.

Backends, in the order :func:`build` tries them:

* ``cublas`` -- cublasGemmEx (:class:`cupyffn._cublas.Gemm`): fp32, fp16, bf16 operands, fp32 out.
* ``cublaslt`` -- cublasLtMatmul (:class:`cupyffn._cublaslt.LtMatmul`): also e4m3 operands ("TN" only,
  dimensions multiples of 16), device A/B scales; the algorithm is chosen once by cuBLASLt's heuristic.

A precision's form decides the descriptions (cupyffn/_precision.py); :class:`PairGemm` is the
f16+e4m3 form's two products into one output, :class:`Sm90PairGemm` the same form as one launch of our sm90
kernel (cupyffn/_sm90_gemm.py PairLaunch) where the engine takes it (_gpu_engine.SM90_PAIR_GEMMS).
"""

from dataclasses import dataclass

from . import _cublas
from . import _precision as P


@dataclass(frozen=True)
class GemmDesc:
    name: str
    m: int
    n: int
    k: int
    a_type: int
    b_type: int
    c_type: int = _cublas.R_32F
    a_trans: bool = False
    b_trans: bool = False
    lda: int = None
    ldb: int = None
    ldc: int = None
    a_scale: int = None  # device pointer to one float, fixed for the plan's life
    epilogue: str = "none"


class Unsupported(ValueError):
    """No backend builds this GEMM; the message lists each backend's reason."""


#: cudaDataType of the operands each conversion format writes (cupyffn/_precision.py FMT_*) for cublasGemmEx.
OPERAND_TYPE = {P.FMT_F32: _cublas.R_32F, P.FMT_BF16: _cublas.R_16BF, P.FMT_BF16X3: _cublas.R_16BF,
                P.FMT_F16S: _cublas.R_16F}


class _CublasBackend:
    name = "cublas"

    def supports(self, desc):
        if desc.epilogue != "none":
            return False, f"cublasGemmEx has no {desc.epilogue!r} epilogue"
        if desc.a_scale is not None:
            return False, "cublasGemmEx takes no operand scale"
        types = {desc.a_type, desc.b_type}
        if not types <= {_cublas.R_32F, _cublas.R_16F, _cublas.R_16BF} or len(types) != 1:
            return False, f"cublasGemmEx here multiplies fp32, fp16 or bf16 pairs, not types {sorted(types)}"
        return True, ""

    def build(self, desc, device_id):
        return _cublas.Gemm(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type, a_trans=desc.a_trans,
                            b_trans=desc.b_trans, lda=desc.lda, ldb=desc.ldb, ldc=desc.ldc, name=desc.name)


class _CublasLtBackend:
    name = "cublaslt"

    def supports(self, desc):
        if desc.epilogue != "none":
            return False, f"the cuBLASLt backend builds no {desc.epilogue!r} epilogue"
        from . import _cublaslt

        return _cublaslt.LtMatmul.supports(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type,
                                           desc.a_trans, desc.b_trans, desc.lda, desc.ldb, desc.ldc)

    def build(self, desc, device_id):
        from . import _cublaslt

        try:
            return _cublaslt.LtMatmul(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type,
                                      a_trans=desc.a_trans, b_trans=desc.b_trans, lda=desc.lda, ldb=desc.ldb,
                                      ldc=desc.ldc, name=desc.name, a_scale=desc.a_scale, device_id=device_id)
        except _cublaslt.LtUnsupported as e:  # no algorithm from the heuristic: a refusal, not a bug
            raise Unsupported(str(e)) from e


CUBLAS = _CublasBackend()
CUBLASLT = _CublasLtBackend()
BACKENDS = (CUBLAS, CUBLASLT)


def build(desc, device_id, backends=BACKENDS):
    """(plan, backend name) from the first backend that supports `desc` and builds it. A backend refuses by
    `supports()` or, at build, by raising Unsupported (cuBLASLt's heuristic); other errors propagate."""
    reasons = []
    for backend in backends:
        ok, why = backend.supports(desc)
        if ok:
            try:
                return backend.build(desc, device_id), backend.name
            except Unsupported as e:
                why = str(e)
        reasons.append(f"{backend.name}: {why}")
    raise Unsupported(f"no GEMM backend for {desc.name} (M={desc.m} N={desc.n} K={desc.k}): " + "; ".join(reasons))


class PairGemm:
    """The f16+e4m3 form: the e4m3 GEMM (cross terms) writes C with the caller's beta, then the fp16
    GEMM adds hi*hi' onto it with beta = 1. Its output is set by set_output, its beta like a single GEMM's."""

    def __init__(self, fp8, f16, one_ptr, name):
        self.fp8, self.f16 = fp8, f16
        self.name = name
        self.f16.beta.value = one_ptr

    @property
    def beta(self):
        """The caller's beta (0 or 1 when accumulating): the first product's."""
        return self.fp8.beta

    def __call__(self, handle):
        self.fp8(handle)
        self.f16(handle)


class Sm90PairGemm:
    """The f16+e4m3 form as one sm90 kernel launch (a _sm90_gemm.PairLaunch over the engine's fixed operands),
    behind a GEMM plan's call: ``plan(handle)`` runs on the stream the cuBLAS handle is bound to. Its output is set
    by set_output, whether it adds to it by set_beta."""

    def __init__(self, launch, name):
        self.launch, self.name = launch, name

    def __call__(self, handle):
        self.launch(handle.stream_ptr)


def set_output(plan, ptr):
    """Point a GEMM plan's output (both products of a PairGemm) at `ptr`."""
    if isinstance(plan, Sm90PairGemm):
        plan.launch.args.c = ptr
        return
    for part in (plan.fp8, plan.f16) if isinstance(plan, PairGemm) else (plan,):
        part.c.value = ptr


def set_beta(plan, beta_ptr, accumulate):
    """The caller's beta of a GEMM plan: the device pointer `beta_ptr` (to 0 or 1) for cuBLAS, `accumulate` for
    the sm90 kernel (which adds to its output or overwrites it)."""
    if isinstance(plan, Sm90PairGemm):
        plan.launch.args.accumulate = int(bool(accumulate))
    else:
        plan.beta.value = beta_ptr
