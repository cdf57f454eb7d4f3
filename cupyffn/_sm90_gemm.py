"""Launcher of the Hopper (sm_90a) GEMM in ``kernels_cu/gemm_sm90.cu``: C = A @ B^T (B K-major) or A @ B.

The engine runs it as the fused GEMM1 + dgelu of the tf32 and bf16x3 plans (:class:`DgeluLaunch`,
cupyffn/_gpu_engine.py);
the validating functions below are for tests, tools and direct use. What they compute:

* :func:`gemm_tn` -- ``out[M, N] (fp32) = a[M, K] @ b[N, K]^T``, or ``a @ b`` of a b[K, N] (N contiguous, a
  weight as stored) with ``b_layout="kn"``;
* :func:`gemm_tn_dgelu` -- GEMM1 with the GELU derivative in its epilogue (x and t staged through
  shared memory by cp.async during the mainloop where their rows start on 16-byte boundaries, else, or
  with ``epilogue="direct"``, loaded in the epilogue):
  ``out = acc * gelu'(linear1_out, tanh_inner)`` rounded to bf16 (``out.dtype == uint16``, bf16
  bit patterns), or split into three bf16 planes (hi, lo, hi) side by side in each row (``planes=3``,
  out [M, 3N]: the bf16x3 plan's grad_linear1), or rounded to fp16 after scaling by a power of two
  ``alpha`` (``out.dtype == float16``); ``tanh_inner=None`` recomputes t from linear1_out (memory mode).

Operands ``a`` and ``b`` are 16-bit: ``float16`` arrays, or bf16 bit patterns in ``uint16`` arrays
(CuPy has no bfloat16 dtype). Constraints (checked, ValueError otherwise): K >= 1; a and b contiguous
along their last dimension (a: K; b: K for "nk", N for "kn") with row strides a multiple of 8 elements (16 bytes, for the TMA unit) and 16-byte-aligned data;
out, linear1_out and tanh_inner row-contiguous with even row strides and 16-byte-aligned data; out
overlapping no input. M, N and K need not be multiples of the tile: the TMA unit zero-fills what lies
outside A and B, and the epilogue stores only in-bounds elements.

Each kernel variant is compiled on first use (its own :class:`cupy.RawModule`, NVRTC) with ``-arch=sm_90a`` (wgmma and
setmaxnreg exist only there; CuPy appends its own ``-arch=sm_90``, and NVRTC then still compiles for
sm_90a: a plain sm_90 pass would reject wgmma, so a successful build is an sm_90a one). The TMA
descriptors (CUtensorMap, 128 opaque bytes) are encoded by ``cuTensorMapEncodeTiled`` from
libcuda through ctypes, cached per (address, shape, stride, tile), and passed by value as
``__grid_constant__`` kernel parameters.
"""

import collections
import ctypes
import functools
import math
import threading

from cupyffn import _kernels, _libcuda

#: Source file in kernels_cu/ (compiled for sm_90a only; not one of _kernels.MODULES, which build for any GPU).
SOURCE = "gemm_sm90.cu"
#: The staged epilogue's shape (CUPYFFN_XT_COLS, CUPYFFN_XS_STAGE_DROP in gemm_sm90.cu): columns of an x/t
#: group, and the pipeline stages given up for the slots. Chosen by measurement
#: (docs/decisions/027-xt-whole-row-segments.md); dev/sm90_gemm_bench.py can try others through set_staging()
#: before anything is compiled.
XT_COLS = 32
XS_STAGE_DROP = 1
#: Measurement hook (dev/sm90_trace.py, set_trace): compile with CUPYFFN_SM90_TRACE, the per-tile timestamps.
TRACE = False
#: With TRACE, what the kernel leaves out (CUPYFFN_SM90_EPI_PROBE): 0 nothing, 1 the epilogue's global stores, 2 its
#: x/t copies, 3 the mainloop's wgmma (the stages still flow: data movement alone); b_layout "kn32": 4 the converter
#: warps' conversion (they only pass each stage on), 5 their proxy fence; 6 gives the 16-bit layouts' 128 x 128 tiles
#: kn32's (shallower) pipeline.
PROBE = 0
#: The epilogue warps' pipeline stages and x/t items per warp (CUPYFFN_EW_STAGES, CUPYFFN_EW_RING in gemm_sm90.cu);
#: set_ew() can try others before anything is compiled.
EW_STAGES = 4
EW_RING = 2


def nvrtc_options():
    """NVRTC options; CuPy adds its include paths and its own -arch (see the module docstring)."""
    return (("-arch=sm_90a", "--std=c++17", f"-DCUPYFFN_XT_COLS={XT_COLS}", f"-DCUPYFFN_XS_STAGE_DROP={XS_STAGE_DROP}",
             f"-DCUPYFFN_EW_STAGES={EW_STAGES}", f"-DCUPYFFN_EW_RING={EW_RING}")
            + (("-DCUPYFFN_SM90_TRACE=1", f"-DCUPYFFN_SM90_EPI_PROBE={PROBE}") if TRACE else ()))


def _before_first_compile(hook):
    """The measurement hooks change the compile options of every variant: only before any is compiled."""
    if _module.cache_info().currsize:
        raise RuntimeError(f"{hook} must come before the first sm90 kernel is compiled in this process")


def set_trace(enabled, probe=0):
    """Measurement hook: compile every variant with the per-tile timestamps of gemm_sm90.cu (CUPYFFN_SM90_TRACE;
    the kernels then store them wherever the module's global ``cupyffn_sm90_trace`` points, nowhere if null), and
    with `probe` 1 or 2 a dgelu epilogue without its global stores or without its x/t copies, with 3 a mainloop
    that waits for and releases every stage but issues no wgmma, with 4 or 5 (b_layout "kn32") converter warps that
    convert nothing or skip their proxy fence: WRONG RESULTS, for timing parts of the kernel only; with 6 the 16-bit
    layouts' 128 x 128 tiles run with kn32's pipeline depth (right results). Only before the first kernel of this
    process is compiled."""
    global TRACE, PROBE
    _before_first_compile("set_trace")
    if probe not in (0, 1, 2, 3, 4, 5, 6) or (probe and not enabled):
        raise ValueError(f"probe must be 0 ... 6, and only with the trace enabled; got {probe!r}, {enabled!r}")
    TRACE, PROBE = bool(enabled), probe


def set_staging(xt_cols, stage_drop):
    """Measurement hook: compile the staged epilogue with groups of `xt_cols` columns (8, 16, 32) and
    `stage_drop` stages given up (1 or 2). Only before the first kernel of this process is compiled."""
    global XT_COLS, XS_STAGE_DROP
    _before_first_compile("set_staging")
    if xt_cols not in (8, 16, 32) or stage_drop not in (1, 2):
        raise ValueError(f"xt_cols must be 8, 16 or 32 and stage_drop 1 or 2, got {xt_cols}, {stage_drop}")
    XT_COLS, XS_STAGE_DROP = xt_cols, stage_drop


def set_ew(stages, ring):
    """Measurement hook: compile the epilogue warps (epilogue WARPS) with `stages` pipeline stages and `ring` x/t
    items per warp (the shared memory must hold them: ew_smem_bytes). Only before the first kernel is compiled."""
    global EW_STAGES, EW_RING
    if not (2 <= stages <= 4 and ring >= 1 and ew_smem_bytes(stages, ring) <= 232448):
        raise ValueError(f"stages 2-4 and a ring that fits in 227 KiB, got {stages}, {ring}")
    _before_first_compile("set_ew")
    EW_STAGES, EW_RING = stages, ring

# Must match gemm_sm90.cu.
THREADS = 384
#: Threads of a block with the epilogue warps (staged = 2): a fourth warpgroup of epilogue warps (kEwThreads).
EW_THREADS = 512
BLOCK_M = 128
BLOCK_K = 64
BLOCK_NS = (128, 256)
OP_F16 = 0
OP_BF16 = 1
OP_F16E4M3 = 2  # the fp16+fp8 pair in one kernel (gemm_sm90_pair_kernel); its tensor maps of e4m3 bytes: OP_E4M3
OP_E4M3 = 100   # not a kernel operand code: the tensor-map kind of the pair's 8-bit operands (encode_tensor_map)
OP_F32 = 101    # not a kernel operand code: the tensor-map kind of a "kn32" b (fp32, unswizzled, encode_tensor_map)
EPI_F32 = 0
EPI_DGELU_BF16 = 1
EPI_DGELU_F16 = 2
EPI_DGELU_BF16X3 = 3  # three bf16 planes (hi, lo, hi) side by side in a row: the bf16x3 plan's grad_linear1
EPI_DGELU_F16G = 4  # EPI_DGELU_F16 and gelu_out = 0.5 x (1 + t) as fp16 codes too: GEMM2's operand, from GEMM1's epilogue

#: (block_n, pingpong) schedules: cooperative 128x128 and 128x256 tiles, ping-pong 128x128 (see gemm_sm90.cu).
CONFIGS = ((128, False), (256, False), (128, True))
#: How a dgelu epilogue reads linear1_out and tanh_inner (gemm_sm90.cu, template parameter XS):
#: "staged" (cp.async into shared memory, requested during the mainloop) or "direct" (global loads in
#: the epilogue, the first version; kept to compare and as a fallback).
EPILOGUES = ("staged", "direct")
#: A third epilogue for one schedule: "warps" (XS = 2 in gemm_sm90.cu) hands each accumulator tile through shared
#: memory to seven epilogue warps (512 threads: EW_THREADS), which run the dgelu epilogue while the consumers compute
#: the next tile: one-plane dgelu epilogues on the cooperative 128 x 128 tile (WARPS_CONFIG), b_layout "nk" or "kn", either
#: cluster size, rows of linear1_out / tanh_inner on 16-byte boundaries as "staged" needs.
WARPS = "warps"
WARPS_CONFIG = (128, False)
_XS = {"direct": 0, "staged": 1, WARPS: 2}


#: How a 16-bit b is laid out: "nk" ([N, K], K contiguous: both operands K-major) or "kn" ([K, N], N contiguous:
#: a weight as stored, read MN-major by wgmma; template parameter BT in gemm_sm90.cu).
B_LAYOUTS = ("nk", "kn")
#: gemm_tn / gemm_tn_dgelu also take b_layout KN32: b float32 [K, N], converted to fp16 inside the kernel (fp16 a
#: only; the codes of b * b_scale as convert.cu rounds them, never written to global memory; BT = 2).
KN32 = "kn32"
_BT = {"nk": 0, "kn": 1, KN32: 2}
#: The schedules with b_layout "kn32" (its fp32 tiles need the room of a 128 x 256 tile's stages).
KN32_CONFIGS = ((128, False), (128, True))
#: CTAs per cluster: 1 (gemm_sm90_kernel) or 2 (gemm_sm90_cluster2_kernel: two vertically adjacent tiles share
#: their B tile through TMA multicast, see gemm_sm90.cu).
CLUSTERS = (1, 2)
_KERNEL_NAMES = {1: "gemm_sm90_kernel", 2: "gemm_sm90_cluster2_kernel"}


#: The one (epilogue, block_n, pingpong) without a staged variant: EPI_DGELU_F16G on the 128 x 256 cooperative tile
#: spills there (128 accumulators per thread and two outputs; tests/test_kernels_compile.py fails on spills). The
#: engine takes the 128 x 128 ping-pong tile instead (choose_config), gemm_tn_dgelu the direct epilogue.
GELU_NO_STAGED = (EPI_DGELU_F16G, 256, False)
#: Dgelu epilogues that exist for one operand type only.
_OWN_EPILOGUES = {OP_F16: (EPI_DGELU_F16G,), OP_BF16: (EPI_DGELU_BF16X3,)}


def _variants():
    for cl in CLUSTERS:
        for bt in (0, 1):
            for op in (OP_F16, OP_BF16):
                for bn, pp in CONFIGS:
                    yield op, bn, EPI_F32, pp, False, bt, cl
                    for epi in (EPI_DGELU_BF16, EPI_DGELU_F16) + _OWN_EPILOGUES[op]:
                        for staged in (False, True):
                            if not (staged and (epi, bn, pp) == GELU_NO_STAGED):
                                yield op, bn, epi, pp, staged, bt, cl
    for cl in CLUSTERS:  # the epilogue warps (XS = 2)
        for bt in (0, 1):
            for op in (OP_F16, OP_BF16):
                for epi in (EPI_DGELU_BF16, EPI_DGELU_F16) + tuple(e for e in _OWN_EPILOGUES[op] if e != EPI_DGELU_BF16X3):
                    yield op, WARPS_CONFIG[0], epi, WARPS_CONFIG[1], 2, bt, cl
    for bn, pp in KN32_CONFIGS:  # b converted in the kernel: fp32 out, and the tf32 plan's GEMM1 epilogue
        yield OP_F16, bn, EPI_F32, pp, False, 2, 1
        for staged in (False, True):
            yield OP_F16, bn, EPI_DGELU_F16, pp, staged, 2, 1


#: How the pair kernel's fp16 A is laid out: "mk" ([M, K], K contiguous) or "km" ([K, M], M contiguous: grad_output /
#: grad_linear1 as stored, the A of the weight gradients; template parameter TA in gemm_sm90.cu).
A_LAYOUTS = ("mk", "km")


def pair_expression(block_n, pingpong, a_layout="mk", b_layout="nk"):
    """The name expression of one variant of the fp16+fp8 pair kernel (gemm_sm90_pair_kernel)."""
    return (f"gemm_sm90_pair_kernel<{block_n}, {int(pingpong)}, {A_LAYOUTS.index(a_layout)}, "
            f"{B_LAYOUTS.index(b_layout)}>")


EXPRESSIONS = (tuple(f"{_KERNEL_NAMES[cl]}<{op}, {bn}, {epi}, {int(pp)}, {int(xs)}, {bt}>"
                     for op, bn, epi, pp, xs, bt, cl in _variants())
               + tuple(pair_expression(bn, pp, al, bl) for bn, pp in CONFIGS for al in A_LAYOUTS for bl in B_LAYOUTS))
# every variant; each compiled on first use


def stage_bytes(block_n, bt=0):
    """Bytes of one pipeline stage (stage_bytes_for in gemm_sm90.cu): the 16-bit tiles, and with bt = 2 ("kn32")
    the fp32 tile of B they are converted from."""
    return (BLOCK_M + block_n) * BLOCK_K * 2 + (block_n * BLOCK_K * 4 if bt == 2 else 0)


def _bars(bt):
    """mbarriers per stage (bars_for)."""
    return 3 if bt == 2 else 2


def stages_for(block_n, bt=0):
    """Pipeline stages (stages_for in gemm_sm90.cu): as many as fit in 192 KiB."""
    return (192 * 1024) // stage_bytes(block_n, bt)


def smem_bytes(block_n, bt=0):
    """Dynamic shared memory of one CTA (smem_bytes_for in gemm_sm90.cu)."""
    s = stages_for(block_n, bt)
    return s * stage_bytes(block_n, bt) + 1024 + _bars(bt) * 8 * s


def xt_slot_bytes():
    """Bytes of one x/t slot of the staged epilogue (kXtSlotBytes in gemm_sm90.cu): x and t of a
    64 x XT_COLS group (4 warps x 16 rows)."""
    return 2 * 64 * XT_COLS * 4


def xs_stages_for(block_n, bt=0):
    """Pipeline stages with the staged epilogue (xs_stages_for): XS_STAGE_DROP fewer, to make room for the slots."""
    return stages_for(block_n, bt) - XS_STAGE_DROP


def xt_slots_for(block_n, bt=0):
    """x/t slots per consumer of the staged epilogue (xt_slots_for): what is left of 224 KiB, halved."""
    return (224 * 1024 - xs_stages_for(block_n, bt) * stage_bytes(block_n, bt)) // (2 * xt_slot_bytes())


def xs_smem_bytes(block_n, bt=0):
    """Dynamic shared memory of one CTA with the staged epilogue (xs_smem_bytes_for in gemm_sm90.cu)."""
    s = xs_stages_for(block_n, bt)
    return s * stage_bytes(block_n, bt) + 2 * xt_slots_for(block_n, bt) * xt_slot_bytes() + 1024 + _bars(bt) * 8 * s


def ew_smem_bytes(stages=None, ring=None):
    """Dynamic shared memory of one CTA with the epilogue warps (ew_smem_bytes_for in gemm_sm90.cu): EW_STAGES stages
    of the 128 x 128 tile, the fp32 accumulator tile and 7 warps' rings of EW_RING items of 2 KiB."""
    stages = EW_STAGES if stages is None else stages
    ring = EW_RING if ring is None else ring
    return stages * stage_bytes(128) + BLOCK_M * 128 * 4 + 7 * ring * 2048 + 1024 + 8 * (2 * stages + 2)


def threads_for(staged):
    """Threads per block of a variant (its XS: 0 direct, 1 staged, 2 the epilogue warps)."""
    return EW_THREADS if int(staged) == 2 else THREADS


def launch_smem_bytes(block_n, staged, b_layout="nk"):
    """Dynamic shared memory a launch of that variant needs (the kernel traps if given less; the same
    for both schedules). staged: the XS of the variant (False/0 direct, True/1 staged, 2 the epilogue warps)."""
    bt = _BT[b_layout]
    if int(staged) == 2:
        return ew_smem_bytes()
    return xs_smem_bytes(block_n, bt) if staged else smem_bytes(block_n, bt)


class TmaDesc(ctypes.Structure):
    """Mirror of ``struct TmaDesc`` (a CUtensorMap: 128 opaque bytes)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


class GemmArgs(ctypes.Structure):
    """Mirror of ``struct GemmArgs`` in gemm_sm90.cu (176 bytes)."""

    _fields_ = [
        ("c", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("t", ctypes.c_void_p),
        ("ldc", ctypes.c_longlong),
        ("ldx", ctypes.c_longlong),
        ("ldt", ctypes.c_longlong),
        ("m", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("alpha", ctypes.c_float),
        ("amax", ctypes.c_void_p),
        ("acc_scale", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("consts", ctypes.c_void_p),
        ("slot", ctypes.c_int),
        ("rescue", ctypes.c_int),
        ("alpha_mask", ctypes.c_int),
        ("xt_pairs", ctypes.c_int),
        ("raster", ctypes.c_int),
        ("pair_scale", ctypes.c_float),
        ("k8", ctypes.c_int),
        ("accumulate", ctypes.c_int),
        ("g", ctypes.c_void_p),
        ("ldg", ctypes.c_longlong),
        ("g_amax", ctypes.c_void_p),
        ("g_slot", ctypes.c_int),
        ("g_alpha", ctypes.c_float),
        ("b_amax", ctypes.c_void_p),
        ("b_slot", ctypes.c_int),
        ("b_alpha", ctypes.c_float),
    ]

    def __init__(self, *args, **kwargs):
        # b_layout "kn32": b's scale is b_alpha unless a b_slot >= 0 names a slot of the state
        kwargs.setdefault("b_slot", -1)
        kwargs.setdefault("b_alpha", 1.0)
        super().__init__(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def module_source():
    """gemm_sm90.cu with common.cuh pasted in (_kernels.source_with_common)."""
    return _kernels.source_with_common(SOURCE)


def device_supported(device_id):
    """True on compute capability 9.0 (H100, H200): the sm_90a code runs only there."""
    import cupy

    return cupy.cuda.Device(device_id).compute_capability == "90"


def expression(op, block_n, epi, pingpong, staged=False, b_layout="nk", cluster=1):
    """The name expression of one kernel variant (one of EXPRESSIONS)."""
    return f"{_KERNEL_NAMES[cluster]}<{op}, {block_n}, {epi}, {int(pingpong)}, {int(staged)}, {_BT[b_layout]}>"


@functools.lru_cache(maxsize=None)
def _module(name, device_id):
    """One RawModule per variant, compiled on first use: NVRTC takes ~0.3-3 s per variant (~30 s for
    all 30 at once), and a caller needs a few; CuPy's disk cache keeps each one for the next process."""
    import cupy

    if not device_supported(device_id):
        cc = cupy.cuda.Device(device_id).compute_capability
        raise RuntimeError(f"the sm_90a GEMM needs a compute capability 9.0 GPU; device {device_id} has {cc}")
    if name not in EXPRESSIONS:
        raise ValueError(f"unknown sm90 GEMM variant {name!r}; one of {EXPRESSIONS}")
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=module_source(), options=nvrtc_options(), name_expressions=(name,))
        module.compile()
    return module


@functools.lru_cache(maxsize=None)
def _function(name, device_id, smem):
    """The kernel `name` (one of EXPRESSIONS), compiled, allowed `smem` bytes of dynamic shared memory."""
    import cupy
    from cupy_backends.cuda.api import driver

    module = _module(name, device_id)
    with cupy.cuda.Device(device_id):
        kernel = module.get_function(name)
        # above 48 KiB of dynamic shared memory needs the opt-in, on the very function we launch
        driver.funcSetAttribute(kernel.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
    return kernel


def _kernel(op, block_n, epi, pingpong, device_id, staged=False, b_layout="nk", cluster=1):
    return _function(expression(op, block_n, epi, pingpong, staged, b_layout, cluster), device_id,
                     launch_smem_bytes(block_n, staged, b_layout))


def _pair_kernel(block_n, pingpong, a_layout, b_layout, device_id):
    return _function(pair_expression(block_n, pingpong, a_layout, b_layout), device_id, smem_bytes(block_n))


# ---- tensor maps --------------------------------------------------------------------------------
_CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
_CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
_CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7
_CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
_CU_TENSOR_MAP_INTERLEAVE_NONE = 0
_CU_TENSOR_MAP_SWIZZLE_NONE = 0
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
_CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros

class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), for cuOccupancyMaxActiveClusters; no attributes: the cluster shape is the
    kernel's own (__cluster_dims__)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def max_active_clusters(function_ptr, smem, cluster, threads=THREADS):
    """How many clusters of `cluster` CTAs of the kernel `function_ptr` (CUfunction) with `smem` bytes of dynamic
    shared memory the GPU runs at once (cuOccupancyMaxActiveClusters: a cluster's CTAs must share a GPC, so this
    can be below sm_count / cluster)."""
    occupancy = _libcuda.function("cuOccupancyMaxActiveClusters", [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                   ctypes.POINTER(_LaunchConfig)])
    config = _LaunchConfig((cluster, 1, 1), (threads, 1, 1), smem, None, None, 0)
    count = ctypes.c_int()
    status = occupancy(ctypes.byref(count), ctypes.c_void_p(function_ptr), ctypes.byref(config))
    detail = f", count {count.value}, for clusters of {cluster} with {smem} bytes of shared memory"
    _libcuda.check(status, "cuOccupancyMaxActiveClusters", detail)
    if count.value < 1:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters returned no cluster{detail}")
    return count.value


class _AlignedDesc:
    """A TmaDesc on a 64-byte boundary (CUtensorMap is declared alignas(64)); keeps its buffer alive."""

    def __init__(self):
        self._buffer = (ctypes.c_uint8 * (ctypes.sizeof(TmaDesc) + 64))()
        offset = (-ctypes.addressof(self._buffer)) % 64
        self.desc = TmaDesc.from_buffer(self._buffer, offset)


def encode_tensor_map(ptr, rows, cols, row_stride_bytes, op, box_rows, box_cols=None):
    """CUtensorMap of a [rows, cols] row-major matrix at `ptr`, 128-byte swizzle, boxes of box_rows rows x 128
    bytes: 64 16-bit elements (op OP_F16, OP_BF16) or 128 bytes (OP_E4M3); or (op OP_F32) float32 elements,
    unswizzled, in boxes of box_rows x box_cols (a "kn32" b's stage: 64 K-rows x block_n, converted in the kernel)."""
    encode = _libcuda.function("cuTensorMapEncodeTiled", [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    holder = _AlignedDesc()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
    if op == OP_F32:
        box_inner = box_cols
    else:
        box_inner = 2 * BLOCK_K if op == OP_E4M3 else BLOCK_K
    box = (ctypes.c_uint32 * 2)(box_inner, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    dtype = {OP_F16: _CU_TENSOR_MAP_DATA_TYPE_FLOAT16, OP_BF16: _CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             OP_E4M3: _CU_TENSOR_MAP_DATA_TYPE_UINT8, OP_F32: _CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[op]
    swizzle = _CU_TENSOR_MAP_SWIZZLE_NONE if op == OP_F32 else _CU_TENSOR_MAP_SWIZZLE_128B
    status = encode(ctypes.addressof(holder.desc), dtype, 2, ctypes.c_void_p(ptr), dims, strides, box, elem,
                    _CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, _CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    _CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _libcuda.check(status, "cuTensorMapEncodeTiled",
                   f" for a [{rows}, {cols}] matrix, row stride {row_stride_bytes} bytes, box [{box_rows}, {box[0]}]")
    return holder


class _MapCache:
    """Tensor maps by everything they encode, so a hit is the very descriptor a fresh encode would give
    (a freed and reused address with the same shape is the same descriptor). Bounded, LRU."""

    def __init__(self, size=256):
        self._size = size
        self._maps = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, *key):
        with self._lock:
            holder = self._maps.get(key)
            if holder is not None:
                self._maps.move_to_end(key)
                return holder
        holder = encode_tensor_map(*key)
        with self._lock:
            self._maps[key] = holder
            while len(self._maps) > self._size:
                self._maps.popitem(last=False)
        return holder


_maps = _MapCache()


# ---- validation ---------------------------------------------------------------------------------
def _operand_code(dtype, name):
    import numpy

    if dtype == numpy.float16:
        return OP_F16
    if dtype == numpy.uint16:
        return OP_BF16
    raise ValueError(f"{name} must be float16 (fp16) or uint16 (bf16 bit patterns), got {dtype}")


def _check_matrix(x, name, shape, dtype=None, row_multiple=2):
    """x is a 2-D CuPy array of `shape`, row-contiguous, 16-byte aligned, row stride a multiple of
    `row_multiple` elements; returns its row stride in elements."""
    import cupy
    import numpy

    if not isinstance(x, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    if x.ndim != 2 or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must be {numpy.dtype(dtype).name}, got {x.dtype}")
    item = x.dtype.itemsize
    if x.size and x.shape[1] > 1 and x.strides[1] != item:  # CuPy gives empty arrays zero strides
        raise ValueError(f"{name} must be contiguous along its last dimension (stride {item} bytes), "
                         f"got strides {x.strides}")
    if x.data.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned, its data is at {x.data.ptr:#x}")
    if x.shape[0] <= 1:  # the row stride of a single row is never used: any valid one will do
        return -(-x.shape[1] // row_multiple) * row_multiple
    if x.strides[0] % item or x.strides[0] // item < x.shape[1]:
        raise ValueError(f"{name} must have rows of {x.shape[1]} elements one after another (a positive row "
                         f"stride of at least that many elements), got strides {x.strides}")
    ld = x.strides[0] // item
    if ld % row_multiple:
        raise ValueError(f"{name} needs a row stride that is a multiple of {row_multiple} elements, got {ld}")
    return ld


def _span(x, ld):
    """[first byte, one past the last byte] the 2-D array x covers."""
    item = x.dtype.itemsize
    return x.data.ptr, x.data.ptr + ((x.shape[0] - 1) * ld + x.shape[1]) * item


def _check_no_overlap(out, out_ld, inputs, out_name="out"):
    if out.size == 0:
        return
    lo, hi = _span(out, out_ld)
    for name, x, ld in inputs:
        if x is None or x.size == 0:
            continue
        a, b = _span(x, ld)
        if a < hi and lo < b:
            raise ValueError(f"{out_name} must not overlap {name}")


def _check_device(arrays):
    import cupy

    device = cupy.cuda.Device().id
    for name, x in arrays:
        if x is not None and x.device.id != device:
            raise ValueError(f"{name} is on device {x.device.id}, but the current device is {device}")
    return device


def _check_operands(a, b, b_layout):
    """(operand code, M, N, K, lda, ldb) of a [M, K] and b ([N, K] for b_layout "nk", [K, N] for "kn", "kn32")."""
    import cupy
    import numpy

    if b_layout not in _BT:
        raise ValueError(f"b_layout must be one of {tuple(_BT)}, got {b_layout!r}")
    b_shape = "[N, K]" if b_layout == "nk" else "[K, N]"
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, cupy.ndarray) or x.ndim != 2:
            raise ValueError(f"{name} must be a 2-D cupy.ndarray (a [M, K], b {b_shape}), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    op = _operand_code(a.dtype, "a")
    if b_layout == KN32:
        if op != OP_F16 or b.dtype != numpy.float32:
            raise ValueError(f"b_layout='kn32' (b converted to fp16 in the kernel) needs a float16 a and a float32 b, "
                             f"got a {a.dtype} and b {b.dtype}")
    elif b.dtype != a.dtype:
        hint = " (a float32 b [K, N] with a float16 a: b_layout='kn32')" if b.dtype == numpy.float32 else ""
        raise ValueError(f"b must have the dtype of a ({a.dtype}), got {b.dtype}{hint}")
    m, k = a.shape
    lda = _check_matrix(a, "a", (m, k), row_multiple=8)
    n, ldb = _check_b(b, b_layout, k, "a.shape[1]")
    return op, m, n, k, lda, ldb


def _check_b(b, b_layout, k, k_source):
    """(N, row stride) of b, [N, K] ("nk") or [K, N] ("kn", "kn32"), K given by `k_source`."""
    b_shape = "[N, K]" if b_layout == "nk" else "[K, N]"
    n = b.shape[0] if b_layout == "nk" else b.shape[1]
    if (b.shape[1] if b_layout == "nk" else b.shape[0]) != k:
        raise ValueError(f"b must be {b_shape} with K = {k_source} = {k} (b_layout={b_layout!r}), got shape {b.shape}")
    # TMA: 16-byte row strides (8 16-bit or 4 fp32 elements)
    return n, _check_matrix(b, "b", (n, k) if b_layout == "nk" else (k, n), row_multiple=4 if b_layout == KN32 else 8)


def _check_config(block_n, pingpong, b_layout="nk", cluster=1):
    """The schedule (block_n, pingpong) is one of CONFIGS; with b_layout "kn32" one of KN32_CONFIGS, without clusters."""
    if (block_n, bool(pingpong)) not in CONFIGS:
        raise ValueError(f"(block_n, pingpong) must be one of {CONFIGS}, got ({block_n!r}, {pingpong!r})")
    if b_layout == KN32 and (block_n, bool(pingpong)) not in KN32_CONFIGS:
        raise ValueError(f"b_layout='kn32' runs the schedules {KN32_CONFIGS} (block_n, pingpong), got "
                         f"({block_n!r}, {pingpong!r})")
    if b_layout == KN32 and cluster != 1:
        raise ValueError(f"b_layout='kn32' runs without clusters (cluster=1), got cluster={cluster!r}")


def _b_scale_fields(b_layout, b_scale, b_amax):
    """GemmArgs fields of b_layout "kn32": b's codes are fp16(b * b_scale), max |b| over the finite b folded into
    b_amax (optional)."""
    if b_layout != KN32:
        if b_scale != 1.0 or b_amax is not None:
            raise ValueError(f"b_scale and b_amax apply only with b_layout='kn32' (b converted in the kernel), "
                             f"got b_layout={b_layout!r}")
        return {}
    _check_amax(b_amax, "b_amax")
    return {"b_alpha": _check_power_of_two(b_scale, "b_scale"), "b_amax": b_amax.data.ptr if b_amax is not None else None}


def _check_size(m, n, k):
    if k < 1:
        raise ValueError(f"K (a.shape[1]) must be >= 1, got {k}")
    if max(m, n, k) >= 2 ** 31:
        raise ValueError(f"M, N, K must each be below 2^31, got {m}, {n}, {k}")


# ---- launch -------------------------------------------------------------------------------------
def _rows_aligned(ptr, ld, rows, nbytes):
    """Every row of the float32 matrix at `ptr` (row stride `ld` elements) starts on an `nbytes` boundary."""
    return ptr % nbytes == 0 and (rows <= 1 or (4 * ld) % nbytes == 0)


def _operand_maps(op, a_ptr, lda, b_ptr, ldb, b_layout, m, n, k, block_n, cluster=1):
    """The tensor maps of A [M, K] (boxes of BLOCK_M rows x 64) and of B: [N, K] in boxes of block_n / cluster
    rows x 64 ("nk"; a cluster's CTAs load one part each), or [K, N] in boxes of 64 K-rows x 64 N-elements,
    block_n / 64 per stage ("kn")."""
    return _maps.get(a_ptr, m, k, lda * 2, op, BLOCK_M), _b_map(op, b_ptr, ldb, b_layout, n, k, block_n, cluster)


def _b_map(op, b_ptr, ldb, b_layout, n, k, block_n, cluster=1):
    """The tensor map of B (_operand_maps)."""
    if b_layout == "nk":
        return _maps.get(b_ptr, n, k, ldb * 2, op, block_n // cluster)
    if b_layout == KN32:  # one fp32 box of 64 K-rows x block_n per stage, for the kernel to convert
        return _maps.get(b_ptr, k, n, ldb * 4, OP_F32, BLOCK_K, block_n)
    return _maps.get(b_ptr, k, n, ldb * 2, op, 64)


def _grid(m, n, block_n, device_id, cluster=1, function_ptr=None, smem=0, threads=THREADS):
    """Persistent grid: one CTA per output tile, at most one per multiprocessor; with clusters, one cluster per
    group of `cluster` vertically adjacent tiles, at most as many clusters as run at once (max_active_clusters
    of the kernel `function_ptr`)."""
    if cluster == 1:
        return min(-(-m // BLOCK_M) * -(-n // block_n), _kernels.sm_count(device_id))
    groups = -(-(-(-m // BLOCK_M)) // cluster) * -(-n // block_n)
    return cluster * min(groups, max_active_clusters(function_ptr, smem, cluster, threads))


def _check_cluster(cluster):
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {CLUSTERS}, got {cluster!r}")


def _check_raster(raster):
    if not isinstance(raster, int) or isinstance(raster, bool) or not 0 <= raster < 2 ** 31:
        raise ValueError(f"raster must be an int >= 0 (0: tiles down each column; R: bands of R tile rows), "
                         f"got {raster!r}")


def _launch(op, block_n, pingpong, epi, a, lda, b, ldb, args, stream, staged=False, b_layout="nk", cluster=1):
    import cupy
    from cupy_backends.cuda.api import driver

    m, n = args.m, args.n
    device = cupy.cuda.Device().id
    kernel = _kernel(op, block_n, epi, bool(pingpong), device, int(staged), b_layout, cluster)
    map_a, map_b = _operand_maps(op, a.data.ptr, lda, b.data.ptr, ldb, b_layout, m, n, args.k, block_n, cluster)
    smem = launch_smem_bytes(block_n, staged, b_layout)
    grid = _grid(m, n, block_n, device, cluster, kernel.kernel.ptr, smem, threads_for(staged))
    argv = (ctypes.c_void_p * 3)(ctypes.addressof(map_a.desc), ctypes.addressof(map_b.desc), ctypes.addressof(args))
    stream_ptr = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    # The driver copies the parameters at launch: map_a/map_b/args may be reused as soon as this returns.
    driver.launchKernel(kernel.kernel.ptr, grid, 1, 1, threads_for(staged), 1, 1, smem, stream_ptr,
                        ctypes.addressof(argv), 0)


def choose_config(m, n, sms, tanh_inner=True, gelu_out=False):
    """The (block_n, pingpong) of a fused GEMM1 + dgelu of an [m, n] output on `sms` multiprocessors.

    With tanh_inner given: the 128 x 128 tile if it fills the last wave better than 128 x 256 by more than 2%,
    as ping-pong where each CTA gets two or three tiles (sms < tiles <= 3 sms: the two consumers take turns,
    one's epilogue under the other's mainloop), cooperative otherwise; else 128 x 256 cooperative.
    Memory mode (tanh_inner recomputed): the 128 x 128 cooperative tile everywhere (64 accumulators per thread
    leave ptxas the registers for tanhf's temporaries; the 128-accumulator variants must serialize it).
    Measured, every schedule at T = 256 ... 8192, H = 6144 on the H200 (docs/decisions/031-schedule-per-t.md): the
    rule's choice is the fastest or within 3.1% of it at every T.
    gelu_out (EPI_DGELU_F16G, which has no staged 128 x 256 cooperative variant: GELU_NO_STAGED): 128 x 128
    ping-pong where the rule says 128 x 256 (in the same sweep, dgelu alone, 1.003x of 128 x 256 at T = 8192 and
    1.04x at T = 4096; 128 x 128 cooperative 1.008x and 1.07x)."""
    if not tanh_inner:
        return (128, False)

    if _wave_fill(m, n, 128, sms) > _wave_fill(m, n, 256, sms) + 0.02:
        return (128, sms < _tiles(m, n, 128) <= 3 * sms)
    return (128, True) if gelu_out else (256, False)


def _tiles(m, n, block_n):
    """Output tiles of BLOCK_M x block_n over an [m, n] output."""
    return -(-m // BLOCK_M) * -(-n // block_n)


def _wave_fill(m, n, block_n, sms):
    """How full the waves of those tiles keep `sms` multiprocessors (1.0: the last wave is full too)."""
    tiles = _tiles(m, n, block_n)
    return tiles / (-(-tiles // sms) * sms)


def choose_pair_config(m, n, sms):
    """The (block_n, pingpong) of a pair kernel launch of an [m, n] output on `sms` multiprocessors: the 128 x 128
    tile if it fills the last wave better than 128 x 256 by more than 2%, else 128 x 256; both cooperative.
    Measured on the H200, GEMM1 at T = 256 ... 8192 (docs/decisions/024-sm90-pair-kernel-gemm1.md): the rule's choice
    is the fastest schedule at every T; ping-pong is 1.5-2.2x slower everywhere (the pair's e4m3 stages bring
    the same bytes per stage in half the MMA time, so delivery, which ping-pong's tiles need more of, rules)."""
    return (128, False) if _wave_fill(m, n, 128, sms) > _wave_fill(m, n, 256, sms) + 0.02 else (256, False)


#: CTAs per cluster of the engine's fused launch (DgeluLaunch). 1 until clusters are measured faster there
#: (docs/decisions/033-clusters-b-multicast.md).
FUSED_CLUSTER = 1
#: Tile order of the engine's fused launch (GemmArgs::raster): bands of 8 tile rows. Measured at T = 2048 and 8192
#: 1.6-3.8% faster than the column order for the fused kernel (docs/decisions/032-raster-bands.md); at T <= 1024 (8 tile
#: rows or fewer) it is the column order itself.
FUSED_RASTER = 8


class DgeluLaunch:
    """A prebuilt fused GEMM1 + dgelu launch of the engine: A [M, K] and B (b_layout) 16-bit operands and
    the output at fixed addresses (tensor maps encoded once), linear1_out / tanh_inner set per call
    (set_activations: the staged epilogue where their rows allow it, else the direct one). No validation
    here: the engine owns the buffers and checks the shapes once.

    ``epi``: EPI_DGELU_F16 (the "tf32" plan: fp16 operands, fp16 output scaled by the device state's
    2^state[slot], max |g| gathered into the state unless ``rescue``, the rescue launch of gemm_sm90.cu)
    or EPI_DGELU_BF16X3 (the bf16x3 plan: bf16 operands with K tripled, the three bf16 planes of the
    output side by side in each row; no scale: pass state_ptr, consts_ptr, acc_scale_ptr None).
    ``gelu_ptr``, ``ldg``, ``gelu_slot`` (EPI_DGELU_F16 only): also write gelu_out = 0.5 x (1 + t) there as fp16
    codes scaled by 2^state[gelu_slot], gathering its max into that slot unless ``rescue`` (EPI_DGELU_F16G: GEMM2's
    operand, formed in this epilogue instead of converted from the caller's gelu_out; the rescue launch then
    runs when either slot's exponent moved).
    ``cluster``: CTAs per cluster (CLUSTERS), default FUSED_CLUSTER.
    ``warps``: with tanh_inner given and rows on 16-byte boundaries, the epilogue warps (WARPS: the cooperative
    128 x 128 tile) instead of choose_config's staged schedule, for a one-plane epilogue (bit for bit the same out)."""

    def __init__(self, a_ptr, lda, b_ptr, ldb, b_layout, out_ptr, ldc, m, n, k, *, state_ptr, consts_ptr,
                 acc_scale_ptr, slot, rescue, alpha_mask, device_id, epi=EPI_DGELU_F16, cluster=None,
                 gelu_ptr=None, ldg=0, gelu_slot=None, warps=False):
        if epi not in (EPI_DGELU_F16, EPI_DGELU_BF16X3):
            raise ValueError(f"epi must be EPI_DGELU_F16 or EPI_DGELU_BF16X3, got {epi!r}")
        if b_layout not in B_LAYOUTS:  # (kn32 is not the engine's: its scale would need the state's b_slot)
            raise ValueError(f"b_layout must be one of {B_LAYOUTS} for the engine's fused launch, got {b_layout!r}")
        if gelu_ptr is not None and (epi != EPI_DGELU_F16 or not state_ptr or gelu_slot is None or ldg != ldc):
            raise ValueError("gelu_ptr needs epi=EPI_DGELU_F16, a state_ptr, a gelu_slot and ldg == ldc (the staged "
                             "epilogue addresses both outputs' rows with ldc)")
        self.cluster = FUSED_CLUSTER if cluster is None else cluster
        _check_cluster(self.cluster)
        op = OP_F16 if epi == EPI_DGELU_F16 else OP_BF16
        sms = _kernels.sm_count(device_id)
        gather = state_ptr + 4 * (_kernels.STATE_SLOTS + slot) if state_ptr and not rescue else None
        self.args = GemmArgs(out_ptr, None, None, ldc, 0, 0, m, n, k, 1.0, gather, acc_scale_ptr, state_ptr,
                             consts_ptr, slot, int(rescue), alpha_mask, 1, FUSED_RASTER)
        if gelu_ptr is not None:
            epi = EPI_DGELU_F16G
            self.args.g, self.args.ldg, self.args.g_slot, self.args.g_alpha = gelu_ptr, ldg, gelu_slot, 1.0
            self.args.g_amax = None if rescue else state_ptr + 4 * (_kernels.STATE_SLOTS + gelu_slot)
        self.epi = epi
        # per (tanh_inner given, staged epilogue): the schedule (choose_config: memory mode has its own), the
        # function, its dynamic shared memory and grid, and the kernel arguments (tensor maps of its block_n)
        self.warps = bool(warps) and epi != EPI_DGELU_BF16X3
        self.configs = {has_t: WARPS_CONFIG if has_t and self.warps else
                        choose_config(m, n, sms, tanh_inner=has_t, gelu_out=gelu_ptr is not None)
                        for has_t in (True, False)}
        self._variants = {}
        for has_t, (block_n, pingpong) in self.configs.items():
            map_a, map_b = _operand_maps(op, a_ptr, lda, b_ptr, ldb, b_layout, m, n, k, block_n, self.cluster)
            argv = (ctypes.c_void_p * 3)(ctypes.addressof(map_a.desc), ctypes.addressof(map_b.desc),
                                         ctypes.addressof(self.args))
            for staged in (True, False):
                xs = 2 if staged and has_t and self.warps else int(staged)  # rows off 16 bytes: direct, as before
                function = _kernel(op, block_n, epi, pingpong, device_id, xs, b_layout, self.cluster).kernel.ptr
                smem = launch_smem_bytes(block_n, xs, b_layout)
                grid = _grid(m, n, block_n, device_id, self.cluster, function, smem, threads_for(xs))
                # (map_a, map_b kept: argv points into them)
                self._variants[has_t, staged] = (function, smem, grid, argv, (map_a, map_b), threads_for(xs))
        self.staged = True

    def set_activations(self, x_ptr, ldx, t_ptr, ldt):
        """linear1_out (and tanh_inner, or t_ptr 0: memory mode) of this call, fp32, row strides in elements
        (any: rows on 16-byte boundaries take the staged epilogue, others the direct one, with float pairs
        where they are 8-byte aligned, else single floats)."""
        self.args.x, self.args.ldx = x_ptr, ldx
        self.args.t, self.args.ldt = (t_ptr or None), (ldt if t_ptr else 0)
        given = [(p, ld) for p, ld in ((x_ptr, ldx), (t_ptr, ldt)) if p]
        self.staged = all(_rows_aligned(p, ld, self.args.m, 16) for p, ld in given)
        self.args.xt_pairs = int(all(_rows_aligned(p, ld, self.args.m, 8) for p, ld in given))

    def __call__(self, stream_ptr):
        from cupy_backends.cuda.api import driver

        function, smem, grid, argv, _, threads = self._variants[self.args.t is not None, self.staged]
        driver.launchKernel(function, grid, 1, 1, threads, 1, 1, smem, stream_ptr, ctypes.addressof(argv), 0)

    def node_params(self):
        """(function, grid, block, dynamic shared memory, argument pointer array) of this call's variant, as
        KernelLaunch.node_params (a call graph's node follows the variant set_activations chose)."""
        function, smem, grid, argv, _, threads = self._variants[self.args.t is not None, self.staged]
        return function, grid, threads, smem, ctypes.addressof(argv)


def gemm_tn(a, b, out, *, block_n=256, pingpong=False, b_layout="nk", cluster=1, raster=0, stream=None,
            b_scale=1.0, b_amax=None):
    """out[M, N] (float32) = a[M, K] @ b[N, K]^T (b_layout "nk") or a[M, K] @ b[K, N] ("kn") on the
    sm_90a kernel; returns out.

    a, b: float16, or uint16 holding bf16 bit patterns (both the same). (block_n, pingpong): the
    schedule, one of CONFIGS. cluster: CTAs per cluster, one of CLUSTERS (2: vertically adjacent tiles share B
    through TMA multicast). raster: the order of the output tiles (0: down each column of tiles; R > 0: bands of R
    tile rows (of R clusters' rows), column by column). Neither changes a single bit of out.
    b_layout "kn32": a float16, b float32 [K, N] converted to fp16 inside the kernel: out = a @ fp16(b * b_scale),
    b_scale a power of two, bit for bit what "kn" gives on the fp16 codes of convert.cu; b_amax (None, or a
    1-element uint32 array, as gemm_tn_dgelu's amax) receives max |b| over the finite b (subnormals count as 0, as in
    convert.cu; untouched when M or N is 0: then nothing runs). Schedules KN32_CONFIGS (pass block_n=128), no
    clusters. Measured slower than converting b first (docs/decisions/043-kn32-weights-converted-in-gemm.md): no plan
    uses it.
    stream: a cupy Stream (default: the current one)."""
    import numpy

    _check_config(block_n, pingpong, b_layout, cluster)
    _check_cluster(cluster)
    _check_raster(raster)
    op, m, n, k, lda, ldb = _check_operands(a, b, b_layout)
    b_fields = _b_scale_fields(b_layout, b_scale, b_amax)
    ldc = _check_matrix(out, "out", (m, n), numpy.float32)
    _check_device((("a", a), ("b", b), ("out", out), ("b_amax", b_amax)))
    _check_size(m, n, k)
    _check_no_overlap(out, ldc, (("a", a, lda), ("b", b, ldb)))
    if m == 0 or n == 0:
        return out
    args = GemmArgs(out.data.ptr, None, None, ldc, 0, 0, m, n, k, 1.0, None, xt_pairs=1, raster=raster, **b_fields)
    _launch(op, block_n, pingpong, EPI_F32, a, lda, b, ldb, args, stream, b_layout=b_layout, cluster=cluster)
    return out


def _pair_maps(a_ptr, lda, a_layout, b_ptr, ldb, b_layout, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8, block_n):
    """The pair kernel's four tensor maps: the fp16 A ([M, K] in boxes of BLOCK_M rows, or [K, M] in boxes of 64
    K-rows x 64 M-elements, two per stage) and B (as _operand_maps), and the e4m3 A8 [M, k8] and B8 [N, k8] in
    boxes of BLOCK_M (block_n) rows x 128 bytes."""
    if a_layout == "mk":
        map_a = _maps.get(a_ptr, m, k, lda * 2, OP_F16, BLOCK_M)
    else:
        map_a = _maps.get(a_ptr, k, m, lda * 2, OP_F16, 64)
    map_b = _b_map(OP_F16, b_ptr, ldb, b_layout, n, k, block_n)
    map_a8 = _maps.get(a8_ptr, m, k8, lda8, OP_E4M3, BLOCK_M)
    map_b8 = _maps.get(b8_ptr, n, k8, ldb8, OP_E4M3, block_n)
    return map_a, map_b, map_a8, map_b8


class PairLaunch:
    """A prebuilt launch of the pair kernel at fixed operand addresses (tensor maps encoded once): fp32
    out = alpha (pair_scale A8 B8^T + A B^T) (+ out), alpha read from the device at ``alpha_ptr`` (the engine's
    consts) or the float ``alpha``. The output and whether it accumulates are set per call (``args.c``,
    ``args.accumulate``). No validation here: gemm_pair validates, the engine owns its buffers."""

    def __init__(self, a_ptr, lda, a_layout, b_ptr, ldb, b_layout, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8, *,
                 device_id, alpha=1.0, alpha_ptr=None, pair_scale=8.0, block_n=128, pingpong=False, out_ptr=None,
                 ldc=None):
        _check_config(block_n, pingpong)
        self.args = GemmArgs(out_ptr, None, None, n if ldc is None else ldc, 0, 0, m, n, k, alpha, None, alpha_ptr,
                             xt_pairs=1, pair_scale=pair_scale, k8=k8)
        self._maps = _pair_maps(a_ptr, lda, a_layout, b_ptr, ldb, b_layout, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8,
                                block_n)
        self._argv = (ctypes.c_void_p * 5)(*(ctypes.addressof(x.desc) for x in self._maps), ctypes.addressof(self.args))
        self.function = _pair_kernel(block_n, pingpong, a_layout, b_layout, device_id).kernel.ptr
        self.smem = smem_bytes(block_n)
        self.grid = _grid(m, n, block_n, device_id)

    def __call__(self, stream_ptr):
        from cupy_backends.cuda.api import driver

        # The driver copies the parameters at launch: the maps and args may change as soon as this returns.
        driver.launchKernel(self.function, self.grid, 1, 1, THREADS, 1, 1, self.smem, stream_ptr,
                            ctypes.addressof(self._argv), 0)

    def node_params(self):
        """(function, grid, block, dynamic shared memory, argument pointer array), as KernelLaunch.node_params."""
        return self.function, self.grid, THREADS, self.smem, ctypes.addressof(self._argv)


def _check_pair_8bit(x, name, rows):
    """An e4m3 pair operand: uint8 [rows, k8], rows of multiples of 16 bytes (TMA); returns (k8, row stride)."""
    import cupy
    import numpy

    if not isinstance(x, cupy.ndarray) or x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D cupy.ndarray of e4m3 bytes [{rows}, k8], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if x.dtype != numpy.uint8:
        raise ValueError(f"{name} must be uint8 (e4m3 bit patterns), got {x.dtype}")
    k8 = x.shape[1]
    if k8 < 16 or k8 % 16:
        raise ValueError(f"{name} must have a positive multiple of 16 columns (k8, the e4m3 K), got {k8}")
    return k8, _check_matrix(x, name, (rows, k8), row_multiple=16)


def gemm_pair(a, b, a8, b8, out, *, alpha=1.0, pair_scale=8.0, accumulate=False, a_layout="mk", b_layout="nk",
              block_n=128, pingpong=False, stream=None):
    """The fp16+fp8 pair in one sm90 kernel: out[M, N] (float32) = alpha * (pair_scale * a8 @ b8^T + a @ b)
    (+ out if accumulate); returns out.

    a: float16 [M, K] (a_layout "mk") or [K, M] ("km"); b: float16 [N, K] ("nk": a @ b^T) or [K, N] ("kn").
    a8, b8: uint8 e4m3 bit patterns, [M, k8] and [N, k8] (both K-major; k8 a multiple of 16: the cross terms'
    pairs of kernels_cu/split_e4m3.cu, e.g. [lo | hi] against [hi | lo]). The e4m3 product is summed first, then
    weighed by pair_scale (a power of two) and the fp16 product added to it in the same accumulator (see
    gemm_sm90.cu). (block_n, pingpong): one of CONFIGS. stream: a cupy Stream (default: the current one)."""
    import cupy
    import numpy

    _check_config(block_n, pingpong)
    if a_layout not in A_LAYOUTS:
        raise ValueError(f"a_layout must be one of {A_LAYOUTS}, got {a_layout!r}")
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {b_layout!r}")
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, cupy.ndarray) or x.ndim != 2 or x.dtype != numpy.float16:
            raise ValueError(f"{name} must be a 2-D float16 cupy.ndarray, got {getattr(x, 'dtype', type(x).__name__)} "
                             f"{getattr(x, 'shape', '')}")
    m, k = a.shape if a_layout == "mk" else a.shape[::-1]
    lda = _check_matrix(a, "a", a.shape, row_multiple=8)
    n, ldb = _check_b(b, b_layout, k, f"a's K ({a_layout!r})")
    k8, lda8 = _check_pair_8bit(a8, "a8", m)
    k8_b, ldb8 = _check_pair_8bit(b8, "b8", n)
    if k8_b != k8:
        raise ValueError(f"b8 must have the k8 = {k8} columns of a8, got shape {b8.shape}")
    ldc = _check_matrix(out, "out", (m, n), numpy.float32)
    for name, v in (("alpha", alpha), ("pair_scale", pair_scale)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite float, got {v!r}")
    if not (pair_scale > 0 and math.frexp(pair_scale)[0] == 0.5):
        raise ValueError(f"pair_scale must be a power of two (exact scaling), got {pair_scale!r}")
    _check_device((("a", a), ("b", b), ("a8", a8), ("b8", b8), ("out", out)))
    _check_size(m, n, max(k, k8))
    _check_no_overlap(out, ldc, (("a", a, lda), ("b", b, ldb), ("a8", a8, lda8), ("b8", b8, ldb8)))
    if m == 0 or n == 0:
        return out
    device = cupy.cuda.Device().id
    launch = PairLaunch(a.data.ptr, lda, a_layout, b.data.ptr, ldb, b_layout, a8.data.ptr, lda8, b8.data.ptr, ldb8,
                        m, n, k, k8, device_id=device, alpha=float(alpha), pair_scale=float(pair_scale),
                        block_n=block_n, pingpong=pingpong, out_ptr=out.data.ptr, ldc=ldc)
    launch.args.accumulate = int(bool(accumulate))
    launch((stream if stream is not None else cupy.cuda.get_current_stream()).ptr)
    return out


def _check_amax(amax, name):
    import cupy
    import numpy

    if amax is not None and (not isinstance(amax, cupy.ndarray) or amax.dtype != numpy.uint32 or amax.size != 1):
        raise ValueError(f"{name} must be None or a 1-element uint32 cupy.ndarray, got "
                         f"{getattr(amax, 'dtype', type(amax).__name__)} {getattr(amax, 'shape', '')}")


def _check_power_of_two(alpha, name):
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha > 0 and math.frexp(alpha)[0] == 0.5 and -126 <= math.frexp(alpha)[1] - 1 <= 127):
        raise ValueError(f"{name} must be a power of two 2^e with -126 <= e <= 127 (a normal float), got {alpha}")
    return alpha


def gemm_tn_dgelu(a, b, linear1_out, tanh_inner, out, *, alpha=1.0, amax=None, block_n=256, pingpong=False,
                  epilogue=None, b_layout="nk", planes=1, cluster=1, raster=0, stream=None, gelu_out=None,
                  gelu_alpha=1.0, gelu_amax=None, b_scale=1.0, b_amax=None):
    """GEMM1 with the GELU derivative fused: g = (a @ b^T) * gelu'(linear1_out, tanh_inner) in fp32,
    stored as bf16 bits (out uint16 [M, N]), as three bf16 planes (planes=3: out uint16 [M, 3N], columns
    [0, N) hi = bf16(g), [N, 2N) lo = bf16(g - hi), [2N, 3N) hi), or as fp16(alpha * g) (out float16);
    returns out.

    linear1_out, tanh_inner: float32 [M, N]; tanh_inner None recomputes it (memory mode). alpha:
    a power of two (exact scaling), only with a float16 out. amax: None, or a 1-element uint32 CuPy
    array that the kernel raises to the bits of max |g| over the finite g (before alpha) with atomicMax;
    the caller initializes it (0, or a running maximum's bits). epilogue: how x and t reach the
    epilogue, one of EPILOGUES ("staged": cp.async into shared memory during the mainloop, which needs
    every row of linear1_out and tanh_inner on a 16-byte boundary (row strides multiples of 4);
    "direct": global loads in the epilogue), or None: staged where the rows allow it, else direct; or WARPS
    ("warps": the epilogue in warps of its own, overlapping the next tile's mainloop, with the rows of "staged",
    block_n=128, pingpong=False, planes=1, b_layout "nk" or "kn"; either cluster size).
    Both give bitwise the same out and amax, and so do both cluster sizes and every raster (as in gemm_tn).
    gelu_out (float16 out only): a float16 [M, N] array that also receives fp16(gelu_alpha * 0.5 x (1 + t)), x =
    linear1_out, t = tanh_inner (or recomputed), the forward's GELU output as GEMM2's operand; gelu_alpha a power of
    two; gelu_amax as amax, for max |0.5 x (1 + t)|.
    b_layout "kn32", b_scale, b_amax: as in gemm_tn (a float16 a, a float32 b converted in the kernel; one-plane
    float16 out without gelu_out)."""
    import numpy

    _check_config(block_n, pingpong, b_layout, cluster)
    _check_cluster(cluster)
    _check_raster(raster)
    if epilogue is not None and epilogue not in EPILOGUES + (WARPS,):
        raise ValueError(f"epilogue must be None or one of {EPILOGUES + (WARPS,)}, got {epilogue!r}")
    if epilogue == WARPS and ((block_n, pingpong) != WARPS_CONFIG or b_layout not in B_LAYOUTS or planes != 1):
        raise ValueError(f"epilogue={WARPS!r} runs the cooperative 128 x 128 tile (block_n=128, pingpong=False), "
                         f"b_layout one of {B_LAYOUTS}, planes=1; got block_n={block_n!r}, pingpong={pingpong!r}, "
                         f"b_layout={b_layout!r}, planes={planes!r}")
    op, m, n, k, lda, ldb = _check_operands(a, b, b_layout)
    if b_layout == KN32 and (getattr(out, "dtype", None) != numpy.float16 or gelu_out is not None):
        raise ValueError("b_layout='kn32' runs the float16 dgelu epilogue (out float16, no gelu_out), got out "
                         f"{getattr(out, 'dtype', type(out).__name__)}, gelu_out {'given' if gelu_out is not None else 'None'}")
    b_fields = _b_scale_fields(b_layout, b_scale, b_amax)
    if planes == 3 and op != OP_BF16:
        raise ValueError(f"planes=3 (bf16x3 planes) needs bf16 operands (uint16 a and b), got {a.dtype}")
    if planes == 3 and n % 2:  # the planes start N columns apart and are stored as 4-byte column pairs
        raise ValueError(f"planes=3 needs an even N (b's {'rows' if b_layout == 'nk' else 'columns'}), got {n}")
    ldx = _check_matrix(linear1_out, "linear1_out", (m, n), numpy.float32)
    ldt = _check_matrix(tanh_inner, "tanh_inner", (m, n), numpy.float32) if tanh_inner is not None else 0
    if planes not in (1, 3):
        raise ValueError(f"planes must be 1 or 3 (bf16x3 planes), got {planes!r}")
    out_dtype = getattr(out, "dtype", None)
    if planes == 3 and out_dtype != numpy.uint16:
        raise ValueError(f"planes=3 writes bf16 planes: out must be uint16 (bf16 bit patterns), got {out_dtype}")
    if out_dtype == numpy.uint16:
        epi = EPI_DGELU_BF16 if planes == 1 else EPI_DGELU_BF16X3
        if alpha != 1.0:
            raise ValueError(f"alpha applies to a float16 out only; with bf16 (uint16) out it must be 1.0, got {alpha}")
    elif out_dtype == numpy.float16:
        epi = EPI_DGELU_F16 if gelu_out is None else EPI_DGELU_F16G
    else:
        raise ValueError(f"out must be uint16 (bf16 bit patterns) or float16, got {out_dtype}")
    if gelu_out is None and (gelu_alpha != 1.0 or gelu_amax is not None):
        raise ValueError("gelu_alpha and gelu_amax apply only with a gelu_out array")
    if gelu_out is not None and epi != EPI_DGELU_F16G:
        raise ValueError(f"gelu_out is written only beside a float16 out, got out {out_dtype}")
    alpha = _check_power_of_two(alpha, "alpha")
    gelu_alpha = _check_power_of_two(gelu_alpha, "gelu_alpha")
    ldc = _check_matrix(out, "out", (m, planes * n))
    ldg = _check_matrix(gelu_out, "gelu_out", (m, n), numpy.float16) if gelu_out is not None else 0
    _check_amax(amax, "amax")
    _check_amax(gelu_amax, "gelu_amax")
    _check_device((("a", a), ("b", b), ("linear1_out", linear1_out), ("tanh_inner", tanh_inner), ("out", out),
                   ("amax", amax), ("gelu_out", gelu_out), ("gelu_amax", gelu_amax), ("b_amax", b_amax)))
    _check_size(m, n, k)
    inputs = (("a", a, lda), ("b", b, ldb), ("linear1_out", linear1_out, ldx), ("tanh_inner", tanh_inner, ldt))
    _check_no_overlap(out, ldc, inputs)
    if gelu_out is not None:
        _check_no_overlap(gelu_out, ldg, inputs + (("out", out, ldc),), out_name="gelu_out")
    for name, ld in (("out", ldc), ("linear1_out", ldx), ("tanh_inner", ldt), ("gelu_out", ldg)):
        if ld >= 2 ** 31:  # the epilogue forms row offsets as 32 x 32-bit products
            raise ValueError(f"{name} must have a row stride below 2^31 elements, got {ld}")
    if m == 0 or n == 0:
        return out
    # the staged epilogue copies 16-byte chunks of rows
    off_16b = [(name, ld) for name, x, ld in (("linear1_out", linear1_out, ldx), ("tanh_inner", tanh_inner, ldt))
               if x is not None and not _rows_aligned(x.data.ptr, ld, x.shape[0], 16)]
    no_staged = (epi, block_n, bool(pingpong)) == GELU_NO_STAGED
    if epilogue is None:
        epilogue = "direct" if off_16b or no_staged or ldg not in (0, ldc) else "staged"
    elif epilogue == "staged" and no_staged:
        raise ValueError("gelu_out with block_n=256 cooperative has no staged epilogue (that variant would spill "
                         "registers); pass epilogue='direct' or None, or another schedule")
    elif epilogue in ("staged", WARPS) and ldg not in (0, ldc):
        raise ValueError(f"epilogue={epilogue!r} with gelu_out needs gelu_out's row stride equal to out's ({ldc}), "
                         f"got {ldg}; epilogue=None falls back to 'direct'")
    elif epilogue in ("staged", WARPS) and off_16b:
        name, ld = off_16b[0]
        raise ValueError(f"epilogue={epilogue!r} needs {name} rows on 16-byte boundaries (a row stride that is a "
                         f"multiple of 4 elements), got {ld}; epilogue=None falls back to 'direct'")
    args = GemmArgs(out.data.ptr, linear1_out.data.ptr, tanh_inner.data.ptr if tanh_inner is not None else None,
                    ldc, ldx, ldt, m, n, k, alpha, amax.data.ptr if amax is not None else None,
                    xt_pairs=1, raster=raster, **b_fields)  # xt_pairs: even row strides, 16-byte aligned data
    if gelu_out is not None:
        args.g, args.ldg, args.g_alpha = gelu_out.data.ptr, ldg, gelu_alpha
        args.g_amax = gelu_amax.data.ptr if gelu_amax is not None else None
    _launch(op, block_n, pingpong, epi, a, lda, b, ldb, args, stream, staged=_XS[epilogue], b_layout=b_layout,
            cluster=cluster)
    return out
