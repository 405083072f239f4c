"""Page allocator, slot layout and the K/V pool tensors."""

import numpy as np
import pytest
import torch

from worker.kv_pool import KVPool, PageAllocator, slots_for


def test_alloc_hands_out_distinct_pages_until_empty() -> None:
    alloc = PageAllocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(5)
    assert a is not None and b is not None
    assert a.dtype == np.int64
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(8))
    assert alloc.num_free == 0
    assert alloc.alloc(0).size == 0


def test_alloc_too_many_returns_none_and_takes_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1
    assert alloc.alloc(1) is not None


def test_freed_pages_are_reused() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(4)
    alloc.free(pages[1:3])
    assert alloc.num_free == 2
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(pages[1:3].tolist())


@pytest.mark.parametrize(
    "bad",
    [np.array([9]), np.array([-1]), np.array([0, 0])],
    ids=["out-of-range", "negative", "twice-in-one-call"],
)
def test_bad_free_raises_and_changes_nothing(bad: np.ndarray) -> None:
    alloc = PageAllocator(4)
    alloc.alloc(4)
    with pytest.raises(ValueError):
        alloc.free(bad)
    assert alloc.num_free == 0


def test_double_free_raises() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])
    assert alloc.num_free == 4


def test_slots_for_maps_positions_through_pages() -> None:
    pages = np.array([5, 2, 7], dtype=np.int64)
    slots = slots_for(pages, 2, 9, page_size=4)
    # positions 2,3 on page 5; 4..7 on page 2; 8 on page 7
    assert slots.tolist() == [22, 23, 8, 9, 10, 11, 28]
    assert slots_for(pages, 3, 3, 4).size == 0
    with pytest.raises(ValueError):
        slots_for(pages, 0, 13, 4)


def test_kv_pool_shapes_and_slot_addressing() -> None:
    pool = KVPool(num_pages=6, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                  dtype=torch.float16, device="cpu")  # fmt: skip
    assert len(pool.k_cache) == len(pool.v_cache) == 2
    # 6 pages x 4 slots, plus the scratch row that no page owns
    assert pool.k_cache[0].shape == (25, 2, 8) and pool.k_cache[0].dtype == torch.float16
    assert pool.scratch_slot == 24
    pages = pool.allocator.alloc(2)
    slots = torch.from_numpy(slots_for(pages, 0, 6, pool.page_size))
    k = torch.randn(6, 2, 8, dtype=torch.float16)
    pool.k_cache[1][slots] = k
    assert torch.equal(pool.k_cache[1][slots], k)
    assert pool.k_cache[0].abs().sum() == 0  # other layers untouched


def test_page_bytes_counts_k_and_v_over_all_layers() -> None:
    # 2 (K,V) * 32 layers * 16 tokens * 8 heads * 128 dims * 2 bytes
    assert KVPool.page_bytes(16, 32, 8, 128, torch.bfloat16) == 2 * 32 * 16 * 8 * 128 * 2
    assert KVPool.page_bytes(16, 1, 1, 1, torch.float32) == 2 * 16 * 4
