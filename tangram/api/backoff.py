"""Exponential backoff with jitter, after a provider's 429 (live and modelled alike)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Wait ``min(base_s * 2**attempt, cap_s)`` times a jitter factor in [0.5, 1.5)
    ("equal jitter" spreads retries that failed together)."""

    base_s: float = 0.5
    cap_s: float = 8.0

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.cap_s >= self.base_s):
            raise ValueError(f"backoff: need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    def delay(self, attempt: int, uniform: float) -> float:
        """The wait before retry ``attempt + 1``; ``uniform`` is a draw in [0, 1)."""
        return min(self.base_s * 2 ** attempt, self.cap_s) * (0.5 + uniform)
