"""The server's warm-up (serve/warmup.py): before it takes requests, synthetic conversations run
every kind of step through the worker (multi-slice first turns beside each other and beside decoding
streams, later turns over kept history, one wave per decode bucket); then nothing of them is left:
no KV, no prefix-index entry, no count in /metrics, and a request replies what it replies without one."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, running
from turnkv.serve import warmup

SLICE = 16


def ask(server) -> str:
    r = server.client().chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Name a colour."}])
    return r.choices[0].message.content


def test_warmup_runs_each_step_kind_and_leaves_nothing(chat_model_dir):
    import turnkv

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB")
    options = dict(served_model_name=MODEL, prefill_chunk=SLICE, max_step_tokens=4 * SLICE, max_running=4)
    with running(llm, **options, warmup=False) as cold:
        assert not hasattr(cold.app.state, "warmup")
        expected = ask(cold)
    llm.prefix_index.clear()

    assert not llm.state.tiers.host_allocated
    with running(llm, **options, warmup=True) as s:
        assert llm.state.tiers.host_allocated  # at the start, not at the first offload
        report = s.app.state.warmup
        assert len(report.prompt_tokens) == 4 and min(report.prompt_tokens) >= 2 * SLICE + SLICE // 2
        # Each later turn took its whole first turn (prompt and reply) from the kept conversation.
        assert len(report.cached_tokens) == 4
        assert all(c >= p for c, p in zip(report.cached_tokens, report.prompt_tokens))
        assert report.mixed_steps > 0
        assert report.batches == [1, 2, 4]
        assert report.requests == 4 + 4 + 1 + 2 + 4
        # Nothing of it is left: the pool, the index, the stored conversations and /metrics are empty.
        assert llm.pool.bytes_in_use() == 0 and len(llm.prefix_index) == 0
        for name in ("vllm:request_success_total", "vllm:generation_tokens_total", "turnkv:mixed_steps_total",
                     "turnkv:stored_conversations", "turnkv:kv_pool_bytes_used"):
            assert s.metric(name) == 0, name
        assert ask(s) == expected


def test_warmup_is_on_by_default_on_cuda_only():
    class Engine:
        def __init__(self, kind):
            import torch

            self.device = torch.device(kind)

    assert warmup.wanted(None, Engine("cuda")) and not warmup.wanted(None, Engine("cpu"))
    assert warmup.wanted(True, Engine("cpu")) and not warmup.wanted(False, Engine("cuda"))


@pytest.mark.parametrize("flags, setting", [([], None), (["--warmup", "on"], True), (["--warmup", "off"], False)])
def test_serve_flag_sets_the_warmup(monkeypatch, capsys, chat_model_dir, flags, setting):
    from tests.test_cli import run_cli

    served = []
    monkeypatch.setattr("turnkv.cli.serve", lambda llm, config, **options: served.append(config))
    code, _, err = run_cli(monkeypatch, capsys, ["serve", "--model", str(chat_model_dir), "--kv-memory", "8MiB",
                                                 "--no-tiers", *flags])
    assert code == 0, err
    assert served[0].warmup is setting


def test_warmup_prompts_reach_past_where_the_recipe_changes_paths(chat_model_dir):
    """LServe's chunks take the windowed paths only past its sink and prefill window: the warm-up's
    first turns are that long and a slice more, so those kernels compile before the first user."""
    import turnkv

    recipe = "prefill=streaming_heads(pattern=random,sink=4,local=8,prefill_local=40)"
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", recipe=recipe)
    reach = llm.recipe.prefill.paths_change_at()
    assert reach == 4 + 40 + 1
    with running(llm, served_model_name=MODEL, prefill_chunk=SLICE, max_step_tokens=4 * SLICE, warmup=True) as s:
        report = s.app.state.warmup
        assert report.prompt_tokens and min(report.prompt_tokens) >= reach + SLICE
        assert max(report.prompt_tokens) > 2 * SLICE + SLICE // 2  # longer than without the recipe's reach
