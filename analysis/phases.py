"""CPU seconds per phase of a command, as the user pays them (user + system time of the
process): what `tangram simulate` writes in summary.json's ``timing.cpu_s`` and
`tangram bench sim-scale` reads there. Phases are laps: each is the CPU spent since the
one before, the first (``start``) everything since the process began (the interpreter and
the imports)."""

from __future__ import annotations

import resource


def cpu_s() -> float:
    """This process's user + system CPU seconds so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Phases:
    """Laps of this process's CPU time, by phase name (a phase lapped twice adds up)."""

    __slots__ = ("_last", "seconds")

    def __init__(self) -> None:
        self._last = 0.0
        #: phase -> CPU seconds, in the order first lapped
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """The CPU since the last lap (since the process began, for the first) was
        ``phase``'s."""
        now = cpu_s()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._last)
        self._last = now
