"""Generated artifacts are not stale (the gRPC stubs match proto/, docs/configuration.md the settings), and
the documentation's relative links all lead somewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_doc_links  # noqa: E402


def test_grpc_stubs_are_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_configuration_reference_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_relative_link_in_the_docs_resolves() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_doc_links.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_link_check_finds_a_missing_file_a_missing_heading_and_an_escape(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "elsewhere.md").write_text("# Elsewhere\n")
    (repo / "other.md").write_text("# Other page\n\n## Sizing: the `Cache`\n\n## Sizing: the `Cache`\n")
    page = repo / "page.md"
    page.write_text(
        "[ok](other.md#sizing-the-cache) [ok twice](other.md#sizing-the-cache-1) [ok here](#page)\n"
        "# Page\n"
        "[gone](missing.md) [no heading](other.md#sizing) [out](../elsewhere.md) [web](https://example.com/x)\n"
        "```\n[inside a code block](missing.md)\n```\n"
        "`[inside code](missing.md)`\n"
    )
    problems = check_doc_links.broken_links(page, root=repo)
    assert problems == [
        "page.md:3: missing.md (no such file)",
        "page.md:3: other.md#sizing (no heading with that anchor)",
        "page.md:3: ../elsewhere.md (outside the repository)",
    ], problems
