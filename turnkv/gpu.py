"""Facts about a CUDA device that kernels size their launches by, read once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
