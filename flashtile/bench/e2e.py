"""End to end: a Llama-3-8B-shaped model (``llama3-8b.json`` next to this file: hidden 4096, 32 heads,
8 KV heads, MLP 14336, vocab 128256) with random weights and fewer layers, built with Hugging Face
transformers' ``AutoModelForCausalLM.from_config(config, attn_implementation=...)`` for
``flashtile`` (registered by ``flashtile.integrations.transformers.register()``), ``sdpa`` and ``eager``.

- Prefill: latency of one forward over a prompt of each length (batch 1, ``use_cache=True``,
  last-token logits only), median of wall-clock runs with the device synchronized (host overhead
  is part of a model's latency); its peak extra memory; the max |difference| of the last-token
  logits against eager at the shortest prompt; and the kernels one prefill ran.
- Decode: ``generate`` greedy with ``min_new_tokens = max_new_tokens = N`` from a fixed prompt;
  tokens/s = ``(N - 1) / (time(N tokens) - time(1 token))``, so the prefill and the first token
  are not counted.

Every implementation gets the same weights (the same seed). Rows are marked ``n/a`` when
transformers is not installed or flashtile's integration is not available.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import common, gpu

CONFIG_PATH = Path(__file__).with_name("llama3-8b.json")
IMPLEMENTATIONS = ("flashtile", "sdpa", "eager")


class Settings(NamedTuple):
    prompts: tuple = (512, 2048, 8192)
    new_tokens: int = 32
    decode_prompt: int = 512
    layers: int = 4
    runs: int = 3
    dtype: str = "bf16"
    config_overrides: tuple = ()  # (key, value) pairs on top of llama3-8b.json, e.g. a tiny model in tests


def load_config(layers: int, **overrides):
    """The bundled Llama-3-8B config with ``num_hidden_layers = layers`` (and any overrides)."""
    import transformers

    data = {k: v for k, v in json.loads(CONFIG_PATH.read_text()).items() if not k.startswith("_")}
    data.update(num_hidden_layers=layers, **overrides)
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def register_flashtile() -> None:
    try:
        from flashtile.integrations import transformers as integration
    except ImportError as exc:
        raise common.Unavailable(f"flashtile.integrations.transformers is not available ({exc})") from None
    if not hasattr(integration, "register"):
        raise common.Unavailable("flashtile.integrations.transformers has no register()")
    integration.register()


def build_model(impl: str, layers: int, dtype, device, **overrides):
    """A fresh model with seeded random weights, in ``dtype`` on ``device``, in eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    if impl == "flashtile":
        register_flashtile()
    config = load_config(layers, **overrides)  # from_config writes the implementation into the config: one each
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"  # renamed in 4.56; the old name warns in 5.x
    torch.manual_seed(0)  # the same weights for every implementation
    with torch.device(device):  # initialize on the device: 2 B random parameters are slow on a CPU
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, **{dtype_kw: dtype})
    return model.to(device=device, dtype=dtype).eval()


def _logits_kwargs(model) -> dict:
    """Ask for the last position's logits only (an 8k x 128k logits tensor is 2 GB), where supported."""
    import inspect

    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def wall_times_ms(fn: Callable, device, runs: int) -> list[float]:
    """Wall-clock ms of ``runs`` calls after one warm-up, the device synchronized after each."""

    def call():
        fn()
        common.synchronize(device)

    return common.time_runs_ms(call, min_runs=runs, max_runs=runs, min_total_s=0.0, warmup=1)


def _prompt(length: int, vocab: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(length)
    return torch.randint(100, vocab - 100, (1, length), generator=gen).to(device)


def _measure_impl(impl: str, settings: Settings, device, profile: bool) -> tuple[list[dict], dict]:
    """Every row of one implementation, and its last-token logits per prompt length (for the error)."""
    dtype = common.DTYPES[settings.dtype]
    base = {"prov": impl, "layers": settings.layers, "dtype": settings.dtype, "batch": 1}
    prefill_rows = [{**base, "kind": "prefill", "prompt": n} for n in settings.prompts]
    decode_row = {**base, "kind": "decode", "prompt": settings.decode_prompt, "new_tokens": settings.new_tokens}
    logits = {}
    try:
        model = build_model(impl, settings.layers, dtype, device, **dict(settings.config_overrides))
    except Exception as exc:  # noqa: BLE001 - not installed / not registered / OOM: every row marked
        label = common.describe_error(exc)
        return [{**r, "err": label} for r in (*prefill_rows, decode_row)], logits
    vocab = model.config.vocab_size
    extra = _logits_kwargs(model)
    cuda = torch.device(device).type == "cuda"
    with torch.inference_mode():
        for i, row in enumerate(prefill_rows):
            ids = _prompt(row["prompt"], vocab, device)
            forward = lambda: model(input_ids=ids, use_cache=True, **extra)  # noqa: E731
            try:
                logits[row["prompt"]] = forward().logits[0, -1].float().cpu()
                row.update(common.timing_fields("prefill", wall_times_ms(forward, device, settings.runs)))
                row["tokens_per_s"] = row["prompt"] / (row["prefill_ms"] * 1e-3)
                if cuda:
                    gpu._free_cuda()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    forward()
                    torch.cuda.synchronize()
                    row["peak_extra_GB"] = (torch.cuda.max_memory_allocated() - before) / 1e9
                if profile and i == 0:
                    row.update(common.kernel_proof(forward, cuda))
            except Exception as exc:  # noqa: BLE001
                row["err"] = common.describe_error(exc)
            gpu._free_cuda()
        ids = _prompt(settings.decode_prompt, vocab, device)
        mask = torch.ones_like(ids)
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

        def generate(n):
            return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=pad)

        try:
            many = common.timing_fields("generate", wall_times_ms(generate(settings.new_tokens), device, settings.runs))
            one = common.timing_fields("generate_1", wall_times_ms(generate(1), device, settings.runs))
            decode_row.update(many, **one)
            decode_ms = many["generate_ms"] - one["generate_1_ms"]
            if decode_ms > 0 and settings.new_tokens > 1:
                decode_row["ms_per_token"] = decode_ms / (settings.new_tokens - 1)
                decode_row["tokens_per_s"] = 1e3 / decode_row["ms_per_token"]
            else:
                decode_row["err"] = f"Noise: generating {settings.new_tokens} tokens took no longer than 1"
        except Exception as exc:  # noqa: BLE001
            decode_row["err"] = common.describe_error(exc)
    return [*prefill_rows, decode_row], logits  # the model goes with this frame; the caller frees the memory


def run(settings: Settings, chosen, device, on_row: Callable, profile: bool = True) -> list[dict]:
    """Every implementation in ``chosen`` (of :data:`IMPLEMENTATIONS`); ``on_row(label, row)`` after each."""
    impls = [impl for impl in IMPLEMENTATIONS if impl in chosen]
    if importlib.util.find_spec("transformers") is None:
        rows = []
        for impl in impls:
            for kind, prompt in [*(("prefill", n) for n in settings.prompts), ("decode", settings.decode_prompt)]:
                rows.append({"prov": impl, "kind": kind, "prompt": prompt, "layers": settings.layers,
                             "dtype": settings.dtype, "batch": 1,
                             "err": "Unavailable: transformers is not installed (pip install transformers)"})
                on_row(label_of(rows[-1]), rows[-1])
        return rows
    rows, logits = [], {}
    for impl in impls:
        mine, logits[impl] = _measure_impl(impl, settings, device, profile)
        gpu._free_cuda(collect=True)
        for row in mine:
            rows.append(row)
            on_row(label_of(row), row)
    shortest = min(settings.prompts)
    reference = logits.get("eager", {}).get(shortest)
    for row in rows:
        mine = logits.get(row["prov"], {}).get(row.get("prompt"))
        if row["kind"] == "prefill" and row["prompt"] == shortest and reference is not None and mine is not None:
            row["logits_max_diff_vs_eager"] = float((mine - reference).abs().max())
    return rows


def cell_count(settings: Settings, chosen) -> int:
    return sum(impl in chosen for impl in IMPLEMENTATIONS) * (len(settings.prompts) + 1)


def label_of(row: dict) -> str:
    return f"e2e {row['kind']} prompt={row['prompt']} {row['prov']}"


def progress_text(row: dict) -> str:
    if row.get("err"):
        return f"failed: {row['err']}"
    if row["kind"] == "prefill":
        return f"{row['prefill_ms']:.2f} ms ({row['tokens_per_s']:.0f} tokens/s)"
    return f"{row['tokens_per_s']:.1f} tokens/s ({row['ms_per_token']:.2f} ms/token)"
