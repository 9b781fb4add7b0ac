"""The methods of the prefill, eviction and decode axes, one file per component (the fourth axis, the
state between turns, is turnkv.state). Importing this package registers every component."""

import turnkv.methods.decode.all  # noqa: F401  (each import registers the components of its file)
import turnkv.methods.decode.quest  # noqa: F401
import turnkv.methods.evict.adakv  # noqa: F401
import turnkv.methods.evict.expected_attention  # noqa: F401
import turnkv.methods.evict.h2o  # noqa: F401
import turnkv.methods.evict.knorm  # noqa: F401
import turnkv.methods.evict.pyramidkv  # noqa: F401
import turnkv.methods.evict.random  # noqa: F401
import turnkv.methods.evict.snapkv  # noqa: F401
import turnkv.methods.evict.streaming_llm  # noqa: F401
import turnkv.methods.evict.tova  # noqa: F401
import turnkv.methods.evict.uniform  # noqa: F401
import turnkv.methods.loopserve.decode  # noqa: F401
import turnkv.methods.loopserve.prefill  # noqa: F401
import turnkv.methods.lserve.decode  # noqa: F401
import turnkv.methods.lserve.streaming_heads  # noqa: F401
import turnkv.methods.prefill.a_shape  # noqa: F401
import turnkv.methods.prefill.dense  # noqa: F401
import turnkv.methods.prefill.minference  # noqa: F401
import turnkv.methods.prefill.tri_shape  # noqa: F401
import turnkv.methods.turns.flowkv  # noqa: F401
import turnkv.methods.turns.recompress  # noqa: F401
from turnkv.methods.evict.eviction import Eviction
from turnkv.methods.recipe import Recipe, preset, presets

__all__ = ["Recipe", "Eviction", "preset", "presets"]
