"""Between a padded batch ``(batch, seqlen, ...)`` and the packed tokens the varlen functions take.

Same names, arguments and results as flash-attn's ``flash_attn.bert_padding``, so code written
for it runs unchanged::

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = flashtile.unpad_input(x, attention_mask)
    out_unpad = flashtile.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                                 max_seqlen, max_seqlen, causal=True)
    out = flashtile.pad_input(out_unpad, indices, batch, seqlen)   # zeros where the mask is 0

Both are differentiable (plain indexing: the gradient of a gather is a scatter and back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["unpad_input", "pad_input"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the tokens of a padded batch that ``attention_mask`` marks.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or int: 1 = a real token, 0 = padding.
        unused_mask: optional ``(batch, seqlen)``, bool or int: 1 = a token that is allocated
            (packed, and counted in ``cu_seqlens``) but unused (not counted in ``seqused``).

    Returns:
        ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, seqused)``:

        - ``hidden_states`` ``(total_nnz, ...)``: the selected tokens (``attention_mask +
          unused_mask``), sequence after sequence.
        - ``indices`` int64 ``(total_nnz,)``: their positions in the flattened ``(batch * seqlen)`` input.
        - ``cu_seqlens`` int32 ``(batch + 1,)``: 0, then the running total of the sequence lengths.
        - ``max_seqlen_in_batch``: a Python int (a device->host copy for CUDA tensors).
        - ``seqused`` int32 ``(batch,)``: the tokens of each sequence that ``attention_mask`` selects
          (the ``seqused_k`` of :func:`flashtile.flash_attn_varlen_func`).
    """
    _check_mask("attention_mask", attention_mask, hidden_states)
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, hidden_states)
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    # Integer indices rather than a bool mask: indexing with a bool mask would expand it over the
    # feature dims first.
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def _check_mask(name: str, mask, hidden_states) -> None:
    """``mask`` must be ``(batch, seqlen)`` of ``hidden_states`` and hold only 0 and 1 (bool or integer);
    its values are read on the host (a device->host copy for CUDA tensors, as max_seqlen_in_batch is)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (batch, seqlen), got {type(mask).__name__}")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be (batch, seqlen, ...), got {shape}")
    if tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"{name} must have shape (batch, seqlen) = {tuple(hidden_states.shape[:2])} of hidden_states "
                         f"{tuple(hidden_states.shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or hold 0 and 1, got {mask.dtype}")
    if mask.dtype != torch.bool and mask.numel():
        bad = (mask != 0) & (mask != 1)
        found, first = torch.stack([bad.any().to(torch.int64), bad.flatten().to(torch.int64).argmax()]).tolist()
        if found:
            row, col = divmod(first, mask.shape[1])
            raise ValueError(f"{name} must hold only 0 (padding) and 1 (a token), got {name}[{row}, {col}] = "
                             f"{mask[row, col].item()}")


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of :func:`unpad_input`: scatter packed tokens back into a zero-padded batch.

    Args:
        hidden_states: ``(total_nnz, ...)``.
        indices: ``(total_nnz,)`` positions in the flattened ``(batch * seqlen)`` batch, as
            :func:`unpad_input` returns them.
        batch, seqlen: the padded batch's size.

    Returns:
        ``(batch, seqlen, ...)`` in ``hidden_states``' dtype, zeros at the positions not in ``indices``.
    """
    if indices.numel():
        # One device->host copy: on CUDA an index past the batch would otherwise be a device-side assert.
        low, high = torch.stack([indices.min(), indices.max()]).tolist()
        if low < 0 or high >= batch * seqlen:
            raise ValueError(f"indices must be positions in the flattened (batch * seqlen) = ({batch} * {seqlen}) batch, "
                             f"in [0, {batch * seqlen}), got values from {low} to {high}")
    output = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    output = output.index_put((indices,), hidden_states)
    return output.unflatten(0, (batch, seqlen))
