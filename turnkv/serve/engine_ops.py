"""The one seam between the server's worker thread and the engine: every change the worker makes to
the engine (conversations, turns, forwards, the state tiers, the prefix index) is one operation here.

An operation is a module-level function op(ctx, *args) over one rank's objects (`Ctx`), which names
conversations by their id and turns by a number: ints, strings, token ids and small dataclasses, no
tensors. On one device EngineOps.run(op, ...) calls it. On rank 0 of a tensor-parallel engine it also
sends it to every worker, which runs it on its own objects at the same time
(turnkv.parallel.mirror.lockstep), so the ranks run the same forwards, hooks and tier moves in the
worker thread's order. What depends on rank 0 alone stays there and goes to the workers as data:
tokenization (the token ids), sampling (each accepted token, with the generation's finish reason,
rides on the next operation), time-based decisions (idle TTL, eviction order: the store sends which
conversation to drop or move). Per-item failures inside a step (a recipe hook raising for one turn)
are returned by position, so the step's other turns go on; the ranks must agree on them.

Contracts:
- Only the worker thread calls EngineOps (one operation at a time on every rank).
- A conversation exists on every rank from new_conversation() to close(); a turn from begin_turn()
  to finish() or abandon().
- Under tensor parallelism the store's tier hook is a LockstepTiers (lockstep_tiers.py): rank 0
  decides what depends on time (which background packs are taken) and every rank makes the moves; a
  pack's collectives run in the operation, its copies on each rank's background packer.
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from dataclasses import dataclass, field, replace

from turnkv.engine import decode_loop, mixed
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import InvalidRequestError
from turnkv.methods.recipe import Recipe
from turnkv.parallel.mirror import lockstep
from turnkv.serve.lockstep_tiers import LockstepTiers
from turnkv.serve.tier_hook import StateTierHook


@dataclass
class Ctx:
    """One rank's objects: conversations by id, turns by number; tiers: its TierHook (or None)."""

    llm: object
    tiers: object = None
    convs: dict = field(default_factory=dict)
    turns: dict = field(default_factory=dict)
    recipes: dict = field(default_factory=dict)  # recipe key -> Recipe
    gens: dict = field(default_factory=dict)  # rank 0: the Generation a turn about to begin takes


@dataclass
class Stepped:
    """A step's result: its value, and {position of the turn in the step: the exception its hook raised}."""

    value: object
    errors: dict


_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # on a worker: engine -> its Ctx


def _signature(result):
    """What the ranks must agree on after an operation."""
    if isinstance(result, Stepped):
        return sorted(result.errors)
    if isinstance(result, tuple) and all(isinstance(x, str) for x in result):
        return result  # the tiers the packs an operation took landed in
    return result if isinstance(result, (bool, int, str, type(None))) else None


def _replay(engine, pending: list, op, args: tuple):
    """A worker's side of EngineOps.run: accept rank 0's tokens since the last operation, run `op`."""
    ctx = _WORKERS.get(engine)
    if ctx is None:
        ctx = _WORKERS[engine] = Ctx(engine)
    for tid, token, reason in pending:
        gen = ctx.turns[tid].gen
        if token is not None:
            gen.accept(token)
        gen.finish_reason = reason  # rank 0's: a grammar or a forced end decides it there
    return _signature(op(ctx, *args))


# ---- operations: op(ctx, *args), run alike on every rank ----------------------------------------------
def start(ctx, calibrate: bool, recipe_key: str, background: bool = False) -> None:
    """A server starts on the engine: forget an earlier server's objects (a worker gets a TierHook over
    its own state tiers); with calibrate, calibrate the restore costs of the default recipe's state
    strategy (it runs the model); with background, pack on a background packer (rank 0 has one)."""
    ctx.convs.clear()
    ctx.turns.clear()
    if ctx.tiers is None and ctx.llm.parallel is not None and ctx.llm.parallel.leader is None:
        ctx.tiers = StateTierHook(ctx.llm.state)  # a worker's: no metrics
    if calibrate:
        ctx.llm.state.calibrate_for(_recipe(ctx, recipe_key).state)
    if background and ctx.llm.state.packer is None:
        ctx.llm.state.pack_in_background()


def pack_inline(ctx) -> None:
    """The server stopped: take every pack in flight, and pack inside a turn's end again."""
    ctx.llm.state.pack_inline()


def _recipe(ctx, key: str) -> Recipe:
    if key not in ctx.recipes:
        ctx.recipes[key] = ctx.llm.resolve_recipe(Recipe.parse(key))
    return ctx.recipes[key]


def new_conversation(ctx, cid: str, recipe_key: str) -> Conversation:
    conv = Conversation(ctx.llm, None, _recipe(ctx, recipe_key))
    conv.id = cid
    ctx.convs[cid] = conv
    return conv


def reset(ctx, cid: str) -> None:
    ctx.convs[cid].reset()


def close(ctx, cid: str) -> None:
    ctx.convs.pop(cid).close()


def cut(ctx, cid: str, tokens: int, chars: int) -> None:
    ctx.convs[cid]._cut(tokens, chars)


def free(ctx, cid: str) -> None:
    ctx.convs[cid].kv.free()


def clear_index(ctx) -> int:
    index = ctx.llm.prefix_index
    if index is None:
        return 0
    entries = len(index)
    index.clear()
    return entries


def begin_turn(ctx, tid: int, cid: str, inputs: TurnInput, params) -> TurnRun:
    conv = ctx.convs[cid]
    gen = ctx.gens.pop(tid, None) or ctx.llm.turn_parts.new_generation(conv.kv, params)
    turn = TurnRun(conv, inputs, gen).begin()
    ctx.turns[tid] = turn
    return turn


def prefill(ctx, tid: int, size: int):
    """The next `size` prompt tokens; the logits [V] after the last one once the prompt is in, else None."""
    return ctx.turns[tid].prefill(size, defer_prompt_hook=True)


def settle(ctx, tid: int) -> None:
    ctx.turns[tid].settle()


def decode(ctx, tids: list[int]) -> Stepped:
    """One decode forward over the turns (decode_loop.forward), then each one's per-step hook:
    Stepped(logits [B, V], errors)."""
    turns = [ctx.turns[t] for t in tids]
    logits = decode_loop.forward(ctx.llm, turns)
    return Stepped(logits, _hooks(turns))


def mixed_step(ctx, batches: list[list[int]], slices: list[tuple[int, int]]) -> Stepped:
    """One mixed forward (engine/mixed.py) over decode batches and prefill slices (turn, size), then the
    decode turns' per-step hooks and the slices' prefill bookkeeping. Stepped((logits per part, the
    logits [V] of each slice that ended its prompt or None), errors by position: the decode turns in
    order, then the slices)."""
    decoding = [[ctx.turns[t] for t in batch] for batch in batches]
    parts = [mixed.decode_part(batch) for batch in decoding]
    parts += [mixed.slice_part(ctx.turns[t], size) for t, size in slices]
    logits = mixed.forward(ctx.llm.runner, parts)
    flat = [turn for batch in decoding for turn in batch]
    errors = _hooks(flat)
    lasts = []
    for i, ((t, _), part, rows) in enumerate(zip(slices, parts[len(batches):], logits[len(batches):])):
        try:
            lasts.append(ctx.turns[t].chunk_prefilled(part.width, rows[0], defer_prompt_hook=True))
        except Exception as e:  # noqa: BLE001 - that request fails; the step's others go on
            errors[len(flat) + i] = e
            lasts.append(None)
    return Stepped((logits, lasts), errors)


def _hooks(turns: list[TurnRun]) -> dict:
    errors = {}
    for i, turn in enumerate(turns):
        try:
            turn.after_step_hook()
        except Exception as e:  # noqa: BLE001 - that request fails; the step's others go on
            errors[i] = e
    return errors


def finish(ctx, tid: int):
    reply = ctx.turns[tid].finish()
    del ctx.turns[tid]
    return reply


def abandon(ctx, tid: int) -> None:
    turn = ctx.turns.pop(tid, None)
    if turn is not None:
        turn.abandon()


# ---- rank 0 ----------------------------------------------------------------------------------------------
class EngineOps:
    """Rank 0's seam (on one device, the only rank). tiers: the store's TierHook, or None."""

    def __init__(self, llm, tiers=None):
        self.llm = llm
        self.ctx = Ctx(llm, tiers)
        self.pending: list[tuple[int, int | None, str | None]] = []  # accepted since the last operation
        self._numbers = itertools.count(1)
        self._tids: dict[int, int] = {}  # id(TurnRun) -> its number
        self.parallel = getattr(llm, "parallel", None) is not None
        if self.parallel and tiers is not None and not hasattr(tiers, "manager"):
            raise InvalidRequestError("a tensor-parallel server keeps idle conversations in the engine's state tiers "
                                      "(tiers='state') or drops them (tiers=None)")
        self.tiers = None if tiers is None else (LockstepTiers(self, tiers) if self.parallel else tiers)

    def run(self, op, *args):
        if not self.parallel:
            return op(self.ctx, *args)
        pending, self.pending = self.pending, []
        return lockstep(self.llm, _replay, (pending, op, args), lambda: op(self.ctx, *args), _signature)

    def unavailable(self) -> str | None:
        """Why the engine cannot serve (a tensor-parallel engine whose worker failed), or None."""
        leader = getattr(self.llm.parallel, "leader", None) if self.parallel else None
        if leader is None:
            return None
        try:
            leader.check()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return str(e)
        return None

    # ---- conversations ----
    def start(self, recipe, calibrate: bool) -> None:
        """The server starts (before its worker thread runs); with calibrate, every rank calibrates
        the restore costs of `recipe`'s state strategy. Where rank 0 packs on a background packer,
        every rank does."""
        self.ctx.recipes[str(recipe)] = recipe
        background = self.parallel and self.ctx.tiers is not None and self.llm.state.packer is not None
        self.run(start, calibrate, str(recipe), background)

    def pack_inline(self) -> None:
        """The server stopped (its worker thread has ended): every rank packs inline again."""
        self.run(pack_inline)

    def new_conversation(self, recipe, recipe_key: str, cid: str | None = None) -> Conversation:
        self.ctx.recipes.setdefault(recipe_key, recipe)
        return self.run(new_conversation, cid or uuid.uuid4().hex, recipe_key)

    def reset(self, conv) -> None:
        self.run(reset, conv.id)

    def close(self, conv) -> None:
        if conv.id in self.ctx.convs:
            self.run(close, conv.id)
        else:  # not made here (taken back from a durable tier on one device)
            conv.close()

    def cut(self, conv, tokens: int, chars: int) -> None:
        self.run(cut, conv.id, tokens, chars)

    def free(self, conv) -> None:
        self.run(free, conv.id)

    def clear_index(self) -> int:
        return self.run(clear_index)

    def adopt(self, conv) -> None:
        """A conversation taken back from a durable tier (under tensor parallelism, every rank took it
        back already: LockstepTiers.kept)."""
        self.ctx.convs[conv.id] = conv

    # ---- turns ----
    def begin_turn(self, conv, inputs: TurnInput, gen) -> TurnRun:
        tid = next(self._numbers)
        self.ctx.gens[tid] = gen
        # The workers build their own Generation: rank 0 samples, so theirs needs no grammar, penalties,
        # or log-probabilities; their text and history are not read.
        params = replace(gen.params, logprobs=None, logit_bias=None, frequency_penalty=0.0, presence_penalty=0.0)
        sent = replace(inputs, messages=[] if inputs.messages is not None else None, full_text="")
        try:
            turn = self.run(begin_turn, tid, conv.id, sent if self.parallel else inputs, params)
        finally:
            self.ctx.gens.pop(tid, None)
        if self.parallel:
            turn.inputs = inputs  # rank 0 keeps the turn's whole history and text
        self._tids[id(turn)] = tid
        return turn

    def prefill(self, turn, size: int):
        return self.run(prefill, self._tids[id(turn)], size)

    def settle(self, turn) -> None:
        self.run(settle, self._tids[id(turn)])

    def take(self, turn, logits) -> str:
        """Sample the turn's next token (rank 0), accept it; the workers accept it at the next operation."""
        piece = turn.take(logits)
        if self.parallel:
            self.pending.append((self._tids[id(turn)], turn.gen.token_ids[-1], turn.gen.finish_reason))
        return piece

    def end(self, turn, reason: str) -> str:
        piece = turn.gen.end(reason)
        if self.parallel:
            self.pending.append((self._tids[id(turn)], None, turn.gen.finish_reason))
        return piece

    def decode(self, turns: list) -> Stepped:
        """decode(): Stepped(logits [B, V], {id(turn): what its hook raised})."""
        return _by_turn(self.run(decode, [self._tids[id(t)] for t in turns]), turns)

    def mixed(self, batches: list[list], slices: list[tuple]) -> Stepped:
        """mixed_step() over decode batches (of turns) and slices (turn, size); errors by id(turn)."""
        step = self.run(mixed_step, [[self._tids[id(t)] for t in batch] for batch in batches],
                        [(self._tids[id(t)], size) for t, size in slices])
        return _by_turn(step, [t for batch in batches for t in batch] + [t for t, _ in slices])

    def finish(self, turn):
        reply = self.run(finish, self._tids[id(turn)])
        self._tids.pop(id(turn), None)
        return reply

    def abandon(self, turn) -> None:
        tid = self._tids.pop(id(turn), None)
        if tid is not None:
            self.run(abandon, tid)


def _by_turn(step: Stepped, turns: list) -> Stepped:
    return Stepped(step.value, {id(turns[i]): e for i, e in step.errors.items()})
