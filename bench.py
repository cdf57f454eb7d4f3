#!/usr/bin/env python
"""cupyffn benchmark: every precision side by side with PyTorch and plain CuPy, on the 16 official workloads,
measured the way SOL-ExecBench measures L2/068.

    python bench.py                      # all workloads; writes results/<gpu>.json, .md and .png
    python bench.py --compile --rounds 10   # the full run (adds the torch.compile baselines)
    python bench.py --quick --rounds 2   # a subset, for a quick look
    python bench.py --impls 'cupyffn-*,torch-tf32'   # only some implementations (fnmatch patterns)
    python bench.py --loop               # also the steady-state loop (host time per call, graph replay)
    python bench.py --host-only --no-write   # only the loop mode's host-time table (CuPy arrays, torch tensors, layer)
    python bench.py --timer events --rounds 1 --json /tmp/events.json   # CUDA-event timing, for comparison
    python bench.py --timer events-idle --rounds 1 --no-write   # events from an idle GPU: the host's part counts
    python bench.py --suite sd35-bf16 --compile   # SD3.5's MLP with biases, bf16 autocast, vs torch eager/compile
    python bench.py --suite train-bf16            # whole training steps of GPT-2s / an SD3.5 stack, torch vs cupyffn
    python bench.py --suite train-fp32 --paired   # the same in float32 (no autocast), each precision, and a JAX loop
    python bench.py --readme             # regenerate README.md's tables from results/*.json (no GPU needed)
    python bench.py --readme --no-write  # only show what that would change (a diff), writing nothing

Correctness: per workload, --rounds rounds of freshly seeded inputs for every implementation, each
output NaN-poisoned before the call (where the call writes into given buffers) and judged by the
benchmark's own check (cupyffn.workloads.check: per-workload max_atol, 99% of the elements, no
NaN/Inf) against the plain-fp32 reference, plus the relative L2 error against float64. A mode
passes the benchmark only when every workload passes in every round.
Timing (benchmarks/protocol.py): 10 warm-up + 50 timed iterations, median; before each the L2 is
flushed and the inputs come from another of 3 input sets (other addresses); CUPTI kernel span when
`cupti-python` imports, CUDA events otherwise (the results name the method); --timer events-idle
synchronizes before each call, so the time includes the host's work before the first kernel.
Summary (benchmarks/report.py): mean and geomean per implementation, % of SOL the leaderboard's way,
SOL scores and the headline comparison.

Without a GPU, bench.py runs a smoke test of cupyffn's NumPy backend on reduced sizes instead (a banner
says why and that these are not the benchmark's numbers; benchmarks/cpu.py). There --quick, --rounds,
--iters, --warmup (defaults 3 and 0 on the CPU), --impls (cupyffn-<precision> names), --json and
--no-write apply; --compile, --loop, --loop-only, --host-only, --loop-calls and --timer events / events-idle measure GPU work
and are refused with exit status 2, as is an --impls pattern that matches only GPU implementations.
"""

import argparse
import os
import sys

from benchmarks.report import newest_results, readme_sections, render_readme  # noqa: F401 (tests use them)
from benchmarks import report as R


def _parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="only B2xS128, B1xS1024, B8xS613, B4xS2048 (on the CPU: T = 64 and 256)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile(max-autotune-no-cudagraphs) baselines, fp32 and TF32")
    parser.add_argument("--rounds", type=int, default=3, help="check rounds of fresh inputs per workload (default 3)")
    parser.add_argument("--impls", default=None, help="comma-separated fnmatch patterns of implementations to run")
    parser.add_argument("--timer", choices=("auto", "events", "events-idle"), default="auto",
                        help="auto: CUPTI when cupti-python imports, else CUDA events (on the CPU: host wall time); "
                             "events-idle: CUDA events with the GPU idle before each call, so the host's part counts")
    parser.add_argument("--iters", type=int, default=50,
                        help="timed calls per implementation and workload, median reported (default 50; 3 on the CPU)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed calls before them (default 10; 0 on the CPU)")
    parser.add_argument("--loop", action="store_true", help="also the steady-state loop mode (host overhead, graphs)")
    parser.add_argument("--loop-only", action="store_true", help="only the loop mode")
    parser.add_argument("--host-only", action="store_true",
                        help="only the loop mode's host-time table: host us per call of the functional API on CuPy "
                             "arrays and on torch tensors, the torch layer's backward and torch eager's, T = 256 and "
                             "8192 (implies --loop-only; refused on the CPU)")
    parser.add_argument("--loop-calls", type=int, default=50,
                        help="calls per measurement of the loop mode (default 50)")
    parser.add_argument("--no-write", action="store_true",
                        help="do not write results/ (with --readme: nor README.md; print what would change)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the run's results JSON to PATH instead of results/ (e.g. a comparison run)")
    parser.add_argument("--readme", action="store_true", help="regenerate README.md from results/ and exit")
    parser.add_argument("--suite", choices=("official", "sd35-bf16", "train-bf16", "train-fp32"), default="official",
                        help="official: the benchmark's fp32 block (default); sd35-bf16: SD3.5's MLP with biases under "
                             "bf16 autocast, cupyffn's layer against torch eager (with --compile: both also under "
                             "torch.compile) (benchmarks/sd35.py; needs torch; writes results/sd35-bf16-<gpu>.json and "
                             ".md); train-bf16: training steps of examples/train_gpt2.py's GPT-2 (SD3.5's MLP shape), "
                             "GPT-2 medium's width and SD3.5 stack, torch and cupyffn's MLPs, each eager, under "
                             "torch.compile and under torch.compile reduce-overhead (benchmarks/training.py; needs "
                             "torch and transformers; results/train-bf16-<gpu>.*); train-fp32: the same models in "
                             "float32 (no autocast), torch strict and TF32 against cupyffn fp16+fp8, tf32 and ieee, "
                             "each step's loss against torch strict's and the first step's gradients against "
                             "float64, and jax-mlp, a jitted JAX loop (benchmarks/training_fp32.py; "
                             "results/train-fp32-<gpu>.*)")
    parser.add_argument("--models", nargs="+", choices=("gpt2", "gpt2-medium", "sd35", "jax-mlp"), default=None,
                        help="train-bf16, train-fp32: the models to train (default: all; jax-mlp: train-fp32's JAX "
                             "loop)")
    parser.add_argument("--steps", type=int, default=None,
                        help="train-bf16, train-fp32: steps per run (default 300 and 40)")
    parser.add_argument("--compiled", choices=("module", "cupyffn"), default="module",
                        help="train-bf16: what the swapped MLPs run under torch.compile (replace_mlps' compiled=): "
                             "the module's own forward (default) or cupyffn's operators")
    parser.add_argument("--paired", action="store_true",
                        help="train-bf16, train-fp32: each plain run beside its swapped twins, their steps in turn "
                             "in one process, the ratio also taken step by step (default: one run after the other)")
    return parser


def parse_args(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    # Which options were given on the command line (not left at their defaults): the CPU run refuses GPU-only
    # ones even when given with their default value, and uses its own defaults for the others. argparse fills
    # in a default only where the namespace lacks the attribute, so a namespace preset to a marker keeps the
    # marker exactly where nothing was given.
    unset = object()
    seen = parser.parse_args(argv, argparse.Namespace(**{name: unset for name in vars(args)}))
    args.given = frozenset(name for name, value in vars(seen).items() if value is not unset)
    training = ("train-bf16", "train-fp32")
    if args.suite not in training and args.given & {"models", "steps", "compiled", "paired"}:
        parser.error("--models, --steps and --paired are options of --suite train-bf16 and train-fp32, --compiled "
                     "of train-bf16")
    if args.suite == "train-fp32" and "compiled" in args.given:
        parser.error("--compiled is an option of --suite train-bf16 (float32 activations always run cupyffn's "
                     "operators under torch.compile)")
    if args.suite == "train-bf16" and "jax-mlp" in (args.models or ()):
        parser.error("--models jax-mlp is a model of --suite train-fp32")
    if args.steps is None:
        from benchmarks import training_fp32

        args.steps = training_fp32.STEPS if args.suite == "train-fp32" else 300
    if args.steps < 25:
        parser.error("--steps must be >= 25 (the median is taken after the fifth step, the loss over the last fifth)")
    for name in ("rounds", "iters", "warmup", "loop_calls"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if args.host_only:  # a part of the loop mode: the CPU run refuses it as it refuses --loop-only
        args.loop_only = True
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.readme:
        old = R.README.read_text()
        new = render_readme(old)
        if args.no_write:  # nothing written: what the regeneration would change, as a diff
            import difflib

            diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "README.md",
                                                "README.md regenerated"))
            sys.stdout.write(diff or f"README.md is up to date with {R.RESULTS}\n")
            return 0
        full, _ = newest_results()
        if full is not None:
            R.plot(full, R.RESULTS / (R.slug(full["env"]["device"]) + ".png"))
        R.README.write_text(new)
        print(f"README.md regenerated from {R.RESULTS}")
        return 0
    if os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        print("CUPY_TF32 is set: the plain-fp32 reference would use TF32. Unset it.", file=sys.stderr)
        return 2
    from benchmarks import gpu

    cupy, reason = gpu.gpu_or_reason()
    if cupy is None:
        from benchmarks.cpu import run_cpu

        if args.suite != "official":
            print(f"bench.py: --suite {args.suite} times GPU work against torch on the GPU ({reason})", file=sys.stderr)
            return 2

        if args.host_only:
            print("bench.py: --host-only: the host-time table times GPU calls; it is a part of the loop mode "
                  "(--loop-only)", file=sys.stderr)
        return run_cpu(args, reason)
    if args.suite in ("sd35-bf16", "train-bf16", "train-fp32"):
        from benchmarks import sd35, training, training_fp32

        suite = {"sd35-bf16": sd35, "train-bf16": training, "train-fp32": training_fp32}[args.suite]
        result = suite.run_suite(args, cupy)
        if args.json:
            import json
            from pathlib import Path

            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        elif not args.no_write:
            suite.write(result, R.RESULTS, R.slug)
        return 0
    result = None if args.loop_only else gpu.run_gpu(args, cupy)
    loop = None
    if args.loop or args.loop_only:
        from benchmarks.loop import run_loop

        loop = run_loop(args, cupy)
        loop["device"] = (result["env"]["device"] if result is not None
                          else gpu.environment(cupy, None)["device"])
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps({"full": result, "loop": loop}, indent=1) + "\n")
        print(f"wrote {args.json}")
    elif not args.no_write:
        R.write_results(result, loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
