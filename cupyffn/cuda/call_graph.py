"""One backward call as a CUDA graph that every later call re-points and launches (the engine's eager path).

Why: at small T the GPU work of a call (~0.1 ms) is about as long as its host enqueue (~14 launches, ~0.1 ms),
so the GPU waits on the host between kernels (docs/decisions/018-call-graph.md). A graph is enqueued by one launch.
But the benchmark (and any training step) passes new addresses every call, so a graph keyed by addresses
(GeluFFNBackward(graph=True)) never replays there. This graph takes each call's addresses instead:

* our kernels' nodes get this call's arguments by ``cuGraphExecKernelNodeSetParams`` (documented to apply
  from the next launch on, leaving launches in flight alone; the function may change too, e.g. the sm90
  kernel's staged or direct epilogue variant);
* the cuBLAS GEMMs are captured as ``cublasGemmBatchedEx`` of one matrix (``Gemm.indirect``,
  cupyffn/gemm/cublas.py), whose operand addresses are read on the GPU from a table; the graph's first node
  (``store_call_table`` in kernels_cu/call_table.cu, one more re-pointed kernel node) writes this call's addresses
  into that table.
  Measured on the H200: bit-identical to cublasGemmEx, 1.002-1.032x its GPU time
  (docs/decisions/018-call-graph.md).

So a call costs the argument updates of a few nodes and one ``cuGraphLaunch`` on the host (12 API calls, ~20-40 us,
against ~35 calls and ~80-95 us launched one by one), and the GPU runs the whole call without waiting. The graph
is instantiated with node priorities: the engine captures its critical path on a high-priority stream, so that
where two kernels become ready at once the GPU starts them in the order the host's launches gave them (without
it, convert B went first at T = 8192 and GEMM1's last wave ran alone: +17 us). Where it is the default:
cupyffn/f32/plan.py CALL_GRAPH_TOKENS. The driver entry points come from libcuda through ctypes (names and
structs the same under CUDA 12 and 13; cupyffn/cuda/libcuda.py).
"""

import ctypes

from . import libcuda as _libcuda

# cuda.h enums
_CAPTURE_MODE_THREAD_LOCAL = 1  # unsafe calls (e.g. cudaMalloc) by this thread during the capture fail loudly
_CAPTURE_STATUS_ACTIVE = 1
_INSTANTIATE_USE_NODE_PRIORITY = 8  # run each kernel node at the priority of the stream it was captured from


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_vp, _pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
_PROTOTYPES = {
    "cuStreamBeginCapture_v2": [_vp, ctypes.c_int],
    "cuStreamEndCapture": [_vp, _pvp],
    "cuGraphInstantiateWithFlags": [_pvp, _vp, ctypes.c_ulonglong],
    "cuGraphUpload": [_vp, _vp],
    "cuGraphLaunch": [_vp, _vp],
    "cuGraphExecKernelNodeSetParams_v2": [_vp, _vp, ctypes.POINTER(_KernelNodeParams)],
    "cuGraphExecDestroy": [_vp],
    "cuGraphDestroy": [_vp],
    "cuCtxGetStreamPriorityRange": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
}


def _fn(name):
    return _libcuda.function(name, _PROTOTYPES[name])


def _capture_info():
    """cuStreamGetCaptureInfo: (stream, status, capture id, graph, dependencies[, edge data], number of
    dependencies) as v3 (CUDA 12.3 on) where the driver has it, else v2; and whether it takes the edge data."""
    common = [_vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64), _pvp, ctypes.POINTER(_pvp)]
    if _libcuda.has("cuStreamGetCaptureInfo_v3"):
        return _libcuda.function("cuStreamGetCaptureInfo_v3", common + [_vp, ctypes.POINTER(ctypes.c_size_t)]), True
    return _libcuda.function("cuStreamGetCaptureInfo_v2", common + [ctypes.POINTER(ctypes.c_size_t)]), False


#: A CUDA driver call of the call graph returned an error (the shared driver error).
DriverError = _libcuda.DriverError
_check = _libcuda.check


def greatest_stream_priority():
    """The highest stream priority of the current context (the most negative number)."""
    least, greatest = ctypes.c_int(), ctypes.c_int()
    _check(_fn("cuCtxGetStreamPriorityRange")(ctypes.byref(least), ctypes.byref(greatest)),
           "cuCtxGetStreamPriorityRange")
    return greatest.value


def last_node(stream_ptr):
    """The node that the last launch on `stream_ptr`, a stream being captured, added to the capture: a stream's
    dependency set right after a kernel launch is that one kernel node."""
    info, has_edges = _capture_info()
    status, graph = ctypes.c_int(), ctypes.c_void_p()
    deps, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    edges = (None,) if has_edges else ()
    _check(info(ctypes.c_void_p(stream_ptr), ctypes.byref(status), None, ctypes.byref(graph), ctypes.byref(deps),
                *edges, ctypes.byref(count)), "cuStreamGetCaptureInfo")
    if status.value != _CAPTURE_STATUS_ACTIVE or count.value != 1:
        raise RuntimeError(f"cupyffn: expected one node at the end of the capture, found {count.value} "
                           f"(capture status {status.value})")
    return deps[0]


class CallGraph:
    """An instantiated graph of one engine call and its re-pointable kernel nodes.

    `capture(enqueue, stream_ptr)` runs `enqueue(stream_ptr)` under capture; during it the engine reports each
    of its kernel launches through `record(launch, stream_ptr)`. `launch(stream_ptr)` sets every recorded node
    to its launch's current arguments (``launch.node_params()``: function, grid, block, shared memory, argument
    pointer array) and launches the graph.
    """

    def __init__(self):
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        self._nodes = []  # (launch, node handle)
        self._params = _KernelNodeParams()

    def record(self, launch, stream_ptr):
        self._nodes.append((launch, last_node(stream_ptr)))

    def capture(self, enqueue, stream_ptr, upload_stream_ptr):
        """Capture `enqueue(stream_ptr)` on `stream_ptr` (a stream of ours, idle), instantiate, and upload the graph
        on `upload_stream_ptr` (where it will be launched). Kernel nodes keep the priority of the stream they were
        captured from (the engine captures its critical path on a high-priority stream, see GpuEngine)."""
        stream = ctypes.c_void_p(stream_ptr)
        _check(_fn("cuStreamBeginCapture_v2")(stream, _CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        try:
            enqueue(stream_ptr)
        finally:  # also on failure: the stream must leave capture mode (the half graph is discarded)
            graph = ctypes.c_void_p()
            status = _fn("cuStreamEndCapture")(stream, ctypes.byref(graph))
            self._graph = graph
        _check(status, "cuStreamEndCapture")
        _check(_fn("cuGraphInstantiateWithFlags")(ctypes.byref(self._exec), self._graph,
                                                  _INSTANTIATE_USE_NODE_PRIORITY), "cuGraphInstantiate")
        _check(_fn("cuGraphUpload")(self._exec, ctypes.c_void_p(upload_stream_ptr)), "cuGraphUpload")

    @property
    def node_count(self):
        """Re-pointed kernel nodes (the cuBLAS nodes are not: they read the table)."""
        return len(self._nodes)

    def launch(self, stream_ptr):
        p = self._params
        set_params = _fn("cuGraphExecKernelNodeSetParams_v2")
        for launch, node in self._nodes:
            p.func, grid, block, p.shared_mem_bytes, p.kernel_params = launch.node_params()
            p.grid[0], p.block[0] = grid, block
            p.grid[1] = p.grid[2] = p.block[1] = p.block[2] = 1
            _check(set_params(self._exec, node, ctypes.byref(p)), "cuGraphExecKernelNodeSetParams")
        _check(_fn("cuGraphLaunch")(self._exec, ctypes.c_void_p(stream_ptr)), "cuGraphLaunch")

    def destroy(self):
        """Free the graph. The driver defers freeing an executable graph until its launches finish."""
        if self._exec:
            _fn("cuGraphExecDestroy")(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph:
            _fn("cuGraphDestroy")(self._graph)
            self._graph = ctypes.c_void_p()
        self._nodes = []
