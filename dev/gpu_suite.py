"""The whole GPU check in one command (GPU machine): precompile, the suite, the failures again serially, a summary.

    CUPYFFN_GIT_COMMIT=<sha> PYTHONPATH=. python3 dev/gpu_suite.py [--workers 4] [--jobs 15] [--log PATH]

1. `dev/sm90_precompile.py --jobs JOBS`: every sm90 GEMM variant compiled into CuPy's cache, so that no test waits on
   NVRTC one variant after another.
2. `pytest -m gpu -n WORKERS --dist loadfile -rfE` (pytest-xdist; whole files per worker, so a file's module fixtures
   and the state its tests build up stay in one process, as in a serial run).
3. The failures of step 2 again, serially (`--lf`): a test that fails in both is a failure; one that passes serially
   is reported as well (it depends on what ran beside it in its worker).
4. `results/gpu-tests-<card>.txt` (or --summary): commit (CUPYFFN_GIT_COMMIT, else `git rev-parse HEAD`; the device
   machine's copy of the tree has no .git), date, card, driver and library versions, both summary lines, and the
   tests that failed.

The full pytest output goes to --log (default: $OUT/gpu-tests.log where $OUT is set, else none). Exit status 1 when a
variant failed to compile or a test failed in both runs, else 0.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pytest's last line, with -q bare ("3 failed, 998 passed, ... in 172.51s (0:02:52)"), else between "=" rules
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+|no tests ran) in [\d.]+s\b.*$", re.M)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def _pytest(args, log, env):
    """Run pytest with `args`; its output appended to `log` (a list of lines) and echoed. Returns the output."""
    cmd = [sys.executable, "-m", "pytest"] + args
    log.append(f"$ {' '.join(cmd)}")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    log.append(text)
    print(text[-4000:], flush=True)
    return text


def summary_line(text):
    """pytest's final summary ('3 failed, 940 passed, ...'), or a note that it printed none."""
    found = _SUMMARY.findall(text)
    return found[-1] if found else "(no pytest summary line: pytest did not finish)"


def failed_tests(text):
    """The node ids pytest's short summary (-rfE) lists as FAILED or ERROR, in order, once each."""
    return list(dict.fromkeys(_FAILED.findall(text)))


def environment():
    import cupy

    from benchmarks import gpu as _gpu
    from benchmarks import report as _report

    try:
        import torch
    except ImportError:
        torch = None
    env = _gpu.environment(cupy, torch)
    for name in ("jax", "transformers", "diffusers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env, _report.slug(env["device"])


def commit():
    from benchmarks import gpu as _gpu

    return _gpu.git_commit() or "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (-n)")
    parser.add_argument("--jobs", type=int, default=15, help="processes compiling sm90 variants")
    parser.add_argument("--summary", default=None, help="summary file (default results/gpu-tests-<card>.txt)")
    parser.add_argument("--log", default=None, help="full pytest output (default $OUT/gpu-tests.log)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    started = datetime.datetime.now(datetime.timezone.utc)
    log = []
    pre = subprocess.run([sys.executable, str(ROOT / "dev" / "sm90_precompile.py"), "--jobs", str(args.jobs)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    log.append(pre.stdout + pre.stderr)
    print(pre.stdout + pre.stderr, flush=True)
    with tempfile.TemporaryDirectory() as cache:  # its own last-failed record, whatever the checkout holds
        common = ["-m", "gpu", "-q", "-rfE", "-o", f"cache_dir={cache}", "-p", "no:randomly"]
        first = _pytest(common + ["-n", str(args.workers), "--dist", "loadfile"], log, env)
        first_failed = failed_tests(first)
        serial = _pytest(common + ["--lf"], log, env) if first_failed else None
    still = failed_tests(serial) if serial is not None else []
    flaky = [t for t in first_failed if t not in still]

    info, card = environment()
    lines = [
        f"cupyffn GPU suite: commit {commit()}",
        f"date {started.strftime('%Y-%m-%d %H:%M UTC')}, {(datetime.datetime.now(datetime.timezone.utc) - started).seconds} s",
        f"card {info['device']} ({info['sm_count']} SMs), driver {info['driver']}, CUDA runtime {info['cuda_runtime']}, "
        f"NVRTC {info['nvrtc']}, cuBLAS {info['cublas']}",
        f"python {info['python']}, numpy {info['numpy']}, cupy {info['cupy']}, torch {info['torch']} "
        f"(CUDA {info['torch_cuda']}), jax {info['jax']}, transformers {info['transformers']}, "
        f"diffusers {info['diffusers']}",
        f"precompile: {pre.stdout.strip().splitlines()[-1] if pre.stdout.strip() else 'no output'} (exit {pre.returncode})",
        f"suite (pytest -m gpu -n {args.workers} --dist loadfile): {summary_line(first)}",
        f"failures re-run serially: {summary_line(serial) if serial is not None else 'none to re-run'}",
        f"failed: {len(still)}",
    ]
    lines += [f"  FAILED {t}" for t in still]
    lines += [f"  passed serially after failing beside other files: {t}" for t in flaky]
    text = "\n".join(lines) + "\n"
    summary = Path(args.summary) if args.summary else ROOT / "results" / f"gpu-tests-{card}.txt"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(text)
    log_path = args.log or (os.path.join(os.environ["OUT"], "gpu-tests.log") if os.environ.get("OUT") else None)
    if log_path:
        Path(log_path).write_text("\n".join(log))
    print(text, flush=True)
    return 1 if still or pre.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
