"""GPU: biases and 16-bit activations (the cuBLASLt engine, cupyffn/lt/engine.py, through the front door) against
float64, the NumPy route, and torch's autocast on the same inputs."""

import math

import numpy
import pytest

import cupyffn

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

DT = {"bfloat16": numpy.dtype(ml_dtypes.bfloat16), "float16": numpy.dtype(numpy.float16),
      "float32": numpy.dtype(numpy.float32)}
C = math.sqrt(2 / math.pi)


def host(a):
    """float64 NumPy copy of a device or host array of any of the three dtypes."""
    if isinstance(a, cupy.ndarray):
        a = cupy.asnumpy(a)
    return numpy.asarray(a).astype(numpy.float64)


def rel(got, ref):
    got, ref = host(got), numpy.asarray(ref, numpy.float64)
    assert numpy.isfinite(got).all()
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def make(T, D, H, act, seed, bias=True, weights="float32"):
    """Host arrays: x, dy in `act`; weights and biases in `weights` (benchmark-style scales)."""
    r = numpy.random.default_rng(seed)
    x = r.standard_normal((T, D)).astype(DT[act])
    dy = r.standard_normal((T, D)).astype(DT[act])
    w1 = (0.02 * r.standard_normal((H, D))).astype(DT[weights])
    w2 = (0.02 * r.standard_normal((D, H))).astype(DT[weights])
    b1 = (0.5 * r.standard_normal(H)).astype(DT[weights]) if bias else None
    b2 = (0.5 * r.standard_normal(D)).astype(DT[weights]) if bias else None
    return x, dy, w1, w2, b1, b2


def reference(x, dy, w1, w2, b1, b2):
    """float64: (output, linear1_out, gelu_out), (grad_hidden, grad_w1, grad_w2, grad_b1, grad_b2)."""
    x, dy, w1, w2 = (host(a) for a in (x, dy, w1, w2))
    z = x @ w1.T + (host(b1) if b1 is not None else 0)
    t = numpy.tanh(C * (z + 0.044715 * z ** 3))
    g = 0.5 * z * (1 + t)
    y = g @ w2.T + (host(b2) if b2 is not None else 0)
    d = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z)
    gl = (dy @ w2) * d
    return (y, z, g), (gl @ w1, gl.T @ x, dy.T @ g, gl.sum(0), dy.sum(0))


def dev(*arrays):
    return [None if a is None else cupy.asarray(a) for a in arrays]


def nan_like(shape, dtype):
    a = cupy.empty(shape, DT[dtype])
    a.view(numpy.uint16 if DT[dtype].itemsize == 2 else numpy.uint32).fill(
        {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}[dtype])
    return a


@pytest.mark.parametrize("act", ["float16", "float32"])
def test_gelu_is_the_tanh_form(act):
    """gelu_out is tanh-GELU, not erf-GELU, on both routes with a bias: cuBLASLt's GELU_AUX_BIAS epilogue (float16)
    and the float32 engine's forward (which also returns tanh_inner). Judged where z in [-3.5, -2]: there the two
    forms are 1e-4 to 5e-4 apart while float16's rounding of gelu_out is below 2.5e-5."""
    x, dy, w1, w2, b1, b2 = make(4096, 64, 256, act, 1)
    b1 = (3 * b1).astype(numpy.float32)  # spread z over [-5, 5]
    f = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=cupy.asarray(b1))
    w1r, b1r = (a.astype(DT[act]).astype(numpy.float64) for a in (w1, b1))  # as the route rounds them
    z = x.astype(numpy.float64) @ w1r.T + b1r
    tanh = numpy.tanh(C * (z + 0.044715 * z ** 3))
    tanh_form = 0.5 * z * (1 + tanh)
    erf_form = 0.5 * z * (1 + numpy.vectorize(math.erf)(z / math.sqrt(2)))
    band = (z > -3.5) & (z < -2)
    assert band.sum() > 1000
    gap = numpy.abs(erf_form - tanh_form)[band].mean()
    assert gap > 1e-4
    assert numpy.abs(host(f.gelu_out) - tanh_form)[band].mean() < 0.2 * gap
    if act == "float32":
        assert numpy.abs(host(f.tanh_inner) - tanh).max() < 1e-4
    else:
        assert f.tanh_inner is None  # recomputed from linear1_out by the backward


@pytest.mark.parametrize("act", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 613, 2048])
def test_forward_and_backward_match_float64_and_the_numpy_route(act, bias, T):
    D, H = 256, 1024
    x, dy, w1, w2, b1, b2 = make(T, D, H, act, T + D, bias)
    (ry, rz, rg), rgrads = reference(x, dy, w1, w2, b1, b2)
    out = [nan_like((T, D), act), nan_like((T, H), act), None, nan_like((T, H), act)]
    f = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=dev(b1)[0], bias2=dev(b2)[0], out=out)
    assert f.output is out[0] and f.gelu_out is out[3]
    cpu = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    # float32 with biases runs the float32 engine in the default precision: its contract
    tol = {"bfloat16": 1.5e-2, "float16": 2e-3, "float32": cupyffn.PRECISIONS[cupyffn.DEFAULT_PRECISION].contract}[act]
    for got, want, ref in zip((f.output, f.linear1_out, f.gelu_out), (cpu.output, cpu.linear1_out, cpu.gelu_out),
                              (ry, rz, rg)):
        assert got.dtype == DT[act]
        assert rel(got, ref) < tol
        assert rel(got, host(want)) < tol  # the NumPy route computes the same thing
    grads = [nan_like((T, D), act), nan_like((H, D), "float32"), nan_like((D, H), "float32"),
             nan_like((H,), "float32"), nan_like((D,), "float32")]
    g = cupyffn.gelu_ffn_backward(*dev(dy, x, w1, w2), f.linear1_out, None, f.gelu_out, out=grads,
                                  need_bias_grads=True)
    assert list(g) == grads[:3] and g.grad_bias1 is grads[3] and g.grad_bias2 is grads[4]
    gc = cupyffn.gelu_ffn_backward(dy, x, w1, w2, host(f.linear1_out).astype(DT[act]), None,
                                   host(f.gelu_out).astype(DT[act]), need_bias_grads=True)
    for name, got, want, ref in zip(("dx", "dw1", "dw2", "db1", "db2"), grads, list(gc) + [gc.grad_bias1,
                                    gc.grad_bias2], rgrads):
        assert rel(got, ref) < tol, name
        assert rel(got, host(want)) < tol, name


@pytest.mark.parametrize("precision", ["tf32"])
@pytest.mark.parametrize("T", [256, 8192])
def test_float32_with_biases_in_tf32(precision, T):
    """float32 activations with biases in precision tf32 (the float32 engine's tf32 plan, docs/precisions.md):
    every output within the precision's contract against float64 at the SD3.5 block's shape, and close to the
    NumPy route's rounding model (operands rounded to nearest)."""
    D, H = 1536, 6144
    x, dy, w1, w2, b1, b2 = make(T, D, H, "float32", T + 7)
    (ry, _, _), rgrads = reference(x, dy, w1, w2, b1, b2)
    out = [nan_like((T, D), "float32"), nan_like((T, H), "float32"), None, nan_like((T, H), "float32")]
    f = cupyffn.gelu_ffn_forward(*dev(x, w1, w2, b1, b2)[:3], bias1=cupy.asarray(b1), bias2=cupy.asarray(b2),
                                 precision=precision, out=out)
    grads = [nan_like((T, D), "float32"), nan_like((H, D), "float32"), nan_like((D, H), "float32"),
             nan_like((H,), "float32"), nan_like((D,), "float32")]
    cupyffn.gelu_ffn_backward(*dev(dy, x, w1, w2), f.linear1_out, None, f.gelu_out, out=grads, need_bias_grads=True,
                              precision=precision)
    contract = cupyffn.PRECISIONS[precision].contract
    errors = {n: rel(a, r) for n, a, r in zip(("y", "dx", "dw1", "dw2", "db1", "db2"), [f.output] + grads,
                                               (ry,) + rgrads)}
    assert max(errors.values()) <= contract, errors
    exact = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=cupy.asarray(b1), bias2=cupy.asarray(b2),
                                     precision="ieee")
    assert rel(exact.output, ry) < 1e-5 < errors["y"]  # the precision took effect
    if T == 256:  # the NumPy route's model of the rounding: same order of error
        cpu = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, precision=precision)
        assert 0.5 < rel(cpu.output, ry) / errors["y"] < 2, (rel(cpu.output, ry), errors)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_memory_mode_accumulate_and_flags(act):
    T, D, H = 1000, 512, 2048
    x, dy, w1, w2, b1, b2 = make(T, D, H, act, 7)
    f = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=dev(b1)[0], bias2=dev(b2)[0])
    args = dev(dy, x, w1, w2) + [f.linear1_out]
    full = cupyffn.gelu_ffn_backward(*args, None, f.gelu_out, need_bias_grads=True)
    lean = cupyffn.gelu_ffn_backward(*args, None, None, need_bias_grads=True)  # gelu_out recomputed from z
    _, rgrads = reference(x, dy, w1, w2, b1, b2)
    tol = {"bfloat16": 1.5e-2, "float16": 2e-3}[act]
    for a, b, r in zip(list(full) + [full.grad_bias1, full.grad_bias2], list(lean) + [lean.grad_bias1,
                       lean.grad_bias2], rgrads):
        assert rel(b, r) < tol
        # the forward's gelu_out comes from the fp32 z, memory mode's from the rounded z: apart by the rounding
        assert rel(b, host(a)) < tol
    # accumulate adds into every weight and bias gradient, grad_hidden_states is overwritten
    start = [cupy.asarray(numpy.random.default_rng(1).standard_normal(s).astype(numpy.float32))
             for s in ((H, D), (D, H), (H,), (D,))]
    acc = [nan_like((T, D), act)] + [s.copy() for s in start]
    cupyffn.gelu_ffn_backward(*args, None, f.gelu_out, need_bias_grads=True, accumulate=True, out=acc)
    for a, s, want in zip(acc[1:], start, [full[1], full[2], full.grad_bias1, full.grad_bias2]):
        assert rel(a, host(s) + host(want)) < 1e-6
    assert rel(acc[0], host(full[0])) == 0.0
    # bias gradients alone (weights frozen), and grad_hidden_states alone
    only_b = cupyffn.gelu_ffn_backward(*args, None, f.gelu_out, need_weight_grads=False, need_grad_hidden=False,
                                       need_bias_grads=True)
    assert only_b[:3] == (None, None, None)
    assert rel(only_b.grad_bias1, host(full.grad_bias1)) == 0.0
    only_x = cupyffn.gelu_ffn_backward(*args, None, f.gelu_out, need_weight_grads=False)
    assert only_x[1] is None and only_x.grad_bias1 is None
    assert rel(only_x[0], host(full[0])) == 0.0


def test_bit_stable_and_capturable():
    T, D, H = 2048, 1536, 6144
    x, dy, w1, w2, b1, b2 = (dev(*make(T, D, H, "bfloat16", 9)))
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    outs = [[nan_like(s, dt) for s, dt in (((T, D), "bfloat16"), ((H, D), "float32"), ((D, H), "float32"),
                                           ((H,), "float32"), ((D,), "float32"))] for _ in range(3)]
    for o in outs[:2]:
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out, need_bias_grads=True, out=o)
    for a, b in zip(*outs[:2]):
        assert bool((a.view(numpy.uint16 if a.itemsize == 2 else numpy.uint32) ==
                     b.view(numpy.uint16 if b.itemsize == 2 else numpy.uint32)).all())
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        graph_fwd = [nan_like((T, D), "bfloat16"), nan_like((T, H), "bfloat16"), None, nan_like((T, H), "bfloat16")]
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, out=graph_fwd)  # plans exist before capture
        s.begin_capture()
        cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2, out=graph_fwd)
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, graph_fwd[1], None, graph_fwd[3], need_bias_grads=True,
                                  out=outs[2])
        graph = s.end_capture()
        for o in outs[2]:
            o.view(numpy.uint16 if o.itemsize == 2 else numpy.uint32).fill(0x7FC0 if o.itemsize == 2 else 0x7FC00000)
        graph.launch(s)
    s.synchronize()
    for a, b in zip(outs[0], outs[2]):
        assert rel(b, host(a)) == 0.0
    cupyffn.release_captured_plans()


def test_grad_hidden_ready_is_recorded():
    T, D, H = 512, 256, 1024
    x, dy, w1, w2, b1, b2 = dev(*make(T, D, H, "bfloat16", 3))
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1, bias2=b2)
    ev = cupy.cuda.Event(disable_timing=True)
    g = cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out, grad_hidden_ready=ev,
                                  need_bias_grads=True)
    ev.synchronize()
    assert ev.done and numpy.isfinite(host(g[0])).all()


def test_check_activations_on_16_bit():
    T, D, H = 256, 256, 1024
    x, dy, w1, w2, b1, b2 = dev(*make(T, D, H, "bfloat16", 5))
    f = cupyffn.gelu_ffn_forward(x, w1, w2, bias1=b1)
    cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, f.gelu_out, check_activations=True)
    # At bf16 the erf and tanh GELUs agree within rounding (2e-4 apart); what the check catches is a gelu_out that
    # belongs to other activations (another layer, batch or step)
    other = cupyffn.gelu_ffn_forward(dy, w1, w2, bias1=b1)
    with pytest.raises(cupyffn.ActivationMismatchError, match="stale or mismatched"):
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, f.linear1_out, None, other.gelu_out, check_activations=True)
    z = f.linear1_out.copy()
    z.view(numpy.uint16)[100, 1000] = 0x7F80  # bfloat16's +inf; the check reads the exponent bits on the device
    with pytest.raises(cupyffn.ActivationMismatchError,
                       match=r"linear1_out holds 1 non-finite element \(the first, inf, at row 100, column 1000"):
        cupyffn.gelu_ffn_backward(dy, x, w1, w2, z, None, f.gelu_out, check_activations=True)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("T", [256, 4096])
def test_accuracy_within_torch_autocast(act, T):
    """The contract: every output's relative L2 error against float64 within 1.25x of torch eager autocast's."""
    torch = pytest.importorskip("torch")
    D, H = 1536, 6144
    x, dy, w1, w2, b1, b2 = make(T, D, H, act, T)
    (ry, _, _), rgrads = reference(x, dy, w1, w2, b1, b2)
    tdt = getattr(torch, act)
    tx = torch.tensor(x.astype(numpy.float32), device="cuda").to(tdt).requires_grad_()
    tdy = torch.tensor(dy.astype(numpy.float32), device="cuda").to(tdt)
    params = [torch.tensor(a, device="cuda", requires_grad=True) for a in (w1, w2, b1, b2)]
    with torch.autocast("cuda", dtype=tdt):
        ty = torch.nn.functional.linear(torch.nn.functional.gelu(
            torch.nn.functional.linear(tx, params[0], params[2]), approximate="tanh"), params[1], params[3])
    ty.backward(tdy)
    torch_out = [ty] + [tx.grad] + [p.grad for p in params]
    f = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=dev(b1)[0], bias2=dev(b2)[0])
    g = cupyffn.gelu_ffn_backward(*dev(dy, x, w1, w2), f.linear1_out, None, f.gelu_out, need_bias_grads=True)
    ours = [f.output, g[0], g[1], g[2], g.grad_bias1, g.grad_bias2]
    refs = [ry] + list(rgrads)
    for name, a, t, r in zip(("output", "dx", "dw1", "dw2", "db1", "db2"), ours, torch_out, refs):
        theirs = rel(t.detach().float().cpu().numpy(), r)
        assert rel(a, r) <= 1.25 * theirs + 1e-6, (name, rel(a, r), theirs)


def test_torch_tensors_are_read_by_pointer():
    torch = pytest.importorskip("torch")
    T, D, H = 300, 256, 512
    x, dy, w1, w2, b1, b2 = make(T, D, H, "bfloat16", 11)
    tensors = [torch.tensor(a.astype(numpy.float32), device="cuda") for a in (x, dy)]
    tx, tdy = (t.to(torch.bfloat16) for t in tensors)
    tw = [torch.tensor(a, device="cuda") for a in (w1, w2, b1, b2)]
    f = cupyffn.gelu_ffn_forward(tx, tw[0], tw[1], bias1=tw[2], bias2=tw[3])
    fc = cupyffn.gelu_ffn_forward(*dev(x, w1, w2), bias1=dev(b1)[0], bias2=dev(b2)[0])
    assert rel(f.output, host(fc.output)) == 0.0
    g = cupyffn.gelu_ffn_backward(tdy, tx, tw[0], tw[1], f.linear1_out, None, f.gelu_out, need_bias_grads=True)
    gc = cupyffn.gelu_ffn_backward(*dev(dy, x, w1, w2), fc.linear1_out, None, fc.gelu_out, need_bias_grads=True)
    assert rel(g.grad_bias1, host(gc.grad_bias1)) == 0.0 and rel(g[1], host(gc[1])) == 0.0


def test_the_layer_validates_once_and_replays_its_repeated_tensors(monkeypatch):
    """cupyffn.torch.GeluFFN under bf16 autocast on CUDA: each set of tensors is validated once (the door remembers
    the call by its signature), a repeated set is replayed as a captured graph (cupyffn/cuda/graph_cache.py), with
    the same bits as the functional API on the same bf16 operands; unaligned weights are refused with the reason."""
    torch = pytest.importorskip("torch")
    from cupyffn.api import execute, routes, validate
    import cupyffn.torch as ct

    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(256, 1024).cuda(), torch.nn.Linear(1024, 256).cuda()
    ffn = ct.GeluFFN.from_linears(l1, l2)
    x = torch.randn(3, 100, 256, device="cuda", requires_grad=True)
    dy = torch.randn(3, 100, 256, device="cuda", dtype=torch.bfloat16)

    validated = []
    real = validate.validate
    params = (x, l1.weight, l2.weight, l1.bias, l2.bias)
    kept = [[torch.empty_like(t) for t in params] for _ in range(3)]  # allocated before: the steps' addresses repeat
    with monkeypatch.context() as m:
        m.setattr(validate, "validate", lambda *a, **k: validated.append(a[0].kind) or real(*a, **k))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ffn(x)
        for keep in kept:  # the same backward three times: the second and third replay its graph
            for t in params:
                t.grad = None
            y.backward(dy, retain_graph=True)
            for k, t in zip(keep, params):
                k.copy_(t.grad)
    torch.cuda.synchronize()
    assert validated.count("forward") == 1 and validated.count("backward") <= 2  # the grads freed step to step
    assert sum(e.graph_cache(routes.REPEATED).launches for e in execute.engine_cache("lt", "backward").plans()) >= 1
    for later in kept[1:]:
        assert all(torch.equal(a, b) for a, b in zip(kept[0], later))
    results = [[y] + kept[0]]
    y, *got = results[0]
    assert y.dtype == torch.bfloat16
    xb = x.detach().to(torch.bfloat16)
    w1, w2, b1, b2 = (t.detach().to(torch.bfloat16) for t in (l1.weight, l2.weight, l1.bias, l2.bias))
    fwd = [torch.empty_like(y), torch.empty(3, 100, 1024, device="cuda", dtype=torch.bfloat16), None,
           torch.empty(3, 100, 1024, device="cuda", dtype=torch.bfloat16)]
    cupyffn.gelu_ffn_forward(xb, w1, w2, bias1=b1, bias2=b2, out=fwd)
    assert torch.equal(y, fwd[0])
    out = [torch.empty_like(xb), torch.empty_like(l1.weight), torch.empty_like(l2.weight), torch.empty_like(l1.bias),
           torch.empty_like(l2.bias)]
    cupyffn.gelu_ffn_backward(dy, xb, w1, w2, fwd[1], None, fwd[3], out=out, need_bias_grads=True)
    for a, b in zip(got, [out[0].float()] + out[1:]):
        assert torch.equal(a, b)
    # weights whose rows are not 16-byte aligned take the functional API, which says why
    w = torch.nn.Parameter(torch.empty(1024 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(1024, 256))
    odd = ct.GeluFFN.from_linears(l1, l2)
    odd.weight1 = w
    with pytest.raises(ValueError, match="16-byte boundary"), torch.autocast("cuda", dtype=torch.bfloat16):
        odd(x)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_float32_biases_beside_16bit_weights_are_rounded_in_the_call(act):
    """16-bit weights with fp32 (master) biases, as the torch operators pass them: the engine rounds the biases inside
    its call, so the results are bit for bit those of biases cast to the activation dtype first; and against float64
    within the route's error, NaN-poisoned outputs fully written."""
    T, D, H = 256, 128, 512
    x, _, w1, w2, b1, b2 = make(T, D, H, act, seed=311, weights=act)
    b1f, b2f = ((0.5 * numpy.random.default_rng(312).standard_normal(n)).astype(numpy.float32) for n in (H, D))
    outs = {}
    for name, biases in (("float32", (b1f, b2f)), ("cast", (b1f.astype(DT[act]), b2f.astype(DT[act])))):
        out = [nan_like((T, D), act), nan_like((T, H), act), None, nan_like((T, H), act)]
        xd, w1d, w2d, b1d, b2d = dev(x, w1, w2, *biases)
        cupyffn.gelu_ffn_forward(xd, w1d, w2d, bias1=b1d, bias2=b2d, out=out)
        outs[name] = [cupy.asnumpy(o) for o in out if o is not None]
    for got, want in zip(outs["float32"], outs["cast"]):
        assert numpy.array_equal(got.view(numpy.uint16), want.view(numpy.uint16))
    ref = reference(x, x, w1, w2, b1f.astype(DT[act]), b2f.astype(DT[act]))[0]
    for got, want in zip(outs["float32"], ref):
        assert rel(got, want) < 2e-2
