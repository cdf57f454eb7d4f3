"""Host time per call of the CuPy path, for an A/B of two checkouts in separate processes (GPU only).

    PYTHONPATH=<checkout> python3 dev/host_ab.py LABEL

Per precision at T=256 (D=1536, H=6144): a plan call with out= (graph=False and graph=True) and the
functional call; median over 300 calls of the time to issue one call with the queue drained first
(bench.py --loop's host-time method). Prints one JSON line.
"""

import argparse
import json
import statistics
import sys
import time

import cupy

import cupyffn
from cupyffn import workloads as W


def host_us(run, stream, calls=300):
    for _ in range(10):
        run()
    samples = []
    for _ in range(calls):
        stream.synchronize()
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    stream.synchronize()
    return statistics.median(samples) * 1e6


def main(label):
    T = 256
    inputs = W.make_inputs((T,), xp=cupy, seed=3)
    args = [inputs[n] for n in W.INPUT_NAMES]
    out = (cupy.empty((T, W.DIM), cupy.float32), cupy.empty((W.HIDDEN_DIM, W.DIM), cupy.float32),
           cupy.empty((W.DIM, W.HIDDEN_DIM), cupy.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    result = {"label": label, "cupyffn_file": cupyffn.__file__}
    for p in ("bf16x3", "tf32"):
        for graph in (False, True):
            plan = cupyffn.GeluFFNBackward(T, W.DIM, W.HIDDEN_DIM, precision=p, graph=graph)
            result[f"{p}{'-graph' if graph else ''}"] = host_us(lambda: plan(*args, out=out, stream=stream), stream)
            plan.close()
        result[f"{p}-functional"] = host_us(
            lambda: cupyffn.gelu_ffn_backward(*args, precision=p, out=out, stream=stream), stream)
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", help="names this checkout in the printed JSON line")
    main(parser.parse_args(sys.argv[1:]).label)
