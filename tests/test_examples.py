"""The training examples (examples/train_cupy.py, examples/train_torch.py) learn: the loss goes down clearly.

CPU runs use the CPU routes (small sizes); GPU runs are marked gpu (the torch one also needs
torch.cuda). The measure is mean(loss of the last 10 steps) / mean(loss of the first 10 steps).
Asked for ``--device cuda`` where there is no usable GPU, an example exits with status 1 and one line saying why.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"cupyffn_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ratio(losses):
    assert all(math.isfinite(v) for v in losses), losses
    return (sum(losses[-10:]) / 10) / (sum(losses[:10]) / 10)


def torch_or_skip(cuda=False):
    torch = pytest.importorskip(
        "torch", reason="torch not installed: framework tests are opt-in, pip install '.[test-frameworks]'")
    if cuda and not torch.cuda.is_available():
        pytest.skip("torch.cuda is not available")
    return torch


def test_cupy_example_on_cpu():
    example = load("train_cupy")
    losses = example.main(steps=150, device="cpu")
    assert len(losses) == 150
    assert ratio(losses) < 0.35, losses[:10] + losses[-10:]
    assert example.main(steps=5, device="cpu") == losses[:5]  # seeded: the same run again


def test_cupy_example_bf16_on_cpu():
    losses = load("train_cupy").main(steps=100, device="cpu", precision="bf16")
    assert ratio(losses) < 0.45, losses[:10] + losses[-10:]


@pytest.mark.gpu
def test_cupy_example_on_gpu():
    losses = load("train_cupy").main(steps=400, device="cuda")
    assert len(losses) == 400
    assert ratio(losses) < 0.5, losses[:10] + losses[-10:]


def test_torch_example_on_cpu():
    torch_or_skip()
    example = load("train_torch")
    losses = example.main(steps=60, device="cpu")  # Adam
    assert len(losses) == 60
    assert ratio(losses) < 0.25, losses[:10] + losses[-10:]
    sgd = example.main(steps=60, device="cpu", optimizer="sgd", save="linear1_out")
    assert ratio(sgd) < 0.3, sgd[:10] + sgd[-10:]


@pytest.mark.gpu
def test_torch_example_on_cuda():
    torch_or_skip(cuda=True)
    losses = load("train_torch").main(steps=150, device="cuda")
    assert len(losses) == 150
    assert ratio(losses) < 0.1, losses[:10] + losses[-10:]


def test_cupy_example_runs_as_a_script():
    proc = run_example("train_cupy.py", "--device", "cpu", "--steps", "30")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("device=cpu dim=32 hidden_dim=128 batch=256 precision=ieee")  # the CPU default
    last = lines[-1].split()
    assert last[:7] == ["mean", "loss", "of", "the", "first", "10", "steps"]
    assert float(last[-2]) < float(last[7].rstrip(","))  # last-10 mean below first-10 mean


def run_example(script, *args):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the script finds the checkout's cupyffn by itself when it is not installed
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=EXAMPLES, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cupy_example_asked_for_cuda_without_a_gpu_says_why():
    import cupyffn

    reason = cupyffn.gpu_unavailable_reason(run_kernel=True)
    if reason is None:
        pytest.skip("CuPy can use a GPU here, so --device cuda trains on it (test_cupy_example_on_gpu)")
    proc = run_example("train_cupy.py", "--device", "cuda", "--steps", "5")
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout[-500:])
    assert proc.stderr.splitlines() == [f"train_cupy.py: --device cuda, but CuPy cannot use a GPU here: {reason}; "
                                        "--device cpu runs on the CPU with NumPy"], proc.stderr[-2000:]


def test_torch_example_asked_for_cuda_without_cuda_says_why():
    torch = torch_or_skip()
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here, so --device cuda trains on it (test_torch_example_on_cuda)")
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    proc = run_example("train_torch.py", "--device", "cuda", "--steps", "5")
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout[-500:])
    assert proc.stderr.splitlines() == [
        f"train_torch.py: --device cuda, but torch.cuda.is_available() is False (torch {torch.__version__}, {build}); "
        "--device cpu runs on CPU tensors"], proc.stderr[-2000:]


def test_gpt2_example_sd35_stack_on_cpu():
    torch_or_skip()
    pytest.importorskip("ml_dtypes")
    r = load("train_gpt2").main("sd35", steps=40, device="cpu", dim=64, layers=2, seq=16, batch=4, compile=False,
                                lr=1e-3)
    assert r["learned"] and r["agree"], r["final_loss_ratio"]


def test_gpt2_example_on_cpu():
    torch_or_skip()
    pytest.importorskip("transformers", reason="transformers not installed (the GPT-2 example builds its model)")
    said = []
    r = load("train_gpt2").main("gpt2", steps=40, device="cpu", dim=64, layers=2, heads=2, vocab=64, seq=32,
                                batch=4, compile=False, lr=3e-3, say=said.append)
    assert r["learned"] and r["agree"], r["final_loss_ratio"]
    # progress: each run as it starts and as it ends (the script prints these as they come)
    assert said[0] == "gpt2: run 1/2, torch eager: 40 steps on cpu"
    assert said[1].startswith("gpt2: run 1/2, torch eager: median step ")
    assert said[1].endswith(f", loss at the last step {r['torch eager']['losses'][-1]:.4f}")
    assert said[2] == "gpt2: run 2/2, cupyffn: 40 steps on cpu" and len(said) == 4
    assert r["final_loss_steps"] == 20 and r["cupyffn"]["final_loss"] == pytest.approx(
        sum(r["cupyffn"]["losses"][-20:]) / 20)


def test_gpt2_example_report_says_what_each_figure_is():
    """The script's closing lines: the final loss named as the mean of the last steps (how many), the paired speed
    as the twin's step time over the run's own, against the twin named."""
    torch_or_skip()
    example = load("train_gpt2")
    r = {"torch eager": {"median_step_ms": 6.8, "final_loss": 3.3261, "final_loss_vs_eager": 1.0},
         "cupyffn": {"median_step_ms": 7.77, "final_loss": 3.3262, "final_loss_vs_eager": 1.00003,
                     "paired_speedup_vs_twin": 0.946},
         "torch.compile": {"error": "RuntimeError: boom"},
         "final_loss_steps": 60, "final_loss_ratio": 1.00003, "agree": True}
    lines = example.report(r)
    assert lines[0] == (f"{'torch eager':40s} median step     6.80 ms   mean loss of the last 60 steps 3.3261 "
                        "(1.0000x eager's)")
    assert lines[1] == (f"{'cupyffn':40s} median step     7.77 ms   mean loss of the last 60 steps 3.3262 (1.0000x "
                        "eager's); step by step 0.946x the speed of torch eager (torch eager's step time / its own, "
                        "median over the steps)")
    assert lines[2] == f"{'torch.compile':40s} failed: RuntimeError: boom"
    assert lines[3] == "mean loss of the last 60 steps, cupyffn / torch eager = 1.0000: agree (within 3%: True)"
    assert example.report(dict(r, agree=False))[-1].endswith(": DISAGREE (within 3%: False)")


def test_gpt2_example_small_run_prints_no_transformers_warnings():
    """A --small run on the CPU: its config's bos / eos ids inside the vocabulary and the loss named, so transformers
    has nothing to warn about (what it would say stays visible: nothing is filtered)."""
    torch_or_skip()
    pytest.importorskip("transformers", reason="transformers not installed (the GPT-2 example builds its model)")
    proc = run_example("train_gpt2.py", "--small", "--device", "cpu", "--no-compile", "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warn" not in proc.stderr.lower() and "transformers" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("mean loss of the last 3 steps, cupyffn / torch eager = "), lines[-1]
    model = load("train_gpt2").build("gpt2", dict(dim=64, layers=2, heads=2, vocab=64, seq=32), "cpu")
    assert model.config.bos_token_id == model.config.eos_token_id == 63 and model.loss_type == "ForCausalLM"


SCRIPTS = ["train_cupy", "train_torch", "train_jax", "train_gpt2", "train_tp_torch"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_defaults_to_auto_and_its_help_shows_defaults(name, monkeypatch):
    """--device defaults to auto in every example (the GPU where it can be used, else the CPU), and --help shows
    every option's default."""
    if name == "train_jax":
        pytest.importorskip("jax", reason="JAX not installed: framework tests are opt-in")
    elif name != "train_cupy":
        torch_or_skip()
    monkeypatch.syspath_prepend(str(EXAMPLES))  # train_tp_torch.py imports train_torch.py beside it
    assert load(name)._parse([]).device == "auto"
    proc = run_example(f"{name}.py", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    entries = []  # each option's help: its first line ("  --steps STEPS  ...") and the indented lines after it
    for line in proc.stdout.split("\n\n", 1)[1].splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
    options = [e for e in entries if not e.startswith("-h, --help")]
    assert len(options) >= 5 and any(e.startswith("--device") and "(default: auto)" in e for e in options), entries
    assert [e for e in options if "(default: " not in e] == [], proc.stdout



def test_torch_example_summary_counts_the_steps_it_had():
    """Fewer than 10 steps: the means are over the steps there are, and the line says how many."""
    torch_or_skip()
    summary = load("train_torch").summary
    assert summary([7.0, 6.0, 5.0]) == ("mean loss of the first 3 steps 6.00000, of the last 3 steps 6.00000 "
                                        "(1.000x)")
    losses = [float(20 - i) for i in range(20)]
    assert summary(losses).startswith("mean loss of the first 10 steps 15.50000, of the last 10 steps 5.50000")
    assert summary([]) == "no steps were run"
    proc = run_example("train_torch.py", "--device", "cpu", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 3 and lines[-1].startswith("mean loss of the first 3 steps ")
    assert abs(float(lines[-1].split()[7].rstrip(",")) - sum(losses) / 3) <= 1e-4  # the mean of its 3 steps


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt2", "sd35"])
def test_gpt2_example_on_gpu(model):
    torch_or_skip(cuda=True)
    if model == "gpt2":
        pytest.importorskip("transformers", reason="transformers not installed (the GPT-2 example builds its model)")
    r = load("train_gpt2").main(model, steps=200, device="cuda", compile=False)
    assert r["learned"] and r["agree"], r["final_loss_ratio"]
