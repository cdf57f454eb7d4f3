"""What a cuBLASLt engine is built for: `LtForwardKey` and `LtBackwardKey`, its plan cache's key (pure data, imported
without the GPU)."""

from typing import NamedTuple


class LtForwardKey(NamedTuple):
    """What a forward plan is built for."""

    device: int
    tokens: int
    dim: int
    hidden_dim: int
    act: str            # dtype name of the activations (hidden_states and the outputs)
    weights: str        # dtype name of the weights as given ("float32" master weights, or act)
    has_bias1: bool     # bias1 given: GEMM1's epilogue adds it
    has_bias2: bool
    weights_transposed: bool = False  # weights stored [in, out] (transformers' Conv1D)
    biases: str = ""    # dtype name of the biases given ("float32" master biases, or act; "": none given)


class LtBackwardKey(NamedTuple):
    """What a backward plan is built for."""

    device: int
    tokens: int
    dim: int
    hidden_dim: int
    act: str            # dtype name of the activations (grad_output, hidden_states, linear1_out, gelu_out, grad_hidden)
    weights: str        # dtype name of the weights as given ("float32" master weights, or act)
    grads: str          # dtype name of the weight and bias gradients ("float32", or weights)
    bias_grads: bool    # grad_bias1 and grad_bias2 wanted (the GEMMs' BGRAD epilogues)
    need_grad_hidden: bool = True
    need_weight_grads: bool = True
    recompute_gelu: bool = False      # gelu_out not given (memory mode)
    weights_transposed: bool = False  # weights stored [in, out] (transformers' Conv1D)
    grads_transposed: bool = False    # weight gradients written [in, out], as such weights are stored
