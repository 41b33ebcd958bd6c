"""Retry delays that double after each failure up to a cap, and start over after a success."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first: float  # seconds before the first retry
    cap: float  # the longest delay
    _delay: float = field(init=False)
    _not_before: float = field(default=0.0, init=False)  # monotonic time before which no retry is due

    def __post_init__(self) -> None:
        self._delay = self.first

    def failed(self) -> float:
        """Count a failure; the seconds to wait before the next try."""
        wait = self._delay
        self._not_before = time.monotonic() + wait
        self._delay = min(self._delay * 2, self.cap)
        return wait

    def succeeded(self) -> None:
        self._delay, self._not_before = self.first, 0.0

    def remaining(self) -> float:
        """Seconds until a retry is due (0: now)."""
        return max(0.0, self._not_before - time.monotonic())

    def configure(self, first: float, cap: float) -> None:
        """New limits (a reload); a delay already running is kept."""
        self.first, self.cap = first, cap
        self._delay = min(max(self._delay, first), cap)
