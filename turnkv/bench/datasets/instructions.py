"""Cumulative instruction following, Multi-IF-like, checked by rule.

Every turn brings a filler passage and asks for a short piece of writing about it, adding one new
formatting instruction (or `difficulty` of them). Earlier instructions stay in force: turn t's
`instructions` holds those of turns 0..t, and the turn depends on every earlier one, since only
their messages state them. The score is the share of those instructions the reply follows
(turnkv.bench.instruction_checks); there is no reference string, so `answer` is "".

Instructions that cannot hold together (lowercase and uppercase, JSON and a closing phrase, ...) are
never drawn into one conversation, so every turn can be satisfied in full.
"""

from __future__ import annotations

import random

from turnkv.bench.datasets.filler import Filler, document
from turnkv.bench.datasets.schema import Instance, Turn, seeded_instances

TASK = "instructions"
SYSTEM = ("Follow every formatting instruction the user gives. An instruction stays in force for the rest of the "
          "conversation, together with the ones given after it.")

KEYWORDS = ("garden", "river", "lantern", "harvest", "compass", "meadow", "signal", "journey", "bridge", "window")
FORBIDDEN = ("very", "really", "basically", "actually", "simply", "just", "thing", "stuff")
START_PHRASES = ("My answer is as follows", "Here is what I think", "In short")
END_PHRASES = ("Is there anything else I can help with?", "Let me know if you have additional questions.",
               "Any other questions?")
WRITING = ("write a short note about the passage in this message for a colleague.",
           "explain what the passage in this message is about to a friend who is new to the subject.",
           "write a brief summary of the passage in this message.",
           "describe one idea from the passage in this message that you find useful.",
           "write a short message recommending the passage in this message to a classmate.",
           "tell me what a reader learns from the passage in this message.",
           "write a few lines on who would benefit from reading the passage in this message.",
           "write a short reflection on the passage in this message.")

# Pairs that no response can satisfy together, or only in contorted ways.
CONFLICTS = {frozenset(p) for p in (
    ("lowercase", "uppercase"), ("min_words", "max_words"), ("min_sentences", "max_sentences"),
    ("json", "quotes"), ("json", "bullets"), ("json", "start"), ("json", "end"), ("json", "postscript"),
    ("json", "title"), ("quotes", "bullets"), ("bullets", "max_sentences"))}


def draw(kind: str, rng: random.Random) -> dict:
    """An instruction of `kind` with its parameters drawn."""
    if kind == "min_words":
        return {"kind": kind, "n": rng.choice((15, 20, 25, 30))}
    if kind == "max_words":
        return {"kind": kind, "n": rng.choice((60, 80, 100, 120))}
    if kind == "min_sentences":
        return {"kind": kind, "n": rng.choice((2, 3))}
    if kind == "max_sentences":
        return {"kind": kind, "n": rng.choice((5, 6, 8))}
    if kind == "include":
        return {"kind": kind, "words": rng.sample(KEYWORDS, 2)}
    if kind == "exclude":
        return {"kind": kind, "word": rng.choice(FORBIDDEN)}
    if kind == "start":
        return {"kind": kind, "phrase": rng.choice(START_PHRASES)}
    if kind == "end":
        return {"kind": kind, "phrase": rng.choice(END_PHRASES)}
    if kind == "bullets":
        return {"kind": kind, "n": rng.choice((2, 3, 4))}
    return {"kind": kind}


def describe(instruction: dict) -> str:
    """The instruction as the user words it (IFEval's phrasings where it has one)."""
    kind, n = instruction["kind"], instruction.get("n")
    return {
        "lowercase": "Your entire response should be in English, and in all lowercase letters. No capital letters "
                     "are allowed.",
        "uppercase": "Your entire response should be in English, and in all capital letters.",
        "min_words": f"Answer with at least {n} words.",
        "max_words": f"Answer with at most {n} words.",
        "min_sentences": f"Your response should contain at least {n} sentences.",
        "max_sentences": f"Your response should contain at most {n} sentences.",
        "include": "Include the keywords " + " and ".join(f'"{w}"' for w in instruction.get("words", ())) +
                   " in the response.",
        "exclude": f'Do not include the word "{instruction.get("word")}" in the response.',
        "start": f'Start your response with the exact phrase "{instruction.get("phrase")}".',
        "end": f'Finish your response with this exact phrase: "{instruction.get("phrase")}". No other words should '
               "follow this phrase.",
        "quotes": "Wrap your entire response with double quotation marks.",
        "no_commas": "In your entire response, refrain from the use of any commas.",
        "postscript": "At the end of your response, please explicitly add a postscript starting with P.S.",
        "bullets": f"Your answer must contain exactly {n} bullet points. Use markdown bullet points such as "
                   "\"* This is a point.\"",
        "json": "Your entire output should be wrapped in JSON format.",
        "title": "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
    }[kind]


KINDS = ("lowercase", "uppercase", "min_words", "max_words", "min_sentences", "max_sentences", "include", "exclude",
         "start", "end", "quotes", "no_commas", "postscript", "bullets", "json", "title")


def make_instance(rng: random.Random, turns: int, context_tokens: int, difficulty: int, tokenizer=None) -> list[Turn]:
    filler = Filler(rng, tokenizer)
    writing = rng.sample(WRITING, len(WRITING))
    active: list[dict] = []
    out = []
    for t in range(turns):
        new = []
        for _ in range(max(1, difficulty)):
            used = {i["kind"] for i in active + new}
            free = [k for k in KINDS if k not in used and all(frozenset((k, u)) not in CONFLICTS for u in used)]
            if free:
                new.append(draw(rng.choice(free), rng))
        active += new
        request = writing[t % len(writing)]
        request = f"Now, {request}" if t else request[0].upper() + request[1:]
        question = " ".join([request] + [describe(i) for i in new])
        out.append(Turn(context=document(filler, context_tokens, [], rng), question=question, answer="",
                        depends_on=list(range(t)), metric="instructions", instructions=[dict(i) for i in active]))
    return out


def generate(n: int, seed: int = 0, turns: int = 3, context_tokens: int = 300, difficulty: int = 1,
             tokenizer=None) -> list[Instance]:
    return seeded_instances(TASK, SYSTEM, make_instance, n, seed, turns, context_tokens, difficulty, tokenizer)
