"""The page side of KV moved between workers (worker/kv_transfer.py is the HTTP side): the pool
slots a transfer pins (export) or takes (import) and their radix-cache bookkeeping, the pool's K/V
read and written a group of slabs at a time, the layout and sizes a transfer carries, and the bytes
and headers of its body. Pool and cache calls here run on the engine thread, between its steps;
nothing here touches the network.

A transfer's KV is one C-contiguous tensor [2 (K, V), layers, tokens, KV heads, head dim] in the
pool's dtype (an fp8 pool's bytes move as they are); its headers (``x-radixgate-kv-start``,
``-block-size``, ``-shape``, ``-dtype``) say what it is, so a receiver checks the layout before reading
the body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from worker.kv_pool import KVPool, raw, slots_for


# ---------------------------------------------------------------------------- engine thread
# A transfer's KV is 2 x layers "slabs": K of layer 0 .. L-1, then V of layer 0 .. L-1, each [tokens,
# KV heads, head dim]; slab f is K (f < L) or V of layer f % L. It moves a group of slabs at a time.
def _slab(pool: Any, f: int) -> Any:
    return (pool.k_cache if f < pool.num_layers else pool.v_cache)[f % pool.num_layers]


def read_kv(pool: Any, slots: Any, lo: int = 0, hi: int | None = None) -> Any:
    """Slabs ``lo`` .. ``hi`` (default: all) of pool ``slots`` (int64 tensor) in one C-contiguous
    CPU tensor [hi - lo, n, heads, dim]: gathered on the pool's device, then copied to the host."""
    import torch

    hi = 2 * pool.num_layers if hi is None else hi
    device = pool.k_cache[0].device
    idx = slots.to(device)
    heads, dim = pool.k_cache[0].shape[1:]
    out = torch.empty(hi - lo, idx.numel(), heads, dim, dtype=pool.k_cache[0].dtype, device=device)
    for i in range(hi - lo):
        torch.index_select(raw(_slab(pool, lo + i)), 0, idx, out=raw(out[i]))
    return out.cpu()


def write_kv(pool: Any, slots: Any, slabs: Any, lo: int = 0) -> None:
    """Write slabs ``lo`` .. ``lo + len(slabs)`` ([m, n, heads, dim]) into pool ``slots``."""
    device = pool.k_cache[0].device
    idx = slots.to(device)
    slabs = slabs.to(device)
    for i in range(slabs.shape[0]):
        raw(_slab(pool, lo + i)).index_copy_(0, idx, raw(slabs[i]))


def export_span(
    cache: Any, page_size: int, tokens: np.ndarray, start: int, max_tokens: int
) -> tuple[Any, int]:
    """The match of ``tokens``' cached prefix (both tiers) as far as an export from ``start``
    (page-aligned) goes, and where that is: at most ``max_tokens`` (whole pages) past ``start``;
    end <= start when nothing. The match stops there, so no more of a host part is loaded back
    than is sent."""
    ps = page_size
    limit = max(0, min((tokens.size - 1) // ps * ps, start + max_tokens // ps * ps))
    # NOTE: one extra token so that the match may cover all of [0, limit) (it always leaves one out)
    match = cache.match_prefix(np.append(tokens[:limit], 0).astype(np.int32))
    return match, match.num_tokens


@dataclasses.dataclass
class Pinned:
    """Pool slots a transfer reads or writes while it is under way, their radix node locked so they
    stay (an export's cached pages; an import's prefix, ``pages`` taken for what it brings)."""

    node: Any
    slots: Any  # int64 tensor: the slots the transfer's tokens occupy, in order
    have: int = 0  # import: the tokens cached here when it began (its first ``skip`` are not written)
    prefix: Any = None  # import: the device pages of tokens[:have]
    pages: Any = None  # import: the pages taken for tokens[have:end]


def export_begin(engine: Any, tokens: np.ndarray, start: int, max_tokens: int) -> Pinned | None:
    """Pin the cached KV of ``tokens`` from ``start`` (page-aligned), at most ``max_tokens`` (whole
    pages), for an export; None when nothing is cached beyond ``start``. Routers see one cache, so
    a host-tier part is sent too: loaded back to the device first, as a local hit's is (LRU pages
    evicted for room); where no room can be made, only the device part is sent."""
    import torch

    cache, ps = engine.cache, engine.page_size
    match, end = export_span(cache, ps, tokens, start, max_tokens)
    if end <= start:
        return None
    cache.lock(match.last_node)
    pages = match.pages
    if match.host_nodes:
        host = match.host_tokens // ps
        cache.make_room(host)
        if engine.allocator.num_free >= host:
            pages = cache.load_back(match)
        end = pages.size * ps
        if end <= start:
            cache.unlock(match.last_node)
            return None
    return Pinned(match.last_node, torch.from_numpy(slots_for(pages, start, end, ps)))


def import_begin(
    cache: Any, allocator: Any, page_size: int, tokens: np.ndarray, start: int, end: int
) -> Pinned | str:
    """Take free pages for ``tokens[have:end]`` behind the cached ``tokens[:have]`` (``have`` >=
    ``start``, both tiers: a host-tier part is loaded back to the device first, as a local hit's
    is; LRU pages are evicted for room, never the prefix extended, which stays locked until
    ``import_end``). Else the outcome, the transfer being of no use here: "cached" when this worker
    caches the whole span already (computed meanwhile), "wasted" when its own prefix is shorter
    than ``start`` now (it left the cache meanwhile) or no pages could be freed."""
    import torch

    ps = page_size
    # NOTE: one extra token so that the match may cover all of [0, end) (it always leaves one out)
    match = cache.match_prefix(np.append(tokens[:end], 0).astype(np.int32))
    have = match.num_tokens
    if have >= end:
        return "cached"
    if have < start:
        return "wasted"
    new = (end - have) // ps
    need = new + match.host_tokens // ps
    cache.lock(match.last_node)
    cache.make_room(need)
    if allocator.num_free < need:
        cache.unlock(match.last_node)
        return "wasted"
    prefix = cache.load_back(match) if match.host_nodes else match.pages
    pages = allocator.alloc(new)
    slots = torch.from_numpy(slots_for(pages, 0, new * ps, ps))
    return Pinned(match.last_node, slots, have, prefix, pages)


def import_end(
    cache: Any, allocator: Any, page_size: int, tokens: np.ndarray, end: int, pin: Pinned, ok: bool
) -> int:
    """Finish an ``import_begin``: with ``ok`` its pages (now written) enter the radix cache (which
    publishes them), else they are freed. Returns the tokens newly cached."""
    cache.unlock(pin.node)
    if not ok:
        allocator.free(pin.pages)
        return 0
    already = cache.insert(tokens[:end], np.concatenate([pin.prefix, pin.pages]))
    duplicates = max(0, already - pin.have) // page_size  # NOTE: computed here meanwhile
    if duplicates:
        allocator.free(pin.pages[:duplicates])
    return end - max(pin.have, already)


def import_pages(
    cache: Any, allocator: Any, page_size: int, tokens: np.ndarray, start: int, end: int,
    write: Callable[[Pinned], None],
) -> int:  # fmt: skip
    """Cache ``tokens[start:end]`` (whole pages) behind the cached ``tokens[:start]`` at once:
    ``import_begin``, ``write(pinned)`` fills its pages, ``import_end``. Returns the tokens newly
    cached (0 when ``import_begin`` took no pages)."""
    pin = import_begin(cache, allocator, page_size, tokens, start, end)
    if isinstance(pin, str):
        return 0
    write(pin)
    return import_end(cache, allocator, page_size, tokens, end, pin, True)


# ---------------------------------------------------------------------------- wire format
EXPORT_PATH = "/v1/kv/export"  # the source's endpoint: POST {token_ids, start, max_tokens, model}
_META = "x-radixgate-kv-"
_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")  # --dtype's, --kv-cache-dtype's


def export_headers(shape: tuple[int, ...], dtype: Any, start: int, block_size: int) -> dict[str, str]:
    """What an export's body is: its place in the prompt, page size, shape and dtype (and length)."""
    size = int(np.prod(shape)) * dtype.itemsize
    return {_META + "start": str(start), _META + "block-size": str(block_size),
            _META + "shape": ",".join(map(str, shape)), _META + "dtype": str(dtype).removeprefix("torch."),
            "content-length": str(size)}  # fmt: skip


def body_view(kv: Any) -> memoryview:
    """The bytes of a C-contiguous tensor, without a copy."""
    import torch

    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def read_headers(headers: Any) -> tuple[int, int, tuple[int, ...], Any]:
    """(start, block size, shape, torch dtype) an export's headers announce; ValueError otherwise."""
    import torch

    try:
        start, block = int(headers[_META + "start"]), int(headers[_META + "block-size"])
        shape = tuple(int(d) for d in headers[_META + "shape"].split(","))
        name = headers[_META + "dtype"]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not a KV export: {exc!r}") from None
    if name not in _DTYPES or len(shape) != 5 or min(shape) < 0:
        raise ValueError(f"not a KV export: shape {shape}, dtype {name!r}")
    return start, block, shape, getattr(torch, name)


# ---------------------------------------------------------------------------- layout and sizes
def kv_layout(engine: Any) -> tuple[int, int, int, Any]:
    """(layers, KV heads of every rank, head dim, dtype) of the engine's pool: a transfer's token."""
    pool = engine.executor.kv_pool
    heads, dim = pool.k_cache[0].shape[1:]
    return pool.num_layers, heads * engine.executor.tensor_parallel_size, dim, pool.k_cache[0].dtype


def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V one cached token holds, every layer and every rank's KV heads."""
    return KVPool.page_bytes(1, *kv_layout(engine))


def transfer_chunking(slab_bytes: int, slabs: int, max_bytes: int) -> tuple[int, int]:
    """(slabs a group carries, host bytes a transfer holds: two groups) for a transfer of ``slabs``
    slabs of ``slab_bytes`` each under a ``max_bytes`` bound: a group is at most 1/16 of the bound,
    or one slab where a slab is larger."""
    group = max(1, min(slabs, max_bytes // 16 // max(slab_bytes, 1)))
    return group, min(2 * group, slabs) * slab_bytes
