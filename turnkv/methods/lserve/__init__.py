"""LServe's parts that stand on their own: streaming-head patterns (files, calibration by attention
statistics, DuoAttention-style gate optimisation) and hierarchical page selection for decode
(with Quest as its one-level case). The engine uses them through the decode axis `quest` / `lserve`
(decode.py, turnkv/methods/decode/quest.py) and the prefill axis `streaming_heads` (streaming_heads.py)."""

from turnkv.methods.lserve.calibrate_stats import StatsStep, calibrate_by_attention, outside_window_mass
from turnkv.methods.lserve.gates import GatedStep, GateResult, optimize_gates
from turnkv.methods.lserve.masks import outside_mask, streaming_mask
from turnkv.methods.lserve.passkey import PasskeySample, passkey_samples
from turnkv.methods.lserve.pattern import HeadPattern, PatternFileError, load_duo_attention
from turnkv.methods.lserve.selector import (PageSelector, SelectionState, SelectorConfig, choose_pages, page_scores,
                                            to_pool_tables)
from turnkv.methods.lserve.summaries import PageSummaries

__all__ = ["HeadPattern", "PatternFileError", "load_duo_attention", "StatsStep", "calibrate_by_attention",
           "outside_window_mass", "GatedStep", "GateResult", "optimize_gates", "streaming_mask", "outside_mask",
           "PasskeySample", "passkey_samples", "PageSummaries", "PageSelector", "SelectionState", "SelectorConfig",
           "choose_pages", "page_scores", "to_pool_tables"]
