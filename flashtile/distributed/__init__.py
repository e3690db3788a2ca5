"""Context parallelism on torch.distributed: one sequence sharded across ranks (NCCL on GPUs, gloo on CPU).

- :func:`shard` / :func:`unshard`: a rank's part of the full sequence and back (zigzag or contiguous).
- :func:`ring_attention`: K/V shards travel a ring; exact attention, forward and backward.
- :func:`ulysses_attention`: all-to-all from sequence shards to head shards, attention, and back.
- :func:`attention`: both on a 2-D DeviceMesh (``"ulysses"`` x ``"ring"``).
- :func:`ring_attention_varlen`: packed documents (global ``cu_seqlens``), contiguous token shards.
- :func:`exit_rank`: the clean end of a spawned rank (after ``destroy_process_group``).
- :func:`set_nccl_priority`: the ring's transfers on NCCL streams of high priority (opt-in; no gain measured on 4 H200s).

See docs/distributed.md.
"""
from .comm import exit_rank, nccl_priority, set_nccl_priority
from .hybrid import attention
from .ring import ring_attention
from .sharding import shard, unshard
from .ulysses import ulysses_attention
from .varlen import ring_attention_varlen

__all__ = ["attention", "exit_rank", "nccl_priority", "ring_attention", "ring_attention_varlen", "set_nccl_priority",
           "shard", "ulysses_attention", "unshard"]
