"""Prompt tokenizers (contract 2): byte mode, HF tokenizer.json + chat template (checked against
transformers), message validation, and streaming detokenization."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.chat_tools import call_arguments
from router.detokenizer import IncrementalDetokenizer
from router.tokenization import (
    ByteTokenizer,
    HFTokenizer,
    chat_options,
    load_tokenizer,
    normalize_messages,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.index0 == 0 and m['role'] == 'assistant' %}{{ raise_exception('must start with a user') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Héllo 🙂"}, {"type": "text", "text": "twice"}]},
]
SAMPLE_TEXTS = [
    "Hello world, the quick brown fox.",
    "naïve café 東京 🙂 done",
    " leading and  double  spaces ",
]


def byte_level_dir(directory: Path, generation_eos: list[int] | None = None) -> Path:
    """GPT-2 style byte-level BPE with BOS added by the post-processor (like Llama 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE_TEXTS * 3, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "<|im_end|>",
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


def sentencepiece_dir(directory: Path) -> Path:
    """Llama-2 style: Metaspace pieces, byte fallback for anything outside the vocabulary, and a
    decoder that strips the leading space of a decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzTH", "▁t", "he", "▁the", "▁a", "in", "▁in"]
    vocab |= {p: len(vocab) + i for i, p in enumerate(dict.fromkeys(pieces))}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "in")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return byte_level_dir(tmp_path_factory.mktemp("bytelevel"), generation_eos=[2, 0])


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    return sentencepiece_dir(tmp_path_factory.mktemp("sentencepiece"))


# ---- bytes -------------------------------------------------------------------------------------


def test_byte_tokenizer_ids_are_utf8_bytes():
    tok = ByteTokenizer()
    assert tok.name == "bytes" and tok.vocab_size == 257 and tok.eos_token_ids == [256]
    assert tok.encode_prompt("hé") == [104, 0xC3, 0xA9]
    assert tok.decode([*tok.encode_prompt("naïve 🙂"), 256]) == "naïve 🙂"
    assert tok.decode([104, 256], skip_special_tokens=False) == "h<|eos|>"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_byte_chat_template_is_fixed_and_plain():
    tok = ByteTokenizer()
    text = "<|system|>\nYou are terse.\n<|user|>\nHéllo 🙂\ntwice\n<|assistant|>\n"
    assert tok.render_chat(CHAT) == text
    assert tok.encode_chat(CHAT) == list(text.encode("utf-8"))
    assert load_tokenizer("bytes").encode_chat(CHAT) == tok.encode_chat(CHAT)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hi", "non-empty list"),
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\].role"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\].role"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"role": "user", "content": None}], "content must be"),
        ([{"role": "user", "content": 5}], "content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text'} part"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\].text"),
    ],
)
def test_invalid_messages_raise_clear_errors(messages, message):
    with pytest.raises(ValueError, match=message):
        ByteTokenizer().encode_chat(messages)


@pytest.mark.parametrize(
    "arguments",
    ["not json", "[" * 100_000 + "]" * 100_000, '{"a": ' + "9" * 5000 + "}"],
    ids=["text", "nested", "digits"],
)  # NOTE: nested past the parser's stack; an integer past Python's 4,300 digits
def test_tool_call_arguments_that_do_not_parse_stay_the_string_sent(arguments):
    assert call_arguments({"function": {"name": "f", "arguments": arguments}}) == arguments
    assert call_arguments({"function": {"name": "f", "arguments": '{"a": [1]}'}}) == {"a": [1]}


def test_assistant_content_may_be_null():
    out = normalize_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])
    assert out[1]["content"] == ""


def test_keys_sent_as_null_are_left_out_as_transformers_leaves_them_out(hf_dir, tmp_path):
    """A history of OpenAI's message objects carries ``"tool_calls": null`` (and ``name``, ``refusal``...):
    templates that test ``'tool_calls' in message`` or its length took it for calls (Llama 3.1's raised a
    400, Mistral's "roles must alternate")."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls is defined %}{{ m.tool_calls | length }} calls"
        "{% else %}{{ m.content }}{% endif %}{% if m.name is defined %} ({{ m.name }}){% endif %}{% endfor %}"
    )
    tok = with_template(hf_dir, tmp_path / "nulls", template)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "nulls"))
    chat = [{"role": "user", "content": "Hi", "name": None},
            {"role": "assistant", "content": "Hello.", "tool_calls": None, "refusal": None},
            {"role": "user", "content": "Again"}]  # fmt: skip
    assert normalize_messages(chat)[1] == {"role": "assistant", "content": "Hello."}
    want = theirs.apply_chat_template(chat, tokenize=False)
    assert want == "<user>Hi<assistant>Hello.<user>Again" and tok.render_chat(chat) == want


# ---- HF tokenizer.json + chat template ---------------------------------------------------------


def test_hf_tokenizer_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer(str(hf_dir)), AutoTokenizer.from_pretrained(hf_dir)
    long = " ".join(SAMPLE_TEXTS) * (20_000 // len(" ".join(SAMPLE_TEXTS)) + 1)  # encoded as a batch of one
    for text in [*SAMPLE_TEXTS, long]:
        assert ours.encode_prompt(text) == theirs(text).input_ids
        assert ours.encode_prompt(text)[0] == 0  # BOS from the post-processor
    assert ours.encode_text(long) == theirs(long, add_special_tokens=False).input_ids
    flat = normalize_messages(CHAT)
    rendered = theirs.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(CHAT) == rendered
    assert ours.encode_chat(CHAT) == theirs(rendered, add_special_tokens=False).input_ids
    ids = ours.encode_chat(CHAT)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_continue_final_message_and_no_generation_prompt_match_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer(str(hf_dir)), AutoTokenizer.from_pretrained(hf_dir)
    prefill = [*normalize_messages(CHAT), {"role": "assistant", "content": 'Sure: {"answer": '}]
    expected = theirs.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert ours.render_chat(prefill, **chat_options({"continue_final_message": True})) == expected
    assert expected.endswith('{"answer": ')
    no_prompt = theirs.apply_chat_template(
        normalize_messages(CHAT), add_generation_prompt=False, tokenize=False
    )
    assert ours.render_chat(CHAT, **chat_options({"add_generation_prompt": False})) == no_prompt
    byte = ByteTokenizer().render_chat(prefill, **chat_options({"continue_final_message": True}))
    assert byte.endswith('<|assistant|>\nSure: {"answer": ')
    for bad in (
        {"continue_final_message": True, "add_generation_prompt": True},
        {"add_generation_prompt": "no"},
    ):
        with pytest.raises(ValueError):
            chat_options(bad)
    for tok in (ours, ByteTokenizer()):
        with pytest.raises(ValueError, match="assistant"):
            tok.encode_chat(
                CHAT, **chat_options({"continue_final_message": True})
            )  # last message: the user's


def with_template(hf_dir: Path, directory: Path, template: str) -> HFTokenizer:
    """The byte-level tokenizer with another chat template (chat_template.jinja takes precedence)."""
    import shutil

    shutil.copytree(hf_dir, directory)
    (directory / "chat_template.jinja").write_text(template)
    return HFTokenizer(str(directory))


LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template", [TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE], ids=["chatml", "llama3", "mistral"]
)
@pytest.mark.parametrize("prefill", ["<", "<|", "im", "e", "Sure: "])
def test_a_short_prefill_is_continued_where_transformers_cuts(hf_dir, tmp_path, template, prefill):
    """A prefill that also occurs in the end of turn the template writes after it ("<" before
    "<|eot_id|>", "im" before "<|im_end|>") is cut right after the prefill, as HF cuts it."""
    from transformers import AutoTokenizer

    ours, theirs = with_template(hf_dir, tmp_path / "t", template), AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "Answer in XML"}, {"role": "assistant", "content": prefill}]
    expected = theirs.apply_chat_template(
        messages, chat_template=template, continue_final_message=True, tokenize=False
    )
    assert ours.render_chat(messages, **chat_options({"continue_final_message": True})) == expected
    assert expected.rstrip().endswith(prefill.strip())


def test_generation_blocks_render_their_body_as_transformers_does(hf_dir, tmp_path):
    """TRL assistant_only_loss templates wrap the assistant's turns in {% generation %} blocks (HF's
    AssistantTracker): they are accepted and render their body, scope included, unchanged."""
    from transformers import AutoTokenizer

    template = (
        "{{ bos_token }}{% set n = 0 %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{% set n = 1 %}{{ m['content'] }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{{ n }}{% endif %}"
    )
    ours, theirs = with_template(hf_dir, tmp_path / "t", template), AutoTokenizer.from_pretrained(hf_dir)
    messages = [
        *normalize_messages(CHAT),
        {"role": "assistant", "content": "naïve 🙂"},
        {"role": "user", "content": "ok"},
    ]
    expected = theirs.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)  # fmt: skip
    assert ours.encode_chat(messages) == expected
    assert ours.render_chat(messages).endswith("<|im_start|>assistant\n0")


def test_hf_identity_eos_and_loading(hf_dir, tmp_path):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.name.startswith("hf:") and len(tok.name) == 3 + 16
    assert tok.name == HFTokenizer(str(hf_dir)).name
    # eos from tokenizer_config first, then generation_config.json, no duplicates
    assert tok.eos_token_ids == [2, 0]
    other = byte_level_dir(tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("<s>", "<S>"))
    assert HFTokenizer(str(other)).name != tok.name
    # one tokenizer.json, other ids: another chat template (base against instruct), or BOS added
    base = tmp_path / "base"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((hf_dir / name).read_bytes())
    assert HFTokenizer(str(base)).name == tok.name
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    assert HFTokenizer(str(base)).name != tok.name
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert HFTokenizer(str(base)).name != tok.name
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_chat_template_errors_are_value_errors(hf_dir, sp_dir):
    tok = HFTokenizer(str(hf_dir))
    with pytest.raises(ValueError, match="must start with a user"):
        tok.encode_chat([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(str(sp_dir)).encode_chat([{"role": "user", "content": "hi"}])


def test_request_data_a_template_cannot_render_is_a_value_error(hf_dir, tmp_path):
    tok = with_template(hf_dir, tmp_path / "greeting", "{{ greeting + '!' }}{{ messages[0]['content'] }}")
    chat = [{"role": "user", "content": "hi"}]
    assert (
        tok.render_chat(chat, **chat_options({"chat_template_kwargs": {"greeting": "Hello"}})) == "Hello!hi"
    )
    with pytest.raises(ValueError, match="chat template rejected"):  # an int added to a string
        tok.render_chat(chat, **chat_options({"chat_template_kwargs": {"greeting": 5}}))


def test_chat_template_file_takes_precedence(hf_dir, tmp_path):
    import shutil

    directory = tmp_path / "with_jinja"
    shutil.copytree(hf_dir, directory)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert HFTokenizer(str(directory)).render_chat([{"role": "user", "content": "x"}]) == "[x]"


@pytest.mark.parametrize("name", ["thinking", "reasoning_content"])
def test_a_messages_reasoning_reaches_the_template_under_each_name_as_transformers_aliases_it(
    hf_dir, tmp_path, name
):
    """gpt-oss's template renders the analysis before a tool call from ``thinking``, Qwen3's and DeepSeek's
    from ``reasoning_content``; clients send back whichever name they keep (this API returns ``reasoning``
    and ``reasoning_content``): a Qwen3 template lost the text sent as ``reasoning`` or ``thinking``."""
    transformers = pytest.importorskip("transformers")
    template = "{% for m in messages %}[{{ m.role }}:{{ m." + name + " }}]{% endfor %}"
    tok = with_template(hf_dir, tmp_path / name, template)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for key in ("reasoning_content", "reasoning", "thinking"):
        conversation = [
            {"role": "user", "content": "q"},
            {"role": "assistant", key: "plan", "tool_calls": call},
        ]
        assert tok.render_chat(conversation) == "[user:][assistant:plan]"
    both = {"role": "assistant", "content": "a", "thinking": "mine", "reasoning_content": "other"}
    user = {"role": "user", "content": "q", "reasoning": "x"}
    for conversation in ([both], [user], [user, both]):
        want = theirs.apply_chat_template(conversation, tokenize=False)
        assert tok.render_chat(conversation) == want, conversation
    # the client's own of each name wins
    assert tok.render_chat([both]) == ("[assistant:mine]" if name == "thinking" else "[assistant:other]")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(hf_dir, tmp_path):
    """vLLM's chat_template_kwargs (Qwen 3's enable_thinking): more template variables, rendered as
    transformers' apply_chat_template renders its keyword arguments; the request's own variables
    cannot be set that way, and the byte template (no variables) ignores them."""
    import shutil

    from transformers import AutoTokenizer

    directory = tmp_path / "thinking"
    shutil.copytree(hf_dir, directory)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    ours, theirs = HFTokenizer(str(directory)), AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "Think?"}]
    for body in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"chat_template_kwargs": {}}):
        extra = body.get("chat_template_kwargs") or {}
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **extra)
        assert ours.render_chat(chat, **chat_options(body)) == want
    assert ours.render_chat(
        chat, **chat_options({"chat_template_kwargs": {"enable_thinking": False}})
    ).endswith("<think></think>")
    for bad in ([1], "x", {"messages": []}, {"add_generation_prompt": False}, {"bos_token": "<s>"}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            chat_options({"chat_template_kwargs": bad})
    byte = ByteTokenizer()
    assert byte.render_chat(chat, **chat_options({"chat_template_kwargs": {"enable_thinking": False}})) == (
        byte.render_chat(chat)
    )


def test_sentencepiece_prompt_gets_bos_and_byte_fallback(sp_dir):
    tok = HFTokenizer(str(sp_dir))
    ids = tok.encode_prompt("the cat 🙂")
    assert ids[0] == 1
    assert tok.decode(ids) == "the cat 🙂"
    assert len([i for i in ids if 3 <= i < 259]) == 4  # the emoji's four UTF-8 bytes


# ---- streaming detokenization ------------------------------------------------------------------


def stream(tok, ids, chunk: int = 1, prompt_ids=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces = [detok.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), chunk=st.integers(1, 5), prompt=st.text(max_size=8))
def test_byte_stream_never_splits_a_character(text, chunk, prompt):
    tok = ByteTokenizer()
    pieces = stream(tok, tok.encode_prompt(text), chunk, prompt_ids=tok.encode_prompt(prompt))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_holds_back_half_a_character_until_complete():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    emoji = "🙂".encode()
    assert detok.feed([ord("a"), emoji[0]]) == "a"
    assert detok.feed([emoji[1], emoji[2]]) == ""
    assert detok.feed([emoji[3]]) == "🙂"
    assert detok.feed([0xFF, ord("b")]) == "\ufffdb"  # an invalid byte is not held forever
    assert detok.feed([0xE2]) == ""
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize("text", ["the cat 🙂 in the hat", " the  theta", "naïve 東京 the end"])
def test_sentencepiece_stream_keeps_spaces_and_whole_characters(sp_dir, text):
    tok = HFTokenizer(str(sp_dir))
    prompt = tok.encode_prompt("in the")
    ids = tok.encode_prompt(text)[1:]  # generated tokens carry no BOS
    pieces = stream(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert not any("\ufffd" in p for p in pieces)


# characters outside the SentencePiece fixture's vocabulary come as byte-fallback runs (<0xNN> tokens)
BYTE_FALLBACK = "Жмирé東京🙂안녕"
MIXED = BYTE_FALLBACK + "the a in "


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=MIXED, max_size=30),
    prompt=st.text(alphabet=MIXED, max_size=12),
    chunk=st.integers(1, 4),
)
def test_byte_fallback_stream_is_the_decode_of_its_ids(sp_dir, text, prompt, chunk):
    """Streamed text (and so the non-stream text, built from the same pieces) is what decoding all
    the ids gives: a long run of byte tokens never turns into U+FFFD, with or without a prompt."""
    tok = load_tokenizer(str(sp_dir))
    ids, prompt_ids = tok.encode_prompt(text)[1:], tok.encode_prompt(prompt)
    assert "".join(stream(tok, ids, chunk)) == tok.decode(ids)
    expected = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]
    assert "".join(stream(tok, ids, chunk, prompt_ids)) == expected


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.text(alphabet=BYTE_FALLBACK, min_size=1, max_size=12),
    text=st.text(alphabet=MIXED, min_size=1, max_size=20),
    chunk=st.integers(1, 4),
)
def test_byte_fallback_run_from_the_prompt_continues_into_the_output(sp_dir, prompt, text, chunk):
    """The prompt ends in byte tokens and the output goes on with more of the same run (no space in
    between): the output's characters come out whole."""
    tok = load_tokenizer(str(sp_dir))
    ids = tok.encode_prompt(prompt + text)
    cut = len(tok.encode_prompt(prompt))
    assert ids[:cut] == tok.encode_prompt(prompt)  # the prompt's bytes never merge with the text's
    expected = tok.decode(ids)[len(tok.decode(ids[:cut])) :]
    assert expected == text  # (the text starts right after the prompt: no space)
    pieces = stream(tok, ids[cut:], chunk, ids[:cut])
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=MIXED, min_size=2, max_size=20), where=st.floats(0, 1), chunk=st.integers(1, 4))
def test_a_prompt_of_ids_cut_inside_a_character_keeps_its_whole_characters(sp_dir, text, where, chunk):
    """A token-id prompt that ends inside a byte-fallback character (an answer cut by max_tokens,
    sent back to go on): the output is the text after the prompt's whole characters. The byte
    fallback decodes the whole unfinished run as U+FFFD, and the characters of that run the prompt
    had whole came out again as the output's."""
    tok = load_tokenizer(str(sp_dir))
    ids = tok.encode_prompt(text)
    cut = 1 + round(where * (len(ids) - 2))  # after the BOS, before the last id
    data = [tok.token_bytes(t) for t in ids[1:]]
    full = tok.decode(ids)
    skipped = len(b"".join(data).decode()) - len(full)  # the leading space the decoder strips
    whole = b"".join(data[: cut - 1])
    while True:  # the prompt's whole characters: its bytes up to the unfinished one
        try:
            prompt_text = whole.decode()
            break
        except UnicodeDecodeError:
            whole = whole[:-1]
    expected = full[max(0, len(prompt_text) - skipped) :]
    assert "".join(stream(tok, ids[cut:], chunk, ids[:cut])) == expected


def test_shown_special_tokens_are_text_and_the_others_stay_hidden(tmp_path):
    """A request whose tool reader needs hermes' tags, special tokens here, gets them in its text;
    every other special token stays out of it, as it does for a request that shows none."""
    from tokenizers import AddedToken, Tokenizer

    directory = byte_level_dir(tmp_path)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<tool_call>"), AddedToken("</tool_call>")])
    backend.save(str(directory / "tokenizer.json"))
    tok = HFTokenizer(str(directory))
    open_tag, close_tag, im_start = (
        backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|im_start|>")
    )

    def text(s: str) -> list[int]:
        return backend.encode(s, add_special_tokens=False).ids

    prompt = tok.encode_chat([{"role": "user", "content": "naïve?"}])  # ends in <|im_start|>assistant\n
    ids = [*text("Hi "), open_tag, *text('{"a":"é"}'), close_tag, im_start, *text(" done")]
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(tok, prompt)
        detok.show([open_tag, close_tag])
        pieces = [detok.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
        assert "".join(pieces) == 'Hi <tool_call>{"a":"é"}</tool_call> done'
        assert "".join(stream(tok, ids, chunk, prompt)) == 'Hi {"a":"é"} done'
        every = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)  # the request's choice
        pieces = [every.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [every.flush()]
        assert "".join(pieces) == 'Hi <tool_call>{"a":"é"}</tool_call><|im_start|> done'


def test_router_import_does_not_pull_in_torch():
    code = "import sys, router.tokenization; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_USE_TEMPLATE = "<tools>{{ tools | tojson }}</tools>\n" + TEMPLATE


@pytest.mark.parametrize("layout", ["list", "files"])
def test_a_request_with_tools_takes_the_tool_use_template_as_transformers_does(hf_dir, tmp_path, layout):
    """Named chat templates: a list in tokenizer_config.json (Hermes 2 Pro, Command-R), or the files
    transformers 5 saves (chat_template.jinja and additional_chat_templates/tool_use.jinja). A request
    with tools is rendered by ``tool_use``, one without by ``default``, as transformers renders them."""
    import shutil

    from transformers import AutoTokenizer

    directory = tmp_path / "named"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if layout == "list":
        config["chat_template"] = [
            {"name": "default", "template": TEMPLATE},
            {"name": "tool_use", "template": TOOL_USE_TEMPLATE},
        ]
    else:
        del config["chat_template"]
        (directory / "chat_template.jinja").write_text(TEMPLATE)
        (directory / "additional_chat_templates").mkdir()
        (directory / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = HFTokenizer(str(directory)), AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    with_tools = ours.render_chat(messages, TOOLS)
    assert with_tools == theirs.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "get_weather" in with_tools
    plain = ours.render_chat(messages)
    assert plain == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>" not in plain


def test_a_prompt_that_ends_inside_a_character_the_output_completes_streams_that_character():
    """Token ids that continue a cut-off text: the prompt's last byte starts an emoji the output
    finishes; the emoji is the output's text. A prompt byte the output does not complete stays the
    prompt's (no U+FFFD in the output)."""
    tok = ByteTokenizer()
    emoji = "😀".encode()
    prompt = [*tok.encode_prompt("Hi "), emoji[0], emoji[1]]
    for chunk in (1, 2):
        assert "".join(stream(tok, [emoji[2], emoji[3], *b" ok"], chunk, prompt)) == "😀 ok"
        assert "".join(stream(tok, list(b"ok"), chunk, prompt)) == "ok"
    assert "".join(stream(tok, [], 1, prompt)) == ""  # nothing generated: nothing of the prompt's
    assert "".join(stream(tok, list(b"ok"), 1, [*prompt, 0xFF])) == "ok"
    literal = [*tok.encode_prompt("Hi \ufffd"), emoji[0], emoji[1]]  # the prompt's own U+FFFD before it
    assert "".join(stream(tok, [emoji[2], emoji[3], *b" ok"], 1, literal)) == "😀 ok"


def test_added_tokens_of_a_byte_level_tokenizer_name_their_own_bytes(tmp_path):
    """A byte-level tokenizer's added token outside its byte alphabet (DeepSeek's end of sentence, its
    bars full-width) is its text as written: its ``▁`` is not SentencePiece's space."""
    from tokenizers import AddedToken, Tokenizer

    directory = byte_level_dir(tmp_path)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    name = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    backend.add_special_tokens([AddedToken(name)])
    backend.save(str(directory / "tokenizer.json"))
    tok = HFTokenizer(str(directory))
    assert tok.token_bytes(backend.token_to_id(name)) == name.encode()
    assert tok.token_bytes(backend.token_to_id("<|im_end|>")) == b"<|im_end|>"


def test_special_tokens_named_in_special_tokens_map_only_are_read_as_transformers_reads_them(tmp_path):
    """The older layout: tokenizer_config.json without the special tokens, special_tokens_map.json
    with them. The template's bos_token and the EOS stop id come from there (where both name one, the
    map's wins, as in transformers)."""
    transformers = pytest.importorskip("transformers")
    directory = byte_level_dir(tmp_path / "map")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["bos_token"], config["eos_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>"})
    )
    ours, theirs = HFTokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(str(directory))
    chat = [{"role": "user", "content": "hello there"}]
    want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert want.startswith("<s>") and ours.render_chat(chat) == want
    assert ours.eos_token_ids == [theirs.eos_token_id] and ours.special_tokens["bos_token"] == "<s>"
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert HFTokenizer(str(directory)).eos_token_ids == [theirs.eos_token_id] == [ours.eos_token_ids[0]]


def test_documents_reach_the_template_as_transformers_passes_them_and_a_request_template_is_refused(
    hf_dir, tmp_path
):
    """vLLM's ``documents`` (RAG templates read them) were dropped without a word, and a request's own
    ``chat_template`` was ignored: the documents reach the template as transformers passes them; a
    per-request template is a clear error. An assistant's refusal part is its text, as vLLM reads it."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "rag"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if documents %}{% for d in documents %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}{% endif %}"
        + TEMPLATE
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = HFTokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(str(directory))
    docs = [{"title": "radix", "text": "a tree of prefixes"}, {"title": "kv", "text": "keys and values"}]
    body = {"messages": CHAT, "documents": docs}
    want = theirs.apply_chat_template(normalize_messages(CHAT), documents=docs, add_generation_prompt=True,
                                      tokenize=False)  # fmt: skip
    assert "<doc>radix: a tree of prefixes</doc>" in want
    assert ours.render_chat(CHAT, **chat_options(body)) == want
    assert ours.encode_chat(CHAT, **chat_options(body)) == theirs(want, add_special_tokens=False).input_ids
    byte = ByteTokenizer().render_chat(CHAT, **chat_options(body))
    assert byte.startswith('<|documents|>\n[{"title":"radix"') and byte != ByteTokenizer().render_chat(CHAT)
    for bad, message in (({"chat_template": "{{ messages }}"}, "per-request 'chat_template'"),
                         ({"documents": "text"}, "'documents' must be a list of objects"),
                         ({"documents": [1]}, "'documents' must be a list of objects")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            chat_options({"messages": CHAT, **bad})
    refusal = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]  # fmt: skip
    assert normalize_messages(refusal)[1]["content"] == "I can't."
    with pytest.raises(ValueError, match="must be a"):
        normalize_messages([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])


PARTS_TEMPLATE = (  # as Gemma 3's: a string as it is, a list of parts item by item (trimmed)
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}"
    "{% else %}{% for item in m['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FILTERED_TEMPLATE = (  # as Llama 4's: the text parts through a filter
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content | selectattr('type', 'equalto', 'text') %}[{{ c.text }}]{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("template", [PARTS_TEMPLATE, FILTERED_TEMPLATE], ids=["gemma3-like", "filtered"])
def test_text_parts_reach_a_template_that_loops_over_them_as_a_list(hf_dir, tmp_path, template):
    """transformers hands a message's content parts to the template as they came: a template that
    loops over them (Gemma 3's, Llama 4's) wrote one newline more between parts than transformers
    when radixgate joined them first; a template that does not still gets them joined."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "parts"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    ours, theirs = HFTokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(str(directory))
    chat = [{"role": "user", "content": [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}]  # fmt: skip
    want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ("Translate:bonjour" in want or "[Translate:][bonjour]" in want) and ours.render_chat(chat) == want
    assert ours.encode_chat(chat) == theirs(want, add_special_tokens=False).input_ids
    plain = HFTokenizer(str(hf_dir))  # TEMPLATE writes content as a string: parts joined, as before
    assert "Translate:\nbonjour" in plain.render_chat(chat)
    # an assistant prefill leaves the history's parts as they are (it joined every message's), and may be
    # parts itself: the last one's text is where the prompt ends, as transformers cuts it
    for final in ("The answer", [{"type": "text", "text": "The "}, {"type": "text", "text": "answer"}]):
        prefill = [*chat, {"role": "assistant", "content": final}]
        want = theirs.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
        assert ours.render_chat(prefill, **chat_options({"continue_final_message": True})) == want, final
        assert want.endswith("answer") and ("Translate:bonjour" in want or "[Translate:][bonjour]" in want)


def _conversation(rng, turns: int) -> list[dict]:
    words = [
        "route",
        " cache",
        "é",
        "🙂",
        " 東京",
        "<|im_end|>",
        "<|im_start|>",
        "\n",
        "  ",
        "</s>",
        "<s>",
        "x",
    ]
    messages = [{"role": "system", "content": "".join(rng.choice(words) for _ in range(rng.randrange(0, 6)))}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(
            {"role": role, "content": "".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))}
        )
    return messages


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_a_growing_conversation_is_encoded_from_its_cached_prefix_with_the_same_ids(kind, tmp_path):
    """PrefixIds: each turn encodes only what it adds, and the ids are those of the whole text encoded
    at once (a cut only right after a special added token, where tokenizers splits anyway)."""
    import random

    directory = (
        byte_level_dir(tmp_path / "bl") if kind == "byte_level" else sentencepiece_dir(tmp_path / "sp")
    )
    if kind == "sentencepiece":  # NOTE: a Prepend normalizer, byte fallback, turns ended by </s>
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(str(directory))
    assert tok.prefix_ids.cut_tokens  # <|im_end|> and its kin / </s>
    rng = random.Random(0)
    for _ in range(6):
        conversation = _conversation(rng, 12)
        for turn in range(1, len(conversation) + 1):
            messages = conversation[:turn]
            whole = tok.encode_text(tok.render_chat(messages, add_generation_prompt=turn % 2 == 0))
            assert tok.encode_chat(messages, add_generation_prompt=turn % 2 == 0) == whole, (kind, messages)
    assert tok.prefix_ids.hits >= 6 * 10


def test_an_added_token_that_overlaps_another_is_never_a_cut(tmp_path):
    """Leftmost-longest matching may take another added token where ``<|im_end|>`` occurs: a cut after
    it would then give other ids, so it is not one."""
    from tokenizers import Tokenizer

    directory = byte_level_dir(tmp_path / "bl")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert "<|im_end|>" in HFTokenizer(str(directory)).prefix_ids.cut_tokens
    tok.add_special_tokens(["d|>\n<|im"])
    tok.save(str(directory / "tokenizer.json"))
    text, cut = "a<|im_end|>\n<|im_start|>b", len("a<|im_end|>")
    assert tok.encode(text).ids != tok.encode(text[:cut]).ids + tok.encode(text[cut:]).ids
    assert HFTokenizer(str(directory)).prefix_ids.cut_tokens == []  # it overlaps <|im_end|> and <|im_start|>


def test_no_cut_after_a_token_ending_a_word_where_a_single_word_token_follows(tmp_path):
    """A single_word added token matches only at a word boundary, read from the character before it:
    after a cut there is none, so a cut token ending in a word character would let it match where
    the whole text does not."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>|:")}
    tok = Tokenizer(models.WordLevel({**vocab, "[UNK]": len(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.add_special_tokens([AddedToken("<|end|>x", special=True, normalized=False)])
    tok.add_tokens([AddedToken("abc", single_word=True, normalized=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}<|end|>x{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    hf = HFTokenizer(str(tmp_path))
    assert hf.prefix_ids.cut_tokens == []
    conversation = [{"role": "user", "content": "hi"}, {"role": "abc", "content": "x"}]
    for turn in (1, 2):  # NOTE: "abc" after "x" is no word of its own: cut there, it would be one
        assert hf.encode_chat(conversation[:turn]) == hf.encode_text(hf.render_chat(conversation[:turn]))


class _Recording:
    """A ``tokenizers.Tokenizer`` that records the texts it is asked to encode."""

    def __init__(self, tok: Any, seen: list[str]) -> None:
        self._tok, self._seen = tok, seen

    def encode(self, text: str, **options: Any) -> Any:
        self._seen.append(text)
        return self._tok.encode(text, **options)

    def encode_batch(self, texts: list[str], **options: Any) -> Any:
        self._seen.extend(texts)
        return self._tok.encode_batch(texts, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_prompts_sharing_a_prefix_encode_only_their_own_part_and_hold_it_once(tmp_path):
    """PrefixIds: new conversations on one system prompt and examples, and a conversation branched
    at an earlier message, encode only what follows the prefix they share with a prompt seen before,
    with the ids of their whole text; the shared prefix is held once."""
    tok = HFTokenizer(str(byte_level_dir(tmp_path / "bl")))
    head = [
        {"role": "system", "content": "You route requests. " * 100},
        {"role": "user", "content": "an example"},
        {"role": "assistant", "content": "its answer"},
    ]
    encoded: list[str] = []
    tok._tok = _Recording(tok._tok, encoded)  # type: ignore[assignment]

    def encode_chat(messages: list[dict]) -> int:
        """The characters encoding ``messages`` took; its ids checked against the whole text's."""
        encoded.clear()
        ids = tok.encode_chat(messages)
        took = sum(map(len, encoded))
        assert ids == tok.encode_text(tok.render_chat(messages))
        return took

    for i in range(4):
        asked = [*head, {"role": "user", "content": f" question {i} 東京 " * (i + 1)}]
        took = encode_chat(asked)
        if i:  # the head was found: its text is not encoded again
            assert 0 < took < 300, encoded  # of ~2,200 characters
        grown = [
            *asked,
            {"role": "assistant", "content": "sure " * 300},
            {"role": "user", "content": "then?"},
        ]
        encode_chat(grown)
        branched = [
            *asked,
            {"role": "assistant", "content": "sure " * 300},
            {"role": "user", "content": "no"},
        ]
        assert 0 < encode_chat(branched) < 60, encoded
    apart = HFTokenizer(str(tmp_path / "bl"))  # NOTE: the same conversations on four system prompts
    for i in range(4):
        system = {"role": "system", "content": f"{i} You route requests. " * 100}
        asked = [system, *head[1:], {"role": "user", "content": f" question {i} 東京 " * (i + 1)}]
        grown = [
            *asked,
            {"role": "assistant", "content": "sure " * 300},
            {"role": "user", "content": "then?"},
        ]
        apart.encode_chat(asked), apart.encode_chat(grown)
    held, held_apart = tok.prefix_ids.describe()["bytes"], apart.prefix_ids.describe()["bytes"]
    assert held < 0.75 * held_apart, (held, held_apart)  # the shared head is held once


def test_tokenizer_bench_runs_both_workloads_with_the_whole_texts_ids(tmp_path):
    from loadtest import bench_tokenizer

    out = tmp_path / "bench.json"
    directory = byte_level_dir(tmp_path / "bl")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = bench_tokenizer.CHATML_TOOLS  # NOTE: it writes the tools: a long head
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["--tokenizer", str(directory), "--conversations", "4", "--turns", "3"]
    assert bench_tokenizer.main([*argv, "--out", str(out)]) == 0
    rows = {(r["workload"], r["prefix_ids"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and all(r["mismatches"] == 0 for r in rows.values())
    assert rows["new conversations", True]["cache"]["hits"] == 3  # the head, found by the next three
    assert rows["new conversations", False]["cache"]["hits"] == 0


def test_a_prompt_spelling_another_prefixs_key_gets_its_own_ids(tmp_path):
    """PrefixIds: a piece's key is keyed by its parent's, so no text can pass for a prefix it is not.
    Chaining the parent's key into the hashed text instead gives a root piece that starts with the
    bytes of another prompt's first key, followed by that prompt's second piece, the same key as
    that second piece, and the other prompt's ids."""
    tok = HFTokenizer(str(byte_level_dir(tmp_path / "bl")))
    end = "<|im_end|>"
    assert end in tok.prefix_ids.cut_tokens
    for i in itertools.count():  # NOTE: one text in ~65,000 has a first key of ASCII bytes alone
        first = f"{i} " + "the first piece " * 70 + end
        key = hashlib.blake2b(first.encode(), digest_size=16).digest()
        if key.isascii():
            break
    second = "the second piece " * 70 + end
    theirs = tok.prefix_ids.encode(first + second, tok._encode_texts)
    assert theirs == tok.encode_text(first + second)
    crafted = key.decode("ascii") + second
    assert tok.prefix_ids.encode(crafted, tok._encode_texts) == tok.encode_text(crafted) != theirs


def _decoded_lengths(tok: Any) -> list[int]:
    """Record the number of ids of each decode ``tok`` makes from now on."""
    lengths: list[int] = []
    decode = tok.decode

    def recording(ids: Any, *args: Any, **kwargs: Any) -> str:
        lengths.append(len(ids))
        return decode(ids, *args, **kwargs)

    tok.decode = recording
    return lengths


def test_a_stream_whose_every_token_ends_inside_a_character_decodes_a_bounded_window(tmp_path):
    """Byte-level tokens that cross characters ("E4", "B8 AD E6", "96 87 E4": 中文中文...) never end on a
    whole character, and the window restarted only then: every token decoded the whole answer so far
    (4,001 tokens: 2.8 s on the engine thread). It restarts where the held character's bytes stay in it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from router.tokenization import _byte_level_table

    symbol = {byte: char for char, byte in _byte_level_table().items()}
    vocab = {symbol[b]: b for b in range(256)}
    crossing = [bytes([0xB8, 0xAD, 0xE6]), bytes([0x96, 0x87, 0xE4])]
    for piece in crossing:
        vocab["".join(symbol[b] for b in piece)] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = HFTokenizer(str(tmp_path))
    ids = [0xE4] + [256, 257] * 300  # 中文 x 300, the last 中 unfinished
    detok = IncrementalDetokenizer(tok, tok.encode_prompt("hi"))
    lengths = _decoded_lengths(tok)
    streamed = [detok.feed([i]) for i in ids]
    assert "".join(streamed) == "中文" * 300 and "\ufffd" not in "".join(streamed)
    assert sum(1 for s in streamed if s) >= 599  # each character as its last byte comes
    assert max(lengths) <= 16, max(lengths)  # the window, not the answer
    assert detok.flush() == "\ufffd"  # the unfinished one, at the end


def test_bytes_no_later_byte_completes_go_out_and_the_window_stays_bounded():
    """Continuation bytes with no first byte can never complete: they were held (nothing streamed before
    flush) and every feed decoded them all again."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode_prompt("hi"))
    lengths = _decoded_lengths(tok)
    streamed = "".join(detok.feed([0x80]) for _ in range(500))
    assert len(streamed) >= 500 - 70 and set(streamed) == {"\ufffd"}
    assert streamed + detok.flush() == "\ufffd" * 500
    assert max(lengths) <= 70, max(lengths)


def test_a_templates_date_is_utc_whatever_the_machines_time_zone(monkeypatch):
    """Llama 3.1's template writes today's date with strftime_now: on the machine's local time, a
    router and workers in time zones a day apart rendered one prompt two ways (and its prefix
    predictions missed). Both sides render UTC."""
    import time
    from datetime import datetime, timezone

    from router.tokenization import _compile_template

    template = _compile_template("{{ strftime_now('%Y-%m-%d %H') }}")
    try:
        for zone in ("Etc/GMT-14", "Etc/GMT+12"):  # UTC+14, UTC-12: a day apart, wherever UTC is
            monkeypatch.setenv("TZ", zone)
            time.tzset()
            before = datetime.now(timezone.utc).strftime("%Y-%m-%d %H")
            rendered = template.render()
            after = datetime.now(timezone.utc).strftime("%Y-%m-%d %H")
            assert rendered in (before, after), zone
    finally:
        monkeypatch.undo()
        time.tzset()
