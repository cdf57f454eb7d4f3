"""Compile sm90 GEMM variants in parallel into CuPy's kernel cache (GPU machine; a warm-up, not a test):

    PYTHONPATH=. python3 dev/sm90_precompile.py [--match REGEX] [--jobs 12]

Each variant of cupyffn.gemm.sm90 is its own NVRTC program (0.3-3 s each, one core), compiled on first use; a test
run or a benchmark that touches many of them spends minutes compiling one after another. This compiles the
variants whose name expression matches REGEX (default: all of VARIANTS), one process per job, each through the
launcher's own module(), so CuPy's disk cache then holds exactly what the next process would build. Prints the count and the wall time; exits 1 if any variant failed to compile.
"""

import argparse
import re
import sys
import time


def _compile(name):
    import cupy

    from cupyffn.gemm import sm90

    try:
        sm90.module(next(c for c in sm90.VARIANTS if c.expression == name), cupy.cuda.Device().id)
        return name, None
    except Exception as e:  # reported by the parent, with the variant's name
        return name, f"{type(e).__name__}: {e}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default="", help="regular expression on the name expressions (re.search)")
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args(argv)
    import multiprocessing

    from cupyffn.gemm import sm90

    names = [c.expression for c in sm90.VARIANTS if re.search(args.match, c.expression)]
    start = time.perf_counter()
    # spawn: each worker makes its own CUDA context (a forked one would inherit none that works)
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        results = pool.map(_compile, names, chunksize=1)
    failed = [(n, err) for n, err in results if err]
    print(f"sm90 precompile: {len(names) - len(failed)} of {len(names)} variants in {time.perf_counter() - start:.1f} s")
    for n, err in failed:
        print(f"FAILED {n}: {err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
