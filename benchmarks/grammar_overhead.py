"""Per-token cost of a structured-output grammar, for each grammar library installed (xgrammar,
llguidance, outlines-core): fill the allowed-token mask, apply it to one row of logits [V], pick the
token, accept it. A fixed JSON object matching a four-field schema is generated, token by token (its
tokens get a large bonus over random logits, so every library walks the same path), with SmolLM2's
tokenizer (49,152 tokens).

    python benchmarks/grammar_overhead.py [--device cuda] [--repeats 5]

The first run of each library (its caches cold) is reported apart from the warm runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from turnkv.model.load import embedded_model_path
from turnkv.model.tokenizer import load_gguf_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}, "city": {"type": "string"}},
          "required": ["name", "age", "tags", "city"], "additionalProperties": False}
TARGET = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "city": "London"}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def xgrammar_lib(tok, vocab, eos, device):
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])) \
        .compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)

    def new():
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)

        def step(logits):
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits[None], bitmask.to(logits.device, non_blocking=True))
            return logits

        return step, matcher.accept_token

    return new


def llguidance_lib(tok, vocab, eos, device):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def new():
        matcher, bitmask = llguidance.LLMatcher(lltok, grammar), llguidance.torch.allocate_token_bitmask(1, vocab)

        def step(logits):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            llguidance.torch.apply_token_bitmask_inplace(logits[None], bitmask.to(logits.device))
            return logits

        return step, matcher.consume_token

    return new


def outlines_lib(tok, vocab, eos, device):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # Byte-level BPE token strings back to bytes (GPT-2's byte-to-unicode table).
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs)}
    table, special = {}, set(tok.all_special_ids)
    for i in range(vocab):
        text = tok.convert_ids_to_tokens(i)
        if i not in special and text is not None and all(ch in to_byte for ch in text):
            table.setdefault(bytes(to_byte[ch] for ch in text), []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r" ?"), Vocabulary(eos, table))

    def new():
        guide = Guide(index)

        def step(logits):
            allowed = torch.tensor(guide.get_tokens(), dtype=torch.int64, device=logits.device)
            mask = torch.full_like(logits, float("-inf"))
            mask[allowed] = 0
            return logits + mask

        return step, lambda t: t == eos or guide.advance(t)

    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    tok = load_gguf_tokenizer(embedded_model_path())
    vocab, eos = len(tok), tok.eos_token_id
    ids = tok.encode(json.dumps(TARGET), add_special_tokens=False) + [eos]
    torch.manual_seed(0)
    base = torch.randn(len(ids), vocab, device=device)
    for name, lib in (("xgrammar", xgrammar_lib), ("llguidance", llguidance_lib), ("outlines-core", outlines_lib)):
        try:
            t0 = time.perf_counter()
            new = lib(tok, vocab, eos, device)
            compile_s = time.perf_counter() - t0
        except ImportError:
            print(f"{name}: not installed")
            continue
        runs = []
        for _ in range(args.repeats):
            step, accept = new()
            times = []
            for i, token in enumerate(ids):
                logits = base[i].clone()
                logits[token] += 50
                sync(device)
                t0 = time.perf_counter()
                picked = int(step(logits).argmax())
                accept(picked)
                times.append(time.perf_counter() - t0)
                assert picked == token, f"{name} refused a token of a valid object at step {i}"
            runs.append(times)
        warm = [t for times in runs[1:] for t in times] or runs[0]
        print(f"{name}: compile {compile_s * 1e3:.0f} ms; per token, warm: median {statistics.median(warm) * 1e3:.3f} ms, "
              f"mean {statistics.mean(warm) * 1e3:.3f} ms; first run mean {statistics.mean(runs[0]) * 1e3:.3f} ms "
              f"({len(ids)} tokens, {device})")


if __name__ == "__main__":
    main()
