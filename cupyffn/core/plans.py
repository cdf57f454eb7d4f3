"""Plan lifetime, shared by the backward and forward caches.

* `EngineCache`: an LRU of per-shape engines (anything with close()). A plan taken with acquire() (or
  reacquire()) is in use until release(): eviction or clear() of an in-use plan only unlinks it, and
  the last release() closes it, so nothing is closed under a call.
* Pins: a plan captured into a caller's CUDA graph is pinned (`pin`) from that call on. A pinned plan
  is held here by a strong reference, eviction and clear() skip it and close() refuses it, because
  the graph replays its scratch by address; `release_captured_plans()` drops the pins.
* `is_capturing`: the one capture query per call; `fill_nan_after_failure`: out= after a failed call.

One module lock guards every cache and the pins (a few dict operations each); it is never held while
a plan is built or closed, so a thread waiting on the device blocks no other thread.
"""

import collections
import sys
import threading
import weakref

_lock = threading.Lock()
_pinned = {}  # id(plan) -> plan: plans a caller's CUDA graph uses
_caches = weakref.WeakSet()  # every EngineCache: dropping pins may leave one above its size


class _Entry:
    """One plan as its cache knows it: its key, the calls in flight on it, and whether it was unlinked (evicted or
    cleared: its last user closes it)."""

    __slots__ = ("plan", "key", "users", "evicted")

    def __init__(self, plan, key):
        self.plan, self.key, self.users, self.evicted = plan, key, 1, False


class EngineCache:
    """Up to `size` unpinned plans by key, least recently used evicted first.

    Plans are built outside the lock; if two threads build the same key, the second build is closed
    and the first kept. The cache's bookkeeping of a plan (its `_Entry`) stays here: a plan is any
    object with close().
    """

    def __init__(self, size):
        self.size = size
        self._linked = collections.OrderedDict()  # key -> _Entry, least recently used first
        self._entries = {}  # id(plan) -> _Entry: the linked plans, and unlinked ones still in use or pinned
        with _lock:
            _caches.add(self)

    def __len__(self):
        return len(self._linked)

    def plans(self):
        """The plans in the cache, least recently used first."""
        with _lock:
            return [e.plan for e in self._linked.values()]

    def acquire(self, key, build=None):
        """The plan for `key`, in use until release(). Missing: build() it (outside the lock), or
        return None when `build` is None (a call during CUDA stream capture must not build)."""
        with _lock:
            entry = self._linked.get(key)
            if entry is not None:
                self._linked.move_to_end(key)
                entry.users += 1
                return entry.plan
        if build is None:
            return None
        plan = build()
        with _lock:
            existing = self._linked.get(key)
            if existing is not None:  # another thread built the same plan meanwhile
                existing.users += 1
                self._linked.move_to_end(key)
                doomed = [plan]
                plan = existing.plan
            else:
                self._linked[key] = self._entries[id(plan)] = _Entry(plan, key)
                doomed = self._evict_locked()
        try:
            _close_all(doomed)
        except BaseException:
            self.release(plan)
            raise
        return plan

    def reacquire(self, plan):
        """Mark `plan` (remembered from an earlier acquire) in use again; False if it left the cache."""
        with _lock:
            entry = self._entries.get(id(plan))
            if entry is None or entry.evicted:
                return False
            entry.users += 1
            self._linked.move_to_end(entry.key)
            return True

    def release(self, plan):
        """End a call on `plan`; the last user of an evicted, unpinned plan closes it."""
        with _lock:
            entry = self._entries[id(plan)]
            entry.users -= 1
            if entry.users or not entry.evicted or id(plan) in _pinned:
                return
            del self._entries[id(plan)]
        plan.close()

    def clear(self):
        """Drop every unpinned plan (closed now, or by its last user when in use)."""
        with _lock:
            doomed = []
            for key in [k for k, e in self._linked.items() if id(e.plan) not in _pinned]:
                doomed += self._unlink_locked(key)
        _close_all(doomed)

    def _unlink_locked(self, key):
        entry = self._linked.pop(key)
        entry.evicted = True
        if entry.users:  # in use: its last release() closes it
            return []
        del self._entries[id(entry.plan)]
        return [entry.plan]

    def after_unpin_locked(self):
        """The plans to close now that no plan is pinned (release_captured_plans, with the module's lock held): those
        kept beyond the cache's size while pinned, and the least recently used beyond it."""
        return self._unpinned_leftovers_locked() + self._evict_locked()

    def _evict_locked(self):
        """Unlink the oldest unpinned plans beyond `size`; returns those to close now."""
        unpinned = [k for k, e in self._linked.items() if id(e.plan) not in _pinned]
        doomed = []
        for key in unpinned[:max(0, len(unpinned) - self.size)]:
            doomed += self._unlink_locked(key)
        return doomed

    def _unpinned_leftovers_locked(self):
        """Forget the unlinked plans that no call uses, kept only for their pins (dropped by the caller); returns
        them to close."""
        left = [e for e in self._entries.values() if e.evicted and not e.users]
        for e in left:
            del self._entries[id(e.plan)]
        return [e.plan for e in left]


def _close_all(plans):
    error = None
    for plan in plans:
        try:
            plan.close()
        except Exception as e:  # close the others anyway; report the first failure
            error = error or e
    if error is not None:
        raise error


def pin(plan):
    """Keep `plan` (and the memory it owns) alive and open until release_captured_plans()."""
    with _lock:
        _pinned[id(plan)] = plan


def is_pinned(plan):
    return id(plan) in _pinned


def release_captured_plans():
    """Drop the pins of every plan captured into a CUDA graph; returns how many there were.

    Call it only once no graph that captured a cupyffn call can be replayed any more (destroyed,
    and its last replay finished): cached plans beyond the cache size are then closed and their
    device memory goes back to CuPy's pool, and plans you own become closable again.
    """
    with _lock:
        plans = list(_pinned.values())
        _pinned.clear()
        doomed = []
        for cache in list(_caches):
            doomed += cache.after_unpin_locked()
    _close_all(doomed)
    return len(plans)


def pinned_error(what):
    return RuntimeError(f"this {what} was captured into a CUDA graph and is pinned: the graph replays its "
                        f"device memory. Destroy the graph, then call cupyffn.release_captured_plans()")


_stream_is_capturing = None


def is_capturing(stream_ptr):
    """Whether `stream_ptr` is being captured into a CUDA graph (one cheap runtime query).

    The legacy default stream (0, cudaStreamLegacy = 1) cannot be captured, and querying it while
    another stream captures is itself an error, so it is not asked. An invalidated capture raises
    (CuPy's RuntimeError): nothing may be enqueued on that stream.
    """
    global _stream_is_capturing
    if stream_ptr <= 1:
        return False
    if _stream_is_capturing is None:
        from cupy_backends.cuda.api.runtime import streamIsCapturing

        _stream_is_capturing = streamIsCapturing
    return _stream_is_capturing(stream_ptr)


def fill_nan_after_failure(error, fill):
    """After `error` ended a call, run `fill()` (NaN into the caller's out= arrays). Returns the
    exception to raise: `error` itself, with a note if the fill failed too (Python 3.11+), or on
    older Pythons a RuntimeError saying so, chained to `error`."""
    try:
        fill()
        return error
    except Exception as fill_error:  # the device may be unusable (sticky error): say what out= holds
        note = (f"cupyffn: filling out= with NaN after this error also failed ({type(fill_error).__name__}: "
                f"{fill_error}); out= may hold stale or partial values")
        if sys.version_info >= (3, 11):
            error.add_note(note)
            return error
        wrapped = RuntimeError(f"{type(error).__name__}: {error}\n{note}")
        wrapped.__cause__ = error
        return wrapped
