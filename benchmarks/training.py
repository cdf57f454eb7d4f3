"""``bench.py --suite train-bf16``: whole training steps of three models under bf16 autocast, torch against cupyffn.

examples/train_gpt2.py's comparison (its PRESETS), run for: a transformers GPT-2 from a config at SD3.5's MLP shape
("gpt2": dim 1536, hidden 6144, 4 layers, seq 256, batch 8: T = 2048 tokens per MLP call), GPT-2 medium's width
("gpt2-medium": dim 1024, hidden 4096, 24 layers where GPU memory allows, fewer with a printed note otherwise,
seq 1024, batch 8: T = 8192), and an SD3.5-shaped stack of residual MLP blocks ("sd35": diffusers' FeedForward when
diffusers is installed, else the equivalent nn.Sequential; dim 1536, 4 layers). Each model is trained six times from
the same initial weights on the same synthetic batches (the example's RUNS): torch eager, and a clone whose MLPs
``cupyffn.torch.replace_mlps`` swapped; each of the two also under torch.compile (default mode) and under
torch.compile(mode="reduce-overhead") (CUDA graphs), the two compiled through the same call. A step is AdamW's
forward + backward + optimizer step, timed by CUDA events around the whole step with the host synchronized after
it (host work included); the median over the steps after the fifth is reported, with each run's final loss (mean
of the last fifth of the steps) against eager torch's and whether it agrees (the example's tolerance); the plain
compiled runs' ratios to eager are the spread torch implementations of the same model show. A run that raises is
recorded with its error, and the suite goes on. The runs go one after the other, or with --paired each plain run
beside its swapped twin, their steps alternating in one process: the twins then see the same state of the host and
the GPU, and each swapped run's ratio to its twin is also taken step by step (the median of the per-step ratios),
which a host-bound model's run-to-run spread does not move.
"""

import datetime
import importlib.util
import inspect
import sys
import time

from . import report as R
from .gpu import environment, git_commit

SUITE = "train-bf16"
MODELS = ("gpt2", "gpt2-medium", "sd35")  # examples/train_gpt2.py PRESETS


def _example():
    path = R.ROOT / "examples" / "train_gpt2.py"
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_gpt2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_suite(args, cupy):
    import torch

    example = _example()
    started = time.perf_counter()
    models, steps = {}, args.steps
    for model in args.models or MODELS:
        entry = summarize(example.main(model, steps=steps, device="cuda", compile=True, keep_going=True,
                                       compiled=args.compiled, paired=args.paired), example)
        models[model] = entry
        print(f"{model}: " + ", ".join(f"{n} " + ("failed" if "error" in e else f"{e['median_step_ms']:.2f} ms")
                                       for n, e in entry["runs"].items())
              + f"; final loss ratio cupyffn / eager {entry['final_loss_ratio']}, agree {entry['agree']}", flush=True)
    return {"suite": SUITE, "env": environment(cupy, torch), "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench.py " + " ".join(sys.argv[1:]), "steps": steps,
            "tolerance": inspect.signature(example.main).parameters["tolerance"].default, "models": models,
            "compiled": args.compiled, "paired": args.paired,
            "wall_s": round(time.perf_counter() - started, 1)}


def summarize(r, example=None):
    """One model's entry of the results from examples/train_gpt2.py's main() output `r` (`example`: that module,
    loaded here when not given)."""
    example = example or _example()
    keys = ("median_step_ms", "paired_speedup_vs_twin", "final_loss", "final_loss_vs_eager", "agree", "graph_breaks",
            "losses", "error")
    runs = {n: {k: r[n][k] for k in keys if k in r[n]} for n, _, _ in example.RUNS if n in r}
    timed = {n: e["median_step_ms"] for n, e in runs.items() if "median_step_ms" in e}
    return {"sizes": r["sizes"], "runs": runs, "final_loss_ratio": r["final_loss_ratio"], "agree": r["agree"],
            "learned": r["learned"],
            # torch eager's step time over each run's; each cupyffn run's twin's step time over its own
            "speedup_vs_eager": {n: timed["torch eager"] / ms for n, ms in timed.items() if "torch eager" in timed},
            "speedup_vs_twin": {n: timed[t] / timed[n] for n, t in example.TWINS.items() if n in timed and t in timed},
            # --paired: the median of the per-step ratios of the same two runs
            "paired_speedup_vs_twin": {n: e["paired_speedup_vs_twin"] for n, e in runs.items()
                                       if "paired_speedup_vs_twin" in e}}


def _cell(text):
    return text.replace("|", "\\|")


#: what a swapped model's compiled runs ran (replace_mlps' `compiled`; runs before the option ran the operators)
_COMPILED_NOTE = {"module": "the MLP modules' own forward (replace_mlps' default compiled=\"module\"), as the plain "
                            "model.",
                  "cupyffn": "cupyffn's operators (replace_mlps(compiled=\"cupyffn\"))."}


def markdown(result):
    env = result["env"]
    lines = [f"# {SUITE}: training steps under bf16 autocast, torch against cupyffn's MLPs, {env['device']}", "",
             f"{result['date'][:10]}, commit {str(result['git_commit'])[:7]}, CuPy {env['cupy']}, torch "
             f"{env['torch']}: `{result['command']}` ({result['steps']} AdamW steps per run; benchmarks/training.py "
             "says what is timed). Compiled swapped runs: " + _COMPILED_NOTE.get(result.get("compiled", "cupyffn"))
             + (" Paired: each plain run and its swapped twin trained side by side, steps alternating; the twin "
                "column gives the ratio of the medians, then the median of the per-step ratios."
                if result.get("paired") else ""),
             "", "| model | run | ms/step | torch eager / this | cupyffn vs its torch twin | final loss / eager's | "
             "agree | graph breaks |",
             "|---|---|---|---|---|---|---|---|"]
    errors = []
    for name, m in result["models"].items():
        for run, e in m["runs"].items():
            if "error" in e:
                errors.append(f"- {name}, {run}: {_cell(e['error'])}")
                lines.append(f"| {name} | {run} | failed ({len(errors)}) | | | | | |")
                continue
            up, twin, ratio = (m["speedup_vs_eager"].get(run), m["speedup_vs_twin"].get(run),
                               e.get("final_loss_vs_eager"))
            step_by_step = m.get("paired_speedup_vs_twin", {}).get(run)
            lines.append(f"| {name} | {run} | {e['median_step_ms']:.2f} | " + ("n/a" if up is None else f"{up:.2f}x")
                         + " | " + ("" if twin is None else f"{twin:.2f}x")
                         + ("" if step_by_step is None else f" (step by step {step_by_step:.2f}x)") + " | "
                         + ("n/a" if ratio is None else f"{ratio:.4f}") + " | "
                         + f"{e.get('agree', 'n/a')} | {e.get('graph_breaks', '')} |")
    lines += ["", f"Agree: the final loss within {result['tolerance']} (relative) of torch eager's. Sizes (hidden = 4 "
              "dim): " + "; ".join(f"{name} dim {m['sizes']['dim']}, {m['sizes']['layers']} layers, seq "
                                   f"{m['sizes']['seq']}, batch {m['sizes']['batch']}"
                                   for name, m in result["models"].items()) + "."]
    if errors:
        lines += ["", "Runs that failed:", ""] + errors
    return "\n".join(lines) + "\n"


def write(result, results_dir, slug):
    R.write_suite(result, SUITE, markdown(result), results_dir, slug)
