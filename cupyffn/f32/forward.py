"""The float32 forward engine: ``output = gelu_tanh(hidden_states @ weight1.T + bias1) @ weight2.T + bias2`` for one
(T, D, H, precision) on the GPU, returning exactly the tensors the backward takes (linear1_out, tanh_inner,
gelu_out), with the backward's precision recipes (cupyffn/core/precision.py `Precision.forward`).

GPU work, on one stream:  convert X, weight1, weight2 ─► GEMM z = X @ W1^T (written into linear1_out)
─► gelu_forward (z -> tanh_inner, gelu_out, and gelu_out's GEMM operand; bias1 added to z first) ─► [bias2's rows
into output] ─► GEMM output = G @ W2^T (beta = 1 with bias2).
Both GEMMs contract over the feature dimension, so every operand keeps its planes side by side in
its rows. For "tf32", the fp16 scale slots reuse the backward's table (kernels_cu/common.cuh): X in
slot 0 and W1 in slot 1 (GEMM pair 0), G in slot 5 and W2 in slot 4 (GEMM pair 2).
"""

import ctypes

from ..core import precision as P
from ..cuda import kernels as _kernels
from ..cuda.stream_engine import StreamEngine
from ..gemm import cublas, ksplit
from ..gemm import desc as gemm_desc
from .launches import convert_launch, items, vec_ok
from .layout import Operand, align

_SLOT = {"hidden_states": 0, "weight1": 1, "weight2": 4, "gelu_out": 5}
_PATTERN = {"hidden_states": P.PATTERN_HLH, "weight1": P.PATTERN_HHL, "gelu_out": P.PATTERN_HLH,
            "weight2": P.PATTERN_HHL}


class GpuForward(StreamEngine):
    """Buffers, launches and GEMMs of one forward shape (see the module docstring)."""

    what = "forward engine"

    def __init__(self, tokens, dim, hidden_dim, precision, device_id, bias2=False):
        import cupy

        StreamEngine.__init__(self, device_id)
        self.T, self.D, self.H = tokens, dim, hidden_dim
        self.precision = precision
        self.bias2 = bias2  # output starts as bias2's rows and the second GEMM adds onto it (beta = 1)
        self.form = precision.forward  # the recipe's form of both forward GEMMs
        self.planes = self.form.planes
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
            if tokens > 0:
                self._build()
            self.constructed(cupy.cuda.get_current_stream().ptr)  # the zero-filled state

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

    def io_key(self, call, outputs):
        return None  # bound at every call: a few fields of the prebuilt launches

    def bind(self, call, outputs):
        """Point the launches at `call`'s hidden_states, weights and biases and at `outputs` (cupyffn/core/results.py
        Outputs: output, linear1_out, tanh_inner, gelu_out); bias2 is given exactly when the engine was built for
        it."""
        x, w1, w2, mb1, mb2 = call.inputs
        b1, b2 = (0 if m is None else m.ptr for m in (mb1, mb2))
        y_ptr, z_ptr, t_ptr, g_ptr = outputs.pointers
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

    def enqueue(self, stream_ptr, serial=False, ready=0):
        """Issue the bound forward on `stream_ptr` (one stream: `serial` changes nothing)."""
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

    def eager(self, stream_ptr, ready=0):
        self.enqueue(stream_ptr)

    def _release(self):
        cublas.release(self._handle)
        self._handle = None
        self._scratch = None
