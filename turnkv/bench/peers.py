"""Peers timed in the same run on the same shapes: transformers' generate on turnkv's own weights,
and PyTorch SDPA alone as the attention floor of prefill. A peer that cannot run says why."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from turnkv.bench.hardware import median_time
from turnkv.model.weights import hf_state_dict


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, out of memory, unsupported shape)."""


def transformers_model(llm):
    """A transformers model (SDPA attention) whose parameters are turnkv's own tensors: no second copy."""
    try:
        import transformers
    except ImportError as e:
        raise PeerUnavailable(f"transformers is not installed: {e}") from None

    c = llm.config
    families = {"llama": "LlamaConfig", "smollm2": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
    config_cls = getattr(transformers, families[c.architecture])
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    kwargs = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                  tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                  rope_parameters=rope)
    if c.architecture == "llama":
        kwargs["attention_bias"] = c.attention_bias
    if c.architecture == "mistral":
        kwargs["sliding_window"] = c.sliding_window
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    model_cls = transformers.AutoModelForCausalLM.from_config.__self__._model_mapping[type(config)]
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(hf_state_dict(llm.model), strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # Buffers (the rotary inverse frequencies) were built on meta: build those modules again, for real.
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(llm.device):
                setattr(parent, child, type(module)(config=config))
    model = model.to(llm.device).eval()
    return model


class _TokenClock:
    """A transformers streamer (put() once for the prompt, then once per generated step) that keeps
    the time of each call."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_generate(model, prompts: torch.Tensor, new_tokens: int, device, repeat: int = 3,
                          prefill_chunk: int | None = None) -> dict:
    """TTFT (generate of 1 token) and time per output token (between the first and the last token of
    an n-token generate, from the times they reach the host) of greedy generate on a [B, T] batch of
    prompts. prefill_chunk uses transformers' own chunked prefill, so a large batch of long prompts
    fits (its activations scale with B x chunk instead of B x T)."""
    options = {"prefill_chunk_size": prefill_chunk} if prefill_chunk and prefill_chunk < prompts.shape[1] else {}

    def run(n, streamer=None):
        with torch.inference_mode():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, streamer=streamer, **options)

    def per_token() -> float:
        clock = _TokenClock()
        run(new_tokens, clock)
        steps = clock.times[1:]  # after the prompt's put
        return (steps[-1] - steps[0]) / max(1, len(steps) - 1)

    try:
        first = median_time(lambda: run(1), device, repeat=repeat)
        tpot = statistics.median(per_token() for _ in range(repeat))
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        raise PeerUnavailable(f"out of memory: {str(e).splitlines()[0]}") from None
    out = {"ttft_s": first, "tpot_s": tpot, "tokens_per_s": prompts.shape[0] / tpot}
    if options:
        out["note"] = f"transformers chunked prefill, {prefill_chunk} tokens per chunk"
    return out


def sdpa_prefill(config, tokens: int, device, dtype) -> float:
    """Seconds of causal SDPA alone, over all layers, for a fresh prompt of `tokens`: what attention
    costs before any engine overhead."""
    c = config
    try:
        q = torch.randn(1, c.num_heads, tokens, c.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, c.num_kv_heads, tokens, c.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
    except torch.OutOfMemoryError as e:
        raise PeerUnavailable(f"out of memory: {str(e).splitlines()[0]}") from None
    one = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device)
    return one * c.num_layers
