"""What a cuBLASLt engine is built for: `LtKey` (its plan cache's key; pure data, imported without the GPU)."""

from typing import NamedTuple


class LtKey(NamedTuple):
    """What a plan is built for (the plan cache's key)."""

    device: int
    tokens: int
    dim: int
    hidden_dim: int
    act: str            # dtype name of the activations (grad_output, hidden_states, linear1_out, gelu_out, outputs)
    weights: str        # dtype name of the weights as given ("float32" master weights, or act)
    grads: str          # dtype name of the weight and bias gradients ("float32", or weights); forward: act
    bias1: bool         # forward: bias1 given; backward: bias gradients wanted
    bias2: bool
    need_grad_hidden: bool = True
    need_weight_grads: bool = True
    recompute_gelu: bool = False  # backward: gelu_out not given (memory mode)
    weights_transposed: bool = False  # weights stored [in, out] (transformers' Conv1D)
    grads_transposed: bool = False    # backward: weight gradients written [in, out], as such weights are stored
