"""FlashAttention-4 for prefill chunks (attention/flash.py): the adapter's layouts against the reference
paths through a stand-in that follows FA4's documented contract, which chunks it takes, the engine's
routing against transformers' logits; on a GPU with flash-attn-4 installed, the real kernels against
the fp32 reference (marked gpu)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from turnkv.attention import chunk, flash, reference


def relative_error(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _attend(q, k, v, scale, causal):
    """q [T, Hq, D] over k, v [S, Hk, D] (Hq a multiple of Hk), causal from the bottom right."""
    T, Hq, D = q.shape
    S, Hk = k.shape[:2]
    k, v = k.repeat_interleave(Hq // Hk, 1).float(), v.repeat_interleave(Hq // Hk, 1).float()
    scores = torch.einsum("thd,shd->hts", q.float(), k) * (scale if scale is not None else D**-0.5)
    if causal:
        hidden = torch.arange(S)[None, :] > torch.arange(T)[:, None] + (S - T)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).to(q.dtype)


class StandIn:
    """FA4's two entry points as its docstrings define them, computed entry by entry in plain torch;
    records what each call received."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False):
        # q [B, T, Hq, D], k, v [B, S, Hk, D] -> (out [B, T, Hq, D], lse)
        self.calls.append(("dense", tuple(q.shape)))
        return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])]), None

    def flash_attn_varlen_func(self, q, k, v, seqused_k=None, page_table=None, softmax_scale=None, causal=False):
        # q [N, T, Hq, D]; entry n holds seqused_k[n] keys. Paged: k, v [pages, page_size, Hk, D], key j
        # at page page_table[n, j // page_size], offset j % page_size. Dense: k, v [N, S, Hk, D], key j
        # at k[n, j].
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (q.shape[0],)
        if page_table is None:
            assert k.shape[0] == q.shape[0] and k.shape[1] >= int(seqused_k.max())
            self.calls.append(("gathered", tuple(q.shape)))
            return torch.stack([_attend(q[n], k[n, : int(seqused_k[n])], v[n, : int(seqused_k[n])], softmax_scale,
                                        causal) for n in range(q.shape[0])]), None
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
        self.calls.append(("paged", tuple(q.shape)))
        page = k.shape[1]
        outs = []
        for n in range(q.shape[0]):
            j = torch.arange(int(seqused_k[n]))
            slots = page_table[n, j // page].long() * page + j % page
            keys, values = k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]
            outs.append(_attend(q[n], keys, values, softmax_scale, causal))
        return torch.stack(outs), None


@pytest.fixture
def stand_in(monkeypatch):
    fake = StandIn()
    monkeypatch.setattr(flash, "_interface", lambda: (fake.flash_attn_func, fake.flash_attn_varlen_func))
    return fake


def paged_pool(lengths, page, D, gen):
    """Pages for heads of the given lengths [B][H], in shuffled order -> (k, v, table [B, H, P] int64)."""
    B, H = len(lengths), len(lengths[0])
    per_head = [[-(-n // page) for n in row] for row in lengths]
    total = sum(map(sum, per_head)) + 2
    order = torch.randperm(total, generator=gen)
    k, v = torch.randn(total, page, D, generator=gen), torch.randn(total, page, D, generator=gen)
    table = torch.zeros(B, H, max(map(max, per_head)), dtype=torch.int64)
    at = 0
    for b in range(B):
        for h in range(H):
            n = per_head[b][h]
            table[b, h, :n] = order[at:at + n]
            at += n
    return k, v, table


@pytest.mark.parametrize("attend", ["paged", "gathered"])
@pytest.mark.parametrize("lengths,T", [([[23, 23]], 5), ([[40, 17, 33]], 1), ([[19, 30], [25, 8]], 8)])
def test_paged_and_gathered_equal_the_reference_for_uneven_heads_and_batches(stand_in, attend, lengths, T):
    """Heads of different lengths, partial last pages, one or several sequences: the reference's
    attention, as a [B, Hq, T, D] view of a [B, T, Hq, D] tensor; one FA4 batch entry per (sequence,
    KV head), its query group as heads. Gathered: each head's pages copied into one run first (shorter
    heads padded with whatever their table holds past their pages, which seqused_k leaves out)."""
    gen = torch.Generator().manual_seed(0)
    B, H, G, D = len(lengths), len(lengths[0]), 2, 16
    k, v, table = paged_pool(lengths, 4, D, gen)
    q = torch.randn(B, T, H * G, D, generator=gen).transpose(1, 2)
    lens = torch.tensor(lengths)
    longest = () if attend == "paged" else (max(map(max, lengths)),)  # gathered: the host's max length
    got = getattr(flash, attend)(q, k, v, table, lens, *longest, scale=0.3)
    want = reference.paged_chunk(q, k, v, table, lens, scale=0.3)
    assert relative_error(got, want) < 1e-5
    assert got.transpose(1, 2).is_contiguous()
    assert stand_in.calls == [(attend, (B * H, T, G, D))]


def test_long_chunks_read_the_history_gathered(monkeypatch, stand_in):
    """A step hands FA4 chunks from GATHER_MIN_ROWS new tokens gathered, shorter ones paged."""
    from turnkv.engine.step import Step
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    monkeypatch.setattr(flash, "usable", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(flash, "takes_chunk", lambda *args: True)
    monkeypatch.setattr(flash, "GATHER_MIN_ROWS", 4)
    pool = PagePool(1, 2, 16, 32, page_size=4, dtype=torch.float32)
    seq = SequenceKV(pool)
    seq.reserve(9)
    for T, kind in ((3, "paged"), (4, "gathered")):
        slots = seq.reserve(T)
        positions = torch.arange(seq.next_position - T, seq.next_position)[None]
        step = Step(pool, [seq], [slots], positions)
        q, kv = torch.randn(1, T, 4, 16), torch.randn(1, T, 2, 16)
        step.attention(0, q, kv, kv)
        assert stand_in.calls[-1][0] == kind


@pytest.mark.parametrize("B,T,G", [(1, 7, 4), (2, 5, 1)])
def test_causal_equals_the_reference(stand_in, B, T, G):
    gen = torch.Generator().manual_seed(1)
    H, D = 2, 8
    q = torch.randn(B, T, H * G, D, generator=gen).transpose(1, 2)
    kv = torch.randn(B, T, 2, H, D, generator=gen)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    got = flash.causal(q, k, v)
    assert relative_error(got, reference.causal_prefill(q, k, v)) < 1e-5
    assert got.transpose(1, 2).is_contiguous() and stand_in.calls == [("dense", (B, T, H * G, D))]


def test_usable_needs_the_package_a_half_precision_and_the_switch(stand_in, monkeypatch):
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert not flash.usable(cpu, bf16, 128)  # a CPU tensor: FA4 runs on Hopper and Blackwell
    monkeypatch.setattr(flash, "FORCE", True)
    assert flash.usable(cpu, bf16, 128) and flash.usable(cpu, torch.float16, 64)
    assert not flash.usable(cpu, torch.float32, 128)
    assert not flash.usable(cpu, bf16, 100) and not flash.usable(cpu, bf16, 512)
    monkeypatch.setattr(flash, "ENABLED", False)
    assert not flash.usable(cpu, bf16, 128)
    monkeypatch.setattr(flash, "ENABLED", True)
    monkeypatch.setattr(flash, "_interface", lambda: None)  # not installed
    assert not flash.usable(cpu, bf16, 128)


@pytest.mark.parametrize("new,history,taken", [
    (512, 32768, True), (384, 32768, False), (256, 131072, False), (384, 131072, True), (1024, 8192, False),
    (4096, 8192, True), (64, 131072, False), (32768, 98304, True)])
def test_takes_chunks_with_work_enough_for_its_host_cost_and_no_key_splits(monkeypatch, new, history, taken):
    """Llama-3.1-8B's heads (8 KV heads, groups of 4) on a 132-SM H100, the cells the thresholds come
    from (benchmarks/prefill/README.md): FA4 where it measured faster than the paged kernel."""
    monkeypatch.setattr(flash, "num_sms", lambda index: 132)
    assert flash.takes_chunk(torch.device("cuda"), 8, 4, new, history + new) is taken


def test_fresh_chunks_take_it_from_its_threshold(stand_in, monkeypatch):
    monkeypatch.setattr(flash, "usable", lambda device, dtype, head_dim: True)
    least = flash.FRESH_MIN_ROWS
    for T in (least - 1, least):
        q = torch.zeros(1, 2, T, 8)
        chunk.fresh_causal(q, q[:, :1], q[:, :1])
    assert stand_in.calls == [("dense", (1, least, 2, 8))]


def test_later_chunks_through_flash_match_transformers(tmp_path, monkeypatch, stand_in):
    """A tiny model prefilled in chunks of 8 over two turns with FA4 taking every chunk (its first
    chunk fresh, the others over history) gives transformers' logits of the whole sequence at once."""
    from tests.conftest import two_turn_logits

    monkeypatch.setattr(flash, "usable", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(flash, "takes_chunk", lambda *args: True)
    monkeypatch.setattr(flash, "takes_fresh", lambda num_new: True)
    ours, ref, c = two_turn_logits(tmp_path, "llama", "cpu")
    kinds = [kind for kind, _ in stand_in.calls]
    assert kinds == ["dense"] * c.num_layers + ["paged"] * 4 * c.num_layers
    assert relative_error(ours, ref) < 1e-4
    # The same with every later chunk's history gathered.
    stand_in.calls.clear()
    monkeypatch.setattr(flash, "GATHER_MIN_ROWS", 1)
    ours, ref, c = two_turn_logits(tmp_path / "gathered", "llama", "cpu")
    assert [kind for kind, _ in stand_in.calls] == ["dense"] * c.num_layers + ["gathered"] * 4 * c.num_layers
    assert relative_error(ours, ref) < 1e-4


def test_windows_sinks_and_quantized_pools_keep_the_paged_kernel(monkeypatch, stand_in):
    """FA4 reads whole heads of a pool in the compute dtype: a step over an int8 pool or with a sliding
    window does not take it."""
    from turnkv.engine.step import Step
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    monkeypatch.setattr(flash, "usable", lambda device, dtype, head_dim: True)
    for kv_dtype, window, taken in ((None, None, True), ("int8", None, False), (None, 4, False)):
        pool = PagePool(1, 2, 16, 32, page_size=4, dtype=torch.float32, kv_dtype=kv_dtype)
        seq = SequenceKV(pool)
        seq.reserve(9)
        slots = seq.reserve(3)
        positions = torch.arange(9, 12)[None]
        assert Step(pool, [seq], [slots], positions, sliding_window=window).flash_history is taken


def test_warm_up_compiles_both_kernels_at_the_engines_shapes(stand_in, monkeypatch):
    """An engine's load runs one fresh and one paged call at its head counts and page size (FA4 compiles
    per head-count ratio, head dim and page size); nothing where FA4 is not used."""
    flash.warm_up(torch.device("cpu"), torch.bfloat16, 8, 2, 16, 4)
    assert stand_in.calls == []
    monkeypatch.setattr(flash, "usable", lambda device, dtype, head_dim: True)
    flash.warm_up(torch.device("cpu"), torch.float32, 8, 2, 16, 4)
    assert stand_in.calls == [("dense", (1, 256, 8, 16)), ("paged", (2, 256, 4, 16))]


def test_a_package_that_fails_to_run_is_switched_off_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(flash, "_interface", lambda: (broken, broken))
    monkeypatch.setattr(flash, "FORCE", True)
    monkeypatch.setattr(flash, "ENABLED", True)
    assert flash.usable(torch.device("cpu"), torch.bfloat16, 16)
    with pytest.warns(UserWarning, match="no kernel image for this GPU"):
        flash.warm_up(torch.device("cpu"), torch.bfloat16, 8, 2, 16, 4)
    assert not flash.usable(torch.device("cpu"), torch.bfloat16, 16)


def test_an_engine_warms_it_up_as_it_loads(monkeypatch, chat_model_dir):
    from turnkv.engine.llm import LLM

    calls = []
    monkeypatch.setattr(flash, "warm_up", lambda *args: calls.append(args))
    llm = LLM(str(chat_model_dir), device="cpu", kv_memory="16MiB")
    c = llm.config
    assert calls == [(llm.device, llm.dtype, c.num_heads, c.num_kv_heads, c.head_dim, llm.pool.page_size)]


# ---- the GPU lane: the real FA4 kernels, bf16 ------------------------------------------------------------

REAL = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")
                               and flash._interface() is not None
                               and flash.usable(torch.device("cuda"), torch.bfloat16, 128)),
                          reason="needs flash-attn-4 on a Hopper or Blackwell GPU")


@pytest.mark.gpu
@REAL
@pytest.mark.parametrize("attend", ["paged", "gathered"])
@pytest.mark.parametrize("lengths,T", [([[4000 + 1024] * 8], 1024), ([[3000 + 131 * h for h in range(8)]] * 2, 300)])
def test_real_paged_and_gathered_match_the_reference_bf16(attend, lengths, T):
    """Even heads, and two sequences of uneven heads with partial last pages; the gathered runs give
    what the in-place pages give (the same kernel, its loads apart)."""
    gen = torch.Generator().manual_seed(2)
    k, v, table = (t.cuda() for t in paged_pool(lengths, 16, 128, gen))
    k, v = k.bfloat16(), v.bfloat16()
    B = len(lengths)
    q = torch.randn(B, T, 32, 128, generator=gen).cuda().bfloat16().transpose(1, 2)
    lens = torch.tensor(lengths).cuda()
    longest = () if attend == "paged" else (max(map(max, lengths)),)
    got = getattr(flash, attend)(q, k, v, table, lens, *longest)
    want = reference.paged_chunk(q.float(), k.float(), v.float(), table, lens)
    assert got.dtype == torch.bfloat16 and relative_error(got, want) < 2e-2
    assert relative_error(got, flash.paged(q, k, v, table, lens)) < 1e-3


@pytest.mark.gpu
@REAL
@pytest.mark.parametrize("B,T", [(1, 4096), (2, 1000)])
def test_real_causal_matches_the_reference_bf16(B, T):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, 32, 128, generator=gen).cuda().bfloat16().transpose(1, 2)
    kv = torch.randn(B, T, 2, 8, 128, generator=gen).cuda().bfloat16()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    got = flash.causal(q, k, v)
    # fp32 reference for the first KV head's group (the full fp32 GQA path materializes every score)
    want = reference.causal_prefill(q[:, :4].float(), k[:, :1].float(), v[:, :1].float())
    assert got.dtype == torch.bfloat16 and relative_error(got[:, :4], want) < 2e-2
