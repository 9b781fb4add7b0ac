"""The interface of each axis: what the engine and the recipe call on a component, and when.

A recipe picks one component per axis:

    axis                 interface(s)                    registry kinds
    prefill pattern      Prefill (+ StaticSparsity)      prefill
    eviction             Scorer, Allocator, Turns        scorer, allocator, turns
    decode selection     Decode -> DecodeSelection       decode
    state between turns  StateStrategy                   state

A component is a dataclass whose fields are its parameters, each with a default, registered with
`turnkv.methods.registry.register(kind, name)`, which sets its `name` and refuses a class that does
not derive from its kind's interface below. Components are shared by every conversation that uses
the recipe; per-conversation state lives in what they return (a DecodeSelection) or in the recipe's
MethodState.

Shapes: B sequences in a batch, L layers, H KV heads, Hq query heads, G = Hq // H, T new tokens of a
chunk, S keys a head holds (padded to the longest head), D head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from turnkv.attention.lines import Keys
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.chunk_windows import NO_WINDOW, ChunkWindows  # noqa: F401 (NO_WINDOW: re-exported)
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.window import QueryWindow
from turnkv.model.parallel import Shard


# ---- prefill pattern --------------------------------------------------------------------------------
class Prefill(ABC):
    """What each new query attends to while a turn is prefilled.

    Attributes
    ----------
    sparse : bool, default True
        False: the engine runs its own dense causal attention and never calls `attend` (the `dense`
        pattern). True: the engine hands every layer of every prefill chunk to `attend`.
    """

    name: ClassVar[str]
    sparse: ClassVar[bool] = True
    # Whether every row's attention depends on positions alone, whatever chunks the prompt is
    # prefilled in (Recipe.path_independent). False by default: a pattern estimated from a chunk's
    # last queries depends on where the chunks start.
    path_independent: ClassVar[bool] = False

    def bind(self, num_layers: int, shard: Shard | None = None) -> None:
        """Called once per conversation, before its first `attend`, with the model's layer count
        (a chunk only shows one layer) and, under tensor parallelism, the shard whose KV heads the
        chunks show (turnkv/model/parallel.py; None on one device). Default: nothing."""

    def chunk_windows(self, seqs: Sequence[SequenceKV], num_new: int) -> ChunkWindows | None:
        """For a chunk of `num_new` tokens that `seqs` have just reserved (their lengths count them):
        whether each row sees exactly the keys its head keeps up to its own position that lie within
        a per-(layer, KV head) window of it or below a sink. The engine then runs the chunk on its own
        paths (engine/step.py: the windowed chunk kernel, or whole and windowed heads apart) and does not
        call `attend`. Host work only. Default: None (call `attend`)."""
        return None

    def paths_change_at(self) -> int:
        """Prompt tokens past which the pattern's chunks take paths that shorter prompts never do (the
        server's warm-up prefills one prompt that long, so no kernel compiles for its first users).
        Default: 0 (none)."""
        return 0

    @abstractmethod
    def attend(self, layer: int, keys: Keys) -> tuple[torch.Tensor, dict]:
        """The attention of one prefill chunk in one layer, under this pattern.

        Parameters
        ----------
        layer : int
            The layer index.
        keys : turnkv.attention.lines.Keys
            The chunk's queries q [B, Hq, T, D] at positions q_pos [B, T], and every key they may see:
            k, v [B, H, S, D] (post-RoPE) at positions k_pos [B, H, S], valid [B, H, S] (or None when
            every head holds S keys). Causality is by position: a row sees keys at positions <= its own.

        Returns
        -------
        out : torch.Tensor
            [B, Hq, T, D], in q's dtype.
        stats : dict
            "layer"; "computed" and "causal", the attention cells computed and the causal cells, per
            sequence and head (their ratio is the density); optionally "vertical" / "slash" lines per
            head [B, U], "recovered" / "estimated" sampled mass [B, U], and "time_<stage>" seconds.
            `turnkv.methods.prefill.pattern_hook.summarise` folds them into the turn's statistics.
        """


class StaticSparsity(ABC):
    """A prefill pattern that also decides what some KV heads keep in the store (streaming heads:
    sink + a local window). The recipe calls `trim` after every prefill slice and decode step, and a
    decode selection leaves the flagged heads out of its selection (DecodeSelection.exclude_static)."""

    @abstractmethod
    def flags(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
        """[L, H] bool: True for a head that keeps and reads only its static window."""

    @abstractmethod
    def trim(self, kv: SequenceKV, prompt_open: bool = False) -> None:
        """Drop the tokens the flagged heads no longer keep; their pages go back to the pool.
        prompt_open: more of the turn's prompt is still to be prefilled (keep what its rows see)."""

    def kept_at_most(self, prompt_open: bool, page_size: int) -> int | None:
        """Tokens a flagged head holds at most after a trim (prompt_open: between a prompt's slices),
        for admission by memory; None: no bound known (count every token)."""
        return None


# ---- eviction: scorer, allocator, turn policy -------------------------------------------------------
class Scorer(ABC):
    """Ranks the tokens of one layer: the eviction driver keeps each head's best-scored candidates.

    Attributes
    ----------
    window : int, default 0
        Queries of the conversation's last positions the scorer reads (LayerView.queries); the engine
        records that many per layer. 0: the scorer needs no queries.
    accumulates_attention : bool, default False
        True: every query the conversation computes adds its attention weights to a mass stored beside
        each key (LayerView.attention_mass), which forces the reference attention path.
    query_moments : int or None, default None
        Not None: the engine also keeps the running pre-RoPE moments of every query the conversation
        computes at positions >= this (LayerView.moments), whatever the window holds.
    stacks_layers : bool, default False
        True: score() scores each row from that row's keys, values, positions, valid entries and its
        query group alone, and reads neither layer, target, attention_mass nor moments. The eviction
        then scores several layers in one call, on a view whose rows are all their heads
        (layer_view.stack_layers).
    """

    name: ClassVar[str]
    window: int = 0
    accumulates_attention: ClassVar[bool] = False
    stacks_layers: ClassVar[bool] = False
    query_moments: int | None = None

    @abstractmethod
    def score(self, view: LayerView) -> torch.Tensor:
        """Scores of every token a layer holds; higher is more worth keeping.

        Parameters
        ----------
        view : turnkv.methods.evict.layer_view.LayerView
            One layer of one conversation: keys, values [H, S, D] (post-RoPE), positions and valid
            [H, S], the observation window (queries [W, Hq, D] at query_positions [W]) when `window`
            > 0, the accumulated attention_mass [H, S] when `accumulates_attention`, the query
            moments when `query_moments` is not None, and `target`,
            the per-head token count this layer will keep.

        Returns
        -------
        torch.Tensor
            [H, S] float. +inf marks a token that must stay (a sink, the observation window). Entries
            past a head's length and outside the compressed span are ignored.
        """

    def layer_target(self, target: int, layer: int, num_layers: int, available: int) -> int:
        """The per-head token target of `layer`, given the recipe's average `target` and the most
        candidates any head of the layer has (`available`). Default: `target` in every layer."""
        return target


class Allocator(ABC):
    """Splits each layer's token budget among its KV heads."""

    name: ClassVar[str]

    @abstractmethod
    def allocate_layers(self, scores: torch.Tensor, totals: Sequence[int]) -> torch.Tensor:
        """How many tokens each head of each layer keeps, for several layers at once.

        Parameters
        ----------
        scores : torch.Tensor
            [T, H, S] float, on the device the scores were computed on: +inf for a token that must
            stay, -inf for one that is not a candidate (padding included), finite scores for the
            candidates. The few per-head integer decisions run on the CPU; work over all S runs where
            the scores are, for all T layers together.
        totals : sequence of int
            [T] tokens each layer keeps, at least its +inf tokens (the eviction driver lets surplus
            protected tokens compete by score instead).

        Returns
        -------
        torch.Tensor
            [T, H] int64 counts on the CPU, each at least the head's +inf tokens and at most its non
            -inf ones, each row summing to min(total, number of the layer's non -inf tokens). A
            layer's counts do not depend on the other layers in the call.
        """

    def allocate(self, scores: torch.Tensor, total: int) -> torch.Tensor:
        """allocate_layers of one layer: scores [H, S] -> [H] counts."""
        return self.allocate_layers(scores[None], [total])[0]


class Turns(ABC):
    """The multi-turn policy of eviction: which positions a compression may touch, and how many
    tokens the layer keeps among them."""

    name: ClassVar[str]
    # Whether a first turn's finished prefix (the system prompt) is compressed at its own end, from
    # its own queries, before the rest of the prompt is prefilled: the result then depends on that
    # prefix alone, and conversations that begin with it can share it (turnkv/engine/prefix.py).
    closes_prefix: ClassVar[bool] = False

    @abstractmethod
    def span_start(self, frozen_upto: int) -> int:
        """The first position a compression may evict, given that positions below `frozen_upto` were
        compressed before."""

    @abstractmethod
    def span_end(self, segment_end: int, next_position: int) -> int:
        """The end of the span compressed after a prompt: `segment_end` ends the finished segments
        (system prompt, earlier turns), `next_position` the prompt just prefilled."""

    @abstractmethod
    def keep_total(self, heads: int, target: int, kept_before: int, candidates: int,
                   keep_ratio: float | None) -> int:
        """Tokens one layer keeps among its `candidates` (summed over heads).

        Parameters
        ----------
        heads : int
            KV heads of the layer.
        target : int
            Per-head token target of the layer (Scorer.layer_target of the recipe's budget).
        kept_before : int
            Tokens below the span that the layer holds (summed over heads).
        candidates : int
            Tokens in the span (summed over heads).
        keep_ratio : float or None
            The recipe's keep_ratio, or None when it gives a token budget.

        Returns
        -------
        int
            In [0, candidates].
        """


# ---- decode selection -------------------------------------------------------------------------------
class DecodeSelection(ABC):
    """One conversation's decode selection: which kept tokens each decode step reads, without
    evicting any. The engine's step calls `begin` once per forward step (prefill chunk or decode
    step), `observe` per layer with that step's queries, and `entries` per layer of a decode step.

    Attributes
    ----------
    steps : int
        Decode steps in the running turn.
    ticks : int
        `begin` calls, ever: the CUDA-graph handler compares it to tell whether an eager step ran.
    selections : int
        Selections made in the running turn (the turn's statistics).
    graph_record : object or None
        Bookkeeping of the CUDA-graph handler for this conversation; None until it first runs.
    """

    steps: int
    ticks: int
    selections: int
    graph_record: Any = None

    @abstractmethod
    def begin(self, decoding: bool) -> None:
        """A forward step starts: a decode step (decoding) or a prefill chunk, which starts a turn."""

    @abstractmethod
    def observe(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's post-RoPE queries of `layer`, q [T, Hq, D] at positions [T].

        q is a view into the step's activations (a prefill chunk's fused QKV output): whatever is
        kept past the step must be a copy, or a view of a one-token step's rows, never a view of a
        chunk's (it would hold the chunk's whole projection output alive)."""

    @classmethod
    def observe_batch(cls, layer: int, selections: Sequence[DecodeSelection], q: torch.Tensor,
                      positions: torch.Tensor) -> None:
        """`observe` of n selections of this class in one call: q [n, T, Hq, D], positions [n, T], row
        i selection i's. Default: one `observe` each."""
        for i, sel in enumerate(selections):
            sel.observe(layer, q[i], positions[i])

    @abstractmethod
    def entries(self, layer: int, seq: SequenceKV) -> tuple[torch.Tensor, np.ndarray] | None:
        """What this decode step reads in `layer` of `seq`.

        Returns
        -------
        (entries, counts) or None
            entries [R, W] int64 indices into each head's token list, counts [R] (numpy): row r reads
            its first counts[r] entries, ascending. R = H (row r reads KV head r) or Hq (row r reads
            KV head r // G). None: every kept token (the step's paged tables).
        """

    def batch_key(self, layer: int, seq: SequenceKV) -> Hashable | None:
        """Selections of one class whose keys in `layer` are equal (and not None) answer a decode step's
        `layer` together, through `entries_batch`. None (the default): this one answers alone, through
        `entries`."""
        return None

    @classmethod
    def entries_batch(cls, layer: int, seqs: Sequence[SequenceKV], selections: Sequence[DecodeSelection],
                      tables: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, np.ndarray] | None:
        """`entries` of n selections of equal batch_key at once, leaving each one's state as its own
        `entries` call would.

        Parameters
        ----------
        seqs, selections : the n conversations and their selections, in the step's order.
        tables : torch.Tensor
            [n, H, P] the conversations' page tables of `layer` (the step's, any int dtype, zero-padded
            to the widest).

        Returns
        -------
        (which, entries, counts) or None
            which: ascending indices into seqs of the m conversations that read a selection, entries
            [m, R, W] and counts [m, R] their `entries` (padded to the widest); the other conversations
            read every kept token. None: all of them do.
        """
        raise NotImplementedError(f"{cls.__name__} gives a batch_key but no entries_batch")

    @abstractmethod
    def discard_step(self, seq: SequenceKV, position: int) -> None:
        """Undo a decode step that ran and was then dropped: the engine launched it before reading
        the token that ended the generation (engine/decode_loop.py). Whatever the step left in the
        selection's state that a later step or turn would read (its queries, the statistics its key
        was folded into, the step count) must be as if it never ran.

        Parameters
        ----------
        seq : SequenceKV
            The conversation's KV, the step's token already taken out (next_position == position).
        position : int
            The dropped step's token position.
        """

    def exclude_static(self, static: StaticSparsity) -> None:
        """The recipe's static sparsity: its flagged heads read their whole (small) list and never
        select. Default: ignored."""

    def graph_config(self) -> tuple[str, Any] | None:
        """How the CUDA-graph decode replays this selection.

        Returns
        -------
        (kind, config) or None
            kind names the graph handler of `turnkv.engine.graph_selection` that captures and replays
            the selection's steps ("paged": page selection by key min/max; "progressive": token
            re-selection by window attention); config, a dataclass, keys its buffers and graphs
            (conversations with equal configs share them). None (the default): the decode steps of
            this selection run eagerly.
        """
        return None


class WriteWatcher(ABC):
    """A decode selection that keeps statistics beside the pool's pages (per-page key min/max): the
    step hands it every K write of its sequence, prefill and decode."""

    @abstractmethod
    def written(self, layer: int, seq: SequenceKV, slots: torch.Tensor, k: torch.Tensor) -> None:
        """The sequence's keys k [T, H, D] of the step, as the decoder makes them (a view: any
        strides), were written in `layer` at flat pool slots [H * T] (page * page_size + offset) in
        (head, token) order, each head's T tokens in its pages in order."""

    def write_key(self, seq: SequenceKV) -> Hashable | None:
        """Watchers of one class with equal keys (not None) take a step's writes together, through
        `step_writes`. None (the default): this one takes them alone, through `written`."""
        return None

    @classmethod
    def step_writes(cls, seqs: Sequence[SequenceKV], watchers: Sequence[WriteWatcher], num_new: int):
        """One step's writes of n watchers of equal write_key, built after the step's `begin` calls ->
        written(layer, slots [n, H, T], k [n, T, H, D]), called once per layer in layer order, row i
        watcher i's (as `written`'s), leaving each watcher as its own `written` calls would."""
        raise NotImplementedError(f"{cls.__name__} gives a write_key but no step_writes")


class Decode(ABC):
    """Which kept tokens a decode step reads.

    Attributes
    ----------
    selects : bool, default True
        False: every decode step reads every kept token and `new_state` gives None (the `all` decode).
    """

    name: ClassVar[str]
    selects: ClassVar[bool] = True
    # Whether a turn's selections depend on nothing a conversation carries from earlier turns beyond
    # its KV (they start afresh at every prefill, from the pool and the turn's own queries):
    # Recipe.path_independent. False by default.
    path_independent: ClassVar[bool] = False

    @abstractmethod
    def new_state(self, num_layers: int) -> DecodeSelection | None:
        """A new conversation's selection state (None when `selects` is False)."""


# ---- state between turns ----------------------------------------------------------------------------
class StateStrategy(ABC):
    """Where a conversation's KV lives between turns and how it comes back. The state manager calls
    `pack` while the KV is still resident (at turn end, or when the GPU tier needs room) and `restore`
    into an empty sequence when the conversation returns. The token history is always stored beside
    the state, so a strategy can recompute whatever it did not keep.

    Attributes
    ----------
    offloads_between_turns : bool, default True
        True: the conversation leaves the GPU at every turn end. False: only when the GPU tier needs
        room (the resident `gpu` strategy).
    needs_costs : bool, default False
        True: `pack` reads the calibrated restore costs (`ctx.cost`, `ctx.recompute_ratio`). The
        calibration runs the model, so a manager that packs on another thread calibrates first, on
        its own.
    """

    name: ClassVar[str]
    offloads_between_turns: ClassVar[bool] = True
    needs_costs: ClassVar[bool] = False
    # False for a strategy whose query_window records more than the last queries (the whole turn's):
    # what it stores then depends on which tokens were computed in which turn (Recipe.path_independent,
    # and no prefix sharing at all: turnkv/engine/prefix.py).
    path_independent: ClassVar[bool] = True

    def query_window(self, num_layers: int, size: int) -> QueryWindow | None:
        """The per-conversation query recorder the engine fills during a turn, for an eviction scorer
        that reads `size` queries. Default: the last `size` queries (None when 0); a strategy that
        looks at the whole turn's attention records more."""
        return QueryWindow(num_layers, size) if size else None

    def prepare(self, ctx, seq: SequenceKV, window: QueryWindow | None, tier: str = "cpu"):
        """The part of a pack to `tier` that runs on the caller's thread, once per pack, before `pack`: under
        tensor parallelism it may run collectives (every rank calls it at the same point), and what
        it returns is the same on every rank. `pack(..., prepared=its result)` then runs no
        collective, so it may run on a background packer's thread. Default: None (nothing to agree)."""
        return None

    @abstractmethod
    def pack(self, ctx, seq: SequenceKV, window: QueryWindow | None, tier: str = "cpu", prepared=None):
        """What to store for the conversation.

        Parameters
        ----------
        ctx : turnkv.state.context.RestoreContext
            The model, the page pool and the calibrated recompute and load costs.
        seq : SequenceKV
            The conversation's resident KV (not changed).
        window : QueryWindow or None
            The turn's recorded queries (what `query_window` made).
        tier : str
            "cpu" or "disk", where the state goes.
        prepared : object
            What `prepare` returned for this pack (None: `pack` prepares itself).

        Returns
        -------
        turnkv.state.base.Stored
            JSON meta and named tensors.
        """

    @abstractmethod
    def restore(self, ctx, seq: SequenceKV, tokens: list[int], meta: dict, tensors: dict[str, torch.Tensor]):
        """Rebuild the KV into the empty `seq` from what `pack` stored and the token history.

        Returns
        -------
        turnkv.state.streams.LoadStream or None
            A stream still loading layers (the next turn waits per layer), or None when done.
        """
