"""Ctrl-C during training: the first one asks the loop to finish the current step and write a
checkpoint; a second one stops at once (``KeyboardInterrupt``)."""
from __future__ import annotations

import signal


class GracefulInterrupt:
    """Context manager installing the SIGINT handler (in the main thread; elsewhere it is a
    no-op). ``requested`` turns true on the first Ctrl-C."""

    def __init__(self):
        self.requested = False
        self._old = None

    def handle(self, signum=None, frame=None) -> None:
        if self.requested:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True
        print("\n[openrlhf-div] Ctrl-C: finishing this step, then writing a checkpoint (Ctrl-C again to abort)")

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self.handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
