"""CPU: cupyffn inside real torch models, compiled, and their checkpoints (issue 40's contract; CPU tensors take the
NumPy route through the same operators as CUDA tensors).

* Every GeluFFN configuration (bias or not; float32, bfloat16, float16 parameters; under bf16 autocast or not; the
  float32 precisions) traces with ``torch.compile(fullgraph=True)`` with no graph break and gives the eager layer's
  values and gradients; inductor (default and max-autotune) and ``mode="reduce-overhead"`` run it.
* ``replace_mlps`` keeps the model: the same modules, Parameters and state_dict keys; an original checkpoint loads
  after the swap, an optimizer built before it trains what runs, shared weights stay shared, ``save_pretrained`` of a
  swapped transformers GPT-2 (and a diffusers SD3 transformer, where installed) loads into the plain library with
  equal outputs, and ``restore_mlps`` gives the modules their own forward back.
* A swapped GPT-2 and SD3.5-like stack compile with zero graph breaks (``torch._dynamo.explain``).
(tests/test_gpu_torch_models.py: the same on CUDA, with CUDA graphs.)
"""

import copy

import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
import cupyffn.torch as ct  # noqa: E402

F = torch.nn.functional
D, H = 32, 128


def grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


def step(module, x, r, ctx=None):
    """Output and gradients of (module(x) * r).sum(), under the autocast `ctx` (None: none)."""
    for t in (x, *module.parameters()):
        t.grad = None
    if ctx is None:
        y = module(x)
    else:
        with ctx():
            y = module(x)
    (y.float() * r).sum().backward()
    return [y.detach()] + [g.clone() for g in grads(module, x)]


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


CONFIGS = [(bias, dtype, autocast, precision)
           for bias in (False, True)
           for dtype in (torch.float32, torch.bfloat16, torch.float16)
           for autocast in (None, bf16_autocast)
           for precision in ((None, "tf32", "bf16x3") if dtype == torch.float32 and autocast is None else (None,))]


@pytest.mark.parametrize("bias,dtype,autocast,precision", CONFIGS,
                         ids=lambda v: getattr(v, "__name__", str(v)).replace("torch.", ""))
def test_every_configuration_compiles_without_a_break_and_matches_eager(bias, dtype, autocast, precision):
    torch._dynamo.reset()
    torch.manual_seed(0)
    ffn = ct.GeluFFN(D, H, bias=bias, dtype=dtype, precision=precision)
    x = torch.randn(4, 8, D, dtype=dtype, requires_grad=True)
    r = torch.randn(4, 8, D)
    eager = step(ffn, x, r, autocast)
    explain = torch._dynamo.explain(ffn)(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(ffn, fullgraph=True, backend="aot_eager")
    got = step(compiled, x, r, autocast)
    for a, b in zip(got, eager):  # the operators' bodies are the eager layer's: the same bits
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(g is not None and torch.isfinite(g.float()).all() for g in got)


@pytest.mark.parametrize("mode", [None, "max-autotune", "reduce-overhead"])
def test_inductor_modes_run_the_bf16_bias_layer(mode):
    """SD3.5's configuration: biases, fp32 master weights, bf16 autocast; inductor fuses what is around the
    operators, so its values agree with eager within bf16 rounding of the fused casts."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    ffn = ct.GeluFFN(D, H, bias=True)
    x = torch.randn(2, 16, D, requires_grad=True)
    r = torch.randn(2, 16, D)
    eager = step(ffn, x, r, bf16_autocast)
    compiled = torch.compile(ffn, fullgraph=True, mode=mode)
    for _ in range(2):  # reduce-overhead records on its second call (on the CPU it warns and runs eagerly)
        got = step(compiled, x, r, bf16_autocast)
    for a, b in zip(got, eager):
        assert a.dtype == b.dtype
        err = float((a.double() - b.double()).norm() / b.double().norm())
        assert err <= 1e-2, err


# ---------------------------------------------------------------------------------------------
# models: the swap keeps them
# ---------------------------------------------------------------------------------------------
def tiny_gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=D, n_layer=2, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers, transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_swap_keeps_modules_parameters_keys_and_checkpoints(entry_counter):
    _, model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 16))
    want = model(ids).logits
    original = copy.deepcopy(model.state_dict())
    params = {name: id(p) for name, p in model.named_parameters()}
    modules = {name: type(m) for name, m in model.named_modules()}
    replaced, skipped = ct.replace_mlps(model)
    assert replaced == ["transformer.h.0.mlp", "transformer.h.1.mlp"] and not skipped
    assert ct.swapped_mlps(model) == replaced
    assert {name: id(p) for name, p in model.named_parameters()} == params
    assert {name: type(m) for name, m in model.named_modules()} == modules
    assert list(model.state_dict()) == list(original)
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (D, 4 * D)  # Conv1D's [in, out], used as stored
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights intact
    got = model(ids).logits
    assert entry_counter.bodies == 2  # both MLPs ran cupyffn
    assert float((got - want).abs().max().detach()) <= 1e-5
    with torch.no_grad():  # an original checkpoint loads after the swap (perturb, then load it back)
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(original)
    assert torch.equal(model(ids).logits, got)


def test_an_optimizer_built_before_the_swap_trains_what_runs():
    _, model = tiny_gpt2(1)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ct.replace_mlps(model)
    fc = model.transformer.h[0].mlp.c_fc
    before = fc.weight.detach().clone()
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert fc.weight.grad is not None and float(fc.weight.grad.abs().sum()) > 0
    optimizer.step()
    assert not torch.equal(fc.weight.detach(), before)  # the very Parameter the optimizer holds moved


def test_save_pretrained_of_a_swapped_gpt2_loads_into_plain_transformers(tmp_path):
    transformers, model = tiny_gpt2(2)
    ids = torch.randint(0, 64, (2, 16))
    ct.replace_mlps(model)
    with torch.no_grad():  # train-like change, on the swapped model
        model.transformer.h[1].mlp.c_proj.bias.add_(0.25)
    swapped = model(ids).logits
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert not ct.swapped_mlps(plain)
    assert float((plain(ids).logits - swapped).abs().max().detach()) <= 1e-5
    assert ct.restore_mlps(model) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert torch.equal(model(ids).logits, plain(ids).logits)  # the modules' own forward again


def test_swapped_gpt2_and_sd35_stack_compile_with_zero_graph_breaks():
    torch._dynamo.reset()
    _, model = tiny_gpt2(3)
    ids = torch.randint(0, 64, (2, 16))
    ct.replace_mlps(model)
    explain = torch._dynamo.explain(model)(ids)
    assert explain.graph_break_count == 0
    code = "\n".join(g.code for g in explain.graphs)
    assert code.count("cupyffn") >= 2  # the operators are in the graph, not the modules' own forward
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert float((compiled(ids).logits - model(ids).logits).abs().max()) == 0.0

    torch._dynamo.reset()
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(approximate="tanh"),
                                                     torch.nn.Linear(H, D)) for _ in range(3))
    norms = torch.nn.ModuleList(torch.nn.LayerNorm(D) for _ in range(3))

    def stack(x):
        for norm, mlp in zip(norms, blocks):
            x = x + mlp(norm(x))
        return x

    assert len(ct.replace_mlps(blocks)[0]) == 3
    x = torch.randn(2, 8, D)
    with bf16_autocast():
        explain = torch._dynamo.explain(stack)(x)
        assert explain.graph_break_count == 0
        assert torch.equal(torch.compile(stack, fullgraph=True, backend="aot_eager")(x), stack(x))


def _swapped_stack(compiled=None):
    """Three residual SD3.5-like blocks whose MLPs replace_mlps swapped (`compiled`: its option, None: the default),
    the plain stack with the same weights, and their forward function."""
    torch.manual_seed(5)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(approximate="tanh"),
                                                     torch.nn.Linear(H, D)) for _ in range(3))
    plain = copy.deepcopy(blocks)
    options = {} if compiled is None else {"compiled": compiled}
    assert len(ct.replace_mlps(blocks, **options)[0]) == 3

    def forward(mlps, x):
        for mlp in mlps:
            x = x + mlp(x)
        return x

    return blocks, plain, forward


@pytest.mark.parametrize("compiled", [None, "module", "cupyffn"])
@pytest.mark.parametrize("autocast", [None, bf16_autocast], ids=["float32", "bf16-autocast"])
def test_compiled_swap_runs_the_modules_own_forward_for_16_bit_activations(monkeypatch, compiled, autocast):
    """replace_mlps(compiled="module"), the default: while torch.compile traces a swapped MLP with 16-bit
    activations, the module's own forward is traced (no cupyffn operator in the graph, the plain compiled model's
    values), and eager calls still run cupyffn's block; compiled="cupyffn" and float32 activations keep the
    operators in the graph."""
    from cupyffn.frameworks import torch_swap

    torch._dynamo.reset()
    blocks, plain, forward = _swapped_stack(compiled)
    calls = []
    real_block = torch_swap.block
    monkeypatch.setattr(torch_swap, "block", lambda *a, **k: calls.append(1) or real_block(*a, **k))
    x = torch.randn(2, 8, D)
    ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        eager = forward(blocks, x)
        assert len(calls) == 3  # eager: cupyffn's block for each MLP, whatever `compiled` says
        explain = torch._dynamo.explain(forward)(blocks, x)
        got = torch.compile(forward, fullgraph=True, backend="aot_eager")(blocks, x)
        want = torch.compile(forward, fullgraph=True, backend="aot_eager")(plain, x)
    assert explain.graph_break_count == 0
    operators = "\n".join(g.code for g in explain.graphs).count("cupyffn")
    if autocast is not None and compiled != "cupyffn":
        assert operators == 0
        assert torch.equal(got, want)  # the plain model's traced code, its very values
    else:
        assert operators >= 3  # one forward operator per MLP
        assert torch.equal(got, eager)
    assert float((got.float() - want.float()).abs().max()) <= (5e-2 if autocast is not None else 1e-5)


def test_compiled_option_is_checked():
    blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(approximate="tanh"),
                                                      torch.nn.Linear(H, D))])
    with pytest.raises(ValueError, match=r"compiled must be one of 'module', 'cupyffn'; got 'fast'"):
        ct.replace_mlps(blocks, compiled="fast")
    assert ct.swapped_mlps(blocks) == []  # refused before anything was swapped


def test_shared_weights_stay_shared():
    """Two MLPs built on one Linear (a tied layer): both run cupyffn, the Parameter stays one object, and its
    gradient is the sum of both uses, as in the plain model."""
    shared = torch.nn.Linear(D, H)
    model = torch.nn.ModuleDict({name: torch.nn.Sequential(shared, torch.nn.GELU(approximate="tanh"),
                                                           torch.nn.Linear(H, D)) for name in ("a", "b")})
    x = torch.randn(8, D)
    (model["a"](x) + model["b"](x)).square().sum().backward()
    want = shared.weight.grad.clone()
    shared.weight.grad = None
    assert sorted(ct.replace_mlps(model, precision="ieee")[0]) == ["a", "b"]
    assert model["a"][0] is model["b"][0] and sum(1 for _ in model.parameters()) == 6  # the shared two once
    (model["a"](x) + model["b"](x)).square().sum().backward()
    assert float((shared.weight.grad - want).norm() / want.norm()) <= 1e-5


def test_the_root_module_can_be_swapped_and_restored():
    mlp = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(H, D))
    x = torch.randn(4, D)
    want = mlp(x)
    assert ct.replace_mlps(mlp, precision="ieee") == ([""], {})
    assert float((mlp(x) - want).abs().max()) <= 1e-5 and ct.swapped_mlps(mlp) == [""]
    assert ct.restore_mlps(mlp) == [""] and torch.equal(mlp(x), want) and ct.swapped_mlps(mlp) == []


def test_print_model_shows_the_swapped_mlps():
    """After replace_mlps, print(model) says which MLPs run on cupyffn and how (their extra_repr), state_dict keys
    unchanged, the compiled model still one graph; restore_mlps gives the plain repr back; copies say it too."""
    import pickle

    _, model = tiny_gpt2(6)
    plain_repr, keys = repr(model), list(model.state_dict())
    ct.replace_mlps(model, precision="ieee", compiled="cupyffn")
    line = "cupyffn: swapped by replace_mlps (precision='ieee', save='all', compiled='cupyffn')"
    text = repr(model)  # ModuleList prints its two identical blocks once ("(0-1): 2 x GPT2Block(")
    assert line in text and text.replace(f"\n          {line}", "") == plain_repr
    for block in model.transformer.h:
        assert repr(block.mlp).splitlines()[:2] == ["GPT2MLP(", f"  {line}"]  # before the children
    assert list(model.state_dict()) == keys
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert repr(other) == text
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 16))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(ids).logits, model(ids).logits)
    ct.replace_mlps(model)  # swapping again updates the options, and the line
    assert "compiled='module'" in repr(model.transformer.h[1].mlp) and "compiled='cupyffn'" not in repr(model)
    ct.restore_mlps(model)
    assert repr(model) == plain_repr and list(model.state_dict()) == keys


def test_swapped_models_pickle_and_deep_copy():
    import pickle

    _, model = tiny_gpt2(4)
    ct.replace_mlps(model)
    ids = torch.randint(0, 64, (1, 8))
    want = model(ids).logits
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert ct.swapped_mlps(other) == ct.swapped_mlps(model)
        mlp = other.transformer.h[0].mlp
        assert mlp.forward.args[0] is mlp  # the copy's forward runs the copy's own Parameters
        assert torch.equal(other(ids).logits, want)


def test_diffusers_sd3_transformer_round_trip(tmp_path):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed: its round trip is optional")
    torch.manual_seed(5)
    model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                            caption_projection_dim=16, pooled_projection_dim=16,
                                            out_channels=4).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 6, 16),
                  pooled_projections=torch.randn(1, 16), timestep=torch.tensor([10]))
    want = model(**inputs).sample
    keys = list(model.state_dict())
    replaced, _ = ct.replace_mlps(model)
    assert replaced and all(type(model.get_submodule(n)).__name__ == "FeedForward" for n in replaced)
    assert list(model.state_dict()) == keys
    got = model(**inputs).sample
    assert float((got - want).abs().max()) <= 1e-4
    model.save_pretrained(tmp_path)
    plain = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path).eval()
    assert not ct.swapped_mlps(plain)
    assert float((plain(**inputs).sample - got).abs().max()) <= 1e-4
