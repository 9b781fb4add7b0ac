"""The lock between CUDA graph captures and device work issued from another thread.

A capture in torch's default (global) mode fails when any thread makes a CUDA call that is unsafe
during a capture (an allocation, a synchronize, a copy to the host). The engine's worker thread
captures graphs on first use, at any point of serving; a thread that works on the device beside it
(the state manager's background packer, turnkv/state/background.py) holds this lock while it does,
and every capture (engine/cuda_graphs.py) holds it too. Never take it while waiting for such a thread.
"""

from __future__ import annotations

import threading

CAPTURE_LOCK = threading.RLock()
