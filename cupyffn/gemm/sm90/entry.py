"""The sm90 GEMM's validating entry points, for tests, dev tools and direct use (the engine builds DgeluLaunch and
PairLaunch itself): thin wrappers that check their arguments, pick the variant (Sm90Config, check_config) and
launch it once.

* :func:`gemm_tn_dgelu` -- GEMM1 with the GELU derivative in its epilogue: ``g = (a @ b) * gelu'(linear1_out,
  tanh_inner)``, a [M, K], b [K, N] (a weight as stored), as fp16(alpha * g) (``out.dtype == float16``; optionally
  gelu_out too) or three bf16 planes (hi, lo, hi) side by side in each row (``planes=3``, out uint16 [M, 3N]: the
  bf16x3 plan's grad_linear1).
* :func:`gemm_pair` -- the fp16+fp8 pair: ``out (fp32) = alpha * (pair_scale * a8 @ b8^T + a @ b)`` (+ out).

Operands ``a`` and ``b`` are 16-bit: ``float16`` arrays, or bf16 bit patterns in ``uint16`` arrays (CuPy has no
bfloat16 dtype). Constraints (checked, ValueError otherwise): K >= 1; a and b contiguous along their last dimension
with row strides a multiple of 8 elements (16 bytes, for the TMA unit) and 16-byte-aligned data; out, linear1_out
and tanh_inner row-contiguous with even row strides and 16-byte-aligned data; out overlapping no input. M, N and K
need not be multiples of the tile: the TMA unit zero-fills what lies outside A and B, and the epilogue stores only
in-bounds elements.
"""

import math

from . import checks as C
from . import tensor_map
from .config import (EPI_DGELU_BF16X3, EPI_DGELU_F16, EPI_DGELU_F16G, EPILOGUES, OP_BF16, OP_F16E4M3, WARPS,
                     Sm90Config, check_config)
from .launch import GemmArgs, launch, rows_aligned


def _stream_ptr(stream):
    import cupy

    return (stream if stream is not None else cupy.cuda.get_current_stream()).ptr


def gemm_tn_dgelu(a, b, linear1_out, tanh_inner, out, *, alpha=1.0, amax=None, block_n=256, pingpong=False,
                  epilogue=None, planes=1, raster=0, stream=None, gelu_out=None, gelu_alpha=1.0, gelu_amax=None,
                  trace=False):
    """GEMM1 with the GELU derivative fused: g = (a @ b) * gelu'(linear1_out, tanh_inner) in fp32, a [M, K],
    b [K, N], stored as fp16(alpha * g) (out float16 [M, N]) or as three bf16 planes (planes=3, bf16 operands: out
    uint16 [M, 3N], columns [0, N) hi = bf16(g), [N, 2N) lo = bf16(g - hi), [2N, 3N) hi); returns out.

    linear1_out, tanh_inner: float32 [M, N]; tanh_inner None recomputes it (memory mode). alpha: a power of two
    (exact scaling), only with a float16 out. amax: None, or a 1-element uint32 CuPy array that the kernel raises to
    the bits of max |g| over the finite g (before alpha) with atomicMax; the caller initializes it (0, or a running
    maximum's bits). (block_n, pingpong): the schedule, one of SCHEDULES. epilogue: how x and t reach the epilogue,
    one of EPILOGUES ("staged": cp.async into shared memory during the mainloop, which needs every row of
    linear1_out and tanh_inner on a 16-byte boundary (row strides multiples of 4); "direct": global loads in the
    epilogue; "warps": the epilogue in warps of its own, overlapping the next tile's mainloop, with the rows of
    "staged", block_n=128, pingpong=False, a float16 out), or None: staged where the rows allow it, else direct.
    Every epilogue and every raster (0: tiles down each column; R > 0: bands of R tile rows) gives bitwise the same
    out and amax. gelu_out (float16 out only): a float16 [M, N] array that also receives fp16(gelu_alpha * 0.5 x
    (1 + t)), x = linear1_out, t = tanh_inner (or recomputed), the forward's GELU output as GEMM2's operand (block_n
    128); gelu_alpha a power of two; gelu_amax as amax, for max |0.5 x (1 + t)|. trace: the variant compiled with
    the per-tile timestamps (dev/sm90_trace.py). stream: a cupy Stream (default: the current one)."""
    import numpy

    C.check_raster(raster)
    if epilogue is not None and epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be None or one of {EPILOGUES}, got {epilogue!r}")
    op, m, n, k, lda, ldb = C.check_operands(a, b)
    if planes not in (1, 3):
        raise ValueError(f"planes must be 1 or 3 (bf16x3 planes), got {planes!r}")
    out_dtype = getattr(out, "dtype", None)
    if planes == 3:
        if op != OP_BF16 or out_dtype != numpy.uint16:
            raise ValueError(f"planes=3 (bf16x3 planes) needs bf16 operands (uint16 a and b) and a uint16 out, got "
                             f"{a.dtype} and {out_dtype}")
        if n % 2:  # the planes start N columns apart and are stored as 4-byte column pairs
            raise ValueError(f"planes=3 needs an even N (b's columns), got {n}")
        if alpha != 1.0:
            raise ValueError(f"alpha applies to a float16 out only; with bf16 planes it must be 1.0, got {alpha}")
        if gelu_out is not None:
            raise ValueError("gelu_out is written by the float16 dgelu epilogues only (planes=1); with planes=3 "
                             "pass gelu_out=None")
        epi = EPI_DGELU_BF16X3
    elif out_dtype == numpy.float16:
        epi = EPI_DGELU_F16 if gelu_out is None else EPI_DGELU_F16G
    else:
        raise ValueError(f"out must be float16 (planes=1, float16 operands) or uint16 (planes=3, bf16 planes), "
                         f"got {out_dtype}")
    if gelu_out is None and (gelu_alpha != 1.0 or gelu_amax is not None):
        raise ValueError("gelu_alpha and gelu_amax apply only with a gelu_out array")
    alpha = C.check_power_of_two(alpha, "alpha")
    gelu_alpha = C.check_power_of_two(gelu_alpha, "gelu_alpha")
    ldx = C.check_matrix(linear1_out, "linear1_out", (m, n), numpy.float32)
    ldt = C.check_matrix(tanh_inner, "tanh_inner", (m, n), numpy.float32) if tanh_inner is not None else 0
    ldc = C.check_matrix(out, "out", (m, planes * n))
    ldg = C.check_matrix(gelu_out, "gelu_out", (m, n), numpy.float16) if gelu_out is not None else 0
    C.check_amax(amax, "amax")
    C.check_amax(gelu_amax, "gelu_amax")
    C.check_device((("a", a), ("b", b), ("linear1_out", linear1_out), ("tanh_inner", tanh_inner), ("out", out),
                    ("amax", amax), ("gelu_out", gelu_out), ("gelu_amax", gelu_amax)))
    C.check_size(m, n, k)
    inputs = (("a", a, lda), ("b", b, ldb), ("linear1_out", linear1_out, ldx), ("tanh_inner", tanh_inner, ldt))
    C.check_no_overlap(out, ldc, inputs)
    if gelu_out is not None:
        C.check_no_overlap(gelu_out, ldg, inputs + (("out", out, ldc),), out_name="gelu_out")
    for name, ld in (("out", ldc), ("linear1_out", ldx), ("tanh_inner", ldt), ("gelu_out", ldg)):
        if ld >= 2 ** 31:  # the epilogue forms row offsets as 32 x 32-bit products
            raise ValueError(f"{name} must have a row stride below 2^31 elements, got {ld}")
    # the staged and warps epilogues copy 16-byte chunks of rows
    off_16b = [(name, ld) for name, x, ld in (("linear1_out", linear1_out, ldx), ("tanh_inner", tanh_inner, ldt))
               if x is not None and not rows_aligned(x.data.ptr, ld, x.shape[0], 16)]
    if epilogue is None:
        epilogue = "direct" if off_16b or ldg not in (0, ldc) else "staged"
    elif epilogue in ("staged", WARPS) and ldg not in (0, ldc):
        raise ValueError(f"epilogue={epilogue!r} with gelu_out needs gelu_out's row stride equal to out's ({ldc}), "
                         f"got {ldg}; epilogue=None falls back to 'direct'")
    elif epilogue in ("staged", WARPS) and off_16b:
        name, ld = off_16b[0]
        raise ValueError(f"epilogue={epilogue!r} needs {name} rows on 16-byte boundaries (a row stride that is a "
                         f"multiple of 4 elements), got {ld}; epilogue=None falls back to 'direct'")
    config = check_config(Sm90Config(op, block_n, pingpong, epi, epilogue, trace=trace))
    if m == 0 or n == 0:
        return out
    args = GemmArgs(out.data.ptr, linear1_out.data.ptr, tanh_inner.data.ptr if tanh_inner is not None else None,
                    ldc, ldx, ldt, m, n, k, alpha, amax.data.ptr if amax is not None else None,
                    xt_pairs=1, raster=raster)  # xt_pairs: even row strides, 16-byte aligned data
    if gelu_out is not None:
        args.g, args.ldg, args.g_alpha = gelu_out.data.ptr, ldg, gelu_alpha
        args.g_amax = gelu_amax.data.ptr if gelu_amax is not None else None
    maps = tensor_map.dgelu_maps(op, a.data.ptr, lda, b.data.ptr, ldb, m, n, k)
    launch(config, maps, args, _stream_ptr(stream), a.device.id)
    return out


def gemm_pair(a, b, a8, b8, out, *, alpha=1.0, pair_scale=8.0, accumulate=False, a_layout="mk", block_n=128,
              stream=None):
    """The fp16+fp8 pair in one sm90 kernel: out[M, N] (float32) = alpha * (pair_scale * a8 @ b8^T + a @ b)
    (+ out if accumulate); returns out.

    a: float16 [M, K] (a_layout "mk") or [K, M] ("km"); b: float16 [K, N] (a weight as stored).
    a8, b8: uint8 e4m3 bit patterns, [M, k8] and [N, k8] (both K-major; k8 a multiple of 16: the cross terms'
    pairs of kernels_cu/split_e4m3.cu, e.g. [lo | hi] against [hi | lo]). The e4m3 product is summed first, then
    weighed by pair_scale (a power of two) and the fp16 product added to it in the same accumulator (see
    gemm_sm90.cu). block_n: 128, 192 or 256 (PAIR_SCHEDULES, cooperative). stream: a cupy Stream (default: the current
    one)."""
    import cupy
    import numpy

    config = check_config(Sm90Config(OP_F16E4M3, block_n, a_layout=a_layout))
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, cupy.ndarray) or x.ndim != 2 or x.dtype != numpy.float16:
            raise ValueError(f"{name} must be a 2-D float16 cupy.ndarray, got {getattr(x, 'dtype', type(x).__name__)} "
                             f"{getattr(x, 'shape', '')}")
    m, k = a.shape if a_layout == "mk" else a.shape[::-1]
    lda = C.check_matrix(a, "a", a.shape, row_multiple=8)
    n, ldb = C.check_b(b, k, f"a's K ({a_layout!r})")
    k8, lda8 = C.check_pair_8bit(a8, "a8", m)
    k8_b, ldb8 = C.check_pair_8bit(b8, "b8", n)
    if k8_b != k8:
        raise ValueError(f"b8 must have the k8 = {k8} columns of a8, got shape {b8.shape}")
    ldc = C.check_matrix(out, "out", (m, n), numpy.float32)
    for name, v in (("alpha", alpha), ("pair_scale", pair_scale)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite float, got {v!r}")
    if not (pair_scale > 0 and math.frexp(pair_scale)[0] == 0.5):
        raise ValueError(f"pair_scale must be a power of two (exact scaling), got {pair_scale!r}")
    C.check_device((("a", a), ("b", b), ("a8", a8), ("b8", b8), ("out", out)))
    C.check_size(m, n, max(k, k8))
    C.check_no_overlap(out, ldc, (("a", a, lda), ("b", b, ldb), ("a8", a8, lda8), ("b8", b8, ldb8)))
    if m == 0 or n == 0:
        return out
    args = GemmArgs(out.data.ptr, None, None, ldc, 0, 0, m, n, k, float(alpha), None, None, xt_pairs=1,
                    pair_scale=float(pair_scale), k8=k8, accumulate=int(bool(accumulate)))
    maps = tensor_map.pair_maps(a.data.ptr, lda, a_layout, b.data.ptr, ldb, a8.data.ptr, lda8, b8.data.ptr, ldb8,
                                m, n, k, k8, block_n)
    launch(config, maps, args, _stream_ptr(stream), a.device.id)
    return out
