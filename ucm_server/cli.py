"""``ucm-server``: start the UCM daemon.

Every setting is a flag here, a key in the YAML file given by ``--config`` and a ``UCM_<KEY>``
environment variable; flags win over the environment, which wins over the file, which wins over the
built-in defaults. With no arguments at all the daemon runs on the defaults: a 1 GiB memory Cache in
front of a Posix tier under ``~/.local/state/ucm``, listening on a private Unix socket.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

import yaml

from ucm_protocol.errors import ConfigError
from ucm_protocol.paths import server_config_path
from ucm_server import __version__
from ucm_server.config import FIELDS, describe, load_config

EXAMPLES = """\
examples:
  ucm-server                                  # defaults: Cache|Posix, socket in $XDG_RUNTIME_DIR or /tmp
  ucm-server --cache-capacity 32GiB --storage-backends /nvme0/ucm:/nvme1/ucm
  ucm-server --config /etc/ucm/ucm.yaml --print-config   # show the effective settings and exit
  UCM_STORE_PIPELINE='Cache|Posix|DS3FS' ucm-server

Point vLLM at it:
  vllm serve MODEL --kv-transfer-config '{"kv_connector":"UCMConnector",
      "kv_connector_module_path":"ucm_client.vllm.connector","kv_role":"kv_both"}'
Inspect it:  ucm-admin stats
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucm-server",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML configuration file (default: $UCM_SERVER_CONFIG)."
    )
    parser.add_argument(
        "--print-config", action="store_true", help="Print the effective configuration and exit."
    )
    parser.add_argument("--version", action="version", version=f"ucm-server {__version__}")
    group = parser.add_argument_group("settings (also YAML keys and UCM_<KEY> environment variables)")
    for name, field in FIELDS.items():
        if name == "tier_settings":
            continue
        flag = "--" + name.replace("_", "-")
        help_ = field.metadata.get("help", "")
        default = field.default_factory() if callable(field.default_factory) else field.default
        help_ = f"{help_} [default: {default}]".replace("%", "%%")  # argparse formats help with %
        if field.type in ("bool", bool):
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            group.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_)
    return parser


def _exit_with_parent() -> None:
    """``UCM_EXIT_WITH_PARENT=1``: get SIGTERM when the process that started us dies (tests, supervisors
    without process groups), so a daemon never outlives its owner."""
    if os.environ.get("UCM_EXIT_WITH_PARENT") != "1":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _exit_with_parent()
    overrides = {name: getattr(args, name) for name in FIELDS if name != "tier_settings"}
    try:
        config, warnings = load_config(args.config or server_config_path(), overrides)
    except ConfigError as exc:
        print(f"ucm-server: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        yaml.safe_dump(describe(config), sys.stdout, sort_keys=False)
        return 0

    from ucm_server.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    import logging

    for w in warnings:
        logging.getLogger("ucm_server").warning(w)
    import uvloop

    from ucm_server.server import run

    try:
        uvloop.run(run(config))
    except ConfigError as exc:
        print(f"ucm-server: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"ucm-server: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
