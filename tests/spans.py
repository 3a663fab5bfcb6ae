"""Reading finished OpenTelemetry spans in tests (the engine's and the gateway's tracing tests):
an in-memory provider, and a finished span's attributes and times, asserted present."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def in_memory_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def attributes(span: ReadableSpan) -> Mapping[str, Any]:
    assert span.attributes is not None  # finished spans carry theirs
    return span.attributes


def started_at(span: ReadableSpan) -> int:
    assert span.start_time is not None
    return span.start_time


def ended_at(span: ReadableSpan) -> int:
    assert span.end_time is not None  # finished
    return span.end_time
