"""Is a CUDA GPU usable here, and if not, why: the one place every "no GPU" message comes from.

CuPy alone cannot say: on a machine with no NVIDIA driver at all its first runtime call fails with
cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version", which blames a
driver that does not exist. So when CuPy cannot use a device, the driver is asked directly (libcuda through
ctypes, no CuPy needed) and the reason names what is actually missing:

* no NVIDIA driver (libcuda.so.1 cannot be loaded), the driver failing to initialize, or a driver that
  reports no device: "no NVIDIA GPU visible (<why>)";
* a GPU and driver but no importable CuPy: "CuPy cannot be imported (<error>)";
* a GPU whose driver is older than CuPy's CUDA runtime: CUDA's own insufficient-driver message, with both
  versions (the one case where that message is true);
* anything else: the exception's type and message.

The working path never touches ctypes: only a failure is diagnosed.
"""

import ctypes
import os

from . import libcuda as _libcuda

NO_GPU = "no NVIDIA GPU visible"

_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver (the runtime's numbering)


def _one_line(error):
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text}"


def _cuda_version(v):
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_reason():
    """None when the NVIDIA driver loads and reports at least one device, else "no NVIDIA GPU visible (<why>)".

    Asks libcuda directly (cuInit, cuDeviceGetCount), so it works without CuPy.
    """
    try:
        _libcuda.library()
    except OSError as e:
        return f"{NO_GPU} (no NVIDIA driver: {' '.join(str(e).split()) or 'libcuda.so.1 cannot be loaded'})"
    try:
        status = _libcuda.function("cuInit", [ctypes.c_uint])(0)
        if status == _CUDA_ERROR_NO_DEVICE:
            return f"{NO_GPU} (the NVIDIA driver is installed but reports no device{_visible_devices_note()})"
        if status != 0:
            return (f"{NO_GPU} (the NVIDIA driver failed to initialize: cuInit returned "
                    f"{_libcuda.error_name(status)} ({status}){_visible_devices_note()})")
        count = ctypes.c_int(0)
        status = _libcuda.function("cuDeviceGetCount", [ctypes.POINTER(ctypes.c_int)])(ctypes.byref(count))
        if status != 0:
            return f"{NO_GPU} (cuDeviceGetCount returned {_libcuda.error_name(status)} ({status}))"
        if count.value < 1:
            return f"{NO_GPU} (the NVIDIA driver is installed but reports no device{_visible_devices_note()})"
    except (OSError, AttributeError) as e:  # a libcuda without these entry points: not a usable driver
        return f"{NO_GPU} (libcuda.so.1 loads but is not usable: {_one_line(e)})"
    return None


def _visible_devices_note():
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f"; CUDA_VISIBLE_DEVICES={value!r}"


def _driver_version():
    """The CUDA version the driver supports, as "12.2", or None if it cannot say."""
    try:
        v = ctypes.c_int(0)
        if _libcuda.function("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])(ctypes.byref(v)) == 0:
            return _cuda_version(v.value)
    except (OSError, AttributeError):
        pass
    return None


def explain(error):
    """A one-line reason for `error`, raised while trying to use a GPU through CuPy (ImportError,
    CUDARuntimeError, ...): what the driver says first (module docstring), then the error itself."""
    reason = driver_reason()
    if reason is not None:
        return reason
    if isinstance(error, ImportError):
        return f"CuPy cannot be imported ({_one_line(error)}); cupyffn's GPU path needs CuPy (cupy-cuda12x)"
    if getattr(error, "status", None) == _CUDA_ERROR_INSUFFICIENT_DRIVER:  # a GPU, and a driver too old for CuPy
        runtime = None
        try:
            import cupy

            runtime = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        except Exception:
            pass
        return (f"the NVIDIA driver (CUDA {_driver_version() or '?'}) is older than the CUDA runtime CuPy uses "
                f"(CUDA {runtime or '?'}): {_one_line(error)}; update the driver")
    return _one_line(error)


def gpu_unavailable_reason(run_kernel=False):
    """None when CuPy can use a CUDA device (and, with run_kernel=True, run a small kernel on it and read the
    result back), else a one-line reason (module docstring)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:  # CUDA reports no device as an error; a guard
            return driver_reason() or f"{NO_GPU} (CuPy reports 0 devices)"
        if run_kernel:
            total = float((cupy.arange(8, dtype=cupy.float32) * 2).sum())  # compiles, runs, copies back
            if total != 56.0:
                return f"a test kernel on the GPU returned {total}, expected 56.0"
    except Exception as e:  # ImportError, CUDARuntimeError, a compile error, ...
        return explain(e)
    return None
