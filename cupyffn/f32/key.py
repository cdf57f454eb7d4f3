"""What a float32 engine is built for: `F32BackwardKey` (cupyffn/f32/engine.py `GpuEngine`) and `F32ForwardKey`
(cupyffn/f32/forward.py `GpuForward`), its plan cache's key (pure data, imported without the GPU)."""

from typing import NamedTuple


class F32BackwardKey(NamedTuple):
    device: int
    tokens: int
    dim: int
    hidden_dim: int
    precision: str      # the precision's name
    need_grad_hidden: bool
    need_weight_grads: bool
    need_bias_grads: bool


class F32ForwardKey(NamedTuple):
    device: int
    tokens: int
    dim: int
    hidden_dim: int
    precision: str
    bias2: bool         # bias2 given: the output starts as its rows
