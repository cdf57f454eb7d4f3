"""The route table: which engine runs a validated call, and when its calls become CUDA graphs. The one place a route
is chosen (docs/architecture.md shows this table); cupyffn/api/execute.py runs whatever it says.

    backend  activations         engine (what runs)                          graphs (GraphPolicy)
    -------  ------------------  ------------------------------------------  -------------------------------------
    cpu      any                 numpy    cupyffn/cpu/backend.py NumpyEngine  -
    gpu      float32             float32  cupyffn/engine/ GpuEngine (backward),
                                          GpuForward (forward)                  backward plans that run a call graph
                                                                                (tf32, T <= 512): REPEATED; plans made
                                                                                with graph=True: GRAPH_PLAN; else -
    gpu      bfloat16, float16   lt       cupyffn/lt/engine.py LtBackward,      REPEATED
                                          LtForward

    Every GPU route, while the caller's stream is capturing a CUDA graph: enqueued into that capture (all on the
    caller's stream while another open capture holds the engine's side stream); no graph of cupyffn's own.

Biases ride with every route (the float32 engine's bias kernels, cuBLASLt's bias epilogues, NumPy). `requirement`
states what an engine needs of a call's layout, the one fast-path eligibility test (CUTLASS's can_implement).
"""

from typing import NamedTuple, Optional

from ..core.results import BACKWARD_INPUTS, BACKWARD_OUTPUTS, FORWARD_INPUTS, FORWARD_OUTPUTS
from ..cuda.graph_cache import GraphPolicy

NUMPY, FLOAT32, LT = "numpy", "float32", "lt"

#: graph policies (cupyffn/cuda/graph_cache.py). REPEATED: a set of arrays seen twice is captured (decisions 051,
#: 052); 64 kept per engine, so the layers of a deep model, each with its own arrays, keep theirs; a model cycling
#: through more sets than that stops capturing (its captures would be dropped before their next use).
REPEATED = GraphPolicy("a graph per repeated set of arrays", capture_after=2, keep=64, stop_when_thrashing=True)
#: GeluFFNBackward(graph=True): every set of arrays captured at its first call, four kept.
GRAPH_PLAN = GraphPolicy("graph=True: a graph per set of arrays", capture_after=1, keep=4)
EAGER = GraphPolicy("eager", capture_after=None, keep=0)

#: (backend, activation dtype) -> engine
ENGINES = {("cpu", "float32"): NUMPY, ("cpu", "bfloat16"): NUMPY, ("cpu", "float16"): NUMPY,
           ("gpu", "float32"): FLOAT32, ("gpu", "bfloat16"): LT, ("gpu", "float16"): LT}


class Route(NamedTuple):
    engine: str             # NUMPY, FLOAT32 or LT
    graphs: GraphPolicy


def engine_of(call):
    return ENGINES[call.backend, call.act]


def graph_policy(kind, pass_kind, engine=None, graph=False):
    """The graph column of the table for engine `kind` running `pass_kind` ("forward" / "backward"): `engine`, a
    float32 backward engine, says whether it runs a call graph; `graph`: a GeluFFNBackward(graph=True) plan."""
    if kind == LT:
        return REPEATED
    if kind == FLOAT32 and pass_kind == "backward":
        if graph:
            return GRAPH_PLAN
        return REPEATED if engine.call_graph else EAGER
    return EAGER


def choose(call, engine, graph=False):
    """The route of `call` on `engine` (graph_policy's arguments)."""
    kind = engine_of(call)
    return Route(kind, graph_policy(kind, call.kind, engine, graph))


def requirement(call) -> Optional[str]:
    """None when the engine of `call` can take its layout, else what it needs (an error message)."""
    kind = engine_of(call)
    names = FORWARD_INPUTS if call.kind == "forward" else BACKWARD_INPUTS
    if kind == FLOAT32 and call.weights_transposed:
        return ("weight1 and weight2 are transposed views ([in, out] storage): the float32 engine reads weights as "
                "[out, in] rows (its conversions write their operands); pass ascontiguousarray of each")
    if kind != LT:
        return None
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


# ---------------------------------------------------------------------- the engines' plans
def plan_key(call):
    """The key a GPU call's engine is cached by: everything the engine is built for (not the arrays, not the
    stream: a warm-up on any stream serves a capture on another)."""
    kind = engine_of(call)
    r = call.request
    if kind == FLOAT32 and call.kind == "backward":
        return (FLOAT32, "backward", call.device, call.tokens, call.dim, call.hidden_dim, call.precision.name,
                r.need_grad_hidden, r.need_weight_grads, r.need_bias_grads)
    if kind == FLOAT32:
        return (FLOAT32, "forward", call.device, call.tokens, call.dim, call.hidden_dim, call.precision.name,
                call.inputs[4] is not None)
    from ..lt.key import LtKey

    if call.kind == "forward":
        return LtKey(call.device, call.tokens, call.dim, call.hidden_dim, call.act, call.weights, call.act,
                     call.inputs[3] is not None, call.inputs[4] is not None,
                     weights_transposed=call.weights_transposed)
    return LtKey(call.device, call.tokens, call.dim, call.hidden_dim, call.act, call.weights, call.grads,
                 r.need_bias_grads, r.need_bias_grads, r.need_grad_hidden, r.need_weight_grads,
                 call.inputs[6] is None, call.weights_transposed, call.grads_transposed)


def build(call, key):
    """A new engine for `call` (its `plan_key` is `key`); the GPU modules are imported here, on first use."""
    kind = engine_of(call)
    if kind == LT:
        from ..lt.engine import LtBackward, LtForward

        engine = (LtForward if call.kind == "forward" else LtBackward)(key)
    elif call.kind == "forward":
        from ..engine.forward import GpuForward

        engine = GpuForward(call.tokens, call.dim, call.hidden_dim, call.precision, call.device,
                            bias2=call.inputs[4] is not None)
    else:
        from ..engine.engine import GpuEngine

        r = call.request
        engine = GpuEngine(call.tokens, call.dim, call.hidden_dim, call.precision, call.device, r.need_grad_hidden,
                           r.need_weight_grads, need_bias_grads=r.need_bias_grads)
    engine.use_graphs(graph_policy(kind, call.kind, engine))
    return engine
