"""Token ids go to the device without waiting for it (turnkv.gpu.upload: pinned memory and a
non-blocking copy on CUDA), and arrive as int64 with their values."""

import numpy as np
import pytest
import torch

from turnkv import gpu


def test_a_decode_steps_tokens_take_the_non_blocking_upload(chat_llm, monkeypatch):
    sent = []
    real = gpu.upload

    def spy(host, device):
        sent.append(host.clone())
        return real(host, device)

    monkeypatch.setattr(gpu, "upload", spy)
    tokens = chat_llm._token_tensor([5, 7, 11])
    assert tokens.dtype == torch.int64 and tokens.tolist() == [5, 7, 11]
    assert tokens.device.type == chat_llm.device.type
    assert [t.tolist() for t in sent] == [[5, 7, 11]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_upload_does_not_wait_for_queued_work():
    device = torch.device("cuda")
    big = torch.randn(8192, 8192, device=device)
    torch.cuda.synchronize()
    for _ in range(20):  # about a second of queued matmuls
        big = big @ big / 8192
    done = torch.cuda.Event()
    out = gpu.upload(np.arange(16), device)
    done.record()
    assert not done.query()  # the host got here while the device still runs the matmuls
    assert out.cpu().tolist() == list(range(16))
