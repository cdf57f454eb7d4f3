"""Shared test configuration.

* Tests marked ``gpu`` (the marker is registered in setup.cfg; GPU test modules set
  ``pytestmark = pytest.mark.gpu``) are skipped, with the reason, when no CUDA device is usable.
  The device check runs once per session and only when some collected test carries the marker;
  cupy is imported inside it, so this file also loads where cupy is not installed.
* The ``rng`` fixture gives each test its own ``numpy.random.Generator`` seeded from the test's
  node id, so every test sees the same data on every run and on every machine.
"""

import functools
import zlib

import numpy
import pytest


@functools.lru_cache(maxsize=None)
def cuda_unusable_reason():
    """None when a CUDA device can run a kernel through CuPy, else a one-line reason."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if count <= 0:
            return "device count 0"
        probe = cupy.arange(8, dtype=cupy.float32)
        total = float((probe * 2).sum())  # compiles and runs a kernel, copies back
        if total != 56.0:
            return f"a test kernel returned {total}, expected 56.0"
    except Exception as e:  # ImportError, CUDARuntimeError, CompileException, ...
        text = " ".join(str(e).split()) or "(no message)"
        return f"{type(e).__name__}: {text}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = cuda_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no CUDA device: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def seed_for(nodeid):
    """The seed the ``rng`` fixture uses for a test node id (crc32 of its UTF-8 bytes)."""
    return zlib.crc32(nodeid.encode("utf-8"))


@pytest.fixture
def rng(request):
    """numpy.random.Generator seeded from this test's node id (reproducible per test)."""
    return numpy.random.default_rng(seed_for(request.node.nodeid))
