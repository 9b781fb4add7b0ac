"""PagePool: page accounting, all-or-nothing allocation, release/reuse order and raw writes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from turnkv.errors import InvalidRequestError, KVCacheFullError, TurnkvError
from turnkv.kv.pool import PagePool

L, H, D, PS = 2, 2, 8, 4


def make_pool(num_pages=6, layers=L, heads=H, head_dim=D, page_size=PS, dtype=torch.float32):
    return PagePool(layers, heads, head_dim, num_pages, page_size, dtype=dtype)


def free_counts(pool):
    return [pool.free_pages(layer) for layer in range(pool.num_layers)]


# ---- construction and sizes -------------------------------------------------------------------

@pytest.mark.parametrize(
    "dtype, element, expected_page_bytes",
    [(torch.float32, 4, 2 * 4 * 8 * 4), (torch.bfloat16, 2, 2 * 4 * 8 * 2), (torch.float16, 2, 128)],
)
def test_page_bytes_and_capacity(dtype, element, expected_page_bytes):
    pool = make_pool(num_pages=6, dtype=dtype)
    assert pool.page_bytes == 2 * PS * D * element == expected_page_bytes
    assert pool.capacity_bytes() == L * 6 * expected_page_bytes
    assert pool.bytes_in_use() == 0
    assert pool.k.shape == pool.v.shape == (L, 6, PS, D)
    assert pool.k.dtype == pool.v.dtype == dtype
    assert pool.positions.shape == (L, 6, PS) and pool.positions.dtype == torch.int64


def test_fresh_pool_is_zeroed_and_all_free():
    pool = make_pool(num_pages=5)
    assert free_counts(pool) == [5, 5]
    assert [pool.used_pages(layer) for layer in range(L)] == [0, 0]
    assert torch.count_nonzero(pool.k) == 0 and torch.count_nonzero(pool.v) == 0
    assert torch.count_nonzero(pool.positions) == 0


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 4)])
def test_constructor_rejects_empty_pool(num_pages, page_size):
    with pytest.raises(ValueError):
        PagePool(L, H, D, num_pages, page_size)


def test_for_budget_sizes_pool_within_budget():
    config = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)
    page_bytes = 2 * 4 * 8 * 4  # 256 for fp32
    budget = 10 * page_bytes * 3 + page_bytes  # room for 10 pages per layer, and a bit over
    pool = PagePool.for_budget(config, budget, page_size=4, dtype=torch.float32, device="cpu")
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size) == (3, 2, 8, 4)
    assert pool.num_pages == 10
    assert pool.capacity_bytes() == 10 * 3 * page_bytes <= budget

    pool16 = PagePool.for_budget(config, budget, page_size=4, dtype=torch.bfloat16, device="cpu")
    assert pool16.num_pages == budget // (128 * 3) == 20
    assert pool16.dtype == torch.bfloat16


def test_for_budget_too_small_raises_kv_full():
    config = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=8)
    page_bytes = 2 * 4 * 8 * 4
    # 2 pages per layer < 3 KV heads; the message names the smallest pool, 3 pages x 2 layers
    assert PagePool.smallest_budget(config, 4, torch.float32) == 3 * page_bytes * 2 == 1536
    with pytest.raises(KVCacheFullError, match=r"a KV pool of 1 KiB cannot hold one page of 4 tokens per KV head in "
                                               r"every layer; this model needs at least 1\.5 KiB \(1536 bytes\)"):
        PagePool.for_budget(config, 2 * page_bytes * 2, page_size=4, dtype=torch.float32, device="cpu")
    # exactly 3 pages per layer is enough
    pool = PagePool.for_budget(config, 3 * page_bytes * 2, page_size=4, dtype=torch.float32, device="cpu")
    assert pool.num_pages == 3


def test_error_hierarchy():
    assert issubclass(KVCacheFullError, TurnkvError)
    assert not issubclass(KVCacheFullError, ValueError)
    assert issubclass(InvalidRequestError, ValueError)


# ---- allocate / release -----------------------------------------------------------------------

def test_allocate_hands_out_lowest_ids_first_per_layer():
    pool = make_pool(num_pages=6)
    assert [p.tolist() for p in pool.allocate([2, 3])] == [[0, 1], [0, 1, 2]]
    assert free_counts(pool) == [4, 3]
    assert [p.tolist() for p in pool.allocate([1, 0])] == [[2], []]
    assert free_counts(pool) == [3, 3]
    assert pool.used_pages(0) == 3 and pool.used_pages(1) == 3
    assert pool.bytes_in_use() == 6 * pool.page_bytes


def test_allocate_zero_takes_nothing():
    pool = make_pool(num_pages=3)
    assert [p.tolist() for p in pool.allocate([0, 0])] == [[], []]
    assert free_counts(pool) == [3, 3]


def test_allocate_exact_capacity_then_full():
    pool = make_pool(num_pages=3)
    assert [p.tolist() for p in pool.allocate([3, 3])] == [[0, 1, 2], [0, 1, 2]]
    assert free_counts(pool) == [0, 0]
    assert pool.bytes_in_use() == pool.capacity_bytes()
    with pytest.raises(KVCacheFullError):
        pool.allocate([1, 0])
    assert [p.tolist() for p in pool.allocate([0, 0])] == [[], []]


def test_allocate_is_all_or_nothing_across_layers():
    pool = make_pool(num_pages=5, layers=3)
    pool.allocate([1, 1, 3])  # layer 2 has 2 free pages left
    before = free_counts(pool)
    assert before == [4, 4, 2]
    with pytest.raises(KVCacheFullError) as info:
        pool.allocate([4, 4, 3])  # layers 0 and 1 could give, layer 2 cannot
    assert free_counts(pool) == before
    message = str(info.value)
    assert "KV pool full" in message
    assert "layer 2 needs 3 pages and has 2 free" in message
    assert "5 pages of 4 tokens per layer" in message
    # nothing was taken: the next allocation continues with the same ids
    assert [p.tolist() for p in pool.allocate([4, 4, 2])] == [[1, 2, 3, 4], [1, 2, 3, 4], [3, 4]]
    assert free_counts(pool) == [0, 0, 0]


def test_allocate_error_names_first_short_layer():
    pool = make_pool(num_pages=2, layers=3)
    with pytest.raises(KVCacheFullError, match=r"layer 1 needs 3 pages and has 2 free"):
        pool.allocate([2, 3, 5])
    assert free_counts(pool) == [2, 2, 2]


def test_release_then_allocate_reuses_same_ids_in_same_order():
    pool = make_pool(num_pages=6)
    first = pool.allocate([4, 2])
    assert [p.tolist() for p in first] == [[0, 1, 2, 3], [0, 1]]
    pool.release(0, [1, 3])
    pool.release(1, torch.tensor([0, 1]))  # tensors are accepted too
    assert free_counts(pool) == [4, 6]
    assert pool.bytes_in_use() == 2 * pool.page_bytes
    assert [p.tolist() for p in pool.allocate([2, 2])] == [[1, 3], [0, 1]]
    assert [p.tolist() for p in pool.allocate([2, 0])] == [[4, 5], []]
    assert free_counts(pool) == [0, 4]


def test_pages_are_int64_arrays_whatever_was_released():
    pool = make_pool(num_pages=4)
    pages = pool.allocate([2, 0])[0]
    pool.release(0, torch.tensor(pages))
    taken = pool.allocate([2, 0])[0]
    assert taken.dtype == np.int64 and taken.tolist() == [0, 1]


def test_release_past_capacity_is_refused():
    pool = make_pool(num_pages=2)
    with pytest.raises(ValueError):
        pool.release(0, [0])  # nothing was taken: a third free page cannot exist
    assert free_counts(pool)[0] == 2


# ---- write ------------------------------------------------------------------------------------

def test_write_places_rows_at_flat_slots_of_one_layer():
    pool = make_pool(num_pages=3)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, D, generator=g)
    v = torch.randn(3, D, generator=g)
    slots = torch.tensor([1, 4, 11])  # page 0 off 1, page 1 off 0, page 2 off 3
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1, 0, 1], k[0]) and torch.equal(pool.v[1, 0, 1], v[0])
    assert torch.equal(pool.k[1, 1, 0], k[1]) and torch.equal(pool.v[1, 1, 0], v[1])
    assert torch.equal(pool.k[1, 2, 3], k[2]) and torch.equal(pool.v[1, 2, 3], v[2])
    # nothing else moved: layer 0 untouched, other slots of layer 1 still zero
    assert torch.count_nonzero(pool.k[0]) == 0 and torch.count_nonzero(pool.v[0]) == 0
    mask = torch.ones(3 * PS, dtype=torch.bool)
    mask[slots] = False
    assert torch.count_nonzero(pool.k[1].reshape(-1, D)[mask]) == 0
    assert torch.count_nonzero(pool.v[1].reshape(-1, D)[mask]) == 0


def test_write_overwrites_and_keeps_bf16_exact():
    pool = make_pool(num_pages=2, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(2, D, generator=g).bfloat16(), torch.randn(2, D, generator=g).bfloat16()
    k2, v2 = torch.randn(1, D, generator=g).bfloat16(), torch.randn(1, D, generator=g).bfloat16()
    pool.write(0, torch.tensor([2, 5]), k1, v1)
    pool.write(0, torch.tensor([5]), k2, v2)
    flat_k, flat_v = pool.k[0].reshape(-1, D), pool.v[0].reshape(-1, D)
    assert torch.equal(flat_k[2], k1[0]) and torch.equal(flat_v[2], v1[0])
    assert torch.equal(flat_k[5], k2[0]) and torch.equal(flat_v[5], v2[0])


def test_allocate_pops_each_layers_free_stack_and_fails_whole():
    pool = PagePool(3, 2, 4, 10, 4, dtype=torch.float32)
    first = pool.allocate([2, 0, 3])
    assert [p.tolist() for p in first] == [[0, 1], [], [0, 1, 2]]  # the stack's top first
    pool.release(0, [1])
    flat = pool.allocate_flat(np.array([2, 1, 0]))
    assert flat.tolist() == [1, 2, 0]  # layer 0 takes its freed page back first, then layer 1's top
    assert [pool.free_pages(layer) for layer in range(3)] == [7, 9, 7]
    assert (pool.refs[0, [0, 1, 2]] == 1).all() and pool.refs[1, 0] == 1
    with pytest.raises(KVCacheFullError, match="layer 1 needs 10 pages and has 9 free"):
        pool.allocate([1, 10, 1])
    assert [pool.free_pages(layer) for layer in range(3)] == [7, 9, 7]  # nothing taken


def test_release_of_pages_from_several_layers_at_once_matches_one_layer_at_a_time():
    batched, single = PagePool(3, 2, 4, 6, 4), PagePool(3, 2, 4, 6, 4)
    for pool in (batched, single):
        pool.allocate([3, 2, 4])
        pool.share(2, [1])  # a page with two holders: released once, it stays in use
    layers, pages = np.array([0, 0, 2, 2, 2]), np.array([2, 0, 1, 3, 0])
    batched.release(layers, pages)
    for layer in (0, 2):
        single.release(layer, pages[layers == layer])
    assert (batched.refs == single.refs).all() and batched.refs[2, 1] == 1
    assert [batched.free_pages(layer) for layer in range(3)] == [5, 4, 4] == [single.free_pages(x) for x in range(3)]
    assert [p.tolist() for p in batched.allocate([2, 0, 2])] == [p.tolist() for p in single.allocate([2, 0, 2])]
    with pytest.raises(ValueError, match="layer 1: releasing pages that are not in use"):
        batched.release(np.array([0, 1]), np.array([1, 5]))
    assert batched.refs[0, 1] == 1  # refused whole: nothing released


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_copy_pages_across_layers_in_one_call_matches_one_layer_at_a_time(kv_dtype):
    def filled():
        pool = PagePool(3, 2, D, 6, 4, dtype=torch.float32, kv_dtype=kv_dtype)
        g = torch.Generator().manual_seed(3)
        for layer in range(3):
            pool.write(layer, torch.arange(24), torch.randn(24, D, generator=g), torch.randn(24, D, generator=g))
            pool.positions[layer] = torch.arange(24).view(6, 4) * (layer + 1)
            pool.attention_mass[layer] = torch.rand(6, 4, generator=g)
        return pool

    batched, single = filled(), filled()
    layers, src, dst = np.array([0, 2, 2]), np.array([1, 0, 4]), np.array([5, 3, 1])
    batched.copy_pages(layers, src, dst)
    for layer, s, d in zip(layers, src, dst):
        single.copy_pages(int(layer), [s], [d])
    for name in ("k", "v", "k_scale", "v_scale", "positions", "attention_mass"):
        a, b = getattr(batched, name), getattr(single, name)
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    assert torch.equal(batched.positions[2, 3], batched.positions[2, 0]) and batched.positions[2, 0, 1] == 3
    fresh = filled()
    assert torch.equal(batched.positions[1], fresh.positions[1])  # layer 1 untouched
    assert torch.equal(batched.attention_mass[1], fresh.attention_mass[1])
