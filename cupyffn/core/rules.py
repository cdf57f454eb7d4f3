"""The shape, dtype and precision rules of a call, over shapes (tuples of ints) and dtype names (strings) only, so
that they run wherever a call's arguments have a shape and a dtype but maybe no memory: the door's arrays
(cupyffn/api/validate.py, which adds the rules that need memory: device, layout, out=, overlap), JAX tracers
(cupyffn/jax.py) and torch FakeTensors and meta tensors (cupyffn/frameworks/torch_ops.py's fake implementations).
So a bad shape or dtype reads the same from every entry point, at call or trace time. What the rules are:
cupyffn/api/validate.py's module docstring.

Arguments come in `inputs_of(kind)` order, None for an absent one.
"""

from .results import BACKWARD_INPUTS, FORWARD_INPUTS

ACTIVATIONS = ("float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")


def inputs_of(kind):
    return FORWARD_INPUTS if kind == "forward" else BACKWARD_INPUTS


def check(kind, dtypes, shapes, precision=None):
    """`check_dtypes`, `check_shapes` and `check_precision` in the door's order: (act, weights, lead, dim, hidden)."""
    act, weights = check_dtypes(kind, dtypes)
    lead, dim, hidden = check_shapes(kind, shapes)
    check_precision(act, precision)
    return act, weights, lead, dim, hidden


def check_needs(need_grad_hidden, need_weight_grads, need_bias_grads):
    """A backward must compute something."""
    if not (need_grad_hidden or need_weight_grads or need_bias_grads):
        raise ValueError("need_grad_hidden, need_weight_grads and need_bias_grads are all False: there is nothing to "
                         "compute")


def dtype_error(name, want, got):
    return TypeError(f"{name} must be {want}; got {got}")


def check_dtypes(kind, dtypes):
    """(activation dtype, weights' dtype) after checking every input's dtype name against them. A name that is no
    plain dtype name (the door names a byte-swapped float32 '>f4') matches none."""
    names = inputs_of(kind)
    act, first_name = dtypes[0], names[0]
    if act not in ACTIVATIONS:
        raise dtype_error(first_name, "float32 (or bfloat16 / float16: docs/precisions.md)", act)
    wt = dtypes[names.index("weight1")]
    weights = ("float32",) if act == "float32" else ("float32", act)
    if wt not in weights:
        raise dtype_error("weight1", " or ".join(weights) + (f" with {act} activations" if act != "float32" else ""),
                          wt)
    for n, d in zip(names, dtypes):
        if d is None or n in (first_name, "weight1"):
            continue
        if n == "weight2":
            if d != wt:
                raise dtype_error(n, wt + (" (weight1's dtype)" if act != "float32" else ""), d)
        elif n in ("bias1", "bias2"):
            # the weights' dtype, or float32 master biases beside 16-bit weights (the engine rounds them in its call)
            allowed = tuple(dict.fromkeys((wt, "float32")))
            if d not in allowed:
                raise dtype_error(n, " or ".join(allowed) + (" (weight1's dtype" + (" or float32)" if len(allowed) > 1
                                                                                   else ")") if act != "float32"
                                                             else ""), d)
        elif d != act:
            raise dtype_error(n, act + (f" ({first_name}'s dtype)" if act != "float32" else ""), d)
    if act in HALF and kind == "backward" and dtypes[names.index("tanh_inner")] is not None:
        raise ValueError("tanh_inner must be None with bfloat16/float16 activations: these plans recompute the GELU "
                         "derivative from linear1_out inside GEMM1 (cuBLASLt's DGELU epilogue)")
    return act, wt


def check_shapes(kind, shapes):
    """(leading dimensions, D, H) after checking every input's shape against them."""
    names = inputs_of(kind)
    first, first_name = shapes[0], names[0]
    if len(first) < 1 or first[-1] < 1:
        raise ValueError(f"{first_name} must have shape [..., dim] with dim >= 1; got {first}")
    dim, lead = first[-1], first[:-1]
    if kind == "backward" and shapes[1] != first:
        raise ValueError(f"hidden_states must have the shape of grad_output {first}; got {shapes[1]}")
    w1, w2 = shapes[names.index("weight1")], shapes[names.index("weight2")]
    if len(w1) != 2 or w1[1] != dim:
        raise ValueError(f"weight1 must have shape (hidden_dim, dim) with dim = {first_name}.shape[-1] = {dim} "
                         f"and hidden_dim >= 1; got {w1}")
    hidden = w1[0]
    if hidden < 1:
        raise ValueError(f"weight1 has no rows (shape {w1}): hidden_dim, its first dimension, must be >= 1")
    if w2 != (dim, hidden):
        raise ValueError(f"weight2 must have shape (dim, hidden_dim) = {(dim, hidden)} to match {first_name} "
                         f"{first} and weight1 {w1}; got {w2}")
    act_shape = lead + (hidden,)
    for n, s in zip(names, shapes):
        if s is None:
            continue
        if n in ("linear1_out", "tanh_inner", "gelu_out") and s != act_shape:
            raise ValueError(f"{n} must have shape {act_shape} ({first_name}'s leading dimensions {lead} + hidden_dim "
                             f"{hidden} from weight1 {w1}); got {s}")
        if n in ("bias1", "bias2"):
            length = hidden if n == "bias1" else dim
            if s != (length,):
                raise ValueError(f"{n} must have shape ({length},); got {s}")
    return lead, dim, hidden


def check_precision(act, precision):
    """`precision` (a name, or None) is for float32 activations: 16-bit ones are multiplied as they are."""
    if act != "float32" and precision is not None:
        raise ValueError(f"precision= chooses how float32 operands are multiplied; {act} activations are multiplied "
                         f"as they are (bf16/fp16 tensor cores, fp32 accumulation): pass precision=None")
