"""Validation of the sm90 GEMM's direct entry points (cupyffn/gemm/sm90/entry.py): each check raises ValueError
naming the argument and what it must be."""

import math

from .config import OP_BF16, OP_F16


def operand_code(dtype, name):
    import numpy

    if dtype == numpy.float16:
        return OP_F16
    if dtype == numpy.uint16:
        return OP_BF16
    raise ValueError(f"{name} must be float16 (fp16) or uint16 (bf16 bit patterns), got {dtype}")


def check_matrix(x, name, shape, dtype=None, row_multiple=2):
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


def check_no_overlap(out, out_ld, inputs, out_name="out"):
    if out.size == 0:
        return
    lo, hi = _span(out, out_ld)
    for name, x, ld in inputs:
        if x is None or x.size == 0:
            continue
        a, b = _span(x, ld)
        if a < hi and lo < b:
            raise ValueError(f"{out_name} must not overlap {name}")


def check_device(arrays):
    import cupy

    device = cupy.cuda.Device().id
    for name, x in arrays:
        if x is not None and x.device.id != device:
            raise ValueError(f"{name} is on device {x.device.id}, but the current device is {device}")
    return device


def check_b(b, k, k_source):
    """(N, row stride) of b [K, N] (N contiguous: a weight as stored), K given by `k_source`."""
    if b.shape[0] != k:
        raise ValueError(f"b must be [K, N] with K = {k_source} = {k}, got shape {b.shape}")
    return b.shape[1], check_matrix(b, "b", (k, b.shape[1]), row_multiple=8)  # TMA: 16-byte row strides


def check_operands(a, b):
    """(operand code, M, N, K, lda, ldb) of a [M, K] and b [K, N], both float16 or both uint16 (bf16 bits)."""
    import cupy

    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, cupy.ndarray) or x.ndim != 2:
            raise ValueError(f"{name} must be a 2-D cupy.ndarray (a [M, K], b [K, N]), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    op = operand_code(a.dtype, "a")
    if b.dtype != a.dtype:
        raise ValueError(f"b must have the dtype of a ({a.dtype}), got {b.dtype}")
    m, k = a.shape
    lda = check_matrix(a, "a", (m, k), row_multiple=8)
    n, ldb = check_b(b, k, "a.shape[1]")
    return op, m, n, k, lda, ldb


def check_pair_8bit(x, name, rows):
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
    return k8, check_matrix(x, name, (rows, k8), row_multiple=16)


def check_amax(amax, name):
    import cupy
    import numpy

    if amax is not None and (not isinstance(amax, cupy.ndarray) or amax.dtype != numpy.uint32 or amax.size != 1):
        raise ValueError(f"{name} must be None or a 1-element uint32 cupy.ndarray, got "
                         f"{getattr(amax, 'dtype', type(amax).__name__)} {getattr(amax, 'shape', '')}")


def check_power_of_two(alpha, name):
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha > 0 and math.frexp(alpha)[0] == 0.5 and -126 <= math.frexp(alpha)[1] - 1 <= 127):
        raise ValueError(f"{name} must be a power of two 2^e with -126 <= e <= 127 (a normal float), got {alpha}")
    return alpha


def check_size(m, n, k):
    if k < 1:
        raise ValueError(f"K (a.shape[1]) must be >= 1, got {k}")
    if max(m, n, k) >= 2 ** 31:
        raise ValueError(f"M, N, K must each be below 2^31, got {m}, {n}, {k}")


def check_raster(raster):
    if not isinstance(raster, int) or isinstance(raster, bool) or not 0 <= raster < 2 ** 31:
        raise ValueError(f"raster must be an int >= 0 (0: tiles down each column; R: bands of R tile rows), "
                         f"got {raster!r}")
