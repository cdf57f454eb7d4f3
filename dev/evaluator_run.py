"""NVIDIA's SOL-ExecBench evaluator on L2/068 with cupyffn's shipped solutions, in one command (GPU machine):

    python3 dev/evaluator_run.py [--out $OUT] [--wheels .whl] [--inputs consistent --inputs random]
                                 [--timeout 420] [--budget 540] [--no-precompile]

From the repository root, with the folder `--wheels` holding the harness and what it needs that the machine lacks
(WHEELS; the harness itself is a `pip wheel --no-deps` of github.com/NVIDIA/SOL-ExecBench's tree; docs/leaderboard.md
lists them and how to get them). No network is used. Steps, each logged to <out>/run.log:

1. versions: Python, the GPU and driver (nvidia-smi), torch, CuPy, NumPy, cuda-bindings, CUPTI;
2. install the wheels offline into a folder of its own (pip --target, put first on PYTHONPATH: nothing of the
   machine's is changed); click and rich (the harness's command line) only where they are not importable already;
   then import the harness, CUPTI, torch and CuPy as the evaluator will;
3. build the solutions as a user would: `python leaderboard/build.py` (self-contained solution.json files);
4. warm CuPy's kernel cache (dev/sm90_precompile.py, the variants in parallel), so that the evaluator's first
   correctness round does not compile them one after another (untimed either way; --no-precompile skips it);
5. the evaluator's own command line (`sol-execbench <problem folder> --solution ... -o traces.jsonl`),
   per input mode (consistent: leaderboard/L2_068, the benchmark's inputs; random: leaderboard/L2_068_random_inputs,
   the harness's own draws) and solution, tf32 first; a run that would not fit in what is left of --budget seconds
   is skipped and says so;
6. <out>/summary.md and summary.json (per run: status of each workload, latency, the worst error over atol, mean
   and geomean, % of the H200 SOL), and <out>/evaluator-runs.tar.gz (every trace file, each run's evaluator
   output, the solution.json files run). run.log, the summary and the archive are written even when a step fails.

Exit status 0 when every run that ran passed every workload, 1 otherwise.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: distribution name in wheel file names -> why the evaluator needs it
WHEELS = {
    "sol_execbench": "the harness (its CLI, evaluation driver, CUPTI timing)",
    "pydantic": "the harness's data models",
    "pydantic_core": "pydantic",
    "annotated_types": "pydantic",
    "typing_inspection": "pydantic",
    "typing_extensions": "pydantic (>= 4.14.1)",
    "cupti_python": "the harness's CUPTI timing (`from cupti import cupti`)",
}
#: importable module -> wheels to install when it is not importable on the machine (the harness's CLI)
IF_MISSING = {"click": ("click",), "rich": ("rich", "markdown_it_py", "mdurl", "pygments")}
INPUTS = {"consistent": "L2_068", "random": "L2_068_random_inputs"}
PRECISIONS = ("tf32", "fp16+fp8")


class Log:
    """Lines to stdout and to run.log at once, flushed as they come (a killed run keeps what it printed)."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")

    def run(self, cmd, env=None, timeout=None, log_to=None):
        """Runs `cmd`, its output into run.log (or into the file `log_to`, then its tail into run.log); returns
        (exit status, seconds); a timeout is status 124."""
        self(f"$ {' '.join(str(c) for c in cmd)}")
        start = time.perf_counter()
        try:
            proc = subprocess.run([str(c) for c in cmd], env=env, timeout=timeout, capture_output=True, text=True,
                                  cwd=ROOT)
            status, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            status = 124
            out = _text(e.stdout) + _text(e.stderr) + f"\n(killed after {timeout} s)\n"
        except OSError as e:
            status, out = 127, f"{type(e).__name__}: {e}\n"
        seconds = time.perf_counter() - start
        if log_to is not None:
            Path(log_to).write_text(out)
            out = "\n".join(out.splitlines()[-40:])
        self.file.write(out if out.endswith("\n") or not out else out + "\n")
        print(out[-4000:], flush=True)
        self(f"(exit {status}, {seconds:.1f} s)")
        return status, seconds


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def find_wheels(folder, names):
    """{name: wheel path} for each distribution `names` in `folder`; FileNotFoundError naming those missing."""
    found, missing = {}, []
    files = sorted(Path(folder).glob("*.whl")) if Path(folder).is_dir() else []
    for name in names:
        hits = [f for f in files if f.name.lower().startswith(name.lower() + "-")]
        if hits:
            found[name] = hits[-1]
        else:
            missing.append(name)
    if missing:
        raise FileNotFoundError(f"{folder} lacks wheels for {', '.join(missing)} "
                                f"(docs/leaderboard.md says how to download or build them)")
    return found


def summarize(traces, label):
    """One run's summary from its Trace dicts (the harness's JSONL lines): per workload its status, latency,
    reference latency and worst max|err| over the workload's max_atol; the counts; mean and geomean latency and the
    H200 SOL's share of the mean when every workload passed."""
    from cupyffn import workloads

    rows = []
    for t in traces:
        ev = t.get("evaluation") or {}
        axes = t["workload"]["axes"]
        tokens = axes["batch_size"] * axes["seq_len"]
        perf, corr = ev.get("performance") or {}, ev.get("correctness") or {}
        atol = t["workload"].get("tolerance", {}).get("max_atol")
        err = corr.get("max_absolute_error")
        rows.append({"workload": f"B{axes['batch_size']}xS{axes['seq_len']}", "tokens": tokens,
                     "status": ev.get("status", "no evaluation"), "latency_ms": perf.get("latency_ms"),
                     "reference_latency_ms": perf.get("reference_latency_ms"),
                     "max_abs_err": err, "err_over_atol": err / atol if err is not None and atol else None,
                     "has_nan": corr.get("has_nan"), "has_inf": corr.get("has_inf"),
                     "hardware": (ev.get("environment") or {}).get("hardware"),
                     "libs": (ev.get("environment") or {}).get("libs"),
                     "log": (ev.get("log") or "")[-2000:] if ev.get("status") != "PASSED" else ""})
    passed = sum(r["status"] == "PASSED" for r in rows)
    out = {"run": label, "workloads": len(rows), "passed": passed, "rows": rows}
    if rows and passed == len(rows):
        lat = [r["latency_ms"] for r in rows]
        sol = [workloads.sol_ms(r["tokens"]) for r in rows]
        out["mean_ms"] = sum(lat) / len(lat)
        out["geomean_ms"] = math.exp(sum(math.log(x) for x in lat) / len(lat))
        out["pct_of_h200_sol"] = 100 * (sum(sol) / len(sol)) / out["mean_ms"]
        out["worst_err_over_atol"] = max(r["err_over_atol"] for r in rows)
        out["reference_mean_ms"] = sum(r["reference_latency_ms"] for r in rows) / len(rows)
    return out


def exit_status(runs):
    """0 when some run ran and every run that ran passed every workload; 1 otherwise (an error, a failed workload,
    nothing run). Runs skipped for time do not count."""
    ran = [r for r in runs if "skipped" not in r]
    return 0 if ran and all("error" not in r and r["passed"] == r["workloads"] for r in ran) else 1


def markdown(runs, header):
    """summary.md: the header lines, one table of the runs, then each run's workloads."""
    lines = ["# NVIDIA SOL-ExecBench evaluator on L2/068, cupyffn's solutions", ""] + header + [""]
    lines += ["| run | passed | mean ms | geomean ms | % of H200 SOL (mean) | worst max err / atol "
              "| reference mean ms |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['run']} | {r.get('skipped') or r.get('error')} | | | | | |")
            continue
        if "mean_ms" in r:
            lines.append(f"| {r['run']} | {r['passed']}/{r['workloads']} | {r['mean_ms']:.4f} | "
                         f"{r['geomean_ms']:.4f} | {r['pct_of_h200_sol']:.1f} | {r['worst_err_over_atol']:.3f} | "
                         f"{r['reference_mean_ms']:.4f} |")
        else:
            lines.append(f"| {r['run']} | {r['passed']}/{r['workloads']} | | | | | |")
    for r in runs:
        if not r.get("rows"):
            continue
        lines += ["", f"## {r['run']}", "", "| workload | T | status | latency ms | reference ms | max err / atol |",
                  "|---|---|---|---|---|---|"]
        for w in r["rows"]:
            lat = "" if w["latency_ms"] is None else f"{w['latency_ms']:.4f}"
            ref = "" if w["reference_latency_ms"] is None else f"{w['reference_latency_ms']:.4f}"
            err = "nan/inf" if w["has_nan"] or w["has_inf"] else (
                "" if w["err_over_atol"] is None else f"{w['err_over_atol']:.3f}")
            lines.append(f"| {w['workload']} | {w['tokens']} | {w['status']} | {lat} | {ref} | {err} |")
        failed = [w for w in r["rows"] if w["log"]]
        for w in failed[:3]:
            lines += ["", f"{w['workload']} ({w['status']}):", "```", w["log"].strip(), "```"]
    return "\n".join(lines) + "\n"


def versions(log, env):
    log("== versions")
    log.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv"], env=env)
    code = ("import sys, importlib.metadata as m\n"
            "print('python', sys.version.split()[0], sys.executable)\n"
            "for d in ('torch', 'cupy-cuda13x', 'cupy-cuda12x', 'numpy', 'cuda-bindings', 'cuda-pathfinder',\n"
            "          'nvidia-cuda-cupti', 'nvidia-cuda-nvrtc', 'nvidia-cublas', 'cupti-python', 'pydantic',\n"
            "          'click', 'rich', 'sol-execbench'):\n"
            "    try: print(d, m.version(d))\n"
            "    except m.PackageNotFoundError: print(d, '-')\n")
    log.run([sys.executable, "-c", code], env=env)
    log.run(["git", "-C", str(ROOT), "log", "-1", "--format=commit %H %cd %s"], env=env)


def install(log, wheels, site, env):
    """Installs the harness's wheels into `site`; returns False (logged) when something cannot be installed."""
    log("== install into", site)
    try:
        picked = find_wheels(wheels, WHEELS)
        for module, names in IF_MISSING.items():
            if subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode:
                log(f"{module} is not importable here: installing {', '.join(names)} from {wheels}")
                picked.update(find_wheels(wheels, names))
            else:
                log(f"{module}: the machine's own")
    except FileNotFoundError as e:
        log("ERROR:", e)
        return False
    for name, path in picked.items():
        log(f"  {path.name}  ({WHEELS.get(name, 'the harness CLI')})")
    status, _ = log.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", site,
                         *picked.values()], env=env)
    if status:
        return False
    check = ("import sol_execbench, pydantic, click, rich, torch, cupy, cupyffn\n"
             "from cupti import cupti\n"
             "from sol_execbench.core.bench import timing\n"
             "print('sol_execbench', sol_execbench.__file__)\n"
             "print('pydantic', pydantic.VERSION, 'cupti', cupti.__name__)\n"
             "print('torch', torch.__version__, torch.version.cuda, 'cuda available', torch.cuda.is_available())\n"
             "print('cupy', cupy.__version__, 'cupyffn', cupyffn.__file__, cupyffn.gpu_unavailable_reason())\n"
             "assert torch.cuda.is_available(), 'torch sees no GPU'\n")
    status, _ = log.run([sys.executable, "-c", check], env=env)
    return status == 0


def python_shim(folder):
    """`folder`/python, which runs this interpreter: the harness starts its driver as `python eval_driver.py`, and
    `folder` goes first on its PATH. A script, not a symlink: a virtual environment's interpreter reached through a
    link elsewhere does not find its pyvenv.cfg and starts without the environment's packages (torch)."""
    shim = Path(folder) / "python"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    return shim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "evaluator-out"),
                        help="results folder (default $OUT, else ./evaluator-out)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of wheels (default %(default)s)")
    parser.add_argument("--inputs", action="append", choices=list(INPUTS),
                        help="input modes to run (repeatable; default: consistent, then random)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds for one evaluator run (its --timeout)")
    parser.add_argument("--budget", type=int, default=540,
                        help="seconds for the whole script: a run that would not fit in what is left is skipped")
    parser.add_argument("--no-precompile", action="store_true", help="skip warming CuPy's kernel cache")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run.log")
    work = Path(tempfile.mkdtemp(prefix="cupyffn-evaluator-"))
    runs_dir = work / "runs"
    runs_dir.mkdir()
    site, shims = work / "site", work / "bin"
    shims.mkdir()
    python_shim(shims)
    # The evaluator runs see the installed wheels and the machine's packages, not this checkout: the solutions
    # carry their own cupyffn. The steps before it (the import check, the cache warm-up) use the checkout's.
    given = [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(site)] + given))
    env_repo = dict(env, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)] + given))
    sys.path.insert(0, str(ROOT))  # cupyffn.workloads, for the summary's SOL figures
    header = [f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, repository {ROOT}"]
    runs = []
    try:
        versions(log, env_repo)
        if not install(log, args.wheels, site, env_repo):
            runs.append({"run": "install", "error": "the harness could not be installed or imported (run.log)"})
            return 1
        log("== build the solutions")
        solutions = work / "solutions"
        status, _ = log.run([sys.executable, "leaderboard/build.py", "--out", solutions], env=env)
        if status:
            runs.append({"run": "build", "error": "leaderboard/build.py failed (run.log)"})
            return 1
        if not args.no_precompile:
            log("== warm CuPy's kernel cache")
            log.run([sys.executable, "dev/sm90_precompile.py"], env=env_repo, timeout=180)
        longest = 0.0
        for mode in args.inputs or list(INPUTS):
            for precision in PRECISIONS:
                label = f"{precision}, {mode} inputs"
                left = args.budget - (time.perf_counter() - start)
                if left < max(longest, 30):
                    log(f"== {label}: skipped, {left:.0f} s left of the budget")
                    runs.append({"run": label, "skipped": f"skipped: {left:.0f} s left of --budget"})
                    continue
                slug = precision.replace("+", "-")
                traces = runs_dir / f"traces-{slug}-{mode}.jsonl"
                log(f"== evaluator: {label}")
                cmd = [site / "bin" / "sol-execbench", f"leaderboard/{INPUTS[mode]}",
                       "--solution", solutions / f"cupyffn-{slug}" / "solution.json", "-o", traces,
                       "--timeout", int(min(args.timeout, left - 10)), "--verbose"]
                status, seconds = log.run(cmd, env=env, timeout=min(args.timeout, left - 10) + 30,
                                          log_to=runs_dir / f"evaluator-{slug}-{mode}.log")
                longest = max(longest, seconds)
                if traces.is_file():
                    summary = summarize([json.loads(x) for x in traces.read_text().splitlines() if x.strip()], label)
                    summary["seconds"] = round(seconds, 1)
                    runs.append(summary)
                    log(f"{label}: {summary['passed']}/{summary['workloads']} passed"
                        + (f", mean {summary['mean_ms']:.4f} ms, geomean {summary['geomean_ms']:.4f} ms"
                           if "mean_ms" in summary else ""))
                else:
                    runs.append({"run": label, "error": f"no traces (exit {status}; evaluator log in the archive)"})
        return exit_status(runs)
    except Exception as e:  # logged, and the summary and archive are still written
        log("ERROR:", f"{type(e).__name__}: {e}")
        runs.append({"run": "script", "error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        cards = {w["hardware"] for r in runs for w in r.get("rows", ()) if w.get("hardware")}
        header.append(f"card(s): {', '.join(sorted(cards)) or 'unknown'}; {time.perf_counter() - start:.0f} s in all")
        (out / "summary.json").write_text(json.dumps({"header": header, "runs": runs}, indent=1) + "\n")
        (out / "summary.md").write_text(markdown(runs, header))
        with tarfile.open(out / "evaluator-runs.tar.gz", "w:gz") as tar:
            tar.add(runs_dir, arcname="runs")
            for sol in sorted((work / "solutions").glob("*/solution.json")):
                tar.add(sol, arcname=f"solutions/{sol.parent.name}/solution.json")
        log(f"wrote {out / 'summary.md'}, {out / 'summary.json'}, {out / 'evaluator-runs.tar.gz'}")
        log.file.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
