"""cupyffn in real torch models on CUDA (issue 40): the bf16/bias layer under torch.compile (inductor, fullgraph; and
mode="reduce-overhead"), a swapped GPT-2 against the plain one, and its checkpoint round trip (a captured training
step of every configuration: tests/test_gpu_capture_torch_graph.py). Values against float64 autograd of the plain
block, or against the plain model within bf16 error; outputs a replay must rewrite are NaN-poisoned first. (The CPU twin: tests/test_torch_models.py.)"""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
import cupyffn.torch as ct  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]

F = torch.nn.functional
DIM, HIDDEN = 256, 1024


def reference64(ffn, x, r):
    """float64 autograd of the plain block on the layer's parameters: output and gradients (x, w1, b1, w2, b2)."""
    xd = x.detach().double().requires_grad_()
    p = [t.detach().double().requires_grad_() for t in (ffn.weight1, ffn.bias1, ffn.weight2, ffn.bias2)]
    y = F.linear(F.gelu(F.linear(xd, p[0], p[1]), approximate="tanh"), p[2], p[3])
    (y * r.double()).sum().backward()
    return [y, xd.grad] + [t.grad for t in p]


def run(model, ffn, x, r):
    xs = x.clone().requires_grad_()
    ffn.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(xs)
    (y.float() * r).sum().backward()
    torch.cuda.synchronize()
    return [y, xs.grad, ffn.weight1.grad, ffn.bias1.grad, ffn.weight2.grad, ffn.bias2.grad]


def rel(a, ref):
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


@pytest.fixture(scope="module")
def ffn():
    torch.manual_seed(7)
    return ct.GeluFFN(DIM, HIDDEN, bias=True, device="cuda")


@pytest.mark.parametrize("mode", [None, "max-autotune", "reduce-overhead"])
def test_bf16_bias_layer_compiled(ffn, mode):
    """SD3.5's configuration under torch.compile(fullgraph=True): inductor default, max-autotune, and CUDA graphs
    (reduce-overhead, several steps so that its recorded graph replays), each against float64 within bf16 error
    (torch autocast's own error on the same inputs: tests/test_gpu_lt.py)."""
    torch._dynamo.reset()
    compiled = torch.compile(ffn, fullgraph=True, mode=mode)
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(4, 128, DIM, device="cuda", generator=g)
        r = torch.randn(4, 128, DIM, device="cuda", generator=g)
        got = run(compiled, ffn, x, r)
        for name, a, want in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), got, reference64(ffn, x, r)):
            assert torch.isfinite(a.float()).all() and rel(a, want) <= 2e-2, (mode, seed, name, rel(a, want))
    # the compiled graphs keep example tensors, and with them this step's autograd graph, alive: release them
    torch._dynamo.reset()


def test_swapped_gpt2_trains_compiled_and_keeps_its_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=DIM, n_layer=2, n_head=4, vocab_size=512, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(11)
    plain = transformers.GPT2LMHeadModel(config).cuda()
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    # the operators in the compiled graph (compiled="module", the default, would compile the plain model's code)
    assert ct.replace_mlps(model, compiled="cupyffn")[0] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    losses = {}
    for name, m in (("plain", plain), ("cupyffn", model)):
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(ids).logits
        # the loss outside the compiled model: transformers' own loss (labels=) logs a warning, which fullgraph
        # refuses for the plain model too
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        losses[name] = float(loss)
    assert abs(losses["cupyffn"] - losses["plain"]) <= 1e-2 * abs(losses["plain"]), losses
    fc, fc_plain = model.transformer.h[0].mlp.c_fc, plain.transformer.h[0].mlp.c_fc
    assert rel(fc.weight.grad, fc_plain.weight.grad) <= 5e-2  # bf16 GEMMs both: within bf16 error
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).cuda().eval()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = loaded(ids).logits.float(), model(ids).logits.float()
    assert rel(b, a) <= 2e-2


@pytest.mark.parametrize("family", ("gpt2", "gptj", "codegen", "phi", "gpt_neo"))
def test_families_swap_every_mlp_and_train_as_the_plain_model(family, tmp_path):
    """The CPU twin's families (tests/test_torch_families.py) on CUDA, in float32 with precision "ieee" (plain fp32
    GEMMs, as torch's own without TF32): every MLP swapped, keys kept, loss and gradients equal to the plain model's
    in train mode (dropout on, the same seed: cupyffn draws nothing from the RNG) and eval mode, and the checkpoint
    loads into the plain library."""
    from test_torch_families import FAMILIES, MLP_CLASSES, build  # noqa: E402  (tests/ is on sys.path)

    _, model_class, plain = build(family, seed=12, **({FAMILIES[family][3]: 0.1} if FAMILIES[family][3] else {}))
    plain = plain.cuda()
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    replaced, skipped = ct.replace_mlps(model, precision="ieee")
    assert len(replaced) == 2 and skipped == {} and list(model.state_dict()) == keys
    assert all(type(model.get_submodule(n)).__name__ == MLP_CLASSES[family] for n in replaced)
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    for mode in ("train", "eval"):
        results = {}
        for name, m in (("plain", plain), ("cupyffn", model)):
            getattr(m, mode)()
            m.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            loss = m(ids, labels=ids).loss
            loss.backward()
            results[name] = (loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        (loss_p, grads_p), (loss_c, grads_c) = results["plain"], results["cupyffn"]
        assert rel(loss_c, loss_p) <= 1e-5, (mode, float(loss_c), float(loss_p))
        worst = max(rel(grads_c[n], g) for n, g in grads_p.items() if float(g.norm()) > 0)
        assert worst <= 1e-4, (mode, worst)
    model.save_pretrained(tmp_path)
    loaded = model_class.from_pretrained(tmp_path).cuda().eval()
    with torch.no_grad():
        assert rel(model(ids).logits, loaded(ids).logits) <= 1e-5
