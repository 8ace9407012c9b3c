"""The Posix tier: one file per block under a sharded directory tree, durable and self-checking.

:class:`PosixTier` (:mod:`.tier`) is the async face over blocking file work written as module
functions (:mod:`.files`, :mod:`.group_commit`); :mod:`.layout`, :mod:`.room`, :mod:`.recovery` (with
:mod:`.index_snapshot` and :mod:`.periodic_snapshots`), :mod:`.packs`, :mod:`.block_index` and
:mod:`.confined` each hold one job. These names are what the rest of UCM uses.
"""

from ucm_server.store.posix.files import block_file_header, read_block_header, unlink_at
from ucm_server.store.posix.layout import QUARANTINE, SUFFIX, TMP_MARK, block_name
from ucm_server.store.posix.settings import Entry, PosixSettings, Profile
from ucm_server.store.posix.tier import PosixTier

__all__ = [
    "QUARANTINE",
    "SUFFIX",
    "TMP_MARK",
    "Entry",
    "PosixSettings",
    "PosixTier",
    "Profile",
    "block_file_header",
    "block_name",
    "read_block_header",
    "unlink_at",
]
