"""Summary, targets, console tables, Markdown/README and the plot: everything computed FROM results.

No GPU and no timing here, so it runs (and is tested) on any machine, and `python bench.py --readme`
regenerates README.md from results/*.json alone.

Results format 2 (written by benchmarks.gpu) holds, per workload and implementation, the median ms
of the timed iterations, the timing method, and the benchmark's verdict over N rounds of fresh inputs
("check"). Older files (no "format" key) predate the benchmark's own check: they are read with their
verdicts marked as not recorded (their "passed" used a stricter rule that is not the benchmark's).
"""

import json
import math
import statistics
from pathlib import Path

import cupyffn
from cupyffn import workloads as W

from . import floor as F

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
README = ROOT / "README.md"
FORMAT = 2

#: The SOL score's baseline (the H200 stand-in for the benchmark's tensor-core PyTorch T_b), and the
#: far easier plain-fp32 one, which is shown only labelled as such.
SCORE_BASELINE = "torch-compile-tf32"
EASY_BASELINE = "torch-fp32"
DEFAULT_IMPL = f"cupyffn-{cupyffn.DEFAULT_PRECISION}"

#: Every target the bench prints, in one place: (group, implementation, metric, op, value, what it means).
#: Metrics are keys of summarize()'s per-implementation entries; "speedup_vs:NAME" is NAME's geomean
#: over this implementation's.
TARGETS = (
    ("default", DEFAULT_IMPL, "geomean_ms", "<=", 0.72, "default precision, cuBLAS/cuBLASLt route"),
    ("default", DEFAULT_IMPL, "max_rel_l2", "<=", 1e-4, "rel. L2 vs float64, every output and workload"),
    ("default", DEFAULT_IMPL, "passes", "==", True, "benchmark check, 16 workloads x N rounds"),
    ("default", DEFAULT_IMPL, "worst_err_over_atol", "<=", 0.1, "worst max|err|/atol over all rounds"),
    ("fastest", "cupyffn-tf32", "geomean_ms", "<=", 0.30, ""),
    ("fastest", "cupyffn-tf32", "pct_sol", ">=", 56.0, "% of SOL, the leaderboard's way (mean SOL / mean ms)"),
    ("fastest", "cupyffn-tf32", "speedup_vs:" + SCORE_BASELINE, ">=", 2.3, "ratio of geomeans, same run"),
    ("fastest", "cupyffn-tf32", "passes", "==", True, "benchmark check, 16 workloads x N rounds"),
    ("fastest", "cupyffn-tf32", "floor_ratio_large_t", "<=", 1.15, "worst ms / the GEMM floor row at T >= 4096"),
    ("fp32", "cupyffn-ieee", "gemm_ratio", "<=", 1.02, "worst ms / sum of its four SGEMMs (stage profile)"),
)

#: The T from which the GEMM floor ratio is a target (issue 57: large T, where the call should be its GEMMs).
LARGE_T = 4096


def geomean(values):
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def is_peer(name):
    return not name.startswith("cupyffn")


#: cupyffn configurations the bench runs beside the precisions to measure one mechanism (A/B twins, e.g.
#: cupyffn-tf32 with its fused GEMM1 turned off): in the tables, never the headline's "fastest mode".
A_B_TWINS = ("cupyffn-tf32-cublas-gemm1", "cupyffn-tf32-launches", "cupyffn-tf32-convert-apart",
             "cupyffn-tf32-staged-epilogue", "cupyffn-fp16+fp8-cublas-gemm1",  # benchmarks/impls.py TWIN_OPTIONS
             "cupyffn-tf32-memory-mode")  # and TF32_MEMORY_MODE (inputs not all given)


# ---------------------------------------------------------------------------------------- loading
def normalize(data):
    """A results dict in format 2 (older files: verdicts marked not recorded, protocol labelled), its summary
    computed again from the per-workload figures (so that a file is read by today's rules, e.g. A_B_TWINS)."""
    if data.get("format") == FORMAT:
        return dict(data, summary=summarize(data["workloads"]))
    data = json.loads(json.dumps(data))  # a copy
    proto = data.get("protocol", {})
    data["protocol"] = {"timing": "cuda-events", "warmup": proto.get("warmup"), "iters": proto.get("iters"),
                        "input_sets": 1, "l2_flush_bytes": proto.get("l2_flush_bytes"), "rounds": 0,
                        "quick": proto.get("quick", False), "earlier_protocol": True}
    for row in data["workloads"]:
        row.setdefault("max_atol", W.max_atol(row["tokens"]) if row["tokens"] in {w.tokens for w in W.WORKLOADS}
                       else None)
        for res in row["results"].values():
            res["check"] = None  # the file's "passed" applied the stricter 1e-2 + 1e-2|ref| rule
            res["rel_l2"] = {o: c["rel_l2"] for o, c in res.get("checks", {}).items()}
            res["timing"] = "cuda-events"
            for key in ("passed", "checks", "sol_score"):
                res.pop(key, None)
    data["summary"] = summarize(data["workloads"])
    data["format"] = FORMAT
    data["converted_from_earlier_format"] = True
    return data


def newest_results(results_dir=None):
    """The newest full run and loop run in results/ (by their recorded date); full runs normalized."""
    full, loop = None, None
    for path in sorted(Path(results_dir or RESULTS).glob("*.json")):
        data = json.loads(path.read_text())
        if "suite" in data:  # another suite's run (benchmarks/sd35.py): its own README section
            continue
        if "summary" in data and not data.get("protocol", {}).get("quick"):
            if full is None or data["date"] > full["date"]:
                full = data
        elif "calls_per_measurement" in data:
            if loop is None or data["date"] > loop["date"]:
                loop = data
    return (normalize(full) if full is not None else None), loop


# ---------------------------------------------------------------------------------------- summary
def sol_score(t_kernel, t_sol, t_baseline):
    """The benchmark's score, or None when the baseline is not slower than SOL (undefined)."""
    if not t_baseline > t_sol:
        return None
    return W.sol_score(t_kernel, t_sol, t_baseline)


def summarize(rows):
    """Per implementation: mean/geomean of the per-workload medians, % of SOL (mean SOL / mean ms),
    SOL scores, the benchmark verdict over all workloads x rounds; plus the headline."""
    names = []
    for r in rows:
        names += [n for n in r["results"] if n not in names]
    per = {}
    for n in names:
        have = [r for r in rows if n in r["results"]]
        res = [r["results"][n] for r in have]
        ms = [x["median_ms"] for x in res]
        e = {"workloads": len(have), "complete": len(have) == len(rows),
             "mean_ms": mean(ms), "geomean_ms": geomean(ms)}
        e["pct_sol"] = 100.0 * mean(r["sol_ms"] for r in have) / e["mean_ms"]
        e["max_rel_l2"] = max(x["max_rel_l2"] for x in res)
        checks = [x.get("check") for x in res]
        if any(c is None for c in checks):
            e.update(passes=None, rounds_passed=None, rounds_total=None, least_matched=None, worst_err_over_atol=None)
        else:
            e["rounds_passed"] = sum(c["rounds_passed"] for c in checks)
            e["rounds_total"] = sum(c["rounds"] for c in checks)
            e["passes"] = e["complete"] and all(c["passed"] for c in checks) and e["rounds_total"] > 0
            e["least_matched"] = min(o["least_matched"] for c in checks for o in c["outputs"].values())
            e["worst_err_over_atol"] = max(o["worst_err_over_atol"] for c in checks for o in c["outputs"].values())
        for base in (SCORE_BASELINE, EASY_BASELINE):
            scores = [sol_score(r["results"][n]["median_ms"], r["sol_ms"], r["results"][base]["median_ms"])
                      for r in have if base in r["results"]]
            if scores and len(scores) == len(have) and all(s is not None for s in scores):
                e[f"sol_score_vs:{base}"] = mean(scores)
        ratios = [x["median_ms"] / x["gemm_sum_ms"] for x in res if x.get("gemm_sum_ms")]
        if ratios:
            e["gemm_ratio"] = max(ratios)
        large = floor_ratios(rows, n, LARGE_T)
        if large:
            e["floor_ratio_large_t"] = max(v for _, v in large)
        per[n] = e
    for n, e in per.items():
        for base, b in per.items():
            if base != n:
                e[f"speedup_vs:{base}"] = b["geomean_ms"] / e["geomean_ms"]
    out = {"implementations": per, "workloads": len(rows),
           "sol_mean_ms": mean(r["sol_ms"] for r in rows), "sol_geomean_ms": geomean([r["sol_ms"] for r in rows]),
           "headline": headline(per)}
    floors = [r["floor"]["median_ms"] for r in rows if r.get("floor")]
    if floors:
        out["floor"] = {"name": F.NAME, "workloads": len(floors), "mean_ms": mean(floors), "geomean_ms": geomean(floors)}
    return out


def headline(per):
    """The fastest cupyffn mode (by mean, as the leaderboard ranks) that passes the benchmark's check
    everywhere, and its speed-up over the fastest passing peer; None when no verdicts were recorded."""
    passing = {n: e for n, e in per.items() if e["passes"] and e["complete"]}
    ours = [n for n in passing if not is_peer(n) and n not in A_B_TWINS]
    if not ours:
        return None
    best = min(ours, key=lambda n: passing[n]["mean_ms"])
    out = {"implementation": best, "mean_ms": passing[best]["mean_ms"], "geomean_ms": passing[best]["geomean_ms"],
           "pct_sol": passing[best]["pct_sol"], "peer": None}
    peers = [n for n in passing if is_peer(n)]
    if peers:
        peer = min(peers, key=lambda n: passing[n]["mean_ms"])
        out.update(peer=peer, peer_mean_ms=passing[peer]["mean_ms"], peer_geomean_ms=passing[peer]["geomean_ms"],
                   speedup_mean=passing[peer]["mean_ms"] / passing[best]["mean_ms"],
                   speedup_geomean=passing[peer]["geomean_ms"] / passing[best]["geomean_ms"])
    return out


def evaluate_targets(summary, targets=TARGETS):
    """[(group, implementation, metric, op, target, value or None, met or None, note)] for the targets
    whose implementation is in the run."""
    ops = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "==": lambda v, t: v == t}
    out = []
    for group, impl, metric, op, target, note in targets:
        e = summary["implementations"].get(impl)
        if e is None:
            continue
        value = e.get(metric)
        met = None if value is None else bool(ops[op](value, target))
        out.append((group, impl, metric, op, target, value, met, note))
    return out


def gemm_bytes(stage, tokens, dim, hidden_dim):
    """The fewest bytes a GEMM stage of a one-plane 16-bit plan (tf32's scaled fp16, bf16) moves: its two 16-bit
    operands read once and its output written once (fp32, or fp16 for the fused GEMM1, which also reads
    linear1_out and tanh_inner as fp32); None for a stage that is not one of the four GEMMs."""
    T, D, H = tokens, dim, hidden_dim
    if stage.startswith("GEMM1"):
        return 2 * (T * D + D * H) + (10 * T * H if "fused" in stage else 4 * T * H)
    return {"GEMM2": 2 * (T * D + T * H) + 4 * D * H, "GEMM3": 2 * (T * H + H * D) + 4 * T * D,
            "GEMM4": 2 * (T * H + T * D) + 4 * H * D}.get(stage[:5])


def stage_rates(stages, tokens, dim, hidden_dim, planes):
    """profile_stages' {stage: {"ms", "bytes"?}} as rows with GB/s (memory stages) or TFLOP/s (GEMMs; for a
    one-plane plan also the GB/s of their fewest bytes, gemm_bytes: at small T they move the weights)."""
    flops = 2 * tokens * dim * hidden_dim * max(planes, 1)
    rows = []
    for stage, s in stages.items():
        row = {"stage": stage, "ms": s["ms"]}
        if "bytes" in s:
            row["bytes"] = s["bytes"]
            row["gbps"] = s["bytes"] / (s["ms"] * 1e-3) / 1e9
        elif stage.startswith("GEMM"):
            row["tflops"] = flops / (s["ms"] * 1e-3) / 1e12
            nbytes = gemm_bytes(stage, tokens, dim, hidden_dim) if planes == 1 else None
            if nbytes:
                row["bytes"] = nbytes
                row["gbps"] = nbytes / (s["ms"] * 1e-3) / 1e9
        rows.append(row)
    return rows


def floor_ratios(rows, name, first_tokens=0):
    """[(T, ms / GEMM floor ms)] of implementation `name` on the workloads with T >= first_tokens that have both."""
    return [(r["tokens"], r["results"][name]["median_ms"] / r["floor"]["median_ms"]) for r in rows
            if r["tokens"] >= first_tokens and name in r["results"] and r.get("floor")]


# ---------------------------------------------------------------------------------------- console
def _fmt(v, spec, none="n/a"):
    return none if v is None else format(v, spec)


def verdict_text(e):
    if e["passes"] is None:
        return "not recorded"
    return f"{'PASS' if e['passes'] else 'FAIL'} {e['rounds_passed']}/{e['rounds_total']}"


def print_workload(row):
    print(f"\n## {row['label']}  T={row['tokens']}  SOL {row['sol_ms']:.3f} ms  max_atol {row['max_atol']}")
    print(f"{'implementation':22s} {'median ms':>10s} {'x SOL':>6s} {'check':>12s} {'least match':>11s} "
          f"{'err/atol':>8s} {'max rel L2':>10s} {'timing':>11s}")
    for name, res in row["results"].items():
        c = res.get("check")
        text = "n/a" if c is None else f"{'pass' if c['passed'] else 'FAIL'} {c['rounds_passed']}/{c['rounds']}"
        least = min(o["least_matched"] for o in c["outputs"].values()) if c else None
        worst = max(o["worst_err_over_atol"] for o in c["outputs"].values()) if c else None
        print(f"{name:22s} {res['median_ms']:10.3f} {res['median_ms'] / row['sol_ms']:6.2f} {text:>12s} "
              f"{_fmt(least, '11.5f'):>11s} {_fmt(worst, '8.3f'):>8s} {res['max_rel_l2']:10.2e} {res['timing']:>11s}")
        if res.get("timing_note"):
            print(f"  {name} timing: {res['timing_note']}")
    for name, res in row["results"].items():
        c = res.get("check")
        if c is not None and not c["passed"]:
            print(f"  {name} check: " + ", ".join(
                f"{o} matched {v['least_matched']:.5f} err/atol {v['worst_err_over_atol']:.2f}"
                f"{'' if v['all_finite'] else ' NON-FINITE'}" for o, v in c["outputs"].items()))
    if row.get("floor"):
        f = row["floor"]["median_ms"]
        print(f"  {F.NAME} (not a solution) {f:.3f} ms; x floor: " + ", ".join(
            f"{n} {res['median_ms'] / f:.2f}" for n, res in row["results"].items() if not is_peer(n)))
    if "fp32_reference_rel_l2" in row:
        print("  fp32 reference vs float64: " + ", ".join(f"{o} {e:.1e}" for o, e in row["fp32_reference_rel_l2"].items()))
    for name, res in row["results"].items():
        if "stages" in res:
            parts = []
            for s in res["stages"]:
                rate = f"{s['gbps']:.0f} GB/s" if "gbps" in s else (f"{s['tflops']:.0f} TF/s" if "tflops" in s else "")
                parts.append(f"{s['stage']} {s['ms']:.3f}" + (f" ({rate})" if rate else ""))
            print(f"  {name}: " + ", ".join(parts))


def print_summary(summary, compile_s=None):
    per = summary["implementations"]
    print(f"\n# Summary over {summary['workloads']} workloads (H200 SOL mean {summary['sol_mean_ms']:.4f} ms, "
          f"geomean {summary['sol_geomean_ms']:.4f} ms)")
    print(f"{'implementation':22s} {'mean ms':>8s} {'geomean':>8s} {'% SOL':>6s} {'benchmark check':>16s} "
          f"{'least match':>11s} {'err/atol':>8s} {'max rel L2':>10s} {'score*':>7s} {'score fp32':>10s}")
    for n, e in per.items():
        print(f"{n:22s} {e['mean_ms']:8.4f} {e['geomean_ms']:8.4f} {e['pct_sol']:6.1f} {verdict_text(e):>16s} "
              f"{_fmt(e['least_matched'], '11.5f'):>11s} {_fmt(e['worst_err_over_atol'], '8.3f'):>8s} "
              f"{e['max_rel_l2']:10.2e} {_fmt(e.get('sol_score_vs:' + SCORE_BASELINE), '7.3f'):>7s} "
              f"{_fmt(e.get('sol_score_vs:' + EASY_BASELINE), '10.3f'):>10s}")
    print(f"* SOL score vs {SCORE_BASELINE} (the benchmark's kind of baseline); 'score fp32': vs {EASY_BASELINE}, "
          f"a far easier baseline")
    if summary.get("floor"):
        f = summary["floor"]
        print(f"{F.NAME} (not a solution: {F.WHAT}): mean {f['mean_ms']:.4f} ms, geomean {f['geomean_ms']:.4f} ms")
    if compile_s:
        print("torch.compile seconds (first call, compile + autotune): "
              + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    print("\n# Headline")
    print(headline_text(summary["headline"]))
    print("\n# Where we stand against the targets")
    for group, impl, metric, op, target, value, met, note in evaluate_targets(summary):
        shown = "n/a" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        status = "n/a" if met is None else ("MET" if met else "missed")
        print(f"{group:8s} {impl:18s} {metric:30s} {shown:>9s} (target {op} {target}) {status}"
              + (f"  [{note}]" if note else ""))


def headline_text(h):
    if h is None:
        return "No cupyffn mode has a recorded pass of the benchmark's check in this run."
    text = (f"Fastest cupyffn mode that passes the benchmark's check: {h['implementation']}, mean "
            f"{h['mean_ms']:.4f} ms, geomean {h['geomean_ms']:.4f} ms ({h['pct_sol']:.0f}% of SOL)")
    if h["peer"]:
        text += (f"; {h['speedup_mean']:.2f}x (mean) / {h['speedup_geomean']:.2f}x (geomean) faster than the "
                 f"fastest passing peer in the same run, {h['peer']} (mean {h['peer_mean_ms']:.4f} ms)")
    return text + "."


# ---------------------------------------------------------------------------------------- Markdown
def protocol_text(result):
    p = result["protocol"]
    if p.get("earlier_protocol"):
        return (f"Timing (earlier protocol): CUDA events, {p.get('warmup')} warm-up + {p.get('iters')} timed "
                "iterations, median, L2 flushed, inputs not rotated. This run predates the benchmark's own check: "
                "its verdicts are not recorded (the file applied a stricter rule that is not the benchmark's); the "
                "next full run records them.")
    method = {"cupti": "CUPTI kernel span (first GPU activity start to last end of each iteration)",
              "cuda-events": "CUDA events",
              "cuda-events-idle": "CUDA events from an idle GPU (host work included)"}.get(p["timing"], p["timing"])
    text = (f"Timing: {method}, {p['warmup']} warm-up + {p['iters']} timed iterations, median per workload; "
            f"before each iteration the inputs move to another of {p['input_sets']} input sets (other addresses, "
            f"fresh random contents) and the L2 is flushed ({p['l2_flush_bytes'] >> 20} MiB zero-filled). "
            f"Benchmark check: its own rule (per-workload max_atol, max_rtol 1e-5, 99% of the elements, no NaN/Inf) "
            f"against the plain-fp32 reference, {p['rounds']} rounds of fresh inputs per workload.")
    if p.get("timing_fallbacks"):
        text += " CUDA events were used instead of CUPTI for: " + ", ".join(p["timing_fallbacks"]) + "."
    return text


def markdown(result):
    """Markdown tables of one bench run (also what README.md includes)."""
    rows = result["workloads"]
    env = result["env"]
    summary = result["summary"]
    per = summary["implementations"]
    names = list(per)
    copy = env.get("copy_rate")
    lines = [f"Measured on {env['device']} (driver {env['driver']}, CUDA runtime {env['cuda_runtime']}, "
             f"cuBLAS {env['cublas']}, CuPy {env['cupy']}, torch {env['torch']}) on {result['date']}, "
             f"commit {str(result['git_commit'])[:12]}; `{result['command']}`. {protocol_text(result)}"
             + (f" Copy rate in this run: {copy['gbps']:.0f} GB/s (a {copy['bytes'] / 1e6:.0f} MB device-to-device "
                f"copy in {1e3 * copy['ms']:.1f} us, bytes read plus written)." if copy else ""), ""]
    if result.get("compile_s"):
        lines += ["torch.compile(mode=\"max-autotune-no-cudagraphs\", dynamic=True), compiled once per mode; first "
                  "call (compile and autotune): " + ", ".join(f"{k} {v:.0f} s" for k, v in result["compile_s"].items())
                  + ".", ""]
    if not result["protocol"].get("earlier_protocol"):
        lines += [f"**{headline_text(summary['headline'])}**", ""]
    score = "SOL score vs " + SCORE_BASELINE
    lines.append(f"| implementation | mean ms | geomean ms | % of SOL | benchmark check | least matched | "
                 f"worst max\\|err\\|/atol | max rel. L2 vs fp64 | {score} | SOL score vs {EASY_BASELINE} (easier) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        e = per[n]
        lines.append(f"| {n} | {e['mean_ms']:.4f} | {e['geomean_ms']:.4f} | {e['pct_sol']:.0f}% | {verdict_text(e)} | "
                     f"{_fmt(e['least_matched'], '.5f')} | {_fmt(e['worst_err_over_atol'], '.3f')} | "
                     f"{e['max_rel_l2']:.1e} | {_fmt(e.get('sol_score_vs:' + SCORE_BASELINE), '.3f')} | "
                     f"{_fmt(e.get('sol_score_vs:' + EASY_BASELINE), '.3f')} |")
    lines.append(f"| H200 SOL | {summary['sol_mean_ms']:.4f} | {summary['sol_geomean_ms']:.4f} | 100% | | | | | | |")
    lines.append("")
    lines.append("% of SOL is the leaderboard's: mean SOL / mean latency over the workloads. SOL score: 1 at SOL, "
                 "0.5 at the baseline measured in the same run, per workload, then the mean; the benchmark's "
                 f"baseline is a tensor-core PyTorch implementation, for which {SCORE_BASELINE} "
                 f"(torch.compile max-autotune-no-cudagraphs, TF32 allowed) stands in; scores vs {EASY_BASELINE} "
                 "(eager, no TF32) are far easier and shown only for comparison.")
    lines.append("")
    marks = not result["protocol"].get("earlier_protocol")
    any_failed = False
    lines.append("| workload | T | SOL | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "---|" * len(names))
    for r in rows:
        cells = []
        for n in names:
            res = r["results"].get(n)
            if res is None:
                cells.append("")
                continue
            failed = marks and res.get("check") is not None and not res["check"]["passed"]
            any_failed |= failed
            cells.append(f"{res['median_ms']:.3f}" + (" ✗" if failed else ""))
        lines.append(f"| {r['label']} | {r['tokens']} | {r['sol_ms']:.3f} | " + " | ".join(cells) + " |")
    if any_failed:
        lines += ["", "✗: the benchmark's check failed in at least one round on that workload."]
    lines += floor_markdown(result)
    for name in ("cupyffn-tf32", DEFAULT_IMPL):
        lines += stage_markdown(result, name)
    return "\n".join(lines) + "\n"


def stage_markdown(result, name):
    """The serial stage profile of implementation `name`, one row per stage and one column per distinct T (the
    first workload of each T): ms, and the rate (GB/s of the stage's fewest bytes, as a share of the run's copy
    rate where it was measured; else TFLOP/s)."""
    rows = {}
    for r in sorted(result["workloads"], key=lambda r: r["tokens"]):
        res = r["results"].get(name)
        if res and res.get("stages") and r["tokens"] not in rows:
            rows[r["tokens"]] = res
    if not rows:
        return []
    copy = (result["env"].get("copy_rate") or {}).get("gbps")
    stages = []
    for res in rows.values():
        stages += [s["stage"] for s in res["stages"] if s["stage"] not in stages]

    def cell(s):
        if s is None:
            return ""
        if "gbps" in s:
            rate = f"{s['gbps']:.0f} GB/s" + (f", {100 * s['gbps'] / copy:.0f}% of copy" if copy else "")
        else:
            rate = f"{s['tflops']:.0f} TFLOP/s" if "tflops" in s else ""
        return f"{s['ms']:.3f}" + (f" ({rate})" if rate else "")

    lines = ["", f"**Stage profile of {name}** (events between the stages of one call, every step serialized, L2 "
             "flushed first; ms, and the rate of each stage's fewest bytes" +
             (f" against this run's copy rate, {copy:.0f} GB/s (a {result['env']['copy_rate']['bytes'] / 1e6:.0f} MB "
              "device-to-device copy, bytes read plus written)" if copy else "") + "; GEMMs also in TFLOP/s):", "",
             "| stage | " + " | ".join(f"T = {t}" for t in rows) + " |", "|---|" + "---|" * len(rows)]
    for st in stages:
        cells = [cell(next((s for s in res["stages"] if s["stage"] == st), None)) for res in rows.values()]
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    lines.append("| whole call (median, both streams) | " + " | ".join(f"{res['median_ms']:.3f}" for res in rows.values())
                 + " |")
    return lines


def floor_markdown(result):
    """The GEMM floor row per workload and each cupyffn precision's time over it (lines; none without a floor)."""
    summary = result["summary"]
    if not summary.get("floor"):
        return []
    rows = result["workloads"]
    names = [n for n in summary["implementations"] if not is_peer(n) and n not in A_B_TWINS]
    f = summary["floor"]
    lines = ["", f"**GEMM floor** (`{F.NAME}`, {F.WHAT}): mean {f['mean_ms']:.4f} ms, geomean {f['geomean_ms']:.4f} "
             f"ms. Each cupyffn precision's median over the floor's, same run:", "",
             "| workload | T | floor ms | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        if not r.get("floor"):
            continue
        fl = r["floor"]["median_ms"]
        cells = [f"{r['results'][n]['median_ms'] / fl:.2f}x" if n in r["results"] else "" for n in names]
        lines.append(f"| {r['label']} | {r['tokens']} | {fl:.3f} | " + " | ".join(cells) + " |")
    return lines


def precision_table(result):
    """Accuracy, benchmark verdict and speed per precision (README)."""
    rows = result["workloads"]
    per = result["summary"]["implementations"]
    rounds = result["protocol"].get("rounds") or 0
    head = (f"benchmark check ({len(rows)} workloads x {rounds} rounds)" if rounds else "benchmark check")
    lines = [f"| precision | what it computes | contract (rel. L2) | measured worst rel. L2 | {head} | geomean ms |",
             "|---|---|---|---|---|---|"]
    for p, prec in cupyffn.PRECISIONS.items():
        name = f"cupyffn-{p}"
        if name not in per:
            continue
        e = per[name]
        lines.append(f"| `{p}` | {prec.summary} | {prec.contract:g} | {e['max_rel_l2']:.1e} | {verdict_text(e)} | "
                     f"{e['geomean_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def readme_results(result):
    """The README's results: the headline and one table of cupyffn's precisions and the peers (no A/B twins)."""
    env = result["env"]
    per = result["summary"]["implementations"]
    lines = [f"{env['device']}, CuPy {env['cupy']}, torch {env['torch']}, {result['date'][:10]}, commit "
             f"{str(result['git_commit'])[:7]}: `{result['command']}` (`results/{slug(env['device'])}.md` has every "
             "workload, the A/B twins and the stage profiles).", "",
             f"**{headline_text(result['summary']['headline'])}**", "",
             "| implementation | mean ms | geomean ms | % of SOL | benchmark check |", "|---|---|---|---|---|"]
    for n, e in per.items():
        if n in A_B_TWINS:
            continue
        lines.append(f"| {n} | {e['mean_ms']:.4f} | {e['geomean_ms']:.4f} | {e['pct_sol']:.0f}% | {verdict_text(e)} |")
    lines.append(f"| H200 SOL | {result['summary']['sol_mean_ms']:.4f} | {result['summary']['sol_geomean_ms']:.4f} | "
                 "100% | |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- results:begin (generated by `python bench.py --readme`; do not edit) -->", "<!-- results:end -->"
PBEGIN, PEND = "<!-- precisions:begin (generated) -->", "<!-- precisions:end -->"


def readme_sections(results_dir=None):
    full, _ = newest_results(results_dir)
    sections = {}
    if full is not None:
        sections[(BEGIN, END)] = readme_results(full)
        sections[(PBEGIN, PEND)] = precision_table(full)
    from . import sd35

    runs = sorted(Path(results_dir or RESULTS).glob(f"{sd35.SUITE}-*.json"))
    if runs:
        sections[(sd35.BEGIN, sd35.END)] = sd35.readme_section(json.loads(runs[-1].read_text()))
    from . import training_fp32

    # always a section: before the first GPU run it says that none is recorded yet, and which command makes one
    sections[(training_fp32.BEGIN, training_fp32.END)] = training_fp32.readme_section(
        training_fp32.newest(results_dir or RESULTS))
    return sections


def render_readme(text, results_dir=None):
    for (begin, end), body in readme_sections(results_dir).items():
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + begin + "\n" + body + end + tail
    return text


# ---------------------------------------------------------------------------------------- files
def slug(name):
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def write_suite(result, suite, text, results_dir, slug):
    """results/<suite>-<gpu>.json (the run) and .md (`text`), for a suite other than the official one."""
    base = results_dir / f"{suite}-{slug(result['env']['device'])}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(text)
    print(f"wrote {base.with_suffix('.json')} and .md")


def write_results(result, loop):
    RESULTS.mkdir(exist_ok=True)
    device = (result or {}).get("env", {}).get("device") or "gpu"
    if result is not None:
        base = RESULTS / slug(device)
        base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        base.with_suffix(".md").write_text(markdown(result))
        plot(result, base.with_suffix(".png"))
        print(f"\nwrote {base.with_suffix('.json')}, .md and .png")
    if loop is not None:
        path = RESULTS / (slug(loop.get("device", device)) + ("-host" if loop.get("host_only") else "-loop") + ".json")
        path.write_text(json.dumps(loop, indent=1) + "\n")
        print(f"wrote {path}")
        if loop.get("host_per_call"):
            path.with_suffix(".md").write_text(host_markdown(loop))
            print(f"wrote {path.with_suffix('.md')}")


def host_markdown(loop):
    """The loop mode's host-time table (benchmarks/loop.py host_table) as markdown: host us per call of each row at
    each workload, then the ratios against their targets."""
    host = loop["host_per_call"]
    table = host["workloads"]
    names = [n for n in host["rows"] if any(n in r["host_us"] for r in table)]
    lines = [f"# Host time per call, {loop.get('device', 'GPU')}", "",
             f"{loop['date'][:10]}, commit {str(loop.get('git_commit'))[:7]}: `{loop.get('command', '')}`. "
             f"Precision {host['precision']}; {host['method']}; median of {host['calls']} calls.", "",
             "| row | " + " | ".join(f"{r['label']} (T={r['tokens']})" for r in table) + " | what |",
             "|---|" + "---|" * len(table) + "---|"]
    for n in names:
        cells = [f"{r['host_us'][n]:.1f}" if n in r["host_us"] else "" for r in table]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {host['rows'][n]} |")
    for key, target in host["targets"].items():
        cells = [f"{r['ratios'][key]:.2f}" if key in r["ratios"] else "" for r in table]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | ratio; target <= {target} |")
    lines.append("")
    lines.append("Host us: microseconds to issue one call with the device idle (benchmarks/layers.py HOST_ROWS says "
                 "what each row runs).")
    return "\n".join(lines) + "\n"


def plot(result, path):
    """Latency vs tokens per implementation (with the H200 SOL) and accuracy per implementation, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = sorted(result["workloads"], key=lambda r: r["tokens"])
    per = result["summary"]["implementations"]
    names = list(per)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    tokens = sorted({r["tokens"] for r in rows})

    def typical(name, t):  # workloads with the same T: the median of their medians
        values = [r["results"][name]["median_ms"] for r in rows if r["tokens"] == t and name in r["results"]]
        return statistics.median(values) if values else float("nan")

    for name in names:
        style = "-o" if name.startswith("cupyffn") else "--s"
        ax1.plot(tokens, [typical(name, t) for t in tokens], style, label=name, markersize=4)
    ax1.plot(tokens, [W.sol_ms(t) for t in tokens], "k:", linewidth=2, label="H200 SOL")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("tokens T (D=1536, H=6144)")
    ax1.set_ylabel("ms per backward (median, L2 flushed)")
    ax1.set_title(f"Latency on {result['env']['device']}")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    order = [n for n in names if n.startswith("cupyffn")] + [n for n in names if not n.startswith("cupyffn")]
    worst = [per[n]["max_rel_l2"] if math.isfinite(per[n]["max_rel_l2"]) else 1.0 for n in order]  # NaN/Inf out: 1
    colors = [{True: "tab:blue", False: "tab:red", None: "tab:gray"}[per[n]["passes"]] for n in order]
    ax2.barh(range(len(order)), worst, color=colors)
    for i, n in enumerate(order):
        p = n.replace("cupyffn-", "")
        if p in cupyffn.PRECISIONS:
            ax2.plot([cupyffn.PRECISIONS[p].contract] * 2, [i - 0.4, i + 0.4], "k-", linewidth=2)
    ax2.set_yticks(range(len(order)))
    ax2.set_yticklabels(order, fontsize=8)
    ax2.set_xscale("log")
    ax2.set_xlabel("worst relative L2 error vs float64 (black: contract)")
    ax2.set_title("Accuracy (blue: passes the benchmark's check, red: fails, grey: n/a)", fontsize=9)
    ax2.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
