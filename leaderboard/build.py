"""Writes cupyffn's solutions for NVIDIA SOL-ExecBench's L2/068, and the problem folders they run against.

    python leaderboard/build.py [--out build/leaderboard] [--precision tf32 --precision fp16+fp8]
                                [--author NAME] [--target-hardware B200 --target-hardware LOCAL]
    python leaderboard/build.py --problems     # rewrites leaderboard/L2_068*/definition.json and workload.jsonl

A solution is a folder `cupyffn-<precision>/` (fp16+fp8 spelled fp16-fp8). Its `solution.json` is the submission:
the harness's Solution (name, definition, author, spec, sources) with every source inline, so the one file is the
whole solution. The evaluator writes the sources into its staging folder, which is first on sys.path, and calls
`spec.entry_point` (leaderboard/cupyffn_entry.py: run_tf32 or run_fp16_fp8). The sources are that entry and
cupyffn itself as its wheel installs it (setup.cfg's packages and package data, kernels_cu/ as cupyffn/kernels_cu/)
less the framework layers, which the entry does not import: the solution runs this checkout's cupyffn whatever is
installed. The same files are written beside solution.json, for reading. What the evaluator's environment must
provide (CuPy, NVRTC, cuBLAS): docs/leaderboard.md.

The problem folders (definition.json + workload.jsonl, the layout `sol-execbench <problem_dir>` reads) are
rebuilt from leaderboard/L2_068/reference.py and cupyffn/workloads.json: L2_068/ with the benchmark's consistent
inputs (its `generate_inputs`, "custom" inputs), L2_068_random_inputs/ with the harness's own random draws. They
are committed; tests/test_solution.py checks that they match what this writes.

Standard library only: no cupyffn import (the sources are read as files), no CuPy, no torch.
"""

import argparse
import configparser
import json
import re
import shutil
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENTRY = HERE / "cupyffn_entry.py"
REFERENCE = HERE / "L2_068" / "reference.py"
PROBLEMS = {"L2_068": "custom", "L2_068_random_inputs": "random"}  # folder -> the workloads' input type
DEFAULT_OUT = ROOT / "build" / "leaderboard"

DEFINITION_NAME = "068_gelu_approximate_feedforward_backward"
#: cupyffn precision -> (its entry in cupyffn_entry.py, the name's slug in solution and folder names)
ENTRIES = {"tf32": ("run_tf32", "tf32"), "fp16+fp8": ("run_fp16_fp8", "fp16-fp8")}
HARDWARE = ("B200", "LOCAL")  # the harness's SupportedHardware values
#: the harness's SourceFile refuses empty content; cupyffn's empty __init__.py files get this line instead
EMPTY_FILE = "# (empty in cupyffn's tree: SOL-ExecBench refuses a source file without content)\n"
#: left out of the solution: the framework layers (the entry calls cupyffn.gelu_ffn_backward only)
LEFT_OUT_PACKAGES = ("cupyffn.frameworks",)
LEFT_OUT_MODULES = ("cupyffn/torch.py", "cupyffn/jax.py")

INPUTS = {
    "grad_output": (["batch_size", "seq_len", "dim"], "gradient of the loss with respect to the block's output"),
    "hidden_states": (["batch_size", "seq_len", "dim"], "the block's input x"),
    "weight1": (["hidden_dim", "dim"], "first linear layer's weight, [out_features, in_features]"),
    "weight2": (["dim", "hidden_dim"], "second linear layer's weight, [out_features, in_features]"),
    "linear1_out": (["batch_size", "seq_len", "hidden_dim"], "saved pre-activation z = x @ weight1^T"),
    "tanh_inner": (["batch_size", "seq_len", "hidden_dim"],
                   "saved tanh(sqrt(2/pi) (z + 0.044715 z^3)), the tanh's output"),
    "gelu_out": (["batch_size", "seq_len", "hidden_dim"], "saved 0.5 z (1 + tanh_inner)"),
}
OUTPUTS = {
    "grad_hidden_states": (["batch_size", "seq_len", "dim"], "gradient with respect to hidden_states"),
    "grad_weight1": (["hidden_dim", "dim"], "gradient with respect to weight1"),
    "grad_weight2": (["dim", "hidden_dim"], "gradient with respect to weight2"),
}


def _workloads_data():
    return json.loads((ROOT / "cupyffn" / "workloads.json").read_text())


def _version():
    text = (ROOT / "cupyffn" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


# ---------------------------------------------------------------------------------------------- problems
def definition(custom_inputs):
    """L2/068's Definition as a dict: axes, inputs, outputs, the reference; with `custom_inputs`, the reference's
    generate_inputs makes the inputs (the benchmark's consistent ones)."""
    data = _workloads_data()
    tensor = (lambda spec: {"shape": spec[0], "dtype": "float32", "description": spec[1]})
    d = {
        "name": DEFINITION_NAME,
        "description": ("Backward of a GELU(tanh) feed-forward block without biases (SD3.5 medium's MLP), float32. "
                        "Reconstructed by cupyffn (leaderboard/build.py) from the problem statement; the official "
                        "definition is the nvidia/SOL-ExecBench dataset's (subset L2)."),
        "axes": {
            "batch_size": {"type": "var", "description": "batch size"},
            "seq_len": {"type": "var", "description": "sequence length"},
            "dim": {"type": "const", "value": data["dim"], "description": "model dimension D"},
            "hidden_dim": {"type": "const", "value": data["hidden_dim"], "description": "hidden dimension H"},
        },
        "inputs": {name: tensor(spec) for name, spec in INPUTS.items()},
        "outputs": {name: tensor(spec) for name, spec in OUTPUTS.items()},
        "reference": REFERENCE.read_text(),
    }
    if custom_inputs:
        d["custom_inputs_entrypoint"] = "generate_inputs"
    return d


def workloads(input_type):
    """The 16 official workloads as Workload dicts: axes, inputs of `input_type` ("custom" or "random"), the
    benchmark's tolerance (max_atol per T, max_rtol, required_matched_ratio: cupyffn/workloads.json)."""
    data = _workloads_data()
    tol = data["tolerance"]
    out = []
    for w in data["workloads"]:
        label = f"B{w['batch_size']}xS{w['seq_len']}"
        out.append({
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"cupyffn/{DEFINITION_NAME}/{input_type}/{label}")),
            "axes": {"batch_size": w["batch_size"], "seq_len": w["seq_len"]},
            "inputs": {name: {"type": input_type} for name in INPUTS},
            "tolerance": {"max_atol": w["max_atol"], "max_rtol": tol["max_rtol"],
                          "required_matched_ratio": tol["required_matched_ratio"]},
        })
    return out


def problem_files(folder):
    """{file name: text} of problem folder `folder` (a key of PROBLEMS)."""
    kind = PROBLEMS[folder]
    return {"definition.json": json.dumps(definition(kind == "custom"), indent=2) + "\n",
            "workload.jsonl": "".join(json.dumps(w) + "\n" for w in workloads(kind))}


def write_problems(root=HERE):
    for folder in PROBLEMS:
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in problem_files(folder).items():
            (root / folder / name).write_text(text)


# --------------------------------------------------------------------------------------------- solutions
def package_sources():
    """[(path in the solution, text)] of cupyffn as its wheel installs it (setup.cfg), less LEFT_OUT_*."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    options = cfg["options"]
    package_dir = dict(line.split("=") for line in options["package_dir"].split("\n") if line.strip())
    package_dir = {k.strip(): v.strip() for k, v in package_dir.items()}
    data = {k: [g.strip() for g in v.split(",")] for k, v in cfg["options.package_data"].items()}
    files = []
    for package in options["packages"].split():
        if package in LEFT_OUT_PACKAGES:
            continue
        src = ROOT / package_dir.get(package, package.replace(".", "/"))
        dest = package.replace(".", "/")
        found = sorted(src.glob("*.py")) + sorted(p for g in data.get(package, ()) for p in src.glob(g))
        for path in found:
            rel = f"{dest}/{path.relative_to(src).as_posix()}"
            if rel not in LEFT_OUT_MODULES:
                files.append((rel, path.read_text() or EMPTY_FILE))
    if not files:
        raise RuntimeError(f"no cupyffn sources found from {ROOT / 'setup.cfg'}")
    return files


def solution(precision, author="cupyffn", target_hardware=HARDWARE):
    """The harness's Solution for cupyffn at `precision` as a dict, every source inline."""
    if precision not in ENTRIES:
        raise ValueError(f"precision must be one of {', '.join(ENTRIES)}; got {precision!r}")
    bad = [h for h in target_hardware if h not in HARDWARE]
    if bad or not target_hardware:
        raise ValueError(f"target_hardware must be a non-empty list of {', '.join(HARDWARE)}; got {target_hardware!r}")
    entry, slug = ENTRIES[precision]
    sources = [(ENTRY.name, ENTRY.read_text())] + package_sources()
    return {
        "name": f"cupyffn-{slug}",
        "definition": DEFINITION_NAME,
        "author": author,
        "description": (f"cupyffn {_version()}, precision {precision} (docs/precisions.md), on torch's current "
                        "stream, zero-copy. Needs CuPy >= 14 (cupy-cuda13x or cupy-cuda12x) with NVRTC, cuBLAS and "
                        "cuBLASLt; its sm_90a GEMMs run on H100/H200 only, other GPUs take its cuBLAS route."),
        "spec": {
            "languages": ["pytorch"],
            "target_hardware": list(target_hardware),
            "entry_point": f"{ENTRY.name}::{entry}",
            "dependencies": ["torch"],
            "destination_passing_style": True,
        },
        "sources": [{"path": path, "content": text} for path, text in sources],
    }


def write_solution(out, precision, author="cupyffn", target_hardware=HARDWARE):
    """Writes `out`/cupyffn-<slug>/ (solution.json and its sources) afresh; returns the solution.json path."""
    sol = solution(precision, author, target_hardware)
    folder = Path(out) / sol["name"]
    if folder.exists():
        if not (folder / "solution.json").is_file():
            raise FileExistsError(f"{folder} exists and holds no solution.json: not a folder this builder wrote")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "solution.json").write_text(json.dumps(sol, indent=1) + "\n")
    for src in sol["sources"]:
        path = folder / src["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src["content"])
    return folder / "solution.json"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the solutions (default %(default)s)")
    parser.add_argument("--precision", action="append", choices=list(ENTRIES),
                        help="a solution to write (repeatable; default: all of them)")
    parser.add_argument("--author", default="cupyffn", help="the solutions' author field (default %(default)s)")
    parser.add_argument("--target-hardware", action="append", choices=HARDWARE,
                        help="the solutions' target_hardware (repeatable; default: B200 and LOCAL)")
    parser.add_argument("--problems", action="store_true",
                        help="rewrite the committed problem folders leaderboard/L2_068*/ instead")
    args = parser.parse_args(argv)
    if args.problems:
        write_problems()
        print(f"wrote {', '.join(str(HERE / f) for f in PROBLEMS)}")
        return 0
    for precision in args.precision or list(ENTRIES):
        path = write_solution(args.out, precision, args.author, tuple(args.target_hardware or HARDWARE))
        print(f"{precision}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
