"""GEMMs described once, built by whichever backend supports them.

A :class:`GemmDesc` says what one product is: row-major ``C[M,N] = alpha * op(A) @ op(B) * a_scale
+ beta * C`` with its shape, operand types and majorness (``a_trans``: A stored as its transpose
[K, M]; ``b_trans``: B stored as [N, K]), leading dimensions, an optional device A-scale and the
epilogue. A backend answers ``supports(desc)`` with (ok, reason) and builds a plan object with
ctypes pointer fields ``a b c alpha beta`` that the engine rewrites per call, called as
``plan(handle)`` on a :class:`cupyffn.gemm.cublas.Handle` bound to the stream.

Backends, in the order :func:`build` tries them:

* ``cublas`` -- cublasGemmEx (:class:`cupyffn.gemm.cublas.Gemm`): fp32, fp16, bf16 operands, fp32 out.
* ``cublaslt`` -- cublasLtMatmul (:class:`cupyffn.gemm.cublaslt.LtMatmul`): also e4m3 operands ("TN" only,
  dimensions multiples of 16), device A/B scales; the algorithm is chosen once by cuBLASLt's heuristic.

A precision's form decides the descriptions (cupyffn/core/precision.py); :class:`PairGemm` is the
f16+e4m3 form's two products into one output, :class:`Sm90PairGemm` the same form as one launch of our sm90
kernel (cupyffn/gemm/sm90/launch.py PairLaunch) where the engine takes it (cupyffn/f32/plan.py SM90_PAIR_TOKENS).
:func:`build` with ``max_k`` runs a GEMM whose K exceeds it as :class:`KChunked` (cupyffn/gemm/ksplit.py).
"""

import ctypes
from dataclasses import dataclass, replace

from . import cublas, ksplit
from ..core import precision as P

#: Bytes per element of each operand type.
ITEMSIZE = {cublas.R_32F: 4, cublas.R_16F: 2, cublas.R_16BF: 2, cublas.R_8F_E4M3: 1}


@dataclass(frozen=True)
class GemmDesc:
    name: str
    m: int
    n: int
    k: int
    a_type: int
    b_type: int
    c_type: int = cublas.R_32F
    a_trans: bool = False
    b_trans: bool = False
    lda: int = None
    ldb: int = None
    ldc: int = None
    a_scale: int = None  # device pointer to one float, fixed for the plan's life
    epilogue: str = "none"


class Unsupported(ValueError):
    """No backend builds this GEMM; the message lists each backend's reason."""


#: cudaDataType of the operands each conversion format writes (cupyffn/core/precision.py FMT_*) for cublasGemmEx.
OPERAND_TYPE = {P.FMT_F32: cublas.R_32F, P.FMT_BF16: cublas.R_16BF, P.FMT_BF16X3: cublas.R_16BF,
                P.FMT_F16S: cublas.R_16F}


class _CublasBackend:
    name = "cublas"

    def supports(self, desc):
        if desc.epilogue != "none":
            return False, f"cublasGemmEx has no {desc.epilogue!r} epilogue"
        if desc.a_scale is not None:
            return False, "cublasGemmEx takes no operand scale"
        types = {desc.a_type, desc.b_type}
        if not types <= {cublas.R_32F, cublas.R_16F, cublas.R_16BF} or len(types) != 1:
            return False, f"cublasGemmEx here multiplies fp32, fp16 or bf16 pairs, not types {sorted(types)}"
        return True, ""

    def build(self, desc, device_id):
        return cublas.Gemm(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type, a_trans=desc.a_trans,
                            b_trans=desc.b_trans, lda=desc.lda, ldb=desc.ldb, ldc=desc.ldc, name=desc.name)


class _CublasLtBackend:
    name = "cublaslt"

    def supports(self, desc):
        if desc.epilogue != "none":
            return False, f"the cuBLASLt backend builds no {desc.epilogue!r} epilogue"
        from . import cublaslt

        return cublaslt.LtMatmul.supports(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type,
                                           desc.a_trans, desc.b_trans, desc.lda, desc.ldb, desc.ldc)

    def build(self, desc, device_id):
        from . import cublaslt

        try:
            return cublaslt.LtMatmul(desc.m, desc.n, desc.k, desc.a_type, desc.b_type, desc.c_type,
                                      a_trans=desc.a_trans, b_trans=desc.b_trans, lda=desc.lda, ldb=desc.ldb,
                                      ldc=desc.ldc, name=desc.name, a_scale=desc.a_scale, device_id=device_id)
        except cublaslt.LtUnsupported as e:  # no algorithm from the heuristic: a refusal, not a bug
            raise Unsupported(str(e)) from e


CUBLAS = _CublasBackend()
CUBLASLT = _CublasLtBackend()
BACKENDS = (CUBLAS, CUBLASLT)


def build(desc, device_id, backends=BACKENDS, max_k=None, one_ptr=None):
    """(plan, backend name) from the first backend that supports `desc` and builds it. A backend refuses by
    `supports()` or, at build, by raising Unsupported (cuBLASLt's heuristic); other errors propagate.

    `max_k`: run a GEMM whose K exceeds it as K-chunks (KChunked; `one_ptr`, a device pointer to 1.0f, is the beta
    of every chunk after the first). Every chunk length is built by the same backend."""
    pieces = ksplit.chunks(desc.k, max_k)
    if len(pieces) > 1:  # the chunks' operands keep the whole GEMM's rows: explicit leading dimensions
        desc = replace(desc, lda=desc.lda or (desc.m if desc.a_trans else desc.k),
                       ldb=desc.ldb or (desc.k if desc.b_trans else desc.n), ldc=desc.ldc or desc.n)
    lengths = sorted({length for _, length in pieces}) if len(pieces) > 1 else [desc.k]  # a plan per length
    reasons = []
    for backend in backends:
        parts = {}
        for length in lengths:
            part = replace(desc, k=length)
            ok, why = backend.supports(part)
            if not ok:
                break
            try:
                parts[length] = backend.build(part, device_id)
            except Unsupported as e:
                why = str(e)
                break
        else:
            if len(pieces) == 1:
                return parts[desc.k], backend.name
            if not one_ptr:
                raise ValueError(f"{desc.name}: a K-chunked GEMM needs one_ptr (a device pointer to 1.0f)")
            return KChunked(desc, parts, pieces, one_ptr), backend.name
        reasons.append(f"{backend.name}: {why}")
    raise Unsupported(f"no GEMM backend for {desc.name} (M={desc.m} N={desc.n} K={desc.k}): " + "; ".join(reasons))


class KChunked:
    """One GEMM summed over K in consecutive chunks (cupyffn/gemm/ksplit.py): a plan per chunk length, each chunk's
    operands offset along K, the first chunk with the caller's beta and the rest adding with beta = 1.

    It has the fields of the plans it wraps (``a b c alpha beta`` pointers, ``lda ldb ldc``), which the engine
    rewrites per call as for a single plan; each call hands them to the chunks' plans. No call graph
    (``indirect``): an engine with a chunked GEMM enqueues its launches one by one."""

    def __init__(self, desc, parts, pieces, one_ptr):
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        self.name, self.m, self.n, self.k = desc.name, desc.m, desc.n, desc.k
        self.chunks = tuple(pieces)
        self._parts = parts
        self._one = one_ptr
        first = parts[pieces[0][1]]
        self.a, self.b, self.c, self.alpha, self.beta = vp(), vp(), vp(), vp(), vp()
        self.lda, self.ldb, self.ldc = (i32(_value(getattr(first, f))) for f in ("lda", "ldb", "ldc"))
        # bytes from one K index to the next: along a row where K is contiguous, a row's stride where it is not
        self._a_item, self._a_by_row = ITEMSIZE[desc.a_type], desc.a_trans
        self._b_item, self._b_by_row = ITEMSIZE[desc.b_type], not desc.b_trans

    def offsets(self, k0):
        """Byte offsets of K index `k0` in A and B at the current leading dimensions."""
        a = k0 * self._a_item * (self.lda.value if self._a_by_row else 1)
        b = k0 * self._b_item * (self.ldb.value if self._b_by_row else 1)
        return a, b

    def __call__(self, handle):
        for k0, length in self.chunks:
            part = self._parts[length]
            da, db = self.offsets(k0)
            part.a.value, part.b.value, part.c.value = self.a.value + da, self.b.value + db, self.c.value
            part.alpha.value = self.alpha.value
            part.beta.value = self.beta.value if k0 == 0 else self._one
            for field in ("lda", "ldb", "ldc"):  # cuBLAS plans take them per call; cuBLASLt's are fixed at build
                mine, theirs = getattr(self, field), getattr(part, field)
                if isinstance(theirs, ctypes.c_int):
                    theirs.value = mine.value
                elif theirs != mine.value:
                    raise ValueError(f"{self.name}: {field} is fixed at {theirs} by its cuBLASLt plan, got {mine.value}")
            part(handle)


def _value(field):
    return field.value if isinstance(field, ctypes.c_int) else int(field)


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
    """The f16+e4m3 form as one sm90 kernel launch (a sm90.PairLaunch over the engine's fixed operands),
    behind a GEMM plan's call: ``plan(handle)`` runs on the stream the cuBLAS handle is bound to. Its output is set
    by set_output, whether it adds to it by set_beta."""

    def __init__(self, launch, name):
        self.launch, self.name = launch, name

    def __call__(self, handle):
        self.launch(handle.stream_ptr)


def chunk_count(plan):
    """How many K-chunks a GEMM plan runs (the most of its products': a PairGemm has two)."""
    parts = (plan.fp8, plan.f16) if isinstance(plan, PairGemm) else (plan,)
    return max(len(p.chunks) if isinstance(p, KChunked) else 1 for p in parts)


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
