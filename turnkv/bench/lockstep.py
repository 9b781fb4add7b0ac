"""Conversations driven a turn at a time and several together, for the quality runner.

Every turn is the engine's TurnRun: each conversation prefills its own prompt, then the unfinished ones
decode in lockstep through engine/decode_loop.step. Three exact shortcuts: teacher forcing as one chunk
for recipes without decode hooks (`chunkable`), forking the forced run off the free run at its first
divergence from the reference, and one prefill of the shared first prompt. Batched steps differ from
single ones only by float rounding (tests/bench/test_lockstep.py checks each path).
Design: docs/architecture.md#the-quality-runner"""

from __future__ import annotations

import time

import torch

from turnkv.engine import decode_loop
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnRun
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.snapshot import export_kv, import_kv
from turnkv.methods.loopserve.decode import ProgressiveSelection
from turnkv.methods.lserve.decode import PagedSelection
from turnkv.methods.step_context import StepContext
from turnkv.methods.window import QueryWindow


def chunkable(recipe) -> bool:
    """Whether a forced answer may be prefilled as one chunk: the recipe does nothing per decode step
    (no selection, no decode-schedule eviction, no streaming-head trim)."""
    if recipe.selects_decode or recipe.static_sparsity is not None:
        return False
    return recipe.evict is None or recipe.evict.schedule != "decode"


def _plain_window(window) -> bool:
    return window is None or type(window) is QueryWindow


def _decode_kind(state) -> str | None:
    """How a decode-selection state can be carried into a copy of its conversation: "none" (no
    selection), "copy" (LoopServe's progressive selection: queries and picks by entry index, which a
    copied KV keeps), "fresh" (a page selection made afresh at every step, Quest's: only statistics
    that a copy rebuilds from its own pages), or None (a selection reused across steps by page id:
    LServe's, which a copy of the KV in other pages would not find)."""
    if state is None:
        return "none"
    if type(state) is ProgressiveSelection and state.graph_record is None:
        return "copy"
    if type(state) is PagedSelection and state.static is None and state.selector.config.reuse_interval == 1:
        return "fresh"
    return None


def forkable(conv: Conversation) -> bool:
    """Whether a conversation can be cloned mid-turn and continued on a forced answer: its state is
    the KV, a plain observation window, the recipe's bookkeeping and a decode selection state that a
    copy can carry (_decode_kind). Streaming heads re-check a copied KV against the pool's positions
    before they trim it (methods/lserve/streaming.py), as after a restore."""
    st = conv.method_state
    return _plain_window(st.window) and _decode_kind(st.decode) is not None


def _shares_first_prompt(conv: Conversation) -> bool:
    st = conv.method_state
    return not conv.recipe.sparse_prefill and _plain_window(st.window) and _decode_kind(st.decode) is not None


class SharedPrompt:
    """The first turn's prompt prefilled once (per attention-accumulation mode) and copied into every
    conversation with a dense prefill: KV rows, the queries an observation window keeps, the
    attention mass H2O accumulates, and the last position's logits. Bit-identical to prefilling it in
    each conversation: the same forward on the same tokens."""

    def __init__(self, llm, keep: int = 4):
        self.llm, self.keep = llm, keep
        # (prompt, accumulate) -> (meta, tensors, queries, positions, logits, seconds), the newest last
        self._done: dict[tuple, tuple] = {}

    def get(self, prompt: list[int], accumulate: bool, split: int = 0):
        """split: where the engine's turn stops its prefill (a system prompt's end; 0: nowhere), so
        that the copy is the same forward in the same slices."""
        key = (tuple(prompt), accumulate, split)
        entry = self._done.pop(key, None)
        if entry is None:
            seq = SequenceKV(self.llm.pool)
            window = QueryWindow(self.llm.config.num_layers, len(prompt))  # every query: each copy takes its tail
            try:
                t0 = time.perf_counter()
                context = StepContext(window=window, accumulate=accumulate)
                for piece in ([prompt[:split], prompt[split:]] if 0 < split < len(prompt) else [prompt]):
                    logits = self.llm.runner.prefill(seq, piece, context=context)
                seconds = time.perf_counter() - t0
                meta, tensors = export_kv(seq)
            finally:
                seq.free()
            entry = (meta, tensors, window.queries, window.positions, logits, seconds)
        self._done[key] = entry
        while len(self._done) > self.keep:
            self._done.pop(next(iter(self._done)))
        return entry

    def copy_into(self, conv: Conversation, prompt: list[int], split: int = 0):
        """Fill an empty conversation's KV and window as prefilling `prompt` (in two slices at `split`)
        would; returns (logits, seconds the shared prefill took)."""
        meta, tensors, queries, positions, logits, seconds = self.get(prompt, conv.recipe.accumulates_attention, split)
        import_kv(conv.kv, meta, tensors)
        st = conv.method_state
        if st.window is not None:
            size = st.window.size
            st.window.restore(([q[-size:].clone() for q in queries], [p[-size:].clone() for p in positions]))
            if st.window.moments is not None:  # a scorer that models every query (ExpectedAttention)
                for layer, (q, p) in enumerate(zip(queries, positions)):
                    st.window.moments.add(layer, q, p)
        if st.decode is not None:
            # What the prefill's forward shows a decode selection: a prefill began (a new turn), then
            # every layer's queries. Page statistics (Quest, LServe) are rebuilt from the copied pages
            # at the first decode step, as after any prefill of a new sequence.
            st.decode.begin(False)
            for layer, (q, p) in enumerate(zip(queries, positions)):
                st.decode.observe(layer, q, p)
        return logits, seconds


class PendingTurn(TurnRun):
    """A lockstep turn: the engine's TurnRun, with the TTFT it took (a shared prompt's prefill
    counted) and the forced answer of a chunkable recipe fed in one forward."""

    ttft_s: float | None = None

    def force_rest_as_chunk(self) -> None:
        """Teacher forcing of a chunkable recipe: the rest of the forced answer in one forward."""
        gen, conv = self.gen, self.conv
        rest = gen.forced[len(gen.token_ids):]
        if gen.done or not rest:
            return
        # In the KV: the last accepted token, then every forced token but the last (whose logits
        # nobody reads), exactly what the decode steps would have fed.
        feed = gen.token_ids[-1:] + rest[:-1]
        ctx = self.context
        logits = conv.llm.runner.prefill(conv.kv, feed, all_logits=True,
                                         context=StepContext(window=ctx.window, accumulate=ctx.accumulate))
        for i, row in enumerate(logits):
            self.take(row)
            if gen.done and i != len(feed) - 1:
                raise RuntimeError("a forced answer stopped before its end (an EOS inside it?)")
        if not gen.done:
            raise RuntimeError("a forced answer did not end with its last token")


class LockstepConversation(Conversation):
    """A Conversation whose turns are opened with begin() and decoded by decode_together()."""

    def begin(self, message: str, max_new_tokens: int, force: list[int] | None = None, logprobs: bool = False,
              shared: SharedPrompt | None = None, watch=None) -> PendingTurn:
        """Render the turn, prefill its prompt (from `shared` on a first turn that may take it), run the
        recipe's after-prompt hook and take the first token. A forced turn of a chunkable recipe is
        complete on return. `watch` sees every token before it is accepted (TurnRun.watch)."""
        inputs = self._turn_input(message)
        params = self.llm.turn_parts.sampling_params(max_new_tokens=max_new_tokens)
        gen = self.llm.turn_parts.new_generation(self.kv, params, forced=force, keep_logprobs=logprobs)
        pending = PendingTurn(self, inputs, gen, self.llm.state).begin()
        pending.watch = watch
        try:
            t0 = time.perf_counter()
            before = 0.0
            # A recipe that closes the system prompt at its end (FlowKV) compresses between the slices.
            closes = pending.prefix_at and self.recipe.evict is not None and self.recipe.turns.closes_prefix
            if shared is not None and pending.cached == 0 and not self.turns and _shares_first_prompt(self) \
                    and not closes:
                logits, before = shared.copy_into(self, pending.prompt, pending.prefix_at)
                pending.prefilled_elsewhere()
            else:
                logits = pending.prefill()
            pending.take(logits)
            # A shared prompt's TTFT is what prefilling it took, plus this conversation's own work.
            pending.ttft_s = time.perf_counter() - t0 + before
            if gen.forced is not None and chunkable(self.recipe):
                pending.force_rest_as_chunk()
        except BaseException:
            pending.abandon()
            raise
        return pending

    def fork(self, pending: PendingTurn, forced: list[int], logprobs: list[torch.Tensor]) -> PendingTurn:
        """A clone of this conversation at the current point of `pending` (every token accepted so far
        agreeing with `forced`), continued on `forced` as teacher forcing. `logprobs` are the kept
        log-probs of the accepted tokens. Returns the clone's turn, not yet at its end."""
        if not forkable(self):
            raise ValueError(f"a conversation with recipe {self.recipe} cannot be forked")
        twin = self.clone(copy_decode=_decode_kind(self.method_state.decode) == "copy")
        twin.llm.state.before_turn(twin, 0)
        parts = self.llm.turn_parts
        gen = parts.new_generation(twin.kv, parts.sampling_params(max_new_tokens=len(forced)), forced=forced,
                                   keep_logprobs=True)
        done = len(pending.gen.token_ids)
        for token in pending.gen.token_ids:
            gen.accept(token)
        gen.logprobs = list(logprobs[:done])
        out = pending.continued_by(twin, gen)
        out.ttft_s = pending.ttft_s
        return out


def decode_together(llm, pendings: list[PendingTurn], max_batch: int = 32) -> None:
    """Decode every unfinished generation of `pendings` to its end through the engine's step loop:
    one batched forward per step for each kind of step (plain; H2O's accumulation; decode
    selection), at most max_batch rows each. A fork made during a step joins `pendings` (the
    tracks' sink) and decodes from the next step on."""
    while any(not p.done for p in pendings):
        decode_loop.step(llm, pendings, max_batch)


class Track:
    """One recipe through one instance's turns: its free run (greedy, its own answers in the history)
    and, given the reference run's answers, its teacher-forced run along them.

    While the free run has reproduced every reference token it is the forced run (its log-probs are
    the forced ones). At the first difference a forkable free run is cloned and the clone goes on as
    the forced run (its forced turns one chunk each where the recipe allows). A recipe that cannot be
    forked marks the turn instead (`replay_from`): its forced run is made afterwards by replay(), a
    forced conversation from the first turn, whose figures from that turn on replace the missing
    ones. Most recipes that do not evict reproduce the reference, and then need no forced run at all.

    outputs[t]: the free run's turn (reply text and tokens, KV bytes, history length, TTFT, prefilled
    tokens, the prefill pattern's figures), its log-probs with keep_logprobs, and given a reference,
    measure(t, the forced run's log-probs along it) merged in (or those log-probs as "forced")."""

    def __init__(self, llm, system: str | None, recipe, messages: list[str], max_new_tokens: int,
                 reference: list[list[int]] | None = None, keep_logprobs: bool = False,
                 shared: SharedPrompt | None = None, measure=None):
        self.llm, self.system, self.messages, self.max_new_tokens = llm, system, messages, max_new_tokens
        self.measure = measure  # measure(turn, forced log-probs) -> figures kept instead of the log-probs
        self.reference, self.keep_logprobs, self.shared = reference, keep_logprobs, shared
        self.free = LockstepConversation(llm, system, recipe)
        self.forced: LockstepConversation | None = None
        self.merged = reference is not None
        self.replay_from: int | None = None  # the turn a forced run must be replayed from
        self.outputs: list[dict] = []
        self._free_turn = self._forced_turn = None
        self._seen = 0
        self.sink: list | None = None  # the turns decoding now, which a fork joins (run_tracks sets it)

    def begin(self, t: int) -> list[PendingTurn]:
        """Open turn t; returns the turns that still decode."""
        message = self.messages[t]
        self._seen = len(self.free.method_stats)
        self._forced_turn, self.sink = None, None
        if self.merged:
            self._ref = self.reference[t]
            self._free_turn = self.free.begin(message, self.max_new_tokens, logprobs=True, shared=self.shared,
                                              watch=self._watch)
        else:
            self._free_turn = self.free.begin(message, self.max_new_tokens, logprobs=self.keep_logprobs,
                                              shared=self.shared)
            if self.forced is not None:
                ref = self.reference[t]
                self._forced_turn = self.forced.begin(message, len(ref), force=ref, logprobs=True, shared=self.shared)
        return [p for p in (self._free_turn, self._forced_turn) if p is not None and not p.gen.done]

    def _watch(self, pending: PendingTurn, index: int, token: int, row) -> None:
        if not self.merged or (index < len(self._ref) and token == self._ref[index]):
            return
        if index >= len(self._ref):  # cannot be: the reference stopped there (EOS or length), so did this run
            raise RuntimeError("a free run went on past the end of the reference answer it reproduced")
        # The first difference from the reference: the forced run goes on from here on its own.
        self.merged = False
        if not self.keep_logprobs:
            logprobs, pending.gen.logprobs = pending.gen.logprobs, None  # the free run's are not needed any more
        else:
            logprobs = pending.gen.logprobs
        if not forkable(self.free):
            self.replay_from = pending.number - 1
            return
        twin = self.free.fork(pending, self._ref, logprobs)
        twin.take(row)
        if chunkable(twin.conv.recipe):
            twin.force_rest_as_chunk()
        elif not twin.gen.done and self.sink is not None:
            self.sink.append(twin)  # decodes step by step from the next step on, in the batch
        self._forced_turn, self.forced = twin, twin.conv

    def end(self, t: int) -> None:
        """Close turn t (after decode_together) and record it."""
        free = self._free_turn
        free.finish()
        reply, conv = free.conv.last_reply, self.free
        out = {"text": reply.text, "tokens": reply.token_ids, "kv_bytes": conv.kv_bytes,
               "history_tokens": len(conv.tokens), "ttft_s": free.ttft_s, "prefilled_tokens": reply.prompt_tokens,
               **_pattern_figures(conv.method_stats[self._seen:])}
        if self.keep_logprobs:
            out["logprobs"] = reply.logprobs
        if self.reference is not None and self.replay_from is None:
            forced = reply  # merged through this turn: the free run was the forced run
            if self._forced_turn is not None:
                self._forced_turn.finish()
                forced = self._forced_turn.conv.last_reply
            self._record_forced(out, t, forced)
        if not self.keep_logprobs:
            reply.logprobs = None
        self.outputs.append(out)
        self._free_turn = self._forced_turn = None

    def _record_forced(self, out: dict, t: int, reply) -> None:
        if self.measure is not None:  # the figures only: [tokens, V] log-probs add up over a run
            out.update(self.measure(t, reply.logprobs))
        else:
            out["forced"] = reply.logprobs
        reply.logprobs = None

    def replay(self) -> _Replay | None:
        """The forced run this track still owes (see replay_from), to run with run_tracks; it fills
        in this track's outputs from that turn on. None when none is owed."""
        if self.replay_from is None:
            return None
        return _Replay(self)

    def abort(self) -> None:
        for p in (self._free_turn, self._forced_turn):
            if p is not None:
                p.abandon()

    def close(self) -> None:
        for conv in (self.free, self.forced):
            if conv is not None:
                conv.close()


class _Replay:
    """A track's forced run from the first turn, step by step in the batch (run_tracks drives it)."""

    def __init__(self, track: Track):
        self.track = track
        self.conv = LockstepConversation(track.llm, track.system, track.free.recipe)
        self.sink = None
        self._turn = None

    def begin(self, t: int) -> list[PendingTurn]:
        tr = self.track
        ref = tr.reference[t]
        self._turn = self.conv.begin(tr.messages[t], len(ref), force=ref, logprobs=t >= tr.replay_from,
                                     shared=tr.shared)
        return [] if self._turn.gen.done else [self._turn]

    def end(self, t: int) -> None:
        self._turn.finish()
        if t >= self.track.replay_from:
            self.track._record_forced(self.track.outputs[t], t, self.conv.last_reply)
        self._turn = None

    def abort(self) -> None:
        if self._turn is not None:
            self._turn.abandon()

    def close(self) -> None:
        self.conv.close()


PATTERN_FIGURES = ("density", "recovered_mass")  # what a sparse prefill computed, when the recipe has one


def _pattern_figures(stats: list[dict]) -> dict:
    """The turn's prefill density (computed / causal cells) and LoopServe's recovered mass."""
    prefill = [entry["prefill"] for entry in stats if "prefill" in entry]
    if not prefill:
        return {}
    return {k: prefill[-1][k] for k in PATTERN_FIGURES if k in prefill[-1]}


def run_tracks(llm, tracks: list[Track], turns: int, max_batch: int = 32) -> None:
    """Every track through `turns` turns together: each turn's prompts prefilled one by one, then every
    generation decoded in lockstep (decode_together). The tracks' conversations stay open."""
    for t in range(turns):
        pendings = []
        try:
            for track in tracks:
                pendings += track.begin(t)
            for track in tracks:
                track.sink = pendings
            decode_together(llm, pendings, max_batch)
            for track in tracks:
                track.end(t)
        except BaseException:
            for track in tracks:
                track.abort()
            raise
