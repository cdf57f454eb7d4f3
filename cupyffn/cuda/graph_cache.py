"""Calls replayed as CUDA graphs keyed by their pointers: the torch layer's 16-bit/bias plans (cupyffn/_torch_lt.py)
and the float32 engine's calls where it runs a call graph (cupyffn/_backward_gpu.py).

A cuBLASLt GEMM with an epilogue costs ~17 us of host time per cublasLtMatmul call (docs/decisions/051), so
a backward of four of them is host-bound at small T; the float32 engine's re-pointed call graph costs the re-pointing
of its launches and nodes on every call. Tensors from torch's caching allocator get the same addresses step after
step in a training loop (and the benchmark rotates three input sets); a call whose pointers (and flags) repeat is
captured once into a graph and then launched as one cuGraphLaunch. A pointer set is captured the second time it is seen, so
one that never repeats costs an eager call and nothing more; at most `KEEP` graphs are kept per plan (the least
recently used is dropped; the driver frees an executable graph once its launches finish).
"""

import collections

#: Graphs kept per plan, and pointer sets remembered (seen once) per plan.
KEEP = 8
SEEN = 64


def _runtime():
    from cupy_backends.cuda.api import runtime

    return runtime


class GraphReplay:
    """The graphs of one plan. `run(key, enqueue, stream_ptr, done_event_ptr)`: `enqueue(stream_ptr, capturing)`
    issues the call eagerly (capturing False) or into a capture (True). The plan's lock is held by the caller."""

    def __init__(self):
        self._graphs = collections.OrderedDict()
        self._seen = set()
        self._capture_stream = None
        self.captures = self.launches = 0

    def graph(self, key):
        """The graph captured for `key` (now the most recently used), or None."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        return graph

    def launch(self, graph, stream_ptr, done_event_ptr=None):
        """Launch `graph` on `stream_ptr`, ordered like an eager call after the plan's previous call when
        `done_event_ptr` is given (recorded after each call; None: the caller orders it)."""
        runtime = _runtime()
        if done_event_ptr is not None:
            runtime.streamWaitEvent(stream_ptr, done_event_ptr, 0)
        try:
            graph.launch(stream_ptr)
            self.launches += 1
        finally:
            if done_event_ptr is not None:
                runtime.eventRecord(done_event_ptr, stream_ptr)

    def run(self, key, enqueue, stream_ptr, done_event_ptr=None):
        """Issue the call of `key` on `stream_ptr`: eagerly the first time the key is seen, then as its graph
        (launched as `launch` does)."""
        graph = self.graph(key)
        if graph is None:
            if key not in self._seen:
                if len(self._seen) >= SEEN:
                    self._seen.clear()
                self._seen.add(key)
                enqueue(stream_ptr, False)
                return
            graph = self._capture(enqueue, stream_ptr)
            self._graphs[key] = graph
            while len(self._graphs) > KEEP:
                self._graphs.popitem(last=False)[1].destroy()
        self.launch(graph, stream_ptr, done_event_ptr)

    def _capture(self, enqueue, stream_ptr):
        import cupy

        from .call_graph import CallGraph

        if self._capture_stream is None:
            self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        graph = CallGraph()  # no re-pointed nodes: every pointer is the key's
        try:
            graph.capture(lambda sp: enqueue(sp, True), self._capture_stream.ptr, upload_stream_ptr=stream_ptr)
        except BaseException:
            graph.destroy()
            raise
        self.captures += 1
        return graph

    def destroy(self):
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self._seen.clear()
