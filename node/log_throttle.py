"""At most one log line per interval for an event that can repeat thousands of times a second
(refused connections, refused appends, a full disk), counting the ones held back."""

from __future__ import annotations


class LogThrottle:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._logged_at = float("-inf")
        self._held = 0

    def due(self, now: float) -> int | None:
        """None: do not log this occurrence (it is counted). Else log it now: the number of
        occurrences held back since the last line."""
        if now - self._logged_at < self.interval_s:
            self._held += 1
            return None
        held, self._held, self._logged_at = self._held, 0, now
        return held
