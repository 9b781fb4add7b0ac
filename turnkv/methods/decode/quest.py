"""Quest: decode reads, per head, the pages whose key min/max bound the query's attention highest.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (arXiv
2406.10774). It is LServe's page selection with one level of pages, reselected at every step
(turnkv.methods.lserve.decode.PagedSelection runs both).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.methods.lserve.decode import PagedSelection
from turnkv.methods.lserve.selector import SelectorConfig
from turnkv.methods.protocols import Decode
from turnkv.methods.registry import register


@register("decode", "quest")
@dataclass
class QuestDecode(Decode):
    """Quest: per 16-token page key min/max, top pages to the token budget every step (first layers dense).

    budget: tokens each head reads (4096). page: tokens per page (16). dense_layers: layers below it
    read everything (2, as the Quest paper)."""

    path_independent = True  # PagedSelection: selects afresh at every prefill, statistics from the pool

    budget: int = 4096
    page: int = 16
    dense_layers: int = 2

    def __post_init__(self):
        self.selector_config()  # checks the values

    def selector_config(self) -> SelectorConfig:
        return SelectorConfig.quest(self.budget, physical_page=self.page, logical_page=self.page,
                                    dense_layers=self.dense_layers)

    def new_state(self, num_layers: int) -> PagedSelection:
        return PagedSelection(self.selector_config(), num_layers)
