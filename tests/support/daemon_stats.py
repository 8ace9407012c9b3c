"""A daemon's statistics as tests read them."""

from __future__ import annotations

from typing import Any

from ucm_client import UcmClient


def tiers_by_name(client: UcmClient) -> dict[str, Any]:
    """The daemon's tier statistics now (``TierStats`` messages), keyed by tier name."""
    return {t.name: t for t in client.stats().tiers}
