"""flashtile: exact, IO-aware FlashAttention in Triton behind a PyTorch API."""
from .dispatch import reset_stats, stats
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "reset_stats",
    "stats",
]
