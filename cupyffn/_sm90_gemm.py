"""Temporary re-export of cupyffn.gemm.sm90 under its former module name, for the callers not yet moved (the engine,
dev/gemm_forms_bench.py); removed when they import cupyffn.gemm.sm90."""

from cupyffn.gemm.sm90 import (EPI_DGELU_BF16X3, EPI_DGELU_F16, DgeluLaunch, PairLaunch,  # noqa: F401
                               choose_pair_config, device_supported)
from cupyffn.gemm.sm90 import PAIR_SCHEDULES as CONFIGS  # noqa: F401  (dev/gemm_forms_bench.py: the pair's schedules)
