"""What every GPU engine shares (the float32 backward and forward, cupyffn/f32/; the cuBLASLt backward and forward,
cupyffn/lt/engine.py): the lock, the ordering of calls on different streams, the "last call done" event that close()
waits for, the side stream's part in a caller's CUDA graph capture, and the engine's graph caches (one per graph
policy a route asks of it). The one executor
(cupyffn/api/execute.py) runs every engine through these and the engine's own `bind` / `enqueue` / `eager`.

Ordering and lifetime. Every eager call on a stream other than the previous call's first waits for `_ev_done`
(`order_after_previous`), and a side stream joins back into the caller's stream before `_ev_done` is recorded, so the
last `_ev_done` follows all work of every earlier call on every stream: close() waits on that one event. Calls during
a caller's capture neither wait on `_ev_done` nor record it (an event recorded outside the capture may not be waited
on inside it, and one recorded inside cannot be synchronized on).

Side stream and a caller's capture. An engine with a side stream forks to it with events; under a caller's capture
that makes the side stream join the capture until the caller ends it. Meanwhile an eager call must not use it (its
waits and launches would land in, and break, that capture), nor may a call captured on another stream: both run
everything on the caller's stream instead (`serial`).
"""

import threading

from ..core import plans as _plans
from .graph_cache import GraphCache


class StreamEngine:
    """Base of the GPU engines (module docstring). Subclasses set `side` (a cupy Stream, or None) and implement the
    engines' protocol, bind(call, outputs) (cupyffn/core/results.py Outputs) and enqueue(stream_ptr, serial, ready),
    with io_key(call, outputs), eager(stream_ptr, ready) and _release() (give back what close() frees)."""

    side = None
    what = "plan"  # how errors name the engine

    def __init__(self, device_id):
        import cupy

        self.device_id = device_id
        self.lock = threading.Lock()
        self.closed = False
        self._graph_caches = {}  # GraphPolicy -> GraphCache: the graphs of this engine's calls under each route's policy
        self.side_in_capture = False  # a captured call made the side stream join a caller's capture
        self.side_capture_stream = 0  # ... on this stream of the caller's (its capture holds the side stream)
        self._io = None  # io_key of what the launches were last bound to
        self._last_stream_ptr = None
        with cupy.cuda.Device(device_id):
            self._ev_done = cupy.cuda.Event(disable_timing=True)

    def constructed(self, stream_ptr):
        """Called by a subclass at the end of its construction, which enqueued its zero fills on `stream_ptr`: the
        first call on any other stream waits for them."""
        self.record_done(stream_ptr)
        self._last_stream_ptr = stream_ptr

    def graph_cache(self, policy):
        """The GraphCache of this engine's calls under `policy` (the route's graph column, cupyffn/api/routes.py), made
        on first use; None for a policy that captures nothing (EAGER)."""
        cache = self._graph_caches.get(policy)
        if cache is None and policy.capture_after:
            cache = self._graph_caches[policy] = GraphCache(policy, self.device_id)
        return cache

    def destroy_graphs(self):
        """Drop every graph of this engine's own (the driver frees each once its launches finish) and what its caches
        have seen: the next calls start over."""
        for cache in self._graph_caches.values():
            cache.destroy()
        self._graph_caches.clear()

    # ------------------------------------------------------------------ per call
    def bind_once(self, call, outputs, io):
        """bind(call, outputs) unless the launches are bound to `io` already (None: always)."""
        if io is None or io != self._io:
            self._io = None  # half-set launches must not be taken for this call's
            self.bind(call, outputs)
            self._io = io

    def allocates_for(self, call):
        """Whether binding `call` would allocate device memory (refused during a caller's capture)."""
        return False

    def order_after_previous(self, stream_ptr):
        """Make `stream_ptr` wait for the previous call if that ran on another stream (shared scratch)."""
        from cupy_backends.cuda.api import runtime

        if self._last_stream_ptr is not None and stream_ptr != self._last_stream_ptr:
            runtime.streamWaitEvent(stream_ptr, self._ev_done.ptr, 0)
        self._last_stream_ptr = stream_ptr

    def record_done(self, stream_ptr):
        """Mark the end of a call on `stream_ptr` (also after a failed call: its partial work counts)."""
        from cupy_backends.cuda.api import runtime

        runtime.eventRecord(self._ev_done.ptr, stream_ptr)

    def side_stream_free(self):
        """False while the side stream still belongs to a caller's capture (module docstring). Hold the lock."""
        if self.side is None or not self.side_in_capture:
            return True
        if _plans.is_capturing(self.side.ptr):
            return False
        self.side_in_capture = False
        return True

    def serial_in_capture(self, stream_ptr):
        """For a call captured on `stream_ptr`: True when it must stay on that stream (another open capture holds the
        side stream), else the side stream is claimed for this capture and False. A captured call on
        `side_capture_stream` is in the capture that holds it (a stream is in one capture at a time)."""
        if self.side is None:
            return False
        if self.side_in_capture and self.side_capture_stream != stream_ptr and not self.side_stream_free():
            return True
        self.side_in_capture, self.side_capture_stream = True, stream_ptr
        return False

    # ------------------------------------------------------------------ lifetime
    def close(self):
        """Wait for the engine's last eager call (module docstring), then give back what it holds. A plan a caller's
        graph captured is pinned and refused (cupyffn/core/plans.py)."""
        from cupy_backends.cuda.api import runtime

        with self.lock:  # a call in progress finishes enqueuing first
            if self.closed:
                return
            if _plans.is_pinned(self):
                raise _plans.pinned_error(self.what)
            self.closed = True
        try:
            runtime.eventSynchronize(self._ev_done.ptr)
        finally:  # the handles go back to their pool even if the wait fails
            self.destroy_graphs()
            self._release()

    def _release(self):
        raise NotImplementedError
