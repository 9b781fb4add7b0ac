"""The prefill patterns' stage times: free off a GPU; on a GPU taken only when asked
(TURNKV_STAGE_TIMES=1), because each one synchronizes the device inside the forward."""

import torch

from turnkv.methods.prefill import pattern_hook
from turnkv.methods.prefill.pattern_hook import clock, since, summarise, with_times


def test_a_gpus_stage_times_synchronize_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    gpu = torch.device("cuda")
    monkeypatch.setattr(pattern_hook, "STAGE_TIMES", False)
    assert clock(gpu) is None and since(clock(gpu), gpu) is None and calls == []
    assert isinstance(clock(gpu, sync=False), float) and calls == []  # a method's own profile=False
    assert isinstance(clock(gpu, sync=True), float) and len(calls) == 1  # its profile=True
    monkeypatch.setattr(pattern_hook, "STAGE_TIMES", True)
    t0 = clock(gpu)
    assert isinstance(t0, float) and since(t0, gpu) >= 0 and len(calls) == 3


def test_a_cpus_stage_times_are_always_taken():
    cpu = torch.device("cpu")
    t0 = clock(cpu)
    assert isinstance(t0, float) and since(t0, cpu) >= 0


def test_untaken_times_are_left_out_of_the_stats_and_their_summary():
    assert with_times({"layer": 0}, time_search=None, time_sparse_attention=0.5) == {
        "layer": 0, "time_sparse_attention": 0.5}
    entries = [{"layer": 0, "computed": torch.tensor([[6]]), "causal": torch.tensor([[10]])},
               {"layer": 1, "computed": torch.tensor([[10]]), "causal": torch.tensor([[10]]),
                "time_sparse_attention": 0.25}]
    out = summarise(entries, 2)
    assert out["density"] == 16 / 20 and out["time_sparse_attention"] == 0.25 and "time_search" not in out


def test_a_turns_device_statistics_come_back_in_one_copy(monkeypatch):
    """on_host moves every tensor not on the host with one .cpu(), values and dtypes unchanged."""
    from turnkv.methods.prefill import pattern_hook as ph

    class Remote(torch.Tensor):  # a stand-in for a device tensor: reports a non-CPU device
        @property
        def device(self):
            return torch.device("meta")

    def remote(t):
        return t.as_subclass(Remote)

    entries = [{"layer": layer, "computed": torch.tensor([[3, 5]]) + layer, "causal": torch.tensor([[10, 10]]),
                "vertical": torch.tensor([[True, False]]), "time_search": 0.1} for layer in range(3)]
    moved = [{k: remote(v) if isinstance(v, torch.Tensor) else v for k, v in e.items()} for e in entries]
    calls = []
    real_cat = torch.cat
    monkeypatch.setattr(ph.torch, "cat", lambda ts, *a, **k: calls.append(len(ts)) or real_cat(
        [t.as_subclass(torch.Tensor) for t in ts], *a, **k))
    back = ph.on_host(moved)
    assert calls == [9]  # one copy for 3 entries x 3 tensors
    for a, b in zip(entries, back):
        for key in ("computed", "causal", "vertical"):
            assert type(b[key]) is torch.Tensor and b[key].dtype == a[key].dtype and torch.equal(b[key], a[key])
        assert b["time_search"] == 0.1
    assert ph.on_host(entries) is entries  # all on the host already: nothing copied
