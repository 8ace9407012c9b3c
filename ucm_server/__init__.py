"""The UCM daemon. Its version is the protocol package's (one number for the product)."""

from ucm_protocol import __version__

__all__ = ["__version__"]
