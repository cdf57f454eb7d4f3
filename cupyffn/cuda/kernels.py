"""The CUDA C kernels in ``kernels_cu/``: source assembly, NVRTC compilation, launches.

Sources are compiled lazily with :class:`cupy.RawModule` (NVRTC), once per device, and memoized
(:func:`compiled_module`, the one loader: the elementwise modules of MODULES and the sm90 GEMM variants of
cupyffn/gemm/sm90/ alike). The headers of ``kernels_cu/`` (``common.cuh``, ``sm90/*.cuh``) are pasted into
each source in Python (not ``#include``-d) because CuPy's disk cache is keyed by the source text: an edited
header must change the key.

Launches go through the driver API with an argument block built once per plan
(:class:`KernelLaunch`): a plan call only rewrites the pointers that changed, which keeps the host
cost of a launch at about a microsecond and works unchanged inside CUDA-graph capture.
"""

import ctypes
import functools
import os
import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: The split_e4m3 kernel the engine runs, per KIND (0: convert A / B, 1: dgelu): (variant, waves), waves =
#: gathering-pass grid in units of resident blocks (split_kernel); the variant is split_e4m3.cu's scheduling
#: (struct split::Variant, instantiation split_e4m3_kernel<10 * variant + KIND>). Measured on the H200
#: (docs/decisions/011-split-e4m3-schedules.md): KIND 0 pipelined, 1 sub-tile per step, 2 waves, 1.026x the first
#: kernel summed over T = 2048-8192 and its stages; KIND 1 the first kernel on 1 wave, 1.046x. Every variant wrote
#: identical bytes; the others were removed: no plan runs them (the note keeps their measurements).
SPLIT_VARIANT = {0: (1, 2), 1: (0, 1)}


def split_expression(kind):
    """Name expression of split_e4m3.cu's instantiation for `kind` (0 or 1): SPLIT_VARIANT's variant."""
    if kind not in SPLIT_VARIANT:
        raise ValueError(f"split_e4m3 has KIND 0 or 1, got {kind!r}")
    return f"split_e4m3_kernel<{10 * SPLIT_VARIANT[kind][0] + kind}>"


#: module name -> (file in kernels_cu/, kernel names to instantiate)
MODULES = {
    "convert": ("convert.cu", ("convert_kernel<0>", "convert_kernel<1>", "convert_kernel<2>", "convert_kernel<3>")),
    "dgelu": ("dgelu.cu", ("dgelu_kernel<0>", "dgelu_kernel<1>", "dgelu_kernel<2>", "dgelu_kernel<3>",
                           "dgelu_sums_kernel<0>", "dgelu_sums_kernel<1>", "dgelu_sums_kernel<2>",
                           "dgelu_sums_kernel<3>", "f16_decide_kernel")),
    "bias": ("bias.cu", ("colsum_kernel", "bias_rows_kernel")),
    "call_table": ("call_table.cu", ("store_call_table",)),
    "gelu_forward": ("gelu_forward.cu", ("gelu_forward_kernel<0>", "gelu_forward_kernel<1>",
                                         "gelu_forward_kernel<2>", "gelu_forward_kernel<3>")),
    "split_e4m3": ("split_e4m3.cu", (split_expression(0), split_expression(1))),
    "half": ("half.cu", ("to_half_kernel<0>", "to_half_kernel<1>", "gelu_half_kernel<0>", "gelu_half_kernel<1>")),
}

#: Options we pass; CuPy adds -arch, -ftz=true, its include paths and (unless given) --std=c++17.
NVRTC_OPTIONS = ("--std=c++17",)

#: Threads per block of every elementwise kernel (their __launch_bounds__).
BLOCK = 256
#: Maximum number of matrices one convert launch handles (kMaxJobs in convert.cu).
MAX_JOBS = 5
#: Slots of the fp16 scale state (kSlots in common.cuh); the state array holds 4 * STATE_SLOTS ints.
STATE_SLOTS = 8


def kernel_dir():
    """Folder holding the .cu sources: inside the installed package, or the repository's top level."""
    for candidate in (_HERE.parent / "kernels_cu", _HERE.parent.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cupyffn cannot find its CUDA sources (kernels_cu/common.cuh) next to the package or one "
        f"level above it ({_HERE}); the installation is incomplete")


_INCLUDE = re.compile(r'^#include "([^"]+)"\n', re.M)


@functools.lru_cache(maxsize=None)
def source(filename):
    """Full CUDA C text of kernels_cu/`filename` with its headers pasted in (source_with_common), read once."""
    return source_with_common(filename)


def source_with_common(filename, folder=None):
    """kernels_cu/`filename` with its headers pasted in (with_headers), read from `folder` (another kernels_cu
    folder: the tools' A/B of an older checkout's sources; default kernel_dir())."""
    folder = kernel_dir() if folder is None else Path(folder)
    text = (folder / filename).read_text()
    if '#include "common.cuh"' not in text:
        raise RuntimeError(f"{filename} must include common.cuh")
    return with_headers(text, folder)


def with_headers(text, folder=None):
    """CUDA C `text` with the headers it includes from kernels_cu/ (``#include "common.cuh"``, ...) pasted in place,
    each once, their own includes too (so CuPy's disk cache, which hashes the source text, sees an edited header)."""
    folder = kernel_dir() if folder is None else Path(folder)
    pasted = set()

    def paste(match):
        name = match.group(1)
        if name in pasted:
            return ""
        pasted.add(name)
        return _INCLUDE.sub(paste, (folder / name).read_text().replace("#pragma once\n", ""))

    return _INCLUDE.sub(paste, text)


@functools.lru_cache(maxsize=None)
def compiled_module(filename, expressions, options, device_id, checks=""):
    """The one RawModule loader: kernels_cu/`filename` (headers pasted: source_with_common) + `checks` compiled by
    NVRTC with `options` (CuPy adds -arch, -ftz=true, its includes) for the name `expressions` (template
    instantiations), on device `device_id`; memoized, and kept across processes by CuPy's disk cache."""
    import cupy

    with cupy.cuda.Device(device_id):
        kwargs = {}
        if any("<" in e for e in expressions):
            kwargs["name_expressions"] = expressions
        module = cupy.RawModule(code=source(filename) + checks, options=options, **kwargs)
        module.compile()
    return module


def _module(name, device_id):
    filename, expressions = MODULES[name]
    return compiled_module(filename, expressions, NVRTC_OPTIONS, device_id)


@functools.lru_cache(maxsize=None)
def get_function(name, expression, device_id):
    """The compiled kernel `expression` of module `name` on device `device_id` (a RawKernel)."""
    import cupy

    module = _module(name, device_id)
    with cupy.cuda.Device(device_id):
        return module.get_function(expression)


@functools.lru_cache(maxsize=None)
def blocks_per_sm(name, expression, device_id):
    """Resident blocks of BLOCK threads per multiprocessor for this kernel."""
    import cupy
    from cupy_backends.cuda.api import driver

    kernel = get_function(name, expression, device_id)
    with cupy.cuda.Device(device_id):
        return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, BLOCK, 0))


@functools.lru_cache(maxsize=None)
def sm_count(device_id):
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


class ConvertJob(ctypes.Structure):
    """Mirror of ``struct ConvertJob`` in convert.cu (96 bytes)."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("src2", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("src_ld", ctypes.c_longlong),
        ("src2_ld", ctypes.c_longlong),
        ("dst_ld", ctypes.c_longlong),
        ("part_stride", ctypes.c_longlong),
        ("rows", ctypes.c_longlong),
        ("cols", ctypes.c_int),
        ("pattern", ctypes.c_int),
        ("slot", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("block_begin", ctypes.c_int),
        ("block_count", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("unused", ctypes.c_int),
    ]


class ConvertJobs(ctypes.Structure):
    """Mirror of ``struct ConvertJobs`` in convert.cu."""

    _fields_ = [("job", ConvertJob * MAX_JOBS), ("count", ctypes.c_int), ("rescue", ctypes.c_int),
                ("counter", ctypes.c_int), ("slot_mask", ctypes.c_int), ("alpha_mask", ctypes.c_int),
                ("unused", ctypes.c_int)]


class DgeluJob(ctypes.Structure):
    """Mirror of ``struct DgeluJob`` in dgelu.cu (120 bytes)."""

    _fields_ = [
        ("grad_gelu", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("t", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("grad_gelu_ld", ctypes.c_longlong),
        ("x_ld", ctypes.c_longlong),
        ("t_ld", ctypes.c_longlong),
        ("dst_ld", ctypes.c_longlong),
        ("part_stride", ctypes.c_longlong),
        ("rows", ctypes.c_longlong),
        ("cols", ctypes.c_int),
        ("pattern", ctypes.c_int),
        ("slot", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("rescue", ctypes.c_int),
        ("counter", ctypes.c_int),
        ("alpha_mask", ctypes.c_int),
        ("unused", ctypes.c_int),
        ("colsum", ctypes.c_void_p),
    ]


class ColsumJob(ctypes.Structure):
    """Mirror of ``struct ColsumJob`` in bias.cu (56 bytes)."""

    _fields_ = [("src", ctypes.c_void_p), ("dst", ctypes.c_void_p), ("ld", ctypes.c_longlong),
                ("rows", ctypes.c_longlong), ("band", ctypes.c_longlong), ("cols", ctypes.c_int),
                ("vec", ctypes.c_int), ("accumulate", ctypes.c_int), ("col_blocks", ctypes.c_int)]


#: GEMMs of a CallTable (kCallGemms in call_table.cu).
CALL_GEMMS = 4


class GemmPointers(ctypes.Structure):
    """Mirror of ``struct GemmPointers`` in call_table.cu (24 bytes)."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p)]


class CallTable(ctypes.Structure):
    """Mirror of ``struct CallTable`` in call_table.cu: GEMM1..GEMM4's operand addresses of one call."""

    _fields_ = [("gemm", GemmPointers * CALL_GEMMS)]


class GeluForwardJob(ctypes.Structure):
    """Mirror of ``struct GeluForwardJob`` in gelu_forward.cu (112 bytes)."""

    _fields_ = [
        ("z", ctypes.c_void_p),
        ("t", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("z_ld", ctypes.c_longlong),
        ("t_ld", ctypes.c_longlong),
        ("g_ld", ctypes.c_longlong),
        ("dst_ld", ctypes.c_longlong),
        ("part_stride", ctypes.c_longlong),
        ("rows", ctypes.c_longlong),
        ("cols", ctypes.c_int),
        ("pattern", ctypes.c_int),
        ("slot", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("counter", ctypes.c_int),
        ("unused", ctypes.c_int),
        ("bias", ctypes.c_void_p),
    ]


class KernelLaunch:
    """One kernel with its argument block; ``args`` are ctypes objects the caller may update in place."""

    def __init__(self, kernel, *args):
        self.function = kernel.kernel.ptr
        self.args = args
        self._argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        self.grid = 1
        self.block = BLOCK

    def __call__(self, stream_ptr):
        from cupy_backends.cuda.api import driver

        driver.launchKernel(self.function, self.grid, 1, 1, self.block, 1, 1, 0, stream_ptr,
                            ctypes.addressof(self._argv), 0)

    def node_params(self):
        """(function, grid, block, dynamic shared memory, argument pointer array) of the launch as it stands: what
        a call graph's node of this launch is set to (cupyffn/cuda/call_graph.py)."""
        return self.function, self.grid, self.block, 0, ctypes.addressof(self._argv)


# ---------------------------------------------------------------------------------------------
# split_e4m3.cu: the "fp16+fp8" plan's conversion (fp16 hi, bf16x3 planes, e4m3 pairs)
# ---------------------------------------------------------------------------------------------
#: Maximum number of matrices one split_e4m3 launch handles (kSplitMaxJobs in split_e4m3.cu).
SPLIT_MAX_JOBS = 5
#: Tile edge of split_e4m3_kernel (a block step covers 64 columns and 64 or 128 rows, per variant).
SPLIT_TILE = 64


class SplitJob(ctypes.Structure):
    """Mirror of ``struct SplitJob`` in split_e4m3.cu (176 bytes)."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("src2", ctypes.c_void_p),
        ("src3", ctypes.c_void_p),
        ("f16", ctypes.c_void_p),
        ("x3", ctypes.c_void_p),
        ("e4n", ctypes.c_void_p),
        ("e4t", ctypes.c_void_p),
        ("src_ld", ctypes.c_longlong),
        ("src2_ld", ctypes.c_longlong),
        ("src3_ld", ctypes.c_longlong),
        ("f16_ld", ctypes.c_longlong),
        ("x3_ld", ctypes.c_longlong),
        ("x3_part_stride", ctypes.c_longlong),
        ("e4n_ld", ctypes.c_longlong),
        ("e4t_ld", ctypes.c_longlong),
        ("rows", ctypes.c_longlong),
        ("cols", ctypes.c_int),
        ("x3_pattern", ctypes.c_int),
        ("e4n_kpad", ctypes.c_int),
        ("e4n_order", ctypes.c_int),
        ("e4t_kpad", ctypes.c_int),
        ("e4t_order", ctypes.c_int),
        ("slot", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("vec_out", ctypes.c_int),
        ("block_begin", ctypes.c_int),
        ("block_count", ctypes.c_int),
    ]


class SplitJobs(ctypes.Structure):
    """Mirror of ``struct SplitJobs`` in split_e4m3.cu."""

    _fields_ = [("job", SplitJob * SPLIT_MAX_JOBS), ("count", ctypes.c_int), ("rescue", ctypes.c_int),
                ("counter", ctypes.c_int), ("slot_mask", ctypes.c_int), ("alpha_mask", ctypes.c_int),
                ("unused", ctypes.c_int), ("colsum", ctypes.c_void_p)]


def e4m3_kpad(k):
    """Padded K of an e4m3 pair buffer: round_up(k, 16); a row holds 2 * e4m3_kpad(k) bytes."""
    return -(-k // 16) * 16


class SplitSpec:
    """One matrix X[rows, cols] of a split_e4m3 launch and the encodings it writes (None: not written).

    f16: (dst, ld)                      fp16(x * 2^e) codes, row stride ld elements
    x3:  (dst, ld, part_stride, pattern) bf16x3 planes at dst + j * part_stride (elements), plane j = lo
                                        where bit j of pattern is set (as convert.cu's FMT_BF16X3)
    e4n: (dst, ld, kpad, order)         e4m3 pair natural [rows, 2 * kpad] bytes, kpad >= cols
    e4t: (dst, ld, kpad, order)         e4m3 pair transposed [cols, 2 * kpad] bytes, kpad >= rows
    (e4: order 0 = L8 in columns [0, K) and H8 in [kpad, kpad + K), order 1 = H8 first; dst, ld and
    kpad multiples of 16; the padding columns are never written: zero-fill them once.)
    slot: the scale slot (0 .. STATE_SLOTS - 1); kind (KIND 0 kernel only): 0 X = src, 1 X = gelu_out
    recomputed from linear1_out (src) and tanh_inner (src2, or recomputed). Sources are per call:
    split_set_sources.
    """

    def __init__(self, rows, cols, slot, kind=0, f16=None, x3=None, e4n=None, e4t=None):
        self.rows, self.cols, self.slot, self.kind = rows, cols, slot, kind
        self.f16, self.x3, self.e4n, self.e4t = f16, x3, e4n, e4t

    def written_bytes_per_element(self):
        return 2 * (self.f16 is not None) + 6 * (self.x3 is not None) + 2 * (self.e4n is not None) + \
            2 * (self.e4t is not None)

    def check(self, name):
        def bad(what):
            raise ValueError(f"{name}: {what}")

        for field in ("rows", "cols", "slot", "kind"):
            if not isinstance(getattr(self, field), int) or isinstance(getattr(self, field), bool):
                bad(f"{field} must be an int, got {getattr(self, field)!r}")
        if not (1 <= self.rows < 2**31 and 1 <= self.cols < 2**31):
            bad(f"rows and cols must be in [1, 2^31), got {self.rows} x {self.cols}")
        if not 0 <= self.slot < STATE_SLOTS:
            bad(f"slot must be in [0, {STATE_SLOTS}), got {self.slot}")
        if self.kind not in (0, 1):
            bad(f"kind must be 0 or 1, got {self.kind}")
        if self.written_bytes_per_element() == 0:
            bad("writes no encoding (f16, x3, e4n and e4t are all None)")
        if self.f16 is not None:
            if len(self.f16) != 2 or not self.f16[0] or self.f16[1] < self.cols:
                bad(f"f16 must be (dst != 0, ld >= cols={self.cols}), got {self.f16}")
        if self.x3 is not None:
            if len(self.x3) != 4 or not self.x3[0] or self.x3[1] < self.cols or self.x3[2] < self.cols \
                    or not 0 <= self.x3[3] < 8:
                bad(f"x3 must be (dst != 0, ld >= cols={self.cols}, part_stride >= cols, pattern in [0, 8)), "
                    f"got {self.x3}")
        for field, k in (("e4n", self.cols), ("e4t", self.rows)):
            spec = getattr(self, field)
            if spec is None:
                continue
            if len(spec) != 4:
                bad(f"{field} must be (dst, ld, kpad, order), got {spec}")
            dst, ld, kpad, order = spec
            if not dst or dst % 16 or ld % 16 or kpad % 16 or kpad < k or ld < 2 * kpad or order not in (0, 1):
                bad(f"{field} must be (dst, ld, kpad, order) with dst, ld and kpad multiples of 16, "
                    f"kpad >= {k} (its K), ld >= 2 * kpad and order 0 or 1; got {spec}")


def split_kernel(kind, device_id):
    """(RawKernel, gathering-pass grid) of split_e4m3 KIND `kind` on `device_id`: SPLIT_VARIANT's variant and
    waves; the grid is waves * SMs * resident blocks per SM (split_launch shares it out)."""
    expr = split_expression(kind)
    kernel = get_function("split_e4m3", expr, device_id)
    return kernel, SPLIT_VARIANT[kind][1] * sm_count(device_id) * blocks_per_sm("split_e4m3", expr, device_id)


def split_launch(kernel, jobs, total_blocks, rescue, counter, alpha_mask, state_ptr, consts_ptr):
    """One split_e4m3_kernel launch (split_e4m3.cu) for `jobs` (SplitSpec, or dicts of its arguments).

    Blocks are shared out in proportion to each job's bytes moved, each job at least one and at most one
    per 64 x 64 tile; the launch's grid is their sum. `rescue` 0 is the gathering pass (its last block
    decides the slots of all jobs; `counter` picks the arrival counter state[3 * STATE_SLOTS + counter]),
    1 the rescue pass (block 0 writes the alphas of the GEMMs in `alpha_mask`). `state_ptr` and
    `consts_ptr` are ctypes.c_void_p of the engine's state (int32[4 * STATE_SLOTS]) and consts (float32[8]).
    Set the sources before each call: split_set_sources(launch.args[0].job[k], ...).
    """
    jobs = [j if isinstance(j, SplitSpec) else SplitSpec(**j) for j in jobs]
    if not 1 <= len(jobs) <= SPLIT_MAX_JOBS:
        raise ValueError(f"jobs: 1 to {SPLIT_MAX_JOBS} matrices per split_e4m3 launch, got {len(jobs)}")
    for k, spec in enumerate(jobs):
        spec.check(f"jobs[{k}]")
    if rescue not in (0, 1):
        raise ValueError(f"rescue must be 0 or 1, got {rescue}")
    if not 0 <= counter < STATE_SLOTS:
        raise ValueError(f"counter must be in [0, {STATE_SLOTS}), got {counter}")
    if not 0 <= alpha_mask < 16:
        raise ValueError(f"alpha_mask must be in [0, 16), got {alpha_mask}")
    if total_blocks < len(jobs):
        raise ValueError(f"total_blocks must be at least the number of jobs ({len(jobs)}), got {total_blocks}")
    out = SplitJobs()
    out.count = len(jobs)
    out.rescue = rescue
    out.counter = counter
    out.slot_mask = 0
    out.alpha_mask = alpha_mask
    weights = [s.rows * s.cols * (4 + s.written_bytes_per_element()) for s in jobs]
    begin = 0
    for job, spec, weight in zip(out.job, jobs, weights):
        out.slot_mask |= 1 << spec.slot
        job.rows, job.cols, job.slot, job.kind = spec.rows, spec.cols, spec.slot, spec.kind
        aligned = True  # 8-byte stores of 4 fp16 / bf16 codes: every row (and plane) start 8-byte aligned
        if spec.f16 is not None:
            job.f16, job.f16_ld = spec.f16
            aligned = aligned and spec.f16[0] % 8 == 0 and spec.f16[1] % 4 == 0
        if spec.x3 is not None:
            job.x3, job.x3_ld, job.x3_part_stride, job.x3_pattern = spec.x3
            aligned = aligned and spec.x3[0] % 8 == 0 and spec.x3[1] % 4 == 0 and spec.x3[2] % 4 == 0
        if spec.e4n is not None:
            job.e4n, job.e4n_ld, job.e4n_kpad, job.e4n_order = spec.e4n
        if spec.e4t is not None:
            job.e4t, job.e4t_ld, job.e4t_kpad, job.e4t_order = spec.e4t
        job.vec_out = int(aligned)
        tiles = -(-spec.rows // SPLIT_TILE) * -(-spec.cols // SPLIT_TILE)
        job.block_begin = begin
        job.block_count = max(1, min(tiles, round(total_blocks * weight / sum(weights))))
        begin += job.block_count
    launch = KernelLaunch(kernel, out, state_ptr, consts_ptr)
    launch.grid = begin
    return launch


def split_set_sources(job, src, src2=None, src3=None, kind=None):
    """Point one SplitJob (launch.args[0].job[k]) at this call's fp32 sources, each (device address, row stride) or
    None, and set its vec flag (cols % 4 == 0, every source row 16-byte aligned). KIND 0: src = the matrix (kind 0)
    or linear1_out (kind 1, src2 = tanh_inner or None: recomputed). KIND 1: src = grad_gelu, src2 = linear1_out,
    src3 = tanh_inner or None. `kind` (KIND 0): None keeps the job's kind."""
    if src is None or not src[0]:
        raise ValueError("src must be (device address != 0, row stride)")
    if kind is not None:
        if kind not in (0, 1):
            raise ValueError(f"kind must be 0 or 1, got {kind}")
        job.kind = kind
    vec = job.cols % 4 == 0
    for name, s in (("src", src), ("src2", src2), ("src3", src3)):
        ptr, ld = (0, 0) if s is None else s
        if s is not None and (not ptr or ld < job.cols):
            raise ValueError(f"{name} must be (device address != 0, row stride >= cols={job.cols}), got {s}")
        setattr(job, name, ptr)
        setattr(job, name + "_ld", ld)
        if s is not None:
            vec = vec and ptr % 16 == 0 and (ld * 4) % 16 == 0
    job.vec = int(vec)


def cuda_include_dir():
    """Folder with cuda_fp16.h / cuda_bf16.h, for compiling kernels_cu/ with NVRTC outside CuPy (tests, tools; CuPy's
    own compiles find them): the pip CUDA runtime headers (cupy-cuda12x[ctk]), else a system toolkit (CUDA_PATH)."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            return str(found)
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    raise RuntimeError("the CUDA headers (cuda_fp16.h, cuda_bf16.h) were found neither by cuda.pathfinder "
                       "nor under CUDA_PATH, CUDA_HOME or /usr/local/cuda")
