"""The worker's order of work, on fakes: which held requests start their prefill when memory is
short, and when a prefill pass hands over to decode steps."""

from __future__ import annotations

from types import SimpleNamespace

from turnkv.engine import mixed
from turnkv.serve.config import ServeConfig
from turnkv.serve.engine_ops import Stepped
from turnkv.serve.scheduler import Scheduler

CHUNK = 32


class FakeJob:
    """A request with `left` prompt tokens to prefill, whose turn takes `pages` pages at its largest,
    `holding` of them already (its conversation back in the pool)."""

    def __init__(self, name: str, left: int, pages: int = 0, holding: int = 0):
        self.name, self.prefill_left, self.pages, self.holding = name, left, pages, holding
        self.turn = SimpleNamespace(prefilled=0)
        self.slices: list[int] = []

    def prefill(self, size: int):
        size = min(size, self.prefill_left)
        self.slices.append(size)
        self.turn.prefilled += size
        self.prefill_left -= size
        return "", False


class FakeGate:
    """Fits a job when its pages and those of the running jobs fit in `available`."""

    def __init__(self, available: int):
        self.available = available

    def fits(self, job, running) -> bool:
        return job.pages + sum(j.pages for j in running) <= self.available

    def held(self, job) -> int:
        return job.holding


def scheduler(max_step_tokens: int, available: int = 100) -> Scheduler:
    s = Scheduler(SimpleNamespace(pool=None, runner=SimpleNamespace(prefill_chunk=CHUNK, graph_batch=None)), store=None,
                  config=ServeConfig(prefill_chunk=CHUNK, max_step_tokens=max_step_tokens), metrics=None)
    s.gate = FakeGate(available)
    s._first_token = lambda job, piece, done: s.decoding.append(job)
    return s


def names(jobs) -> list[str]:
    return [j.name for j in jobs]


def test_only_short_prompts_pass_a_held_request_that_does_not_fit():
    s = scheduler(max_step_tokens=64, available=100)
    s.decoding = [FakeJob("running", 0, pages=60)]
    s.held = [FakeJob("long 1", 4096, pages=50), FakeJob("short", CHUNK, pages=10),
              FakeJob("long 2", 4096, pages=20), FakeJob("short 2", CHUNK - 1, pages=35)]
    s._start_prefills()
    # long 1 (50) does not fit beside running (60). long 2 (20) would, but waits behind it; short
    # (10) passes; short 2 (35) would pass but no longer fits (60 + 10 + 35 > 100).
    assert names(s.prefilling) == ["short"]
    assert names(s.held) == ["long 1", "long 2", "short 2"]
    s.decoding = []  # the running request finished: the rest start in arrival order
    s._start_prefills()
    assert names(s.prefilling) == ["short", "long 1", "long 2"] and names(s.held) == ["short 2"]


def test_with_none_running_the_room_held_back_decides_who_starts():
    """With none running: a request whose conversation holds pages passes a long prompt that does not
    fit (those pages are what it lacks); when none fits, one starts alone (the first holding pages,
    else the first in line), unless packs in flight or requests still encoding hold pages: then all
    wait, and the worker sleeps until one of those ends."""
    s = scheduler(max_step_tokens=64, available=100)
    packs = []
    s.store = SimpleNamespace(packing=lambda: len(packs))
    new, back = FakeJob("new, long", 4096, pages=150), FakeJob("back, long", 4096, pages=60, holding=40)
    s.held = [new, back]
    s._start_prefills()
    assert names(s.prefilling) == ["back, long"] and names(s.held) == ["new, long"]
    s.prefilling, s.held = [], [new, FakeJob("other new", 4096, pages=120)]
    packs.append("a pack in flight")
    s._start_prefills()  # none fits, and room is coming back: none starts
    assert not s.prefilling and s._held_wait and s._short
    packs.clear()
    s.encoding = [FakeJob("encoding, back", 10, holding=30)]
    s._held_wait = False
    s._start_prefills()
    assert not s.prefilling and s._held_wait
    s.encoding = []
    s.held.append(FakeJob("back, too big", 4096, pages=200, holding=30))
    s._start_prefills()  # the first holding pages starts alone
    assert names(s.prefilling) == ["back, too big"] and names(s.held) == ["new, long", "other new"]
    s.prefilling, s.held = [], [new]
    s._start_prefills()  # nothing held back: the first in line starts alone
    assert names(s.prefilling) == ["new, long"]


def test_with_nothing_decoding_a_prefill_pass_ends_when_the_first_prompt_decodes():
    s = scheduler(max_step_tokens=64)
    first, second = FakeJob("first", 40), FakeJob("second", 200)
    s.prefilling = [first, second]
    s._prefill()
    # first's prompt took two slices (32, 8) and it decodes; second waits for the next (mixed) step
    assert first.slices == [32, 8] and second.slices == [] and names(s.decoding) == ["first"]


def test_the_sliced_scheduler_runs_one_chunk_between_decode_steps():
    s = scheduler(max_step_tokens=0)
    first, second = FakeJob("first", 40), FakeJob("second", 200)
    s.prefilling = [first, second]
    s._prefill()  # nothing decoded at the start: prefill until the first decodes and a chunk is spent
    assert first.slices == [32, 8] and second.slices == [] and names(s.decoding) == ["first"]
    s._prefill()  # now one chunk's worth, then the decode step
    assert second.slices == [32]


def test_decode_steps_split_at_the_cuda_graphs_batch():
    s = scheduler(max_step_tokens=64)
    s.config.max_running = 128
    s.llm.runner.graph_batch = 32
    plain = SimpleNamespace(accumulate=False, selector=None)
    s.decoding = [SimpleNamespace(turn=SimpleNamespace(done=False, context=plain)) for _ in range(70)]
    sizes = []
    s._decode_step = lambda batch, jobs: sizes.append(len(batch))
    s._decoded = lambda batch, logits, jobs: None
    s._decode()
    assert sizes == [32, 32, 6]  # each batch replays from the graphs; 70 in one would run eagerly
    s.llm.runner.graph_batch = None  # no graphs (CPU): one batch up to --max-running
    sizes.clear()
    s._decode()
    assert sizes == [70]


def test_a_mixed_step_ends_at_most_one_prompt_that_compresses(monkeypatch):
    """Every running stream waits for the eviction pass that ends a compressed prompt: a mixed step
    carries the slices of other prompts beside one such ending, but not a second."""
    monkeypatch.setattr(mixed, "slice_part",
                        lambda turn, size: SimpleNamespace(size=min(size, turn.left), width=min(size, turn.left)))
    s = scheduler(max_step_tokens=4096)

    def job(name, left, compresses):
        j = FakeJob(name, left)
        j.turn.recipe, j.turn.left = SimpleNamespace(compresses_after_prompt=compresses), left
        return j

    ends_a, ends_b = job("ends, compressed", 10, True), job("ends too, compressed", 5, True)
    full, long = job("ends, not compressed", 3, False), job("does not end", 100, True)
    s.prefilling = [ends_a, ends_b, full, long]
    picked = s._pick_slices(4096)
    assert [(j.name, p.width) for j, p in picked] == [("ends, compressed", 10), ("ends, not compressed", 3),
                                                      ("does not end", CHUNK)]
    s.prefilling = [ends_b, long]  # the next step: the second compressed prompt ends now
    assert [j.name for j, _ in s._pick_slices(4096)] == ["ends too, compressed", "does not end"]
    s.prefilling = [ends_b]  # a lone slice always goes, whatever the budget
    assert [j.name for j, _ in s._pick_slices(0)] == ["ends too, compressed"]


def test_requests_whose_decode_selects_take_a_graphed_step_beside_the_mixed_forward(monkeypatch):
    """Where CUDA graphs run, a selecting request's token stays out of the mixed forward (an eager
    step would select once per conversation and layer): it takes a graphed decode step, and the
    mixed forward carries the other requests' tokens and the slices. Without graphs, every token rides."""
    s = scheduler(max_step_tokens=64)
    plain, selecting = (SimpleNamespace(accumulate=False, selector=sel) for sel in (None, object()))
    dense = [SimpleNamespace(turn=SimpleNamespace(done=False, context=plain)) for _ in range(3)]
    sparse = [SimpleNamespace(turn=SimpleNamespace(done=False, context=selecting)) for _ in range(2)]
    prompt = FakeJob("prompt", 100)
    stepped, forwards = [], []
    s._decode_step = lambda batch, jobs: stepped.append(list(batch))
    s._decoded = lambda batch, logits, jobs: None
    s._pick_slices = lambda budget: [(prompt, SimpleNamespace(size=CHUNK, width=CHUNK))]
    s.ops = SimpleNamespace(mixed=lambda batches, slices: forwards.append(  # the parts of the forward it runs
        [mixed.decode_part(b) for b in batches] + [SimpleNamespace(width=w) for _, w in slices])
                            or Stepped(([], []), {}))
    monkeypatch.setattr(mixed, "decode_part",
                        lambda batch: SimpleNamespace(turns=batch, size=len(batch)))
    s._with_room = lambda fn: fn()
    s.metrics = SimpleNamespace(labels=lambda *a: SimpleNamespace(inc=lambda: None), mixed_steps=None)
    s.decoding, s.prefilling = dense[:2] + sparse + dense[2:], [prompt]
    s.llm.runner.graphs = object()
    s._mixed()
    assert stepped == [[j.turn for j in sparse]]
    (parts,) = forwards
    assert [p.turns for p in parts[:-1]] == [[j.turn for j in dense]] and parts[-1].width == CHUNK
    s.llm.runner.graphs = None  # no graphs (CPU): every token rides the mixed forward
    stepped.clear(), forwards.clear()
    s._mixed()
    assert stepped == [] and sum(p.size for p in forwards[0][:-1]) == 5
