"""cupyffn.jax.gelu_ffn with biases and bfloat16 / float16 activations (the 16-bit/bias plans), on CPU JAX and on
GPU JAX (marked gpu): values and gradients against float64, and the accuracy contract relative to the same
computation written in plain JAX with the same dtypes (docs/precisions.md, "16-bit activations and biases")."""

import math
import os

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts: leave the GPU to CuPy too
jax = pytest.importorskip(
    "jax", reason="jax not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
jnp = pytest.importorskip("jax.numpy")

import cupyffn  # noqa: E402
import cupyffn.jax as cj  # noqa: E402
import test_jax_adapter as adapter  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative import)

DEVICES = adapter.DEVICES
device = adapter.device  # the fixture (cpu or gpu), used by name

C = math.sqrt(2.0 / math.pi)
SIZES = {"cpu": (96, 64, 256), "gpu": (1024, 1024, 4096)}  # T, D, H
# (activation dtype, weight dtype)
DTYPES = [("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"), ("float16", "float16"),
          ("float32", "float32")]


def make(device, seed=0, T=None):
    """Host float64 (x, w1, w2, b1, b2, r) drawn like an nn.Linear model's, and a closure placing them in dtypes."""
    kind = "cpu" if device.platform == "cpu" else "gpu"
    t, D, H = SIZES[kind]
    T = t if T is None else T
    rng = numpy.random.default_rng(seed)
    host = (rng.standard_normal((T, D)), rng.uniform(-1, 1, (H, D)) / math.sqrt(D), rng.uniform(-1, 1, (D, H)) /
            math.sqrt(H), rng.uniform(-1, 1, H) / math.sqrt(D), rng.uniform(-1, 1, D) / math.sqrt(H),
            rng.standard_normal((T, D)))

    def place(act, wt):
        x, w1, w2, b1, b2, r = host
        put = lambda a, dt: jax.device_put(jnp.asarray(a.astype(numpy.float32)).astype(dt), device)  # noqa: E731
        return put(x, act), put(w1, wt), put(w2, wt), put(b1, wt), put(b2, wt), put(r, act)

    return host, place


def reference(x, w1, w2, b1, b2, r):
    """float64 (output, grad_x, grad_w1, grad_w2, grad_b1, grad_b2) of sum(output * r), from the arguments'
    values (rounded to their dtypes)."""
    x, w1, w2, b1, b2, r = (numpy.asarray(a).astype(numpy.float64) for a in (x, w1, w2, b1, b2, r))
    z = x @ w1.T + b1
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    dz = (r @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z))
    return g @ w2.T + b2, dz @ w1, dz.T @ x, r.T @ g, dz.sum(0), r.sum(0)


def plain(x, w1, w2, b1, b2):
    """The same layer in plain JAX as autocast computes it: weights and biases rounded to the activation dtype."""
    act = x.dtype
    z = x @ w1.astype(act).T + b1.astype(act)
    return jax.nn.gelu(z, approximate=True) @ w2.astype(act).T + b2.astype(act)


def rel(a, ref):
    a = numpy.asarray(a).astype(numpy.float64)
    assert numpy.isfinite(a).all()
    return float(numpy.linalg.norm(a - ref) / numpy.linalg.norm(ref))


def loss(f, r):
    return lambda *args: (f(*args).astype(jnp.float32) * r.astype(jnp.float32)).sum()


def ours(x, w1, w2, b1, b2):
    return cj.gelu_ffn(x, w1, w2, bias1=b1, bias2=b2)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("act,wt", DTYPES)
def test_values_dtypes_and_accuracy_against_plain_jax(device, act, wt):
    host, place = make(device)
    x, w1, w2, b1, b2, r = args = place(act, wt)
    refs = reference(*args)
    y = jax.jit(ours)(x, w1, w2, b1, b2)
    grads = jax.jit(jax.grad(loss(ours, r), argnums=range(5)))(x, w1, w2, b1, b2)
    assert y.dtype == act and y.shape == x.shape and y.devices() == {device}
    assert [str(g.dtype) for g in grads] == [act, wt, wt, wt, wt]
    mine = [rel(a, ref) for a, ref in zip((y,) + tuple(grads), refs)]
    y_plain = plain(x, w1, w2, b1, b2)
    theirs = [rel(a, ref) for a, ref in zip((y_plain,) + tuple(jax.grad(loss(plain, r), argnums=range(5))(
        x, w1, w2, b1, b2)), refs)]
    if act == "float32":  # float32 with biases: the device's default precision's contract
        default = cupyffn.CPU_DEFAULT_PRECISION if device.platform == "cpu" else cupyffn.DEFAULT_PRECISION
        assert max(mine) <= cupyffn.PRECISIONS[default].contract, (default, mine)
    else:  # within 1.25x of plain JAX's error in the same dtypes (or at the dtype's own rounding)
        floor = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}[act]
        assert all(m <= max(1.25 * t, floor) for m, t in zip(mine, theirs)), (mine, theirs)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_one_bias_and_its_gradient(device):
    _, place = make(device)
    x, w1, w2, b1, b2, r = place("bfloat16", "float32")
    refs = reference(x, w1, w2, b1, 0 * b2, r)
    f = lambda x, w1, w2, b1: cj.gelu_ffn(x, w1, w2, bias1=b1)  # noqa: E731
    y, pullback = jax.vjp(f, x, w1, w2, b1)
    grads = pullback(r)
    assert len(grads) == 4 and grads[3].shape == b1.shape and grads[3].dtype == jnp.float32
    assert rel(y, refs[0]) < 2e-2 and rel(grads[3], refs[4]) < 2e-2 and rel(grads[0], refs[1]) < 2e-2
    # only bias2: no bias1 gradient to return, bias2's is the sum of the cotangent over tokens
    g2 = jax.grad(loss(lambda b2: cj.gelu_ffn(x, w1, w2, bias2=b2), r))(b2)
    assert rel(g2, refs[5]) < 1e-2


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_zero_tokens_with_biases(device):
    _, place = make(device, T=0)
    x, w1, w2, b1, b2, r = place("bfloat16", "float32")
    y = ours(x, w1, w2, b1, b2)
    grads = jax.grad(lambda *a: ours(*a).astype(jnp.float32).sum(), argnums=range(5))(x, w1, w2, b1, b2)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert [g.shape for g in grads] == [a.shape for a in (x, w1, w2, b1, b2)]
    assert all(float(jnp.abs(g.astype(jnp.float32)).max(initial=0)) == 0.0 for g in grads[1:])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_argument_errors_with_biases(device):
    _, place = make(device)
    x, w1, w2, b1, b2, _ = place("bfloat16", "float32")
    with pytest.raises(ValueError, match=r"bias1 must have shape \((256|4096),\); got"):
        ours(x, w1, w2, b2, b2)
    with pytest.raises(TypeError, match=r"bias2 must be float32 \(weight1's dtype\); got bfloat16"):
        ours(x, w1, w2, b1, b2.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="weight1 must be float32 or bfloat16 with bfloat16 activations; got "
                                        "float16"):
        ours(x, w1.astype(jnp.float16), w2, b1, b2)
    with pytest.raises(ValueError, match="pass precision=None"):
        cj.gelu_ffn(x, w1, w2, "tf32")
    with pytest.raises(TypeError, match=r"bias1 must be float32 \(weight1's dtype\); got bfloat16"):
        ours(x, w1, w2, b1.astype(jnp.bfloat16), b2)
    with pytest.raises(ValueError, match="bias1 must have shape"):  # at trace time under jit
        jax.jit(ours)(x, w1, w2, b2, b2)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_float32_biases_in_every_precision(device):
    """float32 activations with biases run the float32 engine in any precision (jit and grad), each within its
    contract; tf32 measurably less exact than ieee."""
    _, place = make(device)
    args = place("float32", "float32")
    x, w1, w2, b1, b2, r = args
    refs = reference(*args)
    errors = {}
    for precision in cupyffn.PRECISIONS:
        f = lambda x, w1, w2, b1, b2: cj.gelu_ffn(x, w1, w2, precision, bias1=b1, bias2=b2)  # noqa: E731
        y = jax.jit(f)(x, w1, w2, b1, b2)
        grads = jax.jit(jax.grad(loss(f, r), argnums=range(5)))(x, w1, w2, b1, b2)
        errors[precision] = max(rel(a, ref) for a, ref in zip((y,) + tuple(grads), refs))
        assert errors[precision] <= cupyffn.PRECISIONS[precision].contract, errors
    assert errors["ieee"] < 5e-6 < 1e-4 < errors["tf32"], errors


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_vmap_with_biases_runs_one_call_per_element(device):
    _, place = make(device, T=48)
    x, w1, w2, b1, b2, _ = place("bfloat16", "float32")
    xs = x.reshape(3, 16, -1)
    y = jax.jit(jax.vmap(lambda xi: ours(xi, w1, w2, b1, b2)))(xs)
    whole_y = ours(x, w1, w2, b1, b2).astype(jnp.float32)
    # per element: the same sums, perhaps split differently by cuBLASLt at T = 16: within one bf16 rounding
    assert y.dtype == jnp.bfloat16
    assert float(jnp.abs(y.reshape(x.shape).astype(jnp.float32) - whole_y).max()) <= 2.0 ** -7 * float(
        jnp.abs(whole_y).max())
    gw = jax.grad(lambda w1: jax.vmap(lambda xi: ours(xi, w1, w2, b1, b2))(xs).astype(jnp.float32).sum())(w1)
    whole = jax.grad(lambda w1: ours(x, w1, w2, b1, b2).astype(jnp.float32).sum())(w1)
    # grad_linear1 is rounded to bf16 per element, from pre-activations that may differ by a bf16 rounding (GPU:
    # measured 3.4e-3 of the largest entry at worst)
    assert float(jnp.abs(gw - whole).max()) <= 2.0 ** -6 * float(jnp.abs(whole).max())
    assert float(jnp.linalg.norm(gw - whole)) <= 2.0 ** -8 * float(jnp.linalg.norm(whole))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_float32_biases_beside_bfloat16_weights(device):
    """bf16 weights with fp32 biases: accepted, the biases rounded as a cast would round them, and each gradient in
    its primal's dtype (the bias gradients in float32)."""
    _, place = make(device, seed=3)
    x, w1, w2, b1, b2, r = place("bfloat16", "bfloat16")
    _, _, _, b1f, b2f, _ = place("bfloat16", "float32")
    y = jax.jit(ours)(x, w1, w2, b1f, b2f)
    cast = jax.jit(ours)(x, w1, w2, b1f.astype(jnp.bfloat16), b2f.astype(jnp.bfloat16))
    assert bool((y == cast).all())
    grads = jax.jit(jax.grad(loss(ours, r), argnums=range(5)))(x, w1, w2, b1f, b2f)
    assert [str(g.dtype) for g in grads] == ["bfloat16"] * 3 + ["float32"] * 2
    refs = reference(x, w1, w2, b1f.astype(jnp.bfloat16), b2f.astype(jnp.bfloat16), r)
    assert all(rel(g, ref) < 2e-2 for g, ref in zip(grads, refs[1:]))
