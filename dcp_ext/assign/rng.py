"""SplitMix64: the one random generator both implementations share, so seeded runs match.

Python's `random` and C++'s <random> differ; this 10-line generator is written the same
way in csrc/assign_core.hpp and gives bit-identical streams.
"""
from __future__ import annotations

MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def next_double(self) -> float:
        """Uniform in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / 9007199254740992.0)

    def next_below(self, n: int) -> int:
        """An integer in [0, n) (modulo reduction; the tiny bias does not matter here)."""
        return self.next_u64() % n

    def shuffle(self, items: list) -> None:
        """Fisher-Yates, from the back."""
        for i in range(len(items) - 1, 0, -1):
            j = self.next_below(i + 1)
            items[i], items[j] = items[j], items[i]


def derive_seed(seed: int, k: int) -> int:
    """A per-replica / per-attempt seed: seed + k + 1, wrapped to 64 bits."""
    return (seed + k + 1) & MASK64
