"""TEST HOOK: a real daemon process whose spans land in a file the test reads, instead of a collector.

``python -m ucm_server.testing.trace_capture SPANS_FILE [ucm-server arguments...]`` runs
``ucm-server`` exactly as ``python -m ucm_server`` does, except that its tracer exports every span,
as it ends, as one JSON line of ``SPANS_FILE`` (through
:func:`ucm_server.tracing.replace_exporter_for_tests`). Tracing must still be turned on by the
daemon's own settings (``--tracing-exporter otlp``): only where the spans go is replaced, so what is
tested is what an operator runs. :class:`TracedDaemonProcess` starts such a daemon for a test and
reads its spans back (:meth:`TracedDaemonProcess.spans`), waiting for the ones it expects.

A span as written: ``name``, ``trace_id`` and ``span_id`` (hex), ``parent_id`` (hex or None),
``kind`` (``SERVER``...), ``attributes``, ``status`` (``UNSET``/``OK``/``ERROR``), ``start_ns``,
``end_ns``, ``resource`` (its attributes: ``service.name``...) and ``links`` (span ids).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ucm_server.testing.daemon import DaemonProcess

__all__ = ["JsonLinesSpanExporter", "TracedDaemonProcess", "read_spans", "span_record"]


def span_record(span: Any) -> dict[str, Any]:
    """One finished SDK span (``ReadableSpan``) as plain JSON-able data."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "resource": dict(span.resource.attributes),
        "links": [f"{link.context.span_id:016x}" for link in span.links],
    }


class JsonLinesSpanExporter:
    """An SDK ``SpanExporter`` appending each span to a file as one JSON line (flushed at once)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            for span in spans:
                self._file.write(json.dumps(span_record(span)) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans written to ``path`` so far (a line still being written is skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class TracedDaemonProcess(DaemonProcess):
    """A :class:`DaemonProcess` started through this module: its spans go to ``spans_path``.

    Pass the tracing settings in ``args`` as for any daemon (``--tracing-exporter otlp``)."""

    def __init__(self, workdir: Path, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.spans_path = self.workdir / "daemon-spans.jsonl"

    def command(self) -> list[str]:
        plain = super().command()
        assert plain[1:3] == ["-m", "ucm_server"], plain
        return [plain[0], "-m", "ucm_server.testing.trace_capture", str(self.spans_path), *plain[3:]]

    def spans(
        self, until: Callable[[list[dict[str, Any]]], bool] | None = None, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        """The daemon's spans so far; with ``until``, waited for until it holds (a task's span is
        written when the task ends, which may be just after its client saw the result)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = read_spans(self.spans_path)
            if until is None or until(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(
            "usage: python -m ucm_server.testing.trace_capture SPANS_FILE [ucm-server args...]",
            file=sys.stderr,
        )
        return 2
    from ucm_server import cli, tracing

    tracing.replace_exporter_for_tests(JsonLinesSpanExporter(Path(args[0])), batch=False)
    return cli.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
