"""The torch layer on the CPU against plain torch, in one process, steps interleaved (docs/performance.md, "The torch
layer on the CPU"; docs/decisions/059-torch-cpu-route.md):

    python -m benchmarks.torch_cpu                       # both parts, default thread settings
    python -m benchmarks.torch_cpu --part gpt2 --steps 100 --json out.json

* layer: ``GeluFFN`` forward + backward against ``nn.Sequential(Linear, GELU("tanh"), Linear)`` holding the same
  Parameters, in float32 (precision "ieee", the CPU's default) and under bf16 autocast; T = 2048, dim 256, hidden 1024;
* gpt2: one training step of ``examples/train_gpt2.py --small`` (a transformers GPT-2 of dim 64, bf16 autocast,
  AdamW, clipping) with its MLPs swapped by ``replace_mlps``, against the plain model, eager and under
  ``torch.compile`` (default mode).

The two sides of a row alternate step by step (a busy host slows both alike) and each reports its median; the
ratio is cupyffn's over torch's. Not the benchmark (bench.py): a CPU measurement of the torch layer.
"""

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy
import torch

import cupyffn.torch as ct

from .cpu import host_cpu
from .gpu import git_commit

ROOT = Path(__file__).resolve().parent.parent
LAYER = dict(tokens=2048, dim=256, hidden=1024)
GPT2_SMALL = dict(dim=64, layers=2, heads=2, vocab=64, seq=32, batch=4)  # train_gpt2.py --small


def interleaved(steps, warmup, **fns):
    """{name: median seconds} of the callables in `fns`, called in turn (the order flipped every round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    order = list(fns.items())
    for i in range(steps):
        for name, fn in (order if i % 2 else order[::-1]):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_rows(steps, warmup, tokens=LAYER["tokens"], dim=LAYER["dim"], hidden=LAYER["hidden"]):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(hidden, dim))
    ffn = ct.GeluFFN.from_linears(plain[0], plain[2])
    x = torch.randn(tokens, dim, requires_grad=True)
    r = torch.randn(tokens, dim)
    rows = []
    for label, dtype in (("float32", None), ("bf16 autocast", torch.bfloat16)):
        def step(module, dtype=dtype):
            x.grad = None
            for p in module.parameters():
                p.grad = None
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = module(x)
            y.backward(r.to(y.dtype))

        t = interleaved(steps, warmup, torch=lambda: step(plain), cupyffn=lambda: step(ffn))
        rows.append(dict(part="layer", row=f"T={tokens} dim={dim} hidden={hidden} {label}", **_times(t)))
    return rows


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt2", ROOT / "examples" / "train_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt2_rows(steps, warmup, sizes=GPT2_SMALL, modes=("eager", "torch.compile")):
    example = _example()
    plain = example.build("gpt2", sizes, "cpu")
    swapped = copy.deepcopy(plain)
    replaced, skipped = ct.replace_mlps(swapped)
    if len(replaced) != sizes["layers"] or skipped:
        raise RuntimeError(f"replace_mlps swapped {replaced}, left {skipped}")
    ids = next(example.batches("gpt2", 1, sizes["batch"], sizes["seq"], sizes["dim"], sizes["vocab"], "cpu"))
    rows = []
    for label in modes:
        compiled = label == "torch.compile"
        torch._dynamo.reset()
        models = {"torch": copy.deepcopy(plain), "cupyffn": copy.deepcopy(swapped)}
        steps_of = {}
        for name, model in models.items():
            run = torch.compile(model) if compiled else model
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

            def step(run=run, model=model, opt=opt):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = run(ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps_of[name] = step
        t = interleaved(steps, warmup, **steps_of)
        rows.append(dict(part="gpt2", row=f"train_gpt2.py --small step, {label}", **_times(t)))
    return rows


def _times(t):
    return dict(torch_ms=1e3 * t["torch"], cupyffn_ms=1e3 * t["cupyffn"], ratio=t["cupyffn"] / t["torch"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "layer", "gpt2"), default="all")
    p.add_argument("--steps", type=int, default=60, help="timed steps per side and row (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    rows = []
    if a.part in ("all", "layer"):
        rows += layer_rows(a.steps, a.warmup)
    if a.part in ("all", "gpt2"):
        rows += gpt2_rows(a.steps, a.warmup)
    cpu = host_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu['model']} ({cpu['cpuid']}; "
          f"{' '.join(cpu['isa'] or ['ISA unknown'])}; torch's kernels: {torch.backends.cpu.get_cpu_capability()})")
    for r in rows:
        print(f"{r['row']:48s} torch {r['torch_ms']:8.2f} ms   cupyffn {r['cupyffn_ms']:8.2f} ms   "
              f"ratio {r['ratio']:.2f}")
    if a.json:
        # The CPU's model and instruction set always go in: CPU figures depend on the host (performance.md 8).
        env = dict(torch=torch.__version__, numpy=numpy.__version__, python=platform.python_version(), cpu=cpu,
                   torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), cores=os.cpu_count(),
                   threads=torch.get_num_threads())
        Path(a.json).write_text(json.dumps(dict(
            command="python -m benchmarks.torch_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), git_commit=git_commit(),
            env=env, rows=rows), indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
