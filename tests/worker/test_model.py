"""The Llama-family model over the paged KV pool agrees with transformers, whatever way the work
is split: cached prefixes, batches, chunked prefill, decode steps; plus the loader and ``tiny``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from router.tokenization import ByteTokenizer, HFTokenizer
from tests.worker.conftest import QWEN2_MOE, QWEN3_MOE, save_checkpoint
from worker.forward_batch import ForwardBatch
from worker.kv_pool import KVPool, slots_for
from worker.model import LlamaForCausalLM, ModelConfig, load_model
from worker.model.config import SUPPORTED_MODEL_TYPES
from worker.model.rope import rope_attention_factor, rope_inv_freq

PAGE_SIZE = 4  # tokens
ATOL = 2e-4


def new_pool(config: ModelConfig, num_pages: int = 64, device: str = "cpu") -> KVPool:
    return KVPool(
        num_pages, PAGE_SIZE, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, device
    )


def scattered_slots(pool: KVPool, lengths: list[int]) -> list[list[int]]:
    """Slots for sequences of ``lengths`` tokens, pages handed out round-robin so that no
    sequence's slots are contiguous."""
    pages: list[list[int]] = [[] for _ in lengths]
    while any(len(p) * PAGE_SIZE < n for p, n in zip(pages, lengths, strict=True)):
        for p, n in zip(pages, lengths, strict=True):
            if len(p) * PAGE_SIZE < n:
                p.append(int(pool.allocator.alloc(1)[0]))
    return [slots_for(np.array(p), 0, n, PAGE_SIZE).tolist() for p, n in zip(pages, lengths, strict=True)]


def extend(model, pool, chunks, starts, slots, all_logits=True):
    """One extend forward: request i adds tokens ``chunks[i]`` at position ``starts[i]``; ``slots[i]``
    are all of its slots (prefix = the first starts[i])."""
    batch = ForwardBatch.build(
        "extend",
        chunks,
        starts,
        [s[st : st + len(c)] for c, st, s in zip(chunks, starts, slots, strict=True)],
        [s[:st] for st, s in zip(starts, slots, strict=True)],
        device=pool.k_cache[0].device,
        return_all_logits=all_logits,
    )
    return model(batch, pool).cpu()


def decode(model, pool, tokens, positions, slots):
    batch = ForwardBatch.build(
        "decode", [[t] for t in tokens], positions, [[s[p]] for s, p in zip(slots, positions, strict=True)],
        [s[: p + 1] for s, p in zip(slots, positions, strict=True)], device=pool.k_cache[0].device,
    )  # fmt: skip
    return model(batch, pool).cpu()


def hf_model(path: Path):
    """transformers' model of the checkpoint at ``path``, as the reference: float32, eager attention.
    NOTE: the reference must not depend on the installed transformers' defaults. transformers 5.17 (the
    H200 image's; 5.24 does neither) runs Gemma 2 through SDPA, which drops attn_logit_softcapping, and
    clamps gpt-oss's experts at a fixed 7.0 (alpha 1.702) whatever the config's swiglu_limit (1.5 in
    conftest): both references were then other models, by several logits, on any device."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    for module in hf.modules():
        if type(module).__name__ == "GptOssExperts":  # NOTE: a no-op where transformers reads the config
            module.limit = hf.config.swiglu_limit
            module.alpha = getattr(hf.config, "swiglu_alpha", module.alpha)
    return hf.eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def llama(llama_checkpoint):
    return load_model(str(llama_checkpoint)), hf_model(llama_checkpoint)


PROMPT = (
    "Cache-aware routing sends shared prefixes to the worker, naïve café 🙂. "
    "Zebras quietly juggle vivid kumquats while pixels hum."
)


CHECKPOINTS = [
    "gpt_oss_checkpoint",
    "llama_checkpoint",
    "qwen2_checkpoint",
    "qwen3_checkpoint",
    "llama3_scaled_checkpoint",
    "yarn_checkpoint",
    "phi3_checkpoint",
    "granite_checkpoint",
    "mixtral_checkpoint",
    "gemma2_checkpoint",
    "gemma3_checkpoint",
    "gemma3_multimodal_checkpoint",
    "gemma3_multimodal_new_names_checkpoint",
    "mistral_window_checkpoint",
    "ministral_checkpoint",
    "smollm3_checkpoint",
    "qwen2_window_checkpoint",
    "qwen2_moe_checkpoint",
    "granitemoe_checkpoint",
    "granitemoeshared_checkpoint",
    "qwen3_moe_checkpoint",
    "sharded_llama_checkpoint",
]


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_prefill_and_greedy_decode_match_transformers(fixture, request):
    match_transformers(request.getfixturevalue(fixture), "cpu", ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_prefill_and_greedy_decode_match_transformers_on_the_gpu(fixture, request):
    """The same on CUDA (float32): the Triton kernels with each architecture's RoPE cache, score
    scale and weights against transformers on the CPU."""
    match_transformers(request.getfixturevalue(fixture), "cuda", 2e-3)


def match_transformers(path: Path, device: str, atol: float) -> None:
    loaded, hf = load_model(str(path), device, torch.float32), hf_model(path)
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    assert len(ids) > 40  # long enough to pass llama3's original context (32 tokens) in rope
    pool = new_pool(loaded.config, device=device)
    steps = 6
    [slots] = scattered_slots(pool, [len(ids) + steps])
    ours = extend(loaded.model, pool, [ids], [0], [slots])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=atol, rtol=1e-4)

    # greedy decode step by step against transformers' forward over the whole sequence so far (no KV
    # cache: its cache arguments change between transformers versions)
    hf_tokens, our_tokens = [], []
    our_last, hf_last = ours[-1:], hf_logits(hf, ids)[-1:]
    for step in range(steps):
        torch.testing.assert_close(our_last, hf_last, atol=atol, rtol=1e-4)
        our_tokens.append(int(our_last.argmax()))
        hf_tokens.append(int(hf_last.argmax()))
        hf_last = hf_logits(hf, ids + hf_tokens)[-1:]
        our_last = decode(loaded.model, pool, [our_tokens[-1]], [len(ids) + step], [slots])
    assert our_tokens == hf_tokens


@pytest.mark.parametrize(
    ("fixture", "attribute", "off"),
    [("gemma2_checkpoint", "attn_logit_softcapping", None), ("gpt_oss_checkpoint", "limit", 7.0)],
)
def test_the_reference_applies_gemma2s_score_cap_and_gpt_oss_clamp(fixture, attribute, off, request):
    """The transformers reference really soft-caps Gemma 2's attention scores and clamps gpt-oss's experts
    at the config's limit: turning either off changes its logits (neither did, on transformers 5.17's
    defaults, so match_transformers compared against another model)."""
    hf = hf_model(request.getfixturevalue(fixture))
    ids = list(range(5, 60))
    capped = hf_logits(hf, ids)
    modules = [m for m in hf.modules() if hasattr(m, attribute)]
    assert modules
    for module in modules:
        setattr(module, attribute, off)
    assert (hf_logits(hf, ids) - capped).abs().max() > 0.1


def test_cached_prefix_gives_the_same_logits_as_recomputing(llama):
    loaded, _ = llama
    model, pool = loaded.model, new_pool(loaded.config)
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    [first] = scattered_slots(pool, [len(ids)])
    full = extend(model, pool, [ids], [0], [first])
    # a second request shares the first 13 tokens: it reuses their slots and computes only the rest
    shared = 13
    [own] = scattered_slots(pool, [len(ids) - shared])
    slots = first[:shared] + own
    suffix = extend(model, pool, [ids[shared:]], [shared], [slots])
    torch.testing.assert_close(suffix, full[shared:], atol=ATOL, rtol=1e-4)


def test_chunked_prefill_matches_one_pass(llama):
    loaded, _ = llama
    model = loaded.model
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    pool = new_pool(loaded.config)
    [slots] = scattered_slots(pool, [len(ids)])
    whole = extend(model, pool, [ids], [0], [slots])
    pool = new_pool(loaded.config)
    [slots] = scattered_slots(pool, [len(ids)])
    cuts = [0, 7, 30, len(ids)]
    parts = [extend(model, pool, [ids[a:b]], [a], [slots]) for a, b in itertools.pairwise(cuts)]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=1e-4)
    last_only = extend(model, new_pool(loaded.config), [ids], [0], [slots], all_logits=False)
    torch.testing.assert_close(last_only, whole[-1:], atol=ATOL, rtol=1e-4)


def test_batch_matches_one_by_one(llama):
    loaded, _ = llama
    model, tok = loaded.model, loaded.tokenizer
    prompts = [tok.encode_prompt(p) for p in ("Hi", PROMPT, "The quick brown fox jumps over")]
    lengths = [len(p) for p in prompts]
    pool = new_pool(loaded.config)
    slots = scattered_slots(pool, [n + 3 for n in lengths])
    # batch: prefill all three (last logits per request), then three decode steps together
    batched = [extend(model, pool, prompts, [0, 0, 0], slots, all_logits=False)]
    for step in range(3):
        tokens = batched[-1].argmax(-1).tolist()
        batched.append(decode(model, pool, tokens, [n + step for n in lengths], slots))
    # one by one in a fresh pool
    for i, ids in enumerate(prompts):
        pool = new_pool(loaded.config)
        [own] = scattered_slots(pool, [lengths[i] + 3])
        logits = extend(model, pool, [ids], [0], [own], all_logits=False)
        torch.testing.assert_close(logits[0], batched[0][i], atol=ATOL, rtol=1e-4)
        for step in range(3):
            token = int(batched[step][i].argmax())
            logits = decode(model, pool, [token], [lengths[i] + step], [own])
            torch.testing.assert_close(logits[0], batched[step + 1][i], atol=ATOL, rtol=1e-4)


def test_every_layer_stores_new_kv_at_out_slots(llama):
    loaded, _ = llama
    pool = new_pool(loaded.config)
    ids = loaded.tokenizer.encode_prompt("Hello there")
    [slots] = scattered_slots(pool, [len(ids)])
    extend(loaded.model, pool, [ids], [0], [slots])
    written = torch.tensor(slots)
    untouched = torch.ones(pool.k_cache[0].shape[0], dtype=torch.bool)
    untouched[written] = False
    for layer in range(loaded.config.num_layers):
        assert pool.k_cache[layer][written].abs().sum(dim=(1, 2)).gt(0).all()
        assert pool.v_cache[layer][written].abs().sum(dim=(1, 2)).gt(0).all()
        assert pool.k_cache[layer][untouched].eq(0).all()


def test_config_reads_transformers_4_and_5_rope_fields(llama3_scaled_checkpoint):
    v5 = json.loads((llama3_scaled_checkpoint / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = v5["rope_parameters"]["rope_theta"]
    v4["rope_scaling"] = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    a, b = ModelConfig.from_hf(v5), ModelConfig.from_hf(v4)
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    unscaled = ModelConfig.from_hf({**v4, "rope_scaling": None})
    # llama3 scaling slows the low frequencies and keeps the high ones
    assert rope_inv_freq(a)[-1] < rope_inv_freq(unscaled)[-1]
    assert rope_inv_freq(a)[0] == rope_inv_freq(unscaled)[0]


QWEN_LIKE = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 2048,
             "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
             "rope_theta": 1000000.0, "max_position_embeddings": 32768}  # fmt: skip


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5 / Qwen3's advice
        {"rope_type": "yarn", "factor": 4.0},  # the pretraining context taken from max_position_embeddings
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
         "beta_slow": 2, "truncate": False},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.8},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16384, "attention_factor": 1.2},
    ],
)  # fmt: skip
def test_yarn_frequencies_attention_factor_and_context_are_transformers(scaling) -> None:
    """YaRN against transformers' own computation at a real model's sizes (head_dim 128, theta 1e6):
    the frequencies, the factor on cos and sin; the context served is factor x the pretraining one."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**QWEN_LIKE, "rope_scaling": scaling}
    ours = ModelConfig.from_hf(raw)
    theirs = transformers.Qwen2Config(**raw)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(ours).float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-9)
    original = scaling.get("original_max_position_embeddings", QWEN_LIKE["max_position_embeddings"])
    assert ours.max_context == max(QWEN_LIKE["max_position_embeddings"], int(original * scaling["factor"]))
    assert rope_attention_factor(ModelConfig.from_hf(QWEN_LIKE)) == 1.0


def test_rope_scaling_added_to_a_transformers_5_config_wins_over_its_rope_parameters() -> None:
    """transformers 5 writes rope_parameters (default RoPE and the base) into every config.json it saves, and
    Qwen's model cards turn YaRN on by adding rope_scaling: transformers reads rope_scaling, and so does the
    worker, the base kept from rope_parameters; Gemma 3's per-layer parameters take it on full attention."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    saved = {
        **QWEN_LIKE,
        "model_type": "qwen3",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    del saved["rope_theta"]
    ours = ModelConfig.from_hf({**saved, "rope_scaling": yarn})
    assert (ours.rope_scaling, ours.rope_theta, ours.max_context) == (yarn, 1e6, 4 * 32768)
    theirs = transformers.Qwen3Config(**{**saved, "rope_scaling": yarn, "rope_theta": 1e6}).rope_parameters
    assert theirs == {**yarn, "rope_theta": 1e6}
    assert ModelConfig.from_hf({**saved, "rope_scaling": {}}).rope_scaling is None
    linear = {"rope_type": "linear", "factor": 8.0}
    per_layer = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    gemma = ModelConfig.from_hf(
        {"model_type": "gemma3_text", "rope_parameters": per_layer, "rope_scaling": linear}
    )
    assert (gemma.rope_scaling, gemma.rope_theta, gemma.local_rope_theta) == (linear, 1e6, 1e4)
    theirs = transformers.Gemma3TextConfig(rope_parameters=per_layer, rope_scaling=linear).rope_parameters
    assert theirs["full_attention"] == {**linear, "rope_theta": 1e6}


def test_loader_rejects_what_it_cannot_run(llama_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="neither 'tiny' nor a local directory"):
        load_model(str(tmp_path / "missing"))
    cfg = json.loads((llama_checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_hf({**cfg, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}})
    # a checkpoint with a layer's weights missing
    broken = tmp_path / "broken"
    shutil.copytree(llama_checkpoint, broken)
    cfg["num_hidden_layers"] = 3
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.2\.self_attn\.q_proj\.weight, "):
        load_model(str(broken))
    for rope in ({"rope_type": "linear"}, {"rope_type": "llama3", "factor": 8.0}):  # parameters missing
        with pytest.raises(ValueError, match="needs numeric"):
            ModelConfig.from_hf({**cfg, "rope_parameters": rope})
    for partial in ({"partial_rotary_factor": 0.75}, {"rope_parameters": {"partial_rotary_factor": 0.5}}):
        with pytest.raises(ValueError, match="partial_rotary_factor"):  # Phi-4-mini's: part of each head
            ModelConfig.from_hf({**cfg, **partial})
    assert (
        ModelConfig.from_hf({**cfg, "rope_parameters": {"partial_rotary_factor": 1.0}}).rope_scaling is None
    )


def test_sliding_windows_apply_to_the_layers_transformers_applies_them_to() -> None:
    """Mistral and Phi-3 window every layer; Qwen2 only with use_sliding_window, from max_window_layers
    on, or where a transformers 5 config's layer_types says; the context is the model's whole context."""
    phi3 = ModelConfig.from_hf({**QWEN_LIKE, "model_type": "phi3", "max_position_embeddings": 4096,
                                "sliding_window": 2047})  # fmt: skip
    assert phi3.max_context == 4096 and [phi3.layer_window(i) for i in range(2)] == [2047, 2047]
    assert (
        ModelConfig.from_hf({**QWEN_LIKE, "model_type": "phi3", "sliding_window": None}).sliding_layers == ()
    )
    qwen = {**QWEN_LIKE, "sliding_window": 4096, "max_window_layers": 1, "num_hidden_layers": 3}
    assert ModelConfig.from_hf(qwen).sliding_layers == ()  # use_sliding_window is off
    windowed = ModelConfig.from_hf({**qwen, "use_sliding_window": True})
    assert windowed.max_context == 32768 and [windowed.layer_window(i) for i in range(3)] == [0, 4096, 4096]
    types = {**qwen, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    assert ModelConfig.from_hf(types).sliding_layers == (0, 2)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe"])
@pytest.mark.parametrize("bound", [0, 5, None])
def test_qwen_windows_without_layer_types_are_the_layers_transformers_configs_list(model_type, bound) -> None:
    """Configs without layer_types (transformers 4's): use_sliding_window windows Qwen2's and Qwen3's layers
    from max_window_layers on, Qwen2-MoE's even layers below it, 28 where a config leaves it out."""
    raw = {**QWEN_LIKE, "model_type": model_type, "num_hidden_layers": 32, "use_sliding_window": True,
           "sliding_window": 4096, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}  # fmt: skip
    if bound is not None:
        raw["max_window_layers"] = bound
    name = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen2_moe": "Qwen2MoeConfig"}[model_type]
    theirs = getattr(transformers, name)(**raw).layer_types
    sliding = ModelConfig.from_hf(raw).sliding_layers
    assert sliding == tuple(i for i, kind in enumerate(theirs) if kind == "sliding_attention")


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2", "mistral"])
def test_windows_without_layer_types_are_the_layers_transformers_configs_list(model_type) -> None:
    """A config without layer_types (hand-written, or saved before transformers wrote them): gpt-oss's even
    layers slide, as its config class fills them in (it loaded with no window at all, its logits wrong past
    the window)."""
    raw = {**QWEN_LIKE, "model_type": model_type, "num_hidden_layers": 5, "sliding_window": 128,
           "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 128}  # fmt: skip
    name = {"gpt_oss": "GptOssConfig", "gemma2": "Gemma2Config", "mistral": "MistralConfig"}[model_type]
    config = getattr(transformers, name)(**raw)
    theirs = getattr(config, "layer_types", None) or ["sliding_attention"] * 5  # Mistral: every layer
    ours = ModelConfig.from_hf(raw)
    assert ours.sliding_layers == tuple(i for i, kind in enumerate(theirs) if kind == "sliding_attention")
    assert ours.sliding_layers and ours.sliding_window == 128


@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
@pytest.mark.parametrize("place", ["none", "top_level", "both"])
def test_the_pretraining_context_of_scaled_rope_is_read_where_transformers_reads_it(rope_type, place) -> None:
    """llama3's original_max_position_embeddings was refused where the parameters leave it out (transformers
    takes max_position_embeddings), and a top-level one (Phi-3's place) wins over the parameters', as in
    transformers 5."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": rope_type, "factor": 8.0}
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if place == "both":
        scaling["original_max_position_embeddings"] = 2048
    raw = {**QWEN_LIKE, "model_type": "llama", "max_position_embeddings": 8192, "rope_scaling": scaling}
    if place != "none":
        raw["original_max_position_embeddings"] = 1024
    ours = ModelConfig.from_hf(raw)
    theirs = transformers.LlamaConfig(**raw)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](theirs, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(ours).float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-9)
    assert ours.rope_scaling["original_max_position_embeddings"] == (8192 if place == "none" else 1024)


def test_a_layer_type_other_than_full_or_sliding_attention_is_refused() -> None:
    """A linear-attention layer loaded as full attention, silently wrong."""
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\] are not supported"):
        ModelConfig.from_hf({**QWEN_LIKE, "layer_types": ["full_attention", "linear_attention"]})


def test_swish_is_silu() -> None:
    """transformers' ``swish`` is SiLU: such a config was refused as an unsupported activation."""
    assert ModelConfig.from_hf({**QWEN_LIKE, "hidden_act": "swish"}).mlp_activation == "silu"


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_qwen_mixtures_with_use_sliding_window_match_transformers(model_type, tmp_path) -> None:
    """Qwen3-MoE's attention windows every layer (transformers writes no layer_types for it), Qwen2-MoE's
    config the even layers below max_window_layers: both were windowed by Qwen2's rule (layers from it on)."""
    experts = {
        "qwen2_moe": {**QWEN2_MOE, "mlp_only_layers": []},
        "qwen3_moe": {**QWEN3_MOE, "num_hidden_layers": 3},
    }
    path = save_checkpoint(tmp_path, model_type, **experts[model_type], use_sliding_window=True, sliding_window=9,
                           max_window_layers=2)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types", None)  # NOTE: as transformers 4 saved Qwen2-MoE
    (path / "config.json").write_text(json.dumps(config))
    match_transformers(path, "cpu", ATOL)


def test_config_reads_gemma_as_released() -> None:
    """Gemma-3-1b-it's config.json (transformers 4 fields: rope_local_base_freq, sliding_window_pattern),
    a 4B-style image-and-text config whose text_config lists only what differs from the defaults, and a
    Gemma 2 config that leaves its soft-caps and alternating windows to the defaults."""
    one_b = ModelConfig.from_hf({
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
    })  # fmt: skip
    assert one_b.sliding_window == 512 and [i for i in range(26) if not one_b.layer_window(i)] == [
        5,
        11,
        17,
        23,
    ]
    assert (one_b.rope_theta, one_b.local_rope_theta, one_b.rope_scaling) == (1e6, 1e4, None)
    assert one_b.attention_multiplier == 256**-0.5 and one_b.embedding_multiplier == 1152**0.5
    assert one_b.tie_word_embeddings and one_b.norm_offset and one_b.mlp_activation == "gelu_tanh"
    assert one_b.final_logit_softcapping == 0.0 and one_b.qk_norm and not one_b.multimodal
    four_b = ModelConfig.from_hf({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})  # fmt: skip
    assert (four_b.num_heads, four_b.num_kv_heads, four_b.head_dim, four_b.vocab_size) == (8, 4, 256, 262208)
    assert four_b.rope_scaling == {"factor": 8.0, "rope_type": "linear"} and four_b.rope_theta == 1e6
    assert four_b.max_context == 131072 and four_b.eos_token_ids == [1, 106] and four_b.multimodal
    gemma2 = ModelConfig.from_hf({"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26,
                                  "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4})  # fmt: skip
    caps = (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.local_rope_theta)
    assert caps == (50, 30, None) and not gemma2.qk_norm
    assert gemma2.sliding_layers == tuple(range(0, 26, 2)) and gemma2.sliding_window == 4096
    assert (gemma2.vocab_size, gemma2.max_context, gemma2.rope_theta) == (256000, 8192, 1e4)
    uncapped = ModelConfig.from_hf(
        {"model_type": "gemma2", "attn_logit_softcapping": None, "sliding_window": None}
    )
    assert (uncapped.attn_logit_softcapping, uncapped.sliding_layers) == (
        0.0,
        (),
    )  # null: none, as transformers
    # Gemma 3's attention caps nothing whatever its config holds (transformers reads the key, uses it nowhere)
    capped = ModelConfig.from_hf({"model_type": "gemma3_text", "attn_logit_softcapping": 1.5})
    assert capped.attn_logit_softcapping == 0.0
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        ModelConfig.from_hf({**QWEN_LIKE, "model_type": "gemma"})


def test_a_gemma3_image_and_text_checkpoint_is_tied_as_its_top_level_config_says(
    gemma3_multimodal_checkpoint, tmp_path
):
    """transformers ties Gemma 3 4B+'s lm_head to its embeddings by the top level's tie_word_embeddings: a
    checkpoint with an lm_head of its own and tie_word_embeddings false there answers as transformers' does
    (its lm_head was skipped for the embeddings)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "untied"
    shutil.copytree(gemma3_multimodal_checkpoint, path)
    weights = load_file(str(path / "model.safetensors"))
    embed = weights["language_model.model.embed_tokens.weight"]
    weights["language_model.lm_head.weight"] = torch.randn(
        embed.shape, generator=torch.Generator().manual_seed(5)
    )
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert "tie_word_embeddings" not in config["text_config"]
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert not load_model(str(path)).config.tie_word_embeddings
    match_transformers(path, "cpu", ATOL)
    # no top-level key: Gemma3Config ties, whatever text_config says
    text_untied = {
        "model_type": "gemma3",
        "text_config": {**config["text_config"], "tie_word_embeddings": False},
    }
    assert ModelConfig.from_hf(text_untied).tie_word_embeddings


def test_gemma_scales_embeddings_by_sqrt_hidden_rounded_to_the_weights_dtype() -> None:
    """As transformers' Gemma3TextScaledWordEmbedding (and the original): sqrt(1152) = 33.94 is 34.0 in
    bf16, and that is the scale; in float32 it is sqrt(1152) itself. Granite's multiplier is taken as given."""
    gemma = ModelConfig(vocab_size=8, hidden_size=1152, intermediate_size=8, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=8, embedding_multiplier=1152**0.5, sandwich_norms=True,
                        norm_offset=True)  # fmt: skip
    assert LlamaForCausalLM(gemma, "cpu", torch.bfloat16).embedding_scale == 34.0
    assert LlamaForCausalLM(gemma, "cpu", torch.float32).embedding_scale == pytest.approx(1152**0.5, rel=1e-7)
    granite = dataclasses.replace(gemma, embedding_multiplier=12.3, sandwich_norms=False, norm_offset=False)
    assert LlamaForCausalLM(granite, "cpu", torch.bfloat16).embedding_scale == 12.3


def test_config_reads_smollm3_nope_layers_and_windows_as_transformers_does() -> None:
    """SmolLM3-3B as released: every 4th layer without RoPE (from no_rope_layer_interval when no list is
    given), no window unless use_sliding_window, and then on the NoPE layers."""
    smol = {**QWEN_LIKE, "model_type": "smollm3", "num_hidden_layers": 36, "sliding_window": None,
            "use_sliding_window": False, "no_rope_layer_interval": 4}  # fmt: skip
    config = ModelConfig.from_hf(smol)
    assert config.nope_layers == tuple(range(3, 36, 4)) and config.sliding_layers == ()
    listed = ModelConfig.from_hf({**smol, "no_rope_layers": [1, 0] * 18})
    assert listed.nope_layers == tuple(range(1, 36, 2))
    windowed = ModelConfig.from_hf({**smol, "use_sliding_window": True, "sliding_window": 4096})
    assert windowed.sliding_layers == config.nope_layers and windowed.sliding_window == 4096
    assert ModelConfig.from_hf({**smol, "sliding_window": 4096}).sliding_layers == ()


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_config_without_tie_word_embeddings_ties_as_its_transformers_class_does(model_type) -> None:
    """transformers 4 saves no tie_word_embeddings equal to the config class's default: where it is left out,
    each family ties as its class does (SmolLM3 and Gemma tie, the others do not)."""
    raw = {**QWEN_LIKE, "model_type": model_type, "num_experts": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 64}  # fmt: skip
    theirs = transformers.AutoConfig.for_model(model_type).tie_word_embeddings
    assert ModelConfig.from_hf(raw).tie_word_embeddings == theirs


def test_a_smollm3_checkpoint_saved_without_tie_word_embeddings_is_tied(smollm3_checkpoint, tmp_path) -> None:
    """SmolLM3's tied checkpoints hold no lm_head, and transformers 4 leaves the key out (its default):
    such a checkpoint loads tied and answers as transformers' (it was refused, lm_head.weight missing)."""
    path = tmp_path / "smollm3"
    shutil.copytree(smollm3_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    assert config.pop("tie_word_embeddings")
    (path / "config.json").write_text(json.dumps(config))
    match_transformers(path, "cpu", ATOL)


def test_config_reads_the_experts_of_each_mixture_kind() -> None:
    """Fields as the released configs spell them (Qwen3-30B-A3B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B)."""
    qwen3 = ModelConfig.from_hf({**QWEN_LIKE, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                                 "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                                 "mlp_only_layers": []})  # fmt: skip
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.moe_intermediate_size) == (128, 8, 768)
    assert qwen3.norm_topk_prob and qwen3.qk_norm and not qwen3.qkv_bias and qwen3.dense_layers == ()
    mixtral = ModelConfig.from_hf({**QWEN_LIKE, "model_type": "mixtral", "num_local_experts": 8,
                                   "num_experts_per_tok": 2, "intermediate_size": 14336, "sliding_window": None})  # fmt: skip
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 14336, True)
    qwen2 = ModelConfig.from_hf({**QWEN_LIKE, "model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
                                 "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                                 "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [5],
                                 "num_hidden_layers": 8})  # fmt: skip
    assert qwen2.qkv_bias and not qwen2.norm_topk_prob and qwen2.shared_expert_intermediate_size == 5632
    assert qwen2.dense_layers == (0, 2, 4, 5, 6)  # every second layer is sparse, but for layer 5
    assert [qwen2.is_sparse(i) for i in range(8)] == [False, True, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(
            {**QWEN_LIKE, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}
        )


@pytest.mark.parametrize(
    "model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared"]
)
def test_a_mixture_whose_experts_are_not_swiglu_is_refused_by_name(model_type) -> None:
    """transformers runs every expert under hidden_act; the experts here run SwiGLU, so a GeGLU mixture
    is refused at load (it served other logits). gpt-oss's experts ignore hidden_act, there as here."""
    moe = {**QWEN_LIKE, "model_type": model_type, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
    with pytest.raises(ValueError, match=f"'gelu_pytorch_tanh' is not supported on {model_type}'s experts"):
        ModelConfig.from_hf(moe)
    assert ModelConfig.from_hf({**moe, "hidden_act": "silu"}).num_experts == 8
    assert ModelConfig.from_hf({**moe, "model_type": "gpt_oss"}).expert_activation == "clamped_swiglu"


def test_a_mixtures_missing_or_extra_expert_is_named(mixtral_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(mixtral_checkpoint / "model.safetensors"))
    for name, change in (("missing", {"model.layers.1.block_sparse_moe.experts.3.w3.weight": None}),
                         ("extra", {"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)})):  # fmt: skip
        broken = tmp_path / name
        shutil.copytree(mixtral_checkpoint, broken)
        changed = {**weights, **change}
        save_file({k: v for k, v in changed.items() if v is not None}, str(broken / "model.safetensors"))
        with pytest.raises(ValueError) as err:
            load_model(str(broken))
        # NOTE: Mixtral's expert names are read as Qwen-MoE's (w3 is up_proj)
        assert {"missing": "missing weights: model.layers.1.mlp.experts.3.up_proj.weight",
                "extra": "unexpected weight 'model.layers.0.mlp.experts.4.gate_proj.weight'"}[name] in str(err.value)  # fmt: skip


def test_loader_returns_tokenizer_and_name(llama_checkpoint, qwen2_checkpoint):
    loaded = load_model(str(llama_checkpoint))
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.name == llama_checkpoint.name
    assert loaded.model.embed_tokens.dtype == torch.float32
    assert loaded.tokenizer.eos_token_ids == [4]
    assert loaded.tokenizer.encode_prompt("hi")[0] == 1  # llama adds BOS
    qwen = load_model(str(qwen2_checkpoint), dtype=torch.bfloat16)
    assert qwen.model.lm_head is qwen.model.embed_tokens  # tied
    assert qwen.model.embed_tokens.dtype == torch.bfloat16


def greedy(loaded, prompt: str, n: int) -> list[int]:
    ids = loaded.tokenizer.encode_prompt(prompt)
    pool = new_pool(loaded.config, num_pages=(len(ids) + n) // PAGE_SIZE + 2)
    [slots] = scattered_slots(pool, [len(ids) + n])
    logits = extend(loaded.model, pool, [ids], [0], [slots], all_logits=False)
    out: list[int] = []
    for step in range(n):
        out.append(int(logits.argmax()))
        logits = decode(loaded.model, pool, [out[-1]], [len(ids) + step], [slots])
    return out


def test_tiny_loads_the_same_weights_every_time_and_talks():
    a, b = load_model("tiny"), load_model("tiny")
    assert a.name == "tiny" and isinstance(a.tokenizer, ByteTokenizer)
    assert a.config.max_context >= 4096 and a.config.vocab_size == a.tokenizer.vocab_size
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    first = greedy(a, "Hello, how are you?", 32)
    assert first == greedy(b, "Hello, how are you?", 32)
    assert len(set(first)) >= 5  # not one byte repeated
    assert greedy(a, "Tell me a story.", 32) != first


def test_model_rejects_wrong_weight_shapes():
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4, max_position_embeddings=16)  # fmt: skip
    model = LlamaForCausalLM(config, "cpu", torch.float32)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.embed_tokens.weight", torch.zeros(11, 8))])
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.self_attn.q_proj.bias", torch.zeros(8))])


def test_a_repeated_weight_cannot_hide_a_missing_one():
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4, max_position_embeddings=16)  # fmt: skip
    model = LlamaForCausalLM(config, "cpu", torch.float32)
    weights = [(name, torch.zeros(model.weight_slot(name).shape)) for name in model._weight_names()]
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    v_proj = "model.layers.0.self_attn.v_proj.weight"
    without_k = [(n, t) for n, t in weights if n != k_proj]
    with pytest.raises(ValueError, match=f"missing weights: {re.escape(k_proj)}$"):
        model.load_weights(without_k)
    with pytest.raises(
        ValueError, match=re.escape(f"{v_proj!r} appears twice")
    ):  # same size as k here: counts agree
        model.load_weights([*without_k, (v_proj, torch.zeros(4, 8))])
    model.load_weights(weights)  # all of them, once: loads


@pytest.mark.parametrize("window", [0, 1, 6, 20], ids=["full", "w1", "w6", "w20"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cpu_extend_attention_matches_the_reference(group, window):
    """Ragged batch: cached prefixes of 0 to 40 tokens, new tokens 0 to 33, GQA 1/4/8; sliding windows
    of one key, under a request's new tokens, and across its prefix and new tokens."""
    from kernels import reference
    from worker import attention

    gen = torch.Generator().manual_seed(group)
    hkv, d, pool = 2, 16, 128
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, d, generator=gen)
    shapes = [(0, 5), (3, 1), (40, 33), (17, 0), (16, 16), (0, 1)]  # (prefix, new) per request
    perm = torch.randperm(pool, generator=gen).tolist()
    prefixes = []
    for p, _ in shapes:
        prefixes.append(perm[:p])
        perm = perm[p:]
    t = sum(n for _, n in shapes)
    q = torch.randn(t, hkv * group, d, generator=gen)
    k_new, v_new = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    batch = ForwardBatch.build(
        "extend", [[0] * n for _, n in shapes], [p for p, _ in shapes],
        [list(range(n)) for _, n in shapes], prefixes,
    )  # fmt: skip
    ours = attention.extend(q, k_new, v_new, k_cache, v_cache, batch, 0.3, window)
    ref = reference.extend_attention(
        q, k_new, v_new, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, 0.3,
        window=window,
    )  # fmt: skip
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_cpu_short_extends_batched_match_the_reference(group):
    """Verify steps and small chunks (at most 16 new tokens each) run as padded batches reading the
    new K/V from the pool: prefixes of 0 to 300 tokens (two length groups), 0 to 16 new tokens."""
    from kernels import reference
    from worker import attention

    gen = torch.Generator().manual_seed(group)
    hkv, d, pool = 2, 16, 1024
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, d, generator=gen)
    shapes = [(0, 3), (10, 1), (7, 5), (33, 16), (300, 5), (290, 0), (1, 2)]  # (prefix, new)
    perm = torch.randperm(pool, generator=gen).tolist()
    prefixes, outs = [], []
    for p, n in shapes:
        prefixes.append(perm[:p])
        outs.append(perm[p : p + n])
        perm = perm[p + n :]
    t = sum(n for _, n in shapes)
    q = torch.randn(t, hkv * group, d, generator=gen)
    k_new, v_new = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    batch = ForwardBatch.build("extend", [[0] * n for _, n in shapes], [p for p, _ in shapes], outs, prefixes)
    ref = reference.extend_attention(
        q, k_new, v_new, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, 0.3
    )
    reference.store_kv(k_cache, v_cache, batch.out_slots, k_new, v_new)  # as the model does first
    assert len(attention.decode_groups([p + n for p, n in shapes], 0)) > 1
    torch.testing.assert_close(attention.extend(q, k_new, v_new, k_cache, v_cache, batch, 0.3), ref,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(
        attention.extend_short(q, k_cache, v_cache, batch, 0.3), ref, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("window", [0, 1, 8], ids=["full", "w1", "w8"])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_cpu_batched_decode_attention_matches_the_reference(group, window):
    """Lengths 1 to 40 in one batch: several length groups, some with more than one request; sliding
    windows of one key and of 8 (most requests longer)."""
    from kernels import reference
    from worker import attention

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(128, 2, 8, generator=gen), torch.randn(128, 2, 8, generator=gen)
    lengths = [1, 7, 20, 12, 9, 40, 2]
    assert len(attention.length_groups(lengths)) == 3  # [1, 2], [7, 9, 12], [20, 40]
    q = torch.randn(len(lengths), 2 * group, 8, generator=gen)
    indices = torch.randperm(128, generator=gen)[: sum(lengths)].tolist()
    bounds = list(itertools.accumulate(lengths, initial=0))
    batch = ForwardBatch.build(
        "decode", [[0]] * len(lengths), [n - 1 for n in lengths], [[0]] * len(lengths),
        [indices[a:b] for a, b in itertools.pairwise(bounds)],
    )  # fmt: skip
    ours = attention.decode(q, k_cache, v_cache, batch, 0.3, window)  # too little padding to split: one group
    ref = reference.decode_attention(
        q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, 0.3, window=window
    )
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    grouped = attention.decode_grouped(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, 0.3, 0, window)
    torch.testing.assert_close(grouped, ref, atol=1e-5, rtol=1e-5)


def test_cpu_decode_of_no_requests_is_empty_as_the_references():
    from kernels import reference
    from worker import attention

    q, cache = torch.empty(0, 4, 8), torch.randn(16, 2, 8)
    indptr, indices = torch.zeros(1, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    want = reference.decode_attention(q, cache, cache, indptr, indices, 0.3)
    got = attention.decode_grouped(q, cache, cache, indptr, indices, 0.3)
    assert got.shape == want.shape == (0, 4, 8)


def test_length_groups_keep_each_groups_longest_within_twice_its_shortest():
    from worker.attention import length_groups

    lengths = [300, 5, 9, 600, 10, 11, 4000, 1, 2]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each request once
    assert [[lengths[i] for i in g] for g in groups] == [[1, 2], [5, 9, 10], [11], [300, 600], [4000]]
    assert length_groups([]) == [] and length_groups([7, 7, 7]) == [[0, 1, 2]]


def test_decode_groups_split_only_when_the_padding_saved_pays_for_the_extra_calls():
    from worker.attention import decode_groups

    one_long = [4000] + [200] * 31  # one padded: 128,000 slots; two groups: 10,200
    assert decode_groups(one_long) == [list(range(1, 32)), [0]]
    short = [1, 7, 20, 12, 9, 40, 2]  # 280 slots padded: not worth 2 extra calls
    assert decode_groups(short) == [list(range(7))]
    assert len(decode_groups(short, min_saved_slots=0)) == 3


def test_extend_batches_know_their_longest_cached_prefix():
    """The hint the extend kernel picks its tiles by: from per-request lists, from a scheduled step,
    across devices and to the other tensor-parallel ranks; decode batches have none."""
    from worker.request import ScheduledBatch
    from worker.tensor_parallel import step_batch, step_message

    batch = ForwardBatch.build("extend", [[1, 2], [3], [4]], [5, 0, 2], [[10, 11], [12], [13]],
                               [[0, 1, 2, 3, 4], [], [5, 6]])  # fmt: skip
    assert batch.max_prefix_len == 5 and batch.to("cpu").max_prefix_len == 5
    assert step_batch(step_message(batch), torch.device("cpu"), None).max_prefix_len == 5
    assert ForwardBatch.build("decode", [[1]], [3], [[3]], [[0, 1, 2, 3]]).max_prefix_len is None

    def step(mode: str, kv_lens: list[int]) -> ScheduledBatch:
        n = len(kv_lens)
        return ScheduledBatch(
            mode=mode, requests=[], starts=[0] * n, ends=[1] * n, sample=[True] * n,
            input_ids=np.zeros(n, np.int64), positions=np.zeros(n, np.int64), out_slots=np.arange(n),
            qo_indptr=np.arange(n + 1, dtype=np.int32),
            kv_indptr=np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32),
            kv_indices=np.arange(sum(kv_lens), dtype=np.int64),
        )  # fmt: skip

    assert step("extend", [5, 0, 7]).max_prefix_tokens == 7
    assert ForwardBatch.from_step(step("extend", [5, 0, 7]), "cpu").max_prefix_len == 7
    assert ForwardBatch.from_step(step("verify", [9, 2]), "cpu").max_prefix_len == 9
    assert ForwardBatch.from_step(step("decode", [4, 6]), "cpu").max_prefix_len is None


def test_token_ids_are_bounded_by_the_models_vocabulary_not_the_tokenizers(tmp_path):
    """A tokenizer may name tokens past the embedding (Gemma 3's <image_soft_token>, Code Llama's
    infill tokens): the checkpoint loads and only a prompt holding one is refused. An embedding may
    be wider than the tokenizer (Qwen's padding): its ids are valid prompt ids, as the model makes them."""
    import httpx
    from tokenizers import Tokenizer

    from tests.worker.test_server import serve

    extra = save_checkpoint(tmp_path / "extra", "llama")
    tok = Tokenizer.from_file(str(extra / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    tok.add_special_tokens(["<image_soft_token>"])
    tok.save(str(extra / "tokenizer.json"))
    assert load_model(str(extra)).config.vocab_size == vocab  # it was refused
    with (
        serve(model=str(extra), kv_cache_tokens=2048) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        body = {"max_tokens": 4, "temperature": 0}
        for bad in ({"prompt": "see <image_soft_token> here"}, {"prompt": [1, 5, vocab]},
                    {"messages": [{"role": "user", "content": "<image_soft_token>"}]},
                    {"prompt": "hi", "logit_bias": {str(vocab): 5}}):  # fmt: skip
            path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
            r = c.post(path, json={**body, **bad})
            assert r.status_code == 400 and str(vocab) in r.json()["error"]["message"], r.text
        guided = c.post("/v1/completions", json={**body, "prompt": "hi", "regex": "[a-z]+"})
        assert guided.status_code == 200 and guided.json()["choices"][0]["text"].isalpha()
        assert c.post("/v1/completions", json={**body, "prompt": [1, 5, vocab - 1]}).status_code == 200
    padded = save_checkpoint(tmp_path / "padded", "llama", vocab_size=vocab + 64)
    with (
        serve(model=str(padded), kv_cache_tokens=2048) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        past = vocab + 30  # an id the tokenizer does not name, which the model may sample
        made = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {str(past): 100},
                                               "return_token_ids": True})  # fmt: skip
        assert made.status_code == 200 and made.json()["choices"][0]["token_ids"] == [past, past], made.text
        r = c.post(
            "/v1/completions", json={"prompt": [1, 5, past], "max_tokens": 2, "allowed_token_ids": [past]}
        )
        assert r.status_code == 200, r.text
        assert c.post("/detokenize", json={"tokens": [5, past]}).status_code == 200
