"""CPU: ``replace_mlps`` on the model families whose MLP is cupyffn's block (cupyffn/frameworks/torch_swap.py,
docs/decisions/060): GPT-2, GPT-J, CodeGen, Phi and GPT-Neo from their config classes with default settings (sizes
made small), diffusers' DiT / PixArt / Flux blocks through ``FeedForward``, timm's ``Mlp`` (a stand-in of the same
source where timm is not installed). Every MLP swapped, none skipped; keys and Parameters unchanged; checkpoints
round-trip; loss and gradients equal the unswapped model's in train mode (dropout on, same seed) and in eval mode.
Refusals: erf GELU (with a warning when nothing was swapped), a dropout before the second linear in training.
(tests/test_gpu_torch_models.py: the families on CUDA.)"""

import copy
import warnings

import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
import cupyffn.torch as ct  # noqa: E402

F = torch.nn.functional
SMALL = dict(vocab_size=64)
#: family: (config class, model class, small sizes, the config key of the MLP's output dropout)
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=32), "resid_pdrop"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=2, n_positions=32, rotary_dim=8),
             "resid_pdrop"),
    # CodeGen splits its heads over mp_num = 4 model-parallel groups: n_head a multiple of 4
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                            n_ctx=32, rotary_dim=8), "resid_pdrop"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=32), None),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(hidden_size=32, num_layers=2, num_heads=2,
                                                          attention_types=[[["global", "local"], 1]],
                                                          max_position_embeddings=32, window_size=8),
                "resid_dropout"),
}
MLP_CLASSES = {"gpt2": "GPT2MLP", "gptj": "GPTJMLP", "codegen": "CodeGenMLP", "phi": "PhiMLP", "gpt_neo": "GPTNeoMLP"}


def build(family, seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    config_class, model_class, sizes, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(**SMALL, **sizes, **overrides)
    torch.manual_seed(seed)
    return transformers, getattr(transformers, model_class), getattr(transformers, model_class)(config)


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def loss_and_grads(model, ids, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout draws for both models
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_same_training(plain, swapped, ids, calls_per_step, entry_counter):
    for mode in ("train", "eval"):
        getattr(plain, mode)(), getattr(swapped, mode)()
        want, want_grads = loss_and_grads(plain, ids, 7)
        before = entry_counter.bodies
        got, got_grads = loss_and_grads(swapped, ids, 7)
        assert entry_counter.bodies == before + calls_per_step, mode  # every MLP ran cupyffn
        assert rel(got, want) <= 1e-5, (mode, float(got), float(want))
        assert set(got_grads) == set(want_grads)
        worst = max((rel(got_grads[n], g), n) for n, g in want_grads.items() if float(g.norm()) > 0)
        assert worst[0] <= 1e-4, (mode, worst)
        if mode == "train":  # the dropout ran: a different seed gives another loss
            assert float(loss_and_grads(plain, ids, 8)[0]) != float(want) or not _has_dropout(plain)


def _has_dropout(model):
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_default_config_every_mlp_swapped_same_training(family, tmp_path, entry_counter):
    transformers, model_class, plain = build(family)
    swapped = copy.deepcopy(plain)
    original = copy.deepcopy(plain.state_dict())
    params = {n: id(p) for n, p in swapped.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when MLPs are swapped
        replaced, skipped = ct.replace_mlps(swapped)
    mlps = [n for n, m in swapped.named_modules() if type(m).__name__ == MLP_CLASSES[family]]
    assert replaced == mlps and len(mlps) == 2 and skipped == {}
    assert {n: id(p) for n, p in swapped.named_parameters()} == params
    assert list(swapped.state_dict()) == list(original)
    ids = torch.randint(0, 64, (2, 16))
    check_same_training(plain, swapped, ids, 2, entry_counter)

    with torch.no_grad():  # the original checkpoint loads into the swapped model
        for p in swapped.parameters():
            p.add_(0.5)
    swapped.load_state_dict(original)
    swapped.eval(), plain.eval()
    assert rel(swapped(ids).logits, plain(ids).logits) <= 1e-5
    swapped.save_pretrained(tmp_path)  # and its checkpoint loads into the plain library
    again = model_class.from_pretrained(tmp_path).eval()
    assert not ct.swapped_mlps(again)
    assert rel(again(ids).logits, swapped(ids).logits) <= 1e-5


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f][3]])
def test_output_dropout_trains_as_the_module(family, entry_counter):
    """The families whose MLP ends in a dropout (default p = 0 except GPT-2), at p = 0.1: the module's own dropout
    on cupyffn's output, the same draws in train mode."""
    _, _, plain = build(family, seed=1, **{FAMILIES[family][3]: 0.1})
    swapped = copy.deepcopy(plain)
    assert len(ct.replace_mlps(swapped)[0]) == 2
    mlp = next(m for m in swapped.modules() if type(m).__name__ == MLP_CLASSES[family])
    assert mlp.dropout.p == 0.1
    check_same_training(plain, swapped, torch.randint(0, 64, (2, 16)), 2, entry_counter)


@pytest.mark.parametrize("family,mode", [("gptj", "eval"), ("phi", "eval"), ("gpt2", "train")])
def test_swapped_families_compile_without_a_graph_break(family, mode):
    """fullgraph compiles; in train mode (GPT-2's default dropout 0.1) the module's dropout is in the graph too."""
    torch._dynamo.reset()
    _, _, model = build(family, seed=2)
    ct.replace_mlps(model)
    getattr(model, mode)()
    ids = torch.randint(0, 64, (2, 16))
    explain = torch._dynamo.explain(model)(ids)
    assert explain.graph_break_count == 0
    assert "\n".join(g.code for g in explain.graphs).count("cupyffn") >= 2
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    got = compiled(ids).logits.detach()
    torch.manual_seed(3)
    want = model(ids).logits.detach()
    assert torch.equal(got, want)  # aot_eager draws the dropout masks as eager does: the same bits
    if mode == "train":
        torch.manual_seed(4)
        assert not torch.equal(compiled(ids).logits.detach(), got)  # and the dropout is live


def test_erf_gelu_is_refused_with_a_reason_and_one_warning():
    _, _, model = build("gpt2", activation_function="gelu")  # GELUActivation: erf
    with pytest.warns(UserWarning) as caught:
        replaced, skipped = ct.replace_mlps(model)
    assert replaced == [] and sorted(skipped) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert all("erf GELU" in why for why in skipped.values())
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "swapped none of the 2 MLP-like modules of GPT2LMHeadModel" in message
    assert "transformer.h.0.mlp and 1 more: activation GELUActivation (erf GELU" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ct.replace_mlps(torch.nn.Linear(4, 4)) == ([], {})  # nothing MLP-like: nothing to say


def test_activations_are_verified_by_value():
    class NewGELUActivation(torch.nn.Module):  # transformers' name, erf GELU inside
        def forward(self, x):
            return F.gelu(x)

    class GELUTanh(torch.nn.Module):  # the name and the value
        def forward(self, x):
            return F.gelu(x, approximate="tanh")

    D, H = 16, 64
    model = torch.nn.ModuleDict({
        "lying": torch.nn.Sequential(torch.nn.Linear(D, H), NewGELUActivation(), torch.nn.Linear(H, D)),
        "true": torch.nn.Sequential(torch.nn.Linear(D, H), GELUTanh(), torch.nn.Linear(H, D)),
        "relu": torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D)),
        "widening": torch.nn.Sequential(torch.nn.Linear(D, H), GELUTanh(), torch.nn.Linear(H, 2 * D)),
    })
    replaced, skipped = ct.replace_mlps(model)
    assert replaced == ["true"]
    assert "NewGELUActivation computes erf GELU" in skipped["lying"]
    assert "activation ReLU" in skipped["relu"]
    assert "16 -> 64 and 64 -> 32" in skipped["widening"]


# ---------------------------------------------------------------------------------------------
# diffusers: FeedForward in DiT, PixArt and Flux blocks; its dropout before the second linear
# ---------------------------------------------------------------------------------------------
def test_diffusers_dit_pixart_flux_blocks_swap_every_feedforward():
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed: its models are optional")
    torch.manual_seed(3)
    models = {
        "dit": diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                               num_layers=2, sample_size=8, patch_size=2, norm_num_groups=4),
        "pixart": diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                     num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=16,
                                                     caption_channels=16, norm_num_groups=4),
        "flux": diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                 pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)),
    }
    for name, model in models.items():
        model.eval()
        ffs = [n for n, m in model.named_modules() if type(m).__name__ == "FeedForward"]
        plain = {n: copy.deepcopy(model.get_submodule(n)) for n in ffs}
        keys = list(model.state_dict())
        replaced, skipped = ct.replace_mlps(model)
        assert ffs and replaced == ffs and skipped == {}, (name, replaced, skipped)
        assert list(model.state_dict()) == keys
        for n in ffs:  # each swapped block computes its plain twin's values
            dim = plain[n].net[0].proj.in_features
            x = torch.randn(2, 5, dim)
            assert rel(model.get_submodule(n)(x), plain[n](x)) <= 1e-5, (name, n)


def feedforward(dropout, final_dropout=False, seed=4):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed: its FeedForward is optional")
    torch.manual_seed(seed)
    return diffusers.models.attention.FeedForward(16, dropout=dropout, activation_fn="gelu-approximate",
                                                  final_dropout=final_dropout)


def test_feedforward_dropout_before_the_second_linear_swaps_in_eval_only(entry_counter):
    ff = feedforward(0.1)
    ff.train()
    with pytest.warns(UserWarning, match="swapped none of the 1 MLP-like modules of FeedForward"):
        replaced, skipped = ct.replace_mlps(ff)
    assert replaced == [] and "dropout p=0.1 between the activation and the second linear" in skipped[""]
    assert "model.eval()" in skipped[""]

    ff.eval()
    plain = copy.deepcopy(ff)
    assert ct.replace_mlps(ff) == ([""], {}) and ct.swapped_mlps(ff) == [""]
    x = torch.randn(3, 7, 16)
    assert rel(ff(x), plain(x)) <= 1e-5 and entry_counter.bodies == 1

    # put in training, the swapped module computes as the module does (its own forward, the same draws), not
    # cupyffn's block without the dropout
    ff.train(), plain.train()
    assert ct.swapped_mlps(ff) == []
    torch.manual_seed(5)
    got = ff(x)
    torch.manual_seed(5)
    want = plain(x)
    assert torch.equal(got, want) and entry_counter.bodies == 1
    torch.manual_seed(6)
    assert not torch.equal(ff(x), got)  # the dropout is live
    ff.eval()
    assert ct.swapped_mlps(ff) == [""] and rel(ff(x), plain.eval()(x)) <= 1e-5
    assert entry_counter.bodies == 2
    ff.train()  # swapping it again in training updates its options, and it stays eval-only
    assert ct.replace_mlps(ff, precision="bf16x3") == ([""], {}) and ct.swapped_mlps(ff) == []
    assert ff.eval()._cupyffn_mlp.precision == "bf16x3" and ct.swapped_mlps(ff) == [""]
    assert repr(ff).splitlines()[1] == ("  cupyffn: swapped by replace_mlps (precision='bf16x3', save='all', "
                                        "compiled='module', eval mode only: in training its own forward)")


def test_feedforward_final_dropout_is_on_the_output():
    ff = feedforward(0.0, final_dropout=True)
    ff.net[3].p = 0.2  # dropout 0 before the second linear, 0.2 after it
    ff.train()
    plain = copy.deepcopy(ff)
    assert ct.replace_mlps(ff) == ([""], {})
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(9)
    got = ff(x)
    got.square().sum().backward()
    got_grad = x.grad.clone()
    x.grad = None
    torch.manual_seed(9)
    want = plain(x)
    want.square().sum().backward()
    assert rel(got, want) <= 1e-5 and rel(got_grad, x.grad) <= 1e-5
    assert float((want == 0).float().mean()) > 0.05


# ---------------------------------------------------------------------------------------------
# timm's Mlp (SigLIP-style ViT MLPs)
# ---------------------------------------------------------------------------------------------
def timm_mlp():
    """timm's Mlp where timm is installed, else a stand-in built from its source (timm/layers/mlp.py: fc1, act, drop1,
    norm, fc2, drop2, in that order), declared in timm's module as replace_mlps recognizes it."""
    try:
        from timm.layers import Mlp

        return Mlp
    except ImportError:
        pass

    class Mlp(torch.nn.Module):
        def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=torch.nn.GELU,
                     norm_layer=None, bias=True, drop=0.0):
            super().__init__()
            out_features = out_features or in_features
            hidden_features = hidden_features or in_features
            drop = drop if isinstance(drop, tuple) else (drop, drop)
            self.fc1 = torch.nn.Linear(in_features, hidden_features, bias=bias)
            self.act = act_layer()
            self.drop1 = torch.nn.Dropout(drop[0])
            self.norm = norm_layer(hidden_features) if norm_layer is not None else torch.nn.Identity()
            self.fc2 = torch.nn.Linear(hidden_features, out_features, bias=bias)
            self.drop2 = torch.nn.Dropout(drop[1])

        def forward(self, x):
            return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))

    Mlp.__module__ = "timm.layers.mlp"
    return Mlp


def test_timm_mlp_with_tanh_gelu():
    import functools

    Mlp = timm_mlp()
    tanh = functools.partial(torch.nn.GELU, approximate="tanh")
    torch.manual_seed(6)
    model = torch.nn.ModuleDict({
        "siglip": Mlp(16, 64, act_layer=tanh),
        "out_drop": Mlp(16, 64, act_layer=tanh, drop=(0.0, 0.1)),
        "in_drop": Mlp(16, 64, act_layer=tanh, drop=(0.1, 0.0)),
        "erf": Mlp(16, 64),
        "normed": Mlp(16, 64, act_layer=tanh, norm_layer=torch.nn.LayerNorm),
    }).train()
    plain = copy.deepcopy(model)
    replaced, skipped = ct.replace_mlps(model)
    assert sorted(replaced) == ["out_drop", "siglip"]
    assert "erf GELU" in skipped["erf"] and "norm is LayerNorm" in skipped["normed"]
    assert "dropout p=0.1 between the activation and the second linear" in skipped["in_drop"]
    x = torch.randn(3, 16)
    for name in replaced:
        torch.manual_seed(10)
        got = model[name](x)
        torch.manual_seed(10)
        assert rel(got, plain[name](x)) <= 1e-5, name

    class Mlp2(Mlp):  # another class named Mlp outside timm is not timm's
        pass

    Mlp2.__name__, Mlp2.__module__ = "Mlp", "mymodels"
    assert ct.replace_mlps(Mlp2(16, 64, act_layer=tanh)) == ([], {})
