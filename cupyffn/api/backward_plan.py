"""`GeluFFNBackward`: a reusable backward of one shape on its own engine, called through the same door as the
functions (cupyffn/api/functional.py `run`: the one validator, the route table, the executor), with introspection
and close (the benchmark's per-stage profile of its engine: benchmarks/stages.py)."""

import itertools
import sys

import numpy

from ..core import plans as _plans
from ..core import precision as _precision
from ..core import rules as _rules
from ..cuda import device as _device
from . import functional, routes
from .validate import Request, check_size

_tokens = itertools.count(1)  # each plan's own key in the cache of validated calls (0: the functions')


def _resolve_device(device):
    """A plan's device: "cpu", or the id of the GPU that `device` names (None: CuPy's current one). Raises
    RuntimeError with the reason (cupyffn/cuda/device.py) when no GPU can be used: no CuPy, no GPU, an old driver."""
    if device == "cpu":
        return "cpu"
    cupy = sys.modules.get("cupy")  # a cupy.cuda.Device exists only once CuPy is imported
    is_index = isinstance(device, (int, numpy.integer)) and not isinstance(device, bool)
    if not (device is None or is_index or (cupy is not None and isinstance(device, cupy.cuda.Device))):
        raise TypeError(f"device must be None, 'cpu', an int or a cupy.cuda.Device; got {device!r}")
    try:
        import cupy

        if device is None:
            return cupy.cuda.Device().id
        if not is_index:
            return device.id
        cupy.cuda.runtime.getDeviceCount()  # fails here, with a reason, where there is no usable GPU
        return int(device)
    except (ImportError, RuntimeError) as e:  # no CuPy; CUDARuntimeError is a RuntimeError
        raise RuntimeError(f"GeluFFNBackward(device={device!r}) needs a GPU: {_device.explain(e)}; pass "
                           f"device='cpu' for a plan that takes NumPy arrays") from None


def plan_with_options(tokens, dim, hidden_dim, options, **kwargs):
    """A `GeluFFNBackward` whose GPU engine uses `options`, a cupyffn/f32/options.py `EngineOptions`, instead of
    the measured defaults: how measurements (the benchmark's A/B twins) and tests build a plan with a mechanism
    turned on or off. kwargs: GeluFFNBackward's keywords. Not a user feature, so not on the public signature."""
    from ..f32.options import EngineOptions

    if not isinstance(options, EngineOptions):
        raise TypeError(f"options must be a cupyffn.f32.options.EngineOptions; got {options!r}")
    plan = GeluFFNBackward.__new__(GeluFFNBackward)
    plan.engine_options = options  # read by __init__ in place of the class's None
    plan.__init__(tokens, dim, hidden_dim, **kwargs)
    return plan


class GeluFFNBackward:
    """A reusable backward pass of ``Linear(weight1) -> GELU(tanh) -> Linear(weight2)`` for one shape.

    Parameters
    ----------
    tokens, dim, hidden_dim : int
        T (rows of the activations, the product of their leading dimensions), D and H.
    precision : {None, "bf16x3", "fp16+fp8", "ieee", "tf32", "bf16"}
        Operand treatment of the four GEMMs (see ``cupyffn.PRECISIONS``). None (the default): the device's
        default, "fp16+fp8" (``cupyffn.DEFAULT_PRECISION``) on a GPU and "ieee", plain fp32
        (``cupyffn.CPU_DEFAULT_PRECISION``), for device="cpu". Every name is valid on the CPU too, where the
        NumPy backend rounds the operands as the GPU does (to reproduce its numerics; slower than "ieee").
    device : None, int, cupy.cuda.Device or "cpu"
        GPU to build on (None: CuPy's current one), or "cpu" for a plan that takes NumPy arrays. None always
        means a GPU: where none can be used (CuPy not installed, no NVIDIA GPU visible, a driver too old)
        it raises RuntimeError saying which, rather than silently building a CPU plan.
    graph : bool
        Capture the whole backward into a CUDA graph and replay it. A graph is keyed by the addresses
        of the arrays it was captured with: calling with the same arrays (new contents are fine)
        replays it; other addresses capture a new graph at their first call (up to four are kept:
        cupyffn/api/routes.py GRAPH_PLAN). Without ``out=``, the results are arrays owned by the plan that the next call
        overwrites. (The ordinary path of a tf32 plan at T <= 512 is itself one graph launch, re-pointed at
        each call's arrays: docs/cuda-graphs.md.)
    need_grad_hidden, need_weight_grads : bool
        Skip the GEMM(s) of the gradients not needed (frozen weights, first layer).
    need_bias_grads : bool
        Also compute grad_bias1 (the sum over tokens of grad_linear1, [hidden_dim]) and grad_bias2 (of grad_output,
        [dim]), returned as FFNGrads attributes; ``out=`` may then hold five arrays. Summed in fp32 in a fixed
        order (bit-identical across calls): grad_bias1 from column sums the GELU-derivative pass forms as it writes
        grad_linear1, grad_bias2 on the side stream (docs/decisions/050-biases-in-the-split-precisions.md). GEMM1
        and the GELU derivative then run as two launches ("tf32" fuses them otherwise).

    The plan owns its scratch buffers, cuBLAS handles and side stream: in steady state a call
    allocates nothing on the device beyond the outputs it is not given. Calls from several threads
    are serialized per plan, and calls on different streams are ordered on the device (they share
    the scratch); use one plan per stream for concurrency.

    CUDA graphs captured by the caller (``torch.cuda.graph``, ``cupy.cuda.Stream.begin_capture``):
    a call on a capturing stream allocates nothing, never synchronizes and uses no event from outside
    the capture, so it needs a plan that has run once outside the capture and every output given in
    ``out=``. From then on the plan is pinned (``close()`` refuses, the cache keeps it) until
    ``cupyffn.release_captured_plans()``. Ordering the graph's replays with eager calls of the same
    plan on other streams is the caller's business (they share the scratch).
    """

    #: The GPU engine's mechanisms (cupyffn/f32/options.py EngineOptions; None: the measured defaults), what the plan
    #: was built with. Only `plan_with_options` builds a plan with others.
    engine_options = None

    def __init__(self, tokens, dim, hidden_dim, *, precision=None, device=None, graph=False,
                 need_grad_hidden=True, need_weight_grads=True, need_bias_grads=False):
        self.tokens = check_size("tokens", tokens, 0)
        self.dim = check_size("dim", dim, 1)
        self.hidden_dim = check_size("hidden_dim", hidden_dim, 1)
        _precision.checked_name(precision)  # a bad name is reported before the device is looked at
        _rules.check_needs(need_grad_hidden, need_weight_grads, need_bias_grads)
        self.need_grad_hidden = bool(need_grad_hidden)
        self.need_weight_grads = bool(need_weight_grads)
        self.need_bias_grads = bool(need_bias_grads)
        self.device = _resolve_device(device)
        self.precision = _precision.resolve(precision, cpu=self.device == "cpu")
        self.graph = bool(graph)
        if self.graph and self.device == "cpu":
            raise ValueError("graph=True needs a GPU plan; device='cpu' runs NumPy")
        self.token = next(_tokens)
        self.owned_outputs = [None] * 5 if self.graph else None  # graph=True: outputs the plan owns (not out=)
        self.engine = None
        self._closed = False
        if self.device != "cpu":
            self.engine = routes.plan_engine(self)

    # ------------------------------------------------------------------ introspection
    @property
    def scratch_bytes(self):
        """Device memory this plan holds for intermediates (0 on the CPU)."""
        return self.engine.scratch_bytes if self.engine else 0

    @property
    def workspace_bytes(self):
        """cuBLAS workspace bytes of the handles this plan uses."""
        return self.engine.workspace_bytes if self.engine else 0

    @property
    def gemm_forms(self):
        """{gemm: form name} that this plan runs for gemm1..gemm4 (cupyffn/core/precision.py): the precision's
        table at this token count, with bf16x3 wherever the fp16+fp8 pair's constraints failed. GEMMs the
        plan skips (need_grad_hidden / need_weight_grads False) are left out."""
        if self.engine is not None:
            return dict(self.engine.gemm_forms)
        forms = _precision.effective_forms(self.precision, self.tokens, self.dim, self.hidden_dim)
        skip = (() if self.need_grad_hidden else ("gemm3",)) + (() if self.need_weight_grads else ("gemm2", "gemm4"))
        return {g: f.name for g, f in forms.items() if g not in skip}

    @property
    def fused_gemm1(self):
        """True when GEMM1 and the GELU derivative run as one sm90 kernel (the "tf32" plan on a compute capability
        9.0 GPU, where GEMM1's K fits one accumulator: docs/architecture.md), False for cuBLAS GEMM1 + a pass."""
        return bool(self.engine is not None and self.engine.fused_gemm1)

    def __repr__(self):
        bias = ", need_bias_grads=True" if self.need_bias_grads else ""
        return (f"GeluFFNBackward(tokens={self.tokens}, dim={self.dim}, hidden_dim={self.hidden_dim}, "
                f"precision={self.precision.name!r}, device={self.device!r}, graph={self.graph}{bias})")

    # ------------------------------------------------------------------ calls
    def __call__(self, grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None, *,
                 out=None, stream=None, accumulate=False, check_activations=False, grad_hidden_ready=None):
        """Run the backward; returns FFNGrads. See ``cupyffn.gelu_ffn_backward`` for the arguments."""
        if self._closed:
            raise RuntimeError("this GeluFFNBackward plan was closed")
        request = Request("backward", self.precision.name, self.need_grad_hidden, self.need_weight_grads,
                          self.need_bias_grads, bool(accumulate))
        args = (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out)
        return functional.run(request, args, out, stream, check_activations, grad_hidden_ready, plan=self)

    def close(self):
        """Give back device memory and cuBLAS handles now (also done when the plan is collected).

        Waits (on the host) for the plan's calls to finish on the device first, so nothing they still
        use is reused; calls after close() raise RuntimeError. A plan captured into a CUDA graph
        (pinned) cannot be closed until ``cupyffn.release_captured_plans()``.
        """
        if _plans.is_pinned(self):
            raise _plans.pinned_error("GeluFFNBackward plan")
        if self.engine is not None:
            self.engine.close()  # waits on the device; refuses while pinned (a caller's capture pins the engine)
        self._closed = True
        self.owned_outputs = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
