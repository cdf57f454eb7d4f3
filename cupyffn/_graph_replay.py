"""Calls replayed as CUDA graphs keyed by their pointers: the torch layer's 16-bit/bias plans (cupyffn/_torch_lt.py).

A cuBLASLt GEMM with an epilogue costs ~17 us of host time per cublasLtMatmul call (docs/decisions/051), so
a backward of four of them is host-bound at small T. The layer's tensors come from torch's caching allocator, which in
a training loop hands out the same addresses step after step; a call whose pointers (and flags) repeat is captured
once into a graph and then launched as one cuGraphLaunch. A pointer set is captured the second time it is seen, so
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

    def run(self, key, enqueue, stream_ptr, done_event_ptr):
        """Issue the call of `key` on `stream_ptr`: eagerly the first time the key is seen, then as its graph. The
        graph is ordered like an eager call: after the plan's previous call (`done_event_ptr`, recorded after it)."""
        runtime = _runtime()
        graph = self._graphs.get(key)
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
        else:
            self._graphs.move_to_end(key)
        runtime.streamWaitEvent(stream_ptr, done_event_ptr, 0)
        try:
            graph.launch(stream_ptr)
            self.launches += 1
        finally:
            runtime.eventRecord(done_event_ptr, stream_ptr)

    def _capture(self, enqueue, stream_ptr):
        import cupy

        from .engine.call_graph import CallGraph

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
