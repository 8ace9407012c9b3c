"""CUDA IPC regions over the real gRPC API, with the daemon's CUDA calls answered by the fake backend.

The daemon runs in this process (its own thread and event loop) so the fake can stand in for cupy;
everything between the client's ``register_cuda`` and the device copies is the production path: the
proto fields, the servicer, the engine, and the client's re-registration after a daemon restart.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from support.fake_cuda import FakeCuda
from support.gpu_daemon import InProcessDaemon, export

from ucm_client import BlockIO, BlockState, Segment, UcmClient, key_digest, namespace_id

NS = namespace_id(model="gpu-grpc", dtype="uint8")
BLOCK = 128 << 10


def test_register_cuda_round_trip_and_re_registration_after_restart(tmp_path: Path) -> None:
    fake = FakeCuda()
    n = 24
    hs, src = FakeCuda.allocate(n * BLOCK)
    hd, dst = FakeCuda.allocate(n * BLOCK)
    src_view, dst_view = memoryview(src).cast("B"), memoryview(dst).cast("B")
    src_view[:] = os.urandom(n * BLOCK)
    keys = [key_digest("grpc", i) for i in range(n)]
    with InProcessDaemon(tmp_path / "a", fake) as daemon, UcmClient(daemon.target) as client:
        rs = client.register_cuda(export(fake, hs, n * BLOCK), label="src")
        rd = client.register_cuda(export(fake, hd, n * BLOCK), label="dst")
        assert client.stats().regions == 2
        dump = client.wait(
            client.dump(
                NS,
                [BlockIO(k, (Segment(rs, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)],
                wait_durable=True,
            ),
            30,
        )
        assert dump.ok, dump.reasons
        load = client.wait(
            client.load(NS, [BlockIO(k, (Segment(rd, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]), 30
        )
        assert load.ok, load.reasons
        assert bytes(dst_view) == bytes(src_view)
        # Out of bounds is refused with the reason, and the session is still usable.
        bad = [BlockIO(keys[0], (Segment(rd, n * BLOCK - 1, BLOCK),))]
        try:
            client.load(NS, bad)
        except ValueError as exc:
            assert "outside region" in str(exc)
        else:
            raise AssertionError("an out-of-bounds GPU segment was accepted")

        # The daemon restarts (same socket, blocks survive in Posix): the client registers its GPU
        # regions again on the next call and the same handles keep working.
        daemon.__exit__(None, None, None)  # stop it; the client stays
        assert fake.opened == {}, "shutdown closed every IPC mapping"
        dst_view[:] = b"\0" * (n * BLOCK)
        with InProcessDaemon(tmp_path / "a", fake) as again:
            load = client.wait(
                client.load(NS, [BlockIO(k, (Segment(rd, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]),
                30,
            )
            assert load.ok, load.reasons
            assert bytes(dst_view) == bytes(src_view)
            assert len(fake.opened) == 2
            missing = client.wait(
                client.load(NS, [BlockIO(key_digest("none"), (Segment(rd, 0, BLOCK),))]), 30
            )
            assert missing.states == [BlockState.MISSING]
            client.close()
            for _ in range(100):  # the session ends with the client: its mappings are closed
                if not fake.opened:
                    break
                again._run(asyncio.sleep(0.05))
            assert fake.opened == {}
