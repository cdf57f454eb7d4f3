"""What the forward and the backward take and return: their arguments' names, in order, and their results
`FFNForward` and `FFNGrads` (named tuples)."""

from typing import Any, NamedTuple

FORWARD_INPUTS = ("hidden_states", "weight1", "weight2", "bias1", "bias2")
FORWARD_OUTPUTS = ("output", "linear1_out", "tanh_inner", "gelu_out")
BACKWARD_INPUTS = ("grad_output", "hidden_states", "weight1", "weight2", "linear1_out", "tanh_inner", "gelu_out")
BACKWARD_OUTPUTS = ("grad_hidden_states", "grad_weight1", "grad_weight2", "grad_bias1", "grad_bias2")

#: a validated call's inputs by name (cupyffn/api/validate.py `Call.inputs`: their geometry, None where absent)
ForwardInputs = NamedTuple("ForwardInputs", [(n, Any) for n in FORWARD_INPUTS])
BackwardInputs = NamedTuple("BackwardInputs", [(n, Any) for n in BACKWARD_INPUTS])


class Outputs(NamedTuple):
    """What every engine is bound to write (`engine.bind(call, outputs)`, cupyffn/api/execute.py): the outputs as
    arrays and their addresses, in OUTPUTS order (None and 0 where not computed)."""

    arrays: Any
    pointers: Any


class FFNForward(NamedTuple):
    """Forward results; linear1_out, tanh_inner and gelu_out are what gelu_ffn_backward takes (tanh_inner is None
    for bfloat16 / float16 activations: their backward recomputes it)."""

    output: Any
    linear1_out: Any
    tanh_inner: Any
    gelu_out: Any


class _WeightGrads(NamedTuple):
    grad_hidden_states: Any
    grad_weight1: Any
    grad_weight2: Any


class FFNGrads(_WeightGrads):
    """Gradients of the FFN block; unpacks as (grad_hidden_states, grad_weight1, grad_weight2).

    ``grad_bias1`` [hidden_dim] and ``grad_bias2`` [dim] are attributes outside the tuple (so code that unpacks
    three values keeps working), set when ``need_bias_grads=True``. Any entry is None when it was not asked for
    (need_grad_hidden / need_weight_grads / need_bias_grads).
    """

    def __new__(cls, grad_hidden_states, grad_weight1, grad_weight2, grad_bias1=None, grad_bias2=None):
        self = super().__new__(cls, grad_hidden_states, grad_weight1, grad_weight2)
        self.grad_bias1, self.grad_bias2 = grad_bias1, grad_bias2
        return self

    def __repr__(self):
        return (f"FFNGrads(grad_hidden_states={self[0]!r}, grad_weight1={self[1]!r}, grad_weight2={self[2]!r}, "
                f"grad_bias1={self.grad_bias1!r}, grad_bias2={self.grad_bias2!r})")
