"""Where a receiver's copies out of a peer's cache run on a GPU: a stream of their own, which first
waits on the device for the sender's fence (messages.BlockRef), so that neither process waits on
the host for the other's kernels. On CPU the copies run on the calling thread and there is
nothing to wait for.
"""

from __future__ import annotations

import contextlib

import torch

from disagg.engine.cuda_sharing import open_fence


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._fences: dict[str, tuple[tuple[int, ...], torch.cuda.Event]] = {}  # peer id -> its fence, opened

    @contextlib.contextmanager
    def after(self, peer_id: str, fence: tuple[int, ...], fence_device: torch.device):
        """Copies made inside run after the kernels the peer's fence marks (an event of the peer's
        GPU, `fence_device` in this process's numbering)."""
        if self.stream is None:
            yield
            return
        if any(fence):
            self.stream.wait_event(self._opened(peer_id, fence, fence_device))
        with torch.cuda.stream(self.stream):
            yield

    def wait(self) -> None:
        """Until the copies made so far are done: before a transfer counts as arrived, as its ACK
        lets the sender reuse the blocks we read."""
        if self.stream is not None:
            self.stream.synchronize()

    def forget(self, peer_id: str) -> None:
        self._fences.pop(peer_id, None)

    def _opened(self, peer_id: str, fence: tuple[int, ...], device: torch.device) -> torch.cuda.Event:
        known = self._fences.get(peer_id)
        if known is None or known[0] != fence:  # first use, or the peer restarted
            known = self._fences[peer_id] = (fence, open_fence(fence, device))
        return known[1]
