"""The layering holds. ``ucm_protocol`` is the floor both sides stand on and imports nothing else of
UCM; a client process never loads a daemon module; no import loops anywhere in the three packages;
no import runs back up; the old import paths still give the very same objects.

What "up" means: inside a package, each module and each sub-package (a folder, taken whole) is a
*room*, and a room stands above every room it imports. So the rooms of one package must import
each other without a loop; an import that closes such a loop runs back up, from a room below to a
room above it, even where no two modules import each other (``regions.py`` importing from ``gpu/``
while ``gpu/service.py`` imports ``regions.py`` was one). ``scripts/import_graph.py --check``
fails on it too.

Loading is checked in a fresh interpreter (what a vLLM host really gets); the static checks walk every
import statement with ``ast`` (``scripts/import_graph.py``), so imports inside functions and under
``TYPE_CHECKING`` count too: a loop or a client -> daemon import hidden there fails as well.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Loops still present on purpose, each with the package of issue #12 that removes it. A listed loop
# that is no longer found fails the test too, so whoever breaks a loop deletes its line here.
KNOWN: set[frozenset[str]] = {}


def _import_graph() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _analysis() -> dict[str, Any]:
    result: dict[str, Any] = _import_graph().analyse(ROOT, 0)
    return result


def _loaded_after(code: str, tmp_path: Path) -> list[str]:
    """The modules a fresh interpreter holds after running ``code`` (this checkout first on the path)."""
    out = tmp_path / "modules.json"
    script = f"{code}\nimport json, sys\nopen({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    modules: list[str] = json.loads(out.read_text())
    return modules


def _of(modules: list[str], *packages: str) -> list[str]:
    return [m for m in modules if m.partition(".")[0] in packages]


def test_client_never_loads_the_daemon(tmp_path: Path) -> None:
    """The client, the admin CLI (with ``--config`` resolving a socket from a daemon config file) and
    the connector's config load ``ucm_protocol`` and no ``ucm_server`` module, nor torch or vLLM."""
    config = tmp_path / "ucm.yaml"
    config.write_text(f"socket: {tmp_path / 'd.sock'}\ncache_capacity: 1GiB\n")
    modules = _loaded_after(
        "import ucm_client, ucm_client.admin.cli, ucm_client.vllm.config\n"
        "from ucm_client.admin.connection import resolve_target\n"
        f"assert resolve_target(None, None, {str(config)!r}).endswith('d.sock')\n",
        tmp_path,
    )
    assert _of(modules, "ucm_server") == []
    assert "ucm_protocol.errors" in modules and "ucm_protocol.ucm.v1.ucm_pb2" in modules  # not vacuous
    assert "ucm_client.admin.cli" in modules
    assert _of(modules, "torch", "vllm") == []


def test_protocol_imports_nothing_of_ucm(tmp_path: Path) -> None:
    """Every module of ``ucm_protocol``, imported in a fresh interpreter, loads nothing of the daemon
    or the client."""
    names = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "ucm_protocol").rglob("*.py")
    )
    assert "ucm_protocol.ucm.v1.ucm_pb2_grpc" in names and "ucm_protocol.errors" in names
    modules = _loaded_after("\n".join(f"import {n}" for n in names), tmp_path)
    assert set(names) <= set(modules)
    assert _of(modules, "ucm_server", "ucm_client") == []


def test_no_import_cycles() -> None:
    """No loop in the import graph of the three packages, counting imports in function bodies and under
    TYPE_CHECKING; the loops still listed in ``KNOWN`` are exactly the ones left."""
    cycles = _analysis()["cycles"]["all"]
    found = {frozenset(c["modules"]): c["edges"] for c in cycles}
    unexpected = {" , ".join(sorted(m)): edges for m, edges in found.items() if m not in KNOWN}
    assert unexpected == {}, "import loops (each closing edge listed)"
    stale = [sorted(m) for m in KNOWN if m not in found]
    assert stale == [], "these loops are gone: delete them from KNOWN"


def test_no_import_runs_back_up() -> None:
    """No loop between the rooms of any package (see the module docstring), whatever the import's
    kind; a found loop lists every import that makes it."""
    analysis = _analysis()
    loops = {" , ".join(loop["rooms"]): loop["edges"] for loop in analysis["back_up"]}
    assert loops == {}, "imports running back up (the loop's rooms, then its imports)"


def test_a_loop_between_rooms_is_found(tmp_path: Path) -> None:
    """The check sees a loop between a module and a folder that no module-level loop shows (the
    negative control of the test above)."""
    pkg = tmp_path / "ucm_server"
    (pkg / "gpu").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "gpu" / "__init__.py").write_text("")
    (pkg / "gpu" / "region.py").write_text("class GpuRegion: ...\n")
    (pkg / "gpu" / "service.py").write_text("from ucm_server.regions import RegionTable\n")
    (pkg / "regions.py").write_text("from ucm_server.gpu.region import GpuRegion\nclass RegionTable: ...\n")
    analysis = _import_graph().analyse(tmp_path, 0)
    assert analysis["cycles"]["all"] == []
    (loop,) = analysis["back_up"]
    assert loop["rooms"] == ["ucm_server.gpu", "ucm_server.regions"]
    assert len(loop["edges"]) == 2


def test_no_forbidden_cross_package_import() -> None:
    """No ``ucm_client`` -> ``ucm_server`` import, none the other way, and ``ucm_protocol`` imports
    neither, whatever the import's kind (module level, in a function, under TYPE_CHECKING)."""
    analysis = _analysis()
    assert analysis["packages"] == ["ucm_protocol", "ucm_server", "ucm_client"]
    assert analysis["modules"] > 100  # the walk really saw the tree
    bad = [f"{e['file']}:{e['line']} {e['src']} -> {e['dst']}" for e in analysis["forbidden_imports"]]
    assert bad == []


def test_old_import_paths_still_work() -> None:
    """The paths third parties use keep working for one release and give the very same objects, so an
    ``except`` or ``isinstance`` written against either path matches both."""
    import ucm_client
    import ucm_client.errors
    import ucm_client.gpu
    import ucm_protocol.errors
    import ucm_protocol.keys
    import ucm_protocol.ucm.v1.ucm_pb2 as new_pb
    import ucm_protocol.ucm.v1.ucm_pb2_grpc as new_rpc
    import ucm_server
    import ucm_server.api.errors
    import ucm_server.api.ucm.v1.ucm_pb2 as old_pb
    import ucm_server.api.ucm.v1.ucm_pb2_grpc as old_rpc
    import ucm_server.config
    import ucm_server.keys
    import ucm_server.store.base
    from ucm_client.layerwise import LayerwiseLoad
    from ucm_client.vllm.cuda_kv import CudaKVCache
    from ucm_protocol import __version__
    from ucm_protocol.settings import parse_size

    assert old_pb.LoadRequest is new_pb.LoadRequest and old_pb.DESCRIPTOR is new_pb.DESCRIPTOR
    assert old_rpc.KVStoreStub is new_rpc.KVStoreStub
    assert old_rpc.add_AdminServicer_to_server is new_rpc.add_AdminServicer_to_server
    assert ucm_server.api.errors.NotFound is ucm_protocol.errors.NotFound is ucm_client.errors.NotFound
    assert ucm_server.api.errors.ConfigError is ucm_protocol.errors.ConfigError
    assert ucm_server.keys.BlockKey is ucm_protocol.keys.BlockKey
    assert ucm_server.store.base.BlockState is ucm_client.BlockState
    assert ucm_server.config.parse_size is parse_size
    assert ucm_server.__version__ == __version__
    assert ucm_client.gpu.CudaKVCache is CudaKVCache and ucm_client.gpu.LayerwiseLoad is LayerwiseLoad
