"""Moved to :mod:`ucm_protocol.ucm.v1.ucm_pb2` (generated there by ``make proto``); kept until 0.2.

A re-export, never a second generated copy: the same message classes, and ``ucm/v1/ucm.proto`` is
registered once in the default descriptor pool.
"""

from ucm_protocol.ucm.v1.ucm_pb2 import *  # noqa: F403
from ucm_protocol.ucm.v1.ucm_pb2 import DESCRIPTOR  # noqa: F401
