"""Contract 1: block hashes are pinned; changing them silently would break every router's index."""

from __future__ import annotations

import struct

import mmh3
import pytest

from router.block_hash import block_hashes, root_hash


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
