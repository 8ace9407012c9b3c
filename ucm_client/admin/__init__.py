"""``ucm-admin``: inspect and operate a running ``ucm-server`` from a shell or a script.

The package is split by job: :mod:`.cli` builds the parsers and dispatches, :mod:`.output` is the one
object every command writes through (human tables, ``--json`` documents or ``--quiet`` silence),
:mod:`.errors` maps every failure to a message and an exit code, :mod:`.connection` talks gRPC to the
daemon, and the commands live in :mod:`.observe` (read-only), :mod:`.operate` (changes state) and
:mod:`.diagnose` (bench, doctor). Nothing here imports torch or vLLM, so the tool starts fast.
"""
