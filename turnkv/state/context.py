"""What a restoration strategy may use of the engine: the model, the page pool, the runner, and the
restore costs calibrated on this machine (per tier, measured once, on first need)."""

from __future__ import annotations

import logging
import time

from turnkv.model.parallel import rank0_values
from turnkv.state.schedule import CostModel, best_ratio, measure_bandwidth, measure_compute

log = logging.getLogger(__name__)


class RestoreContext:
    def __init__(self, model, pool, runner, costs: dict[str, CostModel] | None = None):
        self.model, self.pool, self.runner = model, pool, runner
        self.config = model.config
        self._costs = dict(costs or {})
        self._compute: tuple[float, float] | None = None
        # Packs move each layer's rows to host memory as they export them (split.pack_split's on_host):
        # set by the state manager for an offload whose whole-state staging found no GPU memory.
        self.stage_on_host = False

    @property
    def element_size(self) -> float:
        """Stored bytes per K/V element: the storage dtype's, plus a quantized pool's scales spread
        over their rows (int8 with head_dim 128: 1 + 4/128)."""
        size = self.pool.token_bytes / (2 * self.pool.head_dim)
        return int(size) if size == int(size) else size

    def cost(self, tier: str = "cpu") -> CostModel:
        """The cost model of restoring from `tier`; calibrated here unless one was given."""
        if tier not in self._costs:
            start = time.perf_counter()
            log.info("calibrating state restores on this machine: recompute rate and %s tier copy bandwidth "
                     "(once per engine and tier)", tier)
            if self._compute is None:
                self._compute = measure_compute(self.model, self.pool.device)
            # The disk tier reads the file into host memory first (pageable), then copies it.
            bandwidth = measure_bandwidth(self.pool.device, pinned=(tier == "cpu") if self.pool.device.type == "cuda" else False)
            cost = CostModel(*self._compute, bandwidth)
            shard = self.pool.shard
            if shard is not None:
                # Tensor parallel: every rank plans its restores by rank 0's measurements, so that the
                # ranks recompute the same tokens (a recompute runs the model's collectives).
                cost = CostModel(*rank0_values([cost.per_token_layer_s, cost.per_token2_layer_s, cost.bytes_per_s],
                                               shard, self.pool.device))
            self._costs[tier] = cost
            log.info("calibrated state restores for the %s tier in %.1f s", tier, time.perf_counter() - start)
        return self._costs[tier]

    def set_cost(self, tier: str, cost: CostModel) -> None:
        self._costs[tier] = cost

    def recompute_ratio(self, n: int, tier: str = "cpu") -> float:
        c = self.config
        return best_ratio(n, c.num_layers, self.cost(tier), c.num_kv_heads, c.head_dim, self.element_size)
