"""Exact top-k (turnkv/attention/top_k.py; the Triton kernels: turnkv/attention/triton/top_k.py for
short rows, radix_top_k.py for long ones) against a stable sort: the k largest of each row, ascending,
the lowest indices winning ties at the threshold. On CPU the kernels run in Triton's interpreter."""

import pytest
import torch

from turnkv.attention import top_k as dispatch

triton_top_k = pytest.importorskip("turnkv.attention.triton.top_k")
radix = pytest.importorskip("turnkv.attention.triton.radix_top_k")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def stable_reference(scores, k):
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


def awkward_scores(rows, n, seed):
    """Random scores with -inf (never chosen while enough others exist), +inf, both zeros and ties."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, n, generator=gen)
    s[:, ::7] = float("-inf")
    s[0, 5] = float("inf")
    s[-1, 10:40] = 0.5  # a tie run
    s[:, 50:60] = -0.0
    s[:, 60:70] = 0.0
    return s


@pytest.mark.parametrize("rows,n,k", [
    (3, 300, 20),     # k not a power of two, n not either
    (2, 2048, 63),    # LServe's rows at 128K (2048 physical pages, K - 1 = 63)
    (1, 500, 1),      # k = 1
    (2, 400, 400),    # k = n: every index
    (2, 3000, 100),   # split over parts (PART), then merged
    (2, 4096, 255),
])
@pytest.mark.parametrize("split", [True, False])
def test_matches_a_stable_sort(rows, n, k, split):
    scores = awkward_scores(rows, n, seed=n + k).to(DEVICE)
    got = triton_top_k.top_k_ascending(scores, k, split=split)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got.cpu(), stable_reference(scores.cpu(), k))


def test_ties_at_the_threshold_take_the_lowest_indices():
    scores = torch.zeros(2, 1500)
    scores[:, 100:110] = 1.0  # 10 sure winners, then 40 of the 1490 zeros: the first ones
    scores[1, 0] = -1.0
    got = triton_top_k.top_k_ascending(scores.to(DEVICE), 50).cpu()
    assert torch.equal(got, stable_reference(scores, 50))
    assert got[0].tolist() == list(range(40)) + list(range(100, 110))
    assert got[1].tolist() == list(range(1, 41)) + list(range(100, 110))


def test_too_few_finite_scores_fill_with_the_first_minus_inf():
    # Pages past a head's history score -inf; callers only read the winners they asked to be valid.
    scores = torch.full((1, 1500), float("-inf"))
    scores[0, 1400:1410] = 2.0
    got = triton_top_k.top_k_ascending(scores.to(DEVICE), 64).cpu()
    assert got[0].tolist() == list(range(54)) + list(range(1400, 1410))


def test_rows_longer_than_one_program_are_refused():
    with pytest.raises(AssertionError):
        triton_top_k.top_k_ascending(torch.zeros(1, triton_top_k.MAX_ROW + 1, device=DEVICE), 4)


def test_batch_dimensions_are_kept():
    scores = awkward_scores(6, 200, seed=1).view(2, 3, 200).to(DEVICE)
    got = triton_top_k.top_k_ascending(scores, 17)
    assert got.shape == (2, 3, 17)
    assert torch.equal(got.cpu(), stable_reference(scores.cpu(), 17))


def test_dispatch_off_cuda_is_torch_topk_sorted():
    scores = torch.randn(4, 300)  # distinct values: every exact top-k agrees
    got = dispatch.top_k_ascending(scores, 33)
    assert torch.equal(got, scores.topk(33, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("rows,n,k,chunk,write_chunk", [
    (3, 5000, 700, 1024, 1024),  # several chunks, the last one partial
    (3, 5000, 700, 1024, 256),   # the last round and the write over smaller chunks than the others
    (2, 3000, 3000, 512, 512),   # k = n
    (1, 2100, 1, 256, 1024),     # k = 1 over nine chunks, written over three
    (2, 9000, 1024, 4096, None),  # LoopServe's k, the default write chunk
])
def test_radix_select_matches_a_stable_sort(rows, n, k, chunk, write_chunk):
    scores = awkward_scores(rows, n, seed=n + k)
    scores[-1, 10:400] = 0.5  # a tie run across chunk borders
    got = radix.top_k_ascending(scores.to(DEVICE), k, chunk=chunk, write_chunk=write_chunk)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got.cpu(), stable_reference(scores, k))


def test_radix_select_ties_and_minus_inf_rows():
    scores = torch.zeros(3, 3000)
    scores[:, 100:110] = 1.0  # 10 sure winners, then the first 40 zeros
    scores[1, 0] = -1.0
    scores[2] = float("-inf")  # nothing finite: the first indices
    scores[2, 2990:] = -5.0
    got = radix.top_k_ascending(scores.to(DEVICE), 50, chunk=512).cpu()
    assert got[0].tolist() == list(range(40)) + list(range(100, 110))
    assert got[1].tolist() == list(range(1, 41)) + list(range(100, 110))
    assert got[2].tolist() == list(range(40)) + list(range(2990, 3000))
    assert torch.equal(got, stable_reference(scores, 50))


def test_radix_select_keeps_batch_dimensions():
    scores = awkward_scores(6, 1500, seed=2).view(2, 3, 1500)
    got = radix.top_k_ascending(scores.to(DEVICE), 100, chunk=512)
    assert got.shape == (2, 3, 100)
    assert torch.equal(got.cpu(), stable_reference(scores, 100))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rows,n,k", [(32, 2048, 63), (64, 4096, 255), (8, 131072 + 77, 1024)])
def test_decode_selection_shapes_on_the_gpu(rows, n, k):
    """Page rows through the one-program kernel; token rows (LoopServe's 128K) through the radix select."""
    scores = torch.rand(rows, n, device="cuda").pow(8)  # many near-ties in the low exponents
    scores[:, n - 100:] = float("-inf")
    scores[:, :4] = float("inf")
    got = dispatch.top_k_ascending(scores, k)
    assert torch.equal(got, stable_reference(scores, k))


@pytest.mark.parametrize("rows,n,k", [(2, 2048, 64), (3, 300, 20), (2, 100, 128)])
def test_candidates_merged_are_the_top_k(rows, n, k):
    """The split path's two stages apart (a consumer kernel merges in its own program): the parts'
    candidates hold each row's k best, merged back to the stable sort's; k past n pads with keys
    below every score."""
    scores = awkward_scores(rows, n, seed=k).to(DEVICE)
    cand = triton_top_k.candidates(scores, k)
    block_k = 1 << (k - 1).bit_length()
    assert cand.dtype == torch.int64 and cand.shape[0] == rows and cand.shape[1] % block_k == 0
    got = triton_top_k.merge_candidates(cand, min(k, n)).cpu()
    assert torch.equal(got, stable_reference(scores.cpu(), min(k, n)))


def test_chosen_indices_as_candidates_merge_back_to_themselves():
    gen = torch.Generator().manual_seed(3)
    chosen = torch.stack([torch.randperm(10_000, generator=gen)[:37] for _ in range(3)])
    keys = triton_top_k.as_candidates(chosen.to(DEVICE))
    assert keys.shape == (3, 64)
    got = triton_top_k.merge_candidates(keys, 37).cpu()
    assert torch.equal(got, chosen.sort(-1).values)
