"""cupyffn.jax on the GPU under jax.jit: XLA's stream and buffers, gradients against float64, the training example.

    PYTHONPATH=. python3 -m pytest tests/test_gpu_jax_jit.py

Every result is compared with the float64 NumPy reference of tests/test_jax_adapter.py (relative L2 within the
precision's contract).
"""

import importlib.util
import math
import os
from pathlib import Path

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts: leave the GPU to CuPy too
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupyffn  # noqa: E402
import cupyffn.jax as cj  # noqa: E402

pytestmark = pytest.mark.gpu

LEAD, DIM, HIDDEN = (2, 256), 256, 1024
C = math.sqrt(2.0 / math.pi)


@pytest.fixture(scope="module")
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend here: {' '.join(str(e).split())[:200]}")


def reference(x, w1, w2, r):
    """float64 (output, grad_x, grad_w1, grad_w2) of loss = sum(output * r)."""
    x, w1, w2, r = (numpy.asarray(a, dtype=numpy.float64) for a in (x, w1, w2, r))
    lead = x.shape[:-1]
    x2, r2 = x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])
    z = x2 @ w1.T
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    dz = (r2 @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z))
    return (g @ w2.T).reshape(r.shape), (dz @ w1).reshape(lead + (x.shape[-1],)), dz.T @ x2, r2.T @ g


def make(rng, device, lead=LEAD):
    host = (rng.standard_normal(lead + (DIM,)), rng.uniform(-1, 1, (HIDDEN, DIM)) / math.sqrt(DIM),
            rng.uniform(-1, 1, (DIM, HIDDEN)) / math.sqrt(HIDDEN), rng.standard_normal(lead + (DIM,)))
    host = tuple(a.astype(numpy.float32) for a in host)
    return host, tuple(jax.device_put(a, device) for a in host)


def rel(a, ref):
    a = numpy.asarray(a)
    assert a.dtype == numpy.float32 and a.shape == ref.shape
    return float(numpy.linalg.norm(a.astype(numpy.float64) - ref) / numpy.linalg.norm(ref))


@pytest.mark.parametrize("precision", tuple(cupyffn.PRECISIONS))
def test_jit_grad_and_value_and_grad_match_float64(rng, gpu, precision):
    host, (x, w1, w2, r) = make(rng, gpu)
    refs = reference(*host)
    contract = cupyffn.PRECISIONS[precision].contract

    def loss(x, w1, w2):
        return (cj.gelu_ffn(x, w1, w2, precision) * r).sum()

    y = jax.jit(lambda x, w1, w2: cj.gelu_ffn(x, w1, w2, precision))(x, w1, w2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
    value, grads2 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
    assert rel(y, refs[0]) <= contract
    for results in (grads, grads2):
        errors = [rel(a, b) for a, b in zip(results, refs[1:])]
        assert all(e <= contract for e in errors), errors
    assert all(a.devices() == {gpu} for a in (y, value) + tuple(grads))


def test_runs_on_xlas_stream_in_order_with_the_program(rng, gpu, monkeypatch):
    """Inside one jitted program, cupyffn reads an input XLA has just computed (after long work) and its
    output feeds later XLA ops: correct values need cupyffn's work ordered on XLA's stream both ways."""
    streams = []
    original = cj._gelu_ffn_forward

    def spy(*args, stream=None, **kwargs):
        streams.append(stream)
        return original(*args, stream=stream, **kwargs)

    monkeypatch.setattr(cj, "_gelu_ffn_forward", spy)
    host, (x, w1, w2, r) = make(rng, gpu)
    refs = reference(*host)
    busy = jax.device_put(numpy.random.default_rng(1).standard_normal((4096, 4096)).astype(numpy.float32), gpu)

    @jax.jit
    def program(x, w1, w2, busy):
        s = jax.lax.fori_loop(0, 10, lambda i, b: jnp.tanh(b @ b), busy).sum()
        x_late = jnp.where(s > -1e30, x, jnp.nan)  # x's value only lands after the busy work
        y = cj.gelu_ffn(x_late, w1, w2, "ieee")
        return y * 2.0  # an XLA op reading cupyffn's output

    y2 = program(x, w1, w2, busy)
    assert rel(y2 / 2.0, refs[0]) <= cupyffn.PRECISIONS["ieee"].contract
    import cupy

    assert len(streams) == 1 and streams[0] is not None
    assert streams[0].ptr not in (0, cupy.cuda.Stream.null.ptr)  # XLA's own stream, not a default stream


def test_eager_and_vmap_on_the_gpu(rng, gpu):
    host, (x, w1, w2, r) = make(rng, gpu, lead=(3, 64))
    refs = reference(*host)
    contract = cupyffn.PRECISIONS["bf16x3"].contract
    assert rel(cj.gelu_ffn(x, w1, w2), refs[0]) <= contract
    assert rel(jax.jit(jax.vmap(lambda xi: cj.gelu_ffn(xi, w1, w2)))(x), refs[0]) <= contract
    _, grads = jax.value_and_grad(lambda w1, w2: (cj.gelu_ffn(x, w1, w2) * r).sum(), argnums=(0, 1))(w1, w2)
    assert rel(grads[0], refs[2]) <= contract and rel(grads[1], refs[3]) <= contract


def test_jitted_training_example_learns(gpu):
    path = Path(__file__).resolve().parent.parent / "examples" / "train_jax.py"
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_jax", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=150, device="gpu")
    assert len(losses) == 150 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last / first < 0.5, (losses[:10], losses[-10:])
