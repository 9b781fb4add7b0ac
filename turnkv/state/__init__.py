"""The state axis: where a conversation's KV lives between turns and how it comes back.

Strategies (registered on the "state" axis, interface turnkv.methods.protocols.StateStrategy): gpu
(resident), recompute, load, partial, krul, minicache, krul_fix. The manager moves conversations
between the GPU (the page pool) and the CPU and disk tiers (turnkv.kv.tiers).
"""

from turnkv.state import gpu, krul, load, partial, recompute  # noqa: F401  (registers the strategies)
