"""Exit codes and the one table that turns any failure into a message and an exit code.

Scripts branch on ``ucm-admin``'s exit status, so the codes are a contract: they are listed in
``--help`` and in ``docs/cli.md``, and every exception a command can raise is classified here, in one
place, instead of ``sys.exit`` calls scattered through the commands.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ucm_protocol.errors import DeadlineExceeded, NotFound, UcmError, Unavailable


class ExitCode(enum.IntEnum):
    """What the process exit status means; stable across releases (see :data:`EXIT_CODE_MEANINGS`)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    DAEMON_ERROR = 4
    INTERRUPTED = 130


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "operation failed: corrupt blocks, block not found, not SERVING, aborted (or a crash)",
    ExitCode.USAGE: "usage error: bad option, malformed key or size (nothing was sent to the daemon)",
    ExitCode.UNREACHABLE: "daemon not reachable: not running, wrong --socket/--target, no answer in time",
    ExitCode.DAEMON_ERROR: "the daemon reported an error (invalid argument, unknown tier, internal error)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}
"""The one description of each code: ``--help`` epilogs and docs/cli.md are built from it."""

EXIT_CODES_HELP = "exit codes:\n" + "\n".join(f"  {c.value:<4} {m}" for c, m in EXIT_CODE_MEANINGS.items())


class CliError(Exception):
    """An error the CLI raises itself; :data:`ERROR_TABLE` gives each subclass its exit code."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(CliError, ValueError):
    """The arguments cannot be acted on (found after parsing, e.g. a bad key read from stdin)."""


class OperationFailed(CliError):
    """The command ran and its answer is a failure (verify found corrupt blocks, say)."""


class DaemonUnreachable(CliError, ConnectionError):
    """Nothing answered at the target: the message says where we looked and how to start one."""


@dataclass(frozen=True, slots=True)
class ErrorRule:
    """One row of the table: exceptions of ``kind`` exit with ``exit_code`` and this ``label``."""

    kind: type[BaseException]
    exit_code: ExitCode
    label: str
    message: Callable[[BaseException], str] = str


def _timeout_message(exc: BaseException) -> str:
    return f"the daemon did not answer in time ({exc}); raise --timeout if it is busy"


def _not_reachable_message(exc: BaseException) -> str:
    return f"daemon not reachable: {exc}"


# Order matters: the first matching row wins, so specific classes come before their bases.
ERROR_TABLE: tuple[ErrorRule, ...] = (
    ErrorRule(KeyboardInterrupt, ExitCode.INTERRUPTED, "interrupted", lambda e: "interrupted"),
    ErrorRule(UsageError, ExitCode.USAGE, "usage"),
    ErrorRule(DaemonUnreachable, ExitCode.UNREACHABLE, "unreachable"),
    ErrorRule(OperationFailed, ExitCode.FAILED, "failed"),
    ErrorRule(NotFound, ExitCode.FAILED, "not_found"),
    ErrorRule(DeadlineExceeded, ExitCode.UNREACHABLE, "timeout", _timeout_message),
    ErrorRule(Unavailable, ExitCode.UNREACHABLE, "unreachable", _not_reachable_message),
    ErrorRule(UcmError, ExitCode.DAEMON_ERROR, "daemon_error"),
)


@dataclass(frozen=True, slots=True)
class Failure:
    """How one exception is reported: exit code, a machine-readable label, a one-line message."""

    exit_code: ExitCode
    label: str
    message: str


def classify(exc: BaseException) -> Failure | None:
    """The :class:`Failure` for ``exc``, or None for an unexpected exception (a bug in ``ucm-admin``)."""
    for rule in ERROR_TABLE:
        if isinstance(exc, rule.kind):
            return Failure(rule.exit_code, rule.label, rule.message(exc))
    return None
