"""The cuBLASLt engine: the block with 16-bit activations (bf16, fp16), biases optional, on cuBLASLt's fused
epilogues (docs/decisions/049).

Every GEMM multiplies its 16-bit operands as they come and accumulates in fp32; the elementwise work rides in the
GEMMs' epilogues (the activation's, cupyffn/core/activation.py):

Forward, one stream:   [fp32 weights and biases to the activation dtype] ─► z = x W1^T + b1, epilogue GELU_AUX_BIAS:
                       gelu_out = GELU(z) and linear1_out = z (aux) ─► output = gelu_out W2^T + b2, epilogue BIAS.
Backward, two streams: main  [W2, W1 to 16-bit] ─► GEMM1 grad_linear1 = (dy W2) * GELU'(z) (epilogue DGELU, aux z)
                             ─► GEMM3 dx = grad_linear1 W1 ─► GEMM4 dW1 = grad_linear1^T x, grad_bias1 = its column
                             sums (epilogue BGRADB)
                       side  [gelu_out = GELU(z) in memory mode] ─► GEMM2 dW2 = dy^T gelu_out, grad_bias2 = column
                             sums of dy (epilogue BGRADB); the main stream joins it at the end.
grad_linear1 is rounded to the activation dtype once (as torch's autocast rounds the matmul's output before the GELU
backward); weight and bias gradients leave the GEMMs in fp32 (or the grads' dtype) without a rounding step between.
Weights may come as stored by transformers' Conv1D ([in, out]: `weights_transposed` of its key): the GEMMs that read
them take the other operand layout, no copy; their gradients may be written in that layout too
(`LtBackwardKey.grads_transposed`: GEMM2 and GEMM4 with their operands swapped), so that no transposing copy follows.
"""

from ..core import activation
from ..core.results import BACKWARD_INPUTS, BACKWARD_OUTPUTS
from ..cuda import kernels as _kernels
from ..cuda.stream_engine import StreamEngine
from ..gemm import cublas, cublaslt
from ..gemm.cublas import R_16BF, R_16F, R_32F
from .key import LtBackwardKey, LtForwardKey  # noqa: F401 (what each engine is built for)

#: cudaDataType and half.cu's template argument of each activation dtype name.
CUDA_TYPE = {"bfloat16": R_16BF, "float16": R_16F, "float32": R_32F}
HALF_CODE = {"bfloat16": 0, "float16": 1}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_EPILOGUE = {name: getattr(cublaslt, "EPILOGUE_" + name)
             for name in (activation.LT_FORWARD, activation.LT_FORWARD_BIAS, activation.LT_BACKWARD)}


class _Scratch:
    """One device allocation carved into named, 256-byte-aligned buffers."""

    def __init__(self, sizes, device_id):
        import cupy

        offsets, total = {}, 0
        for name, nbytes in sizes.items():
            offsets[name] = total
            total += (nbytes + 255) // 256 * 256
        with cupy.cuda.Device(device_id):
            self.memory = cupy.cuda.alloc(max(total, 256))
        self.ptr = {name: self.memory.ptr + off for name, off in offsets.items()}
        self.nbytes = total


class _Engine(StreamEngine):
    """What the forward and backward engines share: the key, scratch, GEMM building and the weights' conversion (the
    rest, StreamEngine: cupyffn/cuda/stream_engine.py)."""

    def __init__(self, key, scratch):
        import cupy

        StreamEngine.__init__(self, key.device)
        self.key = key
        self._handles = []
        self.gemms = {}
        with cupy.cuda.Device(key.device):
            try:
                self.scratch = _Scratch(scratch, key.device)
                self._consts = cupy.asarray([0.0, 1.0, 0.0, 0.0], dtype=cupy.float32)  # 0, 1 (alpha/beta pointers)
            except cupy.cuda.memory.OutOfMemoryError as e:
                raise MemoryError(f"cupyffn needs {sum(scratch.values())} bytes of device scratch for {key}: {e}") \
                    from None
            self.constructed(cupy.cuda.get_current_stream().ptr)  # the constants' copy
        self.zero, self.one = self._consts.data.ptr, self._consts.data.ptr + 4

    def handle(self):
        h = cublas.acquire(self.device_id)
        self._handles.append(h)
        return h

    def gemm(self, name, m, n, k, a, b, c, a_trans=False, b_trans=False, epilogue=cublaslt.EPILOGUE_DEFAULT,
             bias_type=None, weight_b=False):
        """An LtMatmul of row-major C[m,n] = op(A) op(B) on contiguous operands (dtype names a, b, c); `weight_b`:
        B is a weight, read in the other layout when the weights are stored transposed."""
        if weight_b and self.key.weights_transposed:
            b_trans = not b_trans
        lda = m if a_trans else k
        ldb = k if b_trans else n
        g = cublaslt.LtMatmul(m, n, k, CUDA_TYPE[a], CUDA_TYPE[b], CUDA_TYPE[c], a_trans, b_trans, lda, ldb, n,
                              name=name, device_id=self.device_id, epilogue=epilogue,
                              bias_type=None if bias_type is None else CUDA_TYPE[bias_type],
                              compute=cublaslt.COMPUTE_32F)
        g.alpha.value, g.beta.value = self.one, self.zero
        self.gemms[name] = g
        return g

    def to_half(self, src_ptr, dst_ptr, rows, cols, stream_ptr):
        """dst = activation dtype of src (fp32), both contiguous [rows, cols]."""
        kernel = _kernels.get_function("half", f"to_half_kernel<{HALF_CODE[self.key.act]}>", self.device_id)
        vec = int(cols % 4 == 0 and src_ptr % 16 == 0 and dst_ptr % 8 == 0)
        n = rows * (cols // 4 if vec else cols)
        _launch(kernel, n, stream_ptr, (src_ptr, cols, dst_ptr, cols, rows, cols, vec), self.device_id)

    def io_key(self, call, outputs):
        """Everything a call is pointed at (the graph cache's key): inputs, outputs, accumulate."""
        return tuple(None if m is None else m.ptr for m in call.inputs), outputs.pointers, call.request.accumulate

    def eager(self, stream_ptr, ready=0):
        self.enqueue(stream_ptr, ready=ready)

    def _release(self):
        for g in self.gemms.values():
            g.close()
        for h in self._handles:
            cublas.release(h)
        self._handles = []
        self.scratch = None


def _launch(kernel, n, stream_ptr, args, device_id):
    """Launch a grid-stride elementwise kernel over n items (at most 4 waves of resident blocks)."""
    import ctypes

    from cupy_backends.cuda.api import driver

    blocks = max(1, min((n + _kernels.BLOCK - 1) // _kernels.BLOCK, 4 * 8 * _kernels.sm_count(device_id)))
    ptr_args = [ctypes.c_void_p(args[0]), ctypes.c_longlong(args[1]), ctypes.c_void_p(args[2]),
                ctypes.c_longlong(args[3]), ctypes.c_longlong(args[4]), ctypes.c_longlong(args[5])]
    if len(args) > 6:
        ptr_args.append(ctypes.c_int(args[6]))
    argv = (ctypes.c_void_p * len(ptr_args))(*(ctypes.addressof(a) for a in ptr_args))
    driver.launchKernel(kernel.kernel.ptr, blocks, 1, 1, _kernels.BLOCK, 1, 1, 0, stream_ptr, ctypes.addressof(argv), 0)


class LtForward(_Engine):
    """The forward of one LtForwardKey (see the module docstring)."""

    what = "forward engine"

    def __init__(self, key):
        T, D, H, act = key.tokens, key.dim, key.hidden_dim, key.act
        size = ITEMSIZE[act]
        # fp32 master weights and biases are rounded here, inside the call (and its graph): each independently, so a
        # caller that casts the weights itself (to keep the casts for its backward) passes fp32 biases unconverted
        # (docs/decisions/063-fp32-biases-in-the-lt-call.md)
        self.convert = key.weights != act
        self.convert_biases = key.biases not in ("", act)
        scratch = {}
        if self.convert:
            scratch.update(weight1=H * D * size, weight2=D * H * size)
        if self.convert_biases:
            scratch.update(bias1=H * size, bias2=D * size)
        super().__init__(key, scratch)
        gelu = _EPILOGUE[activation.LT_FORWARD_BIAS if key.has_bias1 else activation.LT_FORWARD]
        self.gemm("linear1_out, gelu_out = GELU(hidden_states @ weight1^T + bias1)", T, H, D, act, act, act,
                  b_trans=True, epilogue=gelu, weight_b=True)
        self.gemm("output = gelu_out @ weight2^T + bias2", T, D, H, act, act, act, b_trans=True,
                  epilogue=cublaslt.EPILOGUE_BIAS if key.has_bias2 else cublaslt.EPILOGUE_DEFAULT, weight_b=True)
        self._g1, self._g2 = self.gemms.values()
        self._h = self.handle()
        self._ptrs = None

    def bind(self, call, outputs):
        """`call`'s input pointers (hidden_states, weight1, weight2, bias1, bias2; None where absent) and the outputs'
        (output, linear1_out, tanh_inner: not written, gelu_out)."""
        self._ptrs = tuple(None if m is None else m.ptr for m in call.inputs), outputs.pointers

    def enqueue(self, stream_ptr, serial=False, ready=0):
        """Issue the bound forward on `stream_ptr` (one stream)."""
        (x, w1, w2, b1, b2), (y, z, _, g) = self._ptrs
        k = self.key
        s = self.scratch.ptr
        if self.convert:
            self.to_half(w1, s["weight1"], k.hidden_dim, k.dim, stream_ptr)
            self.to_half(w2, s["weight2"], k.dim, k.hidden_dim, stream_ptr)
            w1, w2 = s["weight1"], s["weight2"]
        if self.convert_biases:
            if b1 is not None:
                self.to_half(b1, s["bias1"], 1, k.hidden_dim, stream_ptr)
                b1 = s["bias1"]
            if b2 is not None:
                self.to_half(b2, s["bias2"], 1, k.dim, stream_ptr)
                b2 = s["bias2"]
        g1, g2 = self._g1, self._g2
        g1.a.value, g1.b.value, g1.c.value = x, w1, g
        g1.set_epilogue(bias=b1, aux=z)
        g2.a.value, g2.b.value, g2.c.value = g, w2, y
        g2.set_epilogue(bias=b2)
        self._h.bind(stream_ptr)
        g1(self._h)
        g2(self._h)


_GEMM1 = "grad_linear1 = (grad_output @ weight2) * GELU'(linear1_out)"
_GEMM2 = "grad_weight2 = grad_output^T @ gelu_out"
_GEMM3 = "grad_hidden_states = grad_linear1 @ weight1"
_GEMM4 = "grad_weight1 = grad_linear1^T @ hidden_states"


class LtBackward(_Engine):
    """The backward of one LtBackwardKey (see the module docstring)."""

    what = "backward plan"

    def __init__(self, key):
        import cupy

        T, D, H, act, gt = key.tokens, key.dim, key.hidden_dim, key.act, key.grads
        size = ITEMSIZE[act]
        self.convert = key.weights != act
        self.weight_gemms = key.need_weight_grads or key.bias_grads
        scratch = {"grad_linear1": T * H * size}
        if self.convert:
            scratch.update(weight1=H * D * size, weight2=D * H * size)
        if key.recompute_gelu and self.weight_gemms:
            scratch["gelu_out"] = T * H * size
        if self.weight_gemms and not key.need_weight_grads:  # bias gradients only: the GEMMs write here
            scratch.update(grad_weight1=H * D * ITEMSIZE[gt], grad_weight2=D * H * ITEMSIZE[gt])
        scratch.update(grad_bias1=H * ITEMSIZE[gt], grad_bias2=D * ITEMSIZE[gt])  # accumulate=True adds from here
        super().__init__(key, scratch)
        E = cublaslt
        self.gemm(_GEMM1, T, H, D, act, act, act, epilogue=_EPILOGUE[activation.LT_BACKWARD], weight_b=True)
        if key.need_grad_hidden:
            self.gemm(_GEMM3, T, D, H, act, act, act, weight_b=True)
        if self.weight_gemms:
            # Weight gradients stored [in, out] (the parameter's layout) are the same products with the operands
            # swapped: grad_weight1^T = x^T grad_linear1. The bias gradient then sums the B operand (BGRADA).
            flip = key.grads_transposed
            bgrad = E.EPILOGUE_BGRADA if flip else E.EPILOGUE_BGRADB
            self.gemm(_GEMM4, *((D, H) if flip else (H, D)), T, act, act, gt, a_trans=True,
                      epilogue=bgrad if key.bias_grads else E.EPILOGUE_DEFAULT)
            self.gemm(_GEMM2, *((H, D) if flip else (D, H)), T, act, act, gt, a_trans=True,
                      epilogue=bgrad if key.bias_grads else E.EPILOGUE_DEFAULT)
        with cupy.cuda.Device(key.device):
            self._main, self._side_h = self.handle(), self.handle()
            self.side = cupy.cuda.Stream(non_blocking=True)
            self._ev_fork = cupy.cuda.Event(disable_timing=True)
            self._ev_join = cupy.cuda.Event(disable_timing=True)
        self._a = self._out = None
        self._accumulate = False

    def bind(self, call, outputs):
        """`call`'s input pointers and the outputs' (grad_hidden_states, grad_weight1, grad_weight2, grad_bias1,
        grad_bias2; 0 where not wanted), and accumulate."""
        self._a = {n: (None if m is None else m.ptr) for n, m in zip(BACKWARD_INPUTS, call.inputs)}
        self._out = {n: (p or None) for n, p in zip(BACKWARD_OUTPUTS, outputs.pointers)}
        self._accumulate = bool(call.request.accumulate)

    def enqueue(self, stream_ptr, serial=False, ready=0):
        """Issue the bound backward: GEMM2 on the side stream beside GEMM1, GEMM3, GEMM4 on `stream_ptr` (all on
        `stream_ptr` when `serial`); `ready`: a raw event recorded right after GEMM3. Bias gradients are written to
        scratch and added into out= when accumulating."""
        from cupy_backends.cuda.api import runtime

        a, out, accumulate = self._a, self._out, self._accumulate
        k, s, gm = self.key, self.scratch.ptr, self.gemms
        T, D, H = k.tokens, k.dim, k.hidden_dim
        side = stream_ptr if serial else self.side.ptr
        adds = []
        if not serial:
            runtime.eventRecord(self._ev_fork.ptr, stream_ptr)
            runtime.streamWaitEvent(side, self._ev_fork.ptr, 0)
        try:
            w1, w2 = a["weight1"], a["weight2"]
            if self.convert:
                self.to_half(w2, s["weight2"], D, H, stream_ptr)
                self.to_half(w1, s["weight1"], H, D, stream_ptr)
                w1, w2 = s["weight1"], s["weight2"]
            dy, x, z, gl = a["grad_output"], a["hidden_states"], a["linear1_out"], s["grad_linear1"]
            beta = self.one if accumulate else self.zero

            def target(name):
                ptr = out.get(name)
                return ptr if ptr is not None else s[name]

            def bias_target(name):
                ptr = out.get(name)
                if ptr is None or accumulate:
                    if ptr is not None:
                        adds.append((name, ptr))
                    return s[name]
                return ptr

            # side stream: GEMM2 (and the GELU it needs in memory mode)
            if self.weight_gemms:
                g = a["gelu_out"]
                if g is None:
                    g = s["gelu_out"]
                    kernel = _kernels.get_function("half", f"gelu_half_kernel<{HALF_CODE[k.act]}>", self.device_id)
                    _launch(kernel, T * H, side, (z, H, g, H, T, H), self.device_id)
                g2 = gm[_GEMM2]
                g2.a.value, g2.b.value = (g, dy) if k.grads_transposed else (dy, g)
                g2.c.value = target("grad_weight2")
                g2.beta.value = beta if out.get("grad_weight2") is not None else self.zero
                if k.bias_grads:
                    g2.set_epilogue(bias=bias_target("grad_bias2"))
                self._side_h.bind(side)
                g2(self._side_h)
            # main stream: GEMM1, GEMM3, GEMM4
            self._main.bind(stream_ptr)
            g1 = gm[_GEMM1]
            g1.a.value, g1.b.value, g1.c.value = dy, w2, gl
            g1.set_epilogue(aux=z)
            g1(self._main)
            if k.need_grad_hidden:
                g3 = gm[_GEMM3]
                g3.a.value, g3.b.value, g3.c.value = gl, w1, out["grad_hidden_states"]
                g3(self._main)
                if ready:
                    runtime.eventRecord(ready, stream_ptr)
            if self.weight_gemms:
                g4 = gm[_GEMM4]
                g4.a.value, g4.b.value = (x, gl) if k.grads_transposed else (gl, x)
                g4.c.value = target("grad_weight1")
                g4.beta.value = beta if out.get("grad_weight1") is not None else self.zero
                if k.bias_grads:
                    g4.set_epilogue(bias=bias_target("grad_bias1"))
                g4(self._main)
        finally:  # also on failure: nothing of this call may land after the caller's error handling
            if not serial:
                runtime.eventRecord(self._ev_join.ptr, side)
                runtime.streamWaitEvent(stream_ptr, self._ev_join.ptr, 0)
        for name, ptr in adds:  # accumulate=True: out += this call's bias gradient
            _add(ptr, s[name], H if name == "grad_bias1" else D, k.grads, k.device, stream_ptr)


def _add(dst, src, n, dtype, device_id, stream_ptr):
    """dst[:n] += src[:n] on `stream_ptr` (CuPy's elementwise add over views of the two vectors)."""
    import cupy

    from ..core.views import external_stream, typed_view

    with cupy.cuda.Device(device_id), external_stream(stream_ptr, device_id):
        d = typed_view(dst, (n,), (1,), device_id, dtype)
        cupy.add(d, typed_view(src, (n,), (1,), device_id, dtype), out=d)
