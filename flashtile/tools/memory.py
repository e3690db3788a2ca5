"""``python -m flashtile memory``: KV-cache bytes and attention intermediates, standard vs flashtile.

What is counted (``B`` batch, ``N`` seqlen, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim,
``L`` layers, ``b`` bytes per element of the model dtype):

- KV cache: ``2 (K and V) x Hkv x D x b`` bytes per token per layer (``Hkv x (D + Dv) x b`` when the values'
  head dim ``Dv`` differs, as in DeepSeek's multi-head latent attention expanded per head); times ``L`` per token; times
  ``N`` per sequence; times ``B`` in total. Every layer holds every token. When the model has
  sliding-window layers a second, *windowed* figure is given too: a sliding layer keeps only its
  last ``sliding_window`` tokens (a rolling cache), a global layer keeps all ``N``.
- Attention intermediates of one layer's prefill call (``seqlen_q = seqlen_k = N``):
  standard attention materialises the scores ``Q K^T`` and the probabilities ``softmax(.)``,
  ``B x H x N^2 x b`` bytes each, both alive while the softmax runs (implementations that upcast
  the softmax to fp32, as transformers' eager attention does, hold one more fp32 ``N x N``
  temporary, not counted). flashtile keeps no ``N x N`` buffer: the forward saves the softmax
  log-sum-exp ``B x H x N x 4`` bytes (fp32), and the Triton backward allocates two more fp32
  values per row (``delta = rowsum(dO * O)`` and the base-2 lse), ``2 x B x H x N x 4`` bytes.
  q, k, v, out and their gradients are the same for both and left out.
- Saved for backward in training, all layers: standard attention keeps the probabilities of every
  layer (``L x B x H x N^2 x b``), flashtile the lse (``L x B x H x N x 4``).
"""
from __future__ import annotations

import argparse

from . import format_bytes, model_config, print_json, readable_errors

LSE_BYTES = 4  # the softmax statistics are fp32 whatever the input dtype

EXAMPLES = """\
examples:
  python -m flashtile memory --config llama-3-8b --seqlen 8192 --batch 4   # 4.00 GiB of KV cache
  python -m flashtile memory --config path/to/Meta-Llama-3-8B/config.json --seqlen 8192
  python -m flashtile memory --config mistral-7b --seqlen 32768     # also the windowed KV cache
  python -m flashtile memory --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --seqlen 4096 --batch 2
  python -m flashtile memory --config gemma-2-9b --dtype fp32 --json # flags override the config

--config takes a config.json, a checkpoint directory holding one, or a bundled name
(llama-3-8b, llama-3-70b, mistral-7b, gemma-2-9b, gpt-oss-20b, gpt-oss-120b, qwen3-8b, deepseek-v3;
tiny-llama is a toy). Bytes are exact; sizes use binary units (1 KiB = 1024 B).
Counted: KV cache = 2 (K,V) x kv heads x head dim x dtype bytes per token per layer; standard
attention = scores + probabilities, B x H x N^2 x dtype bytes each; flashtile = lse B x H x N x 4
(forward) + delta and lse2 2 x B x H x N x 4 (Triton backward).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "memory",
        help="KV-cache bytes and attention memory, standard attention vs flashtile",
        description=(
            "The memory calculator: KV-cache bytes per token per layer, per sequence and in total, and the "
            "attention intermediate memory of standard attention (N x N scores and probabilities) against "
            "flashtile's O(N) softmax statistics. From a Hugging Face config.json or explicit shapes."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_config.add_shape_arguments(parser, layers=True, dtype_default="the config's torch_dtype, else bf16")
    parser.add_argument("--seqlen", type=int, default=4096, metavar="N", help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="sequences (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.set_defaults(func=run, parser=parser)
    return parser


def compute(shape: model_config.ModelShape, seqlen: int, batch: int) -> dict:
    """The numbers (see the module docstring for what each counts), in bytes."""
    b, n, L = shape.dtype_bytes, seqlen, shape.num_layers
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    per_token_layer = hkv * (d + shape.value_dim) * b
    kv = {
        "bytes_per_token_per_layer": per_token_layer,
        "bytes_per_token": per_token_layer * L,
        "bytes_per_sequence": per_token_layer * L * n,
        "bytes_total": per_token_layer * L * n * batch,
        "windowed": None,
    }
    if model_config.SLIDING in shape.layer_types:
        kept = [min(n, shape.sliding_window) if kind == model_config.SLIDING else n for kind in shape.layer_types]
        kv["windowed"] = {
            "sliding_window": shape.sliding_window,
            "tokens_kept_per_layer": kept,
            "bytes_per_sequence": per_token_layer * sum(kept),
            "bytes_total": per_token_layer * sum(kept) * batch,
        }
    scores = batch * h * n * n * b
    lse = batch * h * n * LSE_BYTES
    backward_stats = 2 * batch * h * n * LSE_BYTES
    return {
        "model": shape.name,
        "source": shape.source,
        "shape": shape.to_dict(),
        "seqlen": n,
        "batch": batch,
        "dtype_bytes": b,
        "kv_cache": kv,
        "attention_per_layer": {
            "standard": {"scores_bytes": scores, "probs_bytes": scores, "total_bytes": 2 * scores},
            "flashtile": {"lse_bytes": lse, "backward_stats_bytes": backward_stats, "total_bytes": lse + backward_stats},
            "ratio": 2 * scores / (lse + backward_stats),
        },
        "saved_for_backward_all_layers": {"standard_probs_bytes": L * scores, "flashtile_lse_bytes": L * lse},
    }


def table(shape: model_config.ModelShape, result: dict) -> str:
    """The numbers of :func:`compute` as a table, each with the arithmetic that gives it."""
    from ..bench.common import markdown_table

    n, batch, b, L = result["seqlen"], result["batch"], result["dtype_bytes"], shape.num_layers
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    kv, attn = result["kv_cache"], result["attention_per_layer"]
    saved = result["saved_for_backward_all_layers"]

    def row(what, formula, nbytes):
        return [what, formula, f"{nbytes:,}", format_bytes(nbytes)]

    rows = [
        row("KV cache per token, per layer", f"2 (K,V) x {hkv} kv heads x {d} x {b} B" if not shape.head_dim_v else
            f"{hkv} kv heads x ({d} K + {shape.head_dim_v} V) x {b} B", kv["bytes_per_token_per_layer"]),
        row(f"KV cache per token, {L} layers", f"x {L}", kv["bytes_per_token"]),
        row(f"KV cache per sequence ({n} tokens)", f"x {n}", kv["bytes_per_sequence"]),
        row(f"KV cache total (batch {batch})", f"x {batch}", kv["bytes_total"]),
    ]
    if kv["windowed"]:
        w = kv["windowed"]
        sliding = shape.layer_types.count(model_config.SLIDING)
        kept = f"{sliding} sliding x {min(n, w['sliding_window'])} + {L - sliding} global x {n} tokens"
        rows += [
            row("KV cache per sequence, windowed", kept, w["bytes_per_sequence"]),
            row(f"KV cache total, windowed (batch {batch})", f"x {batch}", w["bytes_total"]),
        ]
    rows += [
        row("standard: scores Q K^T, one layer", f"{batch} batch x {h} heads x {n}^2 x {b} B", attn["standard"]["scores_bytes"]),
        row("standard: probabilities, one layer", f"{batch} batch x {h} heads x {n}^2 x {b} B", attn["standard"]["probs_bytes"]),
        row("standard: total, one layer", "scores + probabilities", attn["standard"]["total_bytes"]),
        row("flashtile: lse (forward), one layer", f"{batch} batch x {h} heads x {n} x 4 B", attn["flashtile"]["lse_bytes"]),
        row("flashtile: delta + lse2 (backward)", f"2 x {batch} batch x {h} heads x {n} x 4 B",
            attn["flashtile"]["backward_stats_bytes"]),
        row("flashtile: total, one layer", "lse + delta + lse2", attn["flashtile"]["total_bytes"]),
        ["standard / flashtile, one layer", "total / total", "", f"{attn['ratio']:,.1f}x"],
        row(f"training, saved for backward: standard probs, {L} layers", f"{L} x probabilities", saved["standard_probs_bytes"]),
        row(f"training, saved for backward: flashtile lse, {L} layers", f"{L} x lse", saved["flashtile_lse_bytes"]),
    ]
    head = [f"{shape.name} ({shape.source}): {shape.summary()}; seqlen {n}, batch {batch}"]
    head += [f"  note: {note}" for note in shape.notes]
    return "\n".join(head) + "\n\n" + markdown_table(["quantity", "formula", "bytes", "size"], rows)


@readable_errors("memory")
def run(args) -> int:
    if args.seqlen <= 0 or args.batch <= 0:
        args.parser.error(f"--seqlen and --batch must be positive, got --seqlen {args.seqlen} --batch {args.batch}")
    shape = model_config.shape_from_args(args)
    result = compute(shape, args.seqlen, args.batch)
    if args.json:
        print_json(result)
    else:
        print(table(shape, result))
    return 0
