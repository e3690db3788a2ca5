"""Kernel arguments for benchmarks/sm90_compile.py: CPU tensors stand in for the GPU's (only their shapes,
strides and dtypes matter to the compiler)."""
import re
from dataclasses import replace

import torch

from flashtile.backends.triton import launch
from flashtile.backends.triton.kernels.bwd_sm90 import attn_bwd_dkdv_sm90


def _inputs(B=2, S=4096, H=16, Hk=16, D=128, dtype=torch.bfloat16):
    q = torch.empty(B, S, H, D, dtype=dtype)
    k = torch.empty(B, S, Hk, D, dtype=dtype)
    lse = torch.empty(B, H, S, dtype=torch.float32)
    return q, k, lse


def case(which: str, causal: bool, softcap: bool, window: bool = False, tiles: dict | None = None):
    """``tiles``: configs.OnePassConfig fields that the one-pass cases (wide*) take over their head dim's."""
    q, k, lse = _inputs()
    common = dict(MASK_LEFT=False, MASK_RIGHT=causal, SOFTCAP=softcap, FAST_TANH=True, FOLD_SCALE=softcap,
                  IS_VARLEN=False, HAS_SEQUSED=False)
    if which == "dkdv":
        args = dict(q_desc=launch._tma_desc(q, 64), k_desc=launch._tma_desc(k, 64), v_desc=launch._tma_desc(k, 64),
                    do_desc=launch._tma_desc(q, 64), DK=k, DV=k, LSE2=lse, DELTA=lse, CU_SEQLENS_Q=lse,
                    CU_SEQLENS_K=lse, SEQUSED_K=lse, total_q=8192, total_k=8192, ERR=torch.zeros(4, dtype=torch.int32),
                    qk_scale=0.1, softcap2=1.0, softmax_scale=0.1, window_left=-1,
                    window_right=0, stride_dkb=k.stride(0), stride_dkn=k.stride(1), stride_dkh=k.stride(2),
                    stride_dvb=k.stride(0), stride_dvn=k.stride(1), stride_dvh=k.stride(2),
                    stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1), seqlen_q=4096, seqlen_k=4096, group=1)
        return attn_bwd_dkdv_sm90, args, dict(common, STAGES=2, num_warps=4), dict(num_warps=4)
    if which == "fwd-ws":
        return _fwd_ws_case(causal, softcap, window)
    if which.startswith("fwd-ws-d"):
        # fwd-ws-d<head dim>[-n<keys a slot>][-s<slots>][-c<consumers>][-pp][-sink][-alibi]: launch._forward_sm90_ws's
        # own arguments (-pp: the consumers take turns, TileConfig.pingpong).
        dims, keys, slots, consumers = (re.findall(rf"-{c}(\d+)", which) for c in "dnsc")
        return _fwd_ws_launch_case(causal, softcap, window, int(dims[0]), int(keys[0]) if keys else 128,
                                   int(slots[0]) if slots else 2, "-sink" in which, "-alibi" in which,
                                   consumers=int(consumers[0]) if consumers else 2, pingpong="-pp" in which)
    if which.startswith("fwd-d"):
        # fwd-d<head dim>[-n<keys a block>][-s<slots>][-sink]: kernels/fwd_sm90.py through launch._forward_sm90.
        dims, keys, slots = (re.findall(rf"-{c}(\d+)", which) for c in "dns")
        return _fwd_ws_launch_case(causal, softcap, window, int(dims[0]), int(keys[0]) if keys else 64,
                                   int(slots[0]) if slots else 2, "-sink" in which, "-alibi" in which, "gluon")
    if which.startswith("fwd-fp8"):
        # fwd-fp8[-d64|-d256][-blocks][-varlen] [knob=value ...]: head dim (128 without), per-block Q/K descales,
        # packed sequences; knobs: fp8.Fp8Tile's fields over the head dim's tile (block_n=256 consumers=3 ...).
        from flashtile.backends.triton import fp8
        dims = re.findall(r"-d(\d+)", which)
        head_dim, blocks = int(dims[0]) if dims else 128, "-blocks" in which
        tile = fp8.fp8_tile(head_dim)
        tile = tile._replace(**{name: type(getattr(tile, name))(value) for name, value in (tiles or {}).items()})
        if which.endswith("-varlen"):
            return _fwd_fp8_varlen_case(causal, softcap, window, head_dim, blocks, tile)
        return _fwd_fp8_case(causal, softcap, window, head_dim, blocks, tile)
    if which.startswith("quant"):
        # quant[-d64|-d256][-g<query heads a KV head>][-v][-varlen]: the FP8 quantizer's launch of q's and k's
        # rotation and cast with v's block amaxes (-v: its second, v's cast), head dim 128 and MHA without.
        dims, groups = re.findall(r"-d(\d+)", which), re.findall(r"-g(\d+)", which)
        v_cast = bool(re.search(r"-v(-|$)", which))
        return _quant_case(int(dims[0]) if dims else 128, int(groups[0]) if groups else 1, v_cast,
                           "-varlen" in which)
    if which.startswith("fused-d"):
        # fused-d64 / fused-d128[-alibi|-varlen]: kernels/bwd_sm90_ws.py through the launcher's own arguments
        # (128-row steps at 64).
        dim = int(re.findall(r"-d(\d+)", which)[0])
        return _one_pass_case(causal, softcap, "-alibi" in which, "-varlen" in which, window, (dim, dim), tiles or {})
    if which in ("fused", "fused-alibi", "fused-varlen"):
        return _fused_case(causal, softcap, which == "fused-alibi", which == "fused-varlen", window)
    if which.startswith("wide"):
        # wide[-alibi|-varlen][-v192|-d256]: 192/128, 192/192 with -v192, 256/256 with -d256.
        dims = (256, 256) if which.endswith("-d256") else (192, 192 if which.endswith("-v192") else 128)
        return _one_pass_case(causal, softcap, "-alibi" in which, "-varlen" in which, window, dims, tiles or {})
    raise ValueError(which)


def _one_pass_case(causal: bool, softcap: bool, alibi: bool, varlen: bool, window: bool, head_dims: tuple,
                   tiles: dict):
    """The one-pass launcher's own arguments (launch._backward_sm90_ws) for a 2 x 4096 call of 16 query and 16 KV
    heads at ``head_dims`` (q/k, v), caught at its launch: ``(kernel, runtime args, constexprs, options)``."""
    from flashtile.backends import AttnArgs, present_features

    d, dv = head_dims
    tokens = 2 * 4096
    q, k, lse = _inputs(D=d)
    v, dout = torch.empty(*k.shape[:3], dv, dtype=k.dtype), torch.empty(*q.shape[:3], dv, dtype=q.dtype)
    extra = {}
    if varlen:
        cu = torch.tensor([0, 4096, tokens], dtype=torch.int32)
        q, k, v, dout = (t.flatten(0, 1) for t in (q, k, v, dout))
        lse = torch.empty(q.shape[1], tokens, dtype=torch.float32)
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4096, max_seqlen_k=4096,
                     seqused_k=torch.tensor([4000, 4096], dtype=torch.int32), total_k=tokens)
    args = AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_left=1024 if window else -1,
                    window_right=0 if causal else -1, softcap=30.0 if softcap else 0.0,
                    alibi_slopes=torch.empty(2, q.shape[-2]) if alibi else None, **extra)
    caught = {}
    name = "_BWD_WIDE" if launch.configs.one_pass_wide(d, dv) else "_BWD_WS"
    if tiles.get("keys96"):
        name = "_BWD_WIDE96"
    kernel = getattr(launch, name)
    setattr(launch, name, lambda key, grid, dynamic, static, **_: caught.update(dynamic, **static()))
    try:
        features = frozenset(present_features(args, d, dv))
        launch._backward_sm90_ws(q, k, v, dout, torch.empty(q.shape, dtype=torch.float32), k, v, lse, lse, args,
                                 features, None,
                                 replace(launch.configs.one_pass_config(d, bool(tiles.get("keys96")), features), **tiles))
    finally:
        setattr(launch, name, kernel)
    # The GPU's bf16 calls take the fast tanh (host.fast_tanh: CUDA tensors only).
    caught["FAST_TANH"] = True
    options = dict(num_warps=caught.pop("num_warps"), maxnreg=caught.pop("maxnreg"))
    constexprs = {p.name: caught.pop(p.name) for p in kernel.fn.params if p.is_constexpr and p.name in caught}
    return kernel.fn, caught, dict(constexprs, num_warps=options["num_warps"]), options


def _fused_case(causal: bool, softcap: bool, alibi: bool = False, varlen: bool = False, window: bool = False):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.backends.triton.kernels.bwd_sm90_ws import attn_bwd_sm90_ws
    q, k, lse = _inputs()
    dq = torch.empty(q.shape, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32)
    dq_desc = TensorDescriptor(dq, list(dq.shape), list(dq.stride()), [1, 64, 1, 64],
                               gl.NVMMASharedLayout.get_default_for([1, 64, 1, 64], gl.float32))
    args = dict(q_desc=launch._tma_desc(q, 64), k_desc=launch._tma_desc(k, 64), v_desc=launch._tma_desc(k, 64),
                do_desc=launch._tma_desc(q, 64), dq_desc=dq_desc, DK=k, DV=k, LSE2=lse, DELTA=lse, CU_SEQLENS_Q=cu,
                CU_SEQLENS_K=cu, SEQUSED_K=cu, ALIBI_SLOPES=lse,
                stride_alibi_b=16, qk_scale=0.1,
                softcap2=1.0, softmax_scale=0.1, window_left=-1, window_right=0, stride_dkb=k.stride(0),
                stride_dkn=k.stride(1), stride_dkh=k.stride(2), stride_dvb=k.stride(0), stride_dvn=k.stride(1),
                stride_dvh=k.stride(2), stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1), seqlen_q=4096,
                seqlen_k=4096, group=1)
    constexprs = dict(MASK_LEFT=window, MASK_RIGHT=causal, SOFTCAP=softcap, FAST_TANH=True, ALIBI=alibi, STAGES=2,
                      ALIBI_LINEAR=alibi and causal, IS_VARLEN=varlen, HAS_SEQUSED=varlen,
                      CONSUMER_REGS=240, DQ_FIRST=False, DK_RS=False, S_AHEAD=False,
                      num_warps=4)
    return attn_bwd_sm90_ws, args, constexprs, dict(num_warps=4, maxnreg=168)


def _fwd_ws_case(causal: bool, softcap: bool, window: bool, block_n: int = 64, stages: int = 4):
    from flashtile.backends.triton.kernels.fwd_sm90_ws import attn_fwd_sm90_ws
    q, k, lse = _inputs()
    args = dict(q_desc=launch._tma_desc(q, 64), k_desc=launch._tma_desc(k, block_n), v_desc=launch._tma_desc(k, block_n),
                q_tail_desc=None, k_tail_desc=None, O=q, LSE=lse, SINK=lse, ALIBI_SLOPES=lse, stride_alibi_b=16, qk_scale=0.1, softcap2=1.0, row_max=0.0,
                window_left=1024 if window else -1, window_right=0 if causal else -1, stride_ob=q.stride(0),
                stride_om=q.stride(1), stride_oh=q.stride(2), stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1),
                seqlen_q=4096, seqlen_k=4096, group=1, nheads=16, num_tiles=1024)
    constexprs = dict(MASK_LEFT=window, MASK_RIGHT=causal, SOFTCAP=softcap, ALIBI=False, HAS_SINK=False,
                      FIXED_MAX=softcap, FOLD_SCALE=softcap, STAGES=stages, CONSUMER_REGS=240, TAIL=False,
                      CONSUMERS=2, PINGPONG=False, num_warps=4)
    return attn_fwd_sm90_ws, args, constexprs, dict(num_warps=4, maxnreg=168)


def _fwd_ws_launch_case(causal: bool, softcap: bool, window: bool, head_dim: int, block_n: int, stages: int,
                        sink: bool, alibi: bool = False, kernel_kind: str = "gluon-ws", consumers: int = 2,
                        pingpong: bool = False):
    """The warp-specialized forward launcher's own arguments (launch._forward_sm90_ws) for a 2 x 4096 bf16 call of
    16 query and 16 KV heads at ``head_dim`` (192: DeepSeek's 192/128, values of 128), the tile's ``stages`` slots of
    ``block_n`` keys and ``consumers`` warpgroups of 64 rows (``pingpong``: taking turns), caught at its launch;
    ``kernel_kind`` "gluon": the one-warpgroup kernel's (launch._forward_sm90, 64-row tiles)."""
    from flashtile.backends import AttnArgs, present_features
    from flashtile.backends.triton import configs

    q, k, lse = _inputs(D=head_dim)
    head_dim_v = 128 if head_dim == 192 else head_dim
    v = torch.empty(*k.shape[:3], head_dim_v, dtype=k.dtype)
    args = AttnArgs(softmax_scale=head_dim ** -0.5, causal=causal, window_left=1024 if window else -1,
                    window_right=0 if causal else -1, softcap=30.0 if softcap else 0.0,
                    sink=torch.empty(q.shape[2]) if sink else None,
                    alibi_slopes=torch.empty(2, q.shape[2]) if alibi else None)
    cfg = configs.TileConfig(64, block_n, 4, stages, kernel=kernel_kind, consumers=consumers, pingpong=pingpong)
    caught = {}
    name, launcher = ("_FWD_SM90_WS", launch._forward_sm90_ws) if kernel_kind == "gluon-ws" else ("_FWD_SM90",
                                                                                                   launch._forward_sm90)
    kernel = getattr(launch, name)
    setattr(launch, name, lambda key, grid, dynamic, static, **_: caught.update(dynamic, **static()))
    try:
        launcher(q, k, v, torch.empty(*q.shape[:3], head_dim_v, dtype=q.dtype), lse, args, cfg, (2, 4096, 4096, 1),
                 frozenset(present_features(args, head_dim, head_dim_v)))
    finally:
        setattr(launch, name, kernel)
    options = dict(num_warps=caught.pop("num_warps"))
    if "maxnreg" in caught:
        options["maxnreg"] = caught.pop("maxnreg")
    constexprs = {p.name: caught.pop(p.name) for p in kernel.fn.params if p.is_constexpr and p.name in caught}
    return kernel.fn, caught, dict(constexprs, num_warps=options["num_warps"]), options


def _fwd_fp8_case(causal: bool, softcap: bool, window: bool, head_dim: int, blocks: bool, tile):
    """The FP8 kernel's arguments for a 2 x 4096 call of 16 heads on ``tile`` (fp8.Fp8Tile)."""
    from flashtile.backends.triton import fp8
    q, k, lse = _inputs(D=head_dim, dtype=torch.float8_e4m3fn)
    v_t = k.permute(0, 2, 3, 1).contiguous()
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    scale = torch.empty(q.shape[0], k.shape[2], dtype=torch.float32)
    args = dict(**fp8.descriptors(q, k, v_t, head_dim, tile.block_n), O=out, LSE=lse, Q_DESCALE=scale, K_DESCALE=scale,
                V_DESCALE=scale, stride_qds_b=16, stride_qds_h=1, stride_qds_m=int(blocks), stride_kds_b=16, stride_kds_h=1,
                stride_kds_n=int(blocks), stride_vds_b=16, stride_vds_h=1, qk_scale=0.1, softcap2=1.0, window_left=1024 if window else -1,
                window_right=0 if causal else -1, stride_ob=out.stride(0), stride_om=out.stride(1),
                stride_oh=out.stride(2), stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1), seqlen_q=4096,
                seqlen_k=4096, group=1, nheads=16, num_tiles=1024)
    consumer_regs, maxnreg = launch._WS_REGS[tile.consumers]
    constexprs = dict(MASK_LEFT=window, MASK_RIGHT=causal, SOFTCAP=softcap, K_BLOCKS=blocks,
                      TWO_LEVEL=tile.two_level, STAGES=tile.stages, CONSUMER_REGS=consumer_regs,
                      PINGPONG=tile.pingpong, CONSUMERS=tile.consumers, num_warps=4)
    return fp8.attn_fwd_sm90_fp8, args, constexprs, dict(num_warps=4, maxnreg=maxnreg)


def _fwd_fp8_varlen_case(causal: bool, softcap: bool, window: bool, head_dim: int, blocks: bool, tile):
    """The FP8 launcher's own arguments (fp8.forward_fp8_sm90) for packed sequences of 4096 and 4000 query and key
    tokens with seqused_k, 16 query and 4 KV heads, caught at its launch."""
    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import fp8

    lengths = (4096, 4000)
    tokens = sum(lengths)
    cu = torch.tensor([0, lengths[0], tokens], dtype=torch.int32)
    q = torch.empty(tokens, 16, head_dim, dtype=torch.float8_e4m3fn)
    k = torch.empty(tokens, 4, head_dim, dtype=torch.float8_e4m3fn)
    v_t = torch.empty(4, head_dim, fp8.packed_vt_width(tokens, len(lengths)), dtype=torch.float8_e4m3fn)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse = torch.empty(16, tokens, dtype=torch.float32)
    blocks_q = (-(-lengths[0] // fp8.DESCALE_BLOCK), ) if blocks else ()
    q_descale, k_descale = (torch.empty(2, 4, *blocks_q) for _ in range(2))
    args = AttnArgs(softmax_scale=head_dim ** -0.5, causal=causal, window_left=1024 if window else -1,
                    window_right=0 if causal else -1, softcap=30.0 if softcap else 0.0, cu_seqlens_q=cu,
                    cu_seqlens_k=cu, max_seqlen_q=lengths[0], max_seqlen_k=lengths[0],
                    seqused_k=torch.tensor([4000, 4000], dtype=torch.int32), total_k=tokens)
    caught = {}
    kernel, fill_tail = fp8._FWD_FP8, fp8._fill_tail
    fp8._FWD_FP8 = lambda key, grid, dynamic, static, **_: caught.update(dynamic, **static())
    # The tail fill is its own (Triton) kernel: not compiled here.
    fp8._fill_tail = lambda *_, **__: None
    try:
        fp8.forward_fp8_sm90(q, k, v_t, q_descale, k_descale, torch.empty(2, 4), out, lse, args, tile)
    finally:
        fp8._FWD_FP8, fp8._fill_tail = kernel, fill_tail
    options = dict(num_warps=caught.pop("num_warps"), maxnreg=caught.pop("maxnreg"))
    constexprs = {p.name: caught.pop(p.name) for p in kernel.fn.params if p.is_constexpr and p.name in caught}
    return kernel.fn, caught, dict(constexprs, num_warps=options["num_warps"]), options


def _quant_case(head_dim: int, group: int, v_cast: bool, varlen: bool):
    """The FP8 quantizer's launcher (quant.quantize, block scales and the rotation) on bf16 q, k, v of 2 x 4096 tokens
    (packed: sequences of 4096 and 4000), 16 query heads, caught at its first launch (``v_cast``: its second):
    ``(kernel, runtime args, constexprs, options)``."""
    from flashtile.backends.triton import quant

    lengths = (4096, 4000) if varlen else (4096, 4096)
    q, k, _ = _inputs(D=head_dim, Hk=16 // group)
    v = torch.empty_like(k)
    extra = {}
    if varlen:
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        q, k, v = (t.flatten(0, 1)[:sum(lengths)] for t in (q, k, v))
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=lengths[0], max_seqlen_k=lengths[0])
    caught = []
    kernel = quant._QUANT
    quant._QUANT = lambda key, grid, dynamic, static: caught.append(
        dict(zip(kernel.dynamic_names, dynamic), **static()))
    try:
        quant.quantize(q, k, v, **extra)
    finally:
        quant._QUANT = kernel
    args = caught[1 if v_cast else 0]
    options = dict(num_warps=args.pop("num_warps"), num_stages=args.pop("num_stages"), maxnreg=args.pop("maxnreg"))
    constexprs = {name: args.pop(name) for name in _constexpr_names(kernel.fn)}
    return kernel.fn, args, constexprs, options


def _constexpr_names(fn) -> list:
    """The ``tl.constexpr`` parameters of Triton kernel ``fn`` (a JIT function, or the interpreter's wrapper of one)."""
    import inspect

    import triton.language as tl

    if hasattr(fn, "params"):
        return [p.name for p in fn.params if p.is_constexpr]
    return [name for name, p in inspect.signature(fn.fn).parameters.items() if p.annotation is tl.constexpr]
