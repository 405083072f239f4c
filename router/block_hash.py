"""Block hashes: the one definition of how a prompt's token ids become chained block hashes.

Both the router (prediction) and the worker (KV events) import this module; it must never
change its output for the same input without bumping ``HASH_VERSION`` (a test pins values).

h_{-1} = H(utf-8 of the model namespace); h_i = H(le_u64(h_{i-1}) || le_u32(tokens of block i)),
H = MurmurHash3 x64-128 (seed 0) keeping its low 64 bits, unsigned. Only full blocks hash.

The router's hot path uses ``PromptHashes``: the same values, computed on demand (a routing
decision usually needs only the blocks up to the deepest cached match) and memoised per aligned
span of blocks, so the long prefixes that many prompts share (system prompts, earlier turns of a
conversation) are hashed once, not once per request.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import mmh3

HASH_VERSION = 1
_MASK64 = (1 << 64) - 1
_digest = mmh3.mmh3_x64_128_digest  # 16 bytes, little-endian: the low 64 bits come first


def _h(data: bytes) -> int:
    return mmh3.hash128(data, 0, True, False) & _MASK64


@functools.lru_cache(maxsize=256)  # a handful of model names, asked for on every request
def root_hash(namespace: str) -> int:
    """h_{-1}: the parent of block 0, derived from the model namespace (usually its name)."""
    return _h(namespace.encode("utf-8"))


# NOTE: a salt is held as long as its namespace is in use (the root cache above, the worker's namespaces):
# unbounded, 256 salts of megabytes each would pin gigabytes in every router and worker
MAX_CACHE_SALT_CHARS = 1024
CACHE_SALT_ERROR = f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"


def valid_cache_salt(salt: object) -> bool:
    """Is ``salt`` a cache_salt the router and the worker take (None: no salt, also valid)?"""
    return salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS)


def salted(namespace: str, cache_salt: str | None) -> str:
    """The chain namespace of a request with vLLM's ``cache_salt``: its prefixes are its salt's own,
    so a request with another salt, or none, never matches them (nor learns from timing that they
    are cached). Without a salt, ``namespace`` itself."""
    return namespace if cache_salt is None else f"{namespace}\x00cache_salt\x00{cache_salt}"


def _token_bytes(token_ids: Sequence[int] | array | bytes) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed representation)."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):  # one token per byte
        wide = bytearray(4 * len(token_ids))
        wide[0::4] = token_ids  # little-endian uint32 of each byte, in one C loop
        return bytes(wide)
    tokens = array("I", token_ids)  # raises OverflowError on ids outside uint32
    if sys.byteorder == "big":  # pragma: no cover - the contract is little-endian
        tokens.byteswap()
    return tokens.tobytes()


def _chain(parent: bytes, raw: bytes | memoryview, step: int) -> list[bytes]:
    """The 8-byte little-endian hash of each full ``step``-byte block of ``raw``, chained from
    ``parent`` (8 bytes). Working on digests avoids int conversions in the loop."""
    out = []
    append = out.append
    h = parent
    for start in range(0, len(raw) - step + 1, step):
        h = _digest(h + raw[start : start + step])[:8]
        append(h)
    return out


def _ints(hashes8: list[bytes]) -> list[int]:
    ints = array("Q", b"".join(hashes8))
    if sys.byteorder == "big":  # pragma: no cover
        ints.byteswap()
    return ints.tolist()


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
    h = root_hash(namespace) if parent is None else parent
    return _ints(_chain(h.to_bytes(8, "little"), _token_bytes(token_ids), 4 * block_size))


class SpanMemo:
    """LRU memo of chained hashes per aligned span of blocks, keyed by the exact bytes hashed
    (block size, parent hash, the span's tokens), so a hit never returns another prompt's hashes.
    Bounded by ``max_bytes`` of keys and values (64 MiB: ~40 M tokens of bytes-tokenizer prompts,
    about what the prefix index's default budget covers). A span is ``SPAN_BLOCKS`` blocks."""

    SPAN_BLOCKS = 32

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._spans: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, key: bytes) -> bytes | None:
        found = self._spans.get(key)
        if found is None:
            self.misses += 1
        else:
            self._spans.move_to_end(key)
            self.hits += 1
        return found

    def put(self, key: bytes, hashes: bytes) -> None:
        self._spans[key] = hashes
        self._bytes += len(key) + len(hashes)
        while self._bytes > self.max_bytes:
            old, value = self._spans.popitem(last=False)
            self._bytes -= len(old) + len(value)

    def __len__(self) -> int:
        return len(self._spans)


class PromptHashes(Sequence[int]):
    """A prompt's block hashes as a lazy sequence: ``len()`` is known up front, element ``i`` is
    computed (with everything before it) when first read. Equal to ``block_hashes(...)``.

    ``bytes`` input (the bytes tokenizer: one token per byte) is kept as is and widened to uint32
    one span at a time, only where a span must actually be hashed."""

    __slots__ = ("_done", "_memo", "_n", "_per_block", "_root", "_src", "_step", "_tag", "_wide")

    def __init__(
        self,
        token_ids: Sequence[int] | array | bytes,
        block_size: int,
        namespace: str = "",
        memo: SpanMemo | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._wide = not isinstance(token_ids, (bytes, bytearray, memoryview))
        self._src = _token_bytes(token_ids) if self._wide else bytes(token_ids)
        self._step = 4 * block_size  # bytes hashed per block
        self._per_block = self._step if self._wide else block_size  # source bytes per block
        self._n = len(self._src) // self._per_block
        self._memo = memo
        self._tag = b"%d:%d:" % (block_size, self._wide)
        self._done: list[int] = []
        self._root = root_hash(namespace).to_bytes(8, "little")

    def __len__(self) -> int:
        return self._n

    def _hash(self, parent: bytes, src: bytes) -> bytes:
        return b"".join(_chain(parent, src if self._wide else _token_bytes(src), self._step))

    def _extend(self, upto: int) -> None:
        """Compute blocks [len(done), upto), rounded up to whole spans (at most all blocks)."""
        done, per, memo, span = len(self._done), self._per_block, self._memo, SpanMemo.SPAN_BLOCKS
        parent = self._done[-1].to_bytes(8, "little") if done else self._root
        new = bytearray()
        start = done
        while start < upto:
            end = min(self._n, (start // span + 1) * span)
            src = self._src[start * per : end * per]
            if memo is not None and end - start == span:
                key = self._tag + parent + src
                part = memo.get(key)
                if part is None:
                    part = self._hash(parent, src)
                    memo.put(key, part)
            else:  # no memo, or a partial span (the prompt's tail): not worth remembering
                part = self._hash(parent, src)
            new += part
            parent = part[-8:]
            start = end
        ints = array("Q", new)
        if sys.byteorder == "big":  # pragma: no cover
            ints.byteswap()
        self._done += ints.tolist()

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, stride = i.indices(self._n)
            if stride == 1:
                if stop > len(self._done):
                    self._extend(stop)
                return self._done[start:stop]
            return [self[j] for j in range(start, stop, stride)]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("block index out of range")
        if i >= len(self._done):
            self._extend(i + 1)
        return self._done[i]

    def __iter__(self) -> Iterator[int]:
        if len(self._done) < self._n:
            self._extend(self._n)
        return iter(self._done)

    def computed(self) -> int:
        """How many leading hashes have been computed so far."""
        return len(self._done)

    def all(self) -> list[int]:
        if len(self._done) < self._n:
            self._extend(self._n)
        return self._done
