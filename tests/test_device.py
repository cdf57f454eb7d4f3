"""cupyffn/cuda/device.py: the one reason every "no GPU" message gives. Where there is no GPU it says "no NVIDIA GPU
visible (<why>)", never CUDA's "driver version is insufficient" (what CuPy reports on a machine with no driver at
all); that message only for a GPU whose driver is older than CuPy's CUDA runtime.

The driver's answers are faked here (libcuda through ctypes), so every branch runs on any machine; the tests
marked "this machine" check the real answer where there is no driver (they skip where there is one)."""

import ctypes

import pytest

import cupyffn
from cupyffn.cuda import device as _device, libcuda as _libcuda


def _no_driver():
    try:
        _libcuda.library()
    except OSError:
        return True
    return False


needs_no_driver = pytest.mark.skipif(not _no_driver(), reason="this machine has an NVIDIA driver (libcuda.so.1)")


class _FakeDriver:
    """libcuda's cuInit / cuDeviceGetCount / cuDriverGetVersion answering as told."""

    def __init__(self, init=0, count=1, version=12020):
        self.init, self.count, self.version = init, count, version

    def function(self, name, argtypes):
        def cu_init(flags):
            return self.init

        def device_count(pointer):
            pointer._obj.value = self.count
            return 0

        def driver_version(pointer):
            pointer._obj.value = self.version
            return 0

        return {"cuInit": cu_init, "cuDeviceGetCount": device_count, "cuDriverGetVersion": driver_version}[name]


@pytest.fixture
def driver(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(_libcuda, "library", lambda: object())
    monkeypatch.setattr(_libcuda, "function", fake.function)
    monkeypatch.setattr(_libcuda, "error_name", lambda status: {999: "CUDA_ERROR_UNKNOWN"}.get(status, "?"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


class _InsufficientDriver(RuntimeError):
    """What CuPy raises (CUDARuntimeError) for cudaErrorInsufficientDriver."""

    status = 35

    def __str__(self):
        return "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


def test_no_driver_is_no_gpu_visible(monkeypatch):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(_libcuda, "library", missing)
    reason = _device.explain(_InsufficientDriver())
    assert reason == ("no NVIDIA GPU visible (no NVIDIA driver: libcuda.so.1: cannot open shared object file: "
                      "No such file or directory)")
    assert _device.explain(ImportError("No module named 'cupy'")) == reason  # no GPU: that comes first


def test_driver_without_a_device(driver, monkeypatch):
    driver.init = 100  # CUDA_ERROR_NO_DEVICE
    assert _device.driver_reason() == "no NVIDIA GPU visible (the NVIDIA driver is installed but reports no device)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _device.explain(_InsufficientDriver()) == ("no NVIDIA GPU visible (the NVIDIA driver is installed but "
                                                       "reports no device; CUDA_VISIBLE_DEVICES='')")
    driver.init, driver.count = 0, 0
    assert _device.driver_reason().startswith("no NVIDIA GPU visible (the NVIDIA driver is installed but reports no")


def test_driver_that_fails_to_initialize(driver):
    driver.init = 999
    assert _device.driver_reason() == ("no NVIDIA GPU visible (the NVIDIA driver failed to initialize: cuInit "
                                       "returned CUDA_ERROR_UNKNOWN (999))")


def test_a_gpu_with_a_driver_too_old_keeps_cudas_message(driver):
    reason = _device.explain(_InsufficientDriver())
    assert not reason.startswith("no NVIDIA GPU visible")
    assert reason.startswith("the NVIDIA driver (CUDA 12.2) is older than the CUDA runtime CuPy uses (CUDA ")
    assert "CUDA driver version is insufficient for CUDA runtime version" in reason and "update the driver" in reason


def test_a_gpu_without_cupy(driver):
    reason = _device.explain(ModuleNotFoundError("No module named 'cupy'"))
    assert reason.startswith("CuPy cannot be imported (ModuleNotFoundError: No module named 'cupy')")


def test_other_errors_are_reported_as_they_are(driver):
    assert _device.explain(RuntimeError("cudaErrorDevicesUnavailable:\n busy")) == \
        "RuntimeError: cudaErrorDevicesUnavailable: busy"


def test_cupy_missing_is_diagnosed(monkeypatch, driver):
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)  # `import cupy` raises ImportError
    assert _device.gpu_unavailable_reason().startswith("CuPy cannot be imported (")
    driver.init = 100
    assert _device.gpu_unavailable_reason().startswith("no NVIDIA GPU visible (")


@needs_no_driver
def test_this_machine_says_no_gpu_visible():
    reason = _device.gpu_unavailable_reason(run_kernel=True)
    assert reason.startswith("no NVIDIA GPU visible (no NVIDIA driver: "), reason
    assert "insufficient" not in reason


@needs_no_driver
def test_this_machine_plan_errors_say_no_gpu_visible():
    for device in (None, 0):
        with pytest.raises(RuntimeError) as info:
            cupyffn.GeluFFNBackward(8, 16, 32, device=device)
        message = str(info.value)
        assert message.startswith(f"GeluFFNBackward(device={device!r}) needs a GPU: no NVIDIA GPU visible (no NVIDIA "
                                  f"driver: "), message
        assert message.endswith("; pass device='cpu' for a plan that takes NumPy arrays")
        assert "insufficient" not in message


@needs_no_driver
def test_this_machine_bench_and_gpu_tests_give_the_same_reason():
    from benchmarks import gpu

    import conftest

    cupy, reason = gpu.gpu_or_reason()
    assert cupy is None and reason == _device.gpu_unavailable_reason(run_kernel=True)
    assert conftest.cuda_unusable_reason() == reason


def test_fake_driver_pointers_work_like_ctypes():  # the fakes above write through byref as libcuda would
    value = ctypes.c_int(0)
    _FakeDriver(count=3).function("cuDeviceGetCount", None)(ctypes.byref(value))
    assert value.value == 3
