"""The radix cache's tree node and match result: plain data, no tree logic (worker.radix_cache)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from router.block_hash import block_hashes

EMPTY_PAGES = np.zeros(0, dtype=np.int64)

# LoRA adapters: adapter a's token t is keyed t + (a << ADAPTER_SHIFT), so each adapter's prefixes
# form their own subtrees (its KV differs from the base's for the same tokens); vocabularies below
# 2**20 tokens, adapters 1..2047 (keys stay int32)
ADAPTER_SHIFT = 20
TOKEN_MASK = (1 << ADAPTER_SHIFT) - 1


def adapter_keys(tokens: np.ndarray, adapter: int) -> np.ndarray:
    """The tree keys of ``tokens`` (int32) for a request of ``adapter`` (0: the base model's)."""
    return tokens if adapter == 0 else tokens + np.int32(adapter << ADAPTER_SHIFT)


def page_hashes(key: np.ndarray, page_size: int, parent_hash: int) -> list[int]:
    """Chained block hashes of ``key``'s pages (router.block_hash), fed as a native uint32 array:
    several times cheaper than a list of Python ints for long keys."""
    return block_hashes(array("I", key.tobytes()), page_size, parent=parent_hash)


class TreeNode:
    """One edge of the radix tree: a run of whole pages and the tokens they hold."""

    __slots__ = (
        "children", "device_children", "hashes", "host_pages", "key", "last_access", "lock_ref", "pages",
        "parent", "removed",
    )  # fmt: skip

    def __init__(
        self,
        key: np.ndarray,
        pages: np.ndarray,
        parent: TreeNode | None,
        hashes: list[int] | None,
        last_access: int,
        host_pages: np.ndarray = EMPTY_PAGES,
    ) -> None:
        self.key = key  # int32 tokens, a whole number of pages of them
        self.pages = pages  # int64 device page ids; empty while the node lives on the host
        self.host_pages = host_pages  # int64 host page ids; empty while the node lives on the device
        self.hashes = hashes  # one block hash per page; None when events are off
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}  # keyed by first page's token bytes
        self.device_children = 0  # children that live on the device (O(1) leaf test per tier)
        self.lock_ref = 0
        self.last_access = last_access  # logical clock tick, not seconds
        self.removed = False  # evicted: a stale MatchResult must not lock it

    @property
    def on_device(self) -> bool:
        return self.pages.size > 0

    def __repr__(self) -> str:
        where = "device" if self.on_device else "host"
        return f"TreeNode({where}, tokens={self.key.size}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    pages: np.ndarray  # int64 device page ids of the device part of the match, in order
    num_tokens: int  # cached tokens, device + host; <= len(token_ids) - 1 so >= 1 is left to compute
    last_node: TreeNode  # deepest node of the match: pass to lock()/unlock()
    host_nodes: list[TreeNode] = field(default_factory=list)  # the match's host part, in order

    @property
    def host_tokens(self) -> int:
        """Tokens of the match held in host memory: ``load_back`` brings them to the device."""
        return sum(n.key.size for n in self.host_nodes)
