"""The old path of Blend: the method lives in :mod:`ucm_client.sparse.methods.blend`."""

from ucm_client.sparse.methods.blend import (
    Blend,
    BlendModel,
    BlendResult,
    BlendSpec,
    Chooser,
    ChunkKV,
    DeviationInputs,
    Scorer,
    blend,
    kv_deviation,
    prefill,
    top_deviation,
)

__all__ = [
    "Blend",
    "BlendModel",
    "BlendResult",
    "BlendSpec",
    "Chooser",
    "ChunkKV",
    "DeviationInputs",
    "Scorer",
    "blend",
    "kv_deviation",
    "prefill",
    "top_deviation",
]
