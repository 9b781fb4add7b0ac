"""Few-shot question classification across turns, TREC-like, in the spirit of LoopServe's Algorithm 3.

Questions come from templates, one family per coarse TREC type: places (LOC), people (HUM),
numbers (NUM), descriptions and reasons (DESC), other entities (ENTY) and abbreviations (ABBR). The
label follows from the template, so the rule is consistent. Every turn brings labelled examples
("Question: ...\\nType: LOC", every label at least once, as many as fill the context budget) and asks
for the type of a new question; later turns may use the examples of all earlier turns (`depends_on`).

Difficulty sets the label set: 2 types at 0, 4 at 1, all 6 at 2, and from 3 on the six types under
arbitrary names (amber, cobalt, ...) that only the examples define.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

from turnkv.bench.datasets.filler import count_tokens
from turnkv.bench.datasets.schema import Instance, Turn, seeded_instances

TASK = "fewshot"
SYSTEM = "Classify each question into one of the types shown in the examples. Answer with the type only."
LABELS = ("LOC", "HUM", "NUM", "DESC", "ENTY", "ABBR")
ARBITRARY = ("amber", "cobalt", "saffron", "jade", "coral", "slate")

_LANDMARKS = ("Eiffel Tower", "Golden Gate Bridge", "Colosseum", "Taj Mahal", "Sydney Opera House", "Alhambra",
              "Brandenburg Gate", "Acropolis", "Machu Picchu", "Angkor Wat", "Tower of London", "Hagia Sophia",
              "Christ the Redeemer statue", "Leaning Tower of Pisa", "Petronas Towers", "Space Needle")
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Lima", "Oslo", "Hanoi", "Quito", "Dublin", "Perth", "Tunis", "Seville",
           "Bergen", "Cusco", "Accra", "Busan", "Porto", "Zagreb", "Montevideo")
_COUNTRIES = ("Peru", "Norway", "Kenya", "Vietnam", "Portugal", "Chile", "Ghana", "Mongolia", "Iceland", "Nepal",
              "Morocco", "Finland", "Laos", "Uruguay", "Croatia", "Bolivia")
_INVENTIONS = ("telephone", "light bulb", "printing press", "steam engine", "bicycle", "radio", "microscope",
               "barometer", "typewriter", "sewing machine", "parachute", "stethoscope", "zipper", "compass")
_BOOKS = ("The Silent Harbor", "A Winter in Prague", "The Glass Orchard", "Letters from the Dunes",
          "The Clockmaker's Daughter", "Rivers of Salt", "The Last Lighthouse", "Ashes of Summer",
          "The Paper Garden", "Beneath the Linden Tree", "The Copper Crown", "Songs of the Steppe")
_THINGS = ("Great Wall of China", "first transatlantic cable", "Panama Canal", "Trans-Siberian Railway",
           "Hoover Dam", "first public library", "Suez Canal", "oldest university in Europe")
_UNITS = (("inches", "foot"), ("ounces", "pound"), ("minutes", "day"), ("days", "leap year"), ("cups", "gallon"),
          ("meters", "kilometer"), ("seconds", "hour"), ("grams", "kilogram"), ("players", "rugby team"),
          ("keys", "piano"), ("bones", "human hand"), ("squares", "chessboard"))
_ANIMALS = ("owls", "salmon", "bees", "geese", "cats", "whales", "ants", "bats", "penguins", "wolves", "frogs",
            "camels", "parrots", "squirrels")
_BEHAVIOURS = ("migrate in autumn", "hunt at night", "live in groups", "build nests", "sleep so much",
               "change color", "make noise at dawn", "store food")
_DEVICES = ("thermostat", "microwave oven", "bicycle gear", "solar panel", "refrigerator", "jet engine",
            "hearing aid", "smoke detector", "pendulum clock", "water filter", "touch screen", "doorbell")
_TERMS = ("photosynthesis", "inflation", "erosion", "democracy", "metabolism", "gravity", "irony", "osmosis",
          "recession", "humidity", "evaporation", "symbiosis", "friction", "nostalgia")
_FRUITS = ("mango", "plum", "kiwi", "lime", "pomegranate", "papaya", "fig", "apricot", "blackberry", "lychee")
_CREATURES = ("axolotl", "pangolin", "okapi", "quokka", "tapir", "narwhal", "capybara", "gecko", "ibis", "marmot")
_ACRONYMS = ("NASA", "UNESCO", "NATO", "FIFA", "OPEC", "WHO", "UNICEF", "DNA", "RAM", "GPS", "HTML", "LED", "ATM",
             "PIN", "ISBN", "SCUBA", "RADAR", "LASER", "PDF", "USB")
_LONG_NAMES = ("Federal Bureau of Investigation", "European Union", "International Space Station",
               "World Trade Organization", "Central Processing Unit", "Personal Identification Number",
               "Gross Domestic Product", "Intensive Care Unit", "Value Added Tax", "Random Access Memory")

TEMPLATES: dict[str, list[tuple[str, tuple]]] = {
    "LOC": [("Which city is the {} in?", _LANDMARKS), ("Where is {} located?", _LANDMARKS),
            ("In which country can you visit the {}?", _LANDMARKS), ("Which country is {} in?", _CITIES),
            ("What river flows through {}?", _CITIES), ("Which countries border {}?", _COUNTRIES),
            ("Where is the capital of {}?", _COUNTRIES), ("On which continent is {}?", _COUNTRIES)],
    "HUM": [("Who invented the {}?", _INVENTIONS), ("Who wrote {}?", _BOOKS),
            ("Who was the first person to patent the {}?", _INVENTIONS), ("Who designed the {}?", _LANDMARKS),
            ("Who is the author of {}?", _BOOKS), ("Who was the first mayor of {}?", _CITIES),
            ("Who built the {}?", _THINGS), ("Who translated {} into English?", _BOOKS)],
    "NUM": [("How many {} are in a {}?", _UNITS), ("In what year was the {} completed?", _THINGS),
            ("How tall is the {}?", _LANDMARKS), ("What is the population of {}?", _CITIES),
            ("How old is the {}?", _LANDMARKS), ("How much did it cost to build the {}?", _THINGS),
            ("How long is the {}?", _THINGS), ("When was the {} invented?", _INVENTIONS)],
    "DESC": [("Why do {} {}?", tuple(itertools.product(_ANIMALS, _BEHAVIOURS))), ("How does a {} work?", _DEVICES),
             ("What does the word {} mean?", _TERMS), ("What is the definition of {}?", _TERMS),
             ("What causes {}?", _TERMS), ("How is a {} made?", _DEVICES)],
    "ENTY": [("What color is a ripe {}?", _FRUITS), ("What kind of animal is the {}?", _CREATURES),
             ("What language is spoken in {}?", _COUNTRIES), ("What is the national flower of {}?", _COUNTRIES),
             ("What sport is most popular in {}?", _COUNTRIES), ("What does the {} eat?", _CREATURES),
             ("What currency is used in {}?", _COUNTRIES), ("What is the main ingredient of {} jam?", _FRUITS)],
    "ABBR": [("What does {} stand for?", _ACRONYMS), ("What is the full form of {}?", _ACRONYMS),
             ("What is the abbreviation for the {}?", _LONG_NAMES), ("What is {} short for?", _ACRONYMS),
             ("How is the {} abbreviated?", _LONG_NAMES)],
}


@lru_cache(maxsize=None)
def questions(label: str) -> tuple[str, ...]:
    """Every question the templates of `label` make, in a fixed order."""
    out = []
    for template, slots in TEMPLATES[label]:
        out += [template.format(*(s if isinstance(s, tuple) else (s,))) for s in slots]
    return tuple(sorted(set(out)))


def label_set(difficulty: int, rng: random.Random) -> dict[str, str]:
    """The types in play, mapped to the names the examples show."""
    k = 2 if difficulty <= 0 else 4 if difficulty == 1 else 6
    chosen = sorted(rng.sample(LABELS, k), key=LABELS.index)
    names = rng.sample(ARBITRARY, k) if difficulty >= 3 else chosen
    return dict(zip(chosen, names))


def example(question: str, label: str) -> str:
    return f"Question: {question}\nType: {label}"


def make_instance(rng: random.Random, turns: int, context_tokens: int, difficulty: int, tokenizer=None) -> list[Turn]:
    labels = label_set(difficulty, rng)
    pools = {lab: rng.sample(questions(lab), len(questions(lab))) for lab in labels}
    tests = [(pools[lab].pop(), lab) for lab in (rng.choice(sorted(labels)) for _ in range(turns))]
    examples = {lab: itertools.cycle(pool) for lab, pool in pools.items()}  # repeats only once a pool runs out
    separator = max(0, count_tokens("a\n\na", tokenizer) - 2 * count_tokens("a", tokenizer))
    out = []
    for t, (question, label) in enumerate(tests):
        order = rng.sample(sorted(labels), len(labels))  # every type at least once per turn
        shots, total = [], 0
        while not shots or len(shots) < len(order) or total < context_tokens:
            lab = order[len(shots)] if len(shots) < len(order) else rng.choice(order)
            shot = example(next(examples[lab]), labels[lab])
            cost = count_tokens(shot, tokenizer) + separator
            if len(shots) >= len(order) and total + cost > context_tokens + cost // 2:
                break
            shots.append(shot)
            total += cost
        rng.shuffle(shots)
        prefix = "Use the examples from the previous turns together with these new ones. " if t else ""
        out.append(Turn(context="\n\n".join(shots),
                        question=f"{prefix}What is the type of the following question? Answer with the type only.\n"
                                 f"Question: {question}",
                        answer=labels[label], depends_on=list(range(t)), metric="em"))
    return out


def generate(n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None) -> list[Instance]:
    return seeded_instances(TASK, SYSTEM, make_instance, n, seed, turns, context_tokens, difficulty, tokenizer)
