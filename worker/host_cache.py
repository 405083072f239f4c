"""Host-memory KV tier: pages of KV evicted from the device pool wait here (pinned CPU memory on
CUDA) until a request needs them again, which then costs a copy instead of a prefill.

Bookkeeping (which host page is free) and the copies live here; which tokens a host page holds
is the radix cache's business. Without a device pool (the simulators) it only keeps the books.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from worker.kv_pool import PageAllocator

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from worker.kv_pool import KVPool


class HostKVPool:
    """``num_pages`` host pages shaped like the device pool's pages, all layers, K and V."""

    def __init__(self, num_pages: int, device_pool: KVPool | None = None) -> None:
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.device_pool = device_pool
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        if device_pool is None:
            return
        import torch

        ref = device_pool.k_cache[0]
        shape = (num_pages * device_pool.page_size, *ref.shape[1:])
        pin = ref.is_cuda  # NOTE: pinned pages make the copies DMA transfers; pointless on a CPU pool
        for _ in range(device_pool.num_layers):
            self.k.append(torch.empty(shape, dtype=ref.dtype, pin_memory=pin))
            self.v.append(torch.empty(shape, dtype=ref.dtype, pin_memory=pin))

    @staticmethod
    def page_bytes(device_pool: KVPool) -> int:
        """Host bytes one page takes (equal to a device page)."""
        ref = device_pool.k_cache[0]
        return 2 * device_pool.num_layers * device_pool.page_size * ref[0].numel() * ref.element_size()

    def _slots(self, pages: np.ndarray, device: torch.device) -> torch.Tensor:
        import torch

        ps = self.device_pool.page_size  # type: ignore[union-attr]
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
        return torch.from_numpy(slots).to(device)

    def save(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        """Copy the KV of ``device_pages`` into ``host_pages`` (same count, in order)."""
        pool = self.device_pool
        if pool is None:
            return
        src = self._slots(device_pages, pool.k_cache[0].device)
        dst = self._slots(host_pages, self.k[0].device)
        for layer in range(pool.num_layers):
            self.k[layer].index_copy_(0, dst, pool.k_cache[layer].index_select(0, src).cpu())
            self.v[layer].index_copy_(0, dst, pool.v_cache[layer].index_select(0, src).cpu())

    def load(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Copy the KV of ``host_pages`` into ``device_pages`` (same count, in order)."""
        pool = self.device_pool
        if pool is None:
            return
        device = pool.k_cache[0].device
        src = self._slots(host_pages, self.k[0].device)
        dst = self._slots(device_pages, device)
        for layer in range(pool.num_layers):
            pool.k_cache[layer].index_copy_(0, dst, self.k[layer].index_select(0, src).to(device))
            pool.v_cache[layer].index_copy_(0, dst, self.v[layer].index_select(0, src).to(device))
