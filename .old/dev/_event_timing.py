"""benchmarks/timing.py's flushed_median_ms, for the dev/ tools that import it from here (run from the repo root)."""

from benchmarks.timing import flushed_median_ms  # noqa: F401
