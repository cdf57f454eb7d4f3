"""A backward that asks for the bias gradients alone (frozen weights and an input without grad: BitFit-style
fine-tuning, adapters): need_grad_hidden=False, need_weight_grads=False, need_bias_grads=True on every route (the
NumPy backend, the float32 engine in every precision, cuBLASLt for bfloat16 / float16 activations), the plan API,
accumulation, and the torch layer with frozen weights. The bias gradients are those of the full call (the same
GEMM1 and the same sums), every other result is None, and the values hold against float64."""

import numpy
import pytest

import cupyffn
from cupyffn.core.views import numpy_dtype
from test_engine_biases import host, make, reference, rel  # noqa: E402  (tests/ is on sys.path)

ONLY_BIASES = dict(need_grad_hidden=False, need_weight_grads=False, need_bias_grads=True)
#: relative L2 bound against float64 per activation dtype (float32: the precision's contract)
HALF_BOUND = {"bfloat16": 1.5e-2, "float16": 2e-3}


def bias_grads64(x, dy, w1, w2, b1):
    """float64 (grad_bias1, grad_bias2) of the block at these values."""
    return reference(x, dy, w1, w2, b1, None)[1][3:]


def check(xp, rng, T, D, H, precision=None, act="float32"):
    """Forward, then the full backward and the bias-only one on the same saved tensors: the bias-only call's None
    entries, its bias gradients against the full call's (returned, for the caller's comparison) and float64."""
    x, dy, w1, w2, b1, b2 = make(rng, T, D, H)
    if act != "float32":
        x, dy = (a.astype(numpy_dtype(act)) for a in (x, dy))
    refs = bias_grads64(x, dy, w1, w2, b1)
    dev = [xp.asarray(a) for a in (x, dy, w1, w2, b1, b2)]
    x, dy, w1, w2, b1, b2 = dev
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    saved = (dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out)
    full = cupyffn.gelu_ffn_backward(*saved, precision=precision, need_bias_grads=True)
    out = [None, None, None, xp.full((H,), numpy.nan, numpy.float32), xp.full((D,), numpy.nan, numpy.float32)]
    only = cupyffn.gelu_ffn_backward(*saved, precision=precision, out=out, **ONLY_BIASES)
    assert tuple(only[:3]) == (None, None, None)
    assert only.grad_bias1 is out[3] and only.grad_bias2 is out[4]
    bound = HALF_BOUND[act] if act != "float32" else cupyffn.PRECISIONS[precision or "fp16+fp8"].contract
    for got, ref in zip((only.grad_bias1, only.grad_bias2), refs):
        assert rel(got, ref) <= bound
    # accumulate=True adds this call's bias gradients into out=
    start = [xp.asarray(rng.standard_normal(n).astype(numpy.float32)) for n in (H, D)]
    acc = [None, None, None] + [s.copy() for s in start]
    cupyffn.gelu_ffn_backward(*saved, precision=precision, out=acc, accumulate=True, **ONLY_BIASES)
    for a, s, g in zip(acc[3:], start, (only.grad_bias1, only.grad_bias2)):
        assert rel(a, host(s) + host(g)) <= 1e-6
    return (only.grad_bias1, only.grad_bias2), (full.grad_bias1, full.grad_bias2)


def same_bits(pairs):
    for a, b in zip(*pairs):
        assert numpy.array_equal(host(a).view(numpy.uint64), host(b).view(numpy.uint64))


# ---------------------------------------------------------------------------------------------
# NumPy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", tuple(cupyffn.PRECISIONS))
def test_numpy_bias_only_float32(rng, precision):
    same_bits(check(numpy, rng, 40, 24, 72, precision))


def test_numpy_bias_only_float16(rng):
    only, full = check(numpy, rng, 40, 24, 72, act="float16")
    same_bits((only, full))


def test_numpy_plan_bias_only(rng):
    T, D, H = 30, 16, 48
    x, dy, w1, w2, b1, b2 = make(rng, T, D, H)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision="ieee")
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="ieee", device="cpu", **ONLY_BIASES)
    r = plan(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out)
    assert tuple(r[:3]) == (None, None, None)
    for got, ref in zip((r.grad_bias1, r.grad_bias2), bias_grads64(x, dy, w1, w2, b1)):
        assert rel(got, ref) <= cupyffn.PRECISIONS["ieee"].contract


def test_nothing_asked_is_refused(rng):
    x, dy, w1, w2, b1, b2 = make(rng, 8, 4, 12)
    f = cupyffn.gelu_ffn_forward(x, w1, w2)
    nothing = dict(need_grad_hidden=False, need_weight_grads=False, need_bias_grads=False)
    with pytest.raises(ValueError, match=r"^need_grad_hidden, need_weight_grads and need_bias_grads are all False"):
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, **nothing)
    with pytest.raises(ValueError, match=r"are all False: there is nothing to compute"):
        cupyffn.GeluFFNBackward(8, 4, 12, device="cpu", **nothing)


def torch_frozen_weights(torch, device, autocast):
    """GeluFFN with frozen weights, trainable biases and an input without grad, one step: the bias gradients
    against float64 autograd of the block (bf16 autocast: within bf16 error), no other gradient."""
    import cupyffn.torch as ct

    torch.manual_seed(3)
    ffn = ct.GeluFFN(64, 256, bias=True, device=device)
    ffn.weight1.requires_grad_(False)
    ffn.weight2.requires_grad_(False)
    x = torch.randn(3, 50, 64, device=device)
    r = torch.randn(3, 50, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        y = ffn(x)
    (y.float() * r).sum().backward()
    assert ffn.weight1.grad is None and ffn.weight2.grad is None
    p = [t.detach().double().requires_grad_(b) for t, b in ((ffn.weight1, False), (ffn.bias1, True),
                                                           (ffn.weight2, False), (ffn.bias2, True))]
    h = torch.nn.functional.gelu(x.double() @ p[0].T + p[1], approximate="tanh")
    ((h @ p[2].T + p[3]) * r.double()).sum().backward()
    default = cupyffn.CPU_DEFAULT_PRECISION if device == "cpu" else cupyffn.DEFAULT_PRECISION
    bound = 2e-2 if autocast else cupyffn.PRECISIONS[ffn.precision or default].contract
    for got, want in ((ffn.bias1.grad, p[1].grad), (ffn.bias2.grad, p[3].grad)):
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        assert float((got.double() - want).norm() / want.norm()) <= bound


def test_torch_layer_frozen_weights_cpu():
    torch = pytest.importorskip("torch")
    torch_frozen_weights(torch, "cpu", autocast=False)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
# T = 256 (bf16x3 planes in fp16+fp8) and T = 2048 (its e4m3 pairs and split_e4m3's dgelu pass)
SHAPES = [(256, 512, 2048), (2048, 512, 2048)]


@gpu
@pytest.mark.parametrize("precision", tuple(cupyffn.PRECISIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_float32_engine_bias_only(rng, precision, shape):
    cupy = pytest.importorskip("cupy")
    same_bits(check(cupy, rng, *shape, precision))


@gpu
@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_gpu_cublaslt_bias_only(rng, act):
    cupy = pytest.importorskip("cupy")
    if act == "bfloat16":
        pytest.importorskip("ml_dtypes")
    only, full = check(cupy, rng, 256, 512, 2048, act=act)
    for a, b in zip(only, full):
        assert rel(a, host(b)) <= 1e-6


@gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_gpu_torch_layer_frozen_weights(autocast):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not available")
    torch_frozen_weights(torch, "cuda", autocast)
