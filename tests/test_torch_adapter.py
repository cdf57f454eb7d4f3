"""cupyffn.torch (GeluFFNFunction, GeluFFN, gelu_ffn) against torch autograd of the plain block in float64;
the custom operators (opcheck), torch.compile(fullgraph=True) and autocast on the CPU.

Every test runs on CPU torch (the torch CPU route, or the NumPy backend for the emulated precisions) and on CUDA
(marked gpu; also skipped where torch has no CUDA). The reference is
``F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)`` evaluated and differentiated by torch in float64 from
the same float32 values; each output must be within the precision's contract (relative L2 error,
cupyffn.PRECISIONS[p].contract).
"""

import subprocess
import sys

import numpy
import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
F = torch.nn.functional

import cupyffn  # noqa: E402
import cupyffn.torch as ct  # noqa: E402

PRECISION_NAMES = tuple(cupyffn.PRECISIONS)
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA, id="cuda")]
# (leading dims, D, H): T = 128 on the CPU, 2048 on the GPU
SIZES = {"cpu": ((2, 64), 256, 1024), "cuda": ((4, 512), 1024, 4096)}
NAMES = ("output", "grad_hidden_states", "grad_weight1", "grad_weight2")


def make(rng, device, lead=None, dim=None, hidden=None):
    """x ~ N(0, 1) [*lead, D], weights like nn.Linear's init, r ~ N(0, 1) (the output's gradient), float32."""
    d_lead, d_dim, d_hidden = SIZES[device]
    lead, dim, hidden = lead or d_lead, dim or d_dim, hidden or d_hidden
    x = rng.standard_normal(lead + (dim,))
    w1 = rng.uniform(-1, 1, (hidden, dim)) / numpy.sqrt(dim)
    w2 = rng.uniform(-1, 1, (dim, hidden)) / numpy.sqrt(hidden)
    r = rng.standard_normal(lead + (dim,))
    return tuple(torch.from_numpy(a.astype(numpy.float32)).to(device) for a in (x, w1, w2, r))


def reference(x, w1, w2, r):
    """float64 (output, grad_x, grad_w1, grad_w2) of loss = sum(output * r), by torch autograd."""
    x64, w1_64, w2_64 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    y = F.linear(F.gelu(F.linear(x64, w1_64), approximate="tanh"), w2_64)
    (y * r.double()).sum().backward()
    return y.detach(), x64.grad, w1_64.grad, w2_64.grad


def rel(a, ref):
    assert a is not None and a.shape == ref.shape and a.dtype == torch.float32 and a.device == ref.device
    return float((a.detach().double() - ref).norm() / ref.norm())


def run(fn, x, w1, w2, r):
    """(output, grad_x, grad_w1, grad_w2) of loss = sum(fn(x, w1, w2) * r) through cupyffn.torch."""
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    y = fn(x, w1, w2)
    (y * r).sum().backward()
    return y.detach(), x.grad, w1.grad, w2.grad


def assert_within(results, refs, contract):
    errors = {n: rel(a, b) for n, a, b in zip(NAMES, results, refs)}
    assert all(e <= contract for e in errors.values()), (errors, contract)
    return errors


@pytest.fixture
def spy(monkeypatch):
    """Records the arguments of every cupyffn forward / backward call cupyffn.torch makes at the door (NumPy views on
    the CPU, tensors on CUDA), with the request's options as the functions' keywords, "out", and "route": "torch"
    where the route table runs the call on torch's own ops (cupyffn/cpu/torch_route.py)."""
    calls = {"forward": [], "backward": []}
    from cupyffn.api import execute, functional, routes

    door, executor = functional.run, execute.run

    def recorder(request, args, out, stream, *rest, **kw):
        options = {"precision": request.precision, "out": out}
        if request.kind == "backward":
            options.update(need_grad_hidden=request.need_grad_hidden, need_weight_grads=request.need_weight_grads,
                           need_bias_grads=request.need_bias_grads)
        calls[request.kind].append((args, options))
        return door(request, args, out, stream, *rest, **kw)

    def execute_recorder(call, route, *a, **k):
        if route.engine == routes.TORCH_CPU:
            calls[call.kind][-1][1]["route"] = "torch"
        return executor(call, route, *a, **k)

    monkeypatch.setattr(functional, "run", recorder)
    monkeypatch.setattr(execute, "run", execute_recorder)
    return calls


def test_import_cupyffn_imports_neither_torch_nor_jax():
    code = "import sys, cupyffn; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("save", ("all", "linear1_out"))
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_function_matches_float64_autograd(rng, device, precision, save):
    x, w1, w2, r = make(rng, device)
    refs = reference(x, w1, w2, r)
    results = run(lambda a, b, c: ct.GeluFFNFunction.apply(a, b, c, precision, save), x, w1, w2, r)
    assert_within(results, refs, cupyffn.PRECISIONS[precision].contract)
    assert results[0].shape == x.shape and results[0].device == x.device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_memory_mode_saves_less_and_agrees(rng, device, precision):
    x, w1, w2, r = make(rng, device)
    outs = {}
    for save, count in (("all", 6), ("linear1_out", 4)):
        xs = x.clone().requires_grad_()
        y = ct.gelu_ffn(xs, w1.clone().requires_grad_(), w2, precision=precision, save=save)
        saved = y.grad_fn.saved_tensors
        assert sum(s is not None for s in saved) == count  # x, w1, w2, linear1_out (+ tanh_inner, gelu_out)
        assert saved[3].shape == x.shape[:-1] + (w1.shape[0],)
        (y * r).sum().backward()
        outs[save] = (y.detach(), xs.grad)
    contract = cupyffn.PRECISIONS[precision].contract
    for a, b in zip(outs["all"], outs["linear1_out"]):
        assert rel(b, a.double()) <= contract


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ("bf16x3", "ieee"))
def test_module_matches_float64_autograd(rng, device, precision):
    lead, dim, hidden = SIZES[device]
    torch.manual_seed(1234)
    ffn = ct.GeluFFN(dim, hidden, precision=precision, device=device)
    assert ffn.weight1.shape == (hidden, dim) and ffn.weight2.shape == (dim, hidden)
    assert ffn.weight1.device.type == device and ffn.weight1.dtype == torch.float32
    # nn.Linear's init: U(-1/sqrt(in_features), 1/sqrt(in_features)), spread over the whole range
    for w, fan_in in ((ffn.weight1.detach(), dim), (ffn.weight2.detach(), hidden)):
        bound = 1 / fan_in ** 0.5
        assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.99 * bound
        assert abs(float(w.std()) - bound / 3 ** 0.5) < 0.02 * bound
    assert repr(ffn) == (f"GeluFFN(dim={dim}, hidden_dim={hidden}, bias=False, dtype=torch.float32, "
                         f"precision={precision!r}, save='all')")
    x, _, _, r = make(rng, device)
    x.requires_grad_()
    y = ffn(x)
    (y * r).sum().backward()
    refs = reference(x, ffn.weight1, ffn.weight2, r)
    results = (y.detach(), x.grad, ffn.weight1.grad, ffn.weight2.grad)
    assert_within(results, refs, cupyffn.PRECISIONS[precision].contract)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ("bf16x3", "ieee"))
def test_sgd_steps_track_the_torch_module(rng, device, precision):
    """5 SGD steps of GeluFFN and of a float64 torch module from the same weights stay together."""
    lead, dim, hidden = SIZES[device]
    torch.manual_seed(99)
    ffn = ct.GeluFFN(dim, hidden, precision=precision, device=device)
    ref = torch.nn.Sequential(torch.nn.Linear(dim, hidden, bias=False), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(hidden, dim, bias=False)).to(device=device, dtype=torch.float64)
    with torch.no_grad():
        ref[0].weight.copy_(ffn.weight1)
        ref[2].weight.copy_(ffn.weight2)
    start = [w.detach().double().clone() for w in (ffn.weight1, ffn.weight2)]
    lr = 40.0 / hidden
    opt, opt_ref = torch.optim.SGD(ffn.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    teacher = make(rng, device)[1:3]
    for step in range(5):
        x = make(rng, device)[0]
        with torch.no_grad():
            target = F.linear(F.gelu(F.linear(x, 2 * teacher[0]), approximate="tanh"), 2 * teacher[1])
        for model, o, dtype in ((ffn, opt, torch.float32), (ref, opt_ref, torch.float64)):
            o.zero_grad()
            loss = 0.5 * (model(x.to(dtype)) - target.to(dtype)).square().sum() / x.shape[:-1].numel()
            loss.backward()
            o.step()
    for w, w_ref, w0 in zip((ffn.weight1, ffn.weight2), (ref[0].weight, ref[2].weight), start):
        w, w_ref = w.detach().double(), w_ref.detach()
        assert float((w - w_ref).norm() / w_ref.norm()) < 1e-4
        # the updates themselves (the part the gradients made) agree to a small multiple of the contract
        update, update_ref = w - w0, w_ref - w0
        assert float(update_ref.norm() / w0.norm()) > 2e-3  # the weights did move (0.9% to 25% by size)
        assert float((update - update_ref).norm() / update_ref.norm()) < 10 * cupyffn.PRECISIONS[precision].contract


# On the CPU, "bf16x3" takes the door's NumPy backend and None ("ieee") the torch route; on CUDA the default.
WORK_PRECISIONS = [pytest.param("cpu", "bf16x3", id="cpu-numpy"), pytest.param("cpu", None, id="cpu-torch"),
                   pytest.param("cuda", None, marks=CUDA, id="cuda")]


@pytest.mark.parametrize("device,precision", WORK_PRECISIONS)
def test_needs_input_grad_selects_the_work(rng, device, precision, spy):
    x, w1, w2, r = make(rng, device)
    refs = reference(x, w1, w2, r)
    contract = cupyffn.PRECISIONS["bf16x3"].contract

    # x is data (no grad): only the weight gradients are computed
    w1p, w2p = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xd = x.clone()
    (ct.gelu_ffn(xd, w1p, w2p, precision) * r).sum().backward()
    kwargs = spy["backward"][-1][1]
    assert kwargs["need_grad_hidden"] is False and kwargs["need_weight_grads"] is True
    assert kwargs.get("route") == ("torch" if device == "cpu" and precision is None else None)
    assert xd.grad is None
    assert rel(w1p.grad, refs[2]) <= contract and rel(w2p.grad, refs[3]) <= contract

    # frozen weights: only grad_hidden_states
    xg = x.clone().requires_grad_()
    (ct.gelu_ffn(xg, w1, w2, precision) * r).sum().backward()
    kwargs = spy["backward"][-1][1]
    assert kwargs["need_grad_hidden"] is True and kwargs["need_weight_grads"] is False
    assert "out" not in kwargs or (kwargs["out"][1] is None and kwargs["out"][2] is None)
    assert w1.grad is None and w2.grad is None
    assert rel(xg.grad, refs[1]) <= contract

    # one weight frozen: both weight gradients come from the same GEMMs, the frozen one is dropped
    xg, w1p = x.clone().requires_grad_(), w1.clone().requires_grad_()
    (ct.gelu_ffn(xg, w1p, w2, precision) * r).sum().backward()
    kwargs = spy["backward"][-1][1]
    assert kwargs["need_grad_hidden"] is True and kwargs["need_weight_grads"] is True
    assert w2.grad is None
    assert rel(xg.grad, refs[1]) <= contract and rel(w1p.grad, refs[2]) <= contract
    assert len(spy["backward"]) == 3 and len(spy["forward"]) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_only_float32(rng, device):
    x, w1, w2, _ = make(rng, device, lead=(8,), dim=16, hidden=32)
    args = {"hidden_states": x, "weight1": w1, "weight2": w2}
    for name in args:
        bad = dict(args, **{name: args[name].double()})
        with pytest.raises(TypeError, match=f"{name} must be float32.*float64"):
            ct.GeluFFNFunction.apply(bad["hidden_states"], bad["weight1"], bad["weight2"], "bf16x3", "all")
    ffn = ct.GeluFFN(16, 32, device=device)
    with pytest.raises(TypeError, match="hidden_states must be float32.*float64"):
        ffn(x.double())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16.*float64"):
        ct.GeluFFN(16, 32, device=device, dtype=torch.float64)
    with pytest.raises(ValueError, match="save must be one of"):
        ct.gelu_ffn(x, w1, w2, save="nothing")
    with pytest.raises(ValueError, match="precision must be one of"):
        ct.gelu_ffn(x, w1, w2, precision="fp8")


def test_functions_say_a_tensor_requiring_grad_needs_detach_or_the_layer(rng):
    """A float32 CPU tensor that requires grad, given to the functional API: torch refuses to export it (DLPack);
    the error names the argument, says it requires grad (not a dtype problem) and gives both fixes."""
    import cupyffn

    x, w1, w2, _ = make(rng, "cpu", lead=(4,), dim=16, hidden=32)
    for i, name in enumerate(("hidden_states", "weight1", "weight2")):
        args = [x, w1, w2]
        args[i] = args[i].clone().requires_grad_()
        with pytest.raises(TypeError) as e:
            cupyffn.gelu_ffn_forward(*args)
        message = str(e.value)
        assert message.startswith(f"{name} is a torch tensor that requires grad")
        assert f"{name}.detach()" in message and "cupyffn.torch.GeluFFN / cupyffn.torch.gelu_ffn" in message
        assert "float32 arrays" not in message  # it is float32: the dtype is not what is wrong
    f = cupyffn.gelu_ffn_forward(x, w1, w2.clone().requires_grad_().detach())  # the fix named works
    assert torch.allclose(torch.as_tensor(f.output), ct.gelu_ffn(x, w1, w2), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_blames_an_input_of_the_wrong_width(device):
    """At the layer the weights are the layer's own: an input whose last dimension is not the layer's dim is the
    argument at fault, and the error says so (not weight1, which the functions' check would name)."""
    ffn = ct.GeluFFN(32, 64, device=device)
    with pytest.raises(ValueError, match=r"^the input of GeluFFN\(dim=32, hidden_dim=64\) must have shape "
                                         r"\[\.\.\., 32\] \(the layer's dim\); got \(4, 33\), last dimension 33$"):
        ffn(torch.randn(4, 33, device=device))
    with pytest.raises(ValueError, match=r"must have shape \[\.\.\., 32\] \(the layer's dim\); got a 0-d tensor$"):
        ffn(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="weight1 must have shape"):  # the function: either could be wrong
        ct.gelu_ffn(torch.randn(4, 33, device=device), ffn.weight1, ffn.weight2)
    assert ffn(torch.randn(2, 3, 32, device=device)).shape == (2, 3, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_zero_copy_where_readable(rng, device, spy):
    """Column slices go to cupyffn as they are; a transposed weight is made contiguous; results unchanged."""
    dim, hidden = 128, 512
    x_wide, w1, _, r = make(rng, device, lead=(2, 64), dim=dim + 32, hidden=hidden)
    w2_wide = make(rng, device, lead=(1,), dim=hidden + 8, hidden=dim)[1]  # [dim, hidden + 8]
    r = r[..., :dim]
    x_base, w2_base = x_wide.clone().requires_grad_(), w2_wide.clone().requires_grad_()
    w1_base = w1[:, :dim].t().contiguous().requires_grad_()  # [dim, hidden]
    x, w2, w1t = x_base[..., :dim], w2_base[:, :hidden], w1_base.t()  # w1t: strides (1, hidden)
    assert not x.is_contiguous() and not w2.is_contiguous() and not w1t.is_contiguous()
    y = ct.gelu_ffn(x, w1t, w2, "ieee")
    y.sum().backward()  # grad_output is an expanded tensor (stride 0): copied for cupyffn
    refs = reference(x, w1t, w2, torch.ones_like(r))
    results = (y.detach(), x_base.grad[..., :dim], w1_base.grad.t(), w2_base.grad[:, :hidden])
    assert_within(results, refs, cupyffn.PRECISIONS["ieee"].contract)
    assert float(x_base.grad[..., dim:].abs().max()) == 0 and float(w2_base.grad[:, hidden:].abs().max()) == 0

    def ptr(a):  # torch tensors (the torch CPU route, and CUDA), NumPy views (the door on the CPU), CuPy views
        if isinstance(a, torch.Tensor):
            return a.data_ptr()
        return a.__array_interface__["data"][0] if isinstance(a, numpy.ndarray) else a.data.ptr

    fwd_args, bwd_args = spy["forward"][-1][0], spy["backward"][-1][0]
    assert ptr(fwd_args[0]) == x.data_ptr() and ptr(fwd_args[2]) == w2.data_ptr()  # zero-copy
    assert ptr(fwd_args[1]) != w1t.data_ptr() and fwd_args[1].shape == (hidden, dim)  # contiguous copy
    dy = bwd_args[0]  # a NumPy view on the CPU, the tensor itself on CUDA (read by pointer)
    assert 0 not in (dy.strides if isinstance(dy, numpy.ndarray) else dy.stride())  # was stride 0: copied
    assert (spy["forward"][-1][1].get("route") == "torch") == (device == "cpu")  # "ieee" on the CPU: torch's ops


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(rng, device):
    x, w1, w2, _ = make(rng, device, lead=(0,), dim=64, hidden=256)
    x.requires_grad_()
    w1.requires_grad_()
    y = ct.gelu_ffn(x, w1, w2)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and w1.grad.shape == (256, 64) and float(w1.grad.abs().max()) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")
def test_cuda_side_stream_needs_no_synchronization(rng):
    """Forward and backward on a non-default torch stream, right after long work on it, read back on it."""
    x, w1, w2, r = make(rng, "cuda")
    refs = reference(x, w1, w2, r)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keeps `side` busy for a while: work not ordered after it would read stale data
            busy = torch.tanh(busy @ busy)
        xs = torch.empty_like(x)
        xs.copy_(x + 0 * busy[0, 0])  # x's values land only after the busy work
        xs.requires_grad_()
        w1p, w2p = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = ct.gelu_ffn(xs, w1p, w2p, precision="bf16x3")
        (y * r).sum().backward()
        errors = [rel(a, b) for a, b in zip((y.detach(), xs.grad, w1p.grad, w2p.grad), refs)]  # .norm() read on `side`
    assert all(e <= cupyffn.PRECISIONS["bf16x3"].contract for e in errors), errors


# ---------------------------------------------------------------------- operators, torch.compile, autocast (CPU)
def test_operators_pass_opcheck(rng):
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration, AOT dispatch."""
    x, w1, w2, r = make(rng, "cpu", lead=(4, 8), dim=32, hidden=64)
    x, w1, w2 = (t.requires_grad_() for t in (x, w1, w2))
    for save in ("all", "linear1_out"):
        torch.library.opcheck(torch.ops.cupyffn.forward.default, (x, w1, w2, None, None, "ieee", save))
    y, z, t, g = torch.ops.cupyffn.forward(x.detach(), w1.detach(), w2.detach(), None, None, "ieee", "all")[:4]
    for need_x, need_w in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.cupyffn.backward.default,
                              (r, x.detach(), w1.detach(), w2.detach(), z, t, g, "ieee", need_x, need_w, False))
    torch.library.opcheck(torch.ops.cupyffn.backward.default,
                          (r, x.detach(), w1.detach(), w2.detach(), z, None, None, "ieee", True, True, False))


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
def test_fullgraph_compile_gives_the_eager_gradients(rng, backend):
    torch._dynamo.reset()
    lead, dim, hidden = (2, 32), 64, 256
    torch.manual_seed(5)
    ffn = ct.GeluFFN(dim, hidden, precision="bf16x3")
    x, _, _, r = make(rng, "cpu", lead=lead, dim=dim, hidden=hidden)

    def step(model):
        xs = x.clone().requires_grad_()
        ffn.zero_grad(set_to_none=True)
        y = model(xs)
        (torch.tanh(y) * r).sum().backward()  # a nonlinear loss: grad_output is not r itself
        return y.detach(), xs.grad, ffn.weight1.grad.clone(), ffn.weight2.grad.clone()

    eager = step(ffn)
    explanation = torch._dynamo.explain(ffn)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = step(torch.compile(ffn, fullgraph=True, backend=backend))
    for a, b, name in zip(compiled, eager, NAMES):
        assert torch.equal(a, b), name  # the same cupyffn calls on the same values
    with torch.no_grad():
        y64 = F.linear(F.gelu(F.linear(x.double(), ffn.weight1.double()), approximate="tanh"), ffn.weight2.double())
    assert rel(compiled[0], y64) <= cupyffn.PRECISIONS["bf16x3"].contract


def test_compile_with_dynamic_shapes(rng):
    torch._dynamo.reset()
    ffn = ct.GeluFFN(32, 64, precision="ieee")
    compiled = torch.compile(ffn, fullgraph=True, backend="aot_eager", dynamic=True)
    for rows in (8, 24, 40):
        x = make(rng, "cpu", lead=(rows,), dim=32, hidden=64)[0]
        assert torch.equal(compiled(x), ffn(x))


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
def test_autocast_computes_in_float32(rng, compiled):
    """gelu_ffn (the float32 operators) under bf16 autocast: inputs cast to float32, float32 output, gradients in
    the inputs' dtypes. (The GeluFFN module runs the 16-bit plan under autocast: test_torch_layer_lt.py.)"""
    torch._dynamo.reset()
    dim, hidden = 64, 256
    torch.manual_seed(9)
    ffn = ct.GeluFFN(dim, hidden, precision="ieee")

    def block(x):
        return ct.gelu_ffn(x, ffn.weight1, ffn.weight2, "ieee")

    model = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
    x, _, _, r = make(rng, "cpu", lead=(32,), dim=dim, hidden=hidden)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(xb)
        z = F.linear(y, torch.eye(dim))  # a torch op after it runs in bf16 as usual
    assert y.dtype == torch.float32 and z.dtype == torch.bfloat16
    (y * r).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and ffn.weight1.grad.dtype == torch.float32
    refs = reference(xb.detach().float(), ffn.weight1, ffn.weight2, r)
    contract = cupyffn.PRECISIONS["ieee"].contract
    assert rel(y, refs[0]) <= contract
    assert rel(ffn.weight1.grad, refs[2]) <= contract and rel(ffn.weight2.grad, refs[3]) <= contract
    assert float((xb.grad.double() - refs[1]).norm() / refs[1].norm()) <= 2 ** -8  # bf16 rounding of grad_x


def test_gelu_ffn_function_keeps_its_name(rng):
    x, w1, w2, r = make(rng, "cpu", lead=(16,), dim=32, hidden=64)
    a = ct.GeluFFNFunction.apply(x, w1, w2, "ieee", "linear1_out")
    assert torch.equal(a, ct.gelu_ffn(x, w1, w2, "ieee", "linear1_out"))
    assert torch.equal(a, torch.ops.cupyffn.forward(x, w1, w2, None, None, "ieee", "linear1_out")[0])


# ---------------------------------------------------------------------- the eager fast path and the operators
def op_layer(x, w1, w2, precision="bf16x3", save="all"):
    """The layer through the custom operators (what torch.compile sees), eager."""
    return torch.ops.cupyffn.forward(x, w1, w2, None, None, precision, save)[0]


def test_eager_mode_takes_the_function_and_compile_the_operators(rng, entry_counter):
    torch._dynamo.reset()
    dim, hidden = 32, 64
    ffn = ct.GeluFFN(dim, hidden, precision="ieee")
    x = make(rng, "cpu", lead=(8,), dim=dim, hidden=hidden)[0].requires_grad_()
    y = ffn(x)
    assert y.grad_fn.name() == "EagerGeluFFNBackward"  # autograd's node for the eager Function
    y.sum().backward()
    assert entry_counter.counts() == {"eager": 1, "operator": 0}

    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    compiled = torch.compile(ffn, fullgraph=True, backend=recording_backend)
    x2 = x.detach().clone().requires_grad_()
    y2 = compiled(x2)
    y2.sum().backward()
    # dynamo recorded the operator (as its packet or overload), not the Function
    assert {torch.ops.cupyffn.forward, torch.ops.cupyffn.forward.default} & set(targets)
    assert entry_counter.counts() == {"eager": 1, "operator": 1}  # the compiled call ran the operator
    assert torch.equal(y2, y) and torch.equal(x2.grad, x.grad)


def test_fake_tensors_take_the_operators(rng, entry_counter):
    """Under FakeTensorMode (as export / make_fx trace) the eager Function would read a fake tensor's memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recorder(TorchDispatchMode):  # above the fake mode: sees each operator on its way there
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode() as mode:
        x = mode.from_tensor(make(rng, "cpu", lead=(4, 8), dim=32, hidden=64)[0])
        w1, w2 = torch.empty(64, 32), torch.empty(32, 64)
        with Recorder():
            y = ct.gelu_ffn(x, w1, w2)
    assert y.shape == (4, 8, 32) and y.dtype == torch.float32
    assert seen.count(torch.ops.cupyffn.forward.default) == 1  # the operator, once
    assert entry_counter.counts() == {"eager": 0, "operator": 0}  # its fake implementation: no body ran


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("save", ("all", "linear1_out"))
@pytest.mark.parametrize("precision", PRECISION_NAMES)
def test_eager_function_and_operators_give_identical_results(rng, entry_counter, device, precision, save):
    """One implementation behind both entry points: bitwise the same output and gradients."""
    x, w1, w2, r = make(rng, device)
    run(lambda a, b, c: ct.gelu_ffn(a, b, c, precision, save), x, w1, w2, r)  # tf32's scale state (GPU) alike
    ops = run(lambda a, b, c: op_layer(a, b, c, precision, save), x, w1, w2, r)
    eager = run(lambda a, b, c: ct.gelu_ffn(a, b, c, precision, save), x, w1, w2, r)
    assert entry_counter.counts() == {"eager": 2, "operator": 1}
    for a, b, name in zip(eager, ops, NAMES):
        assert torch.equal(a, b), name
    assert_within(eager, reference(x, w1, w2, r), cupyffn.PRECISIONS[precision].contract)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_ffn_backward_is_the_operator_without_placeholders(rng, device):
    x, w1, w2, r = make(rng, device)
    y, z, t, g = torch.ops.cupyffn.forward(x, w1, w2, None, None, "bf16x3", "all")[:4]
    for need_x, need_w in ((True, True), (True, False), (False, True)):
        fast = ct.gelu_ffn_backward(r, x, w1, w2, z, t, g, "bf16x3", need_x, need_w)
        op = torch.ops.cupyffn.backward(r, x, w1, w2, z, t, g, "bf16x3", need_x, need_w, False)
        for a, b, needed in zip(fast, op, (need_x, need_w, need_w)):
            if needed:
                assert torch.equal(a, b)
            else:
                assert a is None and b.shape == (0,)
    refs = reference(x, w1, w2, r)
    grads = ct.gelu_ffn_backward(r, x, w1, w2, z, None, None)  # memory mode
    assert_within((y,) + grads, refs, cupyffn.PRECISIONS["bf16x3"].contract)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_eager_autocast_casts_to_float32(rng, entry_counter, dtype):
    """CPU autocast on the eager path: the float32 call's results exactly (inputs cast to float32 first)."""
    x, w1, w2, r = make(rng, "cpu", lead=(32,), dim=64, hidden=256)
    x_low = x.to(dtype)
    xa, w1a, w2a = x_low.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y = ct.gelu_ffn(xa, w1a, w2a, "ieee")
    assert entry_counter.counts() == {"eager": 1, "operator": 0}
    assert y.dtype == torch.float32
    (y * r).sum().backward()
    want = run(lambda a, b, c: ct.gelu_ffn(a, b, c, "ieee"), x_low.float(), w1, w2, r)
    assert torch.equal(y.detach(), want[0])
    assert torch.equal(w1a.grad, want[2]) and torch.equal(w2a.grad, want[3])
    assert xa.grad.dtype == dtype and torch.equal(xa.grad, want[1].to(dtype))  # autograd casts grad_x back
    assert_within(want, reference(x_low.float(), w1, w2, r), cupyffn.PRECISIONS["ieee"].contract)
    with torch.autocast("cpu", dtype=dtype), pytest.raises(TypeError, match="hidden_states must be float32"):
        ct.gelu_ffn(x.double(), w1, w2)  # float64 is not cast by autocast (as the operator's rule)


def test_eager_double_backward_raises(rng):
    x, w1, w2, r = make(rng, "cpu", lead=(8,), dim=32, hidden=64)
    x.requires_grad_()
    (gx,) = torch.autograd.grad(ct.gelu_ffn(x, w1, w2).square().sum(), x, create_graph=True)  # dy needs grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_every_allocated_result_is_written(rng, device, monkeypatch):
    """Every tensor the layer allocates for cupyffn to write starts NaN: an unwritten one fails the check."""
    from cupyffn.frameworks import torch_ops

    monkeypatch.setattr(torch_ops.TorchDevice, "empty", lambda dev, shape, dtype=torch.float32: torch.full(
        shape, float("nan"), dtype=dtype, device=dev.device))
    x, w1, w2, r = make(rng, device)
    results = run(lambda a, b, c: ct.gelu_ffn(a, b, c, "bf16x3"), x, w1, w2, r)
    assert_within(results, reference(x, w1, w2, r), cupyffn.PRECISIONS["bf16x3"].contract)


@pytest.mark.parametrize("device", DEVICES)
def test_default_precision_is_the_devices(rng, device, spy, monkeypatch):
    """No precision argument: "ieee" (plain fp32) for CPU tensors, "fp16+fp8" for CUDA tensors, decided per call by
    the input's device (so a module keeps following .to(device)); bit-identical to naming that precision. The layer
    passes None on: the door resolves it for the device."""
    want = cupyffn.CPU_DEFAULT_PRECISION if device == "cpu" else cupyffn.DEFAULT_PRECISION
    from cupyffn.api import execute

    executed, door_run = [], execute.run  # the precision of every call the door executes

    def record(call, *args, **kwargs):
        executed.append(call.precision.name)
        return door_run(call, *args, **kwargs)

    monkeypatch.setattr(execute, "run", record)

    def ran():
        """The precisions of the calls the door executed since the last look (the torch CPU route's too)."""
        names = list(executed)
        spy["forward"].clear(), spy["backward"].clear(), executed.clear()
        return names

    x, w1, w2, r = make(rng, device, lead=(16,), dim=32, hidden=64)
    default = run(lambda a, b, c: ct.gelu_ffn(a, b, c), x, w1, w2, r)
    assert set(ran()) == {want}
    named = run(lambda a, b, c: ct.gelu_ffn(a, b, c, want), x, w1, w2, r)
    assert set(ran()) == {want}
    for a, b in zip(default, named):
        assert torch.equal(a, b)
    ffn = ct.GeluFFN(32, 64, device=device)
    assert ffn.precision is None and "precision=None" in repr(ffn)
    ffn(x)
    assert ran() == [want]
    grads = ct.gelu_ffn_backward(r, x, w1, w2, *_saved(x, w1))
    assert ran() == [want] and grads[0].shape == x.shape
    if device == "cpu":  # the GPU's default stays selectable on the CPU, and computes something else
        emulated = run(lambda a, b, c: ct.gelu_ffn(a, b, c, "fp16+fp8"), x, w1, w2, r)
        assert not torch.equal(emulated[2], default[2])


def _saved(x, w1):
    """linear1_out, tanh_inner, gelu_out of x and w1, float32."""
    z = F.linear(x, w1)
    t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3))
    return z, t, 0.5 * z * (1 + t)


@pytest.mark.parametrize("precision", ("ieee", "bf16x3"), ids=("torch-route", "numpy-route"))
def test_geluffn_takes_every_input_layout_nn_linear_takes(rng, precision):
    """A transposed, permuted, expanded or sliced input: GeluFFN computes what it computes on the contiguous copy, as
    nn.Linear does, in the forward and the backward (no error naming internal arguments or NumPy's functions)."""
    torch.manual_seed(0)
    ffn = ct.GeluFFN(32, 64, bias=True, precision=precision)
    base = torch.from_numpy(rng.standard_normal((6, 8, 32)).astype(numpy.float32))
    layouts = {  # each a view of a leaf tensor the gradient reaches through it
        "transposed": (base[0].t().contiguous(), lambda leaf: leaf.t()),                 # [8, 32], strides (1, 8)
        "permuted": (base.permute(2, 0, 1).contiguous(), lambda leaf: leaf.permute(1, 2, 0)),
        "expanded": (base[:1].clone(), lambda leaf: leaf.expand(6, 8, 32)),             # stride 0
        "column slice": (torch.cat([base, base], -1), lambda leaf: leaf[..., 7:39]),
        "batch-major transpose": (base.transpose(0, 1).contiguous(), lambda leaf: leaf.transpose(0, 1)),
    }
    for name, (source, view) in layouts.items():
        results = []
        for contiguous in (False, True):
            leaf = source.clone().requires_grad_()
            x = view(leaf)
            assert x.is_contiguous() is False, name
            ffn.zero_grad(set_to_none=True)
            y = ffn(x.contiguous() if contiguous else x)
            (y * y).sum().backward()
            results.append([y.detach(), leaf.grad] + [p.grad.clone() for p in ffn.parameters()])
        for a, b in zip(*results):
            assert torch.equal(a, b), name
        x = view(source)
        with torch.no_grad():
            plain = F.linear(F.gelu(F.linear(x, ffn.weight1, ffn.bias1), approximate="tanh"), ffn.weight2, ffn.bias2)
        assert float((results[0][0] - plain).norm() / plain.norm()) <= cupyffn.PRECISIONS[precision].contract


def test_geluffn_signature_is_public_only():
    import inspect

    params = inspect.signature(ct.GeluFFN).parameters
    assert list(params) == ["dim", "hidden_dim", "bias", "precision", "save", "device", "dtype"]
    assert not any(name.startswith("_") for name in params)
