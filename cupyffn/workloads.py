"""The benchmark's 16 workloads, input generator, references and correctness check.

Used by bench.py and the tests (and usable by anyone reproducing the numbers). Arrays come from
`xp`, which is numpy or cupy.

Source: SOL-ExecBench L2/068 (gelu_approximate_feedforward_backward); workloads.json beside this
file holds the 16 official (batch, seq_len) pairs, their FLOP/byte counts, SOL figures and the
benchmark's per-workload tolerance (max_atol).

The benchmark's check (`check`): per output, an element matches when
|out - ref| <= max_atol + max_rtol * |ref| (ref: the plain-fp32 formula, no TF32; max_rtol = 1e-5);
the output passes when the matched fraction is >= 0.99, every element of out and ref is finite and
out is not all zeros against a non-zero ref. max_atol is per workload (0.025 at T = 256 up to 0.13
at T = 8192) and is only defined for the official token counts: `max_atol(T)` raises for any other
T unless `nearest=True` is asked for (the atol of the nearest official T, ties to the smaller,
tighter one), which is a choice of ours, not the benchmark's: callers on other shapes say so.
"""

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy

from .core import activation

_DATA = json.loads((Path(__file__).resolve().parent / "workloads.json").read_text())

DIM = _DATA["dim"]
HIDDEN_DIM = _DATA["hidden_dim"]
RTOL = _DATA["tolerance"]["max_rtol"]
REQUIRED_MATCH = _DATA["tolerance"]["required_matched_ratio"]

#: H200 ceilings used for SOL (dense bf16 tensor-core rate and HBM bandwidth, datasheet values).
H200_FLOPS = 989e12
H200_BYTES_PER_S = 4.8e12

INPUT_NAMES = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
OUTPUT_NAMES = ("grad_hidden_states", "grad_weight1", "grad_weight2")


class Workload(NamedTuple):
    batch_size: int
    seq_len: int
    tokens: int
    gflop: float
    h200_sol_ms: float
    max_atol: float                  # the benchmark's absolute tolerance for this workload
    b200_sol_ms: float               # the benchmark's own SOL on B200
    b200_scoring_baseline_ms: float  # the benchmark's T_b (optimized PyTorch, timed on B200)

    @property
    def label(self):
        return f"B{self.batch_size}xS{self.seq_len}"


WORKLOADS = tuple(Workload(w["batch_size"], w["seq_len"], w["tokens"], w["gflop"], w["h200_sol_ms"], w["max_atol"],
                           w["b200_sol_ms"], w["b200_scoring_baseline_ms"]) for w in _DATA["workloads"])

_ATOL_BY_TOKENS = {}
for _w in WORKLOADS:  # workloads with the same T share one tolerance (checked: the table is consistent)
    assert _ATOL_BY_TOKENS.setdefault(_w.tokens, _w.max_atol) == _w.max_atol, _w


def max_atol(tokens, nearest=False):
    """The benchmark's max_atol for T = `tokens` (an official token count).

    Other T have no official tolerance: ValueError, unless `nearest` is true, which gives the atol of the
    nearest official T (ties go to the smaller T, whose bound is tighter); that is our choice for shapes
    the benchmark does not have, and results checked with it must say so.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, (int, numpy.integer)) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative integer; got {tokens!r}")
    if tokens in _ATOL_BY_TOKENS:
        return _ATOL_BY_TOKENS[tokens]
    if not nearest:
        official = ", ".join(str(t) for t in sorted(_ATOL_BY_TOKENS))
        raise ValueError(f"no official max_atol for tokens={tokens} (official: {official}); pass atol= explicitly "
                         f"or max_atol(tokens, nearest=True)")
    best = min(_ATOL_BY_TOKENS, key=lambda t: (abs(t - tokens), t))
    return _ATOL_BY_TOKENS[best]


def flops(tokens, dim=DIM, hidden_dim=HIDDEN_DIM):
    """FLOP of the four GEMMs: 8 T D H."""
    return 8 * tokens * dim * hidden_dim


def min_bytes(tokens, dim=DIM, hidden_dim=HIDDEN_DIM):
    """Each fp32 input read once and each output written once: 4 (3 T D + 4 D H + 3 T H)."""
    return 4 * (3 * tokens * dim + 4 * dim * hidden_dim + 3 * tokens * hidden_dim)


def sol_ms(tokens, dim=DIM, hidden_dim=HIDDEN_DIM):
    """H200 speed of light (PROBLEM.md): max(FLOP / 989 TFLOP/s, min bytes / 4.8 TB/s), in ms."""
    return 1e3 * max(flops(tokens, dim, hidden_dim) / H200_FLOPS, min_bytes(tokens, dim, hidden_dim) / H200_BYTES_PER_S)


def sol_score(t_kernel, t_sol, t_baseline):
    """The benchmark's score: 1 at SOL, 0.5 at the baseline (torch.compile), 1 / (1 + (Tk - Ts) / (Tb - Ts))."""
    return 1.0 / (1.0 + (t_kernel - t_sol) / (t_baseline - t_sol))


def make_inputs(lead_shape, dim=DIM, hidden_dim=HIDDEN_DIM, xp=numpy, seed=0):
    """The benchmark's inputs: grad_output, hidden_states ~ N(0, 1); weights ~ 0.02 N(0, 1); the saved
    activations from the forward pass. Returns a dict of float32 arrays keyed by INPUT_NAMES.

    The forward is evaluated in float64 and rounded once, so the saved tensors are consistent and no
    TF32 setting can affect them.
    """
    lead_shape = tuple(lead_shape)
    rng = xp.random.default_rng(seed)
    f32 = numpy.float32

    def normal(shape, scale=1.0):
        return (scale * rng.standard_normal(shape, dtype=xp.float64)).astype(f32)

    grad_output = normal(lead_shape + (dim,))
    hidden_states = normal(lead_shape + (dim,))
    weight1 = normal((hidden_dim, dim), 0.02)
    weight2 = normal((dim, hidden_dim), 0.02)
    z = (hidden_states.reshape(-1, dim).astype(xp.float64) @ weight1.T.astype(xp.float64)).astype(f32)
    z64 = z.astype(xp.float64)
    t = activation.tanh_inner(z64, xp).astype(f32)
    g = activation.value(z64, t.astype(xp.float64)).astype(f32)
    act = lead_shape + (hidden_dim,)
    return {"grad_output": grad_output, "hidden_states": hidden_states, "weight1": weight1, "weight2": weight2,
            "linear1_out": z.reshape(act), "tanh_inner": t.reshape(act), "gelu_out": g.reshape(act)}


def reference(inputs, xp=numpy, dtype=numpy.float64):
    """The backward formula of PROBLEM.md in `dtype` (float64: the accuracy reference; float32: the
    benchmark's plain-fp32 reference, which must run without TF32). Returns three 2-D arrays."""
    dim = inputs["grad_output"].shape[-1]
    hidden_dim = inputs["weight1"].shape[0]
    dy, x, w1, w2 = (inputs[n].reshape(-1, inputs[n].shape[-1]).astype(dtype) for n in INPUT_NAMES[:4])
    z, t = (inputs[n].reshape(-1, hidden_dim).astype(dtype) for n in ("linear1_out", "tanh_inner"))
    g = inputs["gelu_out"].reshape(-1, hidden_dim).astype(dtype)
    grad_gelu = dy @ w2
    grad_w2 = dy.T @ g
    grad_linear1 = grad_gelu * activation.grad_reference(z, t)
    grad_hidden = grad_linear1 @ w1
    grad_w1 = grad_linear1.T @ x
    assert grad_hidden.shape == (dy.shape[0], dim)
    return grad_hidden, grad_w1, grad_w2


def forward_reference(hidden_states, weight1, weight2, xp=numpy):
    """The forward in float64: (output, linear1_out, tanh_inner, gelu_out) as 2-D arrays."""
    x, w1, w2 = (a.astype(xp.float64) for a in (hidden_states, weight1, weight2))
    z = x.reshape(-1, x.shape[-1]) @ w1.T
    t, g = activation.forward(z, xp)
    return g @ w2.T, z, t, g


class Check(NamedTuple):
    """The benchmark's verdict on one output, with the figures behind it."""

    passed: bool          # the benchmark's verdict
    matched: float        # fraction of elements with |out - ref| <= atol + rtol * |ref| (non-finite: not matched)
    finite: bool          # no NaN / Inf in out nor in ref
    nonzero: bool         # False when out is all zeros and ref is not (fails)
    max_abs_err: float    # max |out - ref32| (inf when anything is non-finite)
    err_over_atol: float  # max_abs_err / atol: below 1 means every element is inside the absolute bound
    atol: float
    rel_l2: float         # ||out - ref64|| / ||ref64|| (nan when no float64 reference was given)


def check(out, ref32, ref64=None, xp=numpy, *, tokens=None, atol=None, rtol=RTOL, required=REQUIRED_MATCH):
    """The benchmark's check of one output against the plain-fp32 reference `ref32`, done its way
    (differences and bounds in float32, 1 - exceeding / total as the matched fraction).

    The absolute tolerance is `atol`, or when it is None the official max_atol of T = `tokens`
    (ValueError for a T that is not official: pass atol explicitly). `ref64` (optional) adds the
    relative L2 error against float64. Returns a Check.
    """
    if atol is None:
        if tokens is None:
            raise ValueError("check needs tokens= (an official T, for its max_atol) or an explicit atol=")
        atol = max_atol(tokens)
    atol = float(atol)
    if not atol > 0 or not math.isfinite(atol):
        raise ValueError(f"atol must be a positive finite number; got {atol!r}")
    if out.size != ref32.size:
        raise ValueError(f"out has {out.size} elements, ref32 {ref32.size} (shapes {out.shape}, {ref32.shape})")
    x = out.reshape(ref32.shape).astype(numpy.float32, copy=False)
    y = ref32.astype(numpy.float32, copy=False)
    finite = bool(xp.isfinite(x).all()) and bool(xp.isfinite(y).all())
    nonzero = bool((x != 0).any()) or not bool((y != 0).any())
    total = x.size
    with numpy.errstate(invalid="ignore", over="ignore"):
        err = xp.abs(x - y)
        bound = xp.abs(y) * numpy.float32(rtol) + numpy.float32(atol)  # float32, as the benchmark computes it
        exceeds = int(((err > bound) | ~xp.isfinite(err)).sum()) if total else 0
    matched = max(0.0, min(1.0, 1.0 - exceeds / float(total))) if total else 1.0
    if not finite:
        max_err = math.inf
    else:
        max_err = float(err.max()) if total else 0.0
    rel = relative_l2(out, ref64, xp) if ref64 is not None else float("nan")
    passed = finite and nonzero and matched >= required
    return Check(passed, matched, finite, nonzero, max_err, max_err / atol, atol, rel)


def relative_l2(out, ref64, xp=numpy):
    """||out - ref|| / ||ref|| in float64 (0 when both are empty; inf when ref is zero and out is not)."""
    diff = float(xp.linalg.norm(out.reshape(ref64.shape).astype(xp.float64) - ref64))
    norm = float(xp.linalg.norm(ref64))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm
