"""Paged KV pool: a page allocator (bookkeeping only) and per-layer K/V tensors addressed by slot.

Never frees a page twice or hands out a page it does not own; torch is imported only by KVPool,
so the allocator (used by the cluster simulator) stays cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class PageAllocator:
    """Hands out page ids in [0, num_pages); a page is either free here or owned by exactly one
    holder (a running request or the radix cache)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # NOTE: _stack[:_top] are the free pages; alloc pops from the top. Reversed so that a fresh
        # allocator hands out pages 0, 1, 2, ... (stable layouts make tests and dumps readable).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        """Free pages."""
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` page ids (int64), or None and nothing taken when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._top:
            return None
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[pages] = False
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Return ``pages`` to the pool. Out-of-range ids, pages already free, or an id listed
        twice raise ValueError and leave the allocator unchanged."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return
        if pages.min() < 0 or pages.max() >= self.num_pages:
            raise ValueError(f"page id out of range [0, {self.num_pages})")
        if self._is_free[pages].any():
            bad = pages[self._is_free[pages]]
            raise ValueError(f"double free of pages {bad[:8].tolist()}")
        if np.unique(pages).size != pages.size:
            raise ValueError("the same page is listed twice in one free()")
        self._is_free[pages] = True
        self._stack[self._top : self._top + pages.size] = pages
        self._top += pages.size

    def is_free(self, pages: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``pages`` are currently free (for invariant checks)."""
        return self._is_free[np.asarray(pages, dtype=np.int64)]


def slots_for(pages: np.ndarray, start: int, end: int, page_size: int) -> np.ndarray:
    """Slot ids (int64) of token positions [start, end) of a sequence laid out on ``pages``.

    Token j of page p lives in slot p * page_size + j.
    """
    pages = np.asarray(pages, dtype=np.int64)
    if not 0 <= start <= end <= pages.size * page_size:
        raise ValueError(
            f"positions [{start}, {end}) outside the {pages.size * page_size} tokens of {pages.size} pages"
        )
    pos = np.arange(start, end, dtype=np.int64)
    return pages[pos // page_size] * page_size + pos % page_size


class KVPool:
    """Preallocated K and V caches for every layer, each [num_pages * page_size + 1, Hkv, D].

    NOTE: the last row, ``scratch_slot``, belongs to no page: padded rows of a fixed-size batch (CUDA
    graphs) write their K/V there, and nothing ever reads it."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        import torch

        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.allocator = PageAllocator(num_pages)
        self.scratch_slot = num_pages * page_size
        shape = (num_pages * page_size + 1, num_kv_heads, head_dim)
        self.k_cache: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v_cache: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    @property
    def dtype(self) -> Any:
        return self.k_cache[0].dtype

    @staticmethod
    def page_bytes(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any) -> int:
        """Bytes one page takes: K and V, all layers."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def kv_cache_dtype(name: str, model_dtype: Any, device: Any) -> Any:
    """The KV pool's torch dtype for --kv-cache-dtype ``name``: "auto" is the model's; fp8_e4m3 (or "fp8",
    vLLM's name for it) and fp8_e5m2 store each K/V value in one byte (kernels.reference.to_pool:
    saturated, rounded to nearest even), which the attention kernels widen back as they read. ValueError
    where the device cannot: Triton converts e4m3 on CUDA from compute capability 8.9 (Ada, Hopper) only."""
    import torch

    from kernels.host_checks import e4m3_supported

    if name == "auto":
        return model_dtype
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    if name not in fp8:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected auto, fp8 (fp8_e4m3), fp8_e4m3 or fp8_e5m2")
    if fp8[name] == torch.float8_e4m3fn and not e4m3_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs compute capability 8.9 or later (this GPU is {major}.{minor}); "
            "fp8_e5m2 runs on it"
        )
    return fp8[name]


def raw(cache: Any) -> Any:
    """``cache`` as the byte-copy paths move it (host tier, KV transfers): an fp8 pool viewed as uint8
    (torch's CPU index_copy_ has no fp8 kernel), any other as it is. NOTE: a view; writes go through."""
    import torch

    from kernels.host_checks import FP8_POOL_DTYPES

    return cache.view(torch.uint8) if cache.dtype in FP8_POOL_DTYPES else cache
