"""Block hashes: the one definition of how a prompt's token ids become chained block hashes.

Both the router (prediction) and the worker (KV events) import this module; it must never
change its output for the same input without bumping ``HASH_VERSION`` (a test pins values).

h_{-1} = H(utf-8 of the model namespace); h_i = H(le_u64(h_{i-1}) || le_u32(tokens of block i)),
H = MurmurHash3 x64-128 (seed 0) keeping its low 64 bits, unsigned. Only full blocks hash.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import mmh3

HASH_VERSION = 1
_MASK64 = (1 << 64) - 1


def _h(data: bytes) -> int:
    return mmh3.hash128(data, 0, True, False) & _MASK64


def root_hash(namespace: str) -> int:
    """h_{-1}: the parent of block 0, derived from the model namespace (usually its name)."""
    return _h(namespace.encode("utf-8"))


def block_hashes(
    token_ids: Sequence[int] | array | bytes,
    block_size: int,
    namespace: str = "",
    parent: int | None = None,
) -> list[int]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block is ignored).

    ``parent`` continues a chain (the hash of the block before ``token_ids[0]``); when None the
    chain starts at ``root_hash(namespace)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        token_ids = array("B", token_ids)  # one token per byte, not raw uint32 memory
    tokens = array("I", token_ids)  # raises OverflowError on ids outside uint32
    if sys.byteorder == "big":  # pragma: no cover - the contract is little-endian
        tokens.byteswap()
    raw = tokens.tobytes()
    h = root_hash(namespace) if parent is None else parent
    out: list[int] = []
    step = 4 * block_size
    for start in range(0, len(raw) - step + 1, step):
        h = _h(h.to_bytes(8, "little") + raw[start : start + step])
        out.append(h)
    return out
