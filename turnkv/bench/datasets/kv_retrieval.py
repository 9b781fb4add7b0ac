"""Key-value retrieval across turns: LongEval's lines ("line amber-falcon: REGISTER_CONTENT is <38211>")
or the JSON key-value pairs of "Lost in the Middle" (random UUID keys and values).

Line labels are pairs of words from the filler corpus, as LongEval's are pairs of random words. Every
turn brings a block of records filling the context budget. Turn 0 asks for a value of its own
block; every later turn asks for a value given in a random earlier turn (`depends_on`). Difficulty is
the number of decoy keys per asked key: for lines, labels that share the asked label's first word; for
JSON, keys that share its first eight hex digits.

The records of one turn come in paragraphs of a few records each, so a question placed in the middle
of the message falls between two paragraphs and never splits a record.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache

from turnkv.bench.datasets.filler import corpus, count_tokens
from turnkv.bench.datasets.schema import Instance, Turn

TASK = "kv_retrieval"
STYLES = ("lines", "json")
SYSTEM = ("The user shares records over several turns and asks for values from them. Answer with the value "
          "only, using the records from any turn of the conversation.")

PER_PARAGRAPH = 8


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Words for line labels, as LongEval's word pairs: the filler corpus's plain words of 4 to 9 letters."""
    return tuple(sorted({w for p in corpus() for w in re.findall(r"\b[a-z]{4,9}\b", p)}))


class Records:
    """Keys and values of one instance, never repeated."""

    def __init__(self, rng: random.Random, style: str):
        self.rng, self.style = rng, style
        self.keys: set[str] = set()
        self.values: set[str] = set()

    def _uuid(self) -> str:
        h = "%032x" % self.rng.getrandbits(128)
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) % 4]}{h[17:20]}-{h[20:32]}"

    def key(self, near: str | None = None) -> str:
        for attempt in range(10_000):
            if self.style == "lines":
                first = near.split("-")[0] if near and attempt < 1000 else self.rng.choice(vocabulary())
                key = f"{first}-{self.rng.choice(vocabulary())}"
            else:
                key = self._uuid()
                if near:
                    key = near[:8] + key[8:]
            if key not in self.keys:
                self.keys.add(key)
                return key
        raise RuntimeError("no fresh key left")

    def value(self) -> str:
        while True:
            value = str(self.rng.randint(10000, 99999)) if self.style == "lines" else self._uuid()
            if value not in self.values:
                self.values.add(value)
                return value

    def render(self, pairs: list[tuple[str, str]]) -> str:
        if self.style == "lines":
            return "\n".join(f"line {k}: REGISTER_CONTENT is <{v}>" for k, v in pairs)
        return json.dumps(dict(pairs))

    def question(self, key: str) -> str:
        if self.style == "lines":
            return f"What is the REGISTER_CONTENT in line {key}? Answer with the number only."
        return f'What is the value of the key "{key}" in the JSON objects? Answer with the value only.'


def _pairs_per_budget(records: Records, context_tokens: int, tokenizer) -> int:
    """How many records fill `context_tokens`, measured on a sample rendered like the real ones."""
    probe = Records(random.Random(0), records.style)
    sample = [(probe.key(), probe.value()) for _ in range(PER_PARAGRAPH)]
    per_record = count_tokens(records.render(sample), tokenizer) / PER_PARAGRAPH
    return max(2, round(context_tokens / per_record))


def make_instance(rng: random.Random, turns: int, context_tokens: int, difficulty: int, tokenizer=None,
                  style: str = "lines") -> list[Turn]:
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}")
    records = Records(rng, style)
    per_turn = _pairs_per_budget(records, context_tokens, tokenizer)
    sources = [0] + [rng.randrange(t) for t in range(1, turns)]
    blocks: list[list[tuple[str, str]]] = [[] for _ in range(turns)]
    asked = []
    for t in range(turns):
        key, value = records.key(), records.value()
        asked.append((key, value))
        blocks[sources[t]].append((key, value))
        for _ in range(difficulty):  # decoys in a turn up to the one that asks, preferring turns with room
            roomy = [s for s in range(t + 1) if len(blocks[s]) < per_turn] or list(range(t + 1))
            blocks[rng.choice(roomy)].append((records.key(near=key), records.value()))
    turns_out = []
    for t, block in enumerate(blocks):
        block += [(records.key(), records.value()) for _ in range(max(0, per_turn - len(block)))]
        rng.shuffle(block)
        size = max(1, min(PER_PARAGRAPH, len(block) // 2))
        context = "\n\n".join(records.render(block[i : i + size]) for i in range(0, len(block), size))
        key, value = asked[t]
        turns_out.append(Turn(context=context, question=records.question(key), answer=value,
                              depends_on=[] if t == 0 else [sources[t]], metric="contains"))
    return turns_out


def generate(n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None, style: str | None = None) -> list[Instance]:
    """`style`: "lines", "json", or None to alternate them (even instances lines, odd ones JSON)."""
    out = []
    for i in range(n):
        s = style or STYLES[i % 2]
        rng = random.Random(f"{TASK}:{seed}:{i}")
        out.append(Instance(TASK, f"{TASK}-{s}-s{seed}-t{turns}-c{context_tokens}-d{difficulty}-{i}",
                            make_instance(rng, turns, context_tokens, difficulty, tokenizer, s), system=SYSTEM))
    return out
