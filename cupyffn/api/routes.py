"""The route table: which engine runs a validated call, and when its calls become CUDA graphs. `route(call)` is the one
place a route is chosen (docs/architecture.md shows this table): the door asks it once per new configuration and
remembers the answer beside the validated call; cupyffn/api/execute.py runs what it says, engine and graph policy.

    backend  activations  tokens  engine (what runs)                              graphs (GraphPolicy)
    -------  -----------  ------  ----------------------------------------------  ---------------------------------
    any      any          0       no tokens  cupyffn/api/no_tokens.py NoTokens       EAGER
                                             (nothing to multiply: zero gradients)
    cpu      any          >= 1    torch cpu  cupyffn/cpu/torch_route.py TorchCpu     EAGER
                                             (the torch layer's calls, 16-bit or "ieee": torch's own ops)
    cpu      any          >= 1    numpy      cupyffn/cpu/numpy_route.py NumpyEngine  EAGER
    gpu      float32      >= 1    float32    cupyffn/f32/ GpuEngine (backward),  backward: GRAPH_PLAN for plans
                                             GpuForward (forward)                   made with graph=True; REPEATED
                                                                                    where the plan runs a call graph
                                                                                    (tf32, T <= 512); else EAGER
    gpu      bfloat16,    >= 1    lt         cupyffn/lt/engine.py LtBackward,       REPEATED
             float16                         LtForward

    Every GPU route, while the caller's stream is capturing a CUDA graph: enqueued into that capture (all on the
    caller's stream while another open capture holds the engine's side stream); no graph of cupyffn's own.

Biases ride with every route (the float32 engine's bias kernels, cuBLASLt's bias epilogues, NumPy). A route refuses a
call whose layout its engine cannot take (`refusal`: the one fast-path eligibility test, CUTLASS's can_implement),
and a plan's calls of another shape. The engines' modules are imported here, on first use, and nowhere else.
"""

from typing import Any, Callable, NamedTuple, Optional

from ..core import precision as _precision
from ..core.results import BACKWARD_INPUTS, BACKWARD_OUTPUTS, FORWARD_INPUTS, FORWARD_OUTPUTS
from ..cuda.graph_cache import GraphPolicy

NUMPY, TORCH_CPU, NO_TOKENS, FLOAT32, LT = "numpy", "torch cpu", "no tokens", "float32", "lt"

#: graph policies (cupyffn/cuda/graph_cache.py). REPEATED: a set of arrays seen twice is captured (decisions 051,
#: 052); 64 kept per engine, so the layers of a deep model, each with its own arrays, keep theirs; a model cycling
#: through more sets than that stops capturing (its captures would be dropped before their next use).
REPEATED = GraphPolicy("a graph per repeated set of arrays", capture_after=2, keep=64, stop_when_thrashing=True)
#: GeluFFNBackward(graph=True): every set of arrays captured at its first call, four kept.
GRAPH_PLAN = GraphPolicy("graph=True: a graph per set of arrays", capture_after=1, keep=4)
EAGER = GraphPolicy("eager", capture_after=None, keep=0)


class Route(NamedTuple):
    """Everything the executor needs: the engine (its name: its plan cache's), the graph policy, the key its plan
    cache keeps it by and how to build it. Without a key: an engine built per call (host, T = 0), or a plan's own."""

    engine: str                        # NUMPY, TORCH_CPU, NO_TOKENS, FLOAT32 or LT
    graphs: GraphPolicy
    key: Any = None                    # the plan cache's key: F32BackwardKey, F32ForwardKey, LtBackwardKey, ...
    build: Optional[Callable] = None   # build(key) -> a new engine


def route(call, plan=None):
    """The route of validated `call` (module docstring), `plan` the GeluFFNBackward it is made through, if any; raises
    ValueError / TypeError naming what the engine or the plan needs where it cannot take the call."""
    why = refusal(call)
    if why is not None:
        raise ValueError(why)
    if plan is not None:
        _check_plan_call(plan, call)
    if call.tokens == 0:
        return Route(NO_TOKENS, EAGER, None, _no_tokens_engine)
    if call.backend == "cpu":
        if call.request.torch_layer and (call.act != "float32" or call.precision.name == "ieee"):
            return Route(TORCH_CPU, EAGER, None, _torch_cpu_engine)
        return Route(NUMPY, EAGER, None, _numpy_engine)
    if plan is not None:
        return Route(FLOAT32, _plan_graphs(plan))
    r = call.request
    if call.act != "float32":
        from ..lt.key import LtBackwardKey, LtForwardKey

        inputs = call.inputs
        if call.kind == "forward":
            biases = next((m.dtype for m in (inputs.bias1, inputs.bias2) if m is not None), "")
            key = LtForwardKey(call.device, call.tokens, call.dim, call.hidden_dim, call.act, call.weights,
                               inputs.bias1 is not None, inputs.bias2 is not None, call.weights_transposed, biases)
        else:
            key = LtBackwardKey(call.device, call.tokens, call.dim, call.hidden_dim, call.act, call.weights,
                                call.grads, r.need_bias_grads, r.need_grad_hidden, r.need_weight_grads,
                                inputs.gelu_out is None, call.weights_transposed, call.grads_transposed)
        return Route(LT, REPEATED, key, _lt_engine)
    from ..f32.key import F32BackwardKey, F32ForwardKey

    if call.kind == "forward":
        key = F32ForwardKey(call.device, call.tokens, call.dim, call.hidden_dim, call.precision.name,
                            call.inputs.bias2 is not None)
        return Route(FLOAT32, EAGER, key, _f32_forward)
    from ..f32.plan import call_graph_wanted

    key = F32BackwardKey(call.device, call.tokens, call.dim, call.hidden_dim, call.precision.name,
                         r.need_grad_hidden, r.need_weight_grads, r.need_bias_grads)
    # REPEATED where the plan runs its eager calls as one re-pointed call graph (f32/plan.py CALL_GRAPH_TOKENS; where
    # K is chunked it has none, and the graphs are captured whole instead)
    return Route(FLOAT32, REPEATED if call_graph_wanted(call.precision, call.tokens) else EAGER, key, _f32_backward)


def _plan_graphs(plan):
    """A GeluFFNBackward's graph policy: graph=True captures every set of arrays; otherwise REPEATED where its engine,
    built with the plan, runs a call graph."""
    if plan.graph:
        return GRAPH_PLAN
    return REPEATED if plan.engine.call_graph else EAGER


def _check_plan_call(plan, call):
    expected = (plan.tokens, plan.dim, plan.hidden_dim)
    if (call.tokens, call.dim, call.hidden_dim) != expected:
        raise ValueError(f"this plan is for (tokens, dim, hidden_dim) = {expected}; the arrays give "
                         f"{(call.tokens, call.dim, call.hidden_dim)}")
    if call.device != plan.device:
        where = "the CPU" if call.device == "cpu" else f"cuda:{call.device}"
        raise ValueError(f"this plan is for device {plan.device!r}; the arrays are on {where}")
    if call.act != "float32":
        raise TypeError(f"this plan is for float32 activations; the arrays are {call.act} (call "
                        f"cupyffn.gelu_ffn_backward, which runs them on cuBLASLt)")


def refusal(call) -> Optional[str]:
    """None when the engine of `call` can take its layout, else what it needs (an error message)."""
    if call.backend == "cpu":
        return None
    if call.act == "float32":
        if call.weights_transposed:
            return ("weight1 and weight2 are transposed views ([in, out] storage): the float32 engine reads weights "
                    "as [out, in] rows (its conversions write their operands); pass ascontiguousarray of each")
        return None
    names = FORWARD_INPUTS if call.kind == "forward" else BACKWARD_INPUTS
    for m, name in zip(call.inputs, names):
        if m is None:
            continue
        if m.ld != m.cols and m.rows > 1:
            return (f"{name} must be C-contiguous with bfloat16/float16 activations (the cuBLASLt plans read packed "
                    f"rows); pass ascontiguousarray({name})")
        if m.ptr % 16:
            return f"{name} must start on a 16-byte boundary (cuBLASLt); got address {m.ptr:#x}"
    outputs = FORWARD_OUTPUTS if call.kind == "forward" else BACKWARD_OUTPUTS
    for i, (m, name) in enumerate(zip(call.out, outputs)):
        if m is not None and m.ptr % 16:
            return f"out[{i}] ({name}) must start on a 16-byte boundary (cuBLASLt); got address {m.ptr:#x}"
    size = 2
    if call.dim * size % 16 or call.hidden_dim * size % 16:
        return (f"dim = {call.dim} and hidden_dim = {call.hidden_dim} must be multiples of 8 for {call.act} "
                f"activations on the GPU (cuBLASLt reads 16-byte-aligned rows)")
    return None


# ---------------------------------------------------------------------- building the engines
def _f32_backward(key):
    from ..f32.engine import GpuEngine

    return GpuEngine(key.tokens, key.dim, key.hidden_dim, _precision.lookup(key.precision), key.device,
                     key.need_grad_hidden, key.need_weight_grads, need_bias_grads=key.need_bias_grads)


def plan_engine(plan):
    """The float32 engine a GeluFFNBackward on a GPU runs (its own, not cached), with its EngineOptions (None: the
    measured defaults, which it then records)."""
    from ..f32.engine import GpuEngine
    from ..f32.options import DEFAULT

    if plan.engine_options is None:
        plan.engine_options = DEFAULT
    return GpuEngine(plan.tokens, plan.dim, plan.hidden_dim, plan.precision, plan.device, plan.need_grad_hidden,
                     plan.need_weight_grads, options=plan.engine_options, need_bias_grads=plan.need_bias_grads)


def _f32_forward(key):
    from ..f32.forward import GpuForward

    return GpuForward(key.tokens, key.dim, key.hidden_dim, _precision.lookup(key.precision), key.device,
                      bias2=key.bias2)


def _lt_engine(key):
    from ..lt.engine import LtBackward, LtForward
    from ..lt.key import LtForwardKey

    return LtForward(key) if isinstance(key, LtForwardKey) else LtBackward(key)


def _numpy_engine(key=None):
    from ..cpu.numpy_route import NumpyEngine

    return NumpyEngine()


def _torch_cpu_engine(key=None):
    from ..cpu.torch_route import TorchCpu

    return TorchCpu()


def _no_tokens_engine(key=None):
    from .no_tokens import NoTokens

    return NoTokens()
