"""LoopServe (spec loopserve.md): adaptive vertical/slash prefill lines (Algorithm 5) and progressive
decode selection (Algorithm 6)."""

from turnkv.methods.loopserve import decode, prefill  # noqa: F401
