"""The capacity benchmark's workload: N users, each a conversation of several turns.

Turn 1 carries a long document (or a tool's output) and a question; later turns are short questions.
Users arrive as a Poisson process; between a reply and the user's next turn there is an exponential
think time. Everything is drawn from one seed, so every server configuration gets the same workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

QUESTIONS = ["Summarise it in one sentence.", "What is its main topic?", "Name one detail it mentions.",
             "What would you ask its author?", "Give it a title.", "Which part is the most surprising?",
             "What is missing from it?", "Rewrite its first line more simply."]
FIRST = ["Here is a document. Read it, then answer my questions.",
         "A tool returned the output below. Read it, then answer my questions."]


@dataclass
class User:
    index: int
    arrival_s: float  # when the first turn is sent, from the start of the run
    document: str
    turns: int
    think_s: list[float] = field(default_factory=list)  # before turns 2..turns
    questions: list[str] = field(default_factory=list)  # turns 1..turns

    def first_message(self) -> str:
        return f"{FIRST[self.index % 2]}\n\n{self.document}\n\n{self.questions[0]}"


def document_text(tokenizer, n_tokens: int, offset: int) -> str:
    """About n_tokens of prose, different for each user (a different start in the corpus)."""
    from turnkv.bench.datasets.filler import corpus

    paragraphs = corpus()
    out, i, count = [], offset * 7, 0
    while count < n_tokens + 16:  # counted paragraph by paragraph (re-encoding the whole text is quadratic)
        out.append(paragraphs[i % len(paragraphs)])
        count += len(tokenizer.encode(" " + out[-1], add_special_tokens=False))
        i += 1
    ids = tokenizer.encode(" ".join(out), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def parse_turns(spec: str) -> tuple[int, int]:
    """"6" -> (6, 6); "4-8" -> (4, 8)."""
    lo, _, hi = spec.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"turns: give N or LO-HI with 1 <= LO <= HI, got {spec!r}")
    return lo, hi


def make_users(tokenizer, users: int, doc_tokens: int, turns: str, arrival_rate: float, think_s: float,
               seed: int) -> list[User]:
    """arrival_rate: users per second (Poisson); think_s: mean think time between turns."""
    rng = random.Random(seed)
    lo, hi = parse_turns(turns)
    out, t = [], 0.0
    for i in range(users):
        n = rng.randint(lo, hi)
        user = User(i, t, document_text(tokenizer, doc_tokens, i), n)
        user.think_s = [rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(n - 1)]
        user.questions = [rng.choice(QUESTIONS) for _ in range(n)]
        out.append(user)
        t += rng.expovariate(arrival_rate) if arrival_rate > 0 else 0.0
    return out
