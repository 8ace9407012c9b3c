"""The phase clock behind the vLLM benchmark's per-step breakdown: decode-only steps, medians."""

from __future__ import annotations

from ucm_client.sparse.phase_clock import PhaseClock


def test_only_kept_steps_count_and_figures_are_medians() -> None:
    clock = PhaseClock()
    for kernel in (0.001, 0.002, 0.100):  # one disturbed step: a mean would say 34 ms
        clock.add("kernel", kernel)
        clock.add("step", 2 * kernel)
        clock.end_step(keep=True)
    clock.add("kernel", 5.0)  # a prefill step: dropped
    clock.end_step(keep=False)
    ms = clock.per_step_ms()
    assert round(ms["kernel"], 6) == 2.0
    assert round(ms["step"], 6) == 4.0
    assert len(clock.records) == 3
    assert round(clock.mean_ms("kernel"), 6) == round(1e3 * 0.103 / 3, 6)  # a periodic cost amortized
    assert clock.mean_ms("absent") == 0.0


def test_a_phase_missing_from_a_step_counts_as_zero_there() -> None:
    clock = PhaseClock()
    with clock.time("selection"):
        pass
    clock.end_step(keep=True)
    clock.end_step(keep=True)
    clock.end_step(keep=True)
    assert clock.per_step_ms()["selection"] == 0.0  # median of (t, 0, 0)
    clock.clear()
    assert clock.per_step_ms() == {} and not clock.pending
