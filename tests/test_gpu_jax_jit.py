"""cupyffn.jax on the GPU under jax.jit: XLA's stream and buffers, gradients against float64, the training example.

    PYTHONPATH=. python3 -m pytest tests/test_gpu_jax_jit.py

Every result is compared with the float64 NumPy reference of tests/test_jax_adapter.py, imported from there
(relative L2 within the precision's contract).
"""

import math
import os

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts: leave the GPU to CuPy too
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupyffn  # noqa: E402
import cupyffn.jax as cj  # noqa: E402
import test_jax_adapter as adapter  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative import)
from test_examples import load as load_example  # noqa: E402
from test_jax_adapter import reference, rel  # noqa: E402  (reference: checked there by finite differences)

pytestmark = pytest.mark.gpu

LEAD, DIM, HIDDEN = (2, 256), 256, 1024


@pytest.fixture(scope="module")
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend here: {' '.join(str(e).split())[:200]}")


def make(rng, device, lead=LEAD):
    return adapter.make(rng, device, lead, DIM, HIDDEN)


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
    losses = load_example("train_jax").main(steps=150, device="cuda")
    assert len(losses) == 150 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last / first < 0.5, (losses[:10], losses[-10:])
