"""Where the 16-bit/bias layer's host time goes, beside torch eager's (GPU machine; a measurement, not a test):

    PYTHONPATH=. python3 dev/profile_lt_host.py [--tokens 256] [--calls 200]

SD3.5's MLP (dim 1536, hidden 6144, biases) under bf16 autocast, two ways on the same host: cupyffn's layer
(GeluFFN.from_linears) and torch eager's nn.Linear + GELU(tanh) + nn.Linear. For each, the host time of the forward
and of the backward (the graph retained, the parameters' gradients reset), per call with the queue drained first:
the median. Then cProfile's top functions by own time over the layer's backward calls.
"""

import argparse
import cProfile
import pstats

import torch
from _event_timing import host_median_us

import cupyffn.torch as ct


def host_us(run, calls):
    """Median host microseconds of run() over `calls` calls (the first 10 dropped), the queue drained before each."""
    return host_median_us(run, calls, torch.cuda.synchronize)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args(argv)
    l1, l2 = torch.nn.Linear(1536, 6144).cuda(), torch.nn.Linear(6144, 1536).cuda()
    blocks = {"cupyffn GeluFFN": ct.GeluFFN.from_linears(l1, l2),
              "torch eager": lambda x: l2(torch.nn.functional.gelu(l1(x), approximate="tanh"))}
    x = torch.randn(a.tokens, 1536, device="cuda", requires_grad=True)
    dy = torch.randn(a.tokens, 1536, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name, block in blocks.items():
        def forward(block=block):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return block(x)

        y = forward()

        def backward(y=y):
            for t in (x, l1.weight, l2.weight, l1.bias, l2.bias):
                t.grad = None
            y.backward(dy, retain_graph=True)

        calls[name] = backward
        print(f"{name}, T = {a.tokens}: host us per forward {host_us(forward, a.calls):.0f}, "
              f"per backward {host_us(backward, a.calls):.0f} (medians)")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        calls["cupyffn GeluFFN"]()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
