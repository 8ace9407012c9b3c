"""The accuracy cost of fp8 compression at rest on attention outputs.

The sparse benchmark's planted-needle data (Llama-3-8B layer shape), K and V in bf16 stored through
the codec in 128-token blocks: every element stays within the codec's documented bound, the
attention output moves by less than that bound's relative part (2**-4), the needles stay the
most-attended blocks — and the output does move (a codec that changed nothing was never applied).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks.codec_bench import attention_error


def test_attention_outputs_through_the_codec_stay_within_the_documented_bound() -> None:
    err, vs_fp32, worst, kept = attention_error(4096)
    assert worst <= 1.0, "an element past the codec's bound"
    assert 0 < err < 2**-4, err
    assert err > vs_fp32, "fp8 costs more than bf16 itself: the comparison measures the codec"
    assert kept
