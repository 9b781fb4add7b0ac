"""Every method of the four axes, one file each; importing this package registers them all."""

from turnkv.methods import (a_shape, adakv, all_tokens, dense, expected_attention, flowkv, h2o, knorm,  # noqa: F401
                            loopserve, lserve, minference, pyramidkv, random_scorer, recompress, resident, snapkv,
                            streaming_llm, tova, tri_shape, uniform)
from turnkv.methods.eviction import Eviction
from turnkv.methods.recipe import Recipe, preset, presets

__all__ = ["Recipe", "Eviction", "preset", "presets"]
