"""Document QA with planted facts, in the shape of LoopServe's Algorithm 1.

Every turn brings a filler document holding planted facts ("The secret code of the blue door is
4817."). Turn 0 asks about a fact of its own document; every later turn asks about a fact planted in
the document of a random earlier turn, and `depends_on` names that turn. Difficulty is the number of
distractor facts per document: facts of the same kind about a near subject (the red door beside the
blue one), so a model has to find the right one rather than any number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turnkv.bench.datasets.filler import Filler, document
from turnkv.bench.datasets.schema import Instance, Turn, seeded_instances

TASK = "needle_qa"
SYSTEM = ("The user shares documents over several turns and asks questions about them. Answer each question "
          "briefly, using the documents from any turn of the conversation.")

COLORS = ("amber", "black", "blue", "bronze", "copper", "crimson", "golden", "green", "grey", "indigo", "ivory",
          "orange", "purple", "red", "silver", "violet", "white", "yellow")
LOCKED = ("door", "gate", "locker", "safe", "chest", "suitcase", "cabinet", "vault", "mailbox", "drawer")
SURNAMES = ("Abbott", "Barlow", "Carver", "Dalton", "Ellison", "Fairfax", "Garner", "Hollis", "Ingram", "Jarvis",
            "Keller", "Lambert", "Merritt", "Norwood", "Osborne", "Pemberton", "Quinlan", "Radley", "Sheldon",
            "Thornton", "Underwood", "Vance", "Whitlock", "Yardley")
TOWNS = ("Ashcombe", "Brackenridge", "Caldermoor", "Dunholme", "Elmstead", "Fernhollow", "Glenmarsh", "Harrowgate",
         "Ivybridge", "Kestrel Bay", "Larkspur", "Millbrook", "Northwick", "Oakhaven", "Pennycross", "Queensferry",
         "Redmarsh", "Saltcombe", "Thistledown", "Wrenfield")
FIRST_NAMES = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Keiko",
               "Leon", "Mira", "Nils", "Olga", "Pablo", "Rosa", "Soren", "Tessa", "Viktor")
HIDDEN = ("map", "letter", "ring", "key", "diary", "medal", "coin", "photograph", "ticket", "watch")
PLACES = ("blue teapot", "old piano", "garden shed", "attic trunk", "kitchen clock", "flower pot", "wine cellar",
          "broken radio", "wooden birdhouse", "linen cupboard", "coal scuttle", "umbrella stand")
FRUITS = ("apples", "pears", "plums", "cherries", "lemons", "oranges", "apricots", "peaches", "figs", "quinces")
STORES = ("northern", "southern", "eastern", "western", "riverside", "hilltop", "harbour", "old")


@dataclass(frozen=True)
class Fact:
    kind: str
    subject: str  # what the question names; unique within an instance
    statement: str
    question: str
    answer: str


class Facts:
    """Planted facts for one instance: subjects and answers never repeat, so every question has one
    answer in the whole conversation."""

    KINDS = ("code", "harbour", "hidden", "crates")

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.subjects: set[str] = set()
        self.answers: set[str] = set()

    def new(self, kind: str | None = None, near: Fact | None = None) -> Fact:
        """A fresh fact of `kind` (random when None). With `near`, a distractor: the same kind, and a
        subject that shares a word with near's. A kind whose names run out gives way to the others."""
        kinds = [kind or (near.kind if near else self.rng.choice(self.KINDS))]
        kinds += [k for k in self.rng.sample(self.KINDS, len(self.KINDS)) if k != kinds[0]]
        for k in kinds:
            for attempt in range(200):
                fact = getattr(self, "_" + k)(near if k == kinds[0] and attempt < 100 else None)
                if fact.subject not in self.subjects and fact.answer not in self.answers:
                    self.subjects.add(fact.subject)
                    self.answers.add(fact.answer)
                    return fact
        raise RuntimeError("no fresh fact left")

    def _code(self, near):
        thing = near.subject.split()[1] if near else self.rng.choice(LOCKED)
        subject = f"{self.rng.choice(COLORS)} {thing}"
        code = str(self.rng.randint(1000, 9999))
        return Fact("code", subject, f"The secret code of the {subject} is {code}.",
                    f"What is the secret code of the {subject}?", code)

    def _harbour(self, near):
        subject = f"{self.rng.choice(SURNAMES)} family"
        town = self.rng.choice(TOWNS)
        return Fact("harbour", subject, f"The {subject} keeps its sailing boat in the harbour town of {town}.",
                    f"In which harbour town does the {subject} keep its sailing boat?", town)

    def _hidden(self, near):
        person = (near.subject.split(" hid ")[0] if near
                  else f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(SURNAMES)}")
        thing, place = self.rng.choice(HIDDEN), self.rng.choice(PLACES)
        return Fact("hidden", f"{person} hid {thing}", f"{person} hid the {thing} inside the {place}.",
                    f"Where did {person} hide the {thing}?", place)

    def _crates(self, near):
        fruit = near.subject.split(":")[1] if near else self.rng.choice(FRUITS)
        store = self.rng.choice(STORES)
        count = str(self.rng.randint(101, 999))
        return Fact("crates", f"{store}:{fruit}", f"The {store} warehouse stores exactly {count} crates of {fruit}.",
                    f"How many crates of {fruit} does the {store} warehouse store?", count)


def question_sources(rng: random.Random, turns: int) -> list[int]:
    """For each turn, the turn whose document holds the fact it asks about: itself for turn 0, a random
    earlier turn after that."""
    return [0] + [rng.randrange(t) for t in range(1, turns)]


def make_instance(rng: random.Random, turns: int, context_tokens: int, difficulty: int, tokenizer=None) -> list[Turn]:
    if turns < 1:
        raise ValueError("needle_qa needs at least one turn")
    facts, filler = Facts(rng), Filler(rng, tokenizer)
    sources = question_sources(rng, turns)
    asked = [facts.new() for _ in range(turns)]  # asked[t]: the fact turn t asks about
    planted: list[list[Fact]] = [[] for _ in range(turns)]
    for t, fact in enumerate(asked):
        planted[sources[t]].append(fact)
    for t in range(turns):  # distractors: near the facts asked about, else of any kind
        anchors = list(planted[t])
        planted[t] += [facts.new(near=rng.choice(anchors) if anchors else None) for _ in range(difficulty)]
        rng.shuffle(planted[t])
    return [Turn(context=document(filler, context_tokens, [f.statement for f in planted[t]], rng),
                 question=asked[t].question, answer=asked[t].answer, depends_on=[] if t == 0 else [sources[t]],
                 metric="contains")
            for t in range(turns)]


def generate(n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None) -> list[Instance]:
    return seeded_instances(TASK, SYSTEM, make_instance, n, seed, turns, context_tokens, difficulty, tokenizer)
