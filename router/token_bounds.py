"""The fewest tokens a text can encode to, without encoding it: its UTF-8 bytes over the most bytes
one token stands for. Lets the worker refuse a prompt far past its context before it builds a list of
millions of ids. Must never give a bound above the true count: where a tokenizer could drop text or
fold a long run of it into one token, it gives none."""

from __future__ import annotations

import json
from typing import Any

# NOTE: normalizers that never shorten text (a Replace of a literal by something at least as long);
# NFC/NFKC compose characters, Lowercase can shorten one ("K" Kelvin sign -> "k"), Strip drops text
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace"})
# NOTE: pre-tokenizers that keep every character (Whitespace, WhitespaceSplit, BertPreTokenizer and
# CharDelimiterSplit drop the separators; Split and Punctuation do with behavior "Removed")
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
)


def fewest_tokens(text: str, max_token_bytes: int | None) -> int:
    """At least how many ids ``text`` encodes to (as a prompt, or a rendered chat prompt), for a
    tokenizer none of whose tokens stands for more than ``max_token_bytes`` bytes of text; 0 where
    that is None (no bound known)."""
    if not max_token_bytes:
        return 0
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // max_token_bytes)


def tokenizer_spec(tokenizer: Any) -> dict | None:
    """A ``tokenizers.Tokenizer``'s settings as its tokenizer.json holds them (None: unreadable)."""
    try:
        spec = json.loads(tokenizer.to_str())
    except (ValueError, TypeError):
        return None
    return spec if isinstance(spec, dict) else None


def hf_max_token_bytes(tokenizer: Any, spec: dict | None = None) -> int | None:
    """The most bytes of text one token of a ``tokenizers.Tokenizer`` stands for: its longest piece
    (added tokens too) in UTF-8, which is at least the bytes it covers (a byte-level piece's character
    is one byte of text, "▁" one space, "<0x41>" one byte). None unless every byte of the text ends up
    in some token: no normalizer or pre-tokenizer that can drop or shorten text, a BPE or Unigram
    model that spells any text (byte-level alphabet or byte fallback: no unknown token that may
    stand for a run of any length), no added token that swallows the spaces beside it, and no
    truncation. ``spec``: its ``tokenizer_spec``, where already read."""
    spec = spec if spec is not None else tokenizer_spec(tokenizer)
    if spec is None:
        return None
    added = spec.get("added_tokens") or []
    if spec.get("truncation") or any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    if not all(_keeps_text(n) for n in _parts(spec.get("normalizer"), "normalizers")):
        return None
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if not all(p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed" for p in pre):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    model = spec.get("model") or {}
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None  # NOTE: "##x" pieces: a byte the alphabet spells may still have none inside a word
    byte_level = any(p.get("type") == "ByteLevel" for p in pre) and model.get("type") == "BPE"
    if byte_level and not all(c in vocab for c in _byte_level_alphabet()):
        return None
    fallback = model.get("type") in ("BPE", "Unigram") and model.get("byte_fallback")
    if fallback and not all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return None
    if not (byte_level or fallback):
        return None
    return max(len(piece.encode("utf-8", "surrogatepass")) for piece in vocab)


def _parts(component: dict | None, key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps (a Sequence's, flattened)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [p for c in component.get(key) or [] for p in _parts(c, key)]
    return [component]


def _keeps_text(normalizer: dict) -> bool:
    """Does this normalizer step never shorten a text (in UTF-8 bytes)?"""
    kind = normalizer.get("type")
    if kind != "Replace":
        return kind in _KEEPING_NORMALIZERS
    literal = (normalizer.get("pattern") or {}).get("String")  # NOTE: a Regex may match more than it writes
    content = normalizer.get("content")
    if not isinstance(literal, str) or not literal or not isinstance(content, str):
        return False
    return len(content.encode("utf-8")) >= len(literal.encode("utf-8"))


def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()
