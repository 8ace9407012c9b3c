"""``ucm-admin``: the parsers, and ``main`` which resolves the target, dispatches and maps failures.

argparse keeps start-up fast (no torch, no vLLM, no click); the command modules and gRPC stubs are
imported only when a command runs, so ``ucm-admin --help`` answers at once. Global options are
accepted before or after the command (``ucm-admin --json stats`` and ``ucm-admin stats --json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ucm_client.admin.errors import EXIT_CODES_HELP, ExitCode, classify

if TYPE_CHECKING:
    from ucm_client.admin.connection import Daemon
    from ucm_client.admin.output import Output
    from ucm_protocol.keys import BlockKey

Handler = Callable[[argparse.Namespace, "Daemon", "Output"], ExitCode]

PROG = "ucm-admin"
MAX_PAGE_SIZE = 10000
"""The most blocks the daemon answers in one ListBlocks page."""
DEFAULT_TIMEOUT_S = 10.0

DESCRIPTION = """\
Inspect and operate a running ucm-server: health, per-tier statistics, the blocks it stores,
checksum verification, eviction. Human tables by default; --json prints one JSON document on
stdout for scripts; --quiet prints only what a pipe needs (e.g. keys). Diagnostics go to stderr.

Block keys are written <namespace hex>/<key hex> (32 + 64 hex digits), as `ucm-admin ls` prints them."""

EPILOG = f"""\
examples:
  ucm-admin health                          # exit 0 if the daemon answers SERVING
  ucm-admin stats                           # per tier: blocks, bytes, capacity, hit rate, evictions
  ucm-admin --json stats | jq '.tiers[] | {{name, hit_rate}}'
  ucm-admin ls --namespace 3f2a... --limit 20
  ucm-admin ls -q --namespace 3f2a... | ucm-admin delete -
  ucm-admin verify                          # exit 1 and list them if any block is corrupt
  ucm-admin watch --interval 2
  ucm-admin --socket /run/ucm/ucm.sock doctor

target: --target, else --socket, else the socket of --config FILE, else $UCM_TARGET, else the socket of
$UCM_SERVER_CONFIG (ucm-server's default config file; the image sets it), else $UCM_SOCKET,
else $XDG_RUNTIME_DIR/ucm/ucm.sock, else /tmp/ucm-<uid>/ucm.sock (the same default as ucm-server).
Set UCM_ADMIN_DEBUG=1 to see a traceback for unexpected errors.

{EXIT_CODES_HELP}"""


# -- argument types (errors here are usage errors: exit 2, nothing sent) --------------------------
def block_key(text: str) -> BlockKey:
    from ucm_protocol.keys import BlockKey

    try:
        return BlockKey.from_hex(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def namespace_hex(text: str) -> bytes:
    try:
        value = bytes.fromhex(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"namespace {text!r} is not 32 hexadecimal digits (two per byte)"
        ) from None
    if len(value) != 16:
        raise argparse.ArgumentTypeError(
            f"namespace must be 32 hex digits (16 bytes), got {len(value)} bytes"
        )
    return value


def size(text: str) -> int:
    """A size like ``2GiB``; at most what the wire carries (uint64), so nothing fails later in protobuf."""
    from ucm_protocol.settings import parse_size

    try:
        value = parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value >= 1 << 64:
        raise argparse.ArgumentTypeError(f"size {text} is more than 16 EiB")
    return value


def _require(value: int, ok: bool, message: str) -> int:
    """``value`` when ``ok``; else the usage error (exit 2) saying why."""
    if not ok:
        raise argparse.ArgumentTypeError(message)
    return value


def positive_size(text: str) -> int:
    value = size(text)
    return _require(value, value > 0, f"must be at least 1 byte, got {text}")


def priority_value(text: str) -> int:
    """An eviction priority, checked here: a number past int32 cannot even be put in the request."""
    from ucm_protocol.wire import PRIORITY_MAX, PRIORITY_MIN

    value = whole_number(text)
    message = f"priority must be between {PRIORITY_MIN} and {PRIORITY_MAX}, got {value}"
    return _require(value, PRIORITY_MIN <= value <= PRIORITY_MAX, message)


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    value = whole_number(text)
    return _require(value, value > 0, f"must be at least 1, got {value}")


def page_size(text: str) -> int:
    """A page size, checked here against the daemon's limit so a typo is a usage error (exit 2)."""
    value = positive_int(text)
    return _require(value, value <= MAX_PAGE_SIZE, f"at most {MAX_PAGE_SIZE}, got {value}")


def ttl_seconds(text: str) -> float:
    """A time to live in seconds (> 0), or ``never`` (0: the expiry is removed)."""
    if text == "never":
        return 0.0
    return positive_float(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0, got {text}")
    return value


# -- parsers ----------------------------------------------------------------------------------------
def _add_global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """Options valid before and after the command; after it they default to SUPPRESS (no override)."""
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("global options")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", default=default, help="Unix socket of the daemon.")
    where.add_argument(
        "--target",
        metavar="TARGET",
        default=default,
        help="Any gRPC target: unix:/path, host:port (plain TCP).",
    )
    where.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        help="The daemon's YAML config file: use the socket it names, with $UCM_* applied as ucm-server "
        "applies them (health checks follow the daemon's actual socket this way).",
    )
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="Print one JSON document on stdout (watch: one per line).",
    )
    mode.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="Print only essential data (ls: keys; verify: corrupt keys); rely on the exit code.",
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=positive_float,
        default=argparse.SUPPRESS if suppress else DEFAULT_TIMEOUT_S,
        help=f"Deadline to connect and for each call (default {DEFAULT_TIMEOUT_S:g}).",
    )


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-wrapped descriptions and examples; a fixed width keeps docs/cli.md stable."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)


def build_parser() -> argparse.ArgumentParser:
    """Every command and option; also what ``scripts/gen_cli_docs.py`` renders into docs/cli.md."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter
    )
    _add_global_options(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)

    def command(name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=summary,
            description=f"{summary}\n\n{description}".rstrip(),
            epilog=f"examples:\n{examples}\n\n{EXIT_CODES_HELP}",
            formatter_class=_Formatter,
        )
        _add_global_options(sub, suppress=True)
        return sub

    p = command(
        "health",
        "Is the daemon up? (grpc.health.v1 Check)",
        "Exit 0 when it answers SERVING, 1 when it answers anything else (NOT_SERVING while it shuts down),\n"
        "3 when nothing answers.",
        "  ucm-admin health\n  until ucm-admin -q health; do sleep 1; done   # wait for a starting daemon",
    )
    p.add_argument(
        "--service", default="", help="Service name to check ('' = the whole server; e.g. ucm.v1.Admin)."
    )
    p.set_defaults(handler="observe:health")

    p = command(
        "stats",
        "Per-tier statistics: blocks, bytes, capacity, hit rate, evictions, errors.",
        "Also the daemon's version, uptime, pipeline, sessions, registered memory, tasks and lookups.\n"
        "Hit rates are hits / (hits + misses) since the daemon started; '-' before the first read.",
        "  ucm-admin stats\n  ucm-admin --json stats | jq '.tiers[] | select(.name==\"Cache\") | .hit_rate'",
    )
    p.set_defaults(handler="observe:stats")

    p = command(
        "ls",
        "List stored blocks (each once, with the tiers holding it), a page at a time.",
        "Sorted by namespace then key. Shows --limit blocks; the daemon's page token for the next page is\n"
        "printed on stderr (human) or as next_page_token (--json). --all fetches every page.",
        "  ucm-admin ls\n  ucm-admin ls --namespace 3f2a...e1 --tier Posix --limit 50\n"
        "  ucm-admin ls --page-token 100\n  ucm-admin ls -q --all > keys.txt    # one key per line",
    )
    p.add_argument(
        "--namespace", metavar="HEX", type=namespace_hex, help="Only this namespace (32 hex digits)."
    )
    p.add_argument("--tier", metavar="NAME", help="Only blocks in this tier (e.g. Cache, Posix).")
    paging = p.add_mutually_exclusive_group()
    paging.add_argument(
        "--limit", metavar="N", type=page_size, default=100, help="Page size (default 100, at most 10000)."
    )
    paging.add_argument("--all", action="store_true", help="Follow the pages to the end.")
    p.add_argument("--page-token", metavar="TOKEN", help="Continue from a previous page's next_page_token.")
    p.set_defaults(handler="observe:ls")

    p = command(
        "inspect",
        "Show one block: size, tiers holding it, when it was stored, its checksum.",
        "Exit 1 when no tier has the block.",
        "  ucm-admin inspect 3f2a...e1/9c0d...77\n  ucm-admin --json inspect 3f2a...e1/9c0d...77 | jq .tiers",
    )
    p.add_argument("key", metavar="KEY", type=block_key, help="<namespace hex>/<key hex>")
    p.set_defaults(handler="observe:inspect")

    p = command(
        "delete",
        "Delete blocks from every tier.",
        "Keys are arguments, or '-' to read them from stdin one per line (what `ls -q` prints).\n"
        "Exit 1 if some of them were not stored, unless --missing-ok.",
        "  ucm-admin delete 3f2a...e1/9c0d...77\n"
        "  ucm-admin ls -q --namespace 3f2a...e1 --all | ucm-admin delete -",
    )
    p.add_argument("keys", metavar="KEY", nargs="+", help="<namespace hex>/<key hex>, or - for stdin")
    p.add_argument("--missing-ok", action="store_true", help="Exit 0 even if some keys were not stored.")
    p.set_defaults(handler="operate:delete")

    def retention_command(
        name: str, summary: str, description: str, examples: str
    ) -> argparse.ArgumentParser:
        """A retention command: its own arguments first (added by the caller), then KEY... and
        --missing-ok, handled by ``retain:<name>``."""
        sub = command(name, summary, description, examples)
        sub.set_defaults(handler=f"retain:{name}")
        return sub

    def keys_and_missing_ok(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("keys", metavar="KEY", nargs="+", help="<namespace hex>/<key hex>, or - for stdin")
        sub.add_argument(
            "--missing-ok", action="store_true", help="Exit 0 even if some keys were not stored."
        )

    p = retention_command(
        "pin",
        "Pin blocks: never evicted (by capacity or quota) until unpinned.",
        "A pin is held where the block durably lives (Posix; the Cache when nothing below holds\n"
        "pins): the Cache above Posix lets a pinned block go once it is safe on disk, after every\n"
        "unpinned one. Tiers that cannot hold a pin (shared tiers) are named on stderr, or the pin is\n"
        "refused with --require-all-tiers. Pinned bytes count against the owner's quota (pin_share\n"
        "of a tier without one), and pins leave pin_reserve of each tier unpinned, each tier counting\n"
        "the pins it must hold; a pin past either is refused.",
        "  ucm-admin pin 3f2a...e1/9c0d...77\n"
        "  ucm-admin ls -q --namespace 3f2a...e1 --all | ucm-admin pin --priority 10 -",
    )
    keys_and_missing_ok(p)
    p.add_argument(
        "--priority", metavar="N", type=priority_value, help="Also set the eviction priority (-100..100)."
    )
    p.add_argument("--require-all-tiers", action="store_true", help="Refuse where a tier cannot hold pins.")

    p = retention_command(
        "unpin", "Unpin blocks: evicted again like any other.", "", "  ucm-admin unpin 3f2a...e1/9c0d...77"
    )
    keys_and_missing_ok(p)

    p = retention_command(
        "ttl",
        "Expire blocks SECONDS from now (from every tier), or never again with 'never'.",
        "An expired block is deleted everywhere, pinned or not; Lookups never report it present.",
        "  ucm-admin ttl 3600 3f2a...e1/9c0d...77\n  ucm-admin ttl never 3f2a...e1/9c0d...77",
    )
    p.add_argument("seconds", metavar="SECONDS", type=ttl_seconds, help="Time to live, or 'never'.")
    keys_and_missing_ok(p)

    p = retention_command(
        "priority",
        "Set the eviction priority of blocks: lower goes first (-100..100, default 0).",
        "Within one priority, the least recently used block goes first; pinned blocks never go.",
        "  ucm-admin priority -- -20 3f2a...e1/9c0d...77   # evict before everything else",
    )
    p.add_argument("value", metavar="N", type=priority_value, help="The priority, -100..100.")
    keys_and_missing_ok(p)

    p = command(
        "evict",
        "Free space in one tier: named blocks, a number of bytes, or everything.",
        "Unlike delete, evict acts on one tier only: a block evicted from Cache stays in Posix and is\n"
        "promoted again on the next read. Give exactly one target. --all asks for confirmation on a\n"
        "terminal and needs --yes otherwise.",
        "  ucm-admin evict --tier Cache --bytes 2GiB        # by the tier's eviction policy\n"
        "  ucm-admin evict --tier Cache 3f2a...e1/9c0d...77\n"
        "  ucm-admin evict --tier Posix --all --namespace 3f2a...e1 --yes",
    )
    p.add_argument(
        "--tier", metavar="NAME", required=True, help="Tier to evict from (see `ucm-admin stats`)."
    )
    p.add_argument(
        "keys", metavar="KEY", nargs="*", help="Blocks to evict (<namespace hex>/<key hex>, - for stdin)."
    )
    p.add_argument("--bytes", metavar="SIZE", type=size, help="Free at least this much (e.g. 512MiB, 2G).")
    p.add_argument("--all", action="store_true", help="Evict every block of the tier (or of --namespace).")
    p.add_argument("--namespace", metavar="HEX", type=namespace_hex, help="With --all: only this namespace.")
    p.add_argument("-y", "--yes", action="store_true", help="Do not ask before --all.")
    p.set_defaults(handler="operate:evict")

    p = command(
        "verify",
        "Re-read blocks of the persistent tiers and check their checksums.",
        "A progress bar on a terminal (plain lines otherwise, on stderr), then a summary of corrupt blocks.\n"
        "Corrupt blocks are never served: the daemon moves them aside, so a read becomes a miss.\n"
        "Exit 1 if any block is corrupt.",
        "  ucm-admin verify\n  ucm-admin verify --tier Posix --namespace 3f2a...e1\n"
        "  ucm-admin --json verify | jq -r '.corrupt_blocks[].key'",
    )
    p.add_argument("--tier", metavar="NAME", help="Only this tier (default: every persistent tier).")
    p.add_argument("--namespace", metavar="HEX", type=namespace_hex, help="Only this namespace.")
    p.set_defaults(handler="operate:verify")

    p = command(
        "watch",
        "Live statistics, refreshed every --interval seconds, with read/write throughput.",
        "Redraws in place on a terminal; prints one table per sample otherwise; --json prints one\n"
        "document per line (JSON Lines). Ctrl-C stops it (exit 0).",
        "  ucm-admin watch\n  ucm-admin watch --interval 5 --count 12 --json >> stats.jsonl",
    )
    p.add_argument(
        "--interval",
        metavar="SECONDS",
        type=positive_float,
        default=2.0,
        help="Seconds between samples (default 2).",
    )
    p.add_argument(
        "--count", metavar="N", type=positive_int, help="Stop after N samples (default: until Ctrl-C)."
    )
    p.set_defaults(handler="observe:watch")

    p = command(
        "bench",
        "Quick dump/load throughput check through a SharedBuffer.",
        "Writes --blocks blocks of --block-size into a fresh namespace, reads them back, --rounds times,\n"
        "then deletes them. Must run on the daemon's host (it shares memory with it).",
        "  ucm-admin bench\n  ucm-admin bench --blocks 256 --block-size 2MiB --rounds 5 --durable",
    )
    p.add_argument(
        "--blocks", metavar="N", type=positive_int, default=64, help="Blocks per round (default 64)."
    )
    p.add_argument(
        "--block-size",
        metavar="SIZE",
        type=positive_size,
        default=1 << 20,
        help="Bytes per block (default 1MiB).",
    )
    p.add_argument(
        "--rounds", metavar="N", type=positive_int, default=3, help="Dump+load rounds (default 3)."
    )
    p.add_argument("--durable", action="store_true", help="Dumps wait until the blocks are on disk.")
    p.set_defaults(handler="diagnose:bench")

    p = command(
        "doctor",
        "Check the installation and the daemon: versions, socket, health, sparse patches.",
        "Runs every check and reports each; exit 1 if any failed (an unreachable daemon is a failed\n"
        "check here, not exit 3). Paste its output into bug reports.",
        "  ucm-admin doctor\n  ucm-admin --json doctor --skip-sparse | jq '.checks[] | select(.ok == false)'",
    )
    p.add_argument(
        "--skip-sparse", action="store_true", help="Skip the sparse patch report (it imports vLLM: seconds)."
    )
    p.set_defaults(handler="diagnose:doctor")
    return parser


def _version() -> str:
    from ucm_protocol import __version__

    return __version__


def _handler(spec: str) -> Handler:
    """Import the command's module only now: ``--help`` and other commands never pay for it."""
    import importlib

    module, _, name = spec.partition(":")
    fn: Handler = getattr(importlib.import_module(f"ucm_client.admin.{module}"), name)
    return fn


# -- entry point ------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see ``ExitCode``) instead of raising."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.json and args.quiet:  # one before the command, one after: argparse cannot see it
            parser.error("--json and --quiet cannot be used together")
    except SystemExit as exc:  # argparse: --help/--version exit 0, errors exit 2
        return int(exc.code) if isinstance(exc.code, int) else ExitCode.USAGE

    from ucm_client.admin.connection import Daemon, resolve_target
    from ucm_client.admin.output import Mode, Output

    mode = Mode.JSON if args.json else Mode.QUIET if args.quiet else Mode.HUMAN
    out = Output(mode)
    try:
        target = resolve_target(args.socket, args.target, args.config)
    except ValueError as exc:  # ConfigError: the config file is missing or wrong
        out.error(str(exc), exit_code=ExitCode.USAGE, label="usage")
        return ExitCode.USAGE
    daemon = Daemon(target, args.timeout)
    try:
        return int(_handler(args.handler)(args, daemon, out))
    except BrokenPipeError:  # `ucm-admin ls | head`: the reader left, which is not our failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return ExitCode.OK
    except (Exception, KeyboardInterrupt) as exc:
        failure = classify(exc)
        if failure is None:
            if os.environ.get("UCM_ADMIN_DEBUG"):
                traceback.print_exc()
            message = (
                f"unexpected {type(exc).__name__}: {exc} (a bug in ucm-admin; UCM_ADMIN_DEBUG=1 shows where)"
            )
            out.error(message, exit_code=ExitCode.FAILED, label="internal")
            return ExitCode.FAILED
        out.error(failure.message, exit_code=failure.exit_code, label=failure.label)
        return failure.exit_code
    finally:
        daemon.close()
