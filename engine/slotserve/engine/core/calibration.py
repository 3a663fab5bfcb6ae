"""Choices measured at load, made once per machine kind and cached under ``SLOTSERVE_HOME``.

A choice timed at start-up on a busy CPU is a coin toss: the three demo engines load together on
2 cores, and one of them once measured aten 12.3 ms against oneDNN 12.7 ms where its siblings
measured 6.4 against 2.1. So a decision is keyed by what it depends on (the CPU model and flags,
the machine, torch's version, and the question's own fields: shapes, dtype, threads) and stored
in ``<home>/calibration/<name>-<hash>.json``. The first engine to need it measures while holding
an exclusive lock on that key; engines that start meanwhile wait on the lock and read its
answer, so every engine of a pool on one node (and every later start) chooses the same. A
different CPU or torch build has another key and measures again. Delete the folder to measure
anew. A home that cannot be written (a read-only image) costs the cache, never the start.

Every decision is reported (:class:`CalibrationRecord`): what was chosen, whether it was
measured or read, and the seconds it cost at load.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

# "built": made at load rather than chosen (the native kernels compiled, weights quantized).
CalibrationSource = Literal["measured", "cached", "built"]


@dataclass(frozen=True)
class Measurement:
    """What a measurement chose, with its figures; ``cacheable`` is False when it could not
    measure (an error): the next start tries again."""

    choice: str
    figures: dict[str, float] = field(default_factory=dict)
    cacheable: bool = True


@dataclass(frozen=True)
class CalibrationRecord:
    """One choice made at load, for the log, ``/load`` and metrics."""

    name: str
    choice: str
    source: CalibrationSource
    seconds: float  # spent at load on this choice: measuring, or waiting for and reading it
    figures: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "choice": self.choice,
            "source": self.source,
            "seconds": round(self.seconds, 4),
            "figures": self.figures,
        }


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """What a CPU-speed decision depends on besides the question: CPU model, flags, machine,
    torch version."""
    import torch

    model = flags = ""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass  # not Linux: the model from platform only
    return {
        "cpu_model": model or platform.processor() or "unknown",
        "cpu_flags": flags,
        "machine": platform.machine(),
        "torch": torch.__version__,
    }


class CalibrationCache:
    """Decisions on disk, one file per (name, identity, question), written under a lock."""

    def __init__(self, folder: Path, identity: Mapping[str, str] | None = None) -> None:
        self.folder = folder
        self.identity = dict(identity) if identity is not None else cpu_identity()

    def _key(self, name: str, question: Mapping[str, object]) -> str:
        text = json.dumps({"identity": self.identity, "question": question}, sort_keys=True)
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def decide(
        self, name: str, question: Mapping[str, object], measure: Callable[[], Measurement]
    ) -> CalibrationRecord:
        """The cached decision for ``name`` and ``question``, or ``measure()``'s, then cached."""
        start = time.perf_counter()
        key = self._key(name, question)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = open(self.folder / f"{key}.lock", "a")  # noqa: SIM115 (held across the measure)
        except OSError as error:
            logger.warning("calibration cache %s unusable (%s): measuring", self.folder, error)
            return _measured(name, measure, start)
        with lock:
            # Engines starting together wait here while the first one measures.
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.folder / f"{key}.json"
            cached = _read(path, name)
            if cached is not None:
                choice, figures = cached
                return CalibrationRecord(
                    name, choice, "cached", time.perf_counter() - start, figures
                )
            measurement = measure()
            if measurement.cacheable:
                _write(path, name, self.identity, question, measurement)
            return CalibrationRecord(
                name,
                measurement.choice,
                "measured",
                time.perf_counter() - start,
                measurement.figures,
            )


def _measured(name: str, measure: Callable[[], Measurement], start: float) -> CalibrationRecord:
    measurement = measure()
    return CalibrationRecord(
        name, measurement.choice, "measured", time.perf_counter() - start, measurement.figures
    )


def _read(path: Path, name: str) -> tuple[str, dict[str, float]] | None:
    try:
        data = json.loads(path.read_text())
        return str(data["choice"]), {k: float(v) for k, v in data.get("figures", {}).items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("calibration %s: unreadable %s (%s); measuring again", name, path, error)
        return None


def _write(
    path: Path,
    name: str,
    identity: Mapping[str, str],
    question: Mapping[str, object],
    measurement: Measurement,
) -> None:
    record = {
        "name": name,
        "choice": measurement.choice,
        "figures": measurement.figures,
        "identity": dict(identity),
        "question": dict(question),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except OSError as error:
        logger.warning("calibration %s: cannot write %s (%s)", name, path, error)
