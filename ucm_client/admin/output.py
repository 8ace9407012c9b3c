"""The one output object every command writes through: human, json or quiet.

Data goes to stdout, diagnostics (progress, hints, errors) to stderr, so ``ucm-admin ... --json | jq``
and ``ucm-admin ls -q | ucm-admin delete -`` always see clean data. Commands never ``print``; they hand
this object a JSON-able value plus, optionally, a human renderer and the lines ``--quiet`` keeps.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any, Protocol

from rich.console import Console, RenderableType

from ucm_protocol.text import printable

Json = Any  # what json.dumps accepts; kept loose on purpose (nested dicts of scalars)

# Wide enough that a full block key (97 characters) never folds when stdout is a file or a pipe.
PIPE_WIDTH = 200


class Mode(enum.Enum):
    HUMAN = "human"
    JSON = "json"
    QUIET = "quiet"


class ProgressSink(Protocol):
    """What :meth:`Output.progress` yields: report ``completed`` of ``total`` work items."""

    def update(self, completed: int, total: int, note: str = "") -> None: ...


class Output:
    """Renders results for one mode; holds the stdout and stderr consoles."""

    def __init__(self, mode: Mode, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self.mode = mode
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self.console = _console(self._out)
        self.err_console = _console(self._err)
        self.emitted = False
        """A result is on stdout already; an error after it must not add a second JSON document."""

    # -- data (stdout) --------------------------------------------------------------------------------
    def result(
        self,
        data: Json,
        human: Callable[[Console], None] | None = None,
        quiet: Iterable[str] = (),
    ) -> None:
        """The command's answer: ``data`` as one JSON document, or ``human`` rendered, or ``quiet`` lines."""
        self.emitted = True
        if self.mode is Mode.JSON:
            self._out.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
        elif self.mode is Mode.HUMAN:
            if human is not None:
                human(self.console)
            else:
                self.console.print_json(data=data)
        else:
            for line in quiet:
                self._out.write(line + "\n")
        self._out.flush()

    def record(self, data: Json) -> None:
        """One document of a stream (``watch --json``): JSON Lines, one compact document per line."""
        self.emitted = True
        self._out.write(json.dumps(data, separators=(",", ":")) + "\n")
        self._out.flush()

    # -- diagnostics (stderr) -------------------------------------------------------------------------
    def info(self, message: str) -> None:
        """A hint or a note for a person; silent with ``--quiet`` and ``--json``."""
        if self.mode is Mode.HUMAN:
            self.err_console.print(message, highlight=False)

    def warn(self, message: str) -> None:
        """Something the user should know even when scripting (not with ``--quiet``)."""
        if self.mode is not Mode.QUIET:
            self.err_console.print(f"[yellow]warning:[/] {message}", highlight=False)

    def error(self, message: str, *, exit_code: int, label: str) -> None:
        """Report a failure: always on stderr; with ``--json`` also on stdout unless a result is there."""
        if message:
            shown = printable(message, 4096, backslashes=False)  # may echo a client's text
            # one line however long (soft_wrap): a script greps it, a log keeps it as one record
            self.err_console.print(f"[bold red]error:[/] {_escape(shown)}", highlight=False, soft_wrap=True)
        if self.mode is Mode.JSON and not self.emitted:
            self.result({"error": {"type": label, "message": message, "exit_code": exit_code}})

    def confirm(self, question: str) -> bool:
        """Ask on the terminal; the caller decides what a non-terminal means (see ``evict --all``)."""
        self.err_console.print(f"{question} [y/N] ", end="", highlight=False, markup=False)
        line = sys.stdin.readline()
        if not line:  # end of input: finish the prompt's line before any message
            self.err_console.print()
        return line.strip().lower() in {"y", "yes"}

    @property
    def interactive(self) -> bool:
        """Stderr is a terminal and we are in human mode: progress bars and live views make sense."""
        return self.mode is Mode.HUMAN and self.err_console.is_terminal

    @contextmanager
    def progress(self, description: str) -> Iterator[ProgressSink]:
        """A rich progress bar on a terminal; otherwise a plain line every second (none when quiet/json)."""
        if self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
                console=self.err_console,
                transient=True,
            ) as bar:
                task = bar.add_task(description, total=None, note="")
                yield _RichSink(bar, task)
        elif self.mode is Mode.HUMAN:
            yield _LineSink(self._err, description)
        else:
            yield _NullSink()

    @contextmanager
    def live(self) -> Iterator[Callable[[RenderableType], None]]:
        """A screen region redrawn in place (``watch`` on a terminal); elsewhere each frame is printed."""
        if self.mode is Mode.HUMAN and self.console.is_terminal:
            from rich.live import Live

            with Live(console=self.console, auto_refresh=False, screen=False) as live:
                yield lambda r: live.update(r, refresh=True)
        else:
            yield self.console.print


class _RichSink:
    def __init__(self, bar: Any, task: Any) -> None:
        self._bar, self._task = bar, task

    def update(self, completed: int, total: int, note: str = "") -> None:
        self._bar.update(self._task, completed=completed, total=total or None, note=note)


class _LineSink:
    """Plain progress lines for logs: at most one a second, plus the final one."""

    def __init__(self, stream: IO[str], description: str) -> None:
        self._stream, self._description = stream, description
        self._last = 0.0
        self._shown: tuple[int, int] | None = None

    def update(self, completed: int, total: int, note: str = "") -> None:
        now = time.monotonic()
        if (completed < total and now - self._last < 1.0) or self._shown == (completed, total):
            return
        self._last, self._shown = now, (completed, total)
        extra = f" ({note})" if note else ""
        self._stream.write(f"{self._description}: {completed}/{total}{extra}\n")
        self._stream.flush()


class _NullSink:
    def update(self, completed: int, total: int, note: str = "") -> None:
        pass


def _console(stream: IO[str]) -> Console:
    width = None if stream.isatty() or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(file=stream, width=width, soft_wrap=False, highlight=False)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
