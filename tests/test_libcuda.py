"""cupyffn/cuda/libcuda.py: the driver error and the entry-point cache (the library itself only where a driver is
installed: on a machine without one those tests skip, saying so)."""

import ctypes

import pytest

from cupyffn.cuda import libcuda as _libcuda


def test_check_passes_success_and_names_a_failure(monkeypatch):
    _libcuda.check(0, "cuAnything")  # CUDA_SUCCESS: nothing raised, the library not needed
    monkeypatch.setattr(_libcuda, "error_name", lambda status: {1: "CUDA_ERROR_INVALID_VALUE"}[status])
    with pytest.raises(_libcuda.DriverError) as info:
        _libcuda.check(1, "cuTensorMapEncodeTiled", " for a [3, 5] matrix")
    assert str(info.value) == "cuTensorMapEncodeTiled failed with CUDA_ERROR_INVALID_VALUE (1) for a [3, 5] matrix"
    assert info.value.call == "cuTensorMapEncodeTiled" and info.value.status == 1
    assert isinstance(info.value, RuntimeError)


def test_call_graph_and_sm90_share_the_error():
    from cupyffn.cuda import call_graph as _call_graph

    assert _call_graph.DriverError is _libcuda.DriverError


@pytest.fixture
def driver():
    try:
        return _libcuda.library()
    except OSError as e:
        pytest.skip(f"no CUDA driver on this machine (libcuda.so.1: {e})")


def test_error_names_and_cached_prototypes(driver):
    assert _libcuda.error_name(1) == "CUDA_ERROR_INVALID_VALUE"
    assert _libcuda.error_name(999) in ("CUDA_ERROR_UNKNOWN", "?")
    argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn = _libcuda.function("cuDriverGetVersion", argtypes)
    assert _libcuda.function("cuDriverGetVersion", argtypes) is fn and fn.restype is ctypes.c_int
    version = ctypes.c_int()
    _libcuda.check(fn(ctypes.byref(version)), "cuDriverGetVersion")  # needs no context
    assert version.value >= 12000
    assert _libcuda.has("cuDriverGetVersion") and not _libcuda.has("cuNoSuchEntryPoint")
