"""The front door of the functions: `gelu_ffn_forward` and `gelu_ffn_backward` (and the plans and layers, which call
`run`). A call goes through three stages, each entered once: validate (cupyffn/api/validate.py `check`: the arrays
checked into a Call, or a call with the same signature recalled), route (cupyffn/api/routes.py `route`: asked once per
new signature, remembered beside the call) and execute (cupyffn/api/execute.py `run`: the engine from its cache, the
outputs, the launches). `clear_cache` drops every remembered call and cached engine
(docs/decisions/062-door-in-three-stages.md).
"""

from ..core import precision as _precision
from . import execute, routes
from . import validate as _validate
from .validate import Request


def clear_cache():
    """Drop the plans `gelu_ffn_backward` and `gelu_ffn_forward` keep (waiting for their last calls; their device
    memory goes back to CuPy's pool). Plans captured into a CUDA graph stay (see ``release_captured_plans``);
    plans in use by another thread are closed when that call ends."""
    _validate.forget()
    execute.clear_engines()


def run(request, args, out, stream, check_activations=False, grad_hidden_ready=None, plan=None, graphs=None):
    """The door: validate (or recall) `args` for `request`, route, execute. `plan`: a GeluFFNBackward whose own engine
    runs the call (its route checks the call is of its shape); `graphs`: a graph policy that replaces the route's for
    this call (the plan's stage profile runs without graphs)."""
    call, remembered = _validate.check(request, args, out, stream, grad_hidden_ready, 0 if plan is None else plan.token)
    route = remembered.route
    if route is None:
        route = remembered.route = routes.route(call, plan)
    if graphs is not None:
        route = route._replace(graphs=graphs)
    return execute.run(call, route, out, stream, check_activations, plan)


# ---------------------------------------------------------------------- the functions
def gelu_ffn_forward(hidden_states, weight1, weight2, *, bias1=None, bias2=None, precision=None, out=None,
                     stream=None):
    """Forward pass ``output = gelu_tanh(hidden_states @ weight1.T + bias1) @ weight2.T + bias2``.

    Returns FFNForward(output, linear1_out, tanh_inner, gelu_out): ``linear1_out = x @ weight1.T + bias1``,
    ``tanh_inner = tanh(sqrt(2/pi) (z + 0.044715 z^3))``, ``gelu_out = 0.5 z (1 + tanh_inner)`` in fp32
    (GELU evaluated in fp32 from the GEMM's fp32 result), exactly what ``gelu_ffn_backward`` takes.

    float32 hidden_states: weights and biases (bias1 [H], bias2 [D], each optional) float32; `precision` treats the
    two GEMMs' operands as in the backward (same names and contracts; None, the default: the arrays' device's
    default, "fp16+fp8" on a GPU and "ieee", plain fp32, for NumPy arrays). bfloat16 / float16 hidden_states:
    weights and biases float32 (rounded to the activation dtype first, as torch's autocast does) or that dtype (biases
    may stay float32 beside 16-bit weights),
    precision None; the GEMMs run on the 16-bit operands with fp32 accumulation and cuBLASLt's fused bias and GELU
    epilogues; output, linear1_out and gelu_out come back in the activation dtype and tanh_inner is None (the
    backward recomputes it from linear1_out).

    `out` may give any of the four outputs (C-contiguous, the activation dtype, not overlapping the inputs; out[2]
    None with 16-bit activations); arrays, streams, CUDA stream capture (every output in `out`, one call of the
    shape outside the capture first) and failures (given outputs NaN-filled) as in ``gelu_ffn_backward``.
    """
    request = Request("forward", _precision.checked_name(precision))
    return run(request, (hidden_states, weight1, weight2, bias1, bias2), out, stream)


def gelu_ffn_backward(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None, *,
                      precision=None, out=None, stream=None, accumulate=False,
                      need_grad_hidden=True, need_weight_grads=True, need_bias_grads=False,
                      check_activations=False, grad_hidden_ready=None):
    """Backward pass of ``y = gelu_tanh(x @ weight1.T + bias1) @ weight2.T + bias2`` (biases optional).

    Parameters
    ----------
    grad_output : array [..., D]
        dL/dy.
    hidden_states : array [..., D]
        x, the block's input.
    weight1 : array [H, D]
        First linear layer, ``[out_features, in_features]`` (or the transpose of an ``[in, out]`` matrix, as
        transformers' Conv1D stores it: bfloat16 / float16 activations and NumPy only).
    weight2 : array [D, H]
        Second linear layer.
    linear1_out, tanh_inner, gelu_out : arrays [..., H]
        Saved forward tensors: ``z = x @ weight1.T + bias1``, ``t = tanh(sqrt(2/pi) * (z + 0.044715 z^3))``
        and ``0.5 * z * (1 + t)``. Every tensor given is used as given, in every precision: the
        gradients are the formula's on these very values, whether or not they agree with each other
        (``check_activations`` checks that they do). Memory mode: pass None for tanh_inner and/or
        gelu_out and they are recomputed from linear1_out (and tanh_inner, where given) inside the
        kernels (same results within the precision's contract).
    precision : {None, "bf16x3", "fp16+fp8", "ieee", "tf32", "bf16"}
        GEMM operand treatment of float32 activations; accuracy contracts in ``cupyffn.PRECISIONS``, what each does
        on each route in docs/precisions.md. None (the default): the default of the arrays' device, "fp16+fp8" on a
        GPU (``cupyffn.DEFAULT_PRECISION``) and "ieee", plain fp32, for NumPy arrays
        (``cupyffn.CPU_DEFAULT_PRECISION``: the fastest precision on the CPU, and the most accurate). Every name
        is valid for NumPy arrays too: the NumPy backend then rounds the operands as the GPU does, to reproduce its
        numerics (several times slower than "ieee"). The contracts hold for any T, D and H: a GEMM whose
        contraction length K (planes included) exceeds 24576 (``cupyffn.gemm.ksplit.MAX_K``) sums it in chunks
        added in fp32. bfloat16 / float16 activations take None (their operands are multiplied as they are).
    out : sequence of 3 arrays (5 with need_bias_grads), optional
        Where to write (grad_hidden_states, grad_weight1, grad_weight2[, grad_bias1, grad_bias2]): C-contiguous, the
        shapes of hidden_states, weight1, weight2, [H] and [D], not overlapping any input or each other;
        grad_hidden_states in the activation dtype, the weight and bias gradients float32 (16-bit activations:
        float32 or the weights' dtype, one for all). With weights given as transposed views of [in, out] matrices,
        grad_weight1 and grad_weight2 may be stored that way too (both; transposes of C-contiguous [in, out]
        arrays, the parameters' own layout: no copy follows), and one left None is then allocated so. An entry may
        be None to have it allocated (not during CUDA stream capture: there every computed output must be given).
        If the call fails after validation, the given arrays are filled with NaN, with accumulate=True too (a
        partial accumulation cannot be undone, so the gradients accumulated so far are lost); if that fill fails as
        well, the raised error says so. If validation fails they are untouched.
    stream : cupy.cuda.Stream, optional
        Stream to work on (default: CuPy's current stream). Results are ready on it when the call
        returns; the host is never synchronized, except when a call of a new shape evicts a cached plan
        (closing it waits for that plan's last call). The stream may be capturing a CUDA graph once a call
        of this shape and precision has run outside the capture (docs/cuda-graphs.md).
    accumulate : bool
        Add into ``out`` grad_weight1 / grad_weight2 (and the bias gradients) instead of overwriting them
        (grad_hidden_states is always overwritten).
    need_grad_hidden, need_weight_grads : bool
        Skip the work of gradients that are not needed.
    need_bias_grads : bool
        Also return ``grad_bias1`` (sum over tokens of grad_linear1, [H]) and ``grad_bias2`` (sum over tokens of
        grad_output, [D]) as attributes of the result. Biases do not change the backward's inputs: linear1_out is
        the pre-activation with bias1 added.
    check_activations : bool
        Before computing, test linear1_out and the tanh_inner / gelu_out given for NaN / Inf (every
        element), compare a sample of tanh_inner / gelu_out with the tanh-GELU of linear1_out, and raise
        ``cupyffn.ActivationMismatchError`` naming the likely cause (non-finite values, erf GELU, tanh's
        argument instead of its output, swapped or stale buffers). Synchronizes with the stream.
    grad_hidden_ready : cupy.cuda.Event, optional
        Recorded on the stream as soon as grad_hidden_states is written, before the weight gradients
        are finished (tensor parallelism: start its all-reduce on another stream with
        ``other.wait_event(grad_hidden_ready)`` while the weight-gradient GEMMs run). The call still
        returns everything ready on the stream. GPU only, needs need_grad_hidden=True; not with
        graph=True plans. Under a caller's CUDA stream capture the record is captured too (wait on
        it inside the same capture).

    Arrays may be NumPy (computed on the CPU), CuPy, or any DLPack / CUDA Array Interface producer
    (torch.Tensor, jax.Array), all on one device; activations float32, bfloat16 or float16 (with 16-bit ones,
    weights float32 or that dtype and tanh_inner None: docs/precisions.md). The last dimension must be contiguous
    and the leading dimensions must flatten to one row stride. Returns an FFNGrads named tuple (CuPy arrays for GPU
    inputs, NumPy arrays for NumPy inputs; the out= objects themselves where given).
    """
    request = Request("backward", _precision.checked_name(precision), bool(need_grad_hidden), bool(need_weight_grads),
                      bool(need_bias_grads), bool(accumulate))
    args = (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out)
    return run(request, args, out, stream, check_activations, grad_hidden_ready)
