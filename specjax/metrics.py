"""Metrics of speculative decoding runs, computed from plain numbers (no JAX): τ and acceptance
by position from acceptance histograms, and latency percentiles.

An acceptance histogram ``hist`` [D + 1] counts verify cycles by how many drafted tokens they
accepted (``hist[a]``: cycles that accepted exactly a; ``decode.SpecStats.accept_hist`` per row,
summed over rows). Every cycle also emits one token of its own (the bonus or correction), so

    τ = (Σ_a a · hist[a]) / Σ_a hist[a] + 1,

and the acceptance at position k is the fraction of cycles that accepted at least k drafts,
``Σ_{a ≥ k} hist[a] / Σ_a hist[a]`` for k = 1 .. D (non-increasing in k).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _hist(hist) -> np.ndarray:
    h = np.asarray(hist, np.float64)
    if h.ndim != 1 or h.size < 1 or (h < 0).any():
        raise ValueError(f"an acceptance histogram is a 1-D array of counts >= 0, got shape "
                         f"{h.shape}")
    return h


def tau(hist) -> float:
    """Tokens per verify cycle (module docstring); 1.0 for a histogram without cycles."""
    h = _hist(hist)
    cycles = h.sum()
    return float((np.arange(h.size) * h).sum() / cycles + 1) if cycles else 1.0


def acceptance_by_position(hist) -> list[float]:
    """[D] fractions of cycles that accepted at least k drafts, k = 1 .. D (module docstring);
    empty for a histogram without cycles or without draft positions."""
    h = _hist(hist)
    cycles = h.sum()
    if not cycles or h.size < 2:
        return []
    at_least = np.cumsum(h[::-1])[::-1]  # at_least[k] = sum of h[k:]
    return [float(x / cycles) for x in at_least[1:]]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[float, float]:
    """{q: the q-th percentile of ``values``} with linear interpolation between order
    statistics (numpy's default), e.g. time per output token p50 / p95 / p99 over requests.

    Raises:
      ValueError: no values, or a q outside [0, 100].
    """
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("percentiles of no values")
    bad = [q for q in qs if not 0 <= q <= 100]
    if bad:
        raise ValueError(f"percentiles must be in [0, 100], got {bad}")
    return {q: float(np.percentile(v, q)) for q in qs}
