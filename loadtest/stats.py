"""The one percentile definition the load tools and benchmarks report (no third-party imports: the
benchmarks a GPU run takes import it, and its image carries only what they need)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
