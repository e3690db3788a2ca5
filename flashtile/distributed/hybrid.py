"""The 2-D hybrid (USP): Ulysses inside groups of ranks, a ring across them, on a DeviceMesh.

A mesh with dims ``"ulysses"`` (size U) and ``"ring"`` (size R) holds the sequence as R ring shards
(zigzag or contiguous), each cut into U contiguous parts (:func:`.sharding.shard` with the mesh). The
Ulysses all-to-all gathers a ring shard with ``nheads / U`` heads on each rank; the ring attention then
runs over the R ranks that hold the same heads; a second all-to-all brings the heads back.
"""
from __future__ import annotations

from .. import validation
from .comm import check_same_across, heads_to_seq
from .options import check_dkv_transfer, shapes
from .ring import ring_attention
from .ulysses import heads_of, split_heads

DIMS = ("ulysses", "ring")


def mesh_groups(mesh) -> tuple:
    """``(ulysses_group, ring_group)`` of a 2-D DeviceMesh whose dims are named ``"ulysses"`` and ``"ring"``."""
    names = getattr(mesh, "mesh_dim_names", None)
    if type(mesh).__name__ != "DeviceMesh" or mesh.ndim != 2 or names is None or set(names) != set(DIMS):
        raise ValueError(f"mesh must be a 2-D torch.distributed DeviceMesh with mesh_dim_names ('ulysses', 'ring'), "
                         f"got {type(mesh).__name__} with dims {names}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this process (rank {mesh.get_rank()}) is not in the mesh {mesh.mesh.tolist()}")
    return mesh.get_group("ulysses"), mesh.get_group("ring")


def attention(q, k, v, mesh, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sink=None,
              balance="zigzag", deterministic=False, dkv_transfer="float32"):
    """Exact attention over the whole sequence on a ``("ulysses", "ring")`` DeviceMesh.

    Args:
        q, k, v: this rank's shard (:func:`shard` with ``mesh`` and ``balance``), shapes as in
            :func:`ring_attention`. ``nheads`` must be a multiple of the Ulysses size U, ``nheads_kv`` a
            multiple or a divisor of U (see :func:`ulysses_attention`).
        mesh: a 2-D DeviceMesh with dims ``"ulysses"`` and ``"ring"``; a 1-sized dim makes it plain
            ring (U = 1) or plain Ulysses (R = 1).
        causal, softmax_scale, window_size, softcap, sink, deterministic, balance, dkv_transfer: as in
            :func:`ring_attention` (``dkv_transfer``: how the ring across ``"ring"`` sends its dK/dV sums).

    Returns:
        ``out`` ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype, differentiable.
    """
    check_dkv_transfer(dkv_transfer)
    ulysses, ring = mesh_groups(mesh)
    validation.check_qkv(q, k, v)
    # Across the Ulysses ranks here (before their all-to-all); across the ring by ring_attention.
    check_same_across(ulysses, "attention", shapes(q, k, v), q.device)
    qh, kh, vh = split_heads(q, k, v, ulysses, "attention (the mesh's 'ulysses' dim)")
    out = ring_attention(qh, kh, vh, ring, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         softcap=softcap, sink=heads_of(sink, q.shape[2], ulysses), balance=balance,
                         deterministic=deterministic, dkv_transfer=dkv_transfer)
    return heads_to_seq(out, ulysses)

