"""A small LRU of per-shape plans (anything with close()), shared by the backward and forward caches."""

import collections
import threading


class PlanCache:
    """Up to `size` plans by key. Plans are built outside the lock; if two threads build the same key,
    the second build is closed and the first kept. Evicted plans are closed (which waits for their
    last call)."""

    def __init__(self, size):
        self.size = size
        self._plans = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, build):
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build()
        with self._lock:
            existing = self._plans.get(key)
            if existing is not None:  # another thread built the same plan meanwhile
                duplicate, plan = plan, existing
                evicted = [duplicate]
            else:
                self._plans[key] = plan
                evicted = []
                while len(self._plans) > self.size:
                    evicted.append(self._plans.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return plan

    def clear(self):
        with self._lock:
            plans = list(self._plans.values())
            self._plans.clear()
        for plan in plans:
            plan.close()
