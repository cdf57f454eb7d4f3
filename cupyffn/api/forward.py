"""The forward pass: ``output = gelu_tanh(hidden_states @ weight1.T) @ weight2.T``, returning exactly the
tensors the backward takes (linear1_out, tanh_inner, gelu_out), with the same precision plans.

GPU work, on one stream:  convert X, weight1, weight2 ─► GEMM z = X @ W1^T (written into linear1_out)
─► gelu_forward (z -> tanh_inner, gelu_out, and gelu_out's GEMM operand) ─► GEMM output = G @ W2^T.
Both GEMMs contract over the feature dimension, so every operand keeps its planes side by side in
its rows. For "tf32", the fp16 scale slots reuse the backward's table (kernels_cu/common.cuh): X in
slot 0 and W1 in slot 1 (GEMM pair 0), G in slot 5 and W2 in slot 4 (GEMM pair 2).
"""

import ctypes
import threading
from typing import Any, NamedTuple

import numpy

from ..core import arrays as _arrays, plans as _plan_cache, precision as _precision
from ..cuda import kernels as _kernels
from ..cpu import backend as _numpy_backend
from ..core import precision as P
from ..engine.launches import convert_launch, items, vec_ok
from ..engine.layout import Operand, align
from ..gemm import cublas, ksplit
from ..gemm import desc as gemm_desc
from ..core.plans import PlanCache

FORWARD_OUTPUTS = ("output", "linear1_out", "tanh_inner", "gelu_out")
_SLOT = {"hidden_states": 0, "weight1": 1, "weight2": 4, "gelu_out": 5}
_PATTERN = {"hidden_states": P.PATTERN_HLH, "weight1": P.PATTERN_HHL, "gelu_out": P.PATTERN_HLH,
            "weight2": P.PATTERN_HHL}


class FFNForward(NamedTuple):
    """Forward results; linear1_out, tanh_inner and gelu_out are what gelu_ffn_backward takes."""

    output: Any
    linear1_out: Any
    tanh_inner: Any
    gelu_out: Any


def _prepare(hidden_states, weight1, weight2, out, stream, biases=(None, None)):
    from .validate import _matrix, _overlaps

    names = ("hidden_states", "weight1", "weight2") + tuple(n for n, b in zip(("bias1", "bias2"), biases)
                                                            if b is not None)
    given = (hidden_states, weight1, weight2) + tuple(b for b in biases if b is not None)
    torch_devices = set()  # torch's stream is followed once per call, after every argument is read and checked
    imported = [_arrays.import_array(a, n, stream, torch_devices) for a, n in zip(given, names)]
    backends = {b for b, _ in imported}
    if len(backends) > 1:
        raise ValueError("cannot mix NumPy (CPU) and GPU arrays: " +
                         ", ".join(f"{n} is on the {'CPU' if b == 'cpu' else 'GPU'}" for (b, _), n in zip(imported, names)))
    backend = backends.pop()
    if backend == "cpu" and stream is not None:
        raise ValueError("stream= is for GPU arrays; these inputs are NumPy (CPU) arrays")
    arrays = [a for _, a in imported]
    for a, n in zip(arrays, names):
        if a.dtype != numpy.float32:
            raise TypeError(f"{n} must be float32; got {a.dtype}")
    devices = {_arrays.device_of(a) for a in arrays}
    if len(devices) > 1:
        raise ValueError("all arrays must be on one device; got " +
                         ", ".join(f"{n} on {_arrays.device_of(a)}" for a, n in zip(arrays, names)))
    x, w1, w2 = arrays[:3]
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"hidden_states must have shape [..., dim] with dim >= 1; got {tuple(x.shape)}")
    dim = x.shape[-1]
    if w1.ndim != 2 or w1.shape[1] != dim or w1.shape[0] < 1:
        raise ValueError(f"weight1 must have shape (hidden_dim, dim) with dim = hidden_states.shape[-1] = {dim}; "
                         f"got {tuple(w1.shape)}")
    hidden = w1.shape[0]
    if tuple(w2.shape) != (dim, hidden):
        raise ValueError(f"weight2 must have shape (dim, hidden_dim) = {(dim, hidden)}; got {tuple(w2.shape)}")
    for a, n in zip(arrays[3:], names[3:]):
        length = hidden if n == "bias1" else dim
        if tuple(a.shape) != (length,):
            raise ValueError(f"{n} must have shape ({length},); got {tuple(a.shape)}")
    every = [_matrix(a, n) for a, n in zip(arrays, names)]  # outputs may overlap none of them
    by_name = dict(zip(names, every))
    mats, bias_mats = every[:3], [by_name.get("bias1"), by_name.get("bias2")]
    lead = tuple(x.shape[:-1])
    shapes = (lead + (dim,), lead + (hidden,), lead + (hidden,), lead + (hidden,))
    outs, out_arrays = [None] * 4, [None] * 4
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 4:
            raise TypeError("out must be a sequence of four arrays (output, linear1_out, tanh_inner, gelu_out); "
                            "an entry may be None to have cupyffn allocate it")
        for i, (obj, name) in enumerate(zip(out, FORWARD_OUTPUTS)):
            if obj is None:
                continue
            label = f"out[{i}] ({name})"
            b, a = _arrays.import_array(obj, label, stream, torch_devices)
            if b != backend or _arrays.device_of(a) != _arrays.device_of(x):
                raise ValueError(f"{label} must be on the inputs' device")
            if a.dtype != numpy.float32:
                raise TypeError(f"{label} must be float32; got {a.dtype}")
            if tuple(a.shape) != shapes[i]:
                raise ValueError(f"{label} must have shape {shapes[i]}; got {tuple(a.shape)}")
            if not a.flags.c_contiguous or not getattr(a.flags, "writeable", True):
                raise ValueError(f"{label} must be a writeable C-contiguous array")
            m = _matrix(a, label)
            for inp, n in zip(every, names):
                if _overlaps(m, inp):
                    raise ValueError(f"{label} overlaps the memory of {n}: outputs may not alias inputs")
            for j, prev in enumerate(outs):
                if prev is not None and _overlaps(m, prev):
                    raise ValueError(f"{label} overlaps out[{j}] ({FORWARD_OUTPUTS[j]})")
            outs[i], out_arrays[i] = m, a
    for device in torch_devices:  # one device: the arrays were checked to share it
        _arrays.follow_torch(device, stream)
    return backend, arrays, mats, bias_mats, lead, dim, hidden, shapes, outs, out_arrays


class GpuForward:
    """Buffers, launches and GEMMs of one forward shape (see the module docstring)."""

    def __init__(self, tokens, dim, hidden_dim, precision, device_id, bias2=False):
        import cupy

        self.T, self.D, self.H = tokens, dim, hidden_dim
        self.precision = precision
        self.bias2 = bias2  # output starts as bias2's rows and the second GEMM adds onto it (beta = 1)
        self.form = precision.forward  # the recipe's form of both forward GEMMs
        self.planes = self.form.planes
        self.device_id = device_id
        p = self.planes
        self.ops = {}
        if p:
            self.ops = {"hidden_states": Operand("hidden_states", tokens, dim, True, p),
                        "weight1": Operand("weight1", hidden_dim, dim, True, p),
                        "weight2": Operand("weight2", dim, hidden_dim, True, p),
                        "gelu_out": Operand("gelu_out", tokens, hidden_dim, True, p)}
        offset = 0
        for op in self.ops.values():
            op.offset = offset
            offset += align(op.nbytes)
        self.scratch_bytes = offset
        with cupy.cuda.Device(device_id):
            try:
                self._scratch = cupy.cuda.alloc(max(offset, 256))
                self._state = cupy.zeros(4 * _kernels.STATE_SLOTS, dtype=cupy.int32)
                self._consts = cupy.asarray([0, 1, 1, 1, 1, 1, 0, 0], dtype=cupy.float32)
            except cupy.cuda.memory.OutOfMemoryError as e:
                raise MemoryError(f"cupyffn's forward needs {offset} bytes of device scratch for T={tokens}, "
                                  f"D={dim}, H={hidden_dim}: {e}") from None
            self._base = self._scratch.ptr
            self._state_ptr = ctypes.c_void_p(self._state.data.ptr)
            self._consts_ptr = ctypes.c_void_p(self._consts.data.ptr)
            self._handle = cublas.acquire(device_id)
            self.lock = threading.Lock()
            self.closed = False
            self._ev_done = cupy.cuda.Event(disable_timing=True)
            self._ev_done.record()
            if tokens > 0:
                self._build()

    def _addr(self, name):
        return self._base + self.ops[name].offset

    def _convert_launch(self, names, grid, rescue, alpha_mask):
        kernel = _kernels.get_function("convert", f"convert_kernel<{self.form.fmt}>", self.device_id)
        targets = [(self.ops[n], self._addr(n), _PATTERN[n], _SLOT[n]) for n in names]
        return convert_launch(kernel, targets, grid, rescue, 0, alpha_mask, self._state_ptr, self._consts_ptr)

    def _build(self):
        dev, form, p = self.device_id, self.form, self.planes
        f16 = form.fmt == P.FMT_F16S
        sms = _kernels.sm_count(dev)
        self._convert = self._rescue = self._g_rescue = None
        if p:
            full = sms * _kernels.blocks_per_sm("convert", f"convert_kernel<{form.fmt}>", dev) * 2
            self._convert = self._convert_launch(["hidden_states", "weight1", "weight2"], full, 0, 0)
            if f16:
                self._rescue = self._convert_launch(["hidden_states", "weight1", "weight2"], 2 * sms, 1, 0b0001)
                self._g_rescue = self._convert_launch(["gelu_out"], 2 * sms, 1, 0b0100)
        expr = f"gelu_forward_kernel<{form.fmt}>"
        job = _kernels.GeluForwardJob()
        job.rows, job.cols = self.T, self.H
        job.slot, job.counter, job.pattern = _SLOT["gelu_out"], 2, _PATTERN["gelu_out"]
        if p:
            op = self.ops["gelu_out"]
            job.dst, job.dst_ld, job.part_stride = self._addr("gelu_out"), op.dst_ld, op.part_stride
        self._gelu = _kernels.KernelLaunch(_kernels.get_function("gelu_forward", expr, dev), job, self._state_ptr)
        self._gelu.grid = max(1, min(items(self.T, self.H), sms * _kernels.blocks_per_sm("gelu_forward", expr, dev) * 2))
        dtype = gemm_desc.OPERAND_TYPE[form.fmt]
        kp = max(p, 1)

        # every GEMM sums K in chunks of at most ksplit.MAX_K (docs/decisions/001-k-chunks.md)
        max_k = ksplit.MAX_K

        def gemm(m, n, k, name):  # described once, built by the cuBLAS backend (cupyffn/gemm/desc.py)
            desc = gemm_desc.GemmDesc(name, m, n, k, dtype, dtype, b_trans=True)
            return gemm_desc.build(desc, self.device_id, backends=(gemm_desc.CUBLAS,), max_k=max_k,
                               one_ptr=self._consts.data.ptr + 4)[0]

        self.gemm_z = gemm(self.T, self.H, kp * self.D, "linear1_out = hidden_states @ weight1^T")
        self.gemm_y = gemm(self.T, self.D, kp * self.H, "output = gelu_out @ weight2^T")
        consts = self._consts.data.ptr
        self.gemm_z.alpha.value, self.gemm_z.beta.value = consts + 4 * 2, consts
        self.gemm_y.alpha.value, self.gemm_y.beta.value = consts + 4 * 4, consts + (4 if self.bias2 else 0)
        self._bias_rows = None
        if self.bias2:
            self._bias_rows = _kernels.KernelLaunch(_kernels.get_function("bias", "bias_rows_kernel", dev),
                                                    ctypes.c_void_p(), ctypes.c_longlong(self.D),
                                                    ctypes.c_longlong(self.T), ctypes.c_int(self.D), ctypes.c_void_p())
            self._bias_rows.grid = max(1, min(self.T, 4 * sms))
        if p:
            self.gemm_z.a.value, self.gemm_z.lda.value = self._addr("hidden_states"), p * self.D
            self.gemm_z.b.value, self.gemm_z.ldb.value = self._addr("weight1"), p * self.D
            self.gemm_y.a.value, self.gemm_y.lda.value = self._addr("gelu_out"), p * self.H
            self.gemm_y.b.value, self.gemm_y.ldb.value = self._addr("weight2"), p * self.H

    def run(self, mats, out_ptrs, stream_ptr, capturing=False, biases=(0, 0)):
        """Enqueue one forward (hold `lock`); `biases`: device pointers of bias1 and bias2 (0: none; bias2 given
        exactly when the engine was built for it). During a caller's capture `_ev_done` is neither waited on
        nor recorded (as in the backward engine): ordering replays with eager calls is the caller's."""
        from cupy_backends.cuda.api import runtime

        x, w1, w2 = mats
        b1, b2 = biases
        y_ptr, z_ptr, t_ptr, g_ptr = out_ptrs
        if not capturing:
            runtime.streamWaitEvent(stream_ptr, self._ev_done.ptr, 0)  # scratch of a call on another stream
        if self.planes:
            for launch in (self._convert, self._rescue):
                if launch is None:
                    continue
                jobs = launch.args[0]
                for k, m in enumerate((x, w1, w2)):
                    job = jobs.job[k]
                    job.src, job.src_ld, job.kind = m.ptr, m.ld, 0
                    job.vec = int(vec_ok(m.ptr, m.ld, m.cols) and vec_ok(job.dst, job.dst_ld, m.cols, 2))
        else:
            self.gemm_z.a.value, self.gemm_z.lda.value = x.ptr, x.ld
            self.gemm_z.b.value, self.gemm_z.ldb.value = w1.ptr, w1.ld
            self.gemm_y.a.value, self.gemm_y.lda.value = g_ptr, self.H
            self.gemm_y.b.value, self.gemm_y.ldb.value = w2.ptr, w2.ld
        if self._g_rescue is not None:
            job = self._g_rescue.args[0].job[0]
            job.src, job.src_ld, job.kind = g_ptr, self.H, 0
            job.vec = int(vec_ok(g_ptr, self.H, self.H) and vec_ok(job.dst, job.dst_ld, self.H, 2))
        gj = self._gelu.args[0]
        gj.z, gj.t, gj.g, gj.bias = z_ptr, t_ptr, g_ptr, b1
        gj.z_ld = gj.t_ld = gj.g_ld = self.H
        gj.vec = int(vec_ok(z_ptr, self.H, self.H) and vec_ok(t_ptr, self.H, self.H) and vec_ok(g_ptr, self.H, self.H)
                     and (not self.planes or vec_ok(gj.dst, gj.dst_ld, self.H, 2)) and b1 % 16 == 0)
        if self._bias_rows is not None:
            self._bias_rows.args[0].value, self._bias_rows.args[4].value = y_ptr, b2
        self.gemm_z.c.value, self.gemm_z.ldc.value = z_ptr, self.H
        self.gemm_y.c.value, self.gemm_y.ldc.value = y_ptr, self.D
        try:
            self._handle.bind(stream_ptr)
            for launch in (self._convert, self._rescue):
                if launch is not None:
                    launch(stream_ptr)
            self.gemm_z(self._handle)
            self._gelu(stream_ptr)
            if self._g_rescue is not None:
                self._g_rescue(stream_ptr)
            if self._bias_rows is not None:
                self._bias_rows(stream_ptr)
            self.gemm_y(self._handle)
        finally:  # also after a failure: close() must wait for the part that was enqueued
            if not capturing:
                runtime.eventRecord(self._ev_done.ptr, stream_ptr)

    def close(self):
        """Wait for the last eager call (each waits for the one before), then give back scratch and handle."""
        from cupy_backends.cuda.api import runtime

        with self.lock:  # a call in progress finishes enqueuing first
            if self.closed:
                return
            if _plan_cache.is_pinned(self):
                raise _plan_cache.pinned_error("forward engine")
            self.closed = True
        try:
            runtime.eventSynchronize(self._ev_done.ptr)
        finally:  # as the backward engine: the handle goes back to the pool even if the wait fails
            cublas.release(self._handle)
            self._handle = None
            self._scratch = None


_engines = PlanCache(4)


def clear_cache():
    """Drop the cached forward engines (not those pinned by a captured graph; see _plan_cache)."""
    _engines.clear()


def gelu_ffn_forward(hidden_states, weight1, weight2, *, bias1=None, bias2=None, precision=None, out=None,
                     stream=None):
    """Forward pass ``output = gelu_tanh(hidden_states @ weight1.T + bias1) @ weight2.T + bias2``.

    Returns FFNForward(output, linear1_out, tanh_inner, gelu_out): ``linear1_out = x @ weight1.T``,
    ``tanh_inner = tanh(sqrt(2/pi) (z + 0.044715 z^3))``, ``gelu_out = 0.5 z (1 + tanh_inner)`` in fp32
    (GELU evaluated in fp32 from the GEMM's fp32 result), exactly what ``gelu_ffn_backward`` takes.
    `precision` treats the two GEMMs' operands as in the backward (same contracts; None, the default: the
    arrays' device's default, "fp16+fp8" on a GPU and "ieee", plain fp32, for NumPy arrays); `out` may give any
    of the four outputs (float32, C-contiguous, not overlapping the inputs); arrays, streams, CUDA
    stream capture (all four outputs in `out`, one call of the shape outside the capture first) and
    failures (given outputs NaN-filled) as in ``gelu_ffn_backward``.

    Biases (bias1 [H], bias2 [D], either optional) or bfloat16 / float16 hidden_states (weights and biases float32
    or that dtype) take the 16-bit/bias plan: cuBLASLt GEMMs with the bias and GELU fused into their epilogues,
    fp32 accumulation; linear1_out (with bias1 added), gelu_out and output come back in the activation dtype and
    tanh_inner is None (the backward recomputes it from linear1_out). float32 activations with biases run there
    in precision "ieee" (the default) or "tf32" (cuBLASLt's TF32 compute type); in "bf16x3" or "fp16+fp8" they run
    on the float32 engine, which returns all four tensors in float32 (bias1 added into linear1_out by the GELU
    pass, output starting from bias2's rows). An fp32 weight or bias is rounded to the activation dtype first, as
    torch's autocast does.
    """
    from . import lt_api as _lt_api

    # a bad name is reported before the arrays are looked at; a Precision object routes as its name does
    name = _precision.lookup(precision).name if precision is not None else None
    if _lt_api.wants(hidden_states, bias1 is not None, bias2 is not None) and \
            not _lt_api.engine_biases(hidden_states, name):
        return _lt_api.forward(hidden_states, weight1, weight2, bias1, bias2, name, out, stream)
    if stream is not None and not hasattr(stream, "ptr"):
        raise TypeError(f"stream must be a cupy.cuda.Stream (or ExternalStream) or None; got {type(stream).__name__}")
    backend, arrays, mats, bias_mats, lead, D, H, shapes, outs, out_arrays = _prepare(
        hidden_states, weight1, weight2, out, stream, (bias1, bias2))
    prec = _precision.resolve(precision, cpu=backend == "cpu")  # None: the default of the arrays' device
    T = mats[0].rows
    given = out if out is not None else (None,) * 4
    if backend == "cpu":
        results = [given[i] if outs[i] is not None else numpy.empty(shapes[i], numpy.float32) for i in range(4)]
        views = [(_arrays.view2d(out_arrays[i], outs[i]) if outs[i] is not None else r.reshape(-1, r.shape[-1]))
                 for i, r in enumerate(results)]
        x, w1, w2 = (_arrays.view2d(a, m) for a, m in zip(arrays, mats))
        b1, b2 = (None if b is None else numpy.asarray(b) for b in (bias1, bias2))
        _numpy_backend.forward(x, w1, w2, prec, views, b1, b2)
        return FFNForward(*results)
    import cupy

    device = _arrays.device_of(arrays[0])
    with cupy.cuda.Device(device):
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        capturing = _plan_cache.is_capturing(s.ptr)
        if capturing and any(m is None for m in outs):
            missing = ", ".join(n for n, m in zip(FORWARD_OUTPUTS, outs) if m is None)
            raise RuntimeError(f"cupyffn: gelu_ffn_forward was called during CUDA stream capture without out= for "
                               f"{missing}: allocating from CuPy's memory pool inside a capture would tie that memory "
                               f"to the graph with nothing keeping it alive. Pass all four outputs in out=")
        has_b2 = bias_mats[1] is not None
        key = (device, T, D, H, prec.name, has_b2)  # not by stream: a warm-up on any stream serves a capture
        engine = None
        if T > 0:
            engine = _engines.acquire(key)
            if engine is None:
                if capturing:
                    raise RuntimeError("cupyffn: gelu_ffn_forward was called during CUDA stream capture but no plan "
                                       "exists for this shape/precision; call it once outside the capture first "
                                       "(on any stream)")
                engine = _engines.acquire(key, lambda: GpuForward(T, D, H, prec, device, has_b2))
        try:
            results, ptrs = [], []
            for i in range(4):
                if outs[i] is not None:
                    results.append(given[i])
                    ptrs.append(outs[i].ptr)
                else:
                    with s:
                        a = cupy.empty(shapes[i], dtype=cupy.float32)
                    results.append(a)
                    ptrs.append(a.data.ptr)
            if engine is None:  # T == 0
                return FFNForward(*results)
            try:
                with engine.lock:
                    if engine.closed:  # cannot happen while acquired; a guard, not a path
                        raise RuntimeError("this forward engine was closed")
                    if capturing:
                        _plan_cache.pin(engine)  # a graph may replay its scratch from now on
                    engine.run(mats, ptrs, s.ptr, capturing, tuple(0 if b is None else b.ptr for b in bias_mats))
            except BaseException as e:
                if capturing:  # no NaN fill: it would be captured too; the caller must discard the capture
                    raise

                def fill():
                    with s:
                        for a, m in zip(out_arrays, outs):
                            if m is not None:
                                _arrays.view2d(a, m).fill(numpy.nan)

                error = _plan_cache.fill_nan_after_failure(e, fill)
                if error is e:
                    raise
                raise error from e
        finally:
            if engine is not None:
                _engines.release(engine)
    return FFNForward(*results)
