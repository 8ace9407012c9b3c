"""The local data plane, the client's side: Lookup from the daemon's shared table, Load/Dump through
a shared ring (:class:`~ucm_client.dataplane.plane.ClientDataPlane`, used by
:class:`~ucm_client.sync.UcmClient`). Layouts: :mod:`ucm_protocol.dataplane`; the daemon's side:
:mod:`ucm_server.dataplane`.
"""
