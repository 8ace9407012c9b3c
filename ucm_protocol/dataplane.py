"""The local data plane's shared-memory layouts and handshake, as both the daemon and its clients see them.

A local client (Unix socket, same machine) skips gRPC on its two hottest paths:

- **Lookup** reads a *presence table* the daemon publishes in a memfd the client maps read-only: an
  open-addressing hash table of ``(namespace, digest) -> tiers holding it``, one per tenant, updated
  by the daemon under a per-slot sequence lock (a reader never sees a half-written slot).
- **Load and Dump** go through a per-session *ring*: a memfd both map, holding a submission queue
  (the client's requests, their bodies in an arena), a completion queue (the daemon's answers) and a
  few counters. The doorbell in both directions is one byte on the Unix stream connection that
  carried the descriptors; the same connection tells each side that the other went away.

Everything a client writes is hostile input to the daemon: it copies an entry and its body out of
the ring before it checks anything, and a client that breaks its ring only loses its own data plane.
Every number here is little-endian and every offset is from the start of its memfd.

The handshake (``<socket path>.dp``, a third socket beside the gRPC one and the fd socket): the
client connects, checks the daemon's uid, and sends :data:`HELLO` followed by its bearer token (if
any); the daemon checks the client's uid, the token and that the session is the token's, then
answers :data:`REPLY` with the descriptors attached (``SCM_RIGHTS``), or a status and a reason.
"""

from __future__ import annotations

import struct
from pathlib import Path

SOCKET_SUFFIX = ".dp"
"""The data-plane socket lives beside the gRPC socket: ``<socket path>.dp``."""


def dataplane_socket_path(grpc_socket: Path) -> Path:
    return Path(str(grpc_socket) + SOCKET_SUFFIX)


# -- the handshake ----------------------------------------------------------------------------------
HELLO = struct.Struct("<8sIII32s")  # magic, version, kind, token length, session id (ASCII hex)
HELLO_MAGIC = b"UCMDPHI1"
REPLY = struct.Struct("<8sIII")  # magic, status (0 = OK, else a grpc.StatusCode value), kind, length
REPLY_MAGIC = b"UCMDPRE1"
VERSION = 1
KIND_CHANNEL = 1
"""Open the session's channel: the reply carries the ring's and the table's descriptors, and the
connection stays open as the doorbell and as each side's sign of life."""
KIND_TABLE = 2
"""Fetch the current table again (the one the client holds was superseded): the reply carries its
descriptor and the connection closes."""
MAX_TOKEN_BYTES = 4096
MAX_REASON_BYTES = 4096
CHANNEL_INFO = struct.Struct("<QQQQ")  # ring generation, ring bytes, table generation, table bytes
TABLE_INFO = struct.Struct("<QQ")  # table generation, table bytes
DOORBELL = b"\x01"

# -- the presence table -----------------------------------------------------------------------------
TABLE_MAGIC = b"UCMPRES1"
TABLE_HEADER_BYTES = 4096
"""The header's page; the namespace directory follows it, then the slots (each page-aligned)."""
# Header fields (offset, format):
T_MAGIC = 0  # 8s
T_VERSION = 8  # u32
T_HEADER_BYTES = 12  # u32
T_GENERATION = 16  # u64: random per table, named in the handshake too
T_SEED = 24  # u64: the hash's seed
T_NSLOTS = 32  # u64: any count (a key's first slot is its hash scaled to it)
T_SLOTS_AT = 40  # u64
T_NS_CAPACITY = 48  # u32
T_NS_COUNT = 52  # u32: directory entries in use (written after the entry itself)
T_STATE = 56  # u32: TABLE_LIVE, TABLE_SUPERSEDED or TABLE_CLOSED
T_FLAGS = 60  # u32: FLAG_*
T_VALID_UNTIL = 64  # u64: CLOCK_MONOTONIC nanoseconds; past it, a reader asks the daemon instead
T_LIVE = 72  # u64: entries held (a figure)
T_USED = 80  # u64: entries held + deleted slots (what decides a rebuild)
T_DIR_AT = 88  # u64
T_MAX_KEYS = 96  # u64: the daemon's max_batch_blocks (a longer lookup goes to gRPC, which refuses it)
TABLE_HEADER = struct.Struct("<8sIIQQQQIIIIQQQQQ")  # the fields above, in order

TABLE_LIVE, TABLE_SUPERSEDED, TABLE_CLOSED = 0, 1, 2
FLAG_COMPLETE = 1
"""Every tier of the daemon's pipeline is indexed in this table: a key absent here is absent. Without
it (a shared tier, a tier without a watchable index) a reader answers only when every key is present."""
FLAG_ALL_NAMESPACES = 2
"""Every namespace is in the directory as soon as a block of it is stored (a daemon without tenants):
a namespace missing from the directory holds nothing. Without it a client asks for its namespace to
be tracked (:data:`OP_TRACK`) and uses gRPC until it is."""

FLAG_LOOKUPS_BY_RPC = 4
"""Lookups are the daemon's to see (an admission policy counts a block looked up as used again, to
decide what it writes down): a reader asks gRPC for every lookup; Load and Dump still use the ring."""

DIR_ENTRY = struct.Struct("<16sI12x")  # namespace as the client names it, state
DIR_ENTRY_BYTES = DIR_ENTRY.size  # 32
DIR_FREE, DIR_POPULATING, DIR_TRACKED = 0, 1, 2
NS_NONE = 0xFFFFFFFE
"""The namespace id a reader probes with for a namespace a table of every namespace does not list."""

SLOT = struct.Struct("<II32s")  # sequence, tag (low 16 bits: 0 empty, TAG_DELETED, else ns_id + 1) and
# the tiers holding the key (high 16 bits, one bit per tier), digest
SLOT_BYTES = SLOT.size  # 40
TAG_DELETED = 0xFFFF
MAX_PROBE = 64
"""Slots a probe visits at most, reader and writer alike: an insert that finds no slot this close
makes the daemon rebuild the table (with a new seed), a reader that gets this far asks gRPC."""
MAX_TIERS = 16

# -- the ring ---------------------------------------------------------------------------------------
RING_MAGIC = b"UCMRING1"
RING_HEADER_BYTES = 4096
R_MAGIC = 0  # 8s
R_VERSION = 8  # u32
R_HEADER_BYTES = 12  # u32
R_GENERATION = 16  # u64
R_SQ_ENTRIES = 24  # u32 (a power of two)
R_CQ_ENTRIES = 28  # u32 (a power of two)
R_SQ_AT = 32  # u64
R_CQ_AT = 40  # u64
R_MSG_AT = 48  # u64: one MESSAGE_BYTES reason per completion slot (refusals)
R_ARENA_AT = 56  # u64
R_ARENA_BYTES = 64  # u64
RING_HEADER = struct.Struct("<8sIIQIIQQQQQ")  # the fields above, in order
# Indices, each on its own cache line; each written by one side only (a free-running u32 counter):
R_SQ_TAIL = 128  # client: entries submitted
R_SQ_HEAD = 192  # daemon: entries taken
R_CQ_TAIL = 256  # daemon: completions posted
R_CQ_HEAD = 320  # client: completions read
# Lookups answered from the table, counted by the client (u64 each; the daemon's figures add them,
# bounded: a client cannot make the daemon's counters go backwards or jump past what it could do).
R_LOOKUPS = 384
R_LOOKUP_KEYS = 392
R_LOOKUP_HITS = 400
R_LAST_KEYS = 408
R_LAST_HITS = 416

SQE = struct.Struct("<BBHIQQQIIQQQ")  # 64 bytes
SQE_BYTES = SQE.size
# opcode, flags, pad, nblocks, user_data, body_offset, body_bytes, nsegments, pad,
# progress region, progress offset, progress length
OP_LOAD, OP_DUMP, OP_TRACK = 1, 2, 3
"""OP_TRACK: list a namespace in this tenant's table; its 16 bytes in the progress region and offset
fields (little-endian), no body and no answer."""
SQF_DURABLE = 1
SQF_PROGRESS = 2
SQF_MULTI = 4
"""Blocks of more than one segment: the body carries a segment count per block."""
SQF_CACHE_ONLY = 8
"""A Dump kept in the Cache, never written down (``DumpRequest.cache_only``)."""

CQE = struct.Struct("<QBBBBIQQdII?15x")  # 64 bytes
CQE_BYTES = CQE.size
# user_data, kind, task state, all_ok, progress taken, status, task_id, bytes_done, elapsed_s,
# reason length, blocks, store saturated (a submission's answer: ``TaskHandle.store_saturated``)
CQ_SUBMITTED, CQ_REFUSED, CQ_FINISHED = 1, 2, 3
MESSAGE_BYTES = 1024

assert SQE_BYTES == 64 and CQE_BYTES == 64 and SLOT_BYTES == 40 and DIR_ENTRY_BYTES == 32


def body_bytes(nblocks: int, nsegments: int, multi: bool) -> int:
    """Bytes of a Load/Dump body: namespace, keys, segment counts (multi only, padded to 8), then the
    segments' region ids, offsets and lengths as three u64 columns."""
    counts = (4 * nblocks + 7) & ~7 if multi else 0
    return 16 + 32 * nblocks + counts + 24 * nsegments


def page_align(n: int, page: int = 4096) -> int:
    return (n + page - 1) & ~(page - 1)
