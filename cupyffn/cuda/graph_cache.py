"""The one graph cache: an engine's calls replayed as CUDA graphs keyed by everything they are pointed at, under a
`GraphPolicy` (capture after N sightings of a key, keep K graphs). It serves every graph route of
cupyffn/api/routes.py: the cuBLASLt engine's calls (the torch layer's repeated tensors, decision 051), the float32
engine's calls where it runs a call graph (decision 052), and ``GeluFFNBackward(graph=True)`` plans (captured at
the first sighting).

Why: a cuBLASLt GEMM with an epilogue costs ~17 us of host time per call (docs/decisions/051), and the float32
engine's re-pointed call graph re-points its launches on every call; tensors from a framework's caching allocator
get the same addresses step after step in a training loop, so a call whose key repeats is captured once and then
launched as one cuGraphLaunch. A key seen fewer times than the policy's `capture_after` runs eagerly, so calls whose
addresses never repeat cost an eager call and nothing more. The least recently used graph beyond `keep` is dropped
(the driver frees an executable graph once its launches finish); a policy that stops when thrashing captures no more
once `keep` graphs were dropped (more sets of arrays cycle than are kept: each capture would be wasted). Captures go through one private stream per
device, in the driver's thread-local capture mode (cupyffn/cuda/call_graph.py).
"""

import collections
import threading
from typing import NamedTuple, Optional

from .call_graph import CallGraph


class GraphPolicy(NamedTuple):
    """When an engine's calls become graphs (the graph column of cupyffn/api/routes.py's table)."""

    name: str
    capture_after: Optional[int]  # sightings of one key before its graph is captured (1: the first); None: never
    keep: int                     # graphs kept per engine
    # stop capturing once `keep` graphs were dropped: the calls cycle through more sets of arrays than are kept (a
    # deep model's layers of one shape), where each capture (~1 ms) would be dropped before its next use
    stop_when_thrashing: bool = False


_capture_streams = {}  # device id -> the private stream every capture on that device goes through
_capture_lock = threading.Lock()  # one capture at a time per process: engines on other threads share the stream


def _capture_stream(device_id):
    stream = _capture_streams.get(device_id)
    if stream is None:
        import cupy

        with cupy.cuda.Device(device_id):
            stream = _capture_streams[device_id] = cupy.cuda.Stream(non_blocking=True)
    return stream


class GraphCache:
    """The graphs of one engine under `policy`. `run(key, issue, stream_ptr)`: `issue(stream_ptr, captured)` issues
    the call eagerly (captured False) or into a capture (True). The engine's lock is held by the caller."""

    def __init__(self, policy, device_id):
        if not policy.capture_after or policy.capture_after < 1 or policy.keep < 1:
            raise ValueError(f"a GraphCache needs capture_after >= 1 and keep >= 1; got {policy}")
        self.policy = policy
        self.device_id = device_id
        self._graphs = collections.OrderedDict()
        self._seen = {}  # key -> sightings so far (below capture_after)
        self.captures = self.launches = self.evictions = 0

    def graph(self, key):
        """The graph captured for `key` (now the most recently used), or None."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        return graph

    def launch(self, graph, stream_ptr):
        graph.launch(stream_ptr)
        self.launches += 1

    def run(self, key, issue, stream_ptr):
        """Issue the call of `key` on `stream_ptr`: eagerly until the policy's sightings are reached, then as its
        graph."""
        graph = self.graph(key)
        if graph is None:
            seen = self._seen.get(key, 0) + 1
            if seen < self.policy.capture_after or self.thrashing:
                if len(self._seen) >= 8 * self.policy.keep:  # keys that never repeat are forgotten in bulk
                    self._seen.clear()
                self._seen[key] = seen
                issue(stream_ptr, False)
                return
            self._seen.pop(key, None)
            graph = self._capture(issue, stream_ptr)
            self._graphs[key] = graph
            while len(self._graphs) > self.policy.keep:
                self._graphs.popitem(last=False)[1].destroy()
                self.evictions += 1
        self.launch(graph, stream_ptr)

    @property
    def thrashing(self):
        """Whether the policy has stopped capturing (stop_when_thrashing, after `keep` graphs were dropped): the
        graphs kept are still launched, other sets of arrays run eagerly."""
        return self.policy.stop_when_thrashing and self.evictions >= self.policy.keep

    def _capture(self, issue, stream_ptr):
        graph = CallGraph()  # no re-pointed nodes: every pointer is the key's
        with _capture_lock:
            try:
                graph.capture(lambda sp: issue(sp, True), _capture_stream(self.device_id).ptr,
                              upload_stream_ptr=stream_ptr)
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
