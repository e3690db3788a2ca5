"""transformers models with attn_implementation="flashtile" against the same models with "eager".

Tiny random models built here (no download): Llama, Qwen2, Qwen3, Mistral (sliding window 4 < the
16 tokens), Gemma-2 (softcap, sliding layers) and gpt-oss (sinks, sliding layers), each where the
installed transformers has it. Padded batches of lengths 5, 11 and 16, left and right padded.

Reference: the model with eager attention, on each sequence alone in float64 (``ref_hi``) and on the
padded batch in float32 (``ref_lo``), and the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref` on the logits of the real (non-padding) tokens; greedy
``generate()`` must give eager's tokens. Every model test checks that flashtile ran each attention call
(``flashtile.stats()``) and recorded no fallback, so none can pass by running eager. Weights are
drawn with std 0.2: transformers' 0.02 gives near-uniform attention, where a wrong window or softcap
hardly changes the logits.
"""
import copy
import functools
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402
from flashtile.integrations import transformers as integration  # noqa: E402
from flashtile.integrations.transformers import (  # noqa: E402
    _eager_attention,
    flashtile_attention_forward,
    flashtile_attention_mask,
    register,
)
from flashtile.testing import ATOL, assert_close_to_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_dispatch_state")

SEQLEN, LENGTHS = 16, (5, 11, 16)
NEW_TOKENS = 6
LAYERS = 2
SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
# Config class name in transformers, and what each model adds to SMALL.
MODELS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                    query_pre_attn_scalar=16)),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2)),
}
ATOL_LOGITS = ATOL[torch.float32][1]

register()


@functools.lru_cache(maxsize=None)
def tiny_model(name, device):
    """The named tiny model on ``device`` in eval mode, float32, random weights from a fixed seed
    (skips if the installed transformers lacks it)."""
    config_name, extra = MODELS[name]
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    config = config_class(**SMALL, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")
    assert model.config._attn_implementation == "flashtile"  # not swapped for a flash-attn kernel (gpt-oss would)
    if name == "gpt_oss":
        with torch.no_grad():  # sinks start at 0; make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model.to(device).eval()


def padded_batch(side, device):
    """``(input_ids, attention_mask)`` of ``LENGTHS`` tokens padded to ``SEQLEN`` on ``side``."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, SMALL["vocab_size"], (len(LENGTHS), SEQLEN), generator=generator)
    mask = torch.zeros(len(LENGTHS), SEQLEN, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        if side == "left":
            mask[row, SEQLEN - length:] = 1
        else:
            mask[row, :length] = 1
    return input_ids.masked_fill(mask == 0, SMALL["pad_token_id"]).to(device), mask.to(device)


def logits_with(model, attn_implementation, *args, **kwargs):
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():
        return model(*args, **kwargs).logits


def assert_flashtile_ran(calls):
    stats = flashtile.stats()
    assert stats["fallbacks"] == {}, stats
    assert sum(stats["calls"].values()) == calls, stats


def assert_logits_match_eager(model, input_ids, mask, ours):
    """Our logits of the real tokens against eager's: ``ref_lo`` the padded batch in float32, ``ref_hi``
    each sequence alone (no padding, same positions) in float64, where eager's additive padding mask
    would overflow into NaNs."""
    keep = mask.bool()
    ref_lo = logits_with(model, "eager", input_ids, attention_mask=mask)[keep]
    model_hi = copy.deepcopy(model).double()
    if getattr(model_hi.config, "_experts_implementation", None) not in (None, "eager"):
        model_hi.set_experts_implementation("eager")  # grouped_mm (gpt-oss's experts) has no float64
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    ref_hi = torch.cat([logits_with(model_hi, "eager", ids[row][None], position_ids=columns[row][None])[0]
                        for ids, row in zip(input_ids, keep)])
    assert_close_to_ref("logits", ours[keep], ref_hi, ref_lo, ATOL_LOGITS)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_padded_logits_match_eager(name, side, device):
    model = tiny_model(name, device)
    input_ids, mask = padded_batch(side, device)
    flashtile.reset_stats()
    ours = logits_with(model, "flashtile", input_ids, attention_mask=mask)
    assert_flashtile_ran(calls=LAYERS)
    assert_logits_match_eager(model, input_ids, mask, ours)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_matches_eager(name, device):
    """Greedy decoding from a left-padded batch with transformers' KV cache: prefill, then one query
    against the cache per step (sliding layers keep only their window)."""
    model = tiny_model(name, device)
    input_ids, mask = padded_batch("left", device)
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    model.set_attn_implementation("eager")
    expected = model.generate(input_ids, **options)
    model.set_attn_implementation("flashtile")
    flashtile.reset_stats()
    tokens = model.generate(input_ids, **options)
    assert_flashtile_ran(calls=LAYERS * NEW_TOKENS)  # the prefill and NEW_TOKENS - 1 decoding steps
    assert tokens[:, SEQLEN:].tolist() == expected[:, SEQLEN:].tolist()


def test_training_gradients_match_eager(device):
    """One training step of gpt-oss (sinks, sliding layers) on a right-padded batch: the gradient of every
    parameter, the sinks included. Right padding keeps every query row of eager's float64 reference
    finite (a left-padded row of only padding overflows its additive mask)."""
    model = copy.deepcopy(tiny_model("gpt_oss", device)).train()
    input_ids, mask = padded_batch("right", device)
    labels = input_ids.masked_fill(mask == 0, -100)

    def gradients(model, attn_implementation):
        model.set_attn_implementation(attn_implementation)
        model.zero_grad()
        model(input_ids, attention_mask=mask, labels=labels).loss.backward()
        return {name: parameter.grad for name, parameter in model.named_parameters()}

    ours = gradients(model, "flashtile")
    assert_flashtile_ran(calls=LAYERS)
    ref_lo = gradients(model, "eager")
    model_hi = copy.deepcopy(model).double()
    model_hi.set_experts_implementation("eager")  # grouped_mm has no float64
    ref_hi = gradients(model_hi, "eager")
    assert ours["model.layers.0.self_attn.sinks"] is not None
    for name in ref_hi:
        assert_close_to_ref(name, ours[name], ref_hi[name], ref_lo[name], ATOL[torch.float32][1])


def test_from_pretrained(tmp_path, device):
    model = tiny_model("llama", device)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flashtile")
    assert loaded.config._attn_implementation == "flashtile"
    loaded = loaded.to(device).eval()
    input_ids, mask = padded_batch("right", device)
    ours = logits_with(loaded, "flashtile", input_ids, attention_mask=mask)
    assert_flashtile_ran(calls=LAYERS)
    assert_logits_match_eager(model, input_ids, mask, ours)


def test_packed_sequences_match_eager(device):
    """Sequences of 5, 7 and 4 tokens packed into one row (position_ids restart at 0): varlen, no mask."""
    model = tiny_model("mistral", device)
    lengths = (5, 7, 4)
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, SMALL["vocab_size"], (1, sum(lengths)), generator=generator).to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    ours = logits_with(model, "flashtile", input_ids, position_ids=position_ids)
    assert_flashtile_ran(calls=LAYERS)
    alone = [logits_with(model, "eager", ids[None]) for ids in input_ids[0].split(lengths)]
    torch.testing.assert_close(ours, torch.cat(alone, dim=1), atol=ATOL_LOGITS, rtol=0)


def attention_inputs(device, batch=2, seqlen_q=6, seqlen_k=6, headdim=16, seed=3):
    """Random ``(query, key, value)`` in transformers' layout ``(batch, heads, seqlen, headdim)``, GQA 4/2."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, 4, seqlen_q, headdim, generator=generator)
    key, value = (torch.randn(batch, 2, seqlen_k, headdim, generator=generator) for _ in range(2))
    return query.to(device), key.to(device), value.to(device)


def layer(training=False, is_causal=True):
    """The attributes of an attention layer the attention function reads."""
    return types.SimpleNamespace(is_causal=is_causal, training=training)


def eager(query, key, value, mask=None, causal=True, window=(-1, -1), **options):
    """The integration's own eager fallback (the reference of the function-level tests)."""
    defaults = dict(scale=None, softcap=0.0, sink=None, dropout_p=0.0, position_bias=None, packed=None)
    return _eager_attention(query, key, value, mask, causal=causal, window=window, **{**defaults, **options})


def test_packed_keywords_match_position_ids(device):
    """cu_seq_lens_q/k and max_length_q/k keywords give what position_ids that restart give."""
    query, key, value = attention_inputs(device, batch=1, seqlen_q=9, seqlen_k=9)
    cu_seqlens = torch.tensor([0, 4, 9], device=device)
    by_keywords, _ = flashtile_attention_forward(layer(), query, key, value, None, cu_seq_lens_q=cu_seqlens,
                                                 cu_seq_lens_k=cu_seqlens, max_length_q=5, max_length_k=5)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]], device=device)
    by_positions, _ = flashtile_attention_forward(layer(), query, key, value, None, position_ids=position_ids)
    expected, _ = eager(query, key, value, packed=(cu_seqlens, cu_seqlens, 5, 5))
    torch.testing.assert_close(by_keywords, expected, atol=ATOL[torch.float32][0], rtol=0)
    torch.testing.assert_close(by_positions, by_keywords, atol=0, rtol=0)
    assert_flashtile_ran(calls=2)


@pytest.mark.parametrize("inference", [False, True], ids=["grad_mode", "inference_mode"])
def test_position_ids_are_read_once_per_forward(device, monkeypatch, inference):
    """Every layer of a forward gets the model's one position_ids tensor: its offsets are worked out (a host
    sync) at the first layer only. A layer that comes again starts another forward and reads them again (an
    in-place change in between is followed), as does another tensor."""
    query, key, value = attention_inputs(device, batch=1, seqlen_q=9, seqlen_k=9)
    reads = []
    read = integration._offsets_from_positions
    monkeypatch.setattr(integration, "_offsets_from_positions", lambda *a: reads.append(1) or read(*a))
    layers = [layer(), layer()]
    packed = (torch.tensor([0, 4, 9], device=device),) * 2 + (5, 5)
    expected = eager(query, key, value, packed=packed)[0]
    with torch.inference_mode(inference):
        position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]], device=device)
        first, second = (flashtile_attention_forward(m, query, key, value, None, position_ids=position_ids)[0]
                         for m in layers)
        assert len(reads) == 1
        torch.testing.assert_close(first, expected, atol=ATOL[torch.float32][0], rtol=0)
        torch.testing.assert_close(second, first, atol=0, rtol=0)
        position_ids.copy_(torch.arange(9, device=device)[None])  # one sequence now: plain causal attention
        plain = flashtile_attention_forward(layers[0], query, key, value, None, position_ids=position_ids)[0]
        assert len(reads) == 2
        torch.testing.assert_close(plain, eager(query, key, value)[0], atol=ATOL[torch.float32][0], rtol=0)
        flashtile_attention_forward(layers[1], query, key, value, None, position_ids=position_ids.clone())
        assert len(reads) == 3


@pytest.mark.parametrize("seqlen_q", [7, 3, 1], ids=["prefill", "chunk", "decode"])
def test_padded_attention_on_each_backend(backend, device, seqlen_q):
    """Queries that are the last tokens of a left-padded cache (a prefill, a chunk of new tokens, one
    decoding step) on each backend: bottom-right causal per sequence, a window of 3 keys, GQA 4/2."""
    query, key, value = attention_inputs(device, seqlen_q=seqlen_q, seqlen_k=7)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=device)
    out, weights = flashtile_attention_forward(layer(), query, key, value, mask, sliding_window=3)
    assert weights is None
    assert flashtile.stats()["calls"] == {backend: 1}
    expected, _ = eager(query, key, value, mask, window=(2, 0))
    real = mask[:, 7 - seqlen_q:]  # padding queries come out as zeros; eager's are not compared
    torch.testing.assert_close(out[real], expected[real], atol=ATOL[torch.float32][0], rtol=0)
    assert not out[~real].any()


@pytest.mark.parametrize("padding", ["left", "holes"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_decode_over_padding(device, padding, grad, no_dense_decode_threshold):
    """A decoding step over a padded cache with softcap, a sink and a window: left padding without a gradient
    reads the cache in place (flash_attn_with_kvcache, each row's padding as cache_leftpad, no copy of the
    keys); a mask that is not left padding, or a query that wants a gradient, goes through the packed path,
    whose one query a sequence also runs on the KV-cache kernel. Both match eager."""
    query, key, value = attention_inputs(device, batch=3, seqlen_q=1, seqlen_k=9)
    first = [0, 0, 0, 1, 1, 1, 1, 1, 1] if padding == "left" else [1, 1, 0, 0, 1, 1, 1, 1, 1]
    mask = torch.tensor([first, [1] * 9, [0] * 7 + [1, 1]], dtype=torch.bool, device=device)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5)).to(device)
    query.requires_grad_(grad)
    out, _ = flashtile_attention_forward(layer(), query, key, value, mask, softcap=5.0, s_aux=sink, sliding_window=5)
    expected, _ = eager(query.detach(), key, value, mask, window=(4, 0), softcap=5.0, sink=sink)
    torch.testing.assert_close(out.detach(), expected, atol=ATOL[torch.float32][0], rtol=0)
    (kernel,) = flashtile.stats()["kernels"]
    if padding == "left" and not grad:
        assert kernel.startswith("flashtile.decode[") and " varlen" not in kernel, kernel
    else:
        # The packed path; its one query a sequence takes the KV-cache kernel in 16 bits (and always under
        # Triton's interpreter), float32 keeps the forward kernel on a GPU (configs.dense_takes_decode).
        kv_kernel = device == "cpu" or query.dtype != torch.float32
        assert kernel.startswith("flashtile.decode[" if kv_kernel else "flashtile.fwd[") and " varlen" in kernel, kernel
    assert_flashtile_ran(calls=1)
    if grad:
        (dq,) = torch.autograd.grad(out.sum(), query)
        assert torch.isfinite(dq).all() and dq.abs().sum() > 0


@pytest.mark.parametrize("seqlen_q", [7, 5, 9])
def test_bidirectional_attention_over_padded_keys(device, seqlen_q):
    """A bidirectional layer (``is_causal=False`` overrides the layer's flag) over padded keys, as an
    encoder (same lengths) or cross-attention (queries that are not the keys' tokens) has it: every
    query attends to its row's real keys."""
    query, key, value = attention_inputs(device, seqlen_q=seqlen_q, seqlen_k=7)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool, device=device)
    out, _ = flashtile_attention_forward(layer(is_causal=True), query, key, value, mask, is_causal=False)
    expected, _ = eager(query, key, value, mask, causal=False)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32][0], rtol=0)
    assert_flashtile_ran(calls=1)


def test_dropout_only_while_training(device):
    query, key, value = attention_inputs(device)
    plain, _ = flashtile_attention_forward(layer(), query, key, value, None)
    in_eval, _ = flashtile_attention_forward(layer(training=False), query, key, value, None, dropout=0.5)
    torch.manual_seed(0)
    in_training, _ = flashtile_attention_forward(layer(training=True), query, key, value, None, dropout=0.5)
    assert torch.equal(in_eval, plain)
    assert not torch.allclose(in_training, plain)
    assert_flashtile_ran(calls=3)


def test_mask_function_builds_padding_masks():
    """The mask transformers builds for "flashtile": None without padding, else the 2-D key mask; a
    pattern a padding mask cannot state (an or_masks) becomes the 4-D boolean mask."""
    from transformers import masking_utils

    full = torch.ones(2, 6, dtype=torch.bool)
    padded = full.clone()
    padded[0, :2] = False
    sliding = masking_utils.sliding_window_causal_mask_function(3)
    options = dict(batch_size=2, q_length=6, kv_length=6, device="cpu")
    causal = masking_utils.causal_mask_function
    assert flashtile_attention_mask(mask_function=causal, attention_mask=full, **options) is None
    assert flashtile_attention_mask(mask_function=sliding, attention_mask=None, **options) is None
    assert torch.equal(flashtile_attention_mask(mask_function=sliding, attention_mask=padded, **options), padded)
    # A decoding step of a sliding layer: the cache keeps the last 3 keys, the mask its last 3 columns.
    step = flashtile_attention_mask(batch_size=2, q_length=1, kv_length=3, mask_function=sliding,
                                    attention_mask=torch.cat([padded, full[:, :1]], dim=1))
    assert step is None
    prefix = masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv < 2)
    dense = flashtile_attention_mask(mask_function=prefix, attention_mask=padded, **options)
    assert dense.shape == (2, 1, 6, 6) and dense.dtype == torch.bool
    assert torch.equal(dense, masking_utils.sdpa_mask(mask_function=prefix, attention_mask=padded,
                                                      allow_is_causal_skip=False, **options))


def test_4d_mask_runs_as_attn_bias(device):
    """A 4-D mask replaces causal and window, as in eager; bool keeps, float adds."""
    query, key, value = attention_inputs(device)
    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[..., 0] = True
    keep = keep.to(device)
    additive = torch.zeros(2, 1, 6, 6, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    expected, _ = eager(query, key, value, keep, causal=False)
    for mask in (keep, additive):
        out, _ = flashtile_attention_forward(layer(), query, key, value, mask, sliding_window=2)
        torch.testing.assert_close(out, expected, atol=ATOL[torch.float32][0], rtol=0)
    assert_flashtile_ran(calls=2)


def test_output_attentions_falls_back_to_eager_recorded(device):
    """flashtile never forms attention weights: asking for them runs eager, recorded as a fallback."""
    model = tiny_model("gemma2", device)
    input_ids, mask = padded_batch("left", device)
    model.set_attn_implementation("flashtile")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="output_attentions"):
        ours = model(input_ids, attention_mask=mask, output_attentions=True)
    stats = flashtile.stats()
    assert stats["calls"] == {"eager": LAYERS}
    assert list(stats["fallbacks"]) == ["output_attentions=True: flashtile never forms the attention weights"]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask, output_attentions=True)
    keep = mask.bool()
    torch.testing.assert_close(ours.logits[keep], expected.logits[keep], atol=ATOL_LOGITS, rtol=0)
    assert len(ours.attentions) == LAYERS
    for weights, expected_weights in zip(ours.attentions, expected.attentions):
        # (batch, heads, seqlen_q, seqlen_k): the rows of the real queries.
        rows, expected_rows = weights.transpose(1, 2)[keep], expected_weights.transpose(1, 2)[keep]
        torch.testing.assert_close(rows, expected_rows, atol=ATOL[torch.float32][0], rtol=0)


def test_unsupported_head_dim_is_recorded_or_raises_in_strict_mode(device):
    query, key, value = attention_inputs(device, headdim=12)
    with pytest.warns(RuntimeWarning, match="head dim 12"):
        out, _ = flashtile_attention_forward(layer(), query, key, value, None)
    torch.testing.assert_close(out, eager(query, key, value)[0], atol=0, rtol=0)
    assert flashtile.stats()["fallbacks"] == {"head dim 12: flashtile needs a multiple of 8 between 8 and 256": 1}
    flashtile.set_strict(True)
    with pytest.raises(flashtile.FallbackError, match="head dim 12"):
        flashtile_attention_forward(layer(), query, key, value, None)


@pytest.mark.parametrize("mask, error, match", [
    (torch.zeros(2, 6).masked_fill(torch.eye(2, 6, dtype=torch.bool), -1e9), ValueError, "additive"),
    (torch.ones(2, 6, 6, dtype=torch.bool), ValueError, "shape \\(2, 6, 6\\)"),
    ([[1] * 6] * 2, TypeError, "got list"),
], ids=["additive-2d", "3d", "not-a-tensor"])
def test_masks_that_are_no_padding_mask_raise(mask, error, match):
    query, key, value = attention_inputs("cpu")
    with pytest.raises(error, match=match):
        flashtile_attention_forward(layer(), query, key, value, mask)
    assert flashtile.stats()["calls"] == {}
