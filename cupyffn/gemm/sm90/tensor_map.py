"""TMA descriptors of the sm90 GEMM's operands: CUtensorMap (128 opaque bytes) encoded by ``cuTensorMapEncodeTiled``
from libcuda through ctypes, cached per everything they encode, and passed by value as ``__grid_constant__`` kernel
parameters (kernels_cu/sm90/types.cuh TmaDesc)."""

import collections
import ctypes
import threading

from ...cuda import libcuda as _libcuda

from .config import BLOCK_K, BLOCK_M, OP_BF16, OP_E4M3, OP_F16

_CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
_CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
_CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
_CU_TENSOR_MAP_INTERLEAVE_NONE = 0
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
_CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros


class TmaDesc(ctypes.Structure):
    """Mirror of ``struct TmaDesc`` (a CUtensorMap: 128 opaque bytes)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


class _AlignedDesc:
    """A TmaDesc on a 64-byte boundary (CUtensorMap is declared alignas(64)); keeps its buffer alive."""

    def __init__(self):
        self._buffer = (ctypes.c_uint8 * (ctypes.sizeof(TmaDesc) + 64))()
        offset = (-ctypes.addressof(self._buffer)) % 64
        self.desc = TmaDesc.from_buffer(self._buffer, offset)


def encode_tensor_map(ptr, rows, cols, row_stride_bytes, op, box_rows):
    """CUtensorMap of a [rows, cols] row-major matrix at `ptr`, 128-byte swizzle, boxes of box_rows rows x 128
    bytes: 64 16-bit elements (op OP_F16, OP_BF16) or 128 bytes (OP_E4M3)."""
    encode = _libcuda.function("cuTensorMapEncodeTiled", [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    holder = _AlignedDesc()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
    box = (ctypes.c_uint32 * 2)(2 * BLOCK_K if op == OP_E4M3 else BLOCK_K, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    dtype = {OP_F16: _CU_TENSOR_MAP_DATA_TYPE_FLOAT16, OP_BF16: _CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             OP_E4M3: _CU_TENSOR_MAP_DATA_TYPE_UINT8}[op]
    status = encode(ctypes.addressof(holder.desc), dtype, 2, ctypes.c_void_p(ptr), dims, strides, box, elem,
                    _CU_TENSOR_MAP_INTERLEAVE_NONE, _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
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


maps = _MapCache()


def b_map(op, b_ptr, ldb, n, k):
    """The tensor map of B [K, N] (a weight as stored, N contiguous) in boxes of 64 K-rows x 64 N-elements,
    block_n / 64 of them per stage (read MN-major by wgmma)."""
    return maps.get(b_ptr, k, n, ldb * 2, op, 64)


def dgelu_maps(op, a_ptr, lda, b_ptr, ldb, m, n, k):
    """gemm_sm90_kernel's tensor maps: A [M, K] in boxes of BLOCK_M rows x 64, and B (b_map)."""
    return maps.get(a_ptr, m, k, lda * 2, op, BLOCK_M), b_map(op, b_ptr, ldb, n, k)


def pair_maps(a_ptr, lda, a_layout, b_ptr, ldb, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8, block_n):
    """The pair kernel's four tensor maps: the fp16 A ([M, K] in boxes of BLOCK_M rows, or [K, M] in boxes of 64
    K-rows x 64 M-elements, two per stage) and B (b_map), and the e4m3 A8 [M, k8] and B8 [N, k8] in boxes of
    BLOCK_M (block_n) rows x 128 bytes."""
    if a_layout == "mk":
        map_a = maps.get(a_ptr, m, k, lda * 2, OP_F16, BLOCK_M)
    else:
        map_a = maps.get(a_ptr, k, m, lda * 2, OP_F16, 64)
    map_b = b_map(OP_F16, b_ptr, ldb, n, k)
    map_a8 = maps.get(a8_ptr, m, k8, lda8, OP_E4M3, BLOCK_M)
    map_b8 = maps.get(b8_ptr, n, k8, ldb8, OP_E4M3, block_n)
    return map_a, map_b, map_a8, map_b8
