"""No GPU: the NumPy backend on reduced sizes, to smoke-test the harness (not cupyffn's GPU speed)."""

import statistics
import time

import numpy

import cupyffn
from cupyffn import workloads as W


def run_cpu(args):
    print("=" * 78)
    print("NO GPU: running cupyffn's NumPy backend on REDUCED sizes (D=256, H=1024).")
    print("These are CPU numbers for smoke-testing the harness, not cupyffn's GPU performance.")
    print("The check uses the max_atol of the nearest official T (these shapes have no official one).")
    print("=" * 78)
    dim, hidden = 256, 1024
    tokens = (64, 256) if args.quick else (64, 256, 1024)
    for T in tokens:
        inputs = W.make_inputs((T,), dim, hidden, seed=T)
        ref64 = W.reference(inputs)
        ref32 = W.reference(inputs, dtype=numpy.float32)
        atol = W.max_atol(T, nearest=True)
        print(f"\n## T={T} D={dim} H={hidden} (atol {atol})")
        for p in cupyffn.PRECISIONS:
            args_ = [inputs[n] for n in W.INPUT_NAMES]
            out = (numpy.full((T, dim), numpy.nan, numpy.float32), numpy.full((hidden, dim), numpy.nan, numpy.float32),
                   numpy.full((dim, hidden), numpy.nan, numpy.float32))
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                cupyffn.gelu_ffn_backward(*args_, precision=p, out=out)
                times.append((time.perf_counter() - t0) * 1e3)
            checks = [W.check(o, r32, r64, atol=atol) for o, r32, r64 in zip(out, ref32, ref64)]
            print(f"cupyffn-{p:8s} {statistics.median(times):9.2f} ms  check "
                  f"{'pass' if all(c.passed for c in checks) else 'FAIL'}  "
                  f"max|err|/atol {max(c.err_over_atol for c in checks):.3f}  "
                  f"max rel L2 {max(c.rel_l2 for c in checks):.2e}")
    return 0
