"""Public backward API: `gelu_ffn_backward` (the functional entry point, with its cache of plans and the keys
they are cached by); `GeluFFNBackward` (a plan per shape) and `FFNGrads` live in cupyffn/_backward_plan.py."""

from . import backward_cpu as _backward_cpu, forward as _forward, lt_api as _lt_api, validate as _validate
from ..core import checks as _checks, plans as _plan_cache, precision as _precision
from .backward_gpu import stream_ptr as _stream_ptr
from .backward_plan import FFNGrads, GeluFFNBackward  # noqa: F401 (re-exported by the package)
from ..core.plans import PlanCache, release_captured_plans  # noqa: F401 (re-exported by the package)
from ..engine.options import EngineOptions


# ---------------------------------------------------------------------- functional API
_CACHE_SIZE = 4
_plans = PlanCache(_CACHE_SIZE)
# (signature, precision, flags, options) -> plan: skips validation and the shape lookup for repeated arrays.
# Like the plans, not keyed by stream: a warm-up on any stream serves a capture on another.
_recent = {}
_GPU_DEFAULT = _precision.lookup(_precision.DEFAULT)


def clear_cache():
    """Drop the plans `gelu_ffn_backward` and `gelu_ffn_forward` keep (waiting for their last calls; their
    device memory goes back to CuPy's pool). Plans captured into a CUDA graph stay (see
    ``release_captured_plans``); plans in use by another thread are closed when that call ends."""
    _recent.clear()
    _plans.clear()
    _forward.clear_cache()
    _lt_api.clear_cache()


def _no_plan_error(what):
    return RuntimeError(f"cupyffn: {what} was called during CUDA stream capture but no plan exists for this "
                        f"shape/precision; call it once outside the capture first (on any stream)")



def _plan_key(call, precision, need_grad_hidden, need_weight_grads, options, need_bias_grads=False):
    """The plan cache's key of `call`: device, shape, precision, flags and the EngineOptions the plan is built with
    (EngineOptions.from_env at each call: a plan built under another CUPYFFN_ENGINE is never reused)."""
    return (call.device, call.tokens, call.dim, call.hidden_dim, precision.name, need_grad_hidden,
            need_weight_grads, need_bias_grads, options)


def _recent_key(sig, precision, need_grad_hidden, need_weight_grads, options, need_bias_grads=False):
    """The key of `_recent` (the fast path for repeated arrays): the validated signature and the rest of the plan's
    key (_plan_key)."""
    return (sig, precision.name, need_grad_hidden, need_weight_grads, need_bias_grads, options)


def _acquire_plan(call, precision, stream, need_grad_hidden, need_weight_grads, options, need_bias_grads=False):
    """The cached plan for `call` (keyed by _plan_key; in use until released), built with `options`."""
    import cupy

    key = _plan_key(call, precision, need_grad_hidden, need_weight_grads, options, need_bias_grads)
    plan = _plans.acquire(key)
    if plan is not None:
        return plan
    with cupy.cuda.Device(call.device):
        if _plan_cache.is_capturing(_stream_ptr(stream, call.device)):
            raise _no_plan_error("gelu_ffn_backward")  # building allocates and zero-fills
    return _plans.acquire(key, lambda: GeluFFNBackward(
        call.tokens, call.dim, call.hidden_dim, precision=precision.name, device=call.device,
        need_grad_hidden=need_grad_hidden, need_weight_grads=need_weight_grads, need_bias_grads=need_bias_grads,
        _options=options))


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
        First linear layer, ``[out_features, in_features]``.
    weight2 : array [D, H]
        Second linear layer.
    linear1_out, tanh_inner, gelu_out : arrays [..., H]
        Saved forward tensors: ``z = x @ weight1.T``, ``t = tanh(sqrt(2/pi) * (z + 0.044715 z^3))``
        and ``0.5 * z * (1 + t)``. Every tensor given is used as given, in every precision: the
        gradients are the formula's on these very values, whether or not they agree with each other
        (``check_activations`` checks that they do). Memory mode: pass None for tanh_inner and/or
        gelu_out and they are recomputed from linear1_out (and tanh_inner, where given) inside the
        kernels (same results within the precision's contract).
    precision : {None, "bf16x3", "fp16+fp8", "ieee", "tf32", "bf16"}
        GEMM operand treatment; accuracy contracts in ``cupyffn.PRECISIONS``. None (the default): the
        default of the arrays' device, "fp16+fp8" on a GPU (``cupyffn.DEFAULT_PRECISION``) and "ieee",
        plain fp32, for NumPy arrays (``cupyffn.CPU_DEFAULT_PRECISION``: the fastest precision on the CPU,
        and the most accurate). Every name is valid for NumPy arrays too: the NumPy backend then rounds
        the operands as the GPU does, to reproduce its numerics (several times slower than "ieee").
        The contracts hold for any T, D and H: a GEMM whose contraction length K (planes included)
        exceeds 24576 (``cupyffn.gemm.ksplit.MAX_K``) sums it in chunks added in fp32 (measured from
        0.93x to 1.04x the time of one accumulator at T = 32,768-352,000; none of the benchmark's
        shapes is chunked).
    out : sequence of 3 arrays, optional
        Where to write (grad_hidden_states, grad_weight1, grad_weight2): float32, C-contiguous, the
        shapes of hidden_states, weight1 and weight2, not overlapping any input or each other. An entry
        may be None to have it allocated (not during CUDA stream capture: there every computed output
        must be given). If the call fails after validation, the given arrays are filled with NaN, with
        accumulate=True too (a partial accumulation cannot be undone, so the gradients accumulated so
        far are lost); if that fill fails as well, the raised error says so. If validation fails they
        are untouched.
    stream : cupy.cuda.Stream, optional
        Stream to work on (default: CuPy's current stream). Results are ready on it when the call
        returns; the host is never synchronized, except when a call of a new shape evicts a cached plan
        (closing it waits for that plan's last call). The stream may be capturing a CUDA graph once a call
        of this shape and precision has run outside the capture (docs/cuda-graphs.md).
    accumulate : bool
        Add into ``out`` grad_weight1 / grad_weight2 instead of overwriting them (grad_hidden_states
        is always overwritten).
    need_grad_hidden, need_weight_grads : bool
        Skip the work of gradients that are not needed.
    check_activations : bool
        Before computing, compare a sample of tanh_inner / gelu_out with the tanh-GELU of linear1_out
        and raise ``cupyffn.ActivationMismatchError`` naming the likely cause (erf GELU, tanh's
        argument instead of its output, swapped or stale buffers). Synchronizes with the stream.
    need_bias_grads : bool
        Also return ``grad_bias1`` (sum over tokens of grad_linear1, [H]) and ``grad_bias2`` (sum over tokens of
        grad_output, [D]) as attributes of the result (out= then may hold five arrays). Biases do not change the
        backward's inputs: linear1_out is the pre-activation with bias1 added.
    grad_hidden_ready : cupy.cuda.Event, optional
        Recorded on the stream as soon as grad_hidden_states is written, before the weight gradients
        are finished (tensor parallelism: start its all-reduce on another stream with
        ``other.wait_event(grad_hidden_ready)`` while the weight-gradient GEMMs run). The call still
        returns everything ready on the stream. GPU only, needs need_grad_hidden=True; not with
        graph=True plans. Under a caller's CUDA stream capture the record is captured too (wait on
        it inside the same capture).

    bfloat16 / float16 activations and bias gradients (docs/precisions.md, "16-bit activations and biases"):
    grad_output, hidden_states, linear1_out and gelu_out in one 16-bit dtype (or float32 with biases), weights
    float32 or that dtype, tanh_inner None, precision None (float32 with biases: "ieee" or "tf32"); the GEMMs run
    on the operands as given with cuBLASLt's fused GELU-derivative and bias-gradient epilogues; grad_hidden_states in
    the activation dtype, weight and bias gradients float32 (or the weights' dtype, chosen by out=).

    Arrays may be NumPy (computed on the CPU), CuPy, or any DLPack / CUDA Array Interface producer
    (torch.Tensor, jax.Array), all on one device, float32 (or as above). The last dimension must be contiguous and
    the leading dimensions must flatten to one row stride. Returns an FFNGrads named tuple (CuPy
    arrays for GPU inputs, NumPy arrays for NumPy inputs; the out= objects themselves where given).
    """
    # None: the default of the arrays' device, known once they are looked at; a bad name is reported first
    prec = _precision.lookup(precision) if precision is not None else None
    args = (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out)
    # 16-bit activations, or bias gradients in ieee / tf32: cupyffn/_lt_api.py (the split precisions' bias gradients
    # are the float32 engine's)
    if _lt_api.wants(grad_output, need_bias_grads) and not (prec is not None and _lt_api.engine_biases(grad_output,
                                                                                                       prec.name)):
        return _lt_api.backward(args, precision if prec is None else prec.name, out, stream, accumulate,
                                need_grad_hidden, need_weight_grads, need_bias_grads, check_activations,
                                grad_hidden_ready)
    sig = _validate.signature(args, out, accumulate)
    options = None  # the GPU plan's EngineOptions (CUPYFFN_ENGINE, parsed once per value), read for GPU arrays only
    if sig is not None:  # CuPy arrays: the plan (and its validated call) may be known already
        if prec is None:
            prec = _GPU_DEFAULT
        options = EngineOptions.from_env()
        plan = _recent.get(_recent_key(sig, prec, need_grad_hidden, need_weight_grads, options, need_bias_grads))
        if plan is not None and _plans.reacquire(plan):  # not if evicted meanwhile
            try:
                return plan._run(args, out, stream, accumulate, sig, check_activations=check_activations,
                                 grad_hidden_ready=grad_hidden_ready)
            finally:
                _plans.release(plan)
    call = _validate.prepare(args, out, stream, need_grad_hidden, need_weight_grads, accumulate, need_bias_grads)
    if prec is None:
        prec = _precision.resolve(None, cpu=call.backend == "cpu")
    if call.backend == "cpu":
        if grad_hidden_ready is not None:
            raise ValueError("grad_hidden_ready= is for GPU arrays (a cupy.cuda.Event); these are NumPy (CPU) "
                             "arrays, whose results are all ready when the call returns")
        if check_activations:
            _checks.check(call)
        return FFNGrads(*_backward_cpu.run(call, out, prec, need_grad_hidden, need_weight_grads, accumulate,
                                           need_bias_grads))
    if options is None:
        options = EngineOptions.from_env()
    plan = _acquire_plan(call, prec, stream, need_grad_hidden, need_weight_grads, options, need_bias_grads)
    try:
        if sig is not None:
            if len(_recent) >= 4 * _CACHE_SIZE:
                _recent.clear()
            _recent[_recent_key(sig, prec, need_grad_hidden, need_weight_grads, options, need_bias_grads)] = plan
        return plan._run(args, out, stream, accumulate, sig, call, check_activations=check_activations,
                         grad_hidden_ready=grad_hidden_ready)
    finally:
        _plans.release(plan)
