"""UCM's wire contract, shared by the daemon (``ucm_server``) and its clients (``ucm_client``).

Everything both sides must agree on lives here and nowhere else: the generated ``ucm.v1`` stubs, the
error hierarchy and its status mapping, block keys, block states, socket path defaults, wire constants,
the fd socket's format, size parsing and the version. It imports nothing else of UCM, so a vLLM host
that imports the client never loads daemon modules. Importing the package itself loads nothing.
"""

__version__ = "0.1.0"
