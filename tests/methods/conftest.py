"""Fixtures of the methods tests."""

from __future__ import annotations

import pytest

from tests.methods.turn_helpers import SYSTEM


@pytest.fixture
def open_conv(chat_llm):
    """conversation(...) that is closed after the test, so the shared pool stays clean."""
    opened = []

    def make(recipe, system=SYSTEM):
        conv = chat_llm.conversation(system=system, recipe=recipe)
        opened.append(conv)
        return conv

    used = chat_llm.pool.bytes_in_use() - chat_llm.prefix_cache_bytes()
    yield make
    for conv in opened:
        conv.close()
    # What the conversations held is back, apart from system prompts the prefix index now keeps.
    assert chat_llm.pool.bytes_in_use() - chat_llm.prefix_cache_bytes() == used
