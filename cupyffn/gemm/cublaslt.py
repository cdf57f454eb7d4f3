"""A thin ctypes binding to cuBLASLt, for the GEMMs cublasGemmEx cannot run: fp8 e4m3 operands, and the fused
epilogues of the biased 16-bit plans (bias, GELU with its input kept, GELU derivative, bias gradient).

It loads the libcublasLt that CuPy's libcublas itself links (same directory, same version), checks every
status (cublas.CublasError), and runs each GEMM as a prebuilt call: the matmul descriptor, the four
matrix layouts and the algorithm (cublasLtMatmulAlgoGetHeuristic, asked once) are made at build time, so
a call only rewrites pointers, allocates nothing and never synchronizes (CUDA-graph capturable). It runs
on a cublas.Handle: that handle's cuBLASLt handle (lt_handle), workspace and stream, so it is
stream-ordered with the handle's cublasGemmEx calls, which share the same workspace.
"""

import ctypes
import os
import threading

from . import cublas
from .cublas import OP_N, OP_T, R_8F_E4M3, R_16BF, R_16F, R_32F, WORKSPACE_BYTES, CublasError, check

# cublasLt.h values, passed as plain ints. Each is the same in the CUDA 12.9 (cuBLAS 12.9.2) and CUDA 13.1
# (cuBLAS 13.1.2) headers: cuBLASLt numbers these attributes explicitly and keeps them across versions (stable
# ABI). tests/test_cublaslt.py checks them against the installed header.
MATMUL_DESC_POINTER_MODE = 2
MATMUL_DESC_TRANSA = 3
MATMUL_DESC_TRANSB = 4
MATMUL_DESC_EPILOGUE = 7
MATMUL_DESC_BIAS_POINTER = 8
MATMUL_DESC_EPILOGUE_AUX_POINTER = 11
MATMUL_DESC_EPILOGUE_AUX_LD = 12
MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22
MATMUL_DESC_BIAS_DATA_TYPE = 26
MATMUL_DESC_A_SCALE_POINTER = 17
MATMUL_DESC_B_SCALE_POINTER = 18
MATMUL_DESC_FAST_ACCUM = 25
MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5
MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6
MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7
MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
POINTER_MODE_DEVICE = 1  # CUBLASLT_POINTER_MODE_DEVICE (= CUBLAS_POINTER_MODE_DEVICE)
COMPUTE_32F = cublas.COMPUTE_32F
COMPUTE_32F_FAST_TF32 = cublas.COMPUTE_32F_FAST_TF32

# cublasLtEpilogue_t, in cupyffn's row-major terms (LtMatmul runs C^T = B^T A^T, so cuBLASLt's "rows of D" are
# our columns N and its B operand is our A): BIAS adds bias[N] to every row; GELU_AUX(_BIAS) also writes the
# GELU's input to `aux` [M,N]; DGELU multiplies the product by GELU'(aux) (DGELU_BGRAD also writes the result's
# column sums, bias_grad[N]: grad_bias1 beside grad_linear1); BGRADB writes bias_grad[M] = the sum
# of our A operand over K (grad_bias = column sums of the [K,M] operand, e.g. grad_output over the tokens); BGRADA
# writes bias_grad[N] = the sum of our B operand over K (the same sums when the product is written transposed).
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4
EPILOGUE_GELU_AUX = 32 | 128
EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4
EPILOGUE_DGELU = 64 | 128
EPILOGUE_DGELU_BGRAD = 64 | 128 | 16
EPILOGUE_BGRADA = 256
EPILOGUE_BGRADB = 512
_EPILOGUES = {EPILOGUE_DEFAULT: "none", EPILOGUE_BIAS: "bias", EPILOGUE_GELU_AUX: "gelu_aux",
              EPILOGUE_GELU_AUX_BIAS: "gelu_aux_bias", EPILOGUE_DGELU: "dgelu", EPILOGUE_BGRADB: "bgrad_a",
              EPILOGUE_BGRADA: "bgrad_b", EPILOGUE_DGELU_BGRAD: "dgelu_bgrad"}
_NEEDS_BIAS = (EPILOGUE_BIAS, EPILOGUE_GELU_AUX_BIAS, EPILOGUE_BGRADB, EPILOGUE_BGRADA, EPILOGUE_DGELU_BGRAD)
_NEEDS_AUX = (EPILOGUE_GELU_AUX, EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU, EPILOGUE_DGELU_BGRAD)
R_8F_E5M2 = 29  # cudaDataType (library_types.h); recognised as fp8 by supports(), not otherwise used

#: The pointer alignment every chosen algorithm must accept (cuBLASLt's default assumption is 256 bytes).
ALIGNMENT = 16

_FP8 = (R_8F_E4M3, R_8F_E5M2)
_TYPE_NAMES = {R_32F: "fp32", R_16F: "fp16", R_16BF: "bf16", R_8F_E4M3: "e4m3", R_8F_E5M2: "e5m2"}
_OUT_TYPES = (R_32F, R_16F, R_16BF)


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: uint64_t data[8]."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtUnsupported(ValueError):
    """cuBLASLt cannot run this GEMM (a documented constraint, or no algorithm from its heuristic): fall back."""


_lib = None
_lib_lock = threading.Lock()
_query = {}  # device id -> cuBLASLt handle for heuristic queries (host-only work; never destroyed)


def _library_path():
    # libcublas needs libcublasLt, so the one it loaded is normally mapped already: that very copy.
    path = cublas.loaded_cublas_path("libcublasLt.so")
    if path is not None:
        return path
    blas = cublas.loaded_cublas_path()
    if blas is not None:
        folder, name = os.path.split(blas)
        same = os.path.join(folder, "libcublasLt.so" + name[len("libcublas.so"):])
        if os.path.exists(same):
            return same
        names = sorted(n for n in os.listdir(folder) if n.startswith("libcublasLt.so."))
        if names:
            return os.path.join(folder, names[0])
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return load_nvidia_dynamic_lib("cublasLt").abs_path


def library():
    """The cuBLASLt ctypes.CDLL, with the prototypes used here."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        cublas.library()  # CuPy's libcublas first: its libcublasLt is the one to take
        lib = ctypes.CDLL(_library_path())
        vp, i32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        pvp = ctypes.POINTER(vp)
        prototypes = {
            "cublasLtCreate": [pvp],
            "cublasLtMatmulDescCreate": [pvp, i32, i32],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, size],
            "cublasLtMatrixLayoutCreate": [pvp, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [pvp],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, size],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(HeuristicResult),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, size, vp],
        }
        for name, argtypes in prototypes.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = i32
        lib.cublasLtGetVersion.argtypes = []
        lib.cublasLtGetVersion.restype = size
        _lib = lib
        return _lib


def version():
    """cublasLtGetVersion(), e.g. 130102 (no GPU needed)."""
    return library().cublasLtGetVersion()


def lt_handle(handle):
    """The cuBLASLt handle (an int) of cuBLAS handle `handle` (a cublas.Handle), created on first use. Like the cuBLAS
    handle it lives as long as the pooled Handle, i.e. for the process: it is shared by every plan that takes this
    Handle, and a destroy at interpreter exit could run after the CUDA context is gone."""
    if handle.lt is None:
        handle.lt = create_handle(handle.device_id)
    return handle.lt


def create_handle(device_id):
    """A new cuBLASLt handle (int) made on `device_id` (lt_handle keeps one per cuBLAS handle)."""
    import cupy

    lib = library()
    h = ctypes.c_void_p()
    with cupy.cuda.Device(device_id):
        check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h.value


def _query_handle(device_id):
    with _lib_lock:
        h = _query.get(device_id)
    if h is None:
        h = create_handle(device_id)
        with _lib_lock:
            h = _query.setdefault(device_id, h)  # a racing thread's extra handle is simply unused
    return h


def lt_layouts(m, n, k, a_trans, b_trans, lda, ldb, ldc):
    """cuBLASLt's (column-major) view of row-major C[M,N] = op(A) @ op(B): it runs C^T = op(B)^T op(A)^T, so
    its A is our B and its B is our A. Returns (transa, transb, A layout, B layout, C layout), each layout the
    (rows, cols, ld) of the stored column-major matrix."""
    lt_a = (k, n, ldb) if b_trans else (n, k, ldb)  # B stored [N,K] row-major = [K,N] column-major
    lt_b = (m, k, lda) if a_trans else (k, m, lda)  # A stored [M,K] row-major = [K,M] column-major
    return (OP_T if b_trans else OP_N), (OP_T if a_trans else OP_N), lt_a, lt_b, (n, m, ldc)


def _type_name(t):
    return _TYPE_NAMES.get(t, f"cudaDataType {t}")


def _leading_dims(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc):
    """Validated (lda, ldb, ldc), defaults filled in as in cublas.Gemm; ValueError naming the bad argument."""
    for arg, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"LtMatmul: {arg} must be a positive int, got {v!r}")
    for arg, t, allowed in (("a_type", a_type, _TYPE_NAMES), ("b_type", b_type, _TYPE_NAMES),
                            ("c_type", c_type, _OUT_TYPES)):
        if t not in allowed:
            names = ", ".join(f"{v} ({_type_name(v)})" for v in allowed)
            raise ValueError(f"LtMatmul: {arg} must be one of {names}, got {t!r}")
    lda = lda if lda is not None else (m if a_trans else k)
    ldb = ldb if ldb is not None else (k if b_trans else n)
    ldc = ldc if ldc is not None else n
    for arg, ld, least, what in (("lda", lda, m if a_trans else k, "A's row length (M if a_trans else K)"),
                                 ("ldb", ldb, k if b_trans else n, "B's row length (K if b_trans else N)"),
                                 ("ldc", ldc, n, "N")):
        if not isinstance(ld, int) or isinstance(ld, bool) or ld < least:
            raise ValueError(f"LtMatmul: {arg} must be an int >= {what} = {least}, got {ld!r}")
    return lda, ldb, ldc


def describe(m, n, k, a_type, b_type, c_type, a_trans=False, b_trans=False, lda=None, ldb=None, ldc=None,
             name="gemm"):
    """One line naming the GEMM, its shape, types and storage (for errors and benchmark records)."""
    lda, ldb, ldc = _leading_dims(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc)
    return (f"{name}: M={m} N={n} K={k}, A {_type_name(a_type)} stored {'[K,M]' if a_trans else '[M,K]'} "
            f"lda={lda}, B {_type_name(b_type)} stored {'[N,K]' if b_trans else '[K,N]'} ldb={ldb}, "
            f"C {_type_name(c_type)} [M,N] ldc={ldc}")


def supports(m, n, k, a_type, b_type, c_type, a_trans=False, b_trans=False, lda=None, ldb=None, ldc=None):
    """(ok, reason): whether the GEMM meets cuBLASLt's fp8 constraints (both operands fp8, "TN" = A stored
    [M,K] K-contiguous and B stored [N,K], N, K and every leading dimension a multiple of 16). Measured on the
    H200 (cuBLAS 13.1): M = 40, 3142, 4904 run exactly; N = 3142 gets no algorithm from the heuristic.
    ok can still be followed by LtUnsupported from the heuristic. Invalid arguments raise ValueError."""
    lda, ldb, ldc = _leading_dims(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc)
    if a_type not in _FP8 and b_type not in _FP8:
        return True, ""
    problems = []
    if a_type not in _FP8 or b_type not in _FP8:
        problems.append(f"fp8 needs both operands fp8, got A {_type_name(a_type)} and B {_type_name(b_type)}")
    if a_trans or not b_trans:
        problems.append("fp8 needs A stored [M,K] (a_trans=False) and B stored [N,K] (b_trans=True), K contiguous "
                        f"in both (cuBLAS 'TN'), got a_trans={a_trans}, b_trans={b_trans}")
    bad = [f"{arg}={v}" for arg, v in (("N", n), ("K", k), ("lda", lda), ("ldb", ldb), ("ldc", ldc)) if v % 16]
    if bad:
        problems.append("fp8 needs N, K and the leading dimensions to be multiples of 16, got " + ", ".join(bad))
    return not problems, "; ".join(problems)


class LtMatmul:
    """One row-major GEMM ``C[M,N] = alpha * op(A) @ op(B) * a_scale * b_scale + beta * C`` as a prebuilt
    cublasLtMatmul call (D = C, in place), with cublas.Gemm's meaning of m, n, k, a_trans, b_trans, lda, ldb,
    ldc (row strides in elements; here fixed at build).

    Compute `compute` (CUBLAS_COMPUTE_32F, or COMPUTE_32F_FAST_TF32: fp32 operands rounded to TF32 on the tensor
    cores), fp32 accumulation, scale type fp32; alpha and beta are device pointers to one float each
    (rewritten per call, like the operand pointers `.a .b .c`, which must be 16-byte aligned). `a_scale`,
    `b_scale`: device pointers to one float each, fixed per plan (None: 1); cuBLASLt accepts them for fp8
    operands. With beta = 0, C is not read. Raises LtUnsupported when cuBLASLt cannot run the GEMM.

    `epilogue` (an EPILOGUE_* value, see there): its vectors and matrices are set per call with
    ``set_epilogue(bias=ptr, aux=ptr)`` (16-byte-aligned device pointers); `aux_ld` is the aux matrix's row
    stride (default N) and `aux_type` / `bias_type` their cudaDataType (default: cuBLASLt's, the output type).
    """

    supports = staticmethod(supports)  # LtMatmul.supports(m, n, k, a_type, ...) -> (ok, reason), as the module's

    def __init__(self, m, n, k, a_type, b_type, c_type, a_trans=False, b_trans=False, lda=None, ldb=None,
                 ldc=None, name="gemm", a_scale=None, b_scale=None, device_id=0, epilogue=EPILOGUE_DEFAULT,
                 aux_ld=None, aux_type=None, bias_type=None, compute=COMPUTE_32F):
        self._args = None
        self._layouts = []
        self._desc = ctypes.c_void_p()
        lda, ldb, ldc = _leading_dims(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc)
        self.name, self.m, self.n, self.k = name, m, n, k
        self.lda, self.ldb, self.ldc = lda, ldb, ldc
        self.device_id = device_id
        self.description = describe(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc, name)
        if epilogue not in _EPILOGUES:
            raise ValueError(f"LtMatmul: epilogue must be one of {sorted(_EPILOGUES)}, got {epilogue!r}")
        if epilogue != EPILOGUE_DEFAULT:
            self.description += f", epilogue {_EPILOGUES[epilogue]}"
        self.epilogue = epilogue
        self.aux_ld = (n if aux_ld is None else aux_ld) if epilogue in _NEEDS_AUX else None
        if self.aux_ld is not None and self.aux_ld < n:
            raise ValueError(f"LtMatmul: aux_ld must be >= N = {n}, got {aux_ld!r}")
        self._bias_ptr = self._aux_ptr = None
        ok, reason = supports(m, n, k, a_type, b_type, c_type, a_trans, b_trans, lda, ldb, ldc)
        if not ok:
            raise LtUnsupported(f"cuBLASLt cannot run {self.description}: {reason}")
        for label, ptr in (("a_scale", a_scale), ("b_scale", b_scale)):
            # Measured on the H200 (cuBLAS 13.1): a scale pointer off a 16-byte boundary builds, and the heuristic
            # offers an algorithm, but every cublasLtMatmul then fails with NOT_SUPPORTED.
            if ptr is not None and ptr % 16:
                raise ValueError(f"{label} must be a 16-byte-aligned device pointer (cuBLASLt refuses others at run "
                                 f"time); got {ptr:#x} for {self.description}")
        vp = ctypes.c_void_p
        self.a, self.b, self.c = vp(), vp(), vp()
        self.alpha, self.beta = vp(), vp()
        self._handle, self._workspace, self._stream = vp(), vp(), vp()
        self._call_name = f"cublasLtMatmul ({self.description})"
        lib = library()
        # Kept so close() needs no module globals (it may run from __del__ at interpreter exit).
        self._destroy_layout, self._destroy_desc = lib.cublasLtMatrixLayoutDestroy, lib.cublasLtMatmulDescDestroy
        self._matmul = lib.cublasLtMatmul
        try:
            self._build(lib, a_type, b_type, c_type, a_trans, b_trans, a_scale, b_scale, aux_type, bias_type, compute)
        except BaseException:
            self.close()
            raise

    def _build(self, lib, a_type, b_type, c_type, a_trans, b_trans, a_scale, b_scale, aux_type, bias_type, compute):
        what = self.description

        def set_desc(attr, value, label):
            check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                  f"cublasLtMatmulDescSetAttribute({label}) ({what})")

        transa, transb, lt_a, lt_b, lt_c = lt_layouts(self.m, self.n, self.k, a_trans, b_trans, self.lda, self.ldb,
                                                      self.ldc)
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), compute, R_32F),
              f"cublasLtMatmulDescCreate ({what})")
        set_desc(MATMUL_DESC_POINTER_MODE, ctypes.c_int32(POINTER_MODE_DEVICE), "POINTER_MODE")
        set_desc(MATMUL_DESC_TRANSA, ctypes.c_int32(transa), "TRANSA")
        set_desc(MATMUL_DESC_TRANSB, ctypes.c_int32(transb), "TRANSB")
        # cuBLASLt's A is our B (and its B our A); the scales are one scalar each, so only the names swap.
        if a_scale is not None:
            set_desc(MATMUL_DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale), "B_SCALE_POINTER")
        if b_scale is not None:
            set_desc(MATMUL_DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale), "A_SCALE_POINTER")
        if a_type in _FP8:
            set_desc(MATMUL_DESC_FAST_ACCUM, ctypes.c_int8(0), "FAST_ACCUM")  # off: keep fp32 accumulation
        if self.epilogue != EPILOGUE_DEFAULT:
            set_desc(MATMUL_DESC_EPILOGUE, ctypes.c_int32(self.epilogue), "EPILOGUE")
            # The heuristic reads the pointers' alignment from their values: a placeholder aligned to exactly
            # ALIGNMENT bytes makes it pick an algorithm that accepts any pointer set_epilogue allows.
            if self.epilogue in _NEEDS_BIAS:
                set_desc(MATMUL_DESC_BIAS_POINTER, ctypes.c_void_p(ALIGNMENT), "BIAS_POINTER")
                if bias_type is not None:
                    set_desc(MATMUL_DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_type), "BIAS_DATA_TYPE")
            if self.epilogue in _NEEDS_AUX:
                set_desc(MATMUL_DESC_EPILOGUE_AUX_POINTER, ctypes.c_void_p(ALIGNMENT), "EPILOGUE_AUX_POINTER")
                set_desc(MATMUL_DESC_EPILOGUE_AUX_LD, ctypes.c_int64(self.aux_ld), "EPILOGUE_AUX_LD")
                if aux_type is not None:
                    set_desc(MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, ctypes.c_int32(aux_type), "EPILOGUE_AUX_DATA_TYPE")
        self._set_desc = lib.cublasLtMatmulDescSetAttribute
        for dtype, (rows, cols, ld) in ((b_type, lt_a), (a_type, lt_b), (c_type, lt_c), (c_type, lt_c)):
            layout = ctypes.c_void_p()
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                  f"cublasLtMatrixLayoutCreate({rows}x{cols}, ld={ld}) ({what})")
            self._layouts.append(layout)
        self._algo, self.workspace_size, self.waves = self._heuristic(lib)
        la, lb, lc, ld = self._layouts
        self._args = (self._handle, self._desc, self.alpha, self.b, la, self.a, lb, self.beta, self.c, lc,
                      self.c, ld, ctypes.c_void_p(ctypes.addressof(self._algo)), self._workspace,
                      ctypes.c_size_t(WORKSPACE_BYTES), self._stream)

    def _heuristic(self, lib):
        what = self.description
        pref = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), f"cublasLtMatmulPreferenceCreate ({what})")
        try:
            prefs = [(MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES), "MAX_WORKSPACE_BYTES")]
            prefs += [(attr, ctypes.c_uint32(ALIGNMENT), f"MIN_ALIGNMENT_{x}_BYTES")
                      for attr, x in ((MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "A"), (MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "B"),
                                      (MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "C"), (MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "D"))]
            for attr, value, label in prefs:
                check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                      f"cublasLtMatmulPreferenceSetAttribute({label}) ({what})")
            result = HeuristicResult()
            count = ctypes.c_int(0)
            la, lb, lc, ld = self._layouts
            status = lib.cublasLtMatmulAlgoGetHeuristic(_query_handle(self.device_id), self._desc, la, lb, lc, ld,
                                                        pref, 1, ctypes.byref(result), ctypes.byref(count))
        finally:  # also on failure (then a failed destroy does not hide the first error)
            destroyed = lib.cublasLtMatmulPreferenceDestroy(pref)
        check(destroyed, f"cublasLtMatmulPreferenceDestroy ({what})")
        status_name = cublas.STATUS_NAMES.get(status, "unknown status")
        # NOT_SUPPORTED (15): no algorithm; INVALID_VALUE (7): cuBLASLt's answer to a type combination it lacks
        if status in (7, 15) or (status == 0 and (count.value < 1 or result.state != 0)):
            raise LtUnsupported(f"cuBLASLt has no algorithm for {what} (cublasLtMatmulAlgoGetHeuristic: "
                                f"{status_name} ({status}), {count.value} result(s), result state {result.state})")
        check(status, f"cublasLtMatmulAlgoGetHeuristic ({what})")
        return MatmulAlgo.from_buffer_copy(result.algo), result.workspaceSize, result.wavesCount

    def set_epilogue(self, bias=None, aux=None):
        """Point the epilogue at this call's bias (or bias gradient) vector and aux matrix (device pointers,
        16-byte aligned; only those the epilogue uses). A host-side descriptor update, made only on a change."""
        for ptr, needed, attr, label in ((bias, self.epilogue in _NEEDS_BIAS, MATMUL_DESC_BIAS_POINTER, "bias"),
                                         (aux, self.epilogue in _NEEDS_AUX, MATMUL_DESC_EPILOGUE_AUX_POINTER, "aux")):
            if not needed:
                if ptr is not None:
                    raise ValueError(f"LtMatmul {self.name!r}: its epilogue takes no {label} pointer")
                continue
            if not ptr or ptr % ALIGNMENT:
                raise ValueError(f"LtMatmul {self.name!r}: the {label} pointer must be a {ALIGNMENT}-byte-aligned "
                                 f"device address; got {ptr!r}")
            cached = "_bias_ptr" if label == "bias" else "_aux_ptr"
            if getattr(self, cached) != ptr:
                value = ctypes.c_void_p(ptr)
                check(self._set_desc(self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                      f"cublasLtMatmulDescSetAttribute({label}) ({self.description})")
                setattr(self, cached, ptr)

    def __call__(self, handle):
        """Enqueue on `handle` (a cublas.Handle: its cuBLASLt handle, workspace and bound stream)."""
        args = self._args
        if args is None:
            raise RuntimeError(f"LtMatmul {self.name!r} was closed")
        if handle.device_id != self.device_id:
            raise ValueError(f"LtMatmul {self.name!r} was built for device {self.device_id}, "
                             f"got a handle of device {handle.device_id}")
        self._handle.value = lt_handle(handle)
        self._workspace.value = handle.workspace.ptr
        self._stream.value = handle.stream_ptr
        status = self._matmul(*args)
        if status:
            raise CublasError(self._call_name, status)

    def close(self):
        """Destroy the descriptors (host objects: enqueued or captured calls do not use them). Idempotent."""
        self._args = None
        failed = []
        layouts, self._layouts = getattr(self, "_layouts", []), []
        for layout in layouts:
            status = self._destroy_layout(layout)
            if status:
                failed.append(("cublasLtMatrixLayoutDestroy", status))
        desc = getattr(self, "_desc", None)
        if desc is not None and desc.value:
            status = self._destroy_desc(desc)
            self._desc = ctypes.c_void_p()
            if status:
                failed.append(("cublasLtMatmulDescDestroy", status))
        if failed:
            raise CublasError(*failed[0])

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a failed destroy nobody can act on
            pass
