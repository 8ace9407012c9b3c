"""The sparse methods: block-sparse retrieval (ESA, GSA, KVStarMultiStep on ``block_sparse``), the
dense pass-through for prefill-time methods (Blend, ReRoPE). The factory imports them by module path."""
