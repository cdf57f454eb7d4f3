"""Inputs and outputs the GPU tests share (imported by them; tests/ is on sys.path under pytest's rootdir
conftest): fresh benchmark-style inputs on the device, and NaN-poisoned output buffers, so that a result that
was not written cannot pass."""

import numpy

from cupyffn import workloads as W


def make(tokens, dim, hidden, seed):
    """(the seven inputs in W.INPUT_NAMES order, the dict of them) of one workload shape, on the device."""
    import cupy

    inputs = W.make_inputs((tokens,), dim, hidden, xp=cupy, seed=seed)
    return [inputs[n] for n in W.INPUT_NAMES], inputs


def poisoned(tokens, dim, hidden):
    """NaN-filled fp32 (grad_hidden_states [T, D], grad_weight1 [H, D], grad_weight2 [D, H])."""
    import cupy

    return (cupy.full((tokens, dim), numpy.nan, cupy.float32), cupy.full((hidden, dim), numpy.nan, cupy.float32),
            cupy.full((dim, hidden), numpy.nan, cupy.float32))
