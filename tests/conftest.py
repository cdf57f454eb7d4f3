"""Shared test configuration.

* Tests marked ``gpu`` (the marker is registered in setup.cfg; GPU test modules set
  ``pytestmark = pytest.mark.gpu``) are skipped, with the reason, when no CUDA device is usable.
  The device check runs once per session and only when some collected test carries the marker;
  the reason is cupyffn's own (cupyffn/cuda/device.py: "no NVIDIA GPU visible (...)" where there is
  none, CUDA's driver message only for a GPU whose driver is too old), and cupy is imported inside
  it, so this file also loads where cupy is not installed.
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
    from cupyffn.cuda import device as _device

    return _device.gpu_unavailable_reason(run_kernel=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = cuda_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


def seed_for(nodeid):
    """The seed the ``rng`` fixture uses for a test node id (crc32 of its UTF-8 bytes)."""
    return zlib.crc32(nodeid.encode("utf-8"))


@pytest.fixture
def rng(request):
    """numpy.random.Generator seeded from this test's node id (reproducible per test)."""
    return numpy.random.default_rng(seed_for(request.node.nodeid))


class EntryCounter:
    """How many torch-layer calls took each entry point: the eager autograd.Function, or the custom operators.

    It counts the forward body (`torch_ops.forward_impl`, run by both) and the eager Function's forward, so
    operator calls = bodies - eager. Both run outside dynamo's tracing (the operator's body at run time of a compiled
    graph too), and a fake tensor's operator call runs no body. The bodies are found through the module at call
    time, so wrapping the module attribute counts every call."""

    def __init__(self, monkeypatch):
        from cupyffn.frameworks import torch_ops

        self.bodies = self.eager = 0
        body, eager_forward = torch_ops.forward_impl, torch_ops.EagerGeluFFN.forward

        def counted_body(*args):
            self.bodies += 1
            return body(*args)

        def counted_eager_forward(ctx, *args):
            self.eager += 1
            return eager_forward(ctx, *args)

        monkeypatch.setattr(torch_ops, "forward_impl", counted_body)
        monkeypatch.setattr(torch_ops.EagerGeluFFN, "forward", staticmethod(counted_eager_forward))

    def counts(self):
        return {"eager": self.eager, "operator": self.bodies - self.eager}


@pytest.fixture
def entry_counter(monkeypatch):
    """An EntryCounter, from zero, for this test."""
    return EntryCounter(monkeypatch)
