"""Check that every relative link in README.md and docs/*.md leads somewhere: a file or folder of this
repository, and, with ``#anchor``, a heading of that Markdown file (GitHub's anchor rules).

Links to other sites are not fetched. ``python scripts/check_doc_links.py [FILE ...]`` prints each
broken link as ``file:line: target (why)`` and exits 1 if there is one; ``tests/test_generated.py``
runs it, so a heading renamed or a page moved cannot leave a link dangling.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NOT_IN_ANCHOR = re.compile(r"[^\w\- ]", re.UNICODE)


def default_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text_lines(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return NOT_IN_ANCHOR.sub("", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of ``path`` (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _text_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: target (why)`` for each link of ``path`` that leads nowhere inside ``root``."""
    problems = []
    for number, line in _text_lines(path):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # another site (https:, mailto:)
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif root not in dest.parents and dest != root:
                problems.append(f"{where} (outside the repository)")
            elif anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where} (an anchor into a file that is not Markdown)")
                elif anchor not in anchors(dest):
                    problems.append(f"{where} (no heading with that anchor)")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    args = p.parse_args()
    files = [f.resolve() for f in args.files] or default_files()
    problems = [problem for f in files for problem in broken_links(f)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
