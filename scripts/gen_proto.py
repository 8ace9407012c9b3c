"""Generate the Python gRPC stubs from ``proto/ucm/v1/*.proto`` into ``ucm_protocol/``.

Run ``make proto`` (or ``python scripts/gen_proto.py``). ``--check`` regenerates into a temporary
directory and fails when the committed stubs differ, which is what the staleness test calls.

protoc writes ``from ucm.v1 import ucm_pb2``; we rewrite that to the package path the stubs live at,
``ucm_protocol.ucm.v1``, so they import without touching ``sys.path``. There is one generated copy
only: two generated modules would register ``ucm/v1/ucm.proto`` twice in the default descriptor pool.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "ucm_protocol"
PACKAGE = "ucm_protocol"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # a test/dev dependency only

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for p in (out_root / "ucm").rglob("*") if p.suffix in {".py", ".pyi"})
    for path in written:
        text = path.read_text()
        text = text.replace("from ucm.v1 import", f"from {PACKAGE}.ucm.v1 import")
        path.write_text(text)
    for pkg in {p.parent for p in written} | {out_root / "ucm"}:
        (pkg / "__init__.py").touch()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT_ROOT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.relative_to(tmp)
            for p in fresh
            if p.name != "__init__.py"
            and not (
                (OUT_ROOT / p.relative_to(tmp)).exists()
                and filecmp.cmp(p, OUT_ROOT / p.relative_to(tmp), shallow=False)
            )
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(map(str, stale))}; run `make proto`", file=sys.stderr)
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
