"""N=2 over NCCL (rank r on cuda:r) against N=1 on one GPU, CUDA graphs on (the default on CUDA): a small
random Llama-shaped model in fp32 gives N=1's greedy tokens and kept sets over three turns; in bf16 its
logits stay within the bound the single-GPU tests hold against transformers. Needs two GPUs."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import save_tiny
from tests.model.test_oracle import rel_err
from tests.parallel import graphed, probes
from tests.parallel.conftest import engine_pair, three_turns
from turnkv.parallel.mirror import gather

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs (N=2 over NCCL)")]

# Llama-shaped, big enough for the GPU kernels' usual head size: 8 query heads of 64, 4 KV heads.
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048)
RECIPES = [
    ("full", None),
    ("snapkv keep_ratio=0.5", None),
    ("ada-snapkv keep_ratio=0.5", None),
    # The streaming heads keep more than the selecting heads' budget: whole rows longer than a selection.
    ("prefill=streaming_heads(pattern=random,ratio=0.5,sink=4,local=48,prefill_local=48) "
     "decode=lserve(budget=32,physical_page=16,logical_page=16)", None),
    ("quest decode=quest(budget=32,dense_layers=0)", None),
    ("snapkv keep_ratio=0.5 state=krul", "cpu"),  # Krul's stored form, through the CPU tier after each turn
]


SELECTING = {RECIPES[3][0], RECIPES[4][0]}  # decode selections: every step replays from the graphs


@pytest.fixture(scope="module")
def gpu_tokenizer(request):
    """The embedded model's tokenizer, or $TURNKV_TEST_TOKENIZER's folder (a GPU machine without the
    embedded model's package)."""
    folder = os.environ.get("TURNKV_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return request.getfixturevalue("smol_tokenizer")


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory, gpu_tokenizer):
    path = tmp_path_factory.mktemp("gpu-tp")
    save_tiny(path, "llama", vocab_size=len(gpu_tokenizer), tokenizer=gpu_tokenizer, **SHAPE)
    return path


def _pair(path, dtype):
    options = {"device": "cuda", "dtype": dtype}
    yield from engine_pair(path, "512MiB", "256MiB", options, options)


@pytest.fixture(scope="module")
def fp32_engines(gpu_model_dir):
    for single, pair in _pair(gpu_model_dir, "float32"):
        gather(pair, graphed.count)
        yield single, pair


@pytest.mark.parametrize("recipe, offload", RECIPES)
def test_two_gpus_match_one(fp32_engines, recipe, offload):
    single, pair = fp32_engines
    assert pair.device == torch.device("cuda", 0) and pair.parallel.size == 2
    tokens_1, kept_1 = three_turns(single, recipe, offload)
    before = gather(pair, graphed.paths)
    tokens_2, kept_2 = three_turns(pair, recipe, offload)
    paths = [{k: n - was[k] for k, n in now.items()} for was, now in zip(before, gather(pair, graphed.paths))]
    assert tokens_2 == tokens_1
    assert kept_2 == kept_1
    assert len(kept_1) == single.config.num_layers * single.config.num_kv_heads
    # Both ranks replayed decode steps from CUDA graphs that hold the all-reduces; a selection's steps too.
    assert min(gather(pair, probes.captured_graphs)) > 0
    if recipe in SELECTING:
        assert paths[0] == paths[1] and paths[0]["eager"] == 0 and paths[0]["graphed"] > 0


def test_bf16_logits_track_one_gpu(gpu_model_dir):
    ids = torch.randint(3, 5000, (56,), generator=torch.Generator().manual_seed(5)).tolist()
    for single, pair in _pair(gpu_model_dir, "bfloat16"):
        one = probes.teacher_forced_logits(single, ids, 40)
        two = gather(pair, probes.teacher_forced_logits, ids, 40)
        assert two[0].shape == one.shape == (55, single.config.vocab_size)
        torch.testing.assert_close(two[1], two[0], rtol=0, atol=0)  # every rank has the same logits
        assert rel_err(two[0], one) < 3e-2  # tests/model/test_oracle.py's bound for bf16 against transformers
        assert min(gather(pair, probes.captured_graphs)) > 0
