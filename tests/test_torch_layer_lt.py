"""CPU: GeluFFN with biases, 16-bit dtypes and autocast (cupyffn/frameworks/torch_layer.py), and the converters
from_linears and replace_mlps (cupyffn/frameworks/torch_swap.py; the model-level checks: tests/test_torch_models.py)."""

import copy
import math

import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
import cupyffn  # noqa: E402
import cupyffn.torch as ct  # noqa: E402

F = torch.nn.functional


def rel(a, ref):
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def torch_block(x, l1, l2):
    return l2(F.gelu(l1(x), approximate="tanh"))


def pair(D=32, H=128, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(D, H, bias=bias), torch.nn.Linear(H, D, bias=bias)


def grads_of(params):
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("bias", [True, False])
def test_from_linears_matches_torch_in_float32(bias):
    l1, l2 = pair(bias=bias)
    ffn = ct.GeluFFN.from_linears(l1, l2, precision="ieee")
    assert ffn.weight1 is l1.weight and ffn.bias2 is l2.bias  # the same Parameters
    x = torch.randn(2, 24, 32, requires_grad=True)
    y = ffn(x)
    r = torch.randn_like(y)
    (y * r).sum().backward()
    mine = [x.grad.clone()] + grads_of(ffn.parameters())
    for p in (x, *ffn.parameters()):
        p.grad = None
    want = torch_block(x, l1, l2)
    (want * r).sum().backward()
    theirs = [x.grad] + grads_of(ffn.parameters())
    assert rel(y, want) < 1e-5
    for a, b in zip(mine, theirs):
        assert a.dtype == b.dtype and rel(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_the_autocast_dtype_within_torchs_error(dtype):
    l1, l2 = pair(64, 256, seed=1)
    ffn = ct.GeluFFN.from_linears(l1, l2)
    x = torch.randn(48, 64)
    r = torch.randn(48, 64)
    exact = torch_block(x.double(), l1.double(), l2.double())
    l1.float(), l2.float()
    results = {}
    for name, fn in (("cupyffn", ffn), ("torch", lambda v: torch_block(v, l1, l2))):
        xa = x.clone().requires_grad_()
        for p in ffn.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=dtype):
            y = fn(xa)
        assert y.dtype == dtype
        (y.float() * r).sum().backward()
        results[name] = [y, xa.grad] + grads_of(ffn.parameters())
    xd = x.double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in ffn.parameters()]
    yd = F.linear(F.gelu(F.linear(xd, pd[0], pd[2]), approximate="tanh"), pd[1], pd[3])
    (yd * r.double()).sum().backward()
    ref = [yd, xd.grad] + [p.grad for p in pd]
    assert rel(ref[0], exact) < 1e-12
    for name, a, t, want in zip(("y", "dx", "dw1", "dw2", "db1", "db2"), results["cupyffn"], results["torch"], ref):
        assert a.dtype == t.dtype, name
        assert rel(a, want) <= 1.25 * rel(t, want) + 1e-6, (name, rel(a, want), rel(t, want))


def test_bf16_parameters_outside_autocast():
    ffn = ct.GeluFFN(32, 128, bias=True, dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = ffn(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and ffn.weight1.grad.dtype == torch.bfloat16 and ffn.bias1.grad.dtype == \
        torch.bfloat16
    assert "bias=True" in repr(ffn) and "bfloat16" in repr(ffn)


def test_float32_biases_take_every_precision():
    """float32 with biases runs the float32 engine (here its NumPy model) in every precision: every output and gradient
    against float64 at the precision's contract."""
    l1, l2 = pair()
    x = torch.randn(3, 16, 32, requires_grad=True)
    r = torch.randn(3, 16, 32)
    d1, d2 = copy.deepcopy(l1).double(), copy.deepcopy(l2).double()
    xd = x.detach().double().requires_grad_()
    ref = torch_block(xd, d1, d2)
    (ref * r.double()).sum().backward()
    ref_grads = [xd.grad, d1.weight.grad, d1.bias.grad, d2.weight.grad, d2.bias.grad]
    l1.float(), l2.float()
    errors = {}
    for precision in cupyffn.PRECISIONS:
        ffn = ct.GeluFFN.from_linears(l1, l2, precision=precision)
        for t in (x, l1.weight, l1.bias, l2.weight, l2.bias):
            t.grad = None
        y = ffn(x)
        (y * r).sum().backward()
        got = [x.grad, l1.weight.grad, l1.bias.grad, l2.weight.grad, l2.bias.grad]
        errors[precision] = max([rel(y, ref)] + [rel(g, e) for g, e in zip(got, ref_grads)])
    for precision, error in errors.items():
        assert error <= cupyffn.PRECISIONS[precision].contract, errors
    assert errors["ieee"] < 1e-6 < errors["tf32"], errors  # tf32: the engine's scaled fp16 operands, as without biases


def test_init_matches_nn_linear():
    ffn = ct.GeluFFN(64, 256, bias=True)
    for b, fan_in in ((ffn.bias1.detach(), 64), (ffn.bias2.detach(), 256)):
        assert float(b.abs().max()) <= 1 / math.sqrt(fan_in)
        assert float(b.abs().max()) > 0.9 / math.sqrt(fan_in)


class NewGELUActivation(torch.nn.Module):  # transformers' gelu_new, by name (as replace_mlps recognizes it)
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class Conv1D(torch.nn.Module):  # transformers' Conv1D: weight stored [in, out]
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class GPT2MLP(torch.nn.Module):
    def __init__(self, D, H, p=0.0):
        super().__init__()
        self.c_fc, self.c_proj, self.act, self.dropout = Conv1D(H, D), Conv1D(D, H), NewGELUActivation(), \
            torch.nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


def test_replace_mlps_swaps_what_it_reproduces_and_reports_the_rest(entry_counter):
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({
        "seq": torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(64, 32)),
        "erf": torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)),
        "gpt2": GPT2MLP(32, 128),
        "dropped": GPT2MLP(32, 128, p=0.1),
    })
    x = torch.randn(8, 32)

    def outputs():  # "dropped" in training: its dropout draws from torch's RNG, seeded alike each time
        torch.manual_seed(11)
        return {k: model[k](x) for k in ("seq", "gpt2", "dropped")}

    before = outputs()
    modules = dict(model.named_modules())
    keys = list(model.state_dict())
    replaced, skipped = ct.replace_mlps(model, precision="ieee")
    assert sorted(replaced) == ["dropped", "gpt2", "seq"]  # GPT-2's dropout is on the output: the module's own
    assert list(skipped) == ["erf"] and "erf GELU" in skipped["erf"]
    assert dict(model.named_modules()) == modules and list(model.state_dict()) == keys  # the same modules
    assert type(model["seq"]) is torch.nn.Sequential and type(model["gpt2"]) is GPT2MLP
    after = outputs()
    for k, y in before.items():
        assert rel(after[k], y) < 1e-5, k
    assert float((after["dropped"] == 0).float().mean()) > 0.05  # the dropout ran, with the same draws
    assert entry_counter.bodies == 3  # all three ran cupyffn
    model["erf"](x)
    assert entry_counter.bodies == 3  # the skipped one did not
    assert sorted(ct.restore_mlps(model)) == ["dropped", "gpt2", "seq"]
    for k, y in outputs().items():
        assert torch.equal(y, before[k])  # the module's own forward again
    assert entry_counter.bodies == 3


def test_transformers_gpt2_mlp_when_installed():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 16))
    want = model(ids).logits
    replaced, skipped = ct.replace_mlps(model, precision="ieee")
    assert replaced == ["transformer.h.0.mlp", "transformer.h.1.mlp"] and not skipped
    assert rel(model(ids).logits, want) < 1e-5


def test_from_linears_keeps_conv1d_weights_as_stored():
    """GeluFFN.from_linears of transformers-style Conv1D layers holds their very [in, out] Parameters and reads them
    transposed: the Conv1D block's values and gradients."""
    mlp = GPT2MLP(32, 128)
    ffn = ct.GeluFFN.from_linears(mlp.c_fc, mlp.c_proj, precision="ieee")
    assert ffn.weight1 is mlp.c_fc.weight and ffn.weight1.shape == (32, 128) and ffn.weights_transposed
    x = torch.randn(4, 32, requires_grad=True)
    y = ffn(x)
    y.square().sum().backward()
    got = [x.grad.clone(), mlp.c_fc.weight.grad.clone(), mlp.c_proj.bias.grad.clone()]
    for p in (x, *mlp.parameters()):
        p.grad = None
    want = mlp(x)
    want.square().sum().backward()
    assert rel(y, want) < 1e-6
    for a, b in zip(got, (x.grad, mlp.c_fc.weight.grad, mlp.c_proj.bias.grad)):
        assert a.shape == b.shape and rel(a, b) < 1e-5


def test_bias_gradients_alone():
    """Frozen weights and an input without grad: only the biases train, with torch's gradients."""
    l1, l2 = pair(seed=4)
    for w in (l1.weight, l2.weight):
        w.requires_grad_(False)
    ffn = ct.GeluFFN.from_linears(l1, l2, precision="ieee")
    x = torch.randn(6, 32)
    ffn(x).square().sum().backward()
    got = (l1.bias.grad.clone(), l2.bias.grad.clone())
    l1.bias.grad = l2.bias.grad = None
    torch_block(x, l1, l2).square().sum().backward()
    assert l1.weight.grad is None and rel(got[0], l1.bias.grad) < 1e-5 and rel(got[1], l2.bias.grad) < 1e-5
