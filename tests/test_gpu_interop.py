"""torch and JAX arrays in and out through DLPack, zero-copy, on non-default streams."""

import os

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def _inputs(seed):
    return W.make_inputs((4, 75), 128, 512, xp=cupy, seed=seed)


def test_torch_in_and_out_on_a_side_stream():
    torch = pytest.importorskip("torch")
    from cupyffn.frameworks.torch_ops import cuda_stream

    inputs = _inputs(1)
    ref64 = W.reference(inputs, xp=cupy)
    cupy.cuda.Device().synchronize()  # inputs were made on CuPy's legacy stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        tensors = [torch.from_dlpack(inputs[n]).clone() for n in W.INPUT_NAMES]  # produced on `side`
        outs = [torch.full(tuple(s), float("nan"), device="cuda") for s in
                (tensors[1].shape, tensors[2].shape, tensors[3].shape)]
        stream = cuda_stream(0)  # torch's current stream, as a CuPy stream
        grads = cupyffn.gelu_ffn_backward(*tensors, out=outs, stream=stream)
        assert all(g is o for g, o in zip(grads, outs))
        copies = [o.clone() for o in outs]  # read on the same stream, no synchronization
    side.synchronize()
    assert cupy.from_dlpack(tensors[2]).data.ptr == int(tensors[2].data_ptr())  # zero-copy import
    for c, r, label in zip(copies, ref64, W.OUTPUT_NAMES):
        err = W.relative_l2(cupy.from_dlpack(c), r, xp=cupy)
        assert err <= 1e-4, f"{label}: {err}"


def test_torch_result_export_is_zero_copy():
    torch = pytest.importorskip("torch")
    inputs = _inputs(2)
    tensors = [torch.from_dlpack(inputs[n]) for n in W.INPUT_NAMES]
    grads = cupyffn.gelu_ffn_backward(*tensors)
    t = torch.from_dlpack(grads.grad_weight1)
    assert t.data_ptr() == grads.grad_weight1.data.ptr
    ref64 = W.reference(inputs, xp=cupy)
    assert W.relative_l2(grads.grad_weight1, ref64[1], xp=cupy) <= 1e-4


def test_jax_in_and_out():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    inputs = _inputs(3)
    arrays = [jax.device_put(numpy.asarray(cupy.asnumpy(inputs[n]))) for n in W.INPUT_NAMES]
    grads = cupyffn.gelu_ffn_backward(*arrays, precision="ieee")
    back = jnp.from_dlpack(grads.grad_weight2)
    ref64 = W.reference(inputs, xp=cupy)
    assert W.relative_l2(cupy.asarray(numpy.asarray(back)), ref64[2], xp=cupy) <= 5e-6
    assert W.relative_l2(grads.grad_hidden_states, ref64[0], xp=cupy) <= 5e-6
