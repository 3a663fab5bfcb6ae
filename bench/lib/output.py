"""How the benchmark scripts print."""

from __future__ import annotations

import io
import sys


def line_buffered_stdout() -> None:
    """Flush every line, so a long run's progress shows in a pipe or a log as it happens."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
