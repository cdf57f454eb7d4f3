"""The CUDA driver (libcuda) through ctypes, for the few entry points CuPy does not wrap: tensor maps and cluster
occupancy (cupyffn/gemm/sm90/), stream capture and executable-graph updates (cupyffn/cuda/call_graph.py).

One library handle per process; each entry point is given its prototype once, by the module that uses it
(``function(name, argtypes)``); every one returns a CUresult, which ``check`` turns into a :class:`DriverError`
naming the call and the driver's error name. The names and structs used are the same under CUDA 12 and 13, so
no CUDA-version-specific Python package is needed.
"""

import ctypes
import threading

_lock = threading.Lock()
_library = None
_functions = {}


def library():
    """libcuda.so.1, loaded once."""
    global _library
    with _lock:
        if _library is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuGetErrorName.restype = ctypes.c_int
            _library = lib
    return _library


def has(name):
    """Whether this driver exports the entry point `name` (e.g. a newer versioned one)."""
    return hasattr(library(), name)


def function(name, argtypes):
    """The entry point `name` with its prototype (`argtypes`, returning a CUresult), set up on first use."""
    fn = _functions.get(name)
    if fn is None:
        fn = getattr(library(), name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        with _lock:
            _functions[name] = fn
    return fn


def error_name(status):
    """The driver's name of a CUresult (e.g. CUDA_ERROR_INVALID_VALUE), "?" if it has none."""
    name = ctypes.c_char_p()
    library().cuGetErrorName(status, ctypes.byref(name))
    return (name.value or b"?").decode()


class DriverError(RuntimeError):
    """A CUDA driver call returned an error: ``call``, ``status`` (the CUresult), and what it was asked to do."""

    def __init__(self, call, status, detail=""):
        self.call, self.status = call, status
        super().__init__(f"{call} failed with {error_name(status)} ({status}){detail}")


def check(status, call, detail=""):
    """Raise DriverError(call, status, detail) unless `status` is CUDA_SUCCESS (0)."""
    if status != 0:
        raise DriverError(call, status, detail)
