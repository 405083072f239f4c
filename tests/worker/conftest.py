"""Small random HF checkpoints (transformers models saved with save_pretrained) plus a tokenizer.

Session-scoped so every worker test can reuse them; each fixture returns the directory path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Cache-aware routing sends shared prefixes to the worker that already holds them.",
    "You are a helpful assistant. Answer briefly and accurately.",
    "Paged attention stores keys and values in fixed-size pages of tokens.",
    "Héllo wörld — naïve café, 東京, emoji 🙂 and numbers 0123456789.",
]


def write_tokenizer(directory: Path, add_bos: bool = True) -> int:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json with a chat template); returns
    its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def save_checkpoint(directory: Path, model_type: str, max_shard_size: str | None = None, **overrides) -> Path:
    """A tiny random transformers model of ``model_type`` ("llama", "qwen2", "qwen3", "phi3", "granite",
    "mistral", "ministral", "smollm3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe",
    "granitemoeshared" or "gpt_oss") saved as safetensors."""
    import torch
    import transformers

    vocab = write_tokenizer(directory, add_bos=model_type == "llama")
    common = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,  # large enough that logits differ clearly between tokens
        "bos_token_id": 1,
        "eos_token_id": 4,
    }
    common.update(overrides)
    if model_type == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif model_type == "granite":
        config = transformers.GraniteConfig(**common)
        cls = transformers.GraniteForCausalLM
    elif model_type == "phi3":  # NOTE: fused qkv_proj and gate_up_proj; its default pad id is past the vocab
        config = transformers.Phi3Config(**{"pad_token_id": None, **common})
        cls = transformers.Phi3ForCausalLM
    elif model_type == "gemma2":
        config = transformers.Gemma2Config(**common)
        cls = transformers.Gemma2ForCausalLM
    elif model_type == "gemma3_text":
        config = transformers.Gemma3TextConfig(**common)
        cls = transformers.Gemma3ForCausalLM
    elif model_type in ("mistral", "ministral", "smollm3"):
        name = {"mistral": "Mistral", "ministral": "Ministral", "smollm3": "SmolLM3"}[model_type]
        config = getattr(transformers, f"{name}Config")(**common)
        cls = getattr(transformers, f"{name}ForCausalLM")
    elif model_type == "gpt_oss":
        config = transformers.GptOssConfig(**common)
        cls = transformers.GptOssForCausalLM
    elif model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared"):
        name = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "granitemoe": "GraniteMoe",
                "granitemoeshared": "GraniteMoeShared"}[model_type]  # fmt: skip
        config = getattr(transformers, f"{name}Config")(**common)
        cls = getattr(transformers, f"{name}ForCausalLM")
    else:
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).float().eval()
    with (
        torch.no_grad()
    ):  # NOTE: transformers starts norms at 1: a norm loaded in the wrong place would not show
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            if model_type == "gemma3_text" and name.endswith(
                "norm.weight"
            ):  # NOTE: Gemma's start at 0 (scale 1)
                param.uniform_(-0.5, 0.5)
            if name.endswith(("_proj_bias", "sinks")):  # NOTE: gpt-oss starts its experts' biases at 0
                param.uniform_(-1.0, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with GQA (4 heads, 2 KV heads), untied embeddings, BOS added to prompts."""
    return save_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: q/k/v biases, tied embeddings, no BOS."""
    return save_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3: q/k RMSNorm per head, head_dim 32 (heads x head_dim != hidden size), tied embeddings."""
    return save_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama3_scaled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3 style: rope_theta 500000 with llama3 rope scaling, head_dim 32."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return save_checkpoint(
        tmp_path_factory.mktemp("llama3"),
        "llama",
        rope_scaling=scaling,
        rope_theta=500000.0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )


@pytest.fixture(scope="session")
def phi3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj)."""
    return save_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


# Granite 3's scalars, of its sizes' kind (attention_multiplier replaces 1/sqrt(head_dim) = 1/4 here)
GRANITE = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
           "logits_scaling": 8.0, "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="session")
def granite_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite 3: Llama with multipliers on the embeddings, residual branches, scores and logits."""
    return save_checkpoint(tmp_path_factory.mktemp("granite"), "granite", **GRANITE)


@pytest.fixture(scope="session")
def yarn_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with YaRN rope scaling (as Qwen2.5 / Qwen3 turn on long contexts): factor 4 over a
    32-token pretraining context, so every prompt of the tests runs past it."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    return save_checkpoint(tmp_path_factory.mktemp("yarn"), "qwen2", rope_scaling=scaling)


# Mixtral: 4 experts of 96 units, 2 a token (weights renormalized), saved as block_sparse_moe.*
MIXTRAL = {"intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
# Qwen2-MoE: 6 experts of 32 units, 2 a token (weights not renormalized), a shared expert of 48 under a
# sigmoid gate, q/k/v biases; layer 1 of 3 is a dense MLP of 128 units (mlp_only_layers)
QWEN2_MOE = {"num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}  # fmt: skip
# Qwen3-MoE: 8 experts of 32 units, 3 a token (weights renormalized), q/k norms, head_dim 32
QWEN3_MOE = {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
             "norm_topk_prob": True}  # fmt: skip


@pytest.fixture(scope="session")
def mistral_window_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with a sliding window of 12 tokens on every layer: the tests' prompts run far past it."""
    return save_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=12)


@pytest.fixture(scope="session")
def ministral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ministral: Mistral with windows interleaved (layer_types): layers 0 and 2 of 3 slide over 10 tokens."""
    return save_checkpoint(tmp_path_factory.mktemp("ministral"), "ministral", num_hidden_layers=3, sliding_window=10, head_dim=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip


@pytest.fixture(scope="session")
def smollm3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM3: every second layer of 4 without RoPE (NoPE), and those slide over 10 tokens."""
    return save_checkpoint(tmp_path_factory.mktemp("smollm3"), "smollm3", num_hidden_layers=4, no_rope_layer_interval=2,
                           use_sliding_window=True, sliding_window=10, tie_word_embeddings=True, pad_token_id=None)  # fmt: skip


@pytest.fixture(scope="session")
def qwen2_window_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with use_sliding_window: a window of 9 tokens on layers 1 and 2 of 3 (max_window_layers 1)."""
    return save_checkpoint(tmp_path_factory.mktemp("qwen2_window"), "qwen2", num_hidden_layers=3,
                           use_sliding_window=True, sliding_window=9, max_window_layers=1)  # fmt: skip


# Gemma 3: 3 layers, sliding (8 tokens, RoPE base 10^4), full (base 10^6, linear x2), sliding; head_dim 32
# with queries scaled by 24^-1/2; GeGLU; four norms a layer stored as offsets from 1; logits soft-capped
GEMMA3 = {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          "final_logit_softcapping": 3.0, "tie_word_embeddings": True}  # fmt: skip


# Gemma 2: 3 layers alternating sliding (8 tokens) and full, attention scores soft-capped at 2 (so the cap
# bites at these sizes) and logits at 3; head_dim 32 with queries scaled by 24^-1/2
GEMMA2 = {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}  # fmt: skip


@pytest.fixture(scope="session")
def gemma2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2", **GEMMA2)


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3_text", **GEMMA3)


@pytest.fixture(scope="session")
def gemma3_multimodal_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 4B+'s layout: image and text (Gemma3ForConditionalGeneration), its text_config listing only
    what differs from Gemma3TextConfig's defaults, its weights under language_model.* beside a vision tower."""
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("gemma3_mm")
    vocab = write_tokenizer(directory)
    text = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
            "sliding_window_pattern": 2, "max_position_embeddings": 256}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(1234)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            elif "language_model" in name and param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    cfg = json.loads((directory / "config.json").read_text())
    # NOTE: as the released configs list them: the defaults left out of text_config
    cfg["text_config"] = {
        k: v for k, v in cfg["text_config"].items() if k in text and k != "sliding_window_pattern"
    }
    cfg["text_config"]["sliding_window_pattern"] = 2
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.fixture(scope="session")
def gemma3_multimodal_new_names_checkpoint(
    gemma3_multimodal_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The same weights under the names transformers 4.52+ saves: model.language_model.*, lm_head.*,
    model.vision_tower.*, model.multi_modal_projector.*."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("gemma3_mm_new")
    shutil.copytree(gemma3_multimodal_checkpoint, directory, dirs_exist_ok=True)

    def renamed(name: str) -> str:
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return name.removeprefix("language_model.") if name.startswith("language_model.") else "model." + name

    weights = load_file(str(directory / "model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in weights)
    save_file({renamed(n): t for n, t in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return directory


# Granite 3 MoE: Granite's scalars, 4 experts of 48 units (stacked input_linear / output_linear), 2 a token;
# the shared kind adds an ungated shared expert of 40 units
GRANITE_MOE = {**GRANITE, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}


# gpt-oss: 4 experts of 48 units, 2 a token, a clamp low enough to bite at these weights' scale; YaRN over a
# 32-token pretraining context (as the model's own over 4,096), a 12-token window on its first layer
GPT_OSS = {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
           "sliding_window": 12, "swiglu_limit": 1.5,
           "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0}}  # fmt: skip


@pytest.fixture(scope="session")
def gpt_oss_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss: attention sinks, q/k/v/o biases, a biased router and biased experts under a clamped SwiGLU,
    its stacked [E, in, out] experts with gate and up interleaved."""
    return save_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", **GPT_OSS)


@pytest.fixture(scope="session")
def granitemoe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("granitemoe"), "granitemoe", **GRANITE_MOE)


@pytest.fixture(scope="session")
def granitemoeshared_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("granitemoeshared"), "granitemoeshared", **GRANITE_MOE,
                           shared_intermediate_size=40)  # fmt: skip


@pytest.fixture(scope="session")
def mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral", **MIXTRAL)


@pytest.fixture(scope="session")
def qwen2_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", **QWEN2_MOE)


@pytest.fixture(scope="session")
def qwen3_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", **QWEN3_MOE)


@pytest.fixture(scope="session")
def sharded_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama fixture's architecture split over several safetensors shards (with an index)."""
    return save_checkpoint(tmp_path_factory.mktemp("sharded"), "llama", max_shard_size="100KB")


TOOL_TAGS = ("<tool_call>", "</tool_call>")


def save_tool_tag_checkpoint(
    directory: Path, special: bool, tags: tuple[str, ...] = TOOL_TAGS, chat_template: str | None = None
) -> Path:
    """The llama checkpoint with ``tags`` (hermes' ``<tool_call>`` and ``</tool_call>`` unless told)
    added to its tokenizer (the vocabulary's last ids): special tokens (as Hermes 2 Pro has them) or
    not (Qwen 2.5 / 3); with ``chat_template`` in place of the tokenizer's."""
    from tokenizers import AddedToken, Tokenizer

    vocab = write_tokenizer(directory)
    # NOTE: a template of its own writes the tools' JSON into the prompt: more than the usual 256 positions
    longer = {"max_position_embeddings": 1024} if chat_template else {}
    save_checkpoint(directory, "llama", vocab_size=vocab + len(tags), **longer)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    added = [AddedToken(tag, special=special, normalized=False) for tag in tags]
    assert (tok.add_special_tokens if special else tok.add_tokens)(added) == len(tags)
    tok.save(str(directory / "tokenizer.json"))
    if chat_template:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# Mistral's tool turns as its templates write them, with their check on call ids (9 letters and digits)
MISTRAL_TOOLS_TEMPLATE = (
    "{%- macro check(id) -%}{%- if not (id is string and id|length == 9 and id.isalnum()) -%}"
    "{{ raise_exception('tool call ids must be 9 letters and digits') }}{%- endif -%}{%- endmacro -%}"
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}[TOOL_CALLS][{% for c in m['tool_calls'] %}"
    "{{ check(c['id']) }}"
    '{"name": {{ c["function"]["name"]|tojson }}, "arguments": {{ c["function"]["arguments"]|tojson }}, '
    '"id": {{ c["id"]|tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}'
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}{{ check(m['tool_call_id']) }}"
    '[TOOL_RESULTS]{"content": {{ m["content"]|tojson }}, "call_id": {{ m["tool_call_id"]|tojson }}}[/TOOL_RESULTS]'
    "{% endif %}{% endfor %}"
)


def save_mistral_tools_checkpoint(directory: Path, tags: tuple[str, ...]) -> Path:
    """The llama checkpoint with Mistral's tool tags ``tags`` as special tokens (``[TOOL_CALLS]`` alone
    as Mistral 7B v0.3 has it, or with ``[ARGS]`` and ``[CALL_ID]`` as Mistral Small 3.1+ have them)
    and a chat template that renders tool turns as Mistral's do."""
    return save_tool_tag_checkpoint(directory, True, tags, MISTRAL_TOOLS_TEMPLATE)


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def save_sentencepiece_checkpoint(directory: Path) -> Path:
    """The llama checkpoint with a Llama 2 / Mistral style tokenizer: "▁" prepended to the text and
    standing for spaces, BPE pieces trained on the corpus, every other character as byte-fallback
    ``<0xNN>`` tokens, a decoder that strips the leading space; a Mistral-like chat template."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; the 256 byte pieces follow
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)], show_progress=False
    )
    # NOTE: trained on pre-split words ("▁word") so no piece spans two words, then rebuilt whole
    words = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    words.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    words.train_from_iterator(["▁" + s.replace(" ", "▁") for s in _CORPUS] * 4, trainer=trainer)
    trained = json.loads(words.to_str())["model"]
    tok = Tokenizer(models.BPE(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    save_checkpoint(directory, "llama", vocab_size=tok.get_vocab_size(), bos_token_id=1, eos_token_id=2)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "chat_template": MISTRAL_TEMPLATE, "tokenizer_class": "LlamaTokenizerFast"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="session")
def sentencepiece_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 2 / Mistral style: SentencePiece-like tokenizer with byte fallback, BOS added."""
    return save_sentencepiece_checkpoint(tmp_path_factory.mktemp("sentencepiece"))
