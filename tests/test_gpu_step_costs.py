"""What a training step of the torch layer costs besides its GEMMs (issue 46), eager and compiled: no copy of a
weight's size (the weight gradients come out of the GEMMs in the parameters' own layout, Conv1D's [in, out] too),
and fp32 master weights converted to the 16-bit activation dtype once per step (the forward's copies are saved and
the backward multiplies them). Counted with torch.profiler's op records (with shapes); the values are checked against
float64 autograd each time, so a step that saved a copy by computing something else fails too."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
import torch_capture_cases as cases  # noqa: E402  (tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]

CONFIGS = ("bf16-conv1d", "bf16-fp32-master", "fp16-fp32-master", "bf16-weights")
COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def _weight_ops(prof, shapes):
    """{op name: count} of copies and casts whose first input has a weight's shape (either orientation), each counted
    once: not the copy_ a cast (_to_copy) or clone runs inside itself."""
    counts = {}
    for e in prof.events():
        if e.name in COPIES and e.input_shapes and tuple(e.input_shapes[0]) in shapes:
            parent = e.cpu_parent
            if parent is not None and parent.name in COPIES:
                continue
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("bias", (True, False), ids=("bias", "nobias"))
@pytest.mark.parametrize("config", CONFIGS)
def test_a_step_copies_no_weight_and_casts_each_master_weight_once(config, bias, compiled):
    torch._dynamo.reset()
    ffn = cases.make_layer(torch, config, bias, seed=5)
    model = torch.compile(ffn, fullgraph=True) if compiled else ffn
    shapes = {(cases.HIDDEN, cases.DIM), (cases.DIM, cases.HIDDEN)}
    g = torch.Generator(device="cuda").manual_seed(7)

    def step():
        x = torch.randn(*cases.LEAD, cases.DIM, device="cuda", generator=g, requires_grad=True)
        r = torch.randn(*cases.LEAD, cases.DIM, device="cuda", generator=g)
        ffn.zero_grad(set_to_none=True)
        y = cases.step(torch, model, config, x, r)
        return x, r, y

    for _ in range(2):  # compile, build the plans
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        x, r, y = step()
        torch.cuda.synchronize()
    counts = _weight_ops(prof, shapes)
    master = cases.CONFIGS[config][0] == "float32"
    assert counts.get("aten::_to_copy", 0) == (2 if master else 0), counts  # the forward's casts, none after
    assert not {k: n for k, n in counts.items() if k != "aten::_to_copy"}, counts  # no weight-sized copy at all
    for p in ffn.parameters():
        assert p.grad is not None and p.grad.stride() == p.stride(), (p.shape, p.grad.stride(), p.stride())
    cases.check(torch, ffn, config, x, r, y)


def test_operator_writes_weight_gradients_in_the_parameters_layout():
    """The backward operator's weight gradients for Conv1D weights ([in, out] storage used as [out, in] views) are
    transposed views of [in, out] tensors: their .t() is the parameter's own contiguous layout."""
    ffn = cases.make_layer(torch, "bf16-conv1d", True, seed=9)
    w1, b1, w2, b2 = cases.params(ffn)
    x = torch.randn(*cases.LEAD, cases.DIM, device="cuda", dtype=torch.bfloat16)
    y, z, t, g, w1c, w2c = torch.ops.cupyffn.forward(x, w1.detach(), w2.detach(), b1.detach(), b2.detach(), None,
                                                      "all")
    assert w1c.dtype == torch.bfloat16 and w1c.stride() == w1.stride() and torch.equal(w1c, w1.detach().bfloat16())
    dy = torch.randn_like(y)
    gx, gw1, gw2, gb1, gb2 = torch.ops.cupyffn.backward(dy, x, w1.detach(), w2.detach(), z, None, g, None, True,
                                                        True, True, w1c, w2c)
    assert gw1.dtype == torch.float32 and gw1.stride() == w1.stride() and gw1.t().is_contiguous()
    assert gw2.stride() == w2.stride() and gw2.t().is_contiguous()
    gld = (dy.double() @ w2c.double()) * _dgelu(z.double())
    want_w1, want_w2 = gld.flatten(0, -2).t() @ x.double().flatten(0, -2), \
        dy.double().flatten(0, -2).t() @ g.double().flatten(0, -2)
    for got, want in ((gw1, want_w1), (gw2, want_w2), (gb1, gld.flatten(0, -2).sum(0)),
                      (gb2, dy.double().flatten(0, -2).sum(0))):
        assert cases.rel(got, want) < 2e-2


def _dgelu(z):
    k = (2 / torch.pi) ** 0.5
    t = torch.tanh(k * (z + 0.044715 * z ** 3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)
