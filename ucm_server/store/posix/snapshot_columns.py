"""The Posix tier's index to and from the columns of an index snapshot, in array operations.

A snapshot (:mod:`ucm_server.store.posix.index_snapshot`) lists every block in columns: keys, sizes,
store times, pack ids and record offsets. A start turns a million of them into index entries
(:class:`~ucm_server.store.posix.block_index.Stamp` objects shared per size and second, packs with
their keys and offsets) with a few array operations and C-level calls per column and a few Python
steps per pack, never one per block; a snapshot turns the index back into columns the same way.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np

from ucm_server.store.posix import index_snapshot
from ucm_server.store.posix.block_index import BlockIndex, Stamp
from ucm_server.store.posix.packs import Pack


def stamps_of(
    index: BlockIndex, root: Path, blocks: index_snapshot.Columns
) -> tuple[list[Stamp], list[Pack]]:
    """Each block's stamp (``index``'s shared ones; a packed block's its pack's) and the packs
    named, for a snapshot of ``root``."""
    sizes = np.asarray(blocks.sizes, dtype=np.uint64)
    mine, pairs = index.stamps_for(sizes, np.asarray(blocks.times, dtype=np.float64))
    packs: list[Pack] = []
    if blocks.packs is not None and blocks.offsets is not None:
        ids = np.asarray(blocks.packs, dtype=np.uint64)
        if ids.any():
            packs = _packed_stamps(root, blocks.keys, ids, np.asarray(blocks.offsets), pairs, mine)
    stamps: list[Stamp] = mine.tolist()
    return stamps, packs


def _packed_stamps(
    root: Path,
    keys: Sequence[bytes],
    ids: np.ndarray,
    offsets: np.ndarray,
    pairs: tuple[np.ndarray, list[tuple[int, int]]],
    stamps: np.ndarray,
) -> list[Pack]:
    """The packs a snapshot of ``root`` names (``ids``: each block's pack id, 0 for a block file),
    each with its blocks' keys and record offsets, and their blocks' stamps in ``stamps`` (an object
    array, changed in place) replaced by their packs' (one per pack, size and second; ``pairs``: each
    block's (size, second) index and the pairs, from :meth:`BlockIndex.stamps_for`). Array
    operations over all blocks, then a few C-level steps per pack."""
    rows = np.flatnonzero(ids)
    order = _grouped_by_pack(rows, ids[rows])  # grouped by pack, in LRU order within each
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    bounds = [*starts.tolist(), len(order)]
    pair_of, pair_values = pairs
    pack_of = np.repeat(np.arange(len(starts)), np.diff(bounds))
    # Runs of one pack and one (size, second): usually one run a pack (a dump's blocks share both).
    codes = pack_of.astype(np.int64) * len(pair_values) + pair_of[order]
    first = np.r_[True, codes[1:] != codes[:-1]]
    triples, triple_of = codes[first].tolist(), np.cumsum(first) - 1
    ordered: list[bytes | None]
    if isinstance(keys, list) and len(order) == len(keys) and not (order != np.arange(len(keys))).any():
        ordered = cast("list[bytes | None]", keys)  # every block packed, packs side by side: as listed
    else:
        ordered = list(map(keys.__getitem__, order.tolist()))
    places = offsets[order].astype("<u8").tobytes()
    packs: list[Pack] = []
    for n, pack_id in enumerate(sorted_ids[starts].tolist()):
        a, b = bounds[n], bounds[n + 1]
        pack = Pack(pack_id, root)
        pack.keys = ordered[a:b]
        pack.offsets.frombytes(places[a * 8 : b * 8])
        pack.live = b - a
        packs.append(pack)
    made = np.empty(len(triples), dtype=object)
    for n, triple in enumerate(triples):  # a pack's stamp() shares one stamp per (size, second)
        size, second = pair_values[triple % len(pair_values)]
        made[n] = packs[triple // len(pair_values)].stamp(size, second)
    stamps[order] = made[triple_of]
    return packs


def _grouped_by_pack(rows: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
    """``rows`` (with pack ids ``row_ids``) ordered so that each pack's are side by side, in their
    LRU order within it. Usually they are already (a dump's blocks are stored together, and a
    snapshot lists them in LRU order): then no sort."""
    if not len(rows):
        return rows
    runs = row_ids[np.r_[True, row_ids[1:] != row_ids[:-1]]]
    if len(np.unique(runs)) == len(runs):  # each pack in one run
        return rows
    return rows[np.argsort(row_ids, kind="stable")]


def columns_of(
    keys: list[bytes], stamps: list[Stamp], places: dict[bytes | None, int] | None
) -> index_snapshot.Columns:
    """A root's snapshot columns; with packs (``places``: each live packed key's record offset) the
    packed blocks' pack ids and offsets too, a packed block that died while the snapshot was
    taken left out. C-level maps over the keys and stamps, no Python step per block."""
    times = list(map(_STORED_AT, stamps))
    if places is None:
        return index_snapshot.Columns(keys, stamps, times)
    ids = np.array(list(map(_PACK_ID, stamps)), dtype=np.uint64)
    offsets = np.array(list(map(places.get, keys, itertools.repeat(-1))), dtype=np.int64)
    dead = (ids != 0) & (offsets < 0)
    offsets[ids == 0] = 0
    if dead.any():
        kept = np.flatnonzero(~dead).tolist()
        keys, stamps, times = [keys[i] for i in kept], [stamps[i] for i in kept], [times[i] for i in kept]
        ids, offsets = ids[~dead], offsets[~dead]
    return index_snapshot.Columns(keys, stamps, times, ids, offsets.astype(np.uint64))


_STORED_AT = operator.attrgetter("stored_at")
_PACK_ID = operator.attrgetter("pack_id")
