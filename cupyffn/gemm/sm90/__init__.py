"""The Hopper (sm_90a) GEMM of kernels_cu/gemm_sm90.cu: typed configs and the one function that chooses each
(config.py), tensor maps (tensor_map.py), the engine's prebuilt launches (launch.py), validating entry points for
tests and direct use (entry.py, checks.py)."""

from .config import (A_LAYOUTS, BLOCK_K, BLOCK_M, EPI_DGELU_BF16X3, EPI_DGELU_F16, EPI_DGELU_F16G, EPI_F32, EPILOGUES,
                     EW_THREADS, OP_BF16, OP_E4M3, OP_F16, OP_F16E4M3, PAIR_RASTER, PAIR_SCHEDULES, SCHEDULES, SOURCE,
                     THREADS, VARIANTS, WARPS, WARPS_SCHEDULE, Sm90Config, can_implement, check_config, choose_config,
                     choose_dgelu_config, choose_pair_config, choose_pair_raster)
from .entry import gemm_pair, gemm_tn_dgelu
from .launch import FUSED_RASTER, DgeluLaunch, GemmArgs, PairLaunch, device_supported, function, module
from .tensor_map import TmaDesc, encode_tensor_map

__all__ = ["A_LAYOUTS", "BLOCK_K", "BLOCK_M", "EPI_DGELU_BF16X3", "EPI_DGELU_F16", "EPI_DGELU_F16G", "EPI_F32",
           "EPILOGUES", "EW_THREADS", "FUSED_RASTER", "OP_BF16", "OP_E4M3", "OP_F16", "OP_F16E4M3", "PAIR_RASTER",
           "PAIR_SCHEDULES", "SCHEDULES", "SOURCE", "THREADS", "VARIANTS", "WARPS", "WARPS_SCHEDULE", "DgeluLaunch",
           "GemmArgs", "PairLaunch", "Sm90Config", "TmaDesc", "can_implement", "check_config", "choose_config",
           "choose_dgelu_config", "choose_pair_config", "choose_pair_raster", "device_supported", "encode_tensor_map",
           "function", "gemm_pair", "gemm_tn_dgelu", "module"]
