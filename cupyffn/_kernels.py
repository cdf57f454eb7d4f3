"""The CUDA C kernels in ``kernels_cu/``: source assembly, NVRTC compilation, launches.

Sources are compiled lazily with :class:`cupy.RawModule` (NVRTC), once per device, and memoized.
``common.cuh`` is pasted into each source in Python (not ``#include``-d) because CuPy's disk cache
is keyed by the source text: an edited header must change the key.

Launches go through the driver API with an argument block built once per plan
(:class:`KernelLaunch`): a plan call only rewrites the pointers that changed, which keeps the host
cost of a launch at about a microsecond and works unchanged inside CUDA-graph capture.
"""

import ctypes
import functools
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: module name -> (file in kernels_cu/, kernel names to instantiate)
MODULES = {
    "convert": ("convert.cu", ("convert_kernel<0>", "convert_kernel<1>", "convert_kernel<2>", "convert_kernel<3>")),
    "dgelu": ("dgelu.cu", ("dgelu_kernel<0>", "dgelu_kernel<1>", "dgelu_kernel<2>", "dgelu_kernel<3>")),
    "gelu_forward": ("gelu_forward.cu", ("gelu_forward_kernel<0>", "gelu_forward_kernel<1>",
                                         "gelu_forward_kernel<2>", "gelu_forward_kernel<3>")),
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
    for candidate in (_HERE / "kernels_cu", _HERE.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cupyffn cannot find its CUDA sources (kernels_cu/common.cuh) next to the package or one "
        f"level above it ({_HERE}); the installation is incomplete")


@functools.lru_cache(maxsize=None)
def module_source(name):
    """Full CUDA C text of module `name` with common.cuh pasted in."""
    return source_with_common(MODULES[name][0])


def source_with_common(filename):
    """kernels_cu/`filename` with common.cuh pasted in place of its #include (so CuPy's disk cache, which
    hashes the source text, sees an edited header)."""
    folder = kernel_dir()
    common = (folder / "common.cuh").read_text().replace("#pragma once\n", "")
    text = (folder / filename).read_text()
    include = '#include "common.cuh"'
    if include not in text:
        raise RuntimeError(f"{filename} must include common.cuh")
    return text.replace(include, common, 1)


@functools.lru_cache(maxsize=None)
def _module(name, device_id):
    import cupy

    _, expressions = MODULES[name]
    with cupy.cuda.Device(device_id):
        kwargs = {}
        if any("<" in e for e in expressions):
            kwargs["name_expressions"] = expressions
        module = cupy.RawModule(code=module_source(name), options=NVRTC_OPTIONS, **kwargs)
        module.compile()
    return module


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
    """Mirror of ``struct DgeluJob`` in dgelu.cu (112 bytes)."""

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
    ]


class GeluForwardJob(ctypes.Structure):
    """Mirror of ``struct GeluForwardJob`` in gelu_forward.cu (104 bytes)."""

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
