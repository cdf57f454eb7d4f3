"""``bench.py --suite train-bf16``: whole training steps of two models under bf16 autocast, torch against cupyffn.

examples/train_gpt2.py's comparison, run for both of its models at their default (GPU) sizes: a transformers GPT-2
from a config (dim 1536, hidden 6144, 4 layers, seq 256, batch 8: T = 2048 tokens per MLP call) and an SD3.5-shaped
stack of residual MLP blocks (diffusers' FeedForward when diffusers is installed, else the equivalent
nn.Sequential). Each model is trained three times from the same initial weights on the same synthetic batches:
torch eager, torch.compile of it, and a clone whose MLPs ``cupyffn.torch.replace_mlps`` swapped. A step is AdamW's
forward + backward + optimizer step, timed by CUDA events around the whole step with the host synchronized after
it (host work included); the median over the steps after the fifth is reported, with the final losses (mean of
the last fifth of the steps) and whether cupyffn's agrees with eager torch's (the example's tolerance); torch.compile's
ratio to eager is the spread two torch implementations of the same model show.
"""

import datetime
import importlib.util
import inspect
import sys
import time

from . import report as R
from .gpu import environment, git_commit

SUITE = "train-bf16"
RUNS = ("torch eager", "torch.compile", "cupyffn")


def _example():
    path = R.ROOT / "examples" / "train_gpt2.py"
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_gpt2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_suite(args, cupy, steps=300):
    import torch

    example = _example()
    started = time.perf_counter()
    models = {}
    for model in ("gpt2", "sd35"):
        models[model] = summarize(example.main(model, steps=steps, device="cuda", compile=True))
        print(f"{model}: " + ", ".join(f"{n} {e['median_step_ms']:.2f} ms" for n, e in models[model]["runs"].items())
              + f"; final loss ratio {models[model]['final_loss_ratio']:.4f}, agree {models[model]['agree']}",
              flush=True)
    return {"suite": SUITE, "env": environment(cupy, torch), "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench.py " + " ".join(sys.argv[1:]), "steps": steps,
            "tolerance": inspect.signature(example.main).parameters["tolerance"].default, "models": models,
            "wall_s": round(time.perf_counter() - started, 1)}


def summarize(r):
    """One model's entry of the results from examples/train_gpt2.py's main() output `r`."""
    runs = {n: {"median_step_ms": r[n]["median_step_ms"], "final_loss": r[n]["final_loss"],
                "losses": r[n]["losses"]} for n in RUNS if n in r}
    mine = runs["cupyffn"]["median_step_ms"]
    return {"runs": runs, "final_loss_ratio": r["final_loss_ratio"], "agree": r["agree"], "learned": r["learned"],
            "step_speedup": {n: e["median_step_ms"] / mine for n, e in runs.items() if n != "cupyffn"},
            "final_loss_vs_eager": {n: e["final_loss"] / runs["torch eager"]["final_loss"] for n, e in runs.items()}}


def markdown(result):
    env = result["env"]
    lines = [f"# {SUITE}: training steps under bf16 autocast, torch against cupyffn's MLPs, {env['device']}", "",
             f"{result['date'][:10]}, commit {str(result['git_commit'])[:7]}, CuPy {env['cupy']}, torch "
             f"{env['torch']}: `{result['command']}` ({result['steps']} AdamW steps per run; benchmarks/training.py "
             "says what is timed).", "",
             "| model | torch eager ms/step | torch.compile ms/step | cupyffn ms/step | cupyffn vs eager | "
             "cupyffn vs compile | final loss cupyffn / eager | final loss compile / eager | agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        runs, up = m["runs"], m["step_speedup"]
        cell = lambda n, v, f: f.format(v) if n in runs else "n/a"  # noqa: E731
        lines.append(f"| {name} | " + " | ".join(cell(n, runs.get(n, {}).get("median_step_ms"), "{:.2f}")
                                                 for n in RUNS)
                     + f" | {cell('torch eager', up.get('torch eager'), '{:.2f}x')} | "
                     f"{cell('torch.compile', up.get('torch.compile'), '{:.2f}x')} | "
                     f"{m['final_loss_ratio']:.4f} | "
                     f"{cell('torch.compile', m['final_loss_vs_eager'].get('torch.compile'), '{:.4f}')} | "
                     f"{m['agree']} (tolerance {result['tolerance']}) |")
    return "\n".join(lines) + "\n"


def write(result, results_dir, slug):
    R.write_suite(result, SUITE, markdown(result), results_dir, slug)
