"""What a quality-benchmark instance is: a multi-turn conversation whose every turn has a context, a
question placed at the Begin, Middle or End of the user message, a reference answer, and the earlier
turns it depends on."""

from __future__ import annotations

from dataclasses import dataclass, field

POSITIONS = ("begin", "middle", "end")
METRICS = ("f1", "em", "rouge_l", "accuracy", "contains", "instructions")


@dataclass
class Turn:
    context: str  # what the user brings this turn (a document, filler, examples); may be empty
    question: str
    answer: str | list[str]  # the reference; a list means any of them is right
    position: str = "end"
    depends_on: list[int] = field(default_factory=list)  # indices of earlier turns needed to answer
    metric: str = "f1"
    instructions: list[dict] = field(default_factory=list)  # rule checks for metric "instructions"

    def __post_init__(self):
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}")

    @property
    def scored(self) -> bool:
        """False for turns that only set the scene (a stated preference, given chat history)."""
        if self.metric == "instructions":
            return bool(self.instructions)
        return self.answer not in ("", [])

    def message(self) -> str:
        """The user message: the question before, inside (at a paragraph boundary near the middle),
        or after the context."""
        if not self.context:
            return self.question
        if self.position == "begin":
            return f"{self.question}\n\n{self.context}"
        if self.position == "end":
            return f"{self.context}\n\n{self.question}"
        paragraphs = self.context.split("\n\n")
        if len(paragraphs) > 1:
            half = len(paragraphs) // 2
            before, after = "\n\n".join(paragraphs[:half]), "\n\n".join(paragraphs[half:])
        else:
            words = self.context.split(" ")
            before, after = " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])
        return f"{before}\n\n{self.question}\n\n{after}"


@dataclass
class Instance:
    task: str
    id: str
    turns: list[Turn]
    system: str | None = None

    def with_position(self, position: str) -> Instance:
        """The same conversation with every question moved to `position`."""
        from dataclasses import replace

        return replace(self, id=f"{self.id}-{position}", turns=[replace(t, position=position) for t in self.turns])


def seeded_instances(task: str, system: str | None, make_turns, n: int, seed: int, turns: int,
                     context_tokens: int, difficulty: int, tokenizer) -> list[Instance]:
    """`n` instances of a task whose `make_turns(rng, turns, context_tokens, difficulty, tokenizer)`
    builds one conversation. Instance i draws from its own seeded generator, so it is the same whatever
    n is, and its id names the settings, so a results file never resumes onto other instances."""
    import random

    return [Instance(task, f"{task}-s{seed}-t{turns}-c{context_tokens}-d{difficulty}-{i}",
                     make_turns(random.Random(f"{task}:{seed}:{i}"), turns, context_tokens, difficulty, tokenizer),
                     system=system)
            for i in range(n)]
