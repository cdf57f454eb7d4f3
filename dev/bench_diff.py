"""Per-workload ratio of two bench.py JSON files (for example the same implementations at two commits, run
back to back on one GPU): which workloads moved by more than a tolerance, and the spread of a repeat run.

    python3 dev/bench_diff.py BEFORE.json AFTER.json [--repeat BEFORE2.json] [--impls 'cupyffn-*'] [--tol 0.02]

Each file is bench.py's --json output or a results/<gpu>.json (format 2). Implementations present in both files are compared on
their median times; with --repeat, a second run of BEFORE gives the run-to-run spread the tolerance is
judged against. Prints one line per (workload, implementation), then a summary; exit status 1 if a ratio
lies outside 1 +- max(tol, spread).
"""

import argparse
import fnmatch
import json
import math
import sys


def medians(path, pattern):
    """{(workload label, implementation): median ms} of one bench.py JSON file, and the file's commit."""
    with open(path) as f:
        data = json.load(f)
    data = data.get("full") or data  # bench.py --json wraps the run as {"full": ..., "loop": ...}; results/ does not
    table = {}
    for w in data["workloads"]:
        for impl, r in w["results"].items():
            if fnmatch.fnmatch(impl, pattern) and r.get("median_ms") is not None:
                table[(w["label"], impl)] = r["median_ms"]
    return table, data.get("git_commit", "?")


def ratios(before, after):
    return {key: after[key] / before[key] for key in sorted(before.keys() & after.keys())}


def geomean(values):
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--repeat", help="a second run of BEFORE: the run-to-run spread")
    parser.add_argument("--impls", default="cupyffn-*", help="fnmatch pattern of implementations (default cupyffn-*)")
    parser.add_argument("--tol", type=float, default=0.02, help="allowed |ratio - 1| (default 0.02)")
    args = parser.parse_args(argv)

    before, c0 = medians(args.before, args.impls)
    after, c1 = medians(args.after, args.impls)
    r = ratios(before, after)
    if not r:
        sys.exit("no (workload, implementation) pair is in both files")
    spread = {}
    if args.repeat:
        again, _ = medians(args.repeat, args.impls)
        spread = {k: abs(v - 1) for k, v in ratios(before, again).items()}
    print(f"after ({c1}) / before ({c0}), median times; tolerance {args.tol:.1%}"
          + (" or the repeat run's spread where larger" if spread else ""))
    print(f"{'workload':10s} {'implementation':28s} {'before ms':>10s} {'after ms':>10s} {'ratio':>7s}"
          + (f" {'spread':>7s}" if spread else ""))
    outside = []
    for (label, impl), ratio in r.items():
        allowed = max(args.tol, spread.get((label, impl), 0.0))
        flag = "" if abs(ratio - 1) <= allowed else "  outside"
        if flag:
            outside.append((label, impl, ratio))
        extra = f" {spread[(label, impl)]:7.1%}" if (label, impl) in spread else ""
        print(f"{label:10s} {impl:28s} {before[(label, impl)]:10.4f} {after[(label, impl)]:10.4f} {ratio:7.3f}"
              f"{extra}{flag}")
    print(f"{len(r)} pairs: geomean ratio {geomean(r.values()):.4f}, min {min(r.values()):.3f}, "
          f"max {max(r.values()):.3f}; {len(outside)} outside the tolerance")
    if spread:
        print(f"repeat run of before: median |spread| {sorted(spread.values())[len(spread) // 2]:.1%}, "
              f"max {max(spread.values()):.1%}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
