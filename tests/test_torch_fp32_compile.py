"""CPU: a float32 model (no autocast) whose MLPs replace_mlps swapped, as bench.py --suite train-fp32 trains it, under
torch.compile. In float32 the compiled graph holds cupyffn's operators (``compiled="module"`` applies to 16-bit
activations only), so what is checked is the operators' path: the whole training loss of a transformers GPT-2 (the
example's builder, labels included) traces with ``fullgraph=True`` and no graph break in every precision, gives the
eager swapped model's loss and gradients, keeps the model's state_dict keys; AdamW steps under inductor compile one
graph (no recompilation), train as the eager model does, and hand the operators their activations as eager calls do,
without a copy (tests/test_gpu_torch_models.py: the same models on CUDA)."""

import copy
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, "
                                            "pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
pytest.importorskip("transformers", reason="transformers not installed: pip install '.[test-frameworks]'")
import cupyffn.torch as ct  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = dict(dim=32, layers=2, heads=2, vocab=64, seq=16, batch=4)


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt2_fp32_test", ROOT / "examples" / "train_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def _models(precision):
    plain = EXAMPLE.build("gpt2", SIZES, "cpu")
    swapped = copy.deepcopy(plain)
    replaced, skipped = ct.replace_mlps(swapped, precision=precision)
    assert replaced == ["transformer.h.0.mlp", "transformer.h.1.mlp"] and not skipped
    return plain, swapped


def _batch():
    return next(EXAMPLE.batches("gpt2", 1, SIZES["batch"], SIZES["seq"], SIZES["dim"], SIZES["vocab"], "cpu"))


@pytest.mark.parametrize("precision", [None, "fp16+fp8", "tf32", "ieee"])
def test_swapped_float32_gpt2_loss_traces_whole_and_matches_eager(precision):
    torch._dynamo.reset()
    plain, swapped = _models(precision)
    ids = _batch()
    assert list(swapped.state_dict()) == list(plain.state_dict())  # the model's keys, kept

    def loss(model):
        return EXAMPLE.loss_of(model, "gpt2", ids)

    explain = torch._dynamo.explain(loss)(swapped)
    assert explain.graph_break_count == 0, [str(b.reason)[:200] for b in explain.break_reasons]
    code = "\n".join(g.code for g in explain.graphs)
    assert code.count("torch.ops.cupyffn.forward") == SIZES["layers"]  # the operators, one per MLP

    eager_loss = loss(swapped)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in swapped.named_parameters()}
    swapped.zero_grad(set_to_none=True)
    compiled = torch.compile(swapped, fullgraph=True, backend="aot_eager")
    got = EXAMPLE.loss_of(compiled, "gpt2", ids)
    got.backward()
    assert got.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    for n, p in swapped.named_parameters():
        assert torch.allclose(p.grad, eager_grads[n], rtol=1e-5, atol=1e-7), n
    assert list(compiled.state_dict()) == ["_orig_mod." + k for k in plain.state_dict()]  # torch's own prefix only
    assert list(swapped.state_dict()) == list(plain.state_dict())


def test_float32_adamw_steps_under_inductor_compile_once_and_copy_no_activation(monkeypatch):
    from torch._inductor import compile_fx

    from cupyffn.frameworks import torch_ops

    torch._dynamo.reset()
    _, swapped = _models("fp16+fp8")
    eager = copy.deepcopy(swapped)
    copies = []
    readable = torch_ops.readable

    def counted(tensor):  # every copy the operators make of a tensor whose layout cupyffn cannot read
        out = readable(tensor)
        if out is not tensor:
            copies.append(tuple(tensor.shape))
        return out

    monkeypatch.setattr(torch_ops, "readable", counted)
    graphs = []

    def backend(gm, inputs):  # inductor, counting what Dynamo hands it
        graphs.append(gm)
        return compile_fx.compile_fx(gm, inputs)

    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled_step = EXAMPLE.stepper(torch.compile(swapped, backend=backend), "gpt2", "cpu", 1e-3, autocast=None)
    eager_step = EXAMPLE.stepper(eager, "gpt2", "cpu", 1e-3, autocast=None)
    losses = []
    for item in EXAMPLE.batches("gpt2", 4, SIZES["batch"], SIZES["seq"], SIZES["dim"], SIZES["vocab"], "cpu"):
        losses.append((compiled_step(item)[0], eager_step(item)[0]))
    assert len(graphs) == 1  # one graph, compiled once: no recompilation as the weights change
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert copies == []  # the operators read the activations inductor gives them as they are, as in eager calls
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-5)
