"""benchmarks/timing.py's flushed_median_ms and host_median_us, for the dev/ tools that import them from here (run
from the repo root)."""

from benchmarks.timing import flushed_median_ms, host_median_us  # noqa: F401
