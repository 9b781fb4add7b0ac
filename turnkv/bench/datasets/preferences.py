"""Preference retention, PrefEval-like and verifiable.

One turn (turn 0 by default) states a preference or a personal fact ("I'm vegetarian", "my budget for
gifts is $40", "always sign off with '— Sam'"). Filler turns of controlled length follow, each a
document with a planted fact and a question about it. The last turn asks a query whose generic answer
would ignore the preference, either:
- as multiple choice: the options are listed and exactly one fits the preference; metric "accuracy",
  answer the option letter; or
- checked by rule (the sign-off, lowercase, no commas, a fixed opening); metric "instructions".

Difficulty is the number of wrong options (one more than it, at most five). `pref_turn` moves the
statement later in the conversation, or into the system prompt with "system".
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from turnkv.bench.datasets.filler import Filler, document
from turnkv.bench.datasets.needle_qa import Facts
from turnkv.bench.datasets.schema import Instance, Turn

TASK = "preferences"
SYSTEM = "You are a helpful personal assistant. Answer briefly."
LETTERS = "ABCDEFGH"


@dataclass(frozen=True)
class Choice:
    """A preference tested by multiple choice: `fitting` options suit it, `violating` ones do not."""

    name: str
    statement: str  # may hold {value}, drawn from `values`
    query: str
    fitting: tuple[str, ...] = ()
    violating: tuple[str, ...] = ()
    values: tuple[str, ...] = ()

    def fits(self, statement: str, option: str) -> bool:
        """Whether `option` suits the preference as `statement` words it."""
        if self.values:  # a personal fact: the option is the value stated
            pattern = re.escape(self.statement).replace(re.escape("{value}"), "(.+?)")
            return option == re.search(pattern, statement)[1]
        return option in self.fitting

    def make(self, rng: random.Random, n_options: int) -> tuple[str, list[str], int]:
        """The statement, the options, and the index of the one that fits."""
        if self.values:
            value, *others = rng.sample(self.values, n_options)
            statement, right, wrong = self.statement.format(value=value), value, others
        else:
            statement, right = self.statement, rng.choice(self.fitting)
            wrong = rng.sample(self.violating, n_options - 1)
        options = wrong + [right]
        rng.shuffle(options)
        return statement, options, options.index(right)


@dataclass(frozen=True)
class Budget(Choice):
    """Gifts with prices: exactly one costs no more than the stated budget."""

    items: tuple[str, ...] = ()

    def fits(self, statement: str, option: str) -> bool:
        budget = int(re.search(r"\$(\d+)", statement)[1])
        return int(re.search(r"\$(\d+)", option)[1]) <= budget

    def make(self, rng, n_options):
        budget = rng.choice((30, 40, 50, 60, 80, 120))
        items = rng.sample(self.items, n_options)
        prices = [rng.randint(budget // 2, budget - 1)] + [rng.randint(budget * 13 // 10, budget * 3)
                                                            for _ in range(n_options - 1)]
        options = [f"{item} for ${price}" for item, price in zip(items, prices)]
        right = options[0]
        rng.shuffle(options)
        return self.statement.format(value=budget), options, options.index(right)


@dataclass(frozen=True)
class Rule:
    """A preference on the form of every reply, checked by rule on the final query's reply."""

    name: str
    statement: str  # may hold {value}, drawn from `values`
    query: str
    instructions: list[dict] = field(default_factory=list)  # "{value}" in a string is replaced too
    values: tuple[str, ...] = ()

    def make(self, rng: random.Random) -> tuple[str, list[dict]]:
        value = rng.choice(self.values) if self.values else ""
        fill = lambda v: v.replace("{value}", value) if isinstance(v, str) else v  # noqa: E731
        return self.statement.format(value=value), [{k: fill(v) for k, v in rule.items()} for rule in self.instructions]


SCENARIOS: dict[str, Choice | Rule] = {s.name: s for s in (
    Choice("vegetarian", "I'm vegetarian, so I never eat meat or fish.",
           "I'm cooking dinner for myself tonight. Which of these dishes should I make?",
           fitting=("Mushroom risotto", "Spinach and ricotta lasagne", "Chickpea curry with rice",
                    "Grilled halloumi salad", "Vegetable stir-fry with tofu", "Margherita pizza"),
           violating=("Beef stew", "Grilled salmon with potatoes", "Chicken tikka masala", "Pork ribs with coleslaw",
                      "Shrimp pad thai", "Lamb kebabs", "Spaghetti carbonara with bacon", "Tuna nicoise salad")),
    Choice("peanut_allergy", "I have a severe peanut allergy, so anything with peanuts is off the table for me.",
           "I'm packing a snack for a long hike. Which of these should I bring?",
           fitting=("Apple slices with cheddar", "Rice crackers", "Dried apricots", "Banana oat bars", "Plain popcorn"),
           violating=("A peanut butter sandwich", "Trail mix with roasted peanuts", "Peanut brittle",
                      "Satay chicken skewers with peanut sauce", "Chocolate peanut cups", "Honey roasted peanuts")),
    Choice("no_flying", "I'm terrified of flying and never get on planes.",
           "I need to get from Paris to Rome next month. Which way of travelling should I choose?",
           fitting=("The overnight sleeper train", "A long-distance coach", "Driving my own car"),
           violating=("A direct flight", "A budget airline flight with a layover in Munich", "A business-class flight",
                      "A private charter plane", "A seaplane hop along the coast")),
    Choice("warm_weather", "I really dislike cold weather and I avoid snowy places.",
           "Where should I go on holiday this January?",
           fitting=("A beach resort in the Canary Islands", "A sunny week in Cape Town", "Snorkelling in the Maldives",
                    "A desert trip in southern Morocco"),
           violating=("A ski chalet in the Alps", "An Arctic cruise to see the northern lights",
                      "Ice fishing in northern Finland", "A snowshoe trek in Lapland", "A winter festival in Harbin")),
    Choice("no_horror", "I can't stand horror films; they give me nightmares.",
           "We're having a film night at my place. Which film should we watch?",
           fitting=("A romantic comedy set in Lisbon", "A nature documentary about whales",
                    "An animated family adventure", "A courtroom drama"),
           violating=("A slasher horror film set in a summer camp", "A haunted house horror film",
                      "A zombie horror film", "A horror film about a cursed doll", "A possession horror film")),
    Budget("gift_budget", "My budget for gifts is ${value}, and I never spend more than that.",
           "I need a birthday present for a friend. Which one should I buy?",
           items=("A leather wallet", "A pair of wireless earbuds", "A hardback cookbook", "A scented candle set",
                  "A board game", "A wool scarf", "A desk plant", "A travel mug", "A backpack", "A photo frame")),
    Choice("dog_name", "My dog's name is {value}.", "What is my dog's name?",
           values=("Biscuit", "Pepper", "Maple", "Juniper", "Waffles", "Clover", "Pickles", "Nutmeg", "Sprout")),
    Choice("home_city", "I live in {value}.", "Which city's weather forecast should I check for my daily commute?",
           values=("Lisbon", "Montreal", "Osaka", "Edinburgh", "Valparaiso", "Tbilisi", "Brisbane", "Krakow")),
    Rule("sign_off", "Please always sign off your replies to me with '— {value}'.",
         "Could you write me a two-sentence reminder to water the plants this weekend?",
         [{"kind": "end", "phrase": "— {value}"}], values=("Sam", "Alex", "Robin", "Kim", "Jo")),
    Rule("lowercase", "Capital letters feel like shouting to me, so please write all your replies to me in "
                      "lowercase letters only.",
         "Describe a pleasant morning walk in three sentences.", [{"kind": "lowercase"}]),
    Rule("no_commas", "Please never use commas in your replies to me; my screen reader stumbles over them.",
         "List three things I should pack for a weekend trip, in one or two sentences.", [{"kind": "no_commas"}]),
    Rule("greeting", "Please begin every reply to me with the words 'Dear friend'.",
         "Give me one short tip for sleeping better.", [{"kind": "start", "phrase": "Dear friend"}]),
)}


def make_instance(rng: random.Random, turns: int, context_tokens: int, difficulty: int, tokenizer=None,
                  scenario: str | None = None, pref_turn: int | str = 0) -> tuple[list[Turn], str, str]:
    """The turns, the system prompt and the scenario's name."""
    if turns < 2:
        raise ValueError("preferences needs at least two turns: the statement and the query")
    if pref_turn != "system" and not 0 <= pref_turn < turns - 1:
        raise ValueError("pref_turn must be 'system' or a turn before the last")
    spec = SCENARIOS[scenario] if scenario else SCENARIOS[rng.choice(sorted(SCENARIOS))]
    facts, filler = Facts(rng), Filler(rng, tokenizer)
    if isinstance(spec, Rule):
        statement, instructions = spec.make(rng)
        query = Turn(context="", question=spec.query, answer="", metric="instructions", instructions=instructions)
    else:
        statement, options, right = spec.make(rng, min(2 + max(0, difficulty), 6))
        listed = "\n".join(f"{LETTERS[i]}. {option}" for i, option in enumerate(options))
        query = Turn(context="", question=f"{spec.query}\n{listed}\nAnswer with the letter of the option that suits "
                     "me best.", answer=LETTERS[right], metric="accuracy")
    out = []
    for t in range(turns - 1):
        fact = facts.new()
        question = fact.question
        if t == pref_turn:
            question = f"{statement} Please keep this in mind from now on. Now, about this document: {question}"
        out.append(Turn(context=document(filler, context_tokens, [fact.statement], rng), question=question,
                        answer=fact.answer, metric="contains"))
    query.context = document(filler, context_tokens, [], rng)
    query.depends_on = [] if pref_turn == "system" else [pref_turn]
    system = f"{SYSTEM} What the user told you about themselves: {statement}" if pref_turn == "system" else SYSTEM
    return out + [query], system, spec.name


def generate(n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None, scenario: str | None = None, pref_turn: int | str = 0) -> list[Instance]:
    """`scenario`: a name in SCENARIOS, or None to draw one per instance."""
    out = []
    for i in range(n):
        turns_, system, name = make_instance(random.Random(f"{TASK}:{seed}:{i}"), turns, context_tokens, difficulty,
                                             tokenizer, scenario, pref_turn)
        out.append(Instance(TASK, f"{TASK}-{name}-s{seed}-t{turns}-c{context_tokens}-d{difficulty}-p{pref_turn}-{i}",
                            turns_, system=system))
    return out
