"""Contract 1: block hashes are pinned; changing them silently would break every router's index."""

from __future__ import annotations

import random
import struct

import mmh3
import pytest

from router.block_hash import PromptHashes, SpanMemo, block_hashes, root_hash


def spec_hash(data: bytes) -> int:
    return mmh3.hash128(data, 0, True, False) & (2**64 - 1)


def test_pinned_values():
    assert root_hash("tiny") == 11591285558260149810
    assert block_hashes(list(range(32)), 16, "tiny") == [7497297296444258207, 4645946951644209035]
    assert block_hashes([70000, 1, 2**32 - 1, 5], 2, "m") == [2685323002673520526, 10295048520271425092]


def test_matches_the_written_definition():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    h = spec_hash(b"llama")
    expected = []
    for i in range(0, 12, 4):
        h = spec_hash(struct.pack("<Q", h) + struct.pack("<4I", *tokens[i : i + 4]))
        expected.append(h)
    assert block_hashes(tokens, 4, "llama") == expected


def test_partial_block_ignored_and_chain_continues():
    tokens = list(range(40))
    full = block_hashes(tokens, 16, "m")
    assert len(full) == 2  # the trailing 8 tokens do not form a block
    first = block_hashes(tokens[:16], 16, "m")
    assert block_hashes(tokens[16:32], 16, "m", parent=first[-1]) == full[1:]


def test_namespace_and_prefix_sensitivity():
    a = block_hashes(list(range(32)), 16, "model-a")
    b = block_hashes(list(range(32)), 16, "model-b")
    assert a[0] != b[0]
    changed = block_hashes([0, *range(1, 31), 99], 16, "model-a")
    assert changed[0] == a[0] and changed[1] != a[1]


def test_accepts_bytes_and_rejects_bad_input():
    data = "héllo wörld, this is utf-8 text!".encode()
    assert block_hashes(data, 8, "m") == block_hashes(list(data), 8, "m")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([-1] * 16, 16)


def test_prompt_hashes_equal_block_hashes_lazily():
    rng = random.Random(7)
    memo = SpanMemo(max_bytes=1 << 20)
    for trial in range(60):
        n = rng.randrange(0, 2500)
        tokens = (
            bytes(rng.randrange(256) for _ in range(n))
            if trial % 2
            else [rng.randrange(2**32) for _ in range(n)]
        )
        bs = rng.choice([1, 4, 16])
        expected = block_hashes(tokens, bs, "m")
        for use_memo in (None, memo, memo):  # the second pass with the memo reads hits
            lazy = PromptHashes(tokens, bs, "m", use_memo)
            assert len(lazy) == len(expected)
            if expected:
                i = rng.randrange(len(expected))
                assert lazy[i] == expected[i]
                assert lazy.computed() < len(expected) or i >= len(expected) - 2 * SpanMemo.SPAN_BLOCKS
                assert lazy[-1] == expected[-1]
                assert lazy[i : i + 3] == expected[i : i + 3]
                assert lazy[::-5] == expected[::-5]
            assert list(lazy) == expected
    assert memo.hits > 0


def test_prompt_hashes_compute_only_what_is_read():
    tokens = bytes(range(256)) * 64  # 16,384 tokens, 1,024 blocks of 16
    lazy = PromptHashes(tokens, 16, "m")
    assert lazy[0] == block_hashes(tokens[:16], 16, "m")[0]
    assert lazy.computed() <= SpanMemo.SPAN_BLOCKS
    with pytest.raises(IndexError):
        lazy[len(lazy)]


def test_span_memo_is_bounded_and_keys_by_content():
    memo = SpanMemo(max_bytes=4096)
    a = bytes(range(256)) * 8  # 2,048 tokens: 4 spans of 32 blocks of 16
    b = bytes(reversed(range(256))) * 8
    for tokens in (a, b, a, b):
        assert list(PromptHashes(tokens, 16, "m", memo)) == block_hashes(tokens, 16, "m")
    assert memo._bytes <= 4096 and len(memo) <= 4096 // (512 + 256)
    # Same tokens, another block size: never served from the other block size's spans.
    assert list(PromptHashes(a, 8, "m", memo)) == block_hashes(a, 8, "m")
