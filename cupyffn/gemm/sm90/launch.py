"""Launches of the sm90 GEMM: the kernel arguments (:class:`GemmArgs`, a ctypes mirror), each variant's function
compiled on first use through the one RawModule loader (cupyffn/cuda/kernels.py compiled_module), and the engine's
prebuilt launches :class:`DgeluLaunch` (the fused GEMM1 + dgelu) and :class:`PairLaunch` (the fp16+fp8 pair).
No validation here: the engine owns its buffers and checks the shapes once; cupyffn/gemm/sm90/entry.py validates
for direct use."""

import ctypes
import functools

from ...cuda import kernels as _kernels

from . import tensor_map
from .config import (BLOCK_M, EPI_DGELU_BF16X3, EPI_DGELU_F16, EPI_DGELU_F16G, OP_BF16, OP_F16, OP_F16E4M3, SOURCE,
                     Sm90Config, budget_checks, check_config, choose_dgelu_config)

#: Tile order of the engine's fused launch (GemmArgs::raster): bands of 8 tile rows. Measured at T = 2048 and 8192
#: 1.6-3.8% faster than the column order for the fused kernel (docs/decisions/032-raster-bands.md); at T <= 1024 (8 tile
#: rows or fewer) it is the column order itself.
FUSED_RASTER = 8


class GemmArgs(ctypes.Structure):
    """Mirror of ``struct GemmArgs`` in kernels_cu/sm90/types.cuh (160 bytes)."""

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
    ]


def device_supported(device_id):
    """True on compute capability 9.0 (H100, H200): the sm_90a code runs only there."""
    import cupy

    return cupy.cuda.Device(device_id).compute_capability == "90"


def module(config, device_id):
    """The RawModule of `config`'s variant on `device_id`, compiled on first use (NVRTC takes ~0.3-3 s per variant,
    and a caller needs a few; CuPy's disk cache keeps each one for the next process)."""
    import cupy

    check_config(config)
    if not device_supported(device_id):
        cc = cupy.cuda.Device(device_id).compute_capability
        raise RuntimeError(f"the sm_90a GEMM needs a compute capability 9.0 GPU; device {device_id} has {cc}")
    return _kernels.compiled_module(SOURCE, (config.expression,), config.nvrtc_options, device_id, budget_checks())


@functools.lru_cache(maxsize=None)
def function(config, device_id):
    """The kernel of `config` (a RawKernel), compiled, allowed its dynamic shared memory."""
    import cupy
    from cupy_backends.cuda.api import driver

    mod = module(config, device_id)
    with cupy.cuda.Device(device_id):
        kernel = mod.get_function(config.expression)
        # above 48 KiB of dynamic shared memory needs the opt-in, on the very function we launch
        driver.funcSetAttribute(kernel.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                config.smem_bytes)
    return kernel


def grid(m, n, block_n, device_id):
    """Persistent grid: one CTA per output tile, at most one per multiprocessor."""
    return min(-(-m // BLOCK_M) * -(-n // block_n), _kernels.sm_count(device_id))


def rows_aligned(ptr, ld, rows, nbytes):
    """Every row of the float32 matrix at `ptr` (row stride `ld` elements) starts on an `nbytes` boundary."""
    return ptr % nbytes == 0 and (rows <= 1 or (4 * ld) % nbytes == 0)


def launch(config, maps, args, stream_ptr, device_id):
    """One launch of `config` on the tensor maps `maps` (holders of .desc) and `args` (GemmArgs): the driver copies
    the parameters at launch, so maps and args may be reused as soon as this returns."""
    from cupy_backends.cuda.api import driver

    kernel = function(config, device_id)
    argv = (ctypes.c_void_p * (len(maps) + 1))(*(ctypes.addressof(x.desc) for x in maps), ctypes.addressof(args))
    driver.launchKernel(kernel.kernel.ptr, grid(args.m, args.n, config.block_n, device_id), 1, 1, config.threads, 1,
                        1, config.smem_bytes, stream_ptr, ctypes.addressof(argv), 0)


class DgeluLaunch:
    """A prebuilt fused GEMM1 + dgelu launch of the engine: A [M, K] and B [K, N] (b_layout "kn": a weight as
    stored) 16-bit operands and the output at fixed addresses (tensor maps encoded once), linear1_out / tanh_inner
    set per call (set_activations: the staged epilogue where their rows allow it, else the direct one).

    ``epi``: EPI_DGELU_F16 (the "tf32" plan: fp16 operands, fp16 output scaled by the device state's
    2^state[slot], max |g| gathered into the state unless ``rescue``, the rescue launch of gemm_sm90.cu)
    or EPI_DGELU_BF16X3 (the bf16x3 plan: bf16 operands with K tripled, the three bf16 planes of the
    output side by side in each row; no scale: pass state_ptr, consts_ptr, acc_scale_ptr None).
    ``gelu_ptr``, ``ldg``, ``gelu_slot`` (EPI_DGELU_F16 only): also write gelu_out = 0.5 x (1 + t) there as fp16
    codes scaled by 2^state[gelu_slot], gathering its max into that slot unless ``rescue`` (EPI_DGELU_F16G: GEMM2's
    operand, formed in this epilogue instead of converted from the caller's gelu_out; the rescue launch then
    runs when either slot's exponent moved).
    ``warps``: with tanh_inner given and rows on 16-byte boundaries, the epilogue warps (the cooperative 128 x 128
    tile) instead of choose_config's staged schedule, for a one-plane epilogue (bit for bit the same out).
    The variants it runs: ``configs[has_t, rows_16b]`` (choose_dgelu_config)."""

    def __init__(self, a_ptr, lda, b_ptr, ldb, b_layout, out_ptr, ldc, m, n, k, *, state_ptr, consts_ptr,
                 acc_scale_ptr, slot, rescue, alpha_mask, device_id, epi=EPI_DGELU_F16, gelu_ptr=None, ldg=0,
                 gelu_slot=None, warps=False):
        if epi not in (EPI_DGELU_F16, EPI_DGELU_BF16X3):
            raise ValueError(f"epi must be EPI_DGELU_F16 or EPI_DGELU_BF16X3, got {epi!r}")
        if b_layout != "kn":
            raise ValueError(f"b_layout must be 'kn' (B [K, N], a weight as stored), got {b_layout!r}")
        if gelu_ptr is not None and (epi != EPI_DGELU_F16 or not state_ptr or gelu_slot is None or ldg != ldc):
            raise ValueError("gelu_ptr needs epi=EPI_DGELU_F16, a state_ptr, a gelu_slot and ldg == ldc (the staged "
                             "epilogue addresses both outputs' rows with ldc)")
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
        # per (tanh_inner given, rows on 16-byte boundaries): the variant, its function, dynamic shared memory,
        # grid, threads and kernel arguments (the tensor maps are the same for every variant)
        self.configs = {(has_t, rows_16b): choose_dgelu_config(m, n, sms, epi, tanh_inner=has_t, rows_16b=rows_16b,
                                                               warps=warps)
                        for has_t in (True, False) for rows_16b in (True, False)}
        self._maps = tensor_map.dgelu_maps(op, a_ptr, lda, b_ptr, ldb, m, n, k)
        self._argv = (ctypes.c_void_p * 3)(*(ctypes.addressof(x.desc) for x in self._maps),
                                           ctypes.addressof(self.args))
        self._variants = {key: (function(c, device_id).kernel.ptr, c.smem_bytes, grid(m, n, c.block_n, device_id),
                                c.threads)
                          for key, c in self.configs.items()}
        self.staged = True

    def set_activations(self, x_ptr, ldx, t_ptr, ldt):
        """linear1_out (and tanh_inner, or t_ptr 0: memory mode) of this call, fp32, row strides in elements
        (any: rows on 16-byte boundaries take the staged epilogue, others the direct one, with float pairs
        where they are 8-byte aligned, else single floats)."""
        self.args.x, self.args.ldx = x_ptr, ldx
        self.args.t, self.args.ldt = (t_ptr or None), (ldt if t_ptr else 0)
        given = [(p, ld) for p, ld in ((x_ptr, ldx), (t_ptr, ldt)) if p]
        self.staged = all(rows_aligned(p, ld, self.args.m, 16) for p, ld in given)
        self.args.xt_pairs = int(all(rows_aligned(p, ld, self.args.m, 8) for p, ld in given))

    def __call__(self, stream_ptr):
        from cupy_backends.cuda.api import driver

        function_ptr, smem, grid_size, threads = self._variants[self.args.t is not None, self.staged]
        driver.launchKernel(function_ptr, grid_size, 1, 1, threads, 1, 1, smem, stream_ptr,
                            ctypes.addressof(self._argv), 0)

    def node_params(self):
        """(function, grid, block, dynamic shared memory, argument pointer array) of this call's variant, as
        KernelLaunch.node_params (a call graph's node follows the variant set_activations chose)."""
        function_ptr, smem, grid_size, threads = self._variants[self.args.t is not None, self.staged]
        return function_ptr, grid_size, threads, smem, ctypes.addressof(self._argv)


class PairLaunch:
    """A prebuilt launch of the pair kernel at fixed operand addresses (tensor maps encoded once): fp32
    out = alpha (pair_scale A8 B8^T + A B^T) (+ out), alpha read from the device at ``alpha_ptr`` (the engine's
    consts) or the float ``alpha``. A [M, K] (a_layout "mk") or [K, M] ("km"), B [K, N] (b_layout "kn"), A8 [M, k8],
    B8 [N, k8]. The output and whether it accumulates are set per call (``args.c``, ``args.accumulate``).
    (block_n, pingpong): one of PAIR_SCHEDULES (choose_pair_config); raster: the tile order (0 down each column, R > 0
    bands of R tile rows: kernels_cu/sm90/scheduler.cuh)."""

    def __init__(self, a_ptr, lda, a_layout, b_ptr, ldb, b_layout, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8, *,
                 device_id, alpha=1.0, alpha_ptr=None, pair_scale=8.0, block_n=128, pingpong=False, out_ptr=None,
                 ldc=None, raster=0):
        if b_layout != "kn":
            raise ValueError(f"b_layout must be 'kn' (B [K, N], a weight as stored), got {b_layout!r}")
        self.config = check_config(Sm90Config(OP_F16E4M3, block_n, bool(pingpong), a_layout=a_layout))
        self.args = GemmArgs(out_ptr, None, None, n if ldc is None else ldc, 0, 0, m, n, k, alpha, None, alpha_ptr,
                             xt_pairs=1, raster=raster, pair_scale=pair_scale, k8=k8)
        self._maps = tensor_map.pair_maps(a_ptr, lda, a_layout, b_ptr, ldb, a8_ptr, lda8, b8_ptr, ldb8, m, n, k, k8,
                                          block_n)
        self._argv = (ctypes.c_void_p * 5)(*(ctypes.addressof(x.desc) for x in self._maps), ctypes.addressof(self.args))
        self.function = function(self.config, device_id).kernel.ptr
        self.smem = self.config.smem_bytes
        self.grid = grid(m, n, block_n, device_id)

    def __call__(self, stream_ptr):
        from cupy_backends.cuda.api import driver

        # The driver copies the parameters at launch: the maps and args may change as soon as this returns.
        driver.launchKernel(self.function, self.grid, 1, 1, self.config.threads, 1, 1, self.smem, stream_ptr,
                            ctypes.addressof(self._argv), 0)

    def node_params(self):
        """(function, grid, block, dynamic shared memory, argument pointer array), as KernelLaunch.node_params."""
        return self.function, self.grid, self.config.threads, self.smem, ctypes.addressof(self._argv)
