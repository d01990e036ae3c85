"""Leaving a run cleanly before --train-iters: Megatron-LM's ``--exit-signal-handler`` and
``--exit-duration-in-mins``.

On a cluster a job ends at its time limit or when it is preempted; the run should end with a
checkpoint, not lose the iterations since the last ``--save-interval``. ``ExitConditions`` turns
SIGTERM (what Slurm, and torchrun passing it on, send first) into a request that every rank acts
on at the same iteration: the trainer asks ``reason()`` after each iteration, which takes the
maximum over the world (one small all-reduce, only when a condition is set), then saves and
exits with status 0. recipes/slurm/train.sbatch requeues the job first, so it resumes there.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

REASONS = ("", "SIGTERM received (--exit-signal-handler)",
           "--exit-duration-in-mins reached")


class ExitConditions:
    """Holds the conditions of one run; ``install()`` once before training, ``reason()`` after
    every iteration on every rank (a collective), ``restore()`` at the end."""

    def __init__(self, signal_handler: bool, duration_mins: Optional[float],
                 device: torch.device, start: Optional[float] = None):
        self.signal_handler = signal_handler
        self.duration_s = None if duration_mins is None else 60.0 * duration_mins
        self.device = device
        self.start = time.monotonic() if start is None else start
        self.received = False
        self._previous = None

    @property
    def active(self) -> bool:
        return self.signal_handler or self.duration_s is not None

    def install(self) -> None:
        if self.signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.received = True

    def reason(self) -> str:
        """'' to go on, else why to stop: the same answer on every rank."""
        if not self.active:
            return ""
        code = 1 if self.received else 0
        if not code and self.duration_s is not None and \
                time.monotonic() - self.start >= self.duration_s:
            code = 2
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return REASONS[code]
