"""The decoder's Triton kernels (turnkv/model/triton) against the torch ops they replace: the skinny
matmul, residual add + RMSNorm, in-place RoPE and SiLU * up; then the whole decoder with the kernels
forced on against the torch path, and the torch path against textbook pre-norm blocks that add
the residual inside each block. On CPU they run in Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from turnkv.engine.runner import ModelRunner  # noqa: E402
from turnkv.kv.pool import PagePool  # noqa: E402
from turnkv.kv.sequence import SequenceKV  # noqa: E402
from turnkv.model import ops  # noqa: E402
from turnkv.model.config import ModelConfig  # noqa: E402
from turnkv.model.load import empty_model  # noqa: E402
from turnkv.model.triton.activation import silu_mul_in_place  # noqa: E402
from turnkv.model.triton.gemv import skinny_matmul  # noqa: E402
from turnkv.model.triton.norm import add_rms_norm  # noqa: E402
from turnkv.model.triton.rope import rope_in_place, rope_store  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-2), (torch.bfloat16, 1e-2)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# --- skinny matmul ---------------------------------------------------------------------------------

GEMV_CONFIGS = {
    "fma": dict(block_n=8, block_k=64, num_warps=4, num_stages=1, split_k=1, dot=False),
    "fma-split3": dict(block_n=8, block_k=32, num_warps=4, num_stages=1, split_k=3, dot=False),
    "dot": dict(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=1, dot=True),
    "dot-split2": dict(block_n=16, block_k=64, num_warps=4, num_stages=2, split_k=2, dot=True),
}


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("config", sorted(GEMV_CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_matmul_matches_linear(dtype, tol, M, config, bias):
    if dtype == torch.bfloat16 and GEMV_CONFIGS[config]["dot"] and not CUDA:
        pytest.skip("Triton's interpreter computes bf16 dots wrongly")
    N, K = 37, 200  # N not a multiple of the tile, K not a multiple of block_k nor of the splits
    x, w = randn(M, K, dtype=dtype, seed=1), randn(N, K, dtype=dtype, seed=2)
    b = randn(N, dtype=dtype, seed=3) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    skinny_matmul(x, w, b, out=out, config=GEMV_CONFIGS[config])
    assert not out.isnan().any(), "every output element must be written"
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert rel_err(out, ref) < tol


def test_skinny_matmul_reads_strided_rows_and_default_settings():
    """down_proj's input is the gate half of the gate/up output: rows 2K apart."""
    M, N, K = 3, 50, 96
    wide = randn(M, 2 * K, seed=4)
    w = randn(N, K, seed=5)
    out = skinny_matmul(wide[:, :K], w)
    assert rel_err(out, wide[:, :K].double() @ w.double().T) < 1e-5


def test_split_k_counters_are_left_at_zero_for_the_next_launch():
    from turnkv.model.triton import gemv

    x, w = randn(2, 128, seed=6), randn(24, 128, seed=7)
    config = dict(GEMV_CONFIGS["fma-split3"])
    first = skinny_matmul(x, w, config=config)
    second = skinny_matmul(x, w, config=config)
    assert torch.equal(first, second)
    assert not gemv._arrivals[x.device].any()


# --- residual add + RMSNorm ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("R,H,block", [(1, 64, None), (5, 100, None), (3, 100, 32)])  # block < H: looped
def test_add_rms_norm_matches_add_then_norm(dtype, tol, R, H, block):
    x, residual, w = randn(R, H, dtype=dtype, seed=8), randn(R, H, dtype=dtype, seed=9), randn(H, dtype=dtype, seed=10)
    expected_residual = (residual.float() + x.float()).to(dtype)
    ref = F.rms_norm(expected_residual.double(), (H,), w.double(), 1e-6)
    out = torch.full_like(x, float("nan"))
    add_rms_norm(x, residual, w, 1e-6, out=out, block=block)
    assert not out.isnan().any()
    if dtype == torch.bfloat16 and not CUDA:  # Triton's interpreter truncates to bf16 instead of rounding
        torch.testing.assert_close(residual, expected_residual, rtol=2**-7, atol=0)
    else:
        assert torch.equal(residual, expected_residual), "the residual stream is the rounded sum"
    assert rel_err(out, ref) < tol


# --- RoPE ------------------------------------------------------------------------------------------


def rope_tables(B, T, D, dtype, base=10000.0):
    """cos/sin as Transformer.rope makes them: fp64 angles, rounded to the model dtype."""
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    positions = torch.arange(B * T, dtype=torch.float64).view(B, T) * 7 + 3
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("D", [16, 10])  # 10: half = 5 is not a power of two
@pytest.mark.parametrize("cos_batch", [2, 1])  # 1: one table broadcast over the batch
def test_rope_in_place_matches_apply_rope(dtype, tol, D, cos_batch):
    B, T, Hq, Hkv = 2, 3, 6, 3
    qkv = randn(B, T, Hq + 2 * Hkv, D, dtype=dtype, seed=11)
    cos, sin = rope_tables(cos_batch, T, D, dtype)
    ref = ops.apply_rope(qkv[:, :, : Hq + Hkv].double(), cos.double(), sin.double())
    untouched = qkv[:, :, Hq + Hkv:].clone()
    out = rope_in_place(qkv, Hq + Hkv, cos, sin, block_h=4)  # 4 heads a program: the last block is partial
    assert out.data_ptr() == qkv.data_ptr()
    assert rel_err(out, ref) < tol
    assert torch.equal(qkv[:, :, Hq + Hkv:], untouched), "v heads are not rotated"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 10])
def test_rope_store_is_rope_then_the_stores(dtype, D):
    """rope_store: bit for bit the graphed step's three launches it replaces (rope_in_place, the
    head-layout K/V write and the copy of q), and no pool slot but the token's is touched."""
    from turnkv.kv.head_write import write_heads

    B, Hq, Hkv, pages, page = 3, 6, 3, 5, 4  # blocks of 4 heads: partial q and k/v blocks
    qkv = randn(B, 1, Hq + 2 * Hkv, D, dtype=dtype, seed=5)
    cos, sin = rope_tables(B, 1, D, dtype)
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(1))[: B * Hkv].to(DEVICE)
    k_pool, v_pool = randn(pages, page, D, dtype=dtype, seed=6), randn(pages, page, D, dtype=dtype, seed=7)
    q_out = torch.zeros(B, Hq, D, dtype=dtype, device=DEVICE)
    expected = [qkv.clone(), k_pool.clone(), v_pool.clone()]
    rotated = rope_in_place(expected[0], Hq + Hkv, cos, sin)
    write_heads(rotated[:, :, Hq:], expected[0][:, :, Hq + Hkv:], slots, expected[1], expected[2])
    out = rope_store(qkv, Hq, cos, sin, q_out, slots, k_pool, v_pool)
    assert out.data_ptr() == qkv.data_ptr() and out.shape == (B, 1, Hq + Hkv, D)
    assert torch.equal(qkv, expected[0])
    assert torch.equal(q_out, expected[0][:, 0, :Hq])
    assert torch.equal(k_pool, expected[1]) and torch.equal(v_pool, expected[2])


# --- SiLU * up -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("R,I,block", [(1, 100, 64), (7, 67, 32)])
def test_silu_mul_matches_torch(dtype, tol, R, I, block):
    gate_up = randn(R, 2 * I, dtype=dtype, seed=12)
    gate, up = gate_up.double().split(I, dim=-1)
    ref = F.silu(gate) * up
    up_before = gate_up[:, I:].clone()
    out = silu_mul_in_place(gate_up, I, block=block)
    assert out.data_ptr() == gate_up.data_ptr() and out.shape == (R, I)
    assert rel_err(out, ref) < tol
    assert torch.equal(gate_up[:, I:], up_before)


# --- dispatch --------------------------------------------------------------------------------------


def test_dispatch_takes_the_kernels_only_where_asked(monkeypatch):
    from turnkv.model.triton import gemv

    calls = []
    real = gemv.skinny_matmul
    monkeypatch.setattr(gemv, "skinny_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    w = randn(20, 32, seed=13)
    with torch.inference_mode():
        ops.linear(randn(1, 4, 32), w)
        assert calls == [] or CUDA, "off CUDA the kernels run only when forced"
        calls.clear()
        monkeypatch.setattr(ops, "FORCE", True)
        ops.linear(randn(2, 4, 32), w)  # 8 rows: the skinny matmul
        ops.linear(randn(3, 4, 32), w)  # 12 rows: cuBLAS
        assert calls == [(8, 32)]
        monkeypatch.setattr(ops, "ENABLED", False)
        ops.linear(randn(1, 1, 32), w)
        assert calls == [(8, 32)]
    monkeypatch.setattr(ops, "ENABLED", True)
    ops.linear(randn(1, 1, 32), w)  # autograd records: the torch ops
    assert calls == [(8, 32)]


# --- the decoder -----------------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=256, attention_bias=True, rms_norm_eps=1e-6)


def tiny_model(device=DEVICE):
    model = empty_model(TINY, torch.float32, torch.device(device))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def every_path(model, ids: list[int], graphed: bool = False):
    """Logits of a prefill (more rows than the skinny limit), a second short prefill (fewer: the
    skinny matmul) and token-by-token decode; graphed: decode through the CUDA-graph step (its
    rotation fused with its stores), run without a graph off CUDA."""
    from turnkv.engine.cuda_graphs import GraphedDecode

    c = model.config
    pool = PagePool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32, torch.device(DEVICE))
    runner = ModelRunner(model, pool, cuda_graphs=False)
    if graphed:
        runner.graphs = GraphedDecode(model, pool, c.max_position_embeddings, max_batch=2)
    seq = SequenceKV(pool)
    out = [runner.prefill(seq, ids[:11], all_logits=True), runner.prefill(seq, ids[11:16], all_logits=True)]
    for t in ids[16:]:
        out.append(runner.decode([seq], torch.tensor([t], device=DEVICE)))
    return torch.cat(out)


def test_decoder_with_kernels_forced_on_matches_the_torch_path(monkeypatch):
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(ops, "ENABLED", False)
    ref = every_path(model, ids)
    monkeypatch.setattr(ops, "ENABLED", True)
    monkeypatch.setattr(ops, "FORCE", True)
    calls = []
    monkeypatch.setattr(ops, "_kernels", _counting(ops._kernels(), calls))
    from turnkv.kv import head_write

    real_write = head_write.write_heads
    monkeypatch.setattr(head_write, "write_heads", lambda *a: calls.append("write_heads") or real_write(*a))
    fused = every_path(model, ids)
    assert {"skinny_matmul", "add_rms_norm", "rope_in_place", "silu_mul_in_place", "write_heads"} <= set(calls)
    assert "rope_store" not in calls
    assert fused.shape == ref.shape == (19, TINY.vocab_size)
    assert rel_err(fused, ref) < 1e-5
    calls.clear()
    graphed = every_path(model, ids, graphed=True)
    # Every layer of the 3 decode steps; on CUDA the graph's capture runs the Python, its replays do not.
    assert calls.count("rope_store") == (2 if CUDA else 3) * TINY.num_layers
    assert rel_err(graphed, ref) < 1e-5


def _counting(kernels: dict, calls: list):
    """ops._kernels() whose kernel functions record their names when called."""

    class Counted:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            fn = getattr(self.module, name)
            return lambda *a, **k: calls.append(name) or fn(*a, **k)

    counted = {key: Counted(module) for key, module in kernels.items()}
    return lambda: counted


def test_torch_path_matches_textbook_pre_norm_blocks():
    """Off CUDA the blocks (residual carried beside the output, added in the next norm) give bit for
    bit the logits of the textbook block: x = attn(norm(x)) + x; x = mlp(norm(x)) + x."""
    model = tiny_model("cpu")
    ids = torch.randint(0, TINY.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(13)[None]

    class Causal:
        def attention(self, layer, q, k, v):
            G = q.shape[2] // k.shape[2]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1),
                                                 v.transpose(1, 2).repeat_interleave(G, 1), is_causal=True)
            return out.transpose(1, 2)

    with torch.inference_mode():
        new = model(ids, positions, Causal(), logits_at=torch.tensor([[4, 12]]))
        x = model.embed_tokens(ids)
        cos, sin = model.rope(positions, x.dtype)
        for block in model.layers:
            attn, mlp = block.self_attn, block.mlp
            B, T, _ = x.shape
            Hq, Hkv = attn.num_heads, attn.num_kv_heads
            qkv = F.linear(F.rms_norm(x, (64,), block.input_layernorm.weight, 1e-6), attn.qkv_proj.weight,
                           attn.qkv_proj.bias).view(B, T, Hq + 2 * Hkv, attn.head_dim)
            q, k = ops.apply_rope(qkv[:, :, : Hq + Hkv], cos, sin).split([Hq, Hkv], dim=2)
            out = Causal().attention(attn.layer, q, k, qkv[:, :, Hq + Hkv:])
            x = F.linear(out.reshape(B, T, -1), attn.o_proj.weight).add_(x)
            h = F.rms_norm(x, (64,), block.post_attention_layernorm.weight, 1e-6)
            gate, up = F.linear(h, mlp.gate_up_proj.weight).split(mlp.intermediate_size, dim=-1)
            x = F.linear(F.silu(gate, inplace=True).mul_(up), mlp.down_proj.weight).add_(x)
        x = x[:, [4, 12]]
        old = F.linear(F.rms_norm(x, (64,), model.norm.weight, 1e-6), model.lm_head.weight).float()
    assert torch.equal(new, old)
