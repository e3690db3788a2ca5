"""Triton backend: FlashAttention-2 kernels (``kernels/``), their launchers (``launch.py``) and tile configs."""
