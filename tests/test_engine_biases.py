"""Biases in the split float32 precisions ("bf16x3", "fp16+fp8") on the float32 engine (cupyffn/f32/forward.py,
cupyffn/f32/bias_sums.py, kernels_cu/bias.cu; docs/decisions/050-biases-in-the-split-precisions.md): values
against float64, the GPU against the NumPy model, bit-identical bias gradients, accumulation, memory mode, the plan
API, CUDA graphs (call graph, graph=True, a caller's capture) and argument errors."""

import math

import numpy
import pytest

import cupyffn

SPLIT = ("bf16x3", "fp16+fp8")
C = math.sqrt(2 / math.pi)


def make(rng, T, D, H):
    """x, dy, w1, w2, b1, b2 (float32, benchmark-like scales: every output's error well above rounding noise)."""
    x = rng.standard_normal((T, D), dtype=numpy.float32)
    dy = rng.standard_normal((T, D), dtype=numpy.float32)
    w1 = (rng.standard_normal((H, D)) / math.sqrt(D)).astype(numpy.float32)
    w2 = (rng.standard_normal((D, H)) / math.sqrt(H)).astype(numpy.float32)
    b1 = (0.5 * rng.standard_normal(H)).astype(numpy.float32)
    b2 = (0.5 * rng.standard_normal(D)).astype(numpy.float32)
    return x, dy, w1, w2, b1, b2


def reference(x, dy, w1, w2, b1, b2):
    """float64: (output, linear1_out, tanh_inner, gelu_out), (grad_hidden, grad_w1, grad_w2, grad_b1, grad_b2)."""
    x, dy, w1, w2 = (numpy.asarray(a, numpy.float64) for a in (x, dy, w1, w2))
    z = x @ w1.T + (0 if b1 is None else b1)
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    y = g @ w2.T + (0 if b2 is None else b2)
    gl = (dy @ w2) * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z))
    return (y, z, t, g), (gl @ w1, gl.T @ x, dy.T @ g, gl.sum(0), dy.sum(0))


def host(a):
    if type(a).__module__.startswith("cupy"):
        a = a.get()
    return numpy.asarray(a, numpy.float64)


def rel(got, ref):
    got = host(got)
    assert numpy.isfinite(got).all()
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def within(results, refs, bound):
    errors = [rel(g, r) for g, r in zip(results, refs)]
    assert max(errors) <= bound, errors
    return errors


# ---------------------------------------------------------------------------------------------
# NumPy (the CPU route, which models the GPU's operand rounding)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", SPLIT)
def test_numpy_forward_and_backward_with_biases(rng, precision):
    x, dy, w1, w2, b1, b2 = make(rng, 40, 24, 72)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    (y, z, t, g), grads = reference(x, dy, w1, w2, b1, b2)
    within((f.output, f.linear1_out, f.tanh_inner, f.gelu_out), (y, z, t, g), 1e-4)
    r = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, precision=precision,
                                  need_bias_grads=True)
    within((*r, r.grad_bias1, r.grad_bias2), grads, 1e-4)
    # one bias only: the other term is absent
    f1 = cupyffn.gelu_ffn_forward(x, w1, w2, bias2=b2, precision=precision)
    (y1, z1, _, _), _ = reference(x, dy, w1, w2, None, b2)
    within((f1.output, f1.linear1_out), (y1, z1), 1e-4)


@pytest.mark.parametrize("precision", SPLIT + ("ieee",))
def test_a_precision_object_routes_as_its_name(rng, precision):
    """gelu_ffn_forward / gelu_ffn_backward given cupyffn.PRECISIONS[name] with biases: the same route and the same
    values as the name (a split precision on the float32 engine's model, "ieee" on the 16-bit/bias route)."""
    x, dy, w1, w2, b1, b2 = make(rng, 24, 16, 40)
    by_name = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    by_object = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=cupyffn.PRECISIONS[precision])
    for a, b in zip(by_name, by_object):
        assert (a is None and b is None) or numpy.array_equal(a, b)
    args = (dy, x, w1, w2, by_name.linear1_out, by_name.tanh_inner, by_name.gelu_out)
    grads = [cupyffn.gelu_ffn_backward(*args, precision=p, need_bias_grads=True)
             for p in (precision, cupyffn.PRECISIONS[precision])]
    for a, b in zip(*grads):
        assert numpy.array_equal(a, b)


@pytest.mark.parametrize("precision", SPLIT)
def test_numpy_bias_gradients_accumulate_into_out(rng, precision):
    x, dy, w1, w2, b1, b2 = make(rng, 32, 16, 48)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    _, grads = reference(x, dy, w1, w2, b1, b2)
    start = [rng.standard_normal(s).astype(numpy.float32) for s in ((48, 16), (16, 48), (48,), (16,))]
    out = [None] + [a.copy() for a in start]
    r = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, None, precision=precision, out=out,
                                  accumulate=True, need_bias_grads=True)
    assert r.grad_bias1 is out[3] and r.grad_bias2 is out[4]
    within(out[1:], [g + s for g, s in zip(grads[1:], start)], 1e-4)


def test_numpy_plan_with_bias_gradients(rng):
    x, dy, w1, w2, b1, b2 = make(rng, 20, 8, 32)
    plan = cupyffn.GeluFFNBackward(20, 8, 32, precision="bf16x3", device="cpu", need_bias_grads=True)
    assert "need_bias_grads=True" in repr(plan)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision="bf16x3")
    r = plan(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out)
    _, grads = reference(x, dy, w1, w2, b1, b2)
    within((r.grad_bias1, r.grad_bias2), grads[3:], 1e-4)
    empty = cupyffn.GeluFFNBackward(0, 8, 32, precision="bf16x3", device="cpu", need_bias_grads=True)
    z = numpy.zeros((0, 8), numpy.float32)
    e = empty(z, z, w1, w2, numpy.zeros((0, 32), numpy.float32))
    assert (e.grad_bias1 == 0).all() and e.grad_bias1.shape == (32,) and (e.grad_bias2 == 0).all()


def test_bias_gradient_arguments_are_checked(rng):
    x, dy, w1, w2, b1, b2 = make(rng, 8, 16, 32)
    z = numpy.zeros((8, 32), numpy.float32)
    args = (dy, x, w1, w2, z)
    with pytest.raises(TypeError, match=r"three or five arrays \(grad_hidden_states, .*, grad_bias1, grad_bias2\)"):
        cupyffn.gelu_ffn_backward(*args, precision="bf16x3", need_bias_grads=True, out=[None] * 4)
    with pytest.raises(ValueError, match=r"out\[3\] \(grad_bias1\) must have shape \(32,\)"):
        cupyffn.gelu_ffn_backward(*args, precision="bf16x3", need_bias_grads=True,
                                  out=[None, None, None, numpy.zeros(16, numpy.float32), None])
    with pytest.raises(ValueError, match=r"accumulate=True needs out\[4\] \(grad_bias2\)"):
        cupyffn.gelu_ffn_backward(*args, precision="fp16+fp8", need_bias_grads=True, accumulate=True,
                                  out=[None, numpy.zeros((32, 16), numpy.float32), numpy.zeros((16, 32), numpy.float32),
                                       numpy.zeros(32, numpy.float32), None])
    with pytest.raises(ValueError, match=r"bias2 must have shape \(16,\)"):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias2=b1, precision="bf16x3")
    with pytest.raises(TypeError, match="bias1 must be float32"):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1.astype(numpy.float64), precision="bf16x3")
    with pytest.raises(TypeError, match=r"three arrays \(grad_hidden"):  # five outputs need need_bias_grads
        cupyffn.gelu_ffn_backward(*args, precision="bf16x3", out=[None] * 5)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu

# (T, D, H): the SD3.5 block at a small T (bf16x3 planes in both precisions), at T = 2048, where fp16+fp8 runs its
# e4m3 pairs (all four on the sm90 pair kernel on an H100/H200) and split_e4m3's dgelu pass, and at T = 3142, where
# GEMM2-4 take cuBLAS's pair; an odd shape whose rows take the kernels' scalar paths
SHAPES = [(256, 1536, 6144), (2048, 1536, 6144), (3142, 256, 1024), (77, 100, 300)]


def poisoned(cupy, shapes):
    return [cupy.full(s, numpy.nan, numpy.float32) for s in shapes]


@gpu
@pytest.mark.parametrize("precision", SPLIT)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forward_backward_with_biases(rng, precision, shape):
    cupy = pytest.importorskip("cupy")
    T, D, H = shape
    host_args = make(rng, T, D, H)
    x, dy, w1, w2, b1, b2 = (cupy.asarray(a) for a in host_args)
    fwd = poisoned(cupy, ((T, D), (T, H), (T, H), (T, H)))
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision, out=fwd)
    refs, grads = reference(*host_args)
    within(f, refs, 1e-4)
    out = poisoned(cupy, ((T, D), (H, D), (D, H), (H,), (D,)))
    r = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, precision=precision,
                                  out=out, need_bias_grads=True)
    assert r.grad_bias1 is out[3] and r.grad_bias2 is out[4]
    errors = within(out, grads, 1e-4)
    # the bias gradients land where the NumPy route's model of the same computation does (within 3x: the summation
    # orders differ; or both tiny). (The GEMM outputs' fp32 accumulation over K = 3 H differs from the model's by up to
    # 5x at T = 2048, all well inside the contract: not the mechanism tested here.)
    cpu = cupyffn.gelu_ffn_backward(*(a.get() for a in (dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out)),
                                    precision=precision, need_bias_grads=True)
    for e, c, ref in zip(errors[3:], (cpu.grad_bias1, cpu.grad_bias2), grads[3:]):
        assert e <= max(3 * rel(c, ref), 2e-6), (e, rel(c, ref))
    # bit-identical on a second call (fixed-order sums), also in memory mode (the dgelu pass recomputes t)
    again = poisoned(cupy, ((T, D), (H, D), (D, H), (H,), (D,)))
    cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, precision=precision,
                              out=again, need_bias_grads=True)
    for a, b in zip(out[3:], again[3:]):
        assert cupy.array_equal(a, b)
    mem = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, None, precision=precision,
                                    need_bias_grads=True)
    within((*mem, mem.grad_bias1, mem.grad_bias2), grads, 1e-4)


@gpu
@pytest.mark.parametrize("precision", SPLIT)
def test_gpu_bias_gradients_accumulate_and_zero_tokens(rng, precision):
    cupy = pytest.importorskip("cupy")
    T, D, H = 512, 256, 1024
    host_args = make(rng, T, D, H)
    x, dy, w1, w2, b1, b2 = (cupy.asarray(a) for a in host_args)
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
    _, grads = reference(*host_args)
    start = [cupy.asarray(rng.standard_normal(s).astype(numpy.float32)) for s in ((H, D), (D, H), (H,), (D,))]
    out = [None] + [a.copy() for a in start]
    cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, f.tanh_inner, f.gelu_out, precision=precision, out=out,
                              accumulate=True, need_bias_grads=True)
    within(out[1:], [g + s.get() for g, s in zip(grads[1:], start)], 1e-4)
    z = cupy.zeros((0, D), cupy.float32)
    e = cupyffn.gelu_ffn_backward(z, z, w1, w2, cupy.zeros((0, H), cupy.float32), precision=precision,
                                  need_bias_grads=True)
    assert e.grad_bias1.shape == (H,) and not e.grad_bias1.any() and not e.grad_bias2.any()


@gpu
@pytest.mark.parametrize("precision, graph", [("tf32", False), ("bf16x3", True), ("fp16+fp8", True),
                                              ("ieee", False), ("bf16", True)])
def test_gpu_plans_with_bias_gradients_replay(rng, precision, graph):
    """The plan API: tf32 at T = 256 (GEMM1 unfused, the call graph re-pointed per call) and graph=True plans (a
    graph captured per set of addresses), three calls with new arrays; results against float64 at the precision's
    contract."""
    cupy = pytest.importorskip("cupy")
    T, D, H = 256, 512, 2048
    plan = cupyffn.GeluFFNBackward(T, D, H, precision=precision, graph=graph, need_bias_grads=True)
    assert not plan.fused_gemm1
    bound = cupyffn.PRECISIONS[precision].contract
    out = poisoned(cupy, ((T, D), (H, D), (D, H), (H,), (D,)))
    for _ in range(3):  # new values in the same arrays each time
        host_args = make(rng, T, D, H)
        x, dy, w1, w2, b1, b2 = (cupy.asarray(a) for a in host_args)
        (_, z, t, g), grads = reference(*host_args)
        z, t, g = (cupy.asarray(a, cupy.float32) for a in (z, t, g))
        plan(dy, x, w1, w2, z, t, g, out=out)
        within(out, grads, bound)


@gpu
@pytest.mark.parametrize("precision", SPLIT)
def test_gpu_bias_gradients_in_a_callers_capture(rng, precision):
    cupy = pytest.importorskip("cupy")
    T, D, H = 2048, 256, 1024
    host_args = make(rng, T, D, H)
    x, dy, w1, w2, b1, b2 = (cupy.asarray(a) for a in host_args)
    fwd = poisoned(cupy, ((T, D), (T, H), (T, H), (T, H)))
    out = poisoned(cupy, ((T, D), (H, D), (D, H), (H,), (D,)))

    def step(s):
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision, out=fwd, stream=s)
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, fwd[1], fwd[2], fwd[3], precision=precision, out=out, stream=s,
                                  need_bias_grads=True)

    s = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs and the poisoned outputs, made on the null stream
    step(s)  # plans built outside the capture
    s.begin_capture()
    step(s)
    graph = s.end_capture()
    for a in fwd + out:
        a.fill(numpy.nan)
    # the fills ran on the null stream, which a non-blocking stream does not wait for: without this the replay may
    # run first and the fills land on its results (a failure only when the GPU is busy with other work)
    cupy.cuda.Device().synchronize()
    graph.launch(s)
    s.synchronize()
    refs, grads = reference(*host_args)
    within(fwd, refs, 1e-4)
    within(out, grads, 1e-4)
    cupyffn.release_captured_plans()


@gpu
@pytest.mark.parametrize("precision", SPLIT)
@pytest.mark.parametrize("save", ["all", "linear1_out"])
def test_gpu_torch_layer_with_biases(precision, save):
    """cupyffn.torch.GeluFFN with biases in a split precision (float32 outside autocast): output and every gradient
    against the same block in float64 torch, at the contract; save="all" keeps tanh_inner for the backward."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not available")
    import cupyffn.torch as ct

    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(1536, 6144).cuda(), torch.nn.Linear(6144, 1536).cuda()
    ffn = ct.GeluFFN.from_linears(l1, l2, precision=precision, save=save)
    x = torch.randn(2, 300, 1536, device="cuda", requires_grad=True)
    r = torch.randn(2, 300, 1536, device="cuda")
    y = ffn(x)
    (y * r).sum().backward()
    got = [y, x.grad, l1.weight.grad, l1.bias.grad, l2.weight.grad, l2.bias.grad]
    params = [p.detach().double().requires_grad_() for p in (l1.weight, l1.bias, l2.weight, l2.bias)]
    xd = x.detach().double().requires_grad_()
    h = torch.nn.functional.gelu(xd @ params[0].T + params[1], approximate="tanh")
    ref = h @ params[2].T + params[3]
    (ref * r.double()).sum().backward()
    for g, e in zip(got, [ref, xd.grad] + [p.grad for p in params]):
        err = float((g.double() - e).norm() / e.norm())
        assert err < 1e-4 and g.dtype == torch.float32, err
