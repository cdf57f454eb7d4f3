"""No GPU: the NumPy backend on reduced sizes, to smoke-test the harness (not cupyffn's GPU speed).

Every bench.py flag is either honoured here or refused before anything runs (`refused`; bench.py exits with
status 2), never silently ignored:

- honoured: --quick (fewer sizes), --rounds (check rounds of freshly seeded inputs per size), --iters and
  --warmup (timed and warm-up calls; defaults 3 and 0 here, where one call takes up to ~0.6 s), --impls
  (fnmatch patterns over the cupyffn-<precision> names), --json (the run's results as JSON), --no-write
  (nothing else is ever written by this run), --timer auto (host wall time, time.perf_counter);
- refused: --compile, --loop, --loop-only, --loop-calls and --timer events, which measure GPU work only, and
  --impls patterns that match no implementation the CPU has (PyTorch, plain CuPy and cupyffn's variant
  builds run on a GPU only).

Numbers from here are CPU numbers for the harness, never a substitute for the benchmark.
"""

import datetime
import fnmatch
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy

import cupyffn
from cupyffn import workloads as W

DIM, HIDDEN = 256, 1024
TOKENS = (64, 256, 1024)
QUICK_TOKENS = (64, 256)
ITERS, WARMUP = 3, 0  # the CPU's defaults of --iters / --warmup (the GPU's 50 and 10 would take minutes here)
FORMAT = "cupyffn-cpu-smoke-1"


# The instruction-set flags of /proc/cpuinfo that decide a CPU's GEMM and elementwise speed (vector width, fused
# multiply-add, bf16 / fp16 arithmetic, AMX tiles): CPU figures depend on them, so results files record them.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16", "amx_int8", "asimd", "sve", "sve2")


def host_cpu(cpuinfo="/proc/cpuinfo"):
    """The host's CPU for a results file: {"model", "vendor", "cpuid" (family / model / stepping), "isa" (the
    ISA_FLAGS it has), "virtual" (a hypervisor's guest), "cores", "machine"}.

    From /proc/cpuinfo (Linux) where it is readable; elsewhere the model is platform.processor()'s and the fields
    /proc/cpuinfo would give are None (unknown, not empty).
    """
    fields = {}
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())  # the first processor's entry
    flags = set(fields["flags"].split()) if "flags" in fields else (
        set(fields["features"].split()) if "features" in fields else None)
    cpuid = None
    if all(k in fields for k in ("cpu family", "model", "stepping")):
        cpuid = f"family {fields['cpu family']} model {fields['model']} stepping {fields['stepping']}"
    return {"model": fields.get("model name") or platform.processor() or None,
            "vendor": fields.get("vendor_id"), "cpuid": cpuid,
            "isa": None if flags is None else [f for f in ISA_FLAGS if f in flags],
            "virtual": None if flags is None else "hypervisor" in flags,
            "cores": os.cpu_count(), "machine": platform.machine()}


def implementations():
    """What the CPU run can time: cupyffn's NumPy backend in each precision."""
    return [f"cupyffn-{p}" for p in cupyffn.PRECISIONS]


def _patterns(impls):
    return [p.strip() for p in (impls or "").split(",") if p.strip()]


def refused(args):
    """One message per flag of `args` that the CPU run cannot honour (empty: it can run as asked).

    `args.given` (bench.parse_args) names the options given on the command line; without it only
    non-default values count as given.
    """
    given = getattr(args, "given", None)
    messages = []
    if args.compile:
        messages.append("--compile: the torch.compile baselines are timed on a GPU only")
    for flag, on in (("--loop", args.loop), ("--loop-only", args.loop_only)):
        if on:
            messages.append(f"{flag}: the loop mode measures host time per GPU call and CUDA graph replay, "
                            f"which the CPU run has neither of")
    if (given is not None and "loop_calls" in given) or (given is None and args.loop_calls != 50):
        messages.append("--loop-calls: it sets the GPU loop mode's calls (--loop), which the CPU run does not have")
    if args.timer != "auto":
        messages.append(f"--timer {args.timer}: CUDA events time GPU work; the CPU run times each call on the host "
                        "(time.perf_counter)")
    names = implementations()
    for pattern in _patterns(args.impls):
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            messages.append(f"--impls: {pattern!r} matches none of the CPU run's implementations "
                            f"({', '.join(names)}); PyTorch, plain CuPy and cupyffn's variant builds run on a "
                            f"GPU only")
    return messages


def _selected(args):
    patterns = _patterns(args.impls)
    names = implementations()
    if not patterns:
        return names
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _option(args, name, default):
    """args.<name> where it was given on the command line, else the CPU's default."""
    given = getattr(args, "given", None)
    if given is None:  # a hand-made Namespace (tests): take what it says
        return getattr(args, name)
    return getattr(args, name) if name in given else default


def _nan_outputs(T):
    return (numpy.full((T, DIM), numpy.nan, numpy.float32), numpy.full((HIDDEN, DIM), numpy.nan, numpy.float32),
            numpy.full((DIM, HIDDEN), numpy.nan, numpy.float32))


def run_cpu(args, reason=None):
    """The smoke run; returns bench.py's exit status (2 when a flag is refused, else 0)."""
    problems = refused(args)
    if problems:
        for p in problems:
            print(f"bench.py: {p}", file=sys.stderr)
        print(f"bench.py: refused, as there is no usable GPU here: {reason or 'none found'}. Without these flags "
              f"bench.py runs its CPU smoke test.", file=sys.stderr)
        return 2
    names = _selected(args)
    iters, warmup = _option(args, "iters", ITERS), _option(args, "warmup", WARMUP)
    tokens = QUICK_TOKENS if args.quick else TOKENS
    print("=" * 78)
    if reason:
        print(reason)
    print(f"This is NOT the benchmark: cupyffn's NumPy backend on REDUCED sizes (D={DIM}, H={HIDDEN}).")
    print("These are CPU numbers for smoke-testing the harness, not cupyffn's GPU performance.")
    print("The check uses the max_atol of the nearest official T (these shapes have no official one).")
    print(f"{args.rounds} check round(s) of fresh inputs per size; {warmup} warm-up + {iters} timed call(s), median.")
    print("=" * 78)
    sizes = []
    for T in tokens:
        atol = W.max_atol(T, nearest=True)
        print(f"\n## T={T} D={DIM} H={HIDDEN} (atol {atol})")
        checks = {n: [] for n in names}
        timing_args = None
        for r in range(args.rounds):
            inputs = W.make_inputs((T,), DIM, HIDDEN, seed=T + 1_000_003 * r)  # round 0: the seed it always had
            call_args = [inputs[n] for n in W.INPUT_NAMES]
            timing_args = timing_args or call_args
            ref64 = W.reference(inputs)
            ref32 = W.reference(inputs, dtype=numpy.float32)
            for n in names:
                out = _nan_outputs(T)  # NaN first: an output the call does not write fails the check
                cupyffn.gelu_ffn_backward(*call_args, precision=n[len("cupyffn-"):], out=out)
                checks[n].append([W.check(o, r32, r64, atol=atol) for o, r32, r64 in zip(out, ref32, ref64)])
        rows = {}
        for n in names:
            precision = n[len("cupyffn-"):]
            out = _nan_outputs(T)
            times = []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                cupyffn.gelu_ffn_backward(*timing_args, precision=precision, out=out)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            passed = sum(all(c.passed for c in cs) for cs in checks[n])
            every = [c for cs in checks[n] for c in cs]
            row = {"precision": precision, "median_ms": statistics.median(times), "times_ms": times,
                   "rounds": args.rounds, "rounds_passed": passed, "passes": passed == args.rounds,
                   "max_err_over_atol": max(c.err_over_atol for c in every),
                   "least_matched": min(c.matched for c in every),
                   "max_rel_l2": max(c.rel_l2 for c in every)}
            rows[n] = row
            default = "  (CPU default)" if precision == cupyffn.CPU_DEFAULT_PRECISION else ""
            # The check passes an output with up to 1% of its elements outside atol + rtol |ref|: the worst element
            # may exceed atol (|err|/atol > 1) in a passing round, so the line says which fraction was inside.
            print(f"{n:17s} {row['median_ms']:9.2f} ms  check {'PASS' if row['passes'] else 'FAIL'} "
                  f"{passed}/{args.rounds} (within tolerance: {_percent(row['least_matched'])} of the elements "
                  f"at worst, {_percent(W.REQUIRED_MATCH)} needed; worst element |err|/atol "
                  f"{row['max_err_over_atol']:.3f})  max rel L2 {row['max_rel_l2']:.2e}{default}")
        sizes.append({"tokens": T, "dim": DIM, "hidden_dim": HIDDEN, "atol": atol, "results": rows})
    if args.json:
        result = {"format": FORMAT, "device": "cpu", "gpu_unavailable": reason,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["python", "bench.py"] + sys.argv[1:]),
                  "env": {"cupyffn": cupyffn.__version__, "numpy": numpy.__version__,
                          "python": platform.python_version(), "machine": platform.machine(),
                          "cpu": host_cpu()},
                  "protocol": {"timing": "host wall time (time.perf_counter), median", "warmup": warmup,
                               "iters": iters, "rounds": args.rounds, "quick": bool(args.quick),
                               "implementations": names,
                               "check": "benchmark (cupyffn.workloads.check), max_atol of the nearest official T"},
                  "sizes": sizes}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _percent(fraction):
    """A matched fraction as a percentage that never rounds up to a pass: 0.98996 is 98.99%, not 99.00%."""
    return f"{math.floor(fraction * 10000) / 100:.2f}%"
