"""A Hugging Face ``config.json`` read into the attention shapes a model uses.

Only the local file is read; nothing is downloaded. The fields used, as transformers names them:

- ``num_attention_heads``, ``num_key_value_heads`` (missing: as many as query heads, i.e. MHA),
  ``head_dim`` (missing or null: ``hidden_size // num_attention_heads``), ``num_hidden_layers``.
- ``torch_dtype`` (or ``dtype`` in newer files; missing: bfloat16).
- Sliding windows: ``sliding_window`` with, in order of precedence, ``layer_types``
  (``"sliding_attention"`` / ``"full_attention"`` per layer), ``use_sliding_window: false``
  (Qwen2: no layer slides), ``sliding_window_pattern`` P (Gemma-3: every P-th layer is global),
  ``model_type == "gemma2"`` (even layers slide, odd are global), else every layer slides (Mistral).
- Multi-head latent attention (DeepSeek-V2/V3): ``qk_nope_head_dim + qk_rope_head_dim`` is the query/key head dim
  and ``v_head_dim`` the values'; the shapes are the attention flashtile runs (prefill and training, the latent
  expanded to per-head keys and values), not the compressed latent a serving cache may hold.
- ``attn_logit_softcapping`` (Gemma-2) and ``query_pre_attn_scalar`` (softmax scale
  ``query_pre_attn_scalar ** -0.5``).
- Attention sinks: gpt-oss's learned per-head sink logits are weights, not a config field, so
  ``model_type == "gpt_oss"`` implies them.

Multimodal configs that keep the language model under ``text_config`` are read from there.
A missing or malformed field raises :class:`ConfigError` naming the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import ToolError

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "configs"

FULL = "full"
SLIDING = "sliding"
_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}

# Canonical dtype name -> bytes per element. Accepted spellings in DTYPE_ALIASES.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}
# Earlier bundled names (a toy each, until the real configs replaced them) -> the real model's config.
ALIASES = {"llama": "llama-3-8b", "mistral": "mistral-7b", "gemma2": "gemma-2-9b", "gpt-oss": "gpt-oss-20b"}
# model_type values whose attention has learned sinks (see the module docstring).
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


class ConfigError(ToolError):
    """A config file that cannot be read into attention shapes; the message names file and field."""


@dataclass(frozen=True)
class ModelShape:
    """The attention-relevant shape of a model, one entry of ``layer_types`` per layer."""

    name: str
    source: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float16" or "float32"
    layer_types: tuple = ()  # FULL or SLIDING per layer
    head_dim_v: int | None = None  # the values' head dim where it differs from head_dim (MLA: 128 against 192)
    sliding_window: int | None = None  # tokens a sliding layer sees, the query's own included
    softcap: float | None = None
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sinks: bool = False
    model_type: str | None = None
    max_position_embeddings: int | None = None
    notes: tuple = field(default=())  # defaults filled in, said out loud

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def value_dim(self) -> int:
        """The values' head dim (``head_dim`` unless the model gives another)."""
        return self.head_dim_v or self.head_dim

    def layer_counts(self) -> dict:
        """``{FULL: n, SLIDING: m}`` in the order the kinds first appear, kinds with no layer left out."""
        counts: dict = {}
        for kind in self.layer_types:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.layer_counts().items())
        window = f", window {self.sliding_window}" if SLIDING in self.layer_types else ""
        values = f" (values {self.head_dim_v})" if self.head_dim_v else ""
        extras = "".join([
            f", softcap {self.softcap:g}" if self.softcap else "",
            ", attention sinks" if self.sinks else "",
        ])
        return (f"{self.num_layers} layers ({kinds}{window}), {self.num_heads} heads, {self.num_kv_heads} KV heads, "
                f"head dim {self.head_dim}{values}, {self.dtype}{extras}")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["notes"] = list(self.notes)
        return out


def canonical_dtype(text: str, where: str = "--dtype") -> str:
    name = DTYPE_ALIASES.get(str(text).lower().removeprefix("torch."))
    if name is None:
        raise ConfigError(f"{where}: unsupported dtype {text!r}; expected one of bfloat16, float16, float32")
    return name


def bundled_names() -> list[str]:
    """Names of the configs shipped in ``flashtile/configs`` (``llama-3-8b``, ``mistral-7b``, ``tiny-llama``, ...)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def resolve(spec: str) -> tuple[Path, str]:
    """``(path, model name)`` for a path to a config.json, a checkpoint directory holding one, or a bundled name
    (or one of its :data:`ALIASES`)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{spec}: a directory without a config.json")
        return path, path.parent.resolve().name
    if path.is_file():
        # A Hub checkpoint's file is always called config.json: its directory names the model.
        return path, path.parent.resolve().name if path.stem == "config" else path.stem
    name = ALIASES.get(spec, spec)
    bundled = BUNDLED_DIR / f"{name}.json"
    if "/" not in name and bundled.is_file():
        return bundled, name
    raise ConfigError(
        f"{spec}: no such file, and not a bundled config (bundled: {', '.join(bundled_names())})"
    )


def load(spec: str) -> ModelShape:
    """Read ``spec`` (see :func:`resolve`) into a :class:`ModelShape`."""
    path, name = resolve(spec)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read it ({error.__class__.__name__}: {error})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    return from_hf_config(config, str(path), name)


def _positive_int(config: dict, key: str, where: str, required: bool = True):
    value = config.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{where}: missing field {key!r} (needed for the attention shapes)")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def from_hf_config(config, where: str, name: str) -> ModelShape:
    """The attention shapes of a parsed ``config.json`` (``where`` names the file in errors)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json), got a {type(config).__name__}")
    notes = []
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = {"model_type": config.get("model_type"), **config["text_config"]}
        notes.append("attention shapes read from text_config")
        where = f"{where} (text_config)"
    model_type = config.get("model_type")
    heads = _positive_int(config, "num_attention_heads", where)
    layers = _positive_int(config, "num_hidden_layers", where)
    kv_heads = _positive_int(config, "num_key_value_heads", where, required=False)
    if kv_heads is None:
        kv_heads = heads
        notes.append("num_key_value_heads missing: as many KV heads as query heads (MHA)")
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = _positive_int(config, "head_dim", where, required=False)
    head_dim_v = None
    if config.get("qk_nope_head_dim") is not None and config.get("qk_rope_head_dim") is not None:
        head_dim = _positive_int(config, "qk_nope_head_dim", where) + _positive_int(config, "qk_rope_head_dim", where)
        head_dim_v = _positive_int(config, "v_head_dim", where)
        head_dim_v = None if head_dim_v == head_dim else head_dim_v
        notes.append(f"multi-head latent attention: head dim qk_nope_head_dim + qk_rope_head_dim = {head_dim}, values "
                     f"v_head_dim = {head_dim_v or head_dim}, the latent expanded per head as flashtile runs it "
                     "(a serving cache of the compressed latent holds kv_lora_rank + qk_rope_head_dim per token)")
    if head_dim is None:
        if config.get("hidden_size") is None:
            raise ConfigError(f"{where}: missing field 'head_dim' (or 'hidden_size' to derive it from)")
        hidden = _positive_int(config, "hidden_size", where)
        if hidden % heads:
            raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; give head_dim")
        head_dim = hidden // heads
        notes.append(f"head_dim = hidden_size / num_attention_heads = {head_dim}")
    dtype_key = "torch_dtype" if config.get("torch_dtype") is not None else "dtype"
    dtype_text = config.get(dtype_key)
    if dtype_text is None or dtype_text == "auto":
        dtype = "bfloat16"
        notes.append("no torch_dtype: bfloat16 assumed")
    else:
        dtype = canonical_dtype(dtype_text, f"{where}: field {dtype_key!r}")
    window = _positive_int(config, "sliding_window", where, required=False)
    layer_types = _layer_types(config, where, layers, window, model_type, notes)
    if SLIDING not in layer_types:
        window = None
    softcap = config.get("attn_logit_softcapping")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0):
        raise ConfigError(f"{where}: field 'attn_logit_softcapping' must be a non-negative number or null, got {softcap!r}")
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0):
        raise ConfigError(f"{where}: field 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    sinks = model_type in SINK_MODEL_TYPES
    if sinks:
        notes.append(f"model_type {model_type!r}: learned attention sinks (a weight per head)")
    return ModelShape(
        name=name, source=where, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        head_dim_v=head_dim_v, dtype=dtype, layer_types=layer_types, sliding_window=window, softcap=float(softcap) if softcap else None,
        softmax_scale=float(scalar) ** -0.5 if scalar else None, sinks=sinks, model_type=model_type,
        max_position_embeddings=config.get("max_position_embeddings"), notes=tuple(notes),
    )


def _layer_types(config: dict, where: str, layers: int, window, model_type, notes: list) -> tuple:
    """FULL or SLIDING per layer (rules in the module docstring)."""
    listed = config.get("layer_types")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != layers:
            size = len(listed) if isinstance(listed, list) else type(listed).__name__
            raise ConfigError(f"{where}: field 'layer_types' must list one entry per layer ({layers}), got {size}")
        unknown = sorted({t for t in listed if t not in _LAYER_TYPES}, key=str)
        if unknown:
            raise ConfigError(
                f"{where}: field 'layer_types' has {unknown!r}; flashtile knows {sorted(_LAYER_TYPES)}"
            )
        kinds = tuple(_LAYER_TYPES[t] for t in listed)
        if SLIDING in kinds and window is None:
            raise ConfigError(f"{where}: missing field 'sliding_window' (layer_types has sliding_attention layers)")
        return kinds
    if window is None or config.get("use_sliding_window") is False:
        return (FULL,) * layers
    pattern = config.get("sliding_window_pattern")
    if pattern is not None:
        pattern = _positive_int(config, "sliding_window_pattern", where)
        notes.append(f"sliding_window_pattern {pattern}: every {pattern}th layer is global, the others slide")
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    if model_type == "gemma2":
        notes.append("gemma2 without layer_types: even layers slide, odd layers are global")
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers))
    notes.append("sliding_window without layer_types: every layer slides (as in Mistral)")
    return (SLIDING,) * layers


def from_args(heads: int, kv_heads: int | None, head_dim: int, layers: int = 1, dtype: str = "bfloat16",
              sliding_window: int | None = None, softcap: float | None = None, sinks: bool = False) -> ModelShape:
    """A shape given on the command line; ``sliding_window`` makes every layer slide."""
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    name = f"h{heads}-kv{kv_heads}-d{head_dim}"
    return ModelShape(
        name=name, source="command line", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=canonical_dtype(dtype), layer_types=((SLIDING if sliding_window else FULL),) * layers,
        sliding_window=sliding_window, softcap=softcap or None, sinks=sinks,
    )


def with_overrides(shape: ModelShape, **values) -> ModelShape:
    """``shape`` with the command-line values that are not None put over the config's."""
    changes = {k: v for k, v in values.items() if v is not None}
    if "dtype" in changes:
        changes["dtype"] = canonical_dtype(changes["dtype"])
    if "sliding_window" in changes:
        changes["layer_types"] = (SLIDING,) * changes.get("num_layers", shape.num_layers)
    elif "num_layers" in changes and changes["num_layers"] != shape.num_layers:
        if len(set(shape.layer_types)) > 1:
            raise ConfigError(f"--layers {changes['num_layers']}: cannot resize a model that mixes layer types")
        changes["layer_types"] = shape.layer_types[:1] * changes["num_layers"]
    heads = changes.get("num_heads", shape.num_heads)
    kv = changes.get("num_kv_heads", shape.num_kv_heads)
    if heads % kv:
        raise ConfigError(f"{heads} query heads is not a multiple of {kv} KV heads")
    if changes:
        given = ", ".join(sorted(k for k in values if values[k] is not None))
        changes["notes"] = shape.notes + (f"overridden on the command line: {given}",)
    return replace(shape, **changes)


def add_shape_arguments(parser, layers: bool, dtype_default: str) -> None:
    """``--config`` and the explicit shape flags that override it (``--layers`` only when ``layers``)."""
    parser.add_argument("--config", metavar="PATH|NAME", help="config.json, checkpoint directory, or bundled name")
    if layers:
        parser.add_argument("--layers", type=int, metavar="L", help="number of layers (num_hidden_layers)")
    parser.add_argument("--heads", type=int, metavar="H", help="query heads (num_attention_heads; with --head-dim, instead of or over --config)")
    parser.add_argument("--kv-heads", type=int, metavar="HKV", help="KV heads (num_key_value_heads; default: --heads)")
    parser.add_argument("--head-dim", type=int, metavar="D", help="head dim")
    parser.add_argument("--dtype", help=f"bf16, fp16 or fp32 (default: {dtype_default})")
    parser.add_argument("--sliding-window", type=int, metavar="W", help="every layer attends to its last W keys (Mistral-style)")


def shape_from_args(args) -> ModelShape:
    """The model shape of ``--config`` and/or the flags of :func:`add_shape_arguments`."""
    for flag in ("layers", "heads", "kv_heads", "head_dim", "sliding_window"):
        value = getattr(args, flag, None)
        if value is not None and value <= 0:
            args.parser.error(f"--{flag.replace('_', '-')} must be positive, got {value}")
    overrides = dict(
        num_layers=getattr(args, "layers", None), num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype, sliding_window=args.sliding_window,
    )
    if args.config:
        return with_overrides(load(args.config), **overrides)
    needed = ["--heads", "--head-dim"] + (["--layers"] if hasattr(args, "layers") else [])
    missing = [flag for flag in needed if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        args.parser.error(f"give --config PATH|NAME, or the shape: {' '.join(missing)} missing")
    return from_args(
        args.heads, args.kv_heads, args.head_dim, layers=getattr(args, "layers", None) or 1,
        dtype=args.dtype or "bfloat16", sliding_window=args.sliding_window,
    )
