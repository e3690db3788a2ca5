"""The backward's preprocess (kernels/bwd.py ``bwd_preprocess``) through its launch in launch.py: delta, the lse in
log2 units, and for the one-pass backward the zeroed float32 dQ buffer, whose head dim is q's (192 beside values of
128 for the wide kernel). Runs in the interpreter on the CPU, and on a GPU."""
import math

import pytest
import torch

from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import padded_head_dim


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (192, 128), (192, 192), (64, 64)])
@pytest.mark.parametrize("zero_dq", [False, True], ids=["pair", "one-pass"])
def test_preprocess(device, rng, head_dim, head_dim_v, zero_dq):
    batch, seqlen, nheads = 2, 77, 3
    out, dout = (torch.randn(batch, seqlen, nheads, head_dim_v, generator=rng).to(device) for _ in range(2))
    lse = torch.randn(batch, nheads, seqlen, generator=rng).to(device)
    lse[0, 1, 5] = float("-inf")  # a row that saw no key
    delta, lse2 = torch.full_like(lse, math.nan), torch.full_like(lse, math.nan)
    dq_acc = torch.full((batch, seqlen, nheads, head_dim), math.nan, device=device)
    launch._PREPROCESS((out.shape, head_dim, zero_dq), (launch.cdiv(seqlen, launch._PREPROCESS_BLOCK_M), nheads, batch),
                       dict(O=out, DO=dout, LSE=lse, DELTA=delta, LSE2=lse2, DQ_ACC=dq_acc),
                       lambda: dict(**launch._strides(False, o=out, do=dout, dq=dq_acc), stride_lse_b=lse.stride(0),
                                    stride_lse_h=lse.stride(1), seqlen_q=seqlen, HEAD_DIM_ACTUAL=head_dim_v,
                                    HEAD_DIM=padded_head_dim(head_dim_v), BLOCK_M=launch._PREPROCESS_BLOCK_M,
                                    ZERO_DQ=zero_dq, DQ_DIM_ACTUAL=head_dim, DQ_DIM=padded_head_dim(head_dim)))
    torch.testing.assert_close(delta, (out * dout).sum(-1).transpose(1, 2), rtol=1e-5, atol=1e-5)
    expected_lse2 = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse2, expected_lse2)
    if zero_dq:
        # Every column of q's head dim, not only the values' first ones.
        assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    else:
        assert dq_acc.isnan().all()
