"""Grammar masks fed to a decode round while it runs on the device, so constrained rows
keep K-step rounds instead of one host round trip per token.

A round's K steps are queued at once. For a round with constrained rows each step is
queued in two graphs, the forward pass and the masked sampling; between them, on the
stream, this queues a wait for the host (kernels/host_wait.py) and the copy of the
constrained rows' next masks into the static bitmask. After each sampling it queues the
copy of those rows' tokens to the host and an event. The host, once everything is queued,
serves the steps in order: wait for step i's event, let the matchers take its tokens and
write step i+1's masks (engine/structured.py: advance), then raise the counter the device
waits on. The host does this while the device runs step i+1's forward pass, so the device
waits only when the matchers are slower than a forward pass.

    device:  fwd 0 | sample 0 -> tokens, event 0 | fwd 1 | wait 1, masks 1 | sample 1 -> ...
    host:                  serve 0: event 0, advance, counter = 1 ^

Rows are compact: only the constrained rows' masks cross PCIe (`rows` says where they go)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class MaskFeed:
    def __init__(self, max_rows: int, words: int, max_steps: int, device: torch.device):
        from kernels.host_wait import wait_for_host  # triton: imported where a GPU runs rounds

        self._wait_for_host = wait_for_host
        self.counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # raised by the host
        self.timeouts = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # waits that gave up
        self.host_masks = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=True)
        self.host_tokens = torch.zeros(max_steps, max_rows, dtype=torch.int64, pin_memory=True)
        self.device_masks = torch.full((max_rows, words), -1, dtype=torch.int32, device=device)
        self.events = [torch.cuda.Event() for _ in range(max_steps)]
        self.issued = 0  # the counter value the last queued wait expects
        self._timeouts_seen = 0
        self._wait_for_host(self.counter, self.timeouts, 0)  # compiles the kernel now, not in a round

    def queue_masks(self, token_bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Before a step's sampling: wait for the host's next masks, then copy them into the
        rows `rows` (device int64 [c]) of the static bitmask."""
        self.issued += 1
        c = rows.shape[0]
        self._wait_for_host(self.counter, self.timeouts, self.issued)
        self.device_masks[:c].copy_(self.host_masks[:c], non_blocking=True)
        token_bitmask.index_copy_(0, rows, self.device_masks[:c])

    def queue_tokens(self, step: int, out_tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """After step `step`'s sampling: its constrained rows' tokens to the host, then its event."""
        self.host_tokens[step, :rows.shape[0]].copy_(out_tokens[step].index_select(0, rows), non_blocking=True)
        self.events[step].record()

    def serve(self, num_steps: int, num_rows: int, advance: Callable[[list[int], torch.Tensor], None]) -> None:
        """Feed the round just queued: for steps 0..K-2, once a step's tokens are on the host,
        `advance(tokens, host_masks[:num_rows])` writes the next masks, then the device may go on.
        If anything raises, every queued wait is released first (the round's tokens are then
        worthless, and the caller fails it), so the device never waits for a host gone away."""
        before = self.issued - (num_steps - 1)  # the counter before this round: step s waits for before + s
        try:
            for step in range(num_steps - 1):
                self.events[step].synchronize()
                advance(self.host_tokens[step, :num_rows].tolist(), self.host_masks[:num_rows])
                self.counter.numpy()[0] = before + step + 1
        except BaseException:
            self.counter.numpy()[0] = self.issued
            raise

    def take_timeouts(self) -> int:
        """Waits that gave up since the last call (each one let a step sample with a stale mask)."""
        total = int(self.timeouts.numpy()[0])
        new, self._timeouts_seen = total - self._timeouts_seen, total
        return new
