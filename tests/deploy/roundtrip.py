"""A UCM client as a deployed vLLM would be one: dump, or load and compare, blocks through a socket.

Run by the deployment tests as a separate process, as the daemon's uid, on the host (against the
container's mounted socket) or inside the systemd container (against the unit's socket). It uses only
the public client API (``UcmClient`` + ``SharedBuffer``) and so needs only ``ucm_client`` and numpy:
the ucm-server image's own venv can run it.

    python roundtrip.py SOCKET dump|load|lookup SEED COUNT

Exit 0 when every block went through and (load) came back byte for byte; the last line of stdout is
a JSON summary. Blocks are 64 KiB of bytes derived from SEED and the block index.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id

BLOCK = 1 << 16


def expected(seed: str, count: int) -> np.ndarray:
    """The bytes of all ``count`` blocks, one after the other."""
    rng = np.random.default_rng(int.from_bytes(seed.encode(), "little") % (1 << 63))
    return rng.integers(0, 256, size=count * BLOCK, dtype=np.uint8)


def main(argv: list[str]) -> int:
    socket, action, seed, count = argv[0], argv[1], argv[2], int(argv[3])
    ns = namespace_id(model=f"deploy-{seed}", dtype="uint8")
    data = expected(seed, count)
    with UcmClient(socket) as client, SharedBuffer(count * BLOCK) as buf:
        region = client.register(buf)
        keys = [key_digest(seed, i) for i in range(count)]
        blocks = [BlockIO(k, (Segment(region, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]
        view = buf.array()
        summary: dict[str, object] = {"action": action}
        if action == "dump":
            view[:] = data
            result = client.wait(client.dump(ns, blocks), 30)
            summary["ok"] = result.ok
        elif action == "load":
            view[:] = 0
            result = client.wait(client.load(ns, blocks), 30)
            summary["ok"] = result.ok
            summary["equal"] = bool(np.array_equal(view, data))
        else:
            summary["hit_prefix"] = client.lookup(ns, keys).hit_prefix
            summary["ok"] = True
    print(json.dumps(summary))
    good = summary["ok"] and summary.get("equal", True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
