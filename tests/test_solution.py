"""cupyffn's SOL-ExecBench solutions for L2/068 (leaderboard/), without a GPU: the problem folders are what the
builder writes, and hold the schema the harness reads (axes, inputs, outputs, dtypes, the 16 workloads, their
tolerances); each solution follows the harness's Solution rules, carries this checkout's cupyffn, and its entry,
called as the evaluator calls it (destination-passing style, from a staging folder first on sys.path), writes the
right gradients through the NumPy route: NumPy arrays here, CPU torch tensors from the definition's own input
generator where torch is installed. The harness's own pydantic models check the files where the harness is
installed (docs/leaderboard.md)."""

import ast
import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cupyffn import PRECISIONS, workloads

ROOT = Path(__file__).resolve().parent.parent
LEADERBOARD = ROOT / "leaderboard"


def _load_builder():
    spec = importlib.util.spec_from_file_location("leaderboard_build", LEADERBOARD / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_builder()
FOLDERS = {"L2_068": "custom", "L2_068_random_inputs": "random"}
SHAPES = {"grad_output": ["batch_size", "seq_len", "dim"], "hidden_states": ["batch_size", "seq_len", "dim"],
          "weight1": ["hidden_dim", "dim"], "weight2": ["dim", "hidden_dim"],
          "linear1_out": ["batch_size", "seq_len", "hidden_dim"], "tanh_inner": ["batch_size", "seq_len", "hidden_dim"],
          "gelu_out": ["batch_size", "seq_len", "hidden_dim"], "grad_hidden_states": ["batch_size", "seq_len", "dim"],
          "grad_weight1": ["hidden_dim", "dim"], "grad_weight2": ["dim", "hidden_dim"]}


def _definition(folder):
    return json.loads((LEADERBOARD / folder / "definition.json").read_text())


def _workloads(folder):
    return [json.loads(line) for line in (LEADERBOARD / folder / "workload.jsonl").read_text().splitlines()]


def _function_params(source, name):
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    """{precision: (solution dict, path of solution.json)} as `leaderboard/build.py --out` writes them."""
    out = tmp_path_factory.mktemp("solutions")
    assert build.main(["--out", str(out)]) == 0
    return {p: (json.loads((out / f"cupyffn-{slug}" / "solution.json").read_text()),
                out / f"cupyffn-{slug}" / "solution.json") for p, (_, slug) in build.ENTRIES.items()}


# ------------------------------------------------------------------------------------------ problem folders
@pytest.mark.parametrize("folder", FOLDERS)
def test_problem_folders_are_what_the_builder_writes(folder):
    for name, text in build.problem_files(folder).items():
        assert (LEADERBOARD / folder / name).read_text() == text, \
            f"leaderboard/{folder}/{name} is stale: run python leaderboard/build.py --problems"


@pytest.mark.parametrize("folder", FOLDERS)
def test_definition_has_the_benchmarks_axes_tensors_and_reference(folder):
    d = _definition(folder)
    assert d["name"] == build.DEFINITION_NAME == "068_gelu_approximate_feedforward_backward"
    assert d["axes"] == {"batch_size": {"type": "var", "description": "batch size"},
                         "seq_len": {"type": "var", "description": "sequence length"},
                         "dim": {"type": "const", "value": workloads.DIM, "description": "model dimension D"},
                         "hidden_dim": {"type": "const", "value": workloads.HIDDEN_DIM,
                                        "description": "hidden dimension H"}}
    assert (workloads.DIM, workloads.HIDDEN_DIM) == (1536, 6144)
    assert tuple(d["inputs"]) == workloads.INPUT_NAMES and tuple(d["outputs"]) == workloads.OUTPUT_NAMES
    for name, spec in {**d["inputs"], **d["outputs"]}.items():
        assert spec["dtype"] == "float32" and spec["shape"] == SHAPES[name], name
        assert all(axis in d["axes"] for axis in spec["shape"])
    assert not set(d["inputs"]) & set(d["axes"]) and not set(d["inputs"]) & set(d["outputs"])
    # the harness's rules: a top-level run() whose parameters are the inputs in order; the entrypoint defined
    assert _function_params(d["reference"], "run") == list(d["inputs"])
    assert d["reference"] == (LEADERBOARD / "L2_068" / "reference.py").read_text()
    if FOLDERS[folder] == "custom":
        assert d["custom_inputs_entrypoint"] == "generate_inputs"
        assert _function_params(d["reference"], "generate_inputs") == ["axes_and_scalars", "device"]
    else:
        assert "custom_inputs_entrypoint" not in d


@pytest.mark.parametrize("folder", FOLDERS)
def test_workloads_are_the_16_official_ones_with_their_tolerances(folder):
    ws = _workloads(folder)
    assert [(w["axes"]["batch_size"], w["axes"]["seq_len"]) for w in ws] == \
        [(w.batch_size, w.seq_len) for w in workloads.WORKLOADS]
    assert len(ws) == 16 and len({w["uuid"] for w in ws}) == 16
    for w in ws:
        uuid.UUID(w["uuid"])
        tokens = w["axes"]["batch_size"] * w["axes"]["seq_len"]
        # required_matched_ratio is the harness's field (the dataset's "required_match_ratio" is ignored by it)
        assert w["tolerance"] == {"max_atol": workloads.max_atol(tokens), "max_rtol": 1e-5,
                                  "required_matched_ratio": 0.99}
        assert (workloads.RTOL, workloads.REQUIRED_MATCH) == (1e-5, 0.99)
        assert w["inputs"] == {name: {"type": FOLDERS[folder]} for name in workloads.INPUT_NAMES}
    assert sorted({workloads.max_atol(w.tokens) for w in workloads.WORKLOADS}) == \
        [0.025, 0.037, 0.045, 0.066, 0.081, 0.089, 0.11, 0.13]


# ------------------------------------------------------------------------------------------------ solutions
@pytest.mark.parametrize("precision", list(build.ENTRIES))
def test_solution_follows_the_harness_rules(solutions, precision):
    sol, path = solutions[precision]
    entry, slug = build.ENTRIES[precision]
    assert sol["name"] == f"cupyffn-{slug}" and sol["definition"] == _definition("L2_068")["name"]
    assert sol["author"] and precision in sol["description"]
    spec = sol["spec"]
    assert spec == {"languages": ["pytorch"], "target_hardware": ["B200", "LOCAL"],
                    "entry_point": f"cupyffn_entry.py::{entry}", "dependencies": ["torch"],
                    "destination_passing_style": True}
    paths = [s["path"] for s in sol["sources"]]
    assert len(paths) == len(set(paths)) and spec["entry_point"].split("::")[0] in paths
    for s in sol["sources"]:
        assert s["content"] and not Path(s["path"]).is_absolute() and ".." not in Path(s["path"]).parts
        assert (path.parent / s["path"]).read_text() == s["content"]  # the files beside solution.json
    entry_source = next(s["content"] for s in sol["sources"] if s["path"] == "cupyffn_entry.py")
    d = _definition("L2_068")
    assert _function_params(entry_source, entry) == list(d["inputs"]) + list(d["outputs"])


def test_solution_carries_this_checkouts_cupyffn_without_the_framework_layers(solutions):
    sources = {s["path"]: s["content"] for s in solutions["tf32"][0]["sources"]}
    kernels = sorted(p.relative_to(ROOT / "kernels_cu").as_posix() for p in (ROOT / "kernels_cu").rglob("*")
                     if p.suffix in (".cu", ".cuh"))
    assert kernels and all(sources[f"cupyffn/kernels_cu/{k}"] == (ROOT / "kernels_cu" / k).read_text()
                           for k in kernels)
    for module in ("__init__.py", "workloads.py", "workloads.json", "api/functional.py", "cpu/numpy_route.py",
                   "f32/engine.py", "gemm/sm90/launch.py", "lt/engine.py", "core/views.py"):
        text = (ROOT / "cupyffn" / module).read_text()
        assert sources[f"cupyffn/{module}"] == (text or build.EMPTY_FILE), module
    assert sources["cupyffn/api/__init__.py"] == build.EMPTY_FILE  # empty in the tree
    assert not [p for p in sources if p.startswith("cupyffn/frameworks/") or p in build.LEFT_OUT_MODULES]
    assert sources["cupyffn_entry.py"] == (LEADERBOARD / "cupyffn_entry.py").read_text()


def test_builder_rewrites_its_own_folder_and_refuses_others(tmp_path):
    path = build.write_solution(tmp_path, "tf32")
    (path.parent / "stale.py").write_text("left over")
    assert build.write_solution(tmp_path, "tf32") == path and not (path.parent / "stale.py").exists()
    (tmp_path / "cupyffn-fp16-fp8").mkdir()
    (tmp_path / "cupyffn-fp16-fp8" / "mine.txt").write_text("not the builder's")
    with pytest.raises(FileExistsError, match="holds no solution.json"):
        build.write_solution(tmp_path, "fp16+fp8")
    assert (tmp_path / "cupyffn-fp16-fp8" / "mine.txt").exists()
    with pytest.raises(ValueError, match="precision must be one of tf32, fp16\\+fp8; got 'bf16'"):
        build.solution("bf16")
    with pytest.raises(ValueError, match="target_hardware must be a non-empty list of B200, LOCAL; got"):
        build.solution("tf32", target_hardware=("local",))


def test_solutions_validate_against_the_harness_models(solutions):
    data = pytest.importorskip("sol_execbench.core.data", reason="sol_execbench (NVIDIA's SOL-ExecBench harness) "
                               "not installed: docs/leaderboard.md says how")
    for folder in FOLDERS:
        d = data.Definition(**_definition(folder))
        ws = [data.Workload(**w) for w in _workloads(folder)]
        assert d.get_output_shapes(ws[0].axes) == {"grad_hidden_states": (2, 128, 1536),
                                                   "grad_weight1": (6144, 1536), "grad_weight2": (1536, 6144)}
        assert ws[-1].tolerance.required_matched_ratio == 0.99
    for sol, _ in solutions.values():
        assert data.Solution(**sol).get_entry_symbol() in ("run_tf32", "run_fp16_fp8")


# --------------------------------------------------------------------------- the entry, as the evaluator calls it
# Run in a fresh interpreter from a staging folder written from solution.json alone (as the harness's packager
# writes it), that folder first on sys.path: the cupyffn imported must be the solution's own.
_DRIVER = r"""
import importlib, json, sys
staging, entry_point, precision, mode, reference = sys.argv[1:6]
sys.path.insert(0, staging)
module, name = entry_point.split("::")
run = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)
import numpy, cupyffn
from cupyffn import workloads
names = workloads.INPUT_NAMES
result = {"cupyffn": cupyffn.__file__}
if mode == "numpy":
    a = workloads.make_inputs((2, 8), dim=64, hidden_dim=256, seed=3)
    inputs = [a[n] for n in names]
    outputs = [numpy.zeros(s, numpy.float32) for s in ((2, 8, 64), (256, 64), (64, 256))]
    as_numpy = lambda x: x
else:
    import torch
    spec = importlib.util.spec_from_file_location("reference", reference)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    torch.manual_seed(3)
    made = ref.generate_inputs({"batch_size": 2, "seq_len": 8, "dim": 64, "hidden_dim": 256}, torch.device("cpu"))
    inputs = [made[n] for n in names]
    outputs = [torch.zeros(s) for s in ((2, 8, 64), (256, 64), (64, 256))]
    as_numpy = lambda x: x.numpy()
    z64 = inputs[4].numpy().astype(numpy.float64)
    from cupyffn.core import activation
    t64 = activation.tanh_inner(z64)
    result["tanh_inner_err"] = float(abs(inputs[5].numpy() - t64).max())
    result["gelu_out_err"] = float(abs(inputs[6].numpy() - activation.value(z64, t64)).max())
    result["reference_rel_l2"] = None  # filled below, against float64
    ref32 = [t.numpy() for t in ref.run(*inputs)]
before = [as_numpy(x).copy() for x in inputs]
run(*inputs, *outputs)
got = [as_numpy(o) for o in outputs]
ref64 = workloads.reference({n: as_numpy(x) for n, x in zip(names, inputs)})
rel = lambda out, r: float(numpy.linalg.norm(out.reshape(r.shape) - r) / numpy.linalg.norm(r))
result["rel_l2"] = [rel(o, r) for o, r in zip(got, ref64)]
if mode != "numpy":
    result["reference_rel_l2"] = [rel(o, r) for o, r in zip(ref32, ref64)]
direct = cupyffn.gelu_ffn_backward(*[as_numpy(x) for x in inputs], precision=precision)
result["same_as_direct_call"] = all(numpy.array_equal(o, d) for o, d in zip(got, direct))
result["other_precision_differs"] = any(not numpy.array_equal(o, d) for o, d in zip(got, cupyffn.gelu_ffn_backward(
    *[as_numpy(x) for x in inputs], precision="ieee")))
result["inputs_unchanged"] = all(numpy.array_equal(b, as_numpy(x)) for b, x in zip(before, inputs))
print(json.dumps(result))
"""


def _run_entry(solution, tmp_path, precision, mode):
    staging = tmp_path / "staging"
    for src in solution["sources"]:
        dest = staging / src["path"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(src["content"])
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(staging), solution["spec"]["entry_point"], precision,
                           mode, str(LEADERBOARD / "L2_068" / "reference.py")],
                          capture_output=True, text=True, cwd=staging, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["cupyffn"].startswith(str(staging)), result["cupyffn"]
    return result


@pytest.mark.parametrize("precision", list(build.ENTRIES))
def test_entry_writes_the_gradients_into_the_given_numpy_outputs(solutions, tmp_path, precision):
    r = _run_entry(solutions[precision][0], tmp_path, precision, "numpy")
    assert r["same_as_direct_call"] and r["other_precision_differs"] and r["inputs_unchanged"]
    assert max(r["rel_l2"]) <= PRECISIONS[precision].contract and min(r["rel_l2"]) > 0


@pytest.mark.parametrize("precision", list(build.ENTRIES))
def test_entry_on_cpu_torch_tensors_from_the_definitions_generator(solutions, tmp_path, precision):
    pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, "
                        "pip install '.[test-frameworks]'")
    r = _run_entry(solutions[precision][0], tmp_path, precision, "torch")
    assert r["same_as_direct_call"] and r["other_precision_differs"] and r["inputs_unchanged"]
    assert max(r["rel_l2"]) <= PRECISIONS[precision].contract and min(r["rel_l2"]) > 0
    # the definition's own pieces: consistent saved tensors, and a plain-fp32 reference of the right formula
    assert r["tanh_inner_err"] <= 1e-6 and r["gelu_out_err"] <= 1e-6
    assert max(r["reference_rel_l2"]) <= 1e-5
