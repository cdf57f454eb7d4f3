"""bench.py --suite sd35-bf16 (benchmarks/sd35.py) on the CPU at a tiny width: every implementation of the suite
(cupyffn's layer and torch eager, each also under the same torch.compile call) built, run under bf16 autocast and
checked against float64 as the suite does; the summary and table with an implementation that failed."""

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, "
                                            "pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")

from benchmarks import sd35  # noqa: E402
from cupyffn import workloads as W  # noqa: E402

DIM, HIDDEN = 32, 128
# The suite's error figures are values read off the autograd graph's tensors: reading one that still requires grad
# (torch's warning) is a mistake of the suite's, so it fails here.
pytestmark = pytest.mark.filterwarnings("error:Converting a tensor with requires_grad=True to a scalar:UserWarning")


@pytest.fixture
def models(monkeypatch):
    monkeypatch.setattr(W, "DIM", DIM)
    monkeypatch.setattr(W, "HIDDEN_DIM", HIDDEN)
    from torch._functorch import config  # _models turns its donated_buffer off; restored here after the test

    donated_buffer = config.donated_buffer
    g = torch.Generator().manual_seed(0)
    params = [0.1 * torch.randn(HIDDEN, DIM, generator=g), 0.1 * torch.randn(HIDDEN, generator=g),
              0.1 * torch.randn(DIM, HIDDEN, generator=g), 0.1 * torch.randn(DIM, generator=g)]
    try:
        built, leaves = sd35._models(torch, params, compile=True, device="cpu")
        x = torch.randn(2, 16, DIM, generator=g).to(torch.bfloat16)
        dy = torch.randn(2, 16, DIM, generator=g).to(torch.bfloat16)
        yield built, leaves, x, dy, sd35._reference(torch, x, dy, leaves)
    finally:
        config.donated_buffer = donated_buffer


def _check(name, built, leaves, x, dy, ref):
    y = sd35._forward(torch, built[name], x)  # a timed training forward: autocast's dtype, the graph recorded
    assert y.dtype == torch.bfloat16 and y.requires_grad and torch.isfinite(y).all(), name
    errors = sd35._errors(torch, built[name], leaves, x, dy, ref)
    assert set(errors) == set(sd35.OUTPUTS) and max(errors.values()) < 2e-2, (name, errors)  # bf16-class errors
    sd35._step(torch, built[name], leaves, x, dy, None)  # a timed call: forward + backward
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in leaves), name


def test_every_implementation_is_built(models):
    assert list(models[0]) == list(sd35.IMPLS) == ["cupyffn", "torch-eager", "torch-compile", "cupyffn-compile"]


@pytest.mark.parametrize("name", ["cupyffn", "torch-eager", "torch-compile"])
def test_implementation_runs_within_bf16_error_on_cpu(models, name):
    _check(name, *models)


def test_compiled_cupyffn_runs_within_bf16_error_on_cpu(models):
    # the cupyffn layer under torch.compile(dynamic=True), the call that compiles torch-compile's block
    _check("cupyffn-compile", *models)


def test_summary_and_markdown_with_a_failed_implementation():
    def result(ms, fwd):
        return {"forward_ms": fwd, "backward_ms": ms, "fwd_bwd_ms": 2 * ms, "timing": "cupti",
                "rel_l2": dict.fromkeys(sd35.OUTPUTS, 1e-3)}

    # cupyffn's forward: 1.5x torch eager's at T = 256, 0.5x at 8192 (1.25x its GEMM floor there)
    rows = [{"label": label, "tokens": T, "gemm_floor_ms": 0.1, "forward_floor_ms": 0.08,
             "results": {"cupyffn": result(0.2, fwd), "torch-eager": result(0.4, 0.2), "torch-compile": result(0.5, 0.3),
                         "cupyffn-compile": {"error": "TorchRuntimeError: x | y"}}}
            for label, T, fwd in (("B2xS128", 256, 0.3), ("B4xS2048", 8192, 0.1))]
    s = sd35.summarize(rows)
    assert list(s["implementations"]) == ["cupyffn", "torch-eager", "torch-compile"]
    assert s["best_torch"] == "torch-eager" and s["backward_speedup_vs_best_torch"] == pytest.approx(2.0)
    assert s["implementations"]["cupyffn"]["forward_mean_ms"] == pytest.approx(0.2)
    assert s["forward_slowest_vs_torch_eager"] == {"ratio": pytest.approx(1.5), "tokens": 256}
    assert s["forward_over_floor_from_2048"] == {"ratio": pytest.approx(1.25), "tokens": 8192}
    assert s["errors"] == {"cupyffn-compile": {"error": "TorchRuntimeError: x | y",
                                               "workloads": ["B2xS128", "B4xS2048"]}}
    text = sd35.markdown({"summary": s, "env": {"device": "CPU", "cupy": "-", "torch": "-"}, "date": "2026-12-05",
                          "git_commit": "abcdef0", "timing": "cupti", "command": "python bench.py", "workloads": rows})
    assert "cupyffn-compile failed at 2 workloads (B2xS128, B4xS2048): TorchRuntimeError: x \\| y" in text.splitlines()
    assert ("| B4xS2048 | 8192 | 0.0800 | 0.1000 | 0.1000 | 0.2000 | 0.4000 | 0.2000 | 0.4000 | 0.8000 | 0.3000 | "
            "0.5000 | 1.0000 |") in text.splitlines()
    assert ("Forward: cupyffn's over torch eager's at most 1.50x (T = 256); over its two GEMMs with biases alone "
            "(torch.addmm) at most 1.25x from T = 2048 (T = 8192).") in text.splitlines()
