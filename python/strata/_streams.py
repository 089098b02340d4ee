"""The streams and events of `OffloadedStrataCache`'s layer streaming (`strata._layer_stream`).

`Streams(cuda)` orders work on two streams: the caller's current stream ("compute": the model's
kernels) and a side stream the cache owns ("side": its copies). Every wait is a stream waiting
on an event; the host never waits for the device here, except in `synchronize` (crop, reset and
close, never a decode step). `cuda` is `torch.cuda` on CUDA and None on the CPU, where there are
no streams: copies run at once, events are None and waits do nothing. Tests pass a stand-in for
`torch.cuda` to check the order of the records, waits and copies on the CPU."""

import torch


class Streams:
    def __init__(self, cuda=None, device=None):
        self.cuda = cuda
        self.device = device
        self.side = cuda.Stream(device=device) if cuda is not None else None

    @classmethod
    def for_device(cls, device):
        """Streams for a torch device: CUDA streams on "cuda", immediate on anything else."""
        return cls(torch.cuda, device) if device.type == "cuda" else cls()

    @property
    def pinned(self):
        """Whether host buffers are page-locked (copies from them are asynchronous on CUDA)."""
        return self.cuda is torch.cuda

    def _compute(self):
        return self.cuda.current_stream(self.device)

    def record(self, on_side=False):
        """An event marking the work queued so far on the compute (or side) stream."""
        if self.cuda is None:
            return None
        event = self.cuda.Event()
        event.record(self.side if on_side else self._compute())
        return event

    def side_waits(self, event):
        """The side stream's later work waits for `event`."""
        if event is not None:
            self.side.wait_event(event)

    def compute_waits(self, event):
        """The compute stream's later work waits for `event`."""
        if event is not None:
            self._compute().wait_event(event)

    def copy(self, pairs):
        """Queues `dst.copy_(src)` for each (dst, src) on the side stream (non-blocking: the
        caller keeps both alive and untouched until an event recorded after them is done)."""
        if self.cuda is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        with self.cuda.stream(self.side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    @staticmethod
    def done(event):
        """Whether the work before `event` has finished (a query: never waits)."""
        return event is None or event.query()

    def synchronize(self):
        """The host waits for both streams (crop, reset and close only)."""
        if self.cuda is not None:
            self.side.synchronize()
            self._compute().synchronize()
