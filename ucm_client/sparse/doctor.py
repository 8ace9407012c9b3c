"""``python -m ucm_client.sparse.doctor [--json] [--register]``: which sparse hooks are live here.

The ``ucm-admin doctor`` equivalent for the sparse side until the admin CLI grows a subcommand. With
``--register`` it first does what the vLLM plugin entry point does, showing what a worker would get.
Exit status 0 when the attention hooks are active, 1 when they are not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ucm_client.sparse.vllm.plugin import register, verify_patches

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm-sparse-doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--register", action="store_true", help="register the backend first, as the plugin does"
    )
    args = parser.parse_args(argv)
    if args.register:
        register()
    rows = verify_patches()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        width = max(len(r.hook) for r in rows)
        for r in rows:
            print(f"{r.hook:<{width}}  {'ACTIVE  ' if r.active else 'inactive'}  {r.detail}")
    attention = next(r for r in rows if r.hook == "attention_begin")
    return 0 if attention.active else 1


if __name__ == "__main__":
    sys.exit(main())
