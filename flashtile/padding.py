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
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    # Integer indices rather than a bool mask: indexing with a bool mask would expand it over the
    # feature dims first.
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


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
    output = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    output = output.index_put((indices,), hidden_states)
    return output.unflatten(0, (batch, seqlen))
