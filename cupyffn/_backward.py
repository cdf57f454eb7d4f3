"""Public backward API: `GeluFFNBackward` (a plan per shape) and `gelu_ffn_backward` (cached plans)."""

import collections
import contextlib
import sys
import threading
from typing import Any, NamedTuple

import numpy

from . import _arrays, _checks, _device, _forward, _numpy_backend, _plan_cache, _precision, _validate
from ._options import EngineOptions
from ._plan_cache import PlanCache, release_captured_plans  # noqa: F401 (re-exported by the package)


class FFNGrads(NamedTuple):
    """Gradients of the FFN block; unpacks as (grad_hidden_states, grad_weight1, grad_weight2).

    An entry is None when it was not asked for (need_grad_hidden / need_weight_grads).
    """

    grad_hidden_states: Any
    grad_weight1: Any
    grad_weight2: Any


def _resolve_device(device):
    """A plan's device: "cpu", or the id of the GPU that `device` names (None: CuPy's current one). Raises
    RuntimeError with the reason (cupyffn/_device.py) when no GPU can be used: no CuPy, no GPU, an old driver."""
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


def _check_size(name, value, minimum):
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


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
        replays it; other addresses run the ordinary path once and capture a new graph (up to four are
        kept). Without ``out=``, the results are arrays owned by the plan that the next call
        overwrites. (The ordinary path of a tf32 plan at T <= 512 is itself one graph launch, re-pointed at
        each call's arrays: docs/cuda-graphs.md.)
    need_grad_hidden, need_weight_grads : bool
        Skip the GEMM(s) of the gradients not needed (frozen weights, first layer).

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

    def __init__(self, tokens, dim, hidden_dim, *, precision=None, device=None, graph=False,
                 need_grad_hidden=True, need_weight_grads=True, _options=None):
        self.tokens = _check_size("tokens", tokens, 0)
        self.dim = _check_size("dim", dim, 1)
        self.hidden_dim = _check_size("hidden_dim", hidden_dim, 1)
        if precision is not None:  # a bad name is reported before the device is looked at
            _precision.lookup(precision)
        if not need_grad_hidden and not need_weight_grads:
            raise ValueError("need_grad_hidden and need_weight_grads are both False: there is nothing to compute")
        self.need_grad_hidden = bool(need_grad_hidden)
        self.need_weight_grads = bool(need_weight_grads)
        # _options (private, for comparisons and measurements): the mechanisms the GPU engine uses
        # (cupyffn/_options.py); None: the defaults, or what the debug variable CUPYFFN_ENGINE asks for
        if _options is not None and not isinstance(_options, EngineOptions):
            raise TypeError(f"_options must be None or a cupyffn._options.EngineOptions; got {_options!r}")
        self.device = _resolve_device(device)
        self.precision = _precision.resolve(precision, cpu=self.device == "cpu")
        self.graph = bool(graph)
        if self.graph and self.device == "cpu":
            raise ValueError("graph=True needs a GPU plan; device='cpu' runs NumPy")
        self._engine = None
        self._graphs = collections.OrderedDict()
        self._owned_out = None
        # signature -> validated call of recent calls (see _validate.signature): several, so that layers of one
        # shape sharing this plan, or outputs alternating between two allocations, skip validation too
        self._validated = {}
        self._io = None  # pointers the engine's launches were last set to
        self._closed = False
        self._capture_stream = None
        self._lock = threading.Lock()
        if self.device != "cpu":
            from ._gpu_engine import GpuEngine

            options = _options if _options is not None else EngineOptions.from_env()
            self._engine = GpuEngine(self.tokens, self.dim, self.hidden_dim, self.precision, self.device,
                                     self.need_grad_hidden, self.need_weight_grads, options=options)

    # ------------------------------------------------------------------ introspection
    @property
    def scratch_bytes(self):
        """Device memory this plan holds for intermediates (0 on the CPU)."""
        return self._engine.scratch_bytes if self._engine else 0

    @property
    def workspace_bytes(self):
        """cuBLAS workspace bytes of the handles this plan uses."""
        return self._engine.workspace_bytes if self._engine else 0

    @property
    def gemm_forms(self):
        """{gemm: form name} that this plan runs for gemm1..gemm4 (cupyffn/_precision.py): the precision's
        table at this token count, with bf16x3 wherever the fp16+fp8 pair's constraints failed. GEMMs the
        plan skips (need_grad_hidden / need_weight_grads False) are left out."""
        if self._engine is not None:
            return dict(self._engine.gemm_forms)
        forms = _precision.effective_forms(self.precision, self.tokens, self.dim, self.hidden_dim)
        skip = (() if self.need_grad_hidden else ("gemm3",)) + (() if self.need_weight_grads else ("gemm2", "gemm4"))
        return {g: f.name for g, f in forms.items() if g not in skip}

    @property
    def fused_gemm1(self):
        """True when GEMM1 and the GELU derivative run as one sm90 kernel (the "tf32" plan on a compute capability
        9.0 GPU, where GEMM1's K fits one accumulator: docs/architecture.md), False for cuBLAS GEMM1 + a pass."""
        return bool(self._engine is not None and self._engine.fused_gemm1)

    def __repr__(self):
        return (f"GeluFFNBackward(tokens={self.tokens}, dim={self.dim}, hidden_dim={self.hidden_dim}, "
                f"precision={self.precision.name!r}, device={self.device!r}, graph={self.graph})")

    # ------------------------------------------------------------------ calls
    def __call__(self, grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None, *,
                 out=None, stream=None, accumulate=False, check_activations=False, grad_hidden_ready=None):
        """Run the backward; returns FFNGrads. See ``cupyffn.gelu_ffn_backward`` for the arguments."""
        args = (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out)
        sig = _validate.signature(args, out, accumulate) if self._engine is not None else None
        return self._run(args, out, stream, accumulate, sig, check_activations=check_activations,
                         grad_hidden_ready=grad_hidden_ready)

    def _run(self, args, out, stream, accumulate, sig, call=None, check_activations=False, grad_hidden_ready=None):
        """Validate (or reuse the validation of an identical earlier call) and execute.

        `sig`: _validate.signature of the arrays, or None; `call`: an already prepared Call, or None.
        """
        if self._closed:
            raise _closed_error()
        ready = _ready_event_ptr(grad_hidden_ready, self)
        if call is None:
            known = self._validated.get(sig) if sig is not None else None
            if known is not None:
                if stream is not None and not hasattr(stream, "ptr"):
                    raise TypeError(f"stream must be a cupy.cuda.Stream (or ExternalStream) or None; "
                                    f"got {type(stream).__name__}")
                call = _validate.reuse(known, args, out)
            else:
                call = _validate.prepare(args, out, stream, self.need_grad_hidden, self.need_weight_grads, accumulate)
                self._check_call(call)
                self._remember(sig, call)
        else:
            self._remember(sig, call)
        if check_activations:
            if self._engine is not None and _plan_cache.is_capturing(_stream_ptr(stream, self.device)):
                raise ValueError("check_activations=True synchronizes with the stream, which CUDA stream capture "
                                 "does not allow: check once before capturing")
            _checks.check(call, stream)
        return self._execute(call, out, stream, accumulate, ready)

    _VALIDATED_MAX = 8

    def _remember(self, sig, call):
        """Keep `call`'s validation for calls with signature `sig` (None: not a CuPy-array call)."""
        if sig is None:
            return
        validated = self._validated
        if len(validated) >= self._VALIDATED_MAX:  # start over: a new dict, so readers never see one mid-change
            validated = self._validated = {}
        validated[sig] = call._replace(arrays=None, out_arrays=None)

    def _check_call(self, call):
        expected = (self.tokens, self.dim, self.hidden_dim)
        if (call.tokens, call.dim, call.hidden_dim) != expected:
            raise ValueError(f"this plan is for (tokens, dim, hidden_dim) = {expected}; the arrays give "
                             f"{(call.tokens, call.dim, call.hidden_dim)}")
        if call.device != self.device:
            where = "the CPU" if call.device == "cpu" else f"cuda:{call.device}"
            raise ValueError(f"this plan is for device {self.device!r}; the arrays are on {where}")

    def _execute(self, call, out, stream, accumulate, ready=None):
        if self._engine is None:
            return _run_cpu(call, out, self.precision, self.need_grad_hidden, self.need_weight_grads, accumulate)
        return self._run_gpu(call, out, stream, accumulate, ready)

    def _run_gpu(self, call, out, stream, accumulate, ready=None):
        import cupy

        engine = self._engine
        if cupy.cuda.runtime.getDevice() == self.device:  # the common case: no context switch needed
            device = contextlib.nullcontext()
        else:
            device = cupy.cuda.Device(self.device)
        with device:
            s = stream if stream is not None else cupy.cuda.get_current_stream()
            sp = s.ptr
            # Under a caller's capture: no allocation, no host synchronization, no event from outside
            # the capture (so no order_after_previous: ordering the graph's replays with earlier eager
            # calls is the caller's business), and _ev_done is not recorded (close() synchronizes on it).
            # The engine's own fork/join to its side stream is captured as graph edges.
            capturing = _plan_cache.is_capturing(sp)
            with self._lock:
                if self._closed:
                    raise _closed_error()
                if capturing:
                    self._check_capturable(call)
                results, pointers = self._outputs(call, out, s)
                if self.tokens == 0:
                    if ready:  # grad_hidden_states is empty: ready at once, in stream order
                        cupy.cuda.runtime.eventRecord(ready, sp)
                    with s:
                        for r, needed in zip(results[1:], (self.need_weight_grads,) * 2):
                            if needed and not accumulate:
                                _as_cupy(r).fill(0)
                    return FFNGrads(*results)
                io = (call.inputs, tuple(pointers), bool(accumulate))
                if capturing:
                    _plan_cache.pin(self)  # from now on a graph may replay this plan's scratch
                else:
                    engine.order_after_previous(sp)
                try:
                    if io != self._io:
                        self._io = None  # half-set launches must not be taken for this call's
                        engine.set_io(call.inputs, pointers, accumulate)
                        self._io = io
                    if capturing:
                        if (engine.side_in_capture and engine.side_capture_stream != sp
                                and not engine.side_stream_free()):
                            # another capture, still open, holds the side stream: this one stays on its stream
                            engine.enqueue(sp, serial=True, grad_hidden_ready=ready)
                        else:
                            engine.side_in_capture, engine.side_capture_stream = True, sp
                            engine.enqueue(sp, grad_hidden_ready=ready)
                    elif engine.side_in_capture and not engine.side_stream_free():
                        engine.enqueue(sp, serial=True, grad_hidden_ready=ready)  # all on the caller's stream
                    elif self.graph:
                        self._replay_or_capture(io, s)
                    elif engine.call_graph and not ready:
                        engine.launch_graph(sp)  # the same work as enqueue, as one re-pointed graph launch
                    else:
                        engine.enqueue(sp, grad_hidden_ready=ready)
                except BaseException as e:
                    if capturing:  # no NaN fill: it would be captured too; the caller must discard the capture
                        raise
                    error = _plan_cache.fill_nan_after_failure(e, lambda: self._after_failure(call, s))
                    if error is e:
                        raise
                    raise error from e
                if not capturing:
                    engine.record_done(sp)
        return FFNGrads(*results)

    def _check_capturable(self, call):
        """Raise, before anything is enqueued, if this call would have to allocate during capture."""
        names = [n for i, n in enumerate(_validate.OUTPUT_NAMES)
                 if (self.need_grad_hidden, self.need_weight_grads, self.need_weight_grads)[i]
                 and call.out[i] is None and not (self.graph and self._owned_out and self._owned_out[i] is not None)]
        if names:
            raise RuntimeError(
                f"cupyffn: gelu_ffn_backward was called during CUDA stream capture without out= for "
                f"{', '.join(names)}: allocating from CuPy's memory pool inside a capture would tie that "
                f"memory to the graph with nothing keeping it alive. Pass every output in out=")
        if self._engine.allocates_for(call.inputs):
            raise RuntimeError(
                "cupyffn: gelu_ffn_backward was called during CUDA stream capture, but this plan has not "
                "yet run in memory mode (gelu_out=None) and would allocate its buffer; call it once with "
                "the same arguments outside the capture first")

    def _after_failure(self, call, stream):
        """Mark the failed call's work done (close() waits for it) and NaN-fill the caller's out= arrays."""
        self._engine.record_done(stream.ptr)
        _poison(call, stream)

    def _outputs(self, call, out, stream):
        """(results to return, device pointers to write): the caller's out= objects, else new (or plan-owned) arrays."""
        import cupy

        shapes = (call.lead_shape + (self.dim,), (self.hidden_dim, self.dim), (self.dim, self.hidden_dim))
        needed = (self.need_grad_hidden, self.need_weight_grads, self.need_weight_grads)
        if self.graph and self._owned_out is None:
            self._owned_out = [None, None, None]
        results, pointers = [], []
        for i, (shape, need) in enumerate(zip(shapes, needed)):
            if not need:
                results.append(None)
                pointers.append(0)
            elif call.out[i] is not None:
                results.append(out[i])
                pointers.append(call.out[i].ptr)
            else:
                if self.graph and self._owned_out[i] is not None:
                    array = self._owned_out[i]
                else:
                    array = _allocate(cupy, shape, stream)
                    if self.graph:
                        self._owned_out[i] = array
                results.append(array)
                pointers.append(array.data.ptr)
        return results, pointers

    def _replay_or_capture(self, key, stream):
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.launch(stream=stream)
            return
        import cupy

        engine = self._engine
        engine.enqueue(stream.ptr)  # this call's results, the ordinary way
        if self._capture_stream is None:
            self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        cs = self._capture_stream
        cs.begin_capture()
        try:
            engine.enqueue(cs.ptr)
        except BaseException:
            cs.end_capture()  # leave the stream usable; the graph is discarded
            raise
        graph = cs.end_capture()
        graph.upload(stream=stream)
        self._graphs[key] = graph
        while len(self._graphs) > 4:
            self._graphs.popitem(last=False)

    def close(self):
        """Give back device memory and cuBLAS handles now (also done when the plan is collected).

        Waits (on the host) for the plan's calls to finish on the device first, so nothing they still
        use is reused; calls after close() raise RuntimeError. A plan captured into a CUDA graph
        (pinned) cannot be closed until ``cupyffn.release_captured_plans()``.
        """
        with self._lock:  # a call in progress finishes enqueuing first
            if self._closed:
                return
            if _plan_cache.is_pinned(self):
                raise _plan_cache.pinned_error("GeluFFNBackward plan")
            self._closed = True
            self._graphs.clear()  # an executable graph still running is freed when it completes
            self._owned_out = None
        if self._engine is not None:  # waits on the device outside the lock
            self._engine.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ profiling hook (bench.py)
    def profile_stages(self, *arrays, out, stream=None, reps=5, before_each=None):
        """GPU time of each stage of one call, for profiling (the benchmark's stage table).

        Runs the call once the ordinary way (so `arrays` and `out` are validated as usual), then
        `reps` more times with every step serialized on `stream` and an event after each step;
        `before_each()`, if given, is called (on `stream`) before each rep, e.g. to flush the L2.
        Serialized steps do not overlap, so their sum exceeds an ordinary call's time at small T.
        Returns ``{stage: {"ms": median ms, "bytes": bytes moved}}`` in issue order; "bytes" only for
        memory-bound stages; a stage issued twice in one call gets " #2" (the fp16 rescue launches).
        GPU plans only; `out` (all three outputs) receives the results, as in an ordinary call.
        """
        if self._engine is None:
            raise RuntimeError("profile_stages needs a GPU plan; a device='cpu' plan has no GPU stages")
        if out is None or len(out) != 3 or any(o is None for o in out):
            raise ValueError("profile_stages needs out= with all three output arrays")
        if isinstance(reps, bool) or not isinstance(reps, (int, numpy.integer)) or reps < 1:
            raise ValueError(f"reps must be an integer >= 1; got {reps!r}")
        import cupy

        s = stream if stream is not None else cupy.cuda.get_current_stream()
        self(*arrays, out=out, stream=s)
        engine = self._engine
        samples = {}
        with self._lock:  # no ordinary call of this plan interleaves with the serialized ones
            if self._closed:  # closed by another thread since the call above: its scratch is being freed
                raise _closed_error()
            for _ in range(int(reps)):
                if before_each is not None:
                    with s:
                        before_each()
                events = [(None, cupy.cuda.Event())]
                events[0][1].record(s)

                def mark(stage):
                    e = cupy.cuda.Event()
                    e.record(s)
                    events.append((stage, e))

                engine.order_after_previous(s.ptr)
                engine.enqueue(s.ptr, serial=True, mark=mark)
                engine.record_done(s.ptr)
                s.synchronize()
                seen = {}
                for (_, a), (stage, b) in zip(events, events[1:]):
                    seen[stage] = seen.get(stage, 0) + 1
                    key = stage if seen[stage] == 1 else f"{stage} #{seen[stage]}"
                    samples.setdefault(key, []).append(cupy.cuda.get_elapsed_time(a, b))
        nbytes = engine.stage_bytes()
        result = {}
        for stage, values in samples.items():
            row = {"ms": float(numpy.median(values))}
            if stage in nbytes:
                row["bytes"] = nbytes[stage]
            result[stage] = row
        return result



def _allocate(cupy, shape, stream):
    try:
        with stream:
            return cupy.empty(shape, dtype=cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError as e:
        nbytes = 4 * int(numpy.prod(shape))
        raise MemoryError(f"cupyffn could not allocate an output of shape {shape} ({nbytes} bytes): {e}") from None


def _as_cupy(array):
    import cupy

    return array if isinstance(array, cupy.ndarray) else cupy.from_dlpack(array)


def _poison(call, stream):
    """After a failure mid-call, fill the caller's out= arrays with NaN so no stale or partial value
    passes (with accumulate=True too: a partial accumulation cannot be undone)."""
    with stream:
        for array, m in zip(call.out_arrays, call.out):
            if m is not None:
                _arrays.view2d(array, m).fill(numpy.nan)


def _closed_error():
    return RuntimeError("this GeluFFNBackward plan was closed")


def _stream_ptr(stream, device):
    import cupy

    if stream is not None:
        return stream.ptr
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


def _run_cpu(call, out, precision, need_grad_hidden, need_weight_grads, accumulate):
    shapes = (call.lead_shape + (call.dim,), (call.hidden_dim, call.dim), (call.dim, call.hidden_dim))
    needed = (need_grad_hidden, need_weight_grads, need_weight_grads)
    results, views = [], []
    for i, (shape, need) in enumerate(zip(shapes, needed)):
        if not need:
            results.append(None)
            views.append(None)
        elif call.out[i] is not None:
            results.append(out[i])
            views.append(_arrays.view2d(call.out_arrays[i], call.out[i]))
        else:
            array = numpy.empty(shape, dtype=numpy.float32)
            results.append(array)
            views.append(array.reshape(-1, shape[-1]))
    if call.tokens == 0:
        for v, need in zip(views[1:], needed[1:]):
            if need and not accumulate:
                v[...] = 0
        return FFNGrads(*results)
    try:
        _numpy_backend.backward(call, precision, need_grad_hidden, need_weight_grads, accumulate, views)
    except BaseException:
        for v, m in zip(views, call.out):
            if m is not None:
                v[...] = numpy.nan  # as on the GPU: never leave partial results in the caller's arrays
        raise
    return FFNGrads(*results)


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


def _no_plan_error(what):
    return RuntimeError(f"cupyffn: {what} was called during CUDA stream capture but no plan exists for this "
                        f"shape/precision; call it once outside the capture first (on any stream)")


def _ready_event_ptr(event, plan):
    """The raw pointer of a grad_hidden_ready event (0 for None), after checking it can be honoured."""
    if event is None:
        return 0
    if plan is not None and plan._engine is None:
        raise ValueError("grad_hidden_ready= is for GPU arrays (a cupy.cuda.Event); these are NumPy (CPU) arrays, "
                         "whose results are all ready when the call returns")
    if plan is not None and not plan.need_grad_hidden:
        raise ValueError("grad_hidden_ready= was given but grad_hidden_states is not computed (need_grad_hidden=False)")
    if plan is not None and plan.graph:
        raise ValueError("grad_hidden_ready= is not supported by graph=True plans (a replayed graph records the "
                         "events it was captured with); capture the call in your own graph instead")
    ptr = getattr(event, "ptr", None)
    if not isinstance(ptr, int) or not ptr:
        raise TypeError(f"grad_hidden_ready must be a cupy.cuda.Event or None; got {type(event).__name__}")
    return ptr


def _plan_key(call, precision, need_grad_hidden, need_weight_grads, options):
    """The plan cache's key of `call`: device, shape, precision, flags and the EngineOptions the plan is built with
    (EngineOptions.from_env at each call: a plan built under another CUPYFFN_ENGINE is never reused)."""
    return (call.device, call.tokens, call.dim, call.hidden_dim, precision.name, need_grad_hidden,
            need_weight_grads, options)


def _recent_key(sig, precision, need_grad_hidden, need_weight_grads, options):
    """The key of `_recent` (the fast path for repeated arrays): the validated signature and the rest of the plan's
    key (_plan_key)."""
    return (sig, precision.name, need_grad_hidden, need_weight_grads, options)


def _acquire_plan(call, precision, stream, need_grad_hidden, need_weight_grads, options):
    """The cached plan for `call` (keyed by _plan_key; in use until released), built with `options`."""
    import cupy

    key = _plan_key(call, precision, need_grad_hidden, need_weight_grads, options)
    plan = _plans.acquire(key)
    if plan is not None:
        return plan
    with cupy.cuda.Device(call.device):
        if _plan_cache.is_capturing(_stream_ptr(stream, call.device)):
            raise _no_plan_error("gelu_ffn_backward")  # building allocates and zero-fills
    return _plans.acquire(key, lambda: GeluFFNBackward(
        call.tokens, call.dim, call.hidden_dim, precision=precision.name, device=call.device,
        need_grad_hidden=need_grad_hidden, need_weight_grads=need_weight_grads, _options=options))


def gelu_ffn_backward(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner=None, gelu_out=None, *,
                      precision=None, out=None, stream=None, accumulate=False,
                      need_grad_hidden=True, need_weight_grads=True, check_activations=False,
                      grad_hidden_ready=None):
    """Backward pass of ``y = gelu_tanh(x @ weight1.T) @ weight2.T`` (no biases).

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
        exceeds 24576 (``cupyffn._ksplit.MAX_K``) sums it in chunks added in fp32 (measured from
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
    grad_hidden_ready : cupy.cuda.Event, optional
        Recorded on the stream as soon as grad_hidden_states is written, before the weight gradients
        are finished (tensor parallelism: start its all-reduce on another stream with
        ``other.wait_event(grad_hidden_ready)`` while the weight-gradient GEMMs run). The call still
        returns everything ready on the stream. GPU only, needs need_grad_hidden=True; not with
        graph=True plans. Under a caller's CUDA stream capture the record is captured too (wait on
        it inside the same capture).

    Arrays may be NumPy (computed on the CPU), CuPy, or any DLPack / CUDA Array Interface producer
    (torch.Tensor, jax.Array), all on one device, float32. The last dimension must be contiguous and
    the leading dimensions must flatten to one row stride. Returns an FFNGrads named tuple (CuPy
    arrays for GPU inputs, NumPy arrays for NumPy inputs; the out= objects themselves where given).
    """
    # None: the default of the arrays' device, known once they are looked at; a bad name is reported first
    prec = _precision.lookup(precision) if precision is not None else None
    args = (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out)
    sig = _validate.signature(args, out, accumulate)
    options = None  # the GPU plan's EngineOptions (CUPYFFN_ENGINE, parsed once per value), read for GPU arrays only
    if sig is not None:  # CuPy arrays: the plan (and its validated call) may be known already
        if prec is None:
            prec = _GPU_DEFAULT
        options = EngineOptions.from_env()
        plan = _recent.get(_recent_key(sig, prec, need_grad_hidden, need_weight_grads, options))
        if plan is not None and _plans.reacquire(plan):  # not if evicted meanwhile
            try:
                return plan._run(args, out, stream, accumulate, sig, check_activations=check_activations,
                                 grad_hidden_ready=grad_hidden_ready)
            finally:
                _plans.release(plan)
    call = _validate.prepare(args, out, stream, need_grad_hidden, need_weight_grads, accumulate)
    if prec is None:
        prec = _precision.resolve(None, cpu=call.backend == "cpu")
    if call.backend == "cpu":
        if grad_hidden_ready is not None:
            raise ValueError("grad_hidden_ready= is for GPU arrays (a cupy.cuda.Event); these are NumPy (CPU) "
                             "arrays, whose results are all ready when the call returns")
        if check_activations:
            _checks.check(call)
        return _run_cpu(call, out, prec, need_grad_hidden, need_weight_grads, accumulate)
    if options is None:
        options = EngineOptions.from_env()
    plan = _acquire_plan(call, prec, stream, need_grad_hidden, need_weight_grads, options)
    try:
        if sig is not None:
            if len(_recent) >= 4 * _CACHE_SIZE:
                _recent.clear()
            _recent[_recent_key(sig, prec, need_grad_hidden, need_weight_grads, options)] = plan
        return plan._run(args, out, stream, accumulate, sig, call, check_activations=check_activations,
                         grad_hidden_ready=grad_hidden_ready)
    finally:
        _plans.release(plan)
