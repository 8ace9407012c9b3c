"""GPU registration against a real daemon process on a machine without cupy / without a CUDA device.

The daemon must refuse a CUDA IPC region with FAILED_PRECONDITION and say why, then keep serving host
clients; the client must refuse to export memory it cannot share, with a clear error.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_client.cuda_ipc import CudaIpcExport, CudaUnavailable, as_export, export_pointer
from ucm_protocol.errors import FailedPrecondition
from ucm_server.testing.daemon import DaemonProcess

HAS_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed: this daemon would serve GPU regions")
@pytest.mark.slow
def test_daemon_without_cupy_refuses_gpu_regions_and_keeps_serving(
    daemon: DaemonProcess, client: UcmClient
) -> None:
    export = CudaIpcExport(handle=b"\0" * 64, offset=0, size=1 << 20, device=0, device_uuid=b"")
    for _ in range(2):
        with pytest.raises(FailedPrecondition) as info:
            client.register_cuda(export, label="kv")
        assert "cupy is not installed" in str(info.value)
        assert isinstance(info.value, CudaUnavailable)  # one exception to fall back on, either side
    assert daemon.healthy()
    n, size = 8, 64 << 10
    with SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(n * size)
        assert client.wait(client.dump(NS, blocks_in(rs, n, size)), 30).ok
        assert client.wait(client.load(NS, blocks_in(rd, n, size)), 30).ok
        assert bytes(dst.buf) == bytes(src.buf)
    assert client.stats().regions == 2


@pytest.mark.slow
def test_gpu_off_is_the_stated_reason(tmp_path: object) -> None:
    from pathlib import Path

    with (
        DaemonProcess(Path(str(tmp_path)) / "ucm", args=["--cache-capacity", "16MiB", "--gpu", "off"]) as d,
        UcmClient(d.target) as c,
    ):
        export = CudaIpcExport(handle=b"\0" * 64, offset=0, size=4096, device=0, device_uuid=b"")
        with pytest.raises(FailedPrecondition, match=r"gpu: off"):
            c.register_cuda(export)
        assert d.healthy()


def test_client_refuses_what_it_cannot_share() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(CudaUnavailable, match="CUDA"):
        as_export(torch.zeros(16))
    with pytest.raises(CudaUnavailable):
        export_pointer(0x1000, 4096, 0)  # no driver here: says so instead of crashing
    assert isinstance(CudaUnavailable("x"), FailedPrecondition)
