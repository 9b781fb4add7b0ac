"""The serving store's TierHook (turnkv/serve/store.py) over the state manager: idle conversations
the store evicts go to the CPU tier (or the disk under it) in the form of their recipe's state
strategy, and come back before a request continues them."""

from __future__ import annotations

from turnkv.kv.tiers import StateTiersFullError


class StateTierHook:
    def __init__(self, manager, tier: str = "cpu"):
        self.manager, self.tier = manager, tier

    def offload(self, conv) -> bool:
        try:
            self.manager.offload(conv, self.tier)
        except StateTiersFullError:
            return False  # every tier is full: the store decides (it drops the idle conversation)
        return True

    def restore(self, conv) -> None:
        self.manager.before_turn(conv, 0)  # all or nothing; KVCacheFullError leaves it stored

    def discard(self, conv) -> None:
        self.manager.discard(conv)
