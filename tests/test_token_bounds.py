"""The fewest tokens a text can encode to (router.token_bounds): never above the true count, for the
bytes tokenizer and HF tokenizers that spell every byte; no bound for tokenizers that may drop text
or fold a run of it into one token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.token_bounds import fewest_tokens, hf_max_token_bytes
from router.tokenization import ByteTokenizer, HFTokenizer
from tests.test_tokenization import byte_level_dir, sentencepiece_dir

SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|eos|>", "<0x41>"]
# pieces of text: characters of 1-4 UTF-8 bytes, runs of spaces, and special tokens' own text
TEXTS = st.lists(
    st.one_of(
        st.text(min_size=1, max_size=20),
        st.sampled_from(["the ", " in", "a", "\n\n", "東京", "🙂", "é", " " * 40, "Ġ", "▁"]),
        st.sampled_from(SPECIALS),
    ),
    min_size=1,
    max_size=30,
).map("".join)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> list:
    return [
        ByteTokenizer(),
        HFTokenizer(str(byte_level_dir(tmp_path_factory.mktemp("bytelevel")))),
        HFTokenizer(str(sentencepiece_dir(tmp_path_factory.mktemp("sentencepiece")))),
    ]


def test_the_bound_is_each_tokenizers_longest_token_in_bytes(tokenizers):
    byte, level, sp = tokenizers
    assert byte.max_token_bytes == 1
    for tok in (level, sp):  # NOTE: sp's: "<0x41>" and "▁the" ("▁" is 3 bytes), 6 bytes each
        assert tok.max_token_bytes == max(len(p.encode()) for p in tok._tok.get_vocab(with_added_tokens=True))
    assert sp.max_token_bytes == 6
    assert (
        fewest_tokens("abcd", 3) == 2 and fewest_tokens("東京", 3) == 2 and fewest_tokens("abcd", None) == 0
    )


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_no_text_encodes_to_fewer_ids_than_the_bound(tokenizers, text):
    """Prompts (BOS too), text alone and rendered chat prompts (special tokens in the text are theirs)."""
    for tok in tokenizers:
        fewest = fewest_tokens(text, tok.max_token_bytes)
        assert fewest >= len(text.encode()) / tok.max_token_bytes > 0
        for encode in (tok.encode_prompt, tok.encode_text, tok.encode_chat_text):
            assert len(encode(text)) >= fewest, (tok.name, encode.__name__, text)


def _saved(tmp_path: Path, tok) -> Path:
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def _no_bound_cases():
    """(name, a Tokenizer, a text it encodes to fewer ids than its bytes over its longest piece)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    split = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    split.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    yield "whitespace pre-tokenizer", split, "a" + " " * 100 + "b"
    unknown = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    unknown.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    yield "unknown word", unknown, "x" * 100  # one [UNK] for the whole word
    level = Tokenizer(models.BPE())
    level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    level.add_tokens(pre_tokenizers.ByteLevel.alphabet())
    stripped = Tokenizer.from_str(level.to_str())
    stripped.normalizer = normalizers.Strip()
    yield "strip normalizer", stripped, " " * 100 + "a"
    composed = Tokenizer.from_str(level.to_str())
    composed.normalizer = normalizers.NFKC()
    yield (
        "NFKC normalizer",
        composed,
        "\ufdfa",
    )  # one character of 3 bytes NFKC spells as 18 characters: still none
    swallowing = Tokenizer.from_str(level.to_str())
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    yield "added token taking the spaces beside it", swallowing, " " * 100 + "<mask>" + " " * 100


@pytest.mark.parametrize("case", list(_no_bound_cases()), ids=lambda c: c[0])
def test_no_bound_for_a_tokenizer_that_may_drop_or_fold_text(case, tmp_path):
    name, tok, text = case
    assert hf_max_token_bytes(tok) is None
    assert HFTokenizer(str(_saved(tmp_path, tok))).max_token_bytes is None
    assert fewest_tokens(text, None) == 0
    if name != "NFKC normalizer":  # NOTE: the others show why: a bound from the longest piece would be broken
        longest = max(len(p.encode()) for p in tok.get_vocab(with_added_tokens=True))
        assert len(tok.encode(text).ids) < fewest_tokens(text, longest)


def test_a_byte_level_vocabulary_missing_a_byte_has_no_bound(tmp_path):
    """A byte it cannot spell is dropped (no unknown token): the count could be below any bound."""
    spec = json.loads((byte_level_dir(tmp_path).joinpath("tokenizer.json")).read_text())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(spec))
    assert hf_max_token_bytes(tok) is not None
    del spec["model"]["vocab"]["Ā"]  # byte 0x00
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "Ā" not in str(m)]
    assert hf_max_token_bytes(Tokenizer.from_str(json.dumps(spec))) is None
