"""Where the 16-bit/bias layer's host time goes (GPU machine; a measurement, not a test):

    PYTHONPATH=. python3 dev/profile_lt_host.py [--tokens 256] [--calls 200]

Times the torch layer's backward (GeluFFN.from_linears of SD3.5's MLP under bf16 autocast, the graph retained)
per call on the host, the queue drained before each call, and prints cProfile's top functions by own time.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import cupyffn.torch as ct


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    l1, l2 = torch.nn.Linear(1536, 6144).cuda(), torch.nn.Linear(6144, 1536).cuda()
    ffn = ct.GeluFFN.from_linears(l1, l2)
    x = torch.randn(a.tokens, 1536, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ffn(x)
    dy = torch.randn_like(y)

    def call():
        for t in (x, l1.weight, l2.weight, l1.bias, l2.bias):
            t.grad = None
        y.backward(dy, retain_graph=True)

    times = []
    for _ in range(a.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append(1e6 * (time.perf_counter() - t0))
    print(f"host us per backward at T = {a.tokens}: median {statistics.median(times[10:]):.0f}")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
