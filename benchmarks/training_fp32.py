"""``bench.py --suite train-fp32``: whole float32 training steps (no autocast, AdamW), torch against cupyffn's MLPs.

Models: examples/train_gpt2.py's GPT-2 at SD3.5's MLP shape ("gpt2": 1536/6144, 4 layers, T = 2048), GPT-2 medium's
width ("gpt2-medium": 1024/4096, T = 8192, at 4 layers here: `SIZES`) and its SD3.5 stack ("sd35": 1536/6144, 4
blocks, T = 2048), all float32; and "jax-mlp", a float32 JAX training loop (benchmarks/training_jax.py). Each torch
model is trained once per row of `ROWS` from the same initial weights on the same batches, with AdamW and the
gradient norm clipped at 1 (examples/train_gpt2.py's stepper, no autocast):

* torch's own MLPs, strict (TF32 off for float32 matmuls, PyTorch's default) and with TF32 allowed
  (``torch.set_float32_matmul_precision("high")``), each eager, under torch.compile and under torch.compile's
  reduce-overhead mode (CUDA graphs);
* the model with ``cupyffn.torch.replace_mlps(model, precision=...)``: fp16+fp8 beside strict and tf32 beside TF32,
  each eager, compiled and reduce-overhead (in float32 the compiled graph holds cupyffn's operators), and ieee (plain
  fp32) beside strict, eager, as a control.

A group is a torch row and the cupyffn rows beside it (the same mode and TF32 setting, which the rest of the model
computes with); each cupyffn row's twin is its group's torch row. Without --paired the rows train one after the
other; with it each group trains together, steps in turn, each row going first in turn (decision 066), and each
cupyffn row also gets the median of its per-step ratios to its twin.
Per row: the median step time after the fifth step (CUDA events around the step, the host synchronized after it);
the graph breaks Dynamo counted (compiled rows); the loss curve's largest relative distance from torch strict's
(`loss_distance`); and the first step's gradients against a float64 step of the same model on the same batch
(`grad_errors`: the worst relative L2 error over the MLP weights' gradients, and that of all parameters' gradients
together). A row that raises is recorded with its error and the suite goes on.
"""

import contextlib
import copy
import datetime
import importlib.util
import math
import statistics
import sys
import time
from typing import NamedTuple, Optional

from . import report as R

SUITE = "train-fp32"
JAX_MODEL = "jax-mlp"
TORCH_MODELS = ("gpt2", "gpt2-medium", "sd35")  # examples/train_gpt2.py PRESETS
MODELS = TORCH_MODELS + (JAX_MODEL,)
#: sizes that differ from the example's PRESETS: GPT-2 medium's width at 4 layers, not 24 (a strict float32 step of
#: 24 layers at T = 8192 is ~17 TFLOP, about 0.4 s on an H100: 13 rows would not fit the suite's few minutes)
SIZES = {"gpt2-medium": dict(layers=4)}
STEPS = 40  # the default --steps of this suite
REFERENCE = "torch strict"  # the loss curve the others are measured against


MODES = (None, "default", "reduce-overhead")  # eager, torch.compile, torch.compile(mode="reduce-overhead")


class Row(NamedTuple):
    """One training run: torch's MLPs (precision None) or cupyffn's in `precision`, compiled in `mode` (None: eager),
    with float32 matmuls in TF32 allowed or not."""

    name: str
    precision: Optional[str]
    mode: Optional[str]
    tf32: bool


ROWS = (
    Row("torch strict", None, None, False),
    Row("cupyffn fp16+fp8", "fp16+fp8", None, False),
    Row("cupyffn ieee", "ieee", None, False),
    Row("torch TF32", None, None, True),
    Row("cupyffn tf32", "tf32", None, True),
    Row("torch.compile strict", None, "default", False),
    Row("cupyffn fp16+fp8 + torch.compile", "fp16+fp8", "default", False),
    Row("torch.compile TF32", None, "default", True),
    Row("cupyffn tf32 + torch.compile", "tf32", "default", True),
    Row("torch.compile reduce-overhead strict", None, "reduce-overhead", False),
    Row("cupyffn fp16+fp8 + torch.compile reduce-overhead", "fp16+fp8", "reduce-overhead", False),
    Row("torch.compile reduce-overhead TF32", None, "reduce-overhead", True),
    Row("cupyffn tf32 + torch.compile reduce-overhead", "tf32", "reduce-overhead", True),
)


def groups(rows=ROWS):
    """The rows in groups of one mode and TF32 setting, each led by its torch row, in `rows`' order."""
    out = {}
    for row in rows:
        out.setdefault((row.mode, row.tf32), []).append(row)
    return list(out.values())


#: each cupyffn row and the torch row beside it (its group's)
TWINS = {row.name: group[0].name for group in groups() for row in group[1:]}


def _example():
    path = R.ROOT / "examples" / "train_gpt2.py"
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_gpt2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def matmul_tf32(enabled):
    """torch's float32 matmuls with TF32 allowed ("high") or not ("highest", PyTorch's default) inside; restored
    after."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ---------------------------------------------------------------------------------------- the measures
def loss_distance(losses, reference):
    """The largest relative distance max_i |losses[i] - reference[i]| / |reference[i]| over the steps both have
    (None where there are none)."""
    pairs = list(zip(losses, reference))
    if not pairs:
        return None
    return max(abs(a - r) / abs(r) for a, r in pairs)


def grad_errors(grads, reference, mlp_weights):
    """The gradients `grads` {name: tensor or None} against float64 `reference` {name: tensor}: {"mlp_weights": the
    largest relative L2 error of one MLP weight's gradient (names `mlp_weights`), "all": the relative L2 error of all
    parameters' gradients taken together, "worst": [name, error] of the parameter with the largest}. A missing
    gradient counts as zero; a parameter whose float64 gradient is zero is left out of "worst"."""
    import torch

    per, diff2, ref2 = {}, 0.0, 0.0
    for name, ref in reference.items():
        g = grads.get(name)
        d = float(torch.linalg.vector_norm(ref if g is None else g.double() - ref))
        r = float(torch.linalg.vector_norm(ref))
        diff2, ref2 = diff2 + d * d, ref2 + r * r
        if r > 0:
            per[name] = d / r
    worst = max(per.items(), key=lambda kv: kv[1]) if per else (None, None)
    return {"mlp_weights": max(per[n] for n in mlp_weights) if mlp_weights else None,
            "all": math.sqrt(diff2 / ref2) if ref2 > 0 else None, "worst": list(worst)}


def float64_gradients(example, model, kind, item):
    """{name: gradient} of one float64 step (forward, loss, backward; no optimizer) of a float64 copy of `model` on
    batch `item` (its floating tensors in float64)."""
    import torch

    m = copy.deepcopy(model).double()
    if kind != "gpt2":
        item = tuple(t.double() for t in item)
    example.loss_of(m, kind, item).backward()
    return {n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None}


def mlp_weight_names(model, replaced):
    """The names of `model`'s parameters that are the weights of the MLP modules named `replaced` (replace_mlps)."""
    return [n for n, _ in model.named_parameters()
            if n.endswith("weight") and any(n.startswith(m + ".") for m in replaced)]


# ---------------------------------------------------------------------------------------- running
def run_model(model, steps=STEPS, device="cuda", paired=False, keep_going=True, modes=MODES, sizes=None, lr=None,
              say=None):
    """Train `model` (a TORCH_MODELS name) once per row of ROWS whose mode is in `modes`; returns {"sizes",
    "runs": {row: {"losses", "median_step_ms", "graph_breaks" (compiled), "grad_error", "loss_distance",
    "paired_speedup_vs_twin" (paired cupyffn rows)} or {"error"}}, "mlp_weights"}. `sizes` override the preset's
    (dim, layers, heads, vocab, seq, batch); lr: AdamW's (the example's default)."""
    import torch

    import cupyffn.torch as ct

    example = _example()
    if model not in TORCH_MODELS:
        raise ValueError(f"model must be one of {', '.join(TORCH_MODELS)}; got {model!r}")
    preset = dict(example.PRESETS[model])
    kind = preset.pop("kind")
    sizes = dict(preset, **SIZES.get(model, {}), **(sizes or {}))
    device = example.pick_device(device)
    lr = (3e-4 if kind == "gpt2" else 1e-4) if lr is None else lr
    say = say or (lambda line: None)

    def data():
        return example.batches(kind, steps, sizes["batch"], sizes["seq"], sizes["dim"], sizes["vocab"], device)

    base = example.build(kind, sizes, device)
    replaced, skipped = ct.replace_mlps(copy.deepcopy(base))
    if len(replaced) != sizes["layers"] or skipped:
        raise RuntimeError(f"replace_mlps swapped {replaced}, left {skipped}")
    mlps = mlp_weight_names(base, replaced)
    result = {"sizes": dict(sizes, hidden=4 * sizes["dim"]), "mlp_weights": mlps, "runs": {}}
    try:
        reference = float64_gradients(example, base, kind, next(data()))
    except Exception as e:  # (out of memory, say): the rows still run, without the gradient column
        reference = None
        result["float64_error"] = example._one_line(e)
    rows = [r for r in ROWS if r.mode in modes]
    plan = groups(rows) if paired else [[r] for r in rows]
    for g, group in enumerate(plan):
        label = f"{model}: run {g + 1}/{len(plan)}"
        say(f"{label}, {' and '.join(r.name for r in group)}: {steps} steps on {device}"
            + (", steps in turn" if len(group) > 1 else ""))
        with matmul_tf32(group[0].tf32):
            if group[0].mode is not None:
                torch._dynamo.reset()  # each compiled group from empty caches (and no CUDA graphs of the last)
            active = [_start(example, row, base, kind, device, lr, data(), reference, mlps, model, keep_going)
                      for row in group]
            example.train_together(active, steps, model, keep_going)
        for run in active:
            result["runs"][run.name] = _outcome(run)
            if "median_step_ms" in result["runs"][run.name]:
                say(f"{label}, {run.name}: median step {result['runs'][run.name]['median_step_ms']:.2f} ms")
        twin = active[0]
        for run in active[1:]:
            if run.error is None and twin.error is None:
                ratios = [a / b for a, b in zip(twin.times, run.times)]
                result["runs"][run.name]["paired_speedup_vs_twin"] = statistics.median(ratios[5:] or ratios)
        active = None
        if device == "cuda":
            torch.cuda.empty_cache()
    strict = result["runs"].get(REFERENCE, {}).get("losses")
    for entry in result["runs"].values():
        if strict is not None and "losses" in entry:
            entry["loss_distance"] = loss_distance(entry["losses"], strict)
    return result


def _start(example, row, base, kind, device, lr, data, reference, mlps, model, keep_going):
    """A run of `row` ready to step (examples/train_gpt2.py's _Run), its first step's gradient errors kept in
    run.grad_error."""
    import torch

    import cupyffn.torch as ct

    run = example._Run(row.name, row.mode, data)
    run.grad_error = None
    try:
        m = copy.deepcopy(base)  # every row from the same initial weights
        if row.precision is not None:
            ct.replace_mlps(m, precision=row.precision)
        stepped = m if row.mode is None else torch.compile(m, mode=None if row.mode == "default" else row.mode)

        def first_gradients():
            if run.grad_error is None and reference is not None:
                run.grad_error = grad_errors({n: p.grad for n, p in m.named_parameters()}, reference, mlps)

        run.step = example.stepper(stepped, kind, device, lr, mark_steps=row.mode == "reduce-overhead",
                                   autocast=None, after_backward=first_gradients)
    except Exception as e:
        run.fail(e, model, keep_going)
    return run


def _outcome(run):
    if run.error is not None:
        return {"error": run.error}
    out = {"losses": run.losses, "median_step_ms": statistics.median(run.times[5:] or run.times),
           "grad_error": run.grad_error}
    if run.mode is not None:
        out["graph_breaks"] = run.graph_breaks
    return out


# ---------------------------------------------------------------------------------------- the summary
def summarize(entry, twins=None):
    """`entry` (run_model's, or training_jax.run's) with each cupyffn row's speed over its twin's added
    ("speedup_vs_twin": the ratio of the medians; "paired_speedup_vs_twin" where the steps were paired)."""
    twins = entry.get("twins", TWINS) if twins is None else twins
    runs = entry.get("runs", {})
    timed = {n: e["median_step_ms"] for n, e in runs.items() if "median_step_ms" in e}
    return dict(entry,
                speedup_vs_twin={n: timed[t] / timed[n] for n, t in twins.items() if n in timed and t in timed},
                paired_speedup_vs_twin={n: e["paired_speedup_vs_twin"] for n, e in runs.items()
                                        if "paired_speedup_vs_twin" in e})


#: issue 61's targets, stated for GPT-2 (evaluated for every torch model): (what, row, its twin's row, at least)
SPEED_TARGETS = (("fp16+fp8 compiled over torch.compile strict", "cupyffn fp16+fp8 + torch.compile", 1.6),
                 ("tf32 compiled over torch.compile TF32", "cupyffn tf32 + torch.compile", 1.2),
                 ("fp16+fp8 eager over torch strict", "cupyffn fp16+fp8", 1.6),
                 ("tf32 eager over torch TF32", "cupyffn tf32", 1.2))
CONTRACT = 1e-4  # fp16+fp8's relative L2 contract (cupyffn.PRECISIONS)


def targets(entry):
    """[(what, value, goal text, met: True / False / None where not measured)] of a summarized torch model."""
    runs, speed = entry["runs"], entry["speedup_vs_twin"]
    out = []
    for what, row, least in SPEED_TARGETS:
        value = speed.get(row)
        out.append((what, value, f">= {least}x", None if value is None else value >= least))
    fp8, tf32 = (runs.get(n, {}).get("loss_distance") for n in ("cupyffn fp16+fp8", "torch TF32"))
    ratio = fp8 / tf32 if fp8 is not None and tf32 else None
    out.append(("fp16+fp8's loss distance over torch TF32's", ratio, "<= 0.25", None if ratio is None else ratio <= 0.25))
    error = (runs.get("cupyffn fp16+fp8", {}).get("grad_error") or {}).get("mlp_weights")
    out.append(("fp16+fp8's MLP weight gradients vs float64", error, f"<= {CONTRACT:g}",
                None if error is None else error <= CONTRACT))
    compiled = [n for n, e in runs.items() if n.startswith("cupyffn") and "graph_breaks" in e]
    breaks = sum(runs[n]["graph_breaks"] for n in compiled) if compiled else None
    out.append(("graph breaks in the compiled cupyffn rows", breaks, "0", None if breaks is None else breaks == 0))
    ro = [n for n in runs if n.startswith("cupyffn") and n.endswith("reduce-overhead")]
    ran = all("error" not in runs[n] for n in ro) if ro else None
    out.append(("cupyffn's reduce-overhead rows run", ran, "all", ran))
    return out


def _cell(text):
    return str(text).replace("|", "\\|")


def _num(value, spec, none=""):
    return none if value is None else format(value, spec)


def table(entry, name):
    """The markdown rows of one summarized model (run_model's or training_jax.run's entry) and its failures."""
    lines, errors = [], []
    for run, e in entry.get("runs", {}).items():
        if "error" in e:
            errors.append(f"- {name}, {run}: {_cell(e['error'])}")
            lines.append(f"| {name} | {run} | failed ({len(errors)}) | | | | | |")
            continue
        twin, paired = entry["speedup_vs_twin"].get(run), entry["paired_speedup_vs_twin"].get(run)
        grad = e.get("grad_error") or {}
        lines.append(f"| {name} | {run} | {e['median_step_ms']:.2f} | " + _num(twin, ".2f")
                     + ("x" if twin is not None else "")
                     + ("" if paired is None else f" (step by step {paired:.2f}x)") + " | "
                     + _num(e.get("loss_distance"), ".1e", "n/a") + " | " + _num(grad.get("mlp_weights"), ".1e", "n/a")
                     + " | " + _num(grad.get("all"), ".1e", "n/a") + f" | {e.get('graph_breaks', '')} |")
    return lines, errors


def markdown(result):
    env = result["env"]
    lines = [f"# {SUITE}: float32 training steps, torch against cupyffn's MLPs, {env['device']}", "",
             f"{result['date'][:10]}, commit {str(result['git_commit'])[:7]}, CuPy {env['cupy']}, torch "
             f"{env['torch']}: `{result['command']}` ({result['steps']} steps per run, AdamW, no autocast; "
             "benchmarks/training_fp32.py says what is timed and measured)."
             + (" Paired: each group's rows trained side by side, steps in turn; the twin column gives the ratio of "
                "the medians, then the median of the per-step ratios." if result.get("paired") else ""),
             "", "| model | run | ms/step | cupyffn vs its torch twin | loss distance from torch strict | "
             "grad rel. L2 vs float64: MLP weights | all parameters | graph breaks |",
             "|---|---|---|---|---|---|---|---|"]
    errors, notes = [], []
    for name, entry in result["models"].items():
        if "skipped" in entry or "error" in entry:
            notes.append(f"- {name}: " + (f"skipped: {_cell(entry['skipped'])}" if "skipped" in entry
                                          else f"failed: {_cell(entry['error'])}"))
            continue
        rows, failed = table(entry, name)
        lines += rows
        errors += failed
        if "float64_error" in entry:
            notes.append(f"- {name}: no float64 reference: {_cell(entry['float64_error'])}")
    lines += ["", "Twins: each cupyffn row beside its group's torch row (the same mode and TF32 setting: fp16+fp8 and "
              "ieee beside strict, tf32 beside TF32; jax-mlp: fp16+fp8 and ieee beside jax.jit highest, tf32 beside "
              "jax.jit default). Sizes (hidden = 4 dim): "
              + "; ".join(f"{n} dim {m['sizes']['dim']}, " + (f"{m['sizes']['layers']} layers, seq {m['sizes']['seq']}"
                                                             f", batch {m['sizes']['batch']}" if "layers" in m['sizes']
                                                             else f"{m['sizes']['tokens']} tokens")
                          for n, m in result["models"].items() if "sizes" in m) + "."]
    tlines = []
    for name, entry in result["models"].items():
        if name in TORCH_MODELS and "runs" in entry:
            tlines += [f"| {name} | {what} | " + ("n/a" if value is None else (f"{value:.3g}" if isinstance(
                value, float) else str(value))) + f" | {goal} | {'' if met is None else ('met' if met else 'MISSED')} |"
                       for what, value, goal, met in targets(entry)]
    if tlines:
        lines += ["", "Issue 61's targets (stated for gpt2):", "", "| model | target | value | goal | |",
                  "|---|---|---|---|---|"] + tlines
    if notes:
        lines += ["", "Notes:", ""] + notes
    if errors:
        lines += ["", "Runs that failed:", ""] + errors
    return "\n".join(lines) + "\n"


def write(result, results_dir, slug):
    R.write_suite(result, SUITE, markdown(result), results_dir, slug)


# ---------------------------------------------------------------------------------------- README
BEGIN, END = ("<!-- train-fp32:begin (generated by `python bench.py --readme`; do not edit) -->",
              "<!-- train-fp32:end -->")


#: the README's two rows: (label, cupyffn rows eager and compiled, the row whose loss distance is shown, the row
#: whose MLP weight gradients' error is shown); jax-mlp's rows are jitted (its "compiled" column)
README_ROWS = (("fp16+fp8 / torch strict: eager, compiled; its loss distance, MLP grads vs float64",
                ("cupyffn fp16+fp8", "cupyffn fp16+fp8 + torch.compile"), "cupyffn fp16+fp8", "cupyffn fp16+fp8"),
               ("tf32 / torch TF32: eager, compiled; torch TF32's loss distance, tf32's MLP grads",
                ("cupyffn tf32", "cupyffn tf32 + torch.compile"), "torch TF32", "cupyffn tf32"))
_JAX_README = {"cupyffn fp16+fp8 + torch.compile": "cupyffn fp16+fp8", "cupyffn tf32 + torch.compile": "cupyffn tf32",
               "torch TF32": "jax.jit default"}


def _readme_cell(entry, jax, speeds, distance, grads):
    def row(name):
        return _JAX_README.get(name, name) if jax else name

    ratios = [None if jax and name in ("cupyffn fp16+fp8", "cupyffn tf32") else entry["speedup_vs_twin"].get(row(name))
              for name in speeds]
    runs = entry["runs"]
    dist = runs.get(row(distance), {}).get("loss_distance")
    grad = (runs.get(row(grads), {}).get("grad_error") or {}).get("mlp_weights")
    return (", ".join("-" if v is None else f"{v:.2f}x" for v in ratios) + "; " + _num(dist, ".1e", "-") + ", "
            + _num(grad, ".1e", "-"))


def readme_section(result):
    """The README's summary of a train-fp32 run (None: none recorded yet): one column per model, two rows (the
    README's room is counted: tests/test_bench_training_fp32.py)."""
    if result is None:
        return ("No float32 training run is recorded yet: `python bench.py --suite train-fp32 --paired` writes "
                "`results/train-fp32-<gpu>.md`.\n")
    models = [(n, e) for n, e in result["models"].items() if "runs" in e]
    env = result["env"]
    head = (f"{env['device']}, {result['date'][:10]}, commit {str(result['git_commit'])[:7]}, {result['steps']} "
            f"steps; cupyffn over torch")
    lines = ["| " + head + " | " + " | ".join(n for n, _ in models) + " |", "|---" * (len(models) + 1) + "|"]
    for label, speeds, distance, grads in README_ROWS:
        lines.append(f"| {label} | " + " | ".join(_readme_cell(e, n == JAX_MODEL, speeds, distance, grads)
                                                  for n, e in models) + " |")
    return "\n".join(lines) + "\n"


def newest(results_dir):
    """The train-fp32 run the README shows: the last results/train-fp32-*.json by name, or None."""
    import json
    from pathlib import Path

    runs = sorted(Path(results_dir).glob(f"{SUITE}-*.json"))
    return json.loads(runs[-1].read_text()) if runs else None


# ---------------------------------------------------------------------------------------- the suite
def run_suite(args, cupy):
    import torch

    from . import training_jax
    from .gpu import environment, git_commit

    started = time.perf_counter()
    steps = args.steps
    models = {}
    for name in args.models or MODELS:
        say = (lambda line: print(line, flush=True))
        try:  # a model that fails outside its rows (building it, JAX starting) is recorded; the others still run
            if name == JAX_MODEL:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # what torch's caching allocator holds, back for XLA and CuPy
                entry = training_jax.run(steps, "cuda", paired=args.paired, say=say)
            else:
                entry = run_model(name, steps, "cuda", paired=args.paired, keep_going=True, say=say)
        except Exception as e:
            entry = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000]}
        models[name] = summarize(entry) if "runs" in entry else entry
        print(f"{name}: " + (f"skipped ({entry['skipped']})" if "skipped" in entry else f"failed ({entry['error']})"
                             if "error" in entry else ", ".join(
            f"{n} " + ("failed" if "error" in e else f"{e['median_step_ms']:.2f} ms") for n, e in entry["runs"].items())),
            flush=True)
    return {"suite": SUITE, "env": environment(cupy, torch), "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench.py " + " ".join(sys.argv[1:]), "steps": steps, "paired": args.paired,
            "models": models, "wall_s": round(time.perf_counter() - started, 1)}
