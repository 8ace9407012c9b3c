"""Tensor-level building blocks the methods share: attention over token lists (``attention``), the
compiled scoring loops (``scoring``), and reading keys out of a paged KV cache (``paged``)."""
