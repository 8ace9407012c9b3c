"""Write the configuration reference into docs/configuration.md from the settings (``ucm_server.config``).

The table sits between ``<!-- config-reference:begin -->`` and ``<!-- config-reference:end -->``;
``--check`` fails when it is stale (a test runs that), so the reference never drifts from the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ucm_server.config import FIELDS  # noqa: E402

TARGET = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _default(name: str) -> str:
    f = FIELDS[name]
    if name == "socket":
        return "`$XDG_RUNTIME_DIR/ucm/ucm.sock`, else `/tmp/ucm-<uid>/ucm.sock`"
    if name == "data_dir":
        return "`$XDG_STATE_HOME/ucm`, else `~/.local/state/ucm`"
    value = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
    if f.metadata.get("size") and isinstance(value, int) and value:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value % (1 << shift) == 0:
                return f"`{value >> shift}{unit}`"
    return f"`{value!r}`" if value not in ("", {}) else "(empty)"


def render() -> str:
    lines = [
        BEGIN,
        "| key (YAML) | flag | environment | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, f in FIELDS.items():
        flag = "—" if name == "tier_settings" else f"`--{name.replace('_', '-')}`"
        env = f"`UCM_{name.upper()}`"
        help_ = f.metadata.get("help", "").replace("|", "\\|")
        lines.append(f"| `{name}` | {flag} | {env} | {_default(name)} | {help_} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    name = TARGET.relative_to(ROOT)
    text = TARGET.read_text()
    if BEGIN not in text or END not in text:
        print(f"{name} has no {BEGIN} … {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + render() + tail
    if args.check:
        if new != text:
            print(
                f"{name}: the configuration reference is stale; run `python scripts/gen_config_docs.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    TARGET.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
