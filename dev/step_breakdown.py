"""Where a training step's time goes, the plain model against the one whose MLPs ``cupyffn.torch.replace_mlps``
swapped, both run alike (eager, torch.compile, or reduce-overhead) (GPU).

The step is examples/train_gpt2.py's (bf16 autocast, forward, loss, backward, gradient clipping at 1, AdamW, grads
set to None), on one fixed batch of the example's synthetic data, the plain model and the swapped clone from the
same initial weights. `--float32`: the float32 rows of ``bench.py --suite train-fp32`` instead (no autocast; per
mode torch strict beside cupyffn fp16+fp8, and torch with TF32 allowed beside cupyffn tf32; `--settings` picks). Per run: the median step (CUDA events around the step, the host synchronized after it, as the
example times it), then a few steps under torch.profiler: every GPU kernel's time, grouped (`GROUPS`: GEMMs,
cuBLAS's own reductions, attention, optimizer, copies and casts, cupyffn's own kernels, other elementwise and
reductions), the GPU's busy time (the union of kernel intervals, streams overlapped once) and the rest of the step
(host work the GPU waited for), per step; and the kernels that take the most time. `--gaps N`: the N longest
stretches in which no kernel ran, with the kernels around each (where the GPU idles inside a step); `--host N`: a
cProfile of N steps' host work.

    PYTHONPATH=. python dev/step_breakdown.py --model gpt2 --modes default eager --out $OUT/step-breakdown-gpt2.json
    PYTHONPATH=. python dev/step_breakdown.py --model gpt2 --float32 --modes eager default reduce-overhead

Models: examples/train_gpt2.py's PRESETS (gpt2, gpt2-medium, sd35); --layers, --seq and --batch override the
preset's depth and tokens (T = seq x batch).
"""

import argparse
import importlib.util
import os
import pathlib
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _json_out import save_json  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = {"eager": None, "default": "default", "reduce-overhead": "reduce-overhead"}
#: --float32's settings: torch's float32 matmuls strict or with TF32 allowed, and the cupyffn precision beside each
#: (benchmarks/training_fp32.py ROWS)
SETTINGS = {"strict": (False, "fp16+fp8"), "tf32": (True, "tf32")}
#: (group, substrings of a lower-cased kernel name), the first match wins; cupyffn's own kernels are found first by
#: name (`own_kernels`), and what matches nothing is "other elementwise and reductions".
GROUPS = (("cuBLAS reductions (bias gradient, split-K)", ("bgrad", "splitkreduce", "reduce_1block", "gemvx")),
          ("GEMMs (cuBLAS, cuBLASLt)", ("nvjet", "xmma", "gemm", "cutlass", "cublas")),
          ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
          ("optimizer and gradient clipping", ("multi_tensor", "adam", "foreach", "lpnorm")),
          ("copies and casts", ("copy", "cast", "convert", "to_half", "_to_")))
OWN = "cupyffn's own kernels"
OTHER = "other elementwise and reductions"


def own_kernels():
    """The names of the kernels in kernels_cu/ (cupyffn's NVRTC modules)."""
    names = set()
    for path in (ROOT / "kernels_cu").rglob("*.cu"):
        text = path.read_text()
        names.update(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?([A-Za-z_]\w*)", text))
    return names


def group_of(name, own):
    base = re.split(r"[<(]", name.split(" ")[-1] if name.startswith("void ") else name)[0]
    if base in own or any(k in name for k in own):
        return OWN
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return OTHER


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gpt2", help="examples/train_gpt2.py PRESETS name (default: %(default)s)")
    p.add_argument("--compiled", choices=("module", "cupyffn"), default="cupyffn",
                   help="replace_mlps' compiled= for the swapped model (default: %(default)s, the operators; "
                        "\"module\" compiles the plain model's code)")
    p.add_argument("--layers", type=int, default=None, help="layers instead of the preset's")
    p.add_argument("--seq", type=int, default=None, help="sequence length instead of the preset's")
    p.add_argument("--batch", type=int, default=None, help="batch instead of the preset's")
    p.add_argument("--float32", action="store_true",
                   help="float32 steps, no autocast (bench.py --suite train-fp32's rows): per mode and --settings "
                        "entry, torch's model beside cupyffn's (strict: fp16+fp8; tf32: tf32, torch with TF32 "
                        "allowed); --compiled does not apply (float32 always runs the operators)")
    p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=sorted(SETTINGS),
                   help="--float32: the settings to run (default: both)")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["default"],
                   help="how both models run (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default: %(default)s)")
    p.add_argument("--profiled", type=int, default=5, help="profiled steps per run (default: %(default)s)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per run (default: %(default)s)")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="also list the N longest stretches of the profiled steps in which the GPU ran no kernel")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="also profile N steps' host work with cProfile: the functions with the most own time")
    p.add_argument("--out", default=None,
                   help="JSON file (default: $OUT or results/, step-breakdown-<model>.json, -fp32.json with --float32)")
    args = p.parse_args(argv)
    for name in ("layers", "seq", "batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def runs_of(args):
    """The runs, in order: [(name, swapped, precision (None: replace_mlps' default), mode, TF32 allowed)]."""
    if not args.float32:
        return [(("cupyffn + " if swapped else "torch ") + mode, swapped, None, mode, False)
                for mode in args.modes for swapped in (False, True)]
    runs = []
    for mode in args.modes:
        for setting in args.settings:
            tf32, precision = SETTINGS[setting]
            runs += [(f"torch {'TF32' if tf32 else 'strict'} {mode}", False, None, mode, tf32),
                     (f"cupyffn {precision} {mode}", True, precision, mode, tf32)]
    return runs


def _example():
    spec = importlib.util.spec_from_file_location("cupyffn_example_train_gpt2", ROOT / "examples" / "train_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _busy_ms(intervals):
    """Total length of the union of (start, end) intervals, in ms (ns in)."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e6


def largest_gaps(spans, count):
    """The `count` longest stretches in which no kernel ran, between the first and the last of `spans` ((start ns,
    end ns, name), any order): [(gap µs, kernel before, kernel after)], longest first. Where the GPU idles inside a
    step, and next to what."""
    gaps, end, last = [], None, None
    for s, e, name in sorted(spans):
        if end is not None and s > end:
            gaps.append(((s - end) / 1e3, last, name))
        if end is None or e > end:
            end, last = e, name
    return sorted(gaps, key=lambda g: -g[0])[:count]


def measure(model, kind, item, mode, args, own, example, autocast):
    """One run's step time, kernels and gaps (module docstring); `autocast`: the step's autocast dtype, or None."""
    import contextlib

    import torch

    runner = model if mode is None else torch.compile(model, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mark = mode == "reduce-overhead"
    context = (lambda: torch.autocast("cuda", dtype=autocast)) if autocast is not None else contextlib.nullcontext

    def step():
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with context():
            loss = example.loss_of(runner, kind, item)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profiled):
            step()
        torch.cuda.synchronize()
    kernels, intervals = {}, []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
            continue
        name = e.name()
        if name.startswith(("Memcpy", "Memset")) and "Kernel" not in name:
            name = name.split(" ")[0]  # a copy engine's transfer, not a kernel
        kernels[name] = kernels.get(name, 0) + e.duration_ns()
        intervals.append((e.start_ns(), e.start_ns() + e.duration_ns(), name))
    host = _host_profile(step, args.host) if args.host else None
    n = args.profiled
    groups = {}
    for name, ns in kernels.items():
        g = group_of(name, own)
        groups[g] = groups.get(g, 0.0) + ns / 1e6 / n
    step_ms = statistics.median(times)
    busy = _busy_ms([(a, b) for a, b, _ in intervals]) / n
    gaps = [[round(us, 1), before[:120], after[:120]] for us, before, after in largest_gaps(intervals, args.gaps)]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "host_or_idle_ms": step_ms - busy,
            "kernel_ms": sum(groups.values()), "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"ms": ns / 1e6 / n, "group": group_of(k, own), "name": k[:200]} for k, ns in top],
            "host_functions": host, "largest_gaps": gaps}


def _host_profile(step, steps, top=25):
    """cProfile of `steps` steps (host synchronized after each): [ms per step of own time, calls per step, function]
    for the `top` functions with the most own time."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, nc, f"{pathlib.Path(f).name}:{line} {fn}") for (f, line, fn), (_, nc, tt, _, _) in
                   stats.items()), reverse=True)[:top]
    return [[round(1e3 * tt / steps, 4), nc / steps, name] for tt, nc, name in rows]


def main(argv=None):
    args = parse(argv)
    import torch

    import cupyffn.torch as ct

    example = _example()
    preset = dict(example.PRESETS[args.model])
    kind = preset.pop("kind")
    preset.update({k: getattr(args, k) for k in ("layers", "seq", "batch") if getattr(args, k)})
    item = next(example.batches(kind, 1, preset["batch"], preset["seq"], preset["dim"], preset["vocab"], "cuda"))
    own = own_kernels()
    result = {"model": args.model, "sizes": preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("CUPYFFN_GIT_COMMIT"), "compiled": args.compiled, "float32": args.float32,
              "runs": {}}
    autocast = None if args.float32 else torch.bfloat16
    precision_before = torch.get_float32_matmul_precision()
    for name, swapped, precision, mode, tf32 in runs_of(args):
        model = example.build(kind, preset, "cuda")
        if swapped:
            ct.replace_mlps(model, compiled=args.compiled, **({} if precision is None else {"precision": precision}))
        torch._dynamo.reset()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")  # TF32 allowed or not (PyTorch's default)
        try:
            r = measure(model, kind, item, MODES[mode], args, own, example, autocast)
        finally:
            torch.set_float32_matmul_precision(precision_before)
        r.update(precision=precision, tf32=tf32)
        result["runs"][name] = r
        print(f"== {name}: step {r['step_ms']:.3f} ms, GPU busy {r['gpu_busy_ms']:.3f}, host or idle "
              f"{r['host_or_idle_ms']:.3f}, kernels {r['kernel_ms']:.3f}", flush=True)
        for g, ms in r["groups_ms"].items():
            print(f"     {ms:8.3f} ms  {g}")
        for k in r["top_kernels"]:
            print(f"        {k['ms']:7.3f} ms  {k['name'][:110]}")
        for us, before, after in r["largest_gaps"]:
            print(f"        idle {us:8.1f} us  after {before[:50]}  before {after[:50]}")
        for ms, calls, fn in r["host_functions"] or ():
            print(f"        host {ms:7.3f} ms  x{calls:5.0f}  {fn[:100]}")
        del model
        torch.cuda.empty_cache()
    out = args.out or os.path.join(os.environ.get("OUT", "results"),
                                   f"step-breakdown-{args.model}{'-fp32' if args.float32 else ''}.json")
    save_json(result, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
