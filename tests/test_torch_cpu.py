"""CPU: the torch layer's CPU route (cupyffn/cpu/torch_route.py, a row of the route table, docs/decisions/059): CPU
tensors in "ieee" and in bf16 / fp16 are computed by torch's GEMMs and activation.py's NumPy GELU; the emulated
precisions keep the door's NumPy backend. Checked against the NumPy backend on the same values (today's route) and float64: the same results
within each contract; the door's validation and messages; autocast off inside the route."""

import numpy
import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
import cupyffn  # noqa: E402
import cupyffn.torch as ct  # noqa: E402
from cupyffn.core import views  # noqa: E402
from cupyffn.frameworks import torch_ops  # noqa: E402

F = torch.nn.functional
IEEE = cupyffn.PRECISIONS["ieee"].contract


def rel(a, ref):
    a, ref = torch.as_tensor(numpy.asarray(a, dtype=numpy.float64)) if isinstance(a, numpy.ndarray) else a, ref
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def tensors(rng, lead, dim, hidden, bias, conv1d=False):
    x = torch.from_numpy(rng.standard_normal(lead + (dim,)).astype(numpy.float32))
    w1 = torch.from_numpy((rng.uniform(-1, 1, (hidden, dim)) / numpy.sqrt(dim)).astype(numpy.float32))
    w2 = torch.from_numpy((rng.uniform(-1, 1, (dim, hidden)) / numpy.sqrt(hidden)).astype(numpy.float32))
    if conv1d:  # transformers' Conv1D: [in, out] storage, used as [out, in] views
        w1, w2 = w1.t().contiguous().t(), w2.t().contiguous().t()
    b1 = torch.from_numpy(rng.uniform(-0.1, 0.1, hidden).astype(numpy.float32)) if bias else None
    b2 = torch.from_numpy(rng.uniform(-0.1, 0.1, dim).astype(numpy.float32)) if bias else None
    dy = torch.from_numpy(rng.standard_normal(lead + (dim,)).astype(numpy.float32))
    return x, w1, w2, b1, b2, dy


def reference(x, w1, w2, b1, b2, dy):
    """float64 (y, z, t, g, grad_x, grad_w1, grad_w2, grad_b1, grad_b2) by torch autograd."""
    xd, w1d, w2d = (a.double().requires_grad_() for a in (x, w1, w2))
    bd = [None if b is None else b.double().requires_grad_() for b in (b1, b2)]
    z = F.linear(xd, w1d, bd[0])
    t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    y = F.linear(g, w2d, bd[1])
    (y * dy.double()).sum().backward()
    return [v.detach() for v in (y, z, t, g)] + [xd.grad, w1d.grad, w2d.grad] + [
        None if b is None else b.grad for b in bd]


def numpy_route(x, w1, w2, b1, b2, dy, save):
    """The same call through the door with NumPy arrays (the NumPy backend: the CPU route before 059)."""
    n = [None if a is None else a.numpy() for a in (x, w1, w2, b1, b2, dy)]
    f = cupyffn.gelu_ffn_forward(n[0], n[1], n[2], bias1=n[3], bias2=n[4], precision="ieee")
    t, g = (f.tanh_inner, f.gelu_out) if save == "all" else (None, None)
    b = cupyffn.gelu_ffn_backward(n[5], n[0], n[1], n[2], f.linear1_out, t, g, precision="ieee",
                                  need_bias_grads=b1 is not None)
    grads = [b.grad_hidden_states, b.grad_weight1, b.grad_weight2]
    grads += [b.grad_bias1, b.grad_bias2] if b1 is not None else [None, None]
    return list(f) + grads


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("save", ("all", "linear1_out"))
@pytest.mark.parametrize("conv1d", (False, True), ids=("linear", "conv1d"))
def test_float32_route_equals_the_numpy_backend_within_the_contract(rng, entry_counter, bias, save, conv1d):
    x, w1, w2, b1, b2, dy = tensors(rng, (3, 50), 48, 160, bias, conv1d)
    ref = reference(x, w1, w2, b1, b2, dy)
    before = numpy_route(x, w1, w2, b1, b2, dy, save)
    y, z, t, g = torch_ops.forward_impl(x, w1, w2, b1, b2, "ieee")[:4]
    grads = torch_ops.backward_impl(dy, x, w1, w2, z, t if save == "all" else None, g if save == "all" else None,
                                    "ieee", True, True, bias)
    assert (entry_counter.bodies, entry_counter.eager) == (1, 0)  # the bodies themselves, no layer
    now = [y, z, t, g] + list(grads)
    for name, a, b, want in zip(("y", "z", "t", "g", "dx", "dw1", "dw2", "db1", "db2"), now, before, ref):
        if want is None:
            assert a is None and b is None, name
            continue
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.shape == want.shape, name
        assert a.is_contiguous(), name  # as the operators' fake implementations say
        assert rel(a, want) <= IEEE and rel(b, want) <= IEEE, (name, rel(a, want), rel(b, want))
        assert rel(a, torch.from_numpy(numpy.asarray(b))) <= IEEE, name  # today's values within the contract


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("weights", ("float32", "16-bit"))
def test_16bit_route_within_the_contract(rng, dtype, weights):
    """bf16: torch's bf16 GEMMs, autocast's numbers (within 1.25x of its error is the contract; measured 1.0x);
    fp16: fp32 GEMMs of the fp16 operands, the NumPy backend's numbers."""
    x, w1, w2, b1, b2, dy = tensors(rng, (2, 96), 64, 256, True)
    wt = torch.float32 if weights == "float32" else dtype
    w1, w2, b1, b2 = (a.to(wt) for a in (w1, w2, b1, b2))
    xs, dys = x.to(dtype), dy.to(dtype)
    ref = reference(xs.float(), w1.to(dtype).float(), w2.to(dtype).float(), b1.to(dtype).float(),
                    b2.to(dtype).float(), dys.float())
    y, z, t, g = torch_ops.forward_impl(xs, w1, w2, b1, b2, None)[:4]
    assert t.shape == (0,) and all(a.dtype == dtype for a in (y, z, g))
    grads = torch_ops.backward_impl(dys, xs, w1, w2, z, None, g, None, True, True, True)
    assert [a.dtype for a in grads] == [dtype] + [wt] * 4

    n = [None if a is None else views.numpy_view(a) for a in (xs, w1, w2, b1, b2, dys)]
    f = cupyffn.gelu_ffn_forward(n[0], n[1], n[2], bias1=n[3], bias2=n[4])
    b = cupyffn.gelu_ffn_backward(n[5], n[0], n[1], n[2], f.linear1_out, None, f.gelu_out, need_bias_grads=True,
                                  out=[numpy.empty(s, dt) for s, dt in ((xs.shape, n[0].dtype), (w1.shape, n[1].dtype),
                                                                      (w2.shape, n[2].dtype), (b1.shape, n[3].dtype),
                                                                      (b2.shape, n[4].dtype))])
    before = [f.output, f.gelu_out] + list(b) + [b.grad_bias1, b.grad_bias2]
    torch_autocast = _autocast_errors(xs, w1, w2, b1, b2, dys, ref, dtype)
    for name, a, old, want, theirs in zip(("y", "g", "dx", "dw1", "dw2", "db1", "db2"), [y, g] + list(grads), before,
                                          [ref[0], ref[3]] + ref[4:], torch_autocast):
        mine, today = rel(a, want), rel(torch.from_numpy(numpy.asarray(old, dtype=numpy.float32)), want)
        assert mine <= 1.25 * theirs + 1e-6, (name, mine, theirs)
        if dtype is torch.float16:  # the same roundings: equal within summation order
            assert abs(mine - today) <= 0.02 * today + 1e-6, (name, mine, today)
        else:
            # autocast's roundings (bf16 GEMM results; the GELU of the rounded linear1_out): within 1.25x of its
            # error, above the NumPy backend's fp32-result roundings (059: 1.0-1.3x, gelu_out 1.6x)
            assert mine <= 2 * today, (name, mine, today)


def _autocast_errors(x, w1, w2, b1, b2, dy, ref, dtype):
    """torch autocast's errors against `ref` for (y, g, dx, dw1, dw2, db1, db2) of the plain block."""
    xa = x.float().requires_grad_()
    params = [a.detach().clone().requires_grad_() for a in (w1, w2, b1, b2)]
    with torch.autocast("cpu", dtype=dtype):
        g = F.gelu(F.linear(xa, params[0], params[2]), approximate="tanh")
        y = F.linear(g, params[1], params[3])
    (y.float() * dy.float()).sum().backward()
    got = [y, g, xa.grad] + [p.grad for p in params]
    return [rel(a, want) for a, want in zip(got, [ref[0], ref[3]] + ref[4:])]


@pytest.mark.parametrize("precision", tuple(cupyffn.PRECISIONS))
def test_each_precision_takes_its_route(rng, precision, monkeypatch):
    """The route table's torch row for "ieee" and 16-bit activations, its NumPy row for the emulated precisions; the
    functions' NumPy arrays keep the NumPy row in every precision."""
    from cupyffn.api import execute

    seen, real = [], execute.run
    monkeypatch.setattr(execute, "run", lambda call, route, *a, **k: seen.append(route.engine) or real(call, route, *a,
                                                                                                        **k))
    x, w1, w2, _, _, dy = tensors(rng, (24,), 16, 64, False)
    x.requires_grad_()
    (ct.gelu_ffn(x, w1.requires_grad_(), w2.requires_grad_(), precision) * dy).sum().backward()
    route = "torch cpu" if precision == "ieee" else "numpy"  # the emulated GPU precisions keep the NumPy backend
    assert seen == [route, route] and x.grad.shape == x.shape
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ct.GeluFFN(16, 64, precision=precision)(x).float().sum().backward()  # 16-bit: precision does not apply
    assert seen == ["torch cpu", "torch cpu"]
    seen.clear()
    cupyffn.gelu_ffn_forward(x.detach().numpy(), w1.detach().numpy(), w2.detach().numpy(), precision=precision)
    assert seen == ["numpy"]


def _record(seen, label, fn):
    def recorder(*args, **kwargs):
        seen.append(label)
        return fn(*args, **kwargs)
    return recorder


def test_errors_read_as_the_doors(rng):
    """A call the door refuses is refused on the torch route with the door's own message, before any work."""
    x, w1, w2, _, _, _ = tensors(rng, (8,), 16, 32, False)
    bad_w2 = w2[:, :30]  # [16, 30] for hidden 32
    with pytest.raises(ValueError) as numpy_error:
        cupyffn.gelu_ffn_forward(x.numpy(), w1.numpy(), bad_w2.numpy())
    with pytest.raises(ValueError) as torch_error:
        ct.gelu_ffn(x, w1, bad_w2, "ieee")
    assert str(torch_error.value) == str(numpy_error.value) and "weight2" in str(torch_error.value)
    with pytest.raises(ValueError, match="bias1 must have shape"):
        torch_ops.forward_impl(x, w1, w2, torch.zeros(1), None, "ieee")  # torch would broadcast it


def test_autocast_is_off_inside_the_route(rng):
    """gelu_ffn computes in float32 under autocast: the same bits as outside it (the route's GEMMs are not
    autocast's bf16 ones)."""
    x, w1, w2, _, _, _ = tensors(rng, (40,), 32, 64, False)
    want = ct.gelu_ffn(x, w1, w2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ct.gelu_ffn(x, w1, w2)
        assert torch.is_autocast_enabled("cpu")
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_validation_is_remembered_per_geometry(rng, monkeypatch):
    """A repeated geometry is validated once (the door remembers the NumPy views' configuration); a new one again."""
    from cupyffn.api import validate

    count = []
    monkeypatch.setattr(validate, "validate", _record(count, "validate", validate.validate))
    cupyffn.clear_cache()
    x, w1, w2, _, _, _ = tensors(rng, (12,), 16, 32, False)
    for _ in range(3):
        torch_ops.forward_impl(x, w1, w2, None, None, "ieee")
    assert len(count) == 1
    torch_ops.forward_impl(x[:6], w1, w2, None, None, "ieee")
    assert len(count) == 2


def test_the_cpu_benchmark_runs_and_reports_ratios():
    """benchmarks/torch_cpu.py (docs/performance.md's CPU figures) at toy sizes: both sides timed, the ratio theirs."""
    from benchmarks import torch_cpu as bench

    rows = bench.layer_rows(steps=2, warmup=1, tokens=64, dim=16, hidden=64)
    assert [r["row"] for r in rows] == ["T=64 dim=16 hidden=64 float32", "T=64 dim=16 hidden=64 bf16 autocast"]
    pytest.importorskip("transformers", reason="transformers not installed (the GPT-2 rows build its model)")
    rows += bench.gpt2_rows(steps=2, warmup=1, modes=("eager",))
    assert rows[-1]["row"] == "train_gpt2.py --small step, eager"
    for r in rows:
        assert r["torch_ms"] > 0 and r["cupyffn_ms"] > 0
        assert r["ratio"] == pytest.approx(r["cupyffn_ms"] / r["torch_ms"])


def test_the_cpu_benchmark_records_the_host(tmp_path, monkeypatch):
    """benchmarks/torch_cpu.py --json always records the CPU's model and instruction set (CPU figures depend on the
    host, performance.md 8) and torch's kernel level, beside the rows it measured (toy sizes here)."""
    import functools
    import json

    from benchmarks import cpu as C
    from benchmarks import torch_cpu as bench

    monkeypatch.setattr(bench, "layer_rows", functools.partial(bench.layer_rows, tokens=64, dim=16, hidden=64))
    path = tmp_path / "torch-cpu.json"
    rows = bench.main(["--part", "layer", "--steps", "2", "--warmup", "1", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["rows"] == rows and len(rows) == 2
    assert result["env"]["cpu"] == C.host_cpu()
    assert result["env"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert result["command"] == f"python -m benchmarks.torch_cpu --part layer --steps 2 --warmup 1 --json {path}"
