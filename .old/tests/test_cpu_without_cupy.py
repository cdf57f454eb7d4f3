"""A CPU user without CuPy: every public function on NumPy arrays works where ``import cupy`` fails, and nothing
tries to import it.

Each check runs in a fresh Python whose ``import cupy`` (and ``cupyx``, ``cupy_backends``) raises
ModuleNotFoundError, as on a machine where CuPy is not installed (a finder at the front of sys.meta_path, so
CuPy's own files are never read); at its end the subprocess prints the CuPy modules it holds, which must be
none. Covered: the functional backward and forward, the plan object (device="cpu", and the error of
device=None), check_activations, accumulate, out=, memory mode, clear_cache and release_captured_plans, each
result against the float64 reference of cupyffn.workloads; the training examples' automatic device choice
(the torch and JAX ones where those frameworks are installed) and bench.py's CPU run.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BLOCKED = ("cupy", "cupyx", "cupy_backends")

# Prepended to every subprocess: the machine without CuPy. Then the body runs; then the report.
PREAMBLE = f"""
import sys
BLOCKED = {BLOCKED!r}


class _NoCuPy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (CuPy is blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _NoCuPy())
"""
REPORT = """
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print("CuPy modules loaded:", loaded)
print("cupy in sys.modules:", "cupy" in sys.modules)
"""
# Runs a script as `python script args...` would (its folder first on sys.path), then reports.
SCRIPT_RUNNER = """
import os
import runpy

script, *argv = sys.argv[1:]
sys.argv = [script] + argv
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
status = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
""" + REPORT + """
sys.exit(status)
"""

API = """
import numpy

import cupyffn
from cupyffn import workloads as W

T_LEAD, D, H = (3, 7), 24, 40
T = 21
inputs = W.make_inputs(T_LEAD, D, H, seed=5)
args = [inputs[n] for n in W.INPUT_NAMES]
ref = W.reference(inputs)


def rel(out, want):
    return W.relative_l2(numpy.asarray(out).reshape(want.shape), want)


def within(grads, precision):
    errors = [rel(g, r) for g, r in zip(grads, ref)]
    assert max(errors) <= cupyffn.PRECISIONS[precision].contract, (precision, errors)


# the functional backward: the CPU default (plain fp32), and an emulating precision by name
g = cupyffn.gelu_ffn_backward(*args)
within(g, "ieee")
assert all(isinstance(a, numpy.ndarray) for a in g)
for a, b in zip(g, cupyffn.gelu_ffn_backward(*args, precision="ieee")):
    assert numpy.array_equal(a, b)
within(cupyffn.gelu_ffn_backward(*args, precision="fp16+fp8"), "fp16+fp8")

# out=: the given arrays are the results
out = tuple(numpy.full(a.shape, numpy.nan, numpy.float32) for a in g)
got = cupyffn.gelu_ffn_backward(*args, out=out)
assert all(a is b for a, b in zip(got, out)) and all(numpy.array_equal(a, b) for a, b in zip(out, g))

# accumulate=True adds the weight gradients into out=
base = [numpy.ones(a.shape, numpy.float32) for a in g]
acc = cupyffn.gelu_ffn_backward(*args, out=(None, base[1], base[2]), accumulate=True)
assert numpy.allclose(acc.grad_weight1, 1 + g.grad_weight1, rtol=1e-6, atol=1e-6)
assert numpy.allclose(acc.grad_weight2, 1 + g.grad_weight2, rtol=1e-6, atol=1e-6)

# memory mode and need_* flags
within(cupyffn.gelu_ffn_backward(*args[:5]), "ieee")
only_w = cupyffn.gelu_ffn_backward(*args, need_grad_hidden=False)
assert only_w.grad_hidden_states is None and numpy.array_equal(only_w.grad_weight1, g.grad_weight1)

# check_activations: consistent tensors pass, swapped ones are named
cupyffn.gelu_ffn_backward(*args, check_activations=True)
swapped = args[:5] + [args[6], args[5]]
try:
    cupyffn.gelu_ffn_backward(*swapped, check_activations=True)
    raise AssertionError("swapped activations passed check_activations")
except cupyffn.ActivationMismatchError as e:
    assert "swapped" in str(e), e

# the forward, against its float64 reference
f = cupyffn.gelu_ffn_forward(inputs["hidden_states"], inputs["weight1"], inputs["weight2"])
for a, want in zip(f, W.forward_reference(inputs["hidden_states"], inputs["weight1"], inputs["weight2"])):
    assert rel(a, want) <= cupyffn.PRECISIONS["ieee"].contract, rel(a, want)

# the plan object: device="cpu" works (and with check_activations, out=, accumulate); device=None says why not
plan = cupyffn.GeluFFNBackward(T, D, H, device="cpu")
assert plan.precision.name == "ieee" and plan.scratch_bytes == 0
for a, b in zip(plan(*args, check_activations=True), g):
    assert numpy.array_equal(a, b)
base = [numpy.ones(a.shape, numpy.float32) for a in g]
plan(*args, out=base, accumulate=True)
assert numpy.allclose(base[1], 1 + g.grad_weight1, rtol=1e-6, atol=1e-6)
emulating = cupyffn.GeluFFNBackward(T, D, H, device="cpu", precision="bf16x3")
within(emulating(*args), "bf16x3")
plan.close()
try:
    cupyffn.GeluFFNBackward(T, D, H)
    raise AssertionError("GeluFFNBackward() built a plan without CuPy")
except RuntimeError as e:
    message = str(e)
    assert "device='cpu'" in message and "insufficient" not in message, message
    assert ("no NVIDIA GPU visible (" in message or "CuPy cannot be imported (" in message), message
    print("GeluFFNBackward() says:", message)

cupyffn.clear_cache()
assert cupyffn.release_captured_plans() == 0
print("API OK")
"""


def run_python(code, *args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc


def assert_no_cupy(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "CuPy modules loaded: []" in lines, proc.stdout[-2000:]
    assert "cupy in sys.modules: False" in lines, proc.stdout[-2000:]
    return lines


def test_the_blocker_blocks():
    proc = run_python("""
try:
    import cupy
    raise SystemExit("cupy imported")
except ModuleNotFoundError as e:
    print("blocked:", e)
""" + REPORT)
    lines = assert_no_cupy(proc)
    assert any(line.startswith("blocked: No module named 'cupy'") for line in lines), lines


def test_public_api_on_numpy_arrays():
    lines = assert_no_cupy(run_python(API + REPORT))
    assert "API OK" in lines


def test_cupy_example_chooses_the_cpu():
    proc = run_python(SCRIPT_RUNNER, str(REPO / "examples" / "train_cupy.py"), "--steps", "20")
    lines = assert_no_cupy(proc)
    assert lines[0].startswith("device=cpu dim=32 hidden_dim=128 batch=256 precision=ieee"), lines[0]
    assert any(line.startswith("mean loss of the first 10 steps") for line in lines), lines[-5:]


@pytest.mark.parametrize("framework,example,args", [
    ("torch", "train_torch.py", ("--steps", "12")),
    ("jax", "train_jax.py", ("--steps", "12")),
])
def test_framework_examples_run_on_the_cpu(framework, example, args):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    # the example's default device is the framework's GPU where it has one; its CPU path is the one checked here
    proc = run_python(SCRIPT_RUNNER, str(REPO / "examples" / example), "--device", "cpu", *args)
    lines = assert_no_cupy(proc)
    assert "precision=ieee" in lines[0] or "precision='ieee'" in lines[0], lines[0]
    assert any(line.startswith("mean loss of the first 10 steps") for line in lines), lines[-5:]


def test_bench_runs_its_cpu_smoke_test(tmp_path):
    path = tmp_path / "cpu.json"
    proc = run_python(SCRIPT_RUNNER, str(REPO / "bench.py"), "--quick", "--rounds", "1", "--iters", "1",
                      "--impls", "cupyffn-ieee,cupyffn-bf16x3", "--json", str(path))
    lines = assert_no_cupy(proc)
    assert lines[1].startswith(("no NVIDIA GPU visible (", "CuPy cannot be imported (")), lines[:3]
    assert not any("insufficient" in line for line in lines)
    result = json.loads(path.read_text())
    assert [s["tokens"] for s in result["sizes"]] == [64, 256]
    for size in result["sizes"]:
        assert list(size["results"]) == ["cupyffn-bf16x3", "cupyffn-ieee"]
        assert all(r["passes"] and r["rounds"] == 1 for r in size["results"].values())
