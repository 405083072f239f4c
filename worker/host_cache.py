"""Host-memory KV tier: pages of KV evicted from the device pool wait here (pinned CPU memory on
CUDA) until a request needs them again, which then costs a copy instead of a prefill.

Bookkeeping (which host page is free) and the copies live here; which tokens a host page holds
is the radix cache's business. Without a device pool (the simulators) it only keeps the books.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from worker.kv_pool import PageAllocator, raw

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

    def _runs(
        self, host_pages: np.ndarray, device_pages: np.ndarray
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The pairs sorted by host page: (the device slots in that order, on the pool's device; the
        host slot ranges [start, end) of each run of consecutive host pages, in that order).
        NOTE: each run is one contiguous block of pinned memory, so it moves as one DMA copy, with no
        gather or scatter on the CPU and no staging in pageable memory."""
        ps = self.device_pool.page_size  # type: ignore[union-attr]
        host = np.asarray(host_pages, dtype=np.int64)
        order = np.argsort(host, kind="stable")
        host = host[order]
        cuts = np.flatnonzero(np.diff(host) != 1) + 1
        starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [host.size]))
        runs = [(int(host[a]) * ps, (int(host[b - 1]) + 1) * ps) for a, b in zip(starts, ends, strict=True)]
        device = self.device_pool.k_cache[0].device  # type: ignore[union-attr]
        return self._slots(np.asarray(device_pages, dtype=np.int64)[order], device), runs

    def save(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        """Copy the KV of ``device_pages`` into ``host_pages`` (same count, in order)."""
        pool = self.device_pool
        if pool is None or len(host_pages) == 0:
            return
        src, runs = self._runs(host_pages, device_pages)
        for layer in range(pool.num_layers):
            for cache, host in ((pool.k_cache[layer], self.k[layer]), (pool.v_cache[layer], self.v[layer])):
                # NOTE: raw: an fp8 pool's bytes, as torch's CPU index ops have no fp8 kernels
                cache, host = raw(cache), raw(host)
                gathered, at = cache.index_select(0, src), 0  # on the device, in host order
                for start, end in runs:
                    # NOTE: asynchronous into pinned memory (one wait below, not one per run)
                    host[start:end].copy_(gathered[at : at + end - start], non_blocking=True)
                    at += end - start
        if src.is_cuda:
            import torch

            torch.cuda.current_stream(src.device).synchronize()  # the host copy is complete on return

    def load(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Copy the KV of ``host_pages`` into ``device_pages`` (same count, in order)."""
        pool = self.device_pool
        if pool is None or len(host_pages) == 0:
            return
        dst, runs = self._runs(host_pages, device_pages)
        device = dst.device
        for layer in range(pool.num_layers):
            for cache, host in ((pool.k_cache[layer], self.k[layer]), (pool.v_cache[layer], self.v[layer])):
                cache, host, at = raw(cache), raw(host), 0
                for start, end in runs:
                    # NOTE: asynchronous from pinned memory, ordered before every later use of the pool
                    # on this stream; the host pages are only written again by save, also in stream
                    # order (its device-to-host copies wait for this one)
                    block = host[start:end].to(device, non_blocking=True)
                    cache.index_copy_(0, dst[at : at + end - start], block)
                    at += end - start
