"""cupyffn.torch on CUDA inside torch's machinery: torch.compile(fullgraph=True), torch.cuda.graph capture
(of the eager layer), torch.compile(mode="reduce-overhead"), bf16 autocast, the eager Function against the
operators (bitwise), and the raw-pointer view fast path.

Every result is compared with torch autograd of the plain block in float64 (relative L2 within the precision's
contract); outputs that a graph replay must rewrite are NaN-poisoned first. One compiled module is reused so
the file stays well under a minute and a half.

    PYTHONPATH=. python3 -m pytest tests/test_gpu_torch_compile.py
"""

import numpy
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cupyffn  # noqa: E402
import cupyffn.torch as ct  # noqa: E402
from cupyffn.core import views as _views  # noqa: E402
from test_torch_adapter import reference  # noqa: E402  (float64 autograd of the plain block; tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]

LEAD, DIM, HIDDEN = (4, 128), 256, 1024
PRECISION = "bf16x3"
CONTRACT = cupyffn.PRECISIONS[PRECISION].contract


def tensors(rng, lead=LEAD):
    x = torch.from_numpy(rng.standard_normal(lead + (DIM,)).astype(numpy.float32)).cuda()
    r = torch.from_numpy(rng.standard_normal(lead + (DIM,)).astype(numpy.float32)).cuda()
    return x, r


def rel(a, ref):
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float((a.detach().double() - ref).norm() / ref.norm())


def assert_close(results, refs, bound=CONTRACT):
    errors = [rel(a, b) for a, b in zip(results, refs)]
    assert all(e <= bound for e in errors), errors


@pytest.fixture(scope="module")
def ffn():
    torch.manual_seed(2024)
    return ct.GeluFFN(DIM, HIDDEN, precision=PRECISION, device="cuda")


@pytest.fixture(scope="module")
def compiled(ffn):
    torch._dynamo.reset()
    return torch.compile(ffn, fullgraph=True)  # inductor; a graph break would raise


def step(model, ffn, x, r):
    xs = x.clone().requires_grad_()
    ffn.zero_grad(set_to_none=True)
    y = model(xs)
    (y * r).sum().backward()
    return y.detach(), xs.grad, ffn.weight1.grad.clone(), ffn.weight2.grad.clone()


def test_fullgraph_compile_matches_eager_and_float64(rng, ffn, compiled):
    for _ in range(2):  # the second call runs the cached compiled graph
        x, r = tensors(rng)
        refs = reference(x, ffn.weight1, ffn.weight2, r)
        eager = step(ffn, ffn, x, r)
        comp = step(compiled, ffn, x, r)
        torch.cuda.synchronize()
        assert_close(eager, refs)
        assert_close(comp, refs)
        assert_close(comp, [e.double() for e in eager])  # the same computation within the contract


def test_cuda_graph_capture_of_forward_and_backward_replays_new_values(rng, ffn, entry_counter):
    """torch.cuda.graph over forward + backward: results land in torch's graph pool (out= from torch)."""
    static_x, static_r = tensors(rng)
    static_x.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: builds cupyffn's plans outside the capture
        for _ in range(2):
            ffn.zero_grad(set_to_none=True)
            static_x.grad = None
            (ffn(static_x) * static_r).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    ffn.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    before = entry_counter.counts()
    with torch.cuda.graph(graph):
        static_y = ffn(static_x)
        (static_y * static_r).sum().backward()
    # the eager layer was captured (its autograd.Function, not the operators)
    assert entry_counter.counts() == {"eager": before["eager"] + 1, "operator": before["operator"]}
    assert static_y.grad_fn.name() == "EagerGeluFFNBackward"
    grads = (static_x.grad, ffn.weight1.grad, ffn.weight2.grad)
    for _ in range(3):
        x, r = tensors(rng)
        with torch.no_grad():
            static_x.copy_(x)
            static_r.copy_(r)
            static_y.fill_(float("nan"))
            for g in grads:
                g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close((static_y,) + grads, reference(x, ffn.weight1, ffn.weight2, r))
    del graph
    cupyffn.release_captured_plans()


@pytest.mark.parametrize("precision", tuple(cupyffn.PRECISIONS))
def test_eager_function_and_operators_agree_bitwise(rng, entry_counter, precision):
    """The eager Function and the operators run one implementation: the same bits on CUDA too."""
    torch.manual_seed(11)
    ffn = ct.GeluFFN(DIM, HIDDEN, precision=precision, device="cuda")
    x, r = tensors(rng, (256,))
    step(ffn, ffn, x, r)  # the same values first: tf32's scale state then starts alike for both below
    ops = step(lambda a: torch.ops.cupyffn.forward(a, ffn.weight1, ffn.weight2, None, None, precision, "all")[0], ffn, x, r)
    eager = step(ffn, ffn, x, r)
    torch.cuda.synchronize()
    assert entry_counter.counts() == {"eager": 2, "operator": 1}  # the second step called the operator
    for a, b in zip(eager, ops):
        assert torch.equal(a, b)
    assert_close(eager, reference(x, ffn.weight1, ffn.weight2, r), cupyffn.PRECISIONS[precision].contract)


def test_reduce_overhead_mode(rng):
    torch._dynamo.reset()
    torch.manual_seed(7)
    ffn = ct.GeluFFN(DIM, HIDDEN, precision=PRECISION, device="cuda")
    from torch._dynamo.utils import counters

    counters.clear()
    model = torch.compile(ffn, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, then replays of torch's CUDA graphs
        x, r = tensors(rng)
        results = step(model, ffn, x, r)
        torch.cuda.synchronize()
        assert_close(results, reference(x, ffn.weight1, ffn.weight2, r))  # before the next replay overwrites
    assert counters["inductor"]["cudagraph_skips"] == 0  # inductor did run the steps as CUDA graphs
    torch._dynamo.reset()
    cupyffn.release_captured_plans()


def test_autocast_runs_the_bf16_plan_like_nn_linear(rng, ffn):
    """Under bf16 autocast the layer computes in bf16 as nn.Linear would: bf16 output, fp32 weight gradients,
    errors against float64 of the bf16 computation's size (the contract against torch's autocast itself is
    tests/test_gpu_lt.py and tests/test_torch_layer_lt.py)."""
    x, r = tensors(rng)
    xb = x.bfloat16().requires_grad_()
    ffn.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ffn(xb)
        after = F.linear(y, torch.eye(DIM, device="cuda"))
    assert y.dtype == torch.bfloat16 and after.dtype == torch.bfloat16
    (y.float() * r).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and ffn.weight1.grad.dtype == torch.float32
    refs = reference(xb.detach().float(), ffn.weight1, ffn.weight2, r)
    for got, want in zip((y, xb.grad, ffn.weight1.grad, ffn.weight2.grad), refs):
        assert rel(got, want) <= 2e-2


def test_repeated_tensors_take_the_view_cache_and_fast_path(rng, ffn, monkeypatch):
    """Steady state with the same tensors (a training loop that drops each step's results before the next):
    the eager path, cached CuPy views, no new validation; results still right."""
    from cupyffn.api import validate as _validate

    # The view cache empties when full: what earlier tests in this process left there must not fill it mid-test.
    _views.clear()
    x, r = tensors(rng)
    x.requires_grad_()
    values = [tensors(rng)[0] for _ in range(4)]  # made up front: the loop allocates the same way each time

    def one_step(value):
        x.grad = None
        ffn.zero_grad(set_to_none=True)
        with torch.no_grad():
            x.copy_(value)
        y = ffn(x)
        y_kinds.add(y.grad_fn.name())
        (y * r).sum().backward()
        torch.cuda.synchronize()
        assert_close((y, x.grad, ffn.weight1.grad, ffn.weight2.grad), reference(x, ffn.weight1, ffn.weight2, r))

    y_kinds = set()
    for value in values[:2]:  # warm: plans, views, signatures, and the caching allocator's reuse pattern
        one_step(value)
    prepared = []
    original = _validate.validate
    monkeypatch.setattr(_validate, "validate", lambda *a, **k: prepared.append(1) or original(*a, **k))
    views_before = dict(_views._views)
    for value in values[2:]:
        one_step(value)
    key = (x.data_ptr(), tuple(x.shape), x.stride(), 0, "float32")
    assert key in views_before and _views._views[key] is views_before[key]
    assert prepared == []  # the backward's validated-call fast path served both calls
    assert y_kinds == {"EagerGeluFFNBackward"}


def test_reused_address_with_other_shape_or_values(rng):
    """A freed tensor's address reused by a tensor of another shape, or the same shape with new values."""
    torch.manual_seed(3)
    ffn = ct.GeluFFN(DIM, HIDDEN, precision="ieee", device="cuda")
    contract = cupyffn.PRECISIONS["ieee"].contract
    seen = set()
    for lead in ((256,), (128,), (256,), (2, 64)):
        x, r = tensors(rng, lead)
        seen.add(x.data_ptr())
        x.requires_grad_()
        ffn.zero_grad(set_to_none=True)
        y = ffn(x)
        (y * r).sum().backward()
        torch.cuda.synchronize()
        assert_close((y, x.grad, ffn.weight1.grad, ffn.weight2.grad), reference(x, ffn.weight1, ffn.weight2, r),
                     contract)
        del x, y, r
    assert len(seen) < 4  # the caching allocator did hand an address out again
