"""Wall time per phase of the sparse decode path, kept only for decode-only steps.

The benchmark's question is where a decode step's time goes (attention kernel, selection, feature
update, block-table rebuild, hooks, the rest of the model). Timing is a few ``perf_counter`` calls
per layer, cheap enough to stay on: phases of a step accumulate in ``pending`` and are added to
the record only if the step turns out to be decode-only (a prefill step would swamp the figures).
Figures are medians over steps: on a shared machine a mean is decided by the few disturbed steps.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseClock"]


class PhaseClock:
    """Seconds per named phase of each decode-only step seen."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self.pending: defaultdict[str, float] = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        self.pending[phase] += seconds

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.pending[phase] += time.perf_counter() - start

    def end_step(self, *, keep: bool) -> None:
        """Close a step: its phases count if ``keep`` (a decode-only step), else they are dropped."""
        if keep:
            self.records.append(self.pending)
        self.pending = defaultdict(float)

    def clear(self) -> None:
        self.records.clear()
        self.pending.clear()

    def mean_ms(self, phase: str) -> float:
        """Mean milliseconds per decode-only step of one phase: what a cost paid every few steps
        (a retrieval every ``retrieval_stride`` steps) amortizes to, which a median hides."""
        if not self.records:
            return 0.0
        return 1e3 * statistics.fmean(r.get(phase, 0.0) for r in self.records)

    def per_step_ms(self) -> dict[str, float]:
        """Median milliseconds per decode-only step, per phase (0 in steps where it did not run)."""
        names = sorted({name for record in self.records for name in record})
        return {name: 1e3 * statistics.median(r.get(name, 0.0) for r in self.records) for name in names}
