"""Facts about a CUDA device that kernels size their launches by, read once per device; small host
arrays uploaded without waiting for the device."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.cache
def num_sms(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def upload(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (a tensor already on a device: .to(device)). A CPU array
    goes to CUDA through pinned memory and a non-blocking copy: a pageable copy holds the host until
    the device has run everything queued before it, which an eager step's per-layer uploads would pay
    at every layer."""
    host = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
