"""A thin ctypes binding to the cuBLAS library that CuPy itself loads.

CuPy's own wrappers (``cupy_backends.cuda.libs.cublas``) bind the handle to CuPy's current stream
on every call, which resets any user workspace, and they refuse CUDA-graph capture. cupyffn needs
both a stream and a workspace that stay put, and capture, so it calls the few cuBLAS entry points it
uses directly, on private handles, and checks every status.

Handles come from a per-device pool and are never destroyed (``cublasDestroy`` synchronizes the
device); each carries its own workspace, so two streams never share one (the cuBLAS docs require a
workspace per concurrently running stream).
"""

import ctypes
import threading

# cuBLAS enums (cublas_api.h), passed as plain ints.
OP_N = 0
OP_T = 1
POINTER_MODE_DEVICE = 1
DEFAULT_MATH = 0
COMPUTE_32F = 68
COMPUTE_32F_FAST_TF32 = 77  # fp32 operands rounded to TF32 on the tensor cores, fp32 accumulation
GEMM_DEFAULT = -1
# cudaDataType (library_types.h)
R_32F = 0
R_16F = 2
R_16BF = 14
R_8F_E4M3 = 28  # OCP E4M3 "fn" (cuBLASLt only: cublasGemmEx takes no fp8)

#: Workspace per handle: the size the cuBLAS docs recommend for Hopper.
WORKSPACE_BYTES = 32 << 20

STATUS_NAMES = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR",
}


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call, status):
        self.call = call
        self.status = status
        super().__init__(f"{call} failed with {STATUS_NAMES.get(status, 'unknown status')} ({status})")


def check(status, call):
    if status != 0:
        raise CublasError(call, status)


_lib = None
_lib_lock = threading.Lock()


def loaded_cublas_path(prefix="libcublas.so"):
    """Path of the libcublas (or, by `prefix`, e.g. libcublasLt) this process already has mapped (the one CuPy linked), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if line.count("/") else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def library():
    """The cuBLAS ctypes.CDLL, with the prototypes cupyffn uses."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        # Importing CuPy's wrapper module links libcublas into the process; take that very copy.
        from cupy_backends.cuda.libs import cublas as _cupy_cublas  # noqa: F401

        path = loaded_cublas_path()
        if path is None:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            path = load_nvidia_dynamic_lib("cublas").abs_path
        lib = ctypes.CDLL(path)
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        prototypes = {
            "cublasCreate_v2": [ctypes.POINTER(vp)],
            "cublasSetStream_v2": [vp, vp],
            "cublasSetWorkspace_v2": [vp, vp, ctypes.c_size_t],
            "cublasSetPointerMode_v2": [vp, i32],
            "cublasSetMathMode": [vp, i32],
            "cublasGetVersion_v2": [vp, ctypes.POINTER(i32)],
            "cublasGemmEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32,
                             i32, i32],
            "cublasGemmStridedBatchedEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, ctypes.c_longlong,
                                           vp, i32, i32, ctypes.c_longlong, vp, vp, i32, i32,
                                           ctypes.c_longlong, i32, i32, i32],
            "cublasGemmBatchedEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32,
                                    i32, i32, i32],
        }
        for name, argtypes in prototypes.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = i32
        _lib = lib
        return _lib


class Handle:
    """A private cuBLAS handle with its own workspace, device pointer mode and default math."""

    def __init__(self, device_id):
        import cupy

        lib = library()
        self.device_id = device_id
        self.ptr = ctypes.c_void_p()
        with cupy.cuda.Device(device_id):
            check(lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
            self.workspace = cupy.cuda.alloc(WORKSPACE_BYTES)
        check(lib.cublasSetPointerMode_v2(self.ptr, POINTER_MODE_DEVICE), "cublasSetPointerMode")
        check(lib.cublasSetMathMode(self.ptr, DEFAULT_MATH), "cublasSetMathMode")
        self.stream_ptr = None
        self.lt = None  # its cuBLASLt handle, created by cublaslt.lt_handle on first use

    def bind(self, stream_ptr):
        """Route this handle's work to `stream_ptr`. cublasSetStream resets the workspace, so set it again."""
        if stream_ptr == self.stream_ptr:
            return
        lib = library()
        check(lib.cublasSetStream_v2(self.ptr, stream_ptr), "cublasSetStream")
        check(lib.cublasSetWorkspace_v2(self.ptr, self.workspace.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
        self.stream_ptr = stream_ptr

    def version(self):
        v = ctypes.c_int()
        check(library().cublasGetVersion_v2(self.ptr, ctypes.byref(v)), "cublasGetVersion")
        return v.value


_pool = {}
_pool_lock = threading.Lock()


def acquire(device_id):
    """A handle for `device_id`, from the pool or new."""
    with _pool_lock:
        free = _pool.setdefault(device_id, [])
        if free:
            return free.pop()
    return Handle(device_id)


def release(handle):
    """Return `handle` to the pool. Its last work must have finished (GpuEngine.close waits for it)."""
    with _pool_lock:
        _pool.setdefault(handle.device_id, []).append(handle)


class Gemm:
    """One row-major GEMM ``C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C`` as a prebuilt cublasGemmEx call.

    Row-major matrices are column-major transposes, so this issues ``C^T = op(B)^T op(A)^T``.
    `a_trans` means A is stored as its transpose, a row-major [K, M] with row stride `lda`;
    likewise `b_trans` for B ([N, K]). Pointers are ctypes fields the plan rewrites per call.
    alpha and beta are device pointers (the handles use device pointer mode). `compute`: the cublasComputeType
    (COMPUTE_32F, or COMPUTE_32F_FAST_TF32 for fp32 operands on the TF32 tensor cores).
    """

    def __init__(self, m, n, k, a_type, b_type, c_type, a_trans=False, b_trans=False,
                 lda=None, ldb=None, ldc=None, name="gemm", compute=COMPUTE_32F):
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        self.name = name
        self.m, self.n, self.k = m, n, k
        self.a, self.b, self.c = vp(), vp(), vp()
        self.alpha, self.beta = vp(), vp()
        self.handle = vp()
        self.lda = i32(lda if lda is not None else (m if a_trans else k))
        self.ldb = i32(ldb if ldb is not None else (k if b_trans else n))
        self.ldc = i32(ldc if ldc is not None else n)
        self._args = (self.handle, i32(OP_T if b_trans else OP_N), i32(OP_T if a_trans else OP_N),
                      i32(n), i32(m), i32(k), self.alpha, self.b, i32(b_type), self.ldb,
                      self.a, i32(a_type), self.lda, self.beta, self.c, i32(c_type), self.ldc,
                      i32(compute), i32(GEMM_DEFAULT))

    def __call__(self, handle):
        self.handle.value = handle.ptr.value
        check(library().cublasGemmEx(*self._args), f"cublasGemmEx ({self.name}: M={self.m} N={self.n} K={self.k})")

    def indirect(self, handle, table):
        """The same product as cublasGemmBatchedEx of one matrix, its operands' addresses read on the GPU from
        `table`, a device array of three pointers [A, B, C] (row-major roles), when the kernel runs: a CUDA graph
        replaying this GEMM follows whatever the table holds then (cupyffn/cuda/call_graph.py). alpha, beta as set."""
        a = list(self._args)
        a[0] = handle.ptr
        # the column-major call's A is our B (see the class docstring); pointer arrays of one entry each
        a[7], a[10], a[14] = ctypes.c_void_p(table + 8), ctypes.c_void_p(table), ctypes.c_void_p(table + 16)
        check(library().cublasGemmBatchedEx(*a[:17], ctypes.c_int(1), *a[17:]),
              f"cublasGemmBatchedEx ({self.name}: M={self.m} N={self.n} K={self.k})")
