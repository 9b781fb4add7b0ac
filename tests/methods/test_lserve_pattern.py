"""Streaming-head patterns: the global quantile rule, JSON/TSV round trips, the DuoAttention
release format, and clear errors for wrong shapes and corrupt files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from turnkv.methods.lserve.pattern import HeadPattern, PatternFileError, load_duo_attention

# A DuoAttention-style release file: 4 layers x 2 KV heads of gates, most near 1, as shipped.
DUO_TSV = "1.0\t0.97\n0.12\t1.0\n0.99\t0.03\n0.5\t1.0\n"


def test_global_quantile_and_ties():
    gates = np.array([[0.9, 0.1, 0.8], [0.2, 0.7, 0.3]])
    pattern = HeadPattern.from_gates(gates)  # 50%: the three lowest gates anywhere stream
    assert pattern.streaming.tolist() == [[False, True, False], [True, False, True]]
    # Per-layer counts vary: the quantile is global over all layers.
    skewed = HeadPattern.from_gates(np.array([[0.9, 0.8], [0.7, 0.6], [0.1, 0.2], [0.3, 0.05]]))
    assert skewed.streaming.sum(axis=1).tolist() == [0, 0, 2, 2]
    ties = HeadPattern.from_gates(np.ones((32, 8)))  # all gates equal: noise still splits at 50%
    assert ties.streaming.sum() == 128
    assert HeadPattern.from_gates(gates, 0.0).streaming.sum() == 0
    assert HeadPattern.from_gates(gates, 1.0).streaming.all()
    assert HeadPattern.from_gates(np.random.default_rng(0).uniform(size=(30, 3)), 0.25).streaming.sum() in (22, 23)


def test_json_and_tsv_round_trips(tmp_path):
    pattern = HeadPattern.from_gates(np.random.default_rng(1).uniform(size=(5, 3)), meta={"model": "x"})
    pattern.save_json(tmp_path / "p.json")
    again = HeadPattern.load(tmp_path / "p.json")
    assert (again.streaming == pattern.streaming).all()
    np.testing.assert_allclose(again.gates, pattern.gates)
    assert again.meta["model"] == "x"
    pattern.save_tsv(tmp_path / "p.tsv")
    assert (tmp_path / "p.tsv").read_text().splitlines()[0].count("\t") == 2
    assert (HeadPattern.load(tmp_path / "p.tsv").streaming == pattern.streaming).all()
    assert pattern.query_head_mask(0, 3).tolist() == np.repeat(pattern.streaming[0], 3).tolist()


def test_duo_attention_release_format(tmp_path):
    folder = tmp_path / "Llama-x" / "run"
    folder.mkdir(parents=True)
    (folder / "full_attention_heads.tsv").write_text(DUO_TSV)
    pattern = load_duo_attention(folder, sparsity=0.5, num_layers=4, num_kv_heads=2)
    # Median of the 8 gates splits them 4/4; the four smallest (0.12, 0.03, 0.5, 0.97) stream.
    assert pattern.streaming.tolist() == [[False, True], [True, False], [False, True], [True, False]]
    quarter = load_duo_attention(folder / "full_attention_heads.tsv", sparsity=0.25)
    assert quarter.streaming.sum() == 2 and quarter.streaming[2, 1] and quarter.streaming[1, 0]
    with pytest.raises(PatternFileError, match="4x2 but the model has 32 layers x 8"):
        load_duo_attention(folder, num_layers=32, num_kv_heads=8)
    with pytest.raises(PatternFileError, match="0/1 flags"):
        HeadPattern.load_tsv(folder / "full_attention_heads.tsv")


@pytest.mark.parametrize("text, message", [("1\t0\n1\n", "row 2 has 1 values"), ("", "empty"),
                                           ("1\tx\n", "could not convert"), ("1\tnan\n", "finite")])
def test_corrupt_tsv(tmp_path, text, message):
    (tmp_path / "bad.tsv").write_text(text)
    with pytest.raises(PatternFileError, match=message):
        load_duo_attention(tmp_path / "bad.tsv")


def test_corrupt_json_and_wrong_shapes(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(PatternFileError, match="not a readable JSON"):
        HeadPattern.load(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(PatternFileError, match="not a turnkv-head-pattern"):
        HeadPattern.load(tmp_path / "b.json")
    good = HeadPattern.from_gates(np.ones((2, 2))).to_json()
    (tmp_path / "c.json").write_text(json.dumps({**good, "num_layers": 3}))
    with pytest.raises(PatternFileError, match="header says 3x2"):
        HeadPattern.load(tmp_path / "c.json")
    (tmp_path / "d.json").write_text(json.dumps({**good, "streaming": [[1, 0], [1]]}))
    with pytest.raises(PatternFileError):
        HeadPattern.load(tmp_path / "d.json")
    with pytest.raises(PatternFileError, match=".json or .tsv"):
        HeadPattern.load(tmp_path / "e.txt")
    with pytest.raises(ValueError, match="layers x kv_heads"):
        HeadPattern.from_gates(np.ones(4))
    with pytest.raises(ValueError, match="model has 30 layers x 3"):
        HeadPattern.from_gates(np.ones((2, 2))).check_model(30, 3)
