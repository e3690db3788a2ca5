"""flashtile: exact, IO-aware FlashAttention in Triton behind a PyTorch API."""
from .dispatch import FallbackError, reset_stats, set_strict, stats
from .device_errors import check_device_errors
from .cache import KVCache, PagedKVCache
from .explain import Explanation, explain
from .fp8 import flash_attn_fp8_func, flash_attn_varlen_fp8_func
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    merge_attention_states,
)
from .padding import pad_input, unpad_input
from .sdpa import patch_sdpa, scaled_dot_product_attention
from . import nn

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Explanation",
    "KVCache",
    "PagedKVCache",
    "FallbackError",
    "check_device_errors",
    "explain",
    "flash_attn_fp8_func",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_fp8_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "nn",
    "pad_input",
    "patch_sdpa",
    "reset_stats",
    "scaled_dot_product_attention",
    "set_strict",
    "stats",
    "unpad_input",
]
