"""Shared by dev/pair_plan_ab.py and dev/streams_ab.py: the official shape's rotated input sets and output sets, and
whole calls of several plans timed alternately, each sample the GPU's span of one call (dev/io_graph_ab.py's `sample`: the L2
flushed, a spin kernel ahead of the events)."""

import statistics

from io_graph_ab import SPIN, sample  # dev/ (the tools' folder is on sys.path)


def input_sets(cupy, tokens, count=3):
    """`count` sets of the backward's inputs at the official D and H (cupyffn.workloads.make_inputs, seeds 10 T + k)
    on the GPU, each a list in INPUT_NAMES order."""
    from cupyffn import workloads as W

    sets = []
    for k in range(count):
        inputs = {n: cupy.asarray(v) for n, v in W.make_inputs((tokens,), seed=10 * tokens + k).items()}
        sets.append([inputs[n] for n in W.INPUT_NAMES])
    return sets


def output_sets(cupy, tokens, count=3):
    """`count` sets of the backward's float32 outputs at the official D and H (grad_hidden, grad_weight1,
    grad_weight2), uninitialized."""
    from cupyffn import workloads as W

    D, H = W.DIM, W.HIDDEN_DIM
    return [[cupy.empty(shape, cupy.float32) for shape in ((tokens, D), (H, D), (D, H))] for _ in range(count)]


def alternated_medians(cupy, stream, calls, reps, warmup=3):
    """{name: median ms} of `calls` ({name: call(i)}, each enqueueing call number i on `stream`): `warmup` calls of
    each, then `reps` rounds in which every call is sampled once, in the dict's order."""
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    spin = cupy.RawKernel(SPIN, "spin")
    for call in calls.values():
        for i in range(warmup):
            call(i)
    got = {name: [] for name in calls}
    for i in range(reps):
        for name, call in calls.items():
            ms, _ = sample(cupy, stream, lambda: call(i), lambda: flush_buf.fill(1), spin, True)
            got[name].append(ms)
    return {name: round(statistics.median(v), 4) for name, v in got.items()}
