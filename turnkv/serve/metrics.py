"""Prometheus metrics. vLLM's names where vLLM has the metric, so its dashboards and the routers that
score replicas on them (llm-d, the production-stack router) work unchanged; turnkv's own under
`turnkv:` for what vLLM has no name for (reuse across turns, compression, tiers).

Each app has its own registry, so several servers can live in one process (tests do)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from turnkv.engine.llm import LLM
    from turnkv.serve.scheduler import Scheduler
    from turnkv.serve.store import ConversationStore

# vLLM's bucket edges, so histograms from both engines can be compared bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def device_alloc_retries(device: torch.device) -> int:
    """How often torch's CUDA allocator has freed its cache to retry an allocation on `device`."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, label + list(labels), registry=r)

        def counter(name, doc, labels=()):
            return Counter(name, doc, label + list(labels), registry=r)

        # vLLM names
        self.running = gauge("vllm:num_requests_running", "Requests prefilling or decoding.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued for admission.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV page pool in use (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests, reused ones included.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = counter("vllm:request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in kept conversations.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from kept KV.")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", label,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.", label,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=E2E_BUCKETS, registry=r)
        # turnkv's own
        self.reused_tokens = counter("turnkv:reused_tokens", "Prompt tokens not prefilled because a kept conversation held their KV.")
        self.prefilled_tokens = counter("turnkv:prefilled_tokens", "Prompt tokens prefilled.")
        self.rejected = counter("turnkv:requests_rejected", "Requests refused before admission.", ["reason"])
        self.failed = counter("turnkv:requests_failed", "Admitted requests that ended in an error or a disconnect.", ["reason"])
        self.evictions = counter("turnkv:conversation_evictions", "Idle conversations taken off the KV pool.", ["reason"])
        self.batch = Histogram("turnkv:decode_batch_size", "Sequences in one batched decode step.", label,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.mixed_steps = counter("turnkv:mixed_steps",
                                   "Forwards that carried decode tokens and prefill slices together.")
        self.worker_seconds = Histogram(
            "turnkv:worker_phase_seconds", "Seconds of one worker iteration's phase: admit (find and restore "
            "conversations, start prefills), prefill (slices as their own forwards), decode (a batched step), "
            "mixed (a step with decode tokens and prefill slices), finish (a turn's end, inside decode or mixed).",
            label + ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.held = gauge("turnkv:requests_held_for_memory",
                          "Requests whose tokens are ready, waiting for KV memory to start their prefill.")
        self.tier_bytes = counter("turnkv:tier_traffic_bytes", "Bytes of conversation state moved between the KV "
                                  "pool and the state tiers: offload (pool -> tier), restore (tier -> pool).",
                                  ["direction"])
        self.tier_seconds = counter("turnkv:tier_traffic_seconds", "Worker seconds spent moving conversation state "
                                    "between the KV pool and the state tiers, by direction.", ["direction"])
        self.kv_bytes = gauge("turnkv:kv_pool_bytes_used", "Bytes of KV pages in use.")
        self.kv_capacity = gauge("turnkv:kv_pool_bytes_capacity", "Bytes of the KV page pool.")
        self.stored = gauge("turnkv:stored_conversations", "Conversations kept between requests, by tier.", ["tier"])
        self.stored_bytes = gauge("turnkv:stored_kv_bytes", "Bytes of kept conversations, by tier: KV pages in the "
                                  "pool (gpu), what their state strategy stored elsewhere (cpu, disk).", ["tier"])
        self.shared_bytes = gauge("turnkv:kv_shared_bytes", "Bytes of KV pages held by more than one conversation "
                                  "or the prefix index, each counted once.")
        self.prefix_bytes = gauge("turnkv:prefix_cache_bytes", "Bytes of KV pages the prefix index holds.")
        self.tensor_parallel = gauge("turnkv:tensor_parallel_size", "GPUs (ranks) the engine's model and KV are "
                                     "sharded over: 1 without tensor parallelism.")
        self.alloc_retries = gauge("turnkv:device_alloc_retries", "Allocations torch's CUDA caching allocator "
                                   "retried after freeing its whole cache (a device-wide stall); 0 on a CPU.")
        self.packs_in_flight = gauge("turnkv:state_packs_in_flight",
                                     "Conversations leaving the KV pool whose pack runs on the background packer "
                                     "(their pages still count as used).")
        self.packs_done = gauge("turnkv:state_packs_completed", "Packs the background packer has run.")
        self.pack_seconds = gauge("turnkv:state_pack_seconds", "Seconds the background packer has spent packing, "
                                  "beside the worker (its packs' total).")
        self.compressed = gauge("turnkv:kv_bytes_saved_by_compression",
                                "Dense KV bytes of kept conversations minus the bytes their recipe keeps.")

    def count_traffic(self, direction: str, nbytes: int, seconds: float) -> None:
        """One conversation moved between the pool and a tier (StateTierHook's on_traffic)."""
        self.labels(self.tier_bytes, direction).inc(nbytes)
        self.labels(self.tier_seconds, direction).inc(seconds)

    def request_done(self, outcome, seconds: float) -> None:
        """A request that finished: its end-to-end seconds, finish reason and token counts."""
        self.labels(self.e2e).observe(seconds)
        self.labels(self.success, outcome.finish_reason).inc()
        self.labels(self.prompt_tokens).inc(outcome.prompt_tokens)
        self.labels(self.generation_tokens).inc(outcome.completion_tokens)
        self.labels(self.prefix_queries).inc(outcome.prompt_tokens)
        self.labels(self.prefix_hits).inc(outcome.cached_tokens)
        self.labels(self.reused_tokens).inc(outcome.cached_tokens)
        self.labels(self.prefilled_tokens).inc(outcome.prompt_tokens - outcome.cached_tokens)

    def labels(self, metric, *values):
        return metric.labels(self.model_name, *values)

    def bind(self, llm: LLM, scheduler: Scheduler, store: ConversationStore) -> None:
        """Gauges read the engine's state when scraped, so they are never stale."""
        pool = llm.pool
        dense_per_token = llm.kv_bytes_per_token()  # in the pool's storage (int8 / fp8 KV included)
        self.labels(self.running).set_function(lambda: scheduler.num_running)
        self.labels(self.waiting).set_function(lambda: scheduler.num_waiting)
        self.labels(self.held).set_function(lambda: len(scheduler.held))
        self.labels(self.kv_usage).set_function(lambda: pool.bytes_in_use() / pool.capacity_bytes())
        self.labels(self.kv_bytes).set_function(pool.bytes_in_use)
        self.labels(self.kv_capacity).set_function(pool.capacity_bytes)
        self.labels(self.shared_bytes).set_function(pool.shared_bytes)
        self.labels(self.prefix_bytes).set_function(llm.prefix_cache_bytes)
        for tier in store.tier_names:
            self.labels(self.stored, tier).set_function(lambda t=tier: store.count(t))
            self.labels(self.stored_bytes, tier).set_function(lambda t=tier: store.kv_bytes(t))
        self.labels(self.compressed).set_function(lambda: store.bytes_saved(dense_per_token))
        self.labels(self.alloc_retries).set_function(lambda: device_alloc_retries(llm.device))
        size = llm.parallel.size if getattr(llm, "parallel", None) is not None else 1
        self.labels(self.tensor_parallel).set(size)
        state = llm.state
        self.labels(self.packs_in_flight).set_function(lambda: len(state.leaving))
        self.labels(self.packs_done).set_function(lambda: state.packer.completed if state.packer else 0)
        self.labels(self.pack_seconds).set_function(lambda: state.packer.busy_s if state.packer else 0.0)
