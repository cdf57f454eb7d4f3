"""How a backward plan chooses its mechanisms: `EngineOptions`, one frozen object per plan.

A backward plan (`Plan`, cupyffn/f32/plan.py) reads its choices from the options it is built with, nothing
else. Every field left at its default (None for the switches) is "auto": the measured choice. The windows that
auto resolves to are one table, kept beside the code that uses them in cupyffn/f32/plan.py (`FUSED_GEMM1_TOKENS`,
`GELU_EPILOGUE_TOKENS`, `EPILOGUE_WARPS_TOKENS`, `CALL_GRAPH_TOKENS`, `CONVERT_AB_TOKENS`, `TWO_STREAMS_TOKENS`: per
operand format, the first and last T at which the mechanism runs; `SM90_PAIR_TOKENS`), each with its measurement and the
decision note in docs/decisions/ it comes from. True asks for a mechanism wherever it can run (the engine still
adds what the mechanism itself needs: the GPU, the format, the shape), False never; both are for comparisons
and measurements (the benchmark's A/B twins, tests), not a user feature.

  fused_gemm1     GEMM1 + dgelu as one sm90 kernel (FUSED_GEMM1_TOKENS; docs/decisions/025, 042)
  gelu_epilogue   memory mode: the fused GEMM1's epilogue also writes gelu_out for GEMM2 (GELU_EPILOGUE_TOKENS; 041)
  epilogue_warps  the fused GEMM1's epilogue in warps of its own (EPILOGUE_WARPS_TOKENS; 045)
  sm90_pair       fp16+fp8: which pair GEMMs run as the sm90 pair kernel: None the GEMMs and T in SM90_PAIR_TOKENS,
                  True every pair GEMM, False none (024)
  call_graph      eager calls as one re-pointed CUDA graph launch (CALL_GRAPH_TOKENS; 018)
  convert_ab      convert A and convert B as one launch (CONVERT_AB_TOKENS; 019)
  two_streams     the independent GEMMs (and convert B) on the engine's side stream beside the caller's
                  (TWO_STREAMS_TOKENS; 013, 064); off, every step on the caller's stream in issue order
  max_k           the longest K one GEMM accumulator sums (cupyffn/gemm/ksplit.py; docs/decisions/001):
                  ksplit.MAX_K by default, None (or 0) unbounded, for measuring what the K-chunks buy

Plans take them through ``plan_with_options(tokens, dim, hidden_dim, EngineOptions(...), ...)`` of
cupyffn/api/backward_plan.py (the benchmark's A/B twins and the tests), never through the public
``GeluFFNBackward``; the functions' plans use the defaults. They are arguments, never read from the environment.
"""

import dataclasses
from typing import Optional

from ..gemm import ksplit

#: The fields that turn one mechanism on or off (None: auto).
SWITCHES = ("fused_gemm1", "gelu_epilogue", "epilogue_warps", "sm90_pair", "call_graph", "convert_ab",
            "two_streams")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The mechanisms one backward plan uses (module docstring): None = auto (the measured windows), True
    wherever the mechanism can run, False never; `max_k` the longest K one accumulator sums (None: unbounded)."""

    fused_gemm1: Optional[bool] = None
    gelu_epilogue: Optional[bool] = None
    epilogue_warps: Optional[bool] = None
    sm90_pair: Optional[bool] = None
    call_graph: Optional[bool] = None
    convert_ab: Optional[bool] = None
    two_streams: Optional[bool] = None
    max_k: Optional[int] = ksplit.MAX_K

    def __post_init__(self):
        for name in SWITCHES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"EngineOptions.{name} must be None (auto), True or False; got {value!r}")
        k = self.max_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"EngineOptions.max_k must be None (unbounded) or an int; got {k!r}")
        if k is not None and (k < 0 or k % ksplit.ALIGN):
            raise ValueError(f"EngineOptions.max_k must be None or an integer >= 0, a multiple of "
                             f"{ksplit.ALIGN}; got {k!r}")
        # hashed once here, not per lookup
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self):
        return self._hash


#: The options of a plan nobody configured: every mechanism where its measured window puts it.
DEFAULT = EngineOptions()
