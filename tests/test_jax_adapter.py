"""cupyffn.jax.gelu_ffn (custom VJP over buffer callbacks) against a float64 NumPy reference, eagerly and under
jax.jit, on CPU JAX and on GPU JAX (marked gpu).

The reference (forward and the three gradients of sum(output * r), written out below) is checked against
central finite differences of the float64 forward first; each cupyffn result must be within the
precision's contract (relative L2 error, cupyffn.PRECISIONS[p].contract).
"""

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

PRECISION_NAMES = tuple(cupyffn.PRECISIONS)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", marks=pytest.mark.gpu, id="gpu")]
SIZES = {"cpu": ((2, 64), 256, 1024), "gpu": ((2, 512), 1024, 4096)}  # (leading dims, D, H)
NAMES = ("output", "grad_hidden_states", "grad_weight1", "grad_weight2")
C = math.sqrt(2.0 / math.pi)


@pytest.fixture
def device(request):
    """The jax.Device of the parametrized kind ('cpu' or 'gpu'); skips where JAX has none."""
    kind = request.param
    try:
        return jax.devices(kind)[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no {kind} backend here: {' '.join(str(e).split())[:200]}")


def forward64(x, w1, w2):
    z = x @ w1.T
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    return (0.5 * z * (1 + t)) @ w2.T, z, t


def reference(x, w1, w2, r):
    """float64 (output, grad_x, grad_w1, grad_w2) of loss = sum(output * r); x, r [..., D]."""
    x, w1, w2, r = (numpy.asarray(a, dtype=numpy.float64) for a in (x, w1, w2, r))
    lead = x.shape[:-1]
    x2, r2 = x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])
    y, z, t = forward64(x2, w1, w2)
    g = 0.5 * z * (1 + t)
    dz = (r2 @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z))
    return y.reshape(r.shape), (dz @ w1).reshape(lead + (x.shape[-1],)), dz.T @ x2, r2.T @ g


def test_reference_matches_finite_differences():
    rng = numpy.random.default_rng(7)
    x, w1, w2, r = rng.standard_normal((5, 6)), rng.standard_normal((9, 6)) / 2, rng.standard_normal((6, 9)) / 3, \
        rng.standard_normal((5, 6))
    _, *grads = reference(x, w1, w2, r)
    args = [x, w1, w2]
    for i, grad in enumerate(grads):
        for idx in [(0, 0), (2, 3), (4, 5)]:
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[i][idx] += 1e-6
            minus[i][idx] -= 1e-6
            fd = ((forward64(*plus)[0] * r).sum() - (forward64(*minus)[0] * r).sum()) / 2e-6
            assert abs(fd - grad[idx]) <= 1e-6 * max(1.0, abs(fd)), (i, idx, fd, grad[idx])


def make(rng, device, lead=None, dim=None, hidden=None):
    """x ~ N(0, 1), weights like nn.Linear's init, r ~ N(0, 1): float32 NumPy arrays and their jax.Arrays."""
    kind = "gpu" if device.platform != "cpu" else "cpu"
    d_lead, d_dim, d_hidden = SIZES[kind]
    lead, dim, hidden = lead or d_lead, dim or d_dim, hidden or d_hidden
    host = (rng.standard_normal(lead + (dim,)), rng.uniform(-1, 1, (hidden, dim)) / math.sqrt(dim),
            rng.uniform(-1, 1, (dim, hidden)) / math.sqrt(hidden), rng.standard_normal(lead + (dim,)))
    host = tuple(a.astype(numpy.float32) for a in host)
    return host, tuple(jax.device_put(a, device) for a in host)


def rel(a, ref):
    a = numpy.asarray(a)
    assert a.dtype == numpy.float32 and a.shape == ref.shape
    return float(numpy.linalg.norm(a.astype(numpy.float64) - ref) / numpy.linalg.norm(ref))


def loss_fn(precision, r):
    return lambda x, w1, w2: (cj.gelu_ffn(x, w1, w2, precision) * r).sum()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_value_and_grad_match_float64(rng, device, precision):
    host, (x, w1, w2, r) = make(rng, device)
    refs = reference(*host)
    y = cj.gelu_ffn(x, w1, w2, precision)
    _, grads = jax.value_and_grad(loss_fn(precision, r), argnums=(0, 1, 2))(x, w1, w2)
    results = (y,) + tuple(grads)
    for a in results:
        assert isinstance(a, jax.Array) and a.devices() == {device}
    errors = {n: rel(a, b) for n, a, b in zip(NAMES, results, refs)}
    assert all(e <= cupyffn.PRECISIONS[precision].contract for e in errors.values()), errors


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_vjp_of_one_argument(rng, device):
    host, (x, w1, w2, r) = make(rng, device)
    refs = reference(*host)
    y, pullback = jax.vjp(lambda w2: cj.gelu_ffn(x, w1, w2, "ieee"), w2)
    (grad_w2,) = pullback(r)
    contract = cupyffn.PRECISIONS["ieee"].contract
    assert rel(y, refs[0]) <= contract and rel(grad_w2, refs[3]) <= contract


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("precision", ("bf16x3", "ieee"))
def test_jit_grad_and_value_and_grad_match_float64(rng, device, precision):
    """Under jax.jit: the forward, jax.grad and jax.value_and_grad, each against the float64 reference."""
    host, (x, w1, w2, r) = make(rng, device)
    refs = reference(*host)
    contract = cupyffn.PRECISIONS[precision].contract
    f = loss_fn(precision, r)
    y = jax.jit(lambda x, w1, w2: cj.gelu_ffn(x, w1, w2, precision))(x, w1, w2)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w1, w2)
    value, grads2 = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w1, w2)
    for a in (y,) + tuple(grads) + tuple(grads2):
        assert isinstance(a, jax.Array) and a.devices() == {device}
    assert rel(y, refs[0]) <= contract
    for results in (grads, grads2):
        errors = {n: rel(a, b) for n, a, b in zip(NAMES[1:], results, refs[1:])}
        assert all(e <= contract for e in errors.values()), errors
    loss64 = float((refs[0] * host[3].astype(numpy.float64)).sum())
    assert abs(float(value) - loss64) <= 10 * contract * float(numpy.abs(refs[0] * host[3]).sum())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_jit_reruns_with_new_values(rng, device):
    """A jitted step called again with new inputs computes from the new values (nothing stale is reused)."""
    step = jax.jit(jax.grad(lambda x, w1, w2, r: (cj.gelu_ffn(x, w1, w2, "ieee") * r).sum(), argnums=(1, 2)))
    contract = cupyffn.PRECISIONS["ieee"].contract
    for _ in range(3):
        host, arrays = make(rng, device, lead=(64,), dim=64, hidden=256)
        refs = reference(*host)
        grad_w1, grad_w2 = step(*arrays)
        assert rel(grad_w1, refs[2]) <= contract and rel(grad_w2, refs[3]) <= contract


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_vmap_runs_one_call_per_element(rng, device):
    host, (x, w1, w2, r) = make(rng, device, lead=(3, 16), dim=32, hidden=64)
    contract = cupyffn.PRECISIONS["ieee"].contract
    y = jax.jit(jax.vmap(lambda xi: cj.gelu_ffn(xi, w1, w2, "ieee")))(x)
    assert rel(y, reference(*host)[0]) <= contract


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_zero_tokens(rng, device):
    _, (x, w1, w2, _) = make(rng, device, lead=(0,), dim=16, hidden=32)
    y, grads = jax.value_and_grad(lambda w1, w2: cj.gelu_ffn(x, w1, w2).sum(), argnums=(0, 1))(w1, w2)
    assert float(y) == 0.0 and all(float(jnp.abs(g).max()) == 0.0 for g in grads)
    assert cj.gelu_ffn(x, w1, w2).shape == (0, 16)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_argument_errors(rng, device):
    host, (x, w1, w2, _) = make(rng, device, lead=(8,), dim=16, hidden=32)
    # the door's rules and words (cupyffn/core/rules.py), at trace time
    with pytest.raises(TypeError, match=r"hidden_states must be float32 \(or bfloat16 / float16.*; got int32"):
        cj.gelu_ffn(x.astype(jnp.int32), w1, w2)
    with pytest.raises(TypeError, match="weight1 must be float32; got bfloat16"):
        cj.gelu_ffn(x, w1.astype(jnp.bfloat16), w2)
    with pytest.raises(TypeError, match="weight2 must be float32; got bfloat16"):
        cj.gelu_ffn(x, w1, w2.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="weight1 must be a jax.Array"):
        cj.gelu_ffn(x, host[1], w2)
    with pytest.raises(ValueError, match="precision must be one of"):
        cj.gelu_ffn(x, w1, w2, "fp8")
    with pytest.raises(ValueError, match="weight1 must have shape"):
        cj.gelu_ffn(x, w1[:, :8], w2)
    with pytest.raises(ValueError, match="weight1 must have shape"):  # raised at trace time under jit
        jax.jit(cj.gelu_ffn)(x, w1[:, :8], w2)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(dim, hidden_dim\) = \(16, 32\)"):
        cj.gelu_ffn(x, w1, w2.T)


def test_jitted_training_example_learns_on_cpu():
    from test_examples import load  # tests/ is on sys.path (pytest's rootdir-relative import)

    try:
        jax.devices("cpu")
    except RuntimeError as e:
        pytest.skip(f"JAX has no cpu backend here: {e}")
    losses = load("train_jax").main(steps=60, device="cpu")
    assert len(losses) == 60 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last / first < 0.5, (losses[:10], losses[-10:])


def test_gpu_callback_reads_xlas_buffers_and_stream(monkeypatch):
    """The GPU branch of the callbacks' plumbing, with stand-ins for XLA's context and buffers (no GPU needed):
    views at the buffers' addresses with their shapes, XLA's stream (an int or a capsule), the device the
    pointer lives on."""
    import ctypes

    runtime = pytest.importorskip("cupy_backends.cuda.api.runtime",
                                  reason="the GPU branch's stand-ins replace a function of CuPy's runtime: needs CuPy")

    from cupyffn.core import views as _views

    class Buffer:
        def __init__(self, ptr, shape, dtype="float32"):
            self.dtype = numpy.dtype(dtype) if dtype != "bfloat16" else _views.numpy_dtype(dtype)
            typestr = "<f4" if dtype == "float32" else "<V2"
            self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 2}

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

    api = ctypes.pythonapi
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    seen = []
    monkeypatch.setattr(runtime, "pointerGetAttributes",
                        lambda ptr: seen.append(ptr) or type("A", (), {"device": 0})())
    monkeypatch.setattr(_views, "external_stream", lambda ptr, device: ("stream", ptr, device))
    pytest.importorskip("ml_dtypes")
    buffers = (Buffer(1 << 30, (4, 8, 16)), Buffer((1 << 30) + 4096, (32, 16)),
               Buffer((1 << 30) + 8192, (16, 8), "bfloat16"))
    for stream in (0x5000, api.PyCapsule_New(0x5000, None, None)):
        ctx = type("Ctx", (), {"stream": stream})()
        arrays, s, device = cj._on_device(ctx, buffers)
        assert s == ("stream", 0x5000, 0) and device == 0 and seen[-1] == 1 << 30
        assert [a.data.ptr for a in arrays] == [1 << 30, (1 << 30) + 4096, (1 << 30) + 8192]
        assert [a.shape for a in arrays] == [(4, 8, 16), (32, 16), (16, 8)]
        assert [a.strides for a in arrays] == [(512, 64, 4), (64, 4), (16, 2)]
        assert [a.dtype.name for a in arrays] == ["float32", "float32", "bfloat16"]


def test_host_buffers_take_the_numpy_path_and_device_errors_surface():
    """The CPU client's buffers (DLPack device kDLCPU) are NumPy arrays with no stream; device buffers whose
    context cannot give a stream raise that error instead of silently taking the NumPy path."""
    class HostBuffer:
        def __init__(self, values):
            self.values = values

        def __dlpack_device__(self):
            return (1, 0)

        def __array__(self, dtype=None, copy=None):
            return self.values

    class DeviceBuffer(HostBuffer):
        def __dlpack_device__(self):
            return (2, 0)

    class NoStream:
        @property
        def stream(self):
            raise RuntimeError("stream not available")

    values = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    arrays, stream, device = cj._on_device(NoStream(), [HostBuffer(values)])
    assert stream is None and device is None and arrays[0] is values
    with pytest.raises(RuntimeError, match="stream not available"):
        cj._on_device(NoStream(), [DeviceBuffer(values)])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_default_precision_is_the_devices(rng, device):
    """No precision argument: the default of the buffers' device ("ieee" on the CPU, "fp16+fp8" on a GPU),
    decided inside the callbacks (a traced value has no device), eagerly and under jit; bit-identical to
    naming it."""
    want = cupyffn.CPU_DEFAULT_PRECISION if device.platform == "cpu" else cupyffn.DEFAULT_PRECISION
    _, (x, w1, w2, r) = make(rng, device, lead=(16,), dim=32, hidden=64)
    for f in (lambda fn: fn, jax.jit):
        default = f(jax.value_and_grad(lambda a, b, c: (cj.gelu_ffn(a, b, c) * r).sum(), argnums=(0, 1, 2)))(x, w1, w2)
        named = f(jax.value_and_grad(loss_fn(want, r), argnums=(0, 1, 2)))(x, w1, w2)
        for a, b in zip(jax.tree_util.tree_leaves(default), jax.tree_util.tree_leaves(named)):
            numpy.testing.assert_array_equal(numpy.asarray(a), numpy.asarray(b))
    if device.platform == "cpu":  # the GPU's default stays selectable on the CPU, and computes something else
        emulated = jax.grad(loss_fn("fp16+fp8", r), argnums=1)(x, w1, w2)
        assert not numpy.array_equal(numpy.asarray(emulated), numpy.asarray(named[1][1]))


def test_the_module_shows_its_api_only():
    """dir(cupyffn.jax) lists gelu_ffn, not the modules it imports (numpy, jax, ctypes: imported privately)."""
    public = [name for name in dir(cj) if not name.startswith("_")]
    assert public == ["gelu_ffn"] == cj.__all__
    for name in ("numpy", "jax", "jnp", "ctypes", "functools", "math", "buffer_callback"):
        assert not hasattr(cj, name), name
