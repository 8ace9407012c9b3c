"""Moved to :mod:`ucm_protocol.ucm.v1.ucm_pb2_grpc` (generated there by ``make proto``); kept until 0.2."""

from ucm_protocol.ucm.v1.ucm_pb2_grpc import *  # noqa: F403
from ucm_protocol.ucm.v1.ucm_pb2_grpc import (  # noqa: F401
    Admin,
    AdminServicer,
    AdminStub,
    KVStore,
    KVStoreServicer,
    KVStoreStub,
    add_AdminServicer_to_server,
    add_KVStoreServicer_to_server,
)
