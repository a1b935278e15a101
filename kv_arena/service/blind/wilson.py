"""The 95% Wilson score interval of a share: honest at small counts and at 0% or 100%, where the
normal approximation gives an interval of width 0 or one outside [0, 1]."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the normal quantile of 0.975: a two-sided 95% interval


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the share ``successes / trials``; (0, 1) when there are no trials (nothing is known)."""
    if trials <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must lie between 0 and trials ({trials}); got {successes}")
    share, z2 = successes / trials, z * z
    centre = (share + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)
