"""The load stream: host -> device copies layer by layer on a side CUDA stream, and the gate that lets
the next forward's layer l start as soon as layer l has arrived, while later layers still load.

On a CPU device there is nothing to overlap: the work runs inline and nothing is gated.

Memory the copies read: device tensors made on the current stream (the slots a layer's rows go to,
masks) are read later on the load stream. The caching allocator knows only the stream a block was
allocated on, so once the last reference is dropped it hands the block out again to the current
stream, whose next kernels may overwrite it before the load stream has read it (slots turned into
garbage: an out-of-bounds index_copy_, or rows written over another conversation's pages). `run`
marks each such tensor with record_stream, so the allocator holds its block until the load stream's
work issued so far is done, however long the caller keeps this object (a caller may drop the
returned stream at once). Host sources (the pinned tier's views) stay the caller's to keep until
`synchronize()`; they are held here meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LoadStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.events: dict[int, torch.cuda.Event] = {}
        self.keep_alive: list = []  # host sources of in-flight copies (device ones are record_stream'ed)

    def start(self) -> None:
        """Order the load stream after everything issued so far (the slots it writes to)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def run(self, layer: int, work: Callable[[], None], *sources) -> None:
        """Run `work` (copies and writes of one layer) on the load stream and mark the layer loaded.
        sources: every tensor `work` reads that was not made inside it (host sources, and device
        tensors made on the current stream, which are protected from reuse here: see the module)."""
        if not self.cuda:
            work()
            return
        for t in sources:
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                t.record_stream(self.stream)  # its block is not reused before the load stream has read it
            else:
                self.keep_alive.append(t)
        with torch.cuda.stream(self.stream):
            work()
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[layer] = event

    def to_device(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        """A copy on the device; asynchronous from pinned memory when called inside run()."""
        return t.to(self.device, dtype=dtype, non_blocking=self.cuda and t.is_pinned())

    def gate(self, model) -> None:
        """Before the next forward runs block l, its stream waits for layer l's copies (one-shot hooks)."""
        if not self.cuda:
            return
        for layer, event in self.events.items():
            _wait_once(model.layers[layer], event, self.device)

    def wait_all(self) -> None:
        """The current stream waits for every copy (for readers that are not the model's layers)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until every copy is done; then the host sources may be reused."""
        if self.cuda:
            self.stream.synchronize()
        self.keep_alive.clear()


def _wait_once(block, event, device) -> None:
    handles = []

    def wait(module, args):
        torch.cuda.current_stream(device).wait_event(event)
        handles.pop().remove()

    handles.append(block.register_forward_pre_hook(wait))
