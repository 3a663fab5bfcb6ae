"""Choices measured at load, made once per machine kind and cached under ``SLOTSERVE_HOME``,
in a way one busy start cannot poison.

A choice timed at start-up on a busy CPU is a coin toss: the three demo engines load together on
2 cores, and one of them once measured aten 12.3 ms against oneDNN 12.7 ms where its siblings
measured 6.4 against 2.1; an engine started next to two busy processes measured the native
products 4.65x slower than aten (0.34x on a quiet machine), cached "never native", and every
later engine on that home decoded at half speed. So:

- **No single measurement decides.** Each trial interleaves the candidates round by round; a
  choice is taken when two trials agree and neither waited for a CPU more than
  :data:`BUSY_WAIT_FRACTION` of its time (the threads' run-queue wait, from the kernel's
  schedstat). Otherwise the caller's **rule** (from CPU features) decides.
- **A result that contradicts the rule by a wide margin is measured again** (two more trials
  that must agree with it, on a CPU of their own) and is never cached on the strength of one.
- A rule taken because the measurement could not be trusted is cached as *provisional*:
  engines starting within :data:`PROVISIONAL_RETRY_SECONDS` read it (so they agree, and their
  CPUs are as busy), later starts measure again (up to :data:`PROVISIONAL_ATTEMPTS` times), so
  one busy start does not fix the choice forever.
- Decisions are keyed by what they depend on (the CPU model and flags, the machine, torch's
  version, and the question's own fields: shapes, dtype, threads) and stored in
  ``<home>/calibration/<name>-<hash>.json``. The first engine to need one decides while holding
  an exclusive lock on that key; engines that start meanwhile wait and read its answer, so every
  engine of a pool on one node chooses the same. Delete the folder to measure anew. A home that
  cannot be written costs the cache, never the start.
- A cached decision that the engine's own steady-state steps contradict is dropped
  (:meth:`CalibrationCache.drop`) and taken again (``native_linear.NativeRowsWatch``).

Every decision is reported (:class:`CalibrationRecord`): what was chosen, whether it was
measured, read, or taken by the rule, and the seconds it cost at load.
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

# "built": made at load rather than chosen (the native kernels compiled, weights quantized);
# "rule": the CPU-feature rule decided (the measurements disagreed, waited for a CPU, or
# contradicted the rule without being confirmed).
CalibrationSource = Literal["measured", "cached", "built", "rule"]

# A trial whose threads spent more than this share of their time waiting for a CPU (runnable,
# not running) measured the neighbours as much as the candidates.
BUSY_WAIT_FRACTION = 0.25
# Trials that must agree before a measured choice is taken; as many again to confirm a choice
# that contradicts the rule.
AGREEING_TRIALS = 2
# Starts that measure again after a rule was taken for want of a trustworthy measurement, and
# how long after it (engines starting together read it: their CPUs are as busy as its was).
PROVISIONAL_ATTEMPTS = 3
PROVISIONAL_RETRY_SECONDS = 600.0


@dataclass(frozen=True)
class Measurement:
    """What one trial chose, with its figures; ``cacheable`` is False when it could not
    measure (an error): the next start tries again. ``busy``: the share of the trial's thread
    time spent waiting for a CPU (None: unknown)."""

    choice: str
    figures: dict[str, float] = field(default_factory=dict)
    cacheable: bool = True
    busy: float | None = None

    @property
    def quiet(self) -> bool:
        return self.busy is None or self.busy <= BUSY_WAIT_FRACTION


@dataclass(frozen=True)
class Rule:
    """What CPU features say the choice should be, and which measured choices contradict it
    by a wide margin (those are measured again before they are believed)."""

    choice: str
    why: str
    contradicted_by: Callable[[str], bool] = lambda _choice: False


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


class RunQueueWait:
    """The share of this process's thread time spent runnable but waiting for a CPU, over a
    ``with`` block (Linux schedstat; ``fraction`` None where the kernel does not keep it)."""

    def __enter__(self) -> RunQueueWait:
        self.fraction: float | None = None
        self._start = _schedstat()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _schedstat()
        if self._start is None or end is None:
            return
        ran, waited = end[0] - self._start[0], end[1] - self._start[1]
        if ran + waited > 0:
            self.fraction = max(0.0, waited / (ran + waited))


def _schedstat() -> tuple[int, int] | None:
    """Nanoseconds run and waited on a run queue, summed over this process's threads."""
    ran = waited = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            fields = Path(f"/proc/self/task/{task}/schedstat").read_text().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return ran, waited


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
        self,
        name: str,
        question: Mapping[str, object],
        measure: Callable[[], Measurement],
        rule: Rule | None = None,
    ) -> CalibrationRecord:
        """The cached decision for ``name`` and ``question``, or one taken now from repeated
        trials of ``measure()`` and the ``rule`` (see the module doc), then cached."""
        start = time.perf_counter()
        key = self._key(name, question)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = open(self.folder / f"{key}.lock", "a")  # noqa: SIM115 (held across the measure)
        except OSError as error:
            logger.warning("calibration cache %s unusable (%s): measuring", self.folder, error)
            decision = settle(name, measure, rule)
            return decision.record(name, time.perf_counter() - start)
        with lock:
            # Engines starting together wait here while the first one measures.
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.folder / f"{key}.json"
            cached = _read(path, name)
            attempts = 0
            if cached is not None:
                if not cached.provisional or not cached.retry_now():
                    return CalibrationRecord(
                        name, cached.choice, "cached", time.perf_counter() - start, cached.figures
                    )
                attempts = cached.attempts  # a rule taken on a busy start: measure again
            decision = settle(name, measure, rule)
            if decision.cacheable:
                _write(path, name, self.identity, question, decision, attempts + 1)
            return decision.record(name, time.perf_counter() - start)

    def path(self, name: str, question: Mapping[str, object]) -> Path:
        return self.folder / f"{self._key(name, question)}.json"

    def read(self, name: str, question: Mapping[str, object]) -> str | None:
        """The choice cached for ``name`` and ``question`` now (another engine may have
        re-taken it since this one started), or None."""
        cached = _read(self.path(name, question), name)
        return None if cached is None else cached.choice

    def drop(self, name: str, question: Mapping[str, object], why: str) -> None:
        """Forget a cached decision that the engine's own steps contradicted."""
        path = self.path(name, question)
        logger.warning("calibration %s: dropping %s (%s)", name, path, why)
        try:
            with open(self.folder / f"{path.stem}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("calibration %s: cannot drop %s (%s)", name, path, error)


@dataclass(frozen=True)
class Decision:
    choice: str
    source: CalibrationSource
    figures: dict[str, float]
    cacheable: bool
    provisional: bool  # a rule taken for want of a trustworthy measurement

    def record(self, name: str, seconds: float) -> CalibrationRecord:
        return CalibrationRecord(name, self.choice, self.source, seconds, self.figures)


def settle(name: str, measure: Callable[[], Measurement], rule: Rule | None) -> Decision:
    """A choice from trials of ``measure`` that agree on a quiet CPU, else ``rule``'s; one
    that contradicts the rule widely must be confirmed by as many trials again."""
    trials: list[Measurement] = []

    def agreeing(count: int) -> Measurement | None:
        for _ in range(count):
            trial = measure()
            trials.append(trial)
            if not trial.cacheable:
                return None
            if not trial.quiet or trial.choice != trials[0].choice:
                return None
        return trials[0]

    agreed = agreeing(AGREEING_TRIALS)
    figures = _trial_figures(trials)
    if agreed is not None and (rule is None or not rule.contradicted_by(agreed.choice)):
        return Decision(agreed.choice, "measured", figures, True, False)
    if agreed is not None and rule is not None:
        logger.warning(
            "calibration %s: trials chose %s against the rule's %s (%s); measuring again",
            name,
            agreed.choice,
            rule.choice,
            rule.why,
        )
        confirmed = agreeing(AGREEING_TRIALS)
        figures = _trial_figures(trials)
        if confirmed is not None and confirmed.choice == agreed.choice:
            return Decision(agreed.choice, "measured", figures, True, False)
    failed = any(not trial.cacheable for trial in trials)
    if rule is None:
        # Nothing to fall back on: the last trial's choice for this start, cached by none.
        return Decision(trials[-1].choice, "measured", figures, False, False)
    logger.warning(
        "calibration %s: %s; taking the rule's %s (%s)",
        name,
        _why_not_measured(trials),
        rule.choice,
        rule.why,
    )
    return Decision(rule.choice, "rule", figures, not failed, True)


def _why_not_measured(trials: list[Measurement]) -> str:
    if any(not trial.cacheable for trial in trials):
        return "a trial could not measure"
    busy = [trial.busy for trial in trials if not trial.quiet]
    if busy:
        return f"a trial waited for a CPU {max(b or 0.0 for b in busy):.0%} of its time"
    return "trials disagreed (" + ", ".join(trial.choice for trial in trials) + ")"


def _trial_figures(trials: list[Measurement]) -> dict[str, float]:
    """The first trial's figures, with how many trials ran and the busiest one's wait."""
    figures = dict(trials[0].figures) if trials else {}
    figures["trials"] = float(len(trials))
    waits = [trial.busy for trial in trials if trial.busy is not None]
    if waits:
        figures["cpu_wait_max"] = round(max(waits), 3)
    return figures


@dataclass(frozen=True)
class _Cached:
    choice: str
    figures: dict[str, float]
    provisional: bool
    attempts: int
    decided_at: float

    def retry_now(self) -> bool:
        return (
            self.attempts < PROVISIONAL_ATTEMPTS
            and time.time() - self.decided_at >= PROVISIONAL_RETRY_SECONDS
        )


def _read(path: Path, name: str) -> _Cached | None:
    try:
        data = json.loads(path.read_text())
        return _Cached(
            str(data["choice"]),
            {k: float(v) for k, v in data.get("figures", {}).items()},
            bool(data.get("provisional", False)),
            int(data.get("attempts", 1)),
            float(data.get("decided_at", 0.0)),
        )
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
    decision: Decision,
    attempts: int,
) -> None:
    record = {
        "name": name,
        "choice": decision.choice,
        "source": decision.source,
        "provisional": decision.provisional,
        "attempts": attempts,
        "figures": decision.figures,
        "identity": dict(identity),
        "question": dict(question),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "decided_at": time.time(),
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except OSError as error:
        logger.warning("calibration %s: cannot write %s (%s)", name, path, error)
