"""Pure status computation: a pool's status from what the operator knows of its children.

The handlers keep small views of pods and Deployments in kopf indexes (fed by watches) and call
``compute_status``; nothing here talks to the API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from slotserve.operator.builders import ENGINE_PORT, selector_string
from slotserve.operator.cold_start import ready_after_seconds

# Container waiting reasons that will not fix themselves: the pool is degraded.
STUCK_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
# The engine's exit status when its settings cannot run on this machine (``--device cuda`` and
# no usable GPU, a quantization the device lacks): restarting will not help.
ENGINE_CANNOT_START_EXIT = 2
# Longest piece of an engine's termination message that a condition repeats.
MAX_TERMINATION_LINE = 512


def termination_line(message: str) -> str:
    """The line of a termination message (the log tail, policy FallbackToLogsOnError) that says
    why: the engine's last "cannot start" line, else the last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if "cannot start" in line), None)
    return (why or (lines[-1] if lines else ""))[:MAX_TERMINATION_LINE]


def _stuck(container: Mapping[str, Any]) -> tuple[str, str]:
    """(reason, message) when this container will not come up by itself; ("", "") otherwise."""
    state = container.get("state") or {}
    terminated = state.get("terminated") or (container.get("lastState") or {}).get("terminated")
    terminated = terminated or {}
    why = termination_line(terminated.get("message") or "")
    exit_code = terminated.get("exitCode")
    if exit_code == ENGINE_CANNOT_START_EXIT and not container.get("ready"):
        return "EngineCannotStart", f"the engine exited {exit_code}: {why}".rstrip(": ")
    waiting = state.get("waiting") or {}
    if waiting.get("reason") not in STUCK_REASONS:
        return "", ""
    message = waiting.get("message", "")
    if exit_code and why:
        message = f"{message}; last exit {exit_code}: {why}".lstrip("; ")
    return waiting["reason"], message


@dataclass(frozen=True)
class PodView:
    """What status needs of one engine pod."""

    name: str
    ip: str
    ready: bool
    terminating: bool
    finished: bool
    stuck_reason: str = ""
    stuck_message: str = ""
    unschedulable_message: str = ""
    ready_after_s: float | None = None  # creation -> Ready (cold_start.py); None: not Ready

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PodView:
        """Read a Pod object (dict or kopf body)."""
        metadata, status = body.get("metadata", {}), body.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = conditions.get("Ready", {}).get("status") == "True"
        scheduled = conditions.get("PodScheduled", {})
        unschedulable = scheduled.get("status") == "False" and (
            scheduled.get("reason") == "Unschedulable"
        )
        stuck_reason, stuck_message = next(
            (stuck for c in status.get("containerStatuses") or [] if (stuck := _stuck(c))[0]),
            ("", ""),
        )
        return cls(
            name=metadata.get("name", ""),
            ip=status.get("podIP") or "",
            ready=ready,
            terminating=bool(metadata.get("deletionTimestamp")),
            finished=status.get("phase") in {"Succeeded", "Failed"},
            stuck_reason=stuck_reason,
            stuck_message=stuck_message,
            unschedulable_message=scheduled.get("message", "") if unschedulable else "",
            ready_after_s=ready_after_seconds(body),
        )

    @property
    def alive(self) -> bool:
        return not (self.terminating or self.finished)

    @property
    def serving(self) -> bool:
        return self.alive and self.ready and bool(self.ip)


@dataclass(frozen=True)
class DeploymentView:
    """What status needs of the engine Deployment."""

    generation: int
    observed_generation: int
    updated_replicas: int
    deadline_exceeded: bool

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> DeploymentView:
        """Read a Deployment object (dict or kopf body)."""
        status = body.get("status") or {}
        progressing = {c.get("type"): c for c in status.get("conditions") or []}.get(
            "Progressing", {}
        )
        return cls(
            generation=int(body.get("metadata", {}).get("generation", 0)),
            observed_generation=int(status.get("observedGeneration", 0)),
            updated_replicas=int(status.get("updatedReplicas", 0)),
            deadline_exceeded=progressing.get("reason") == "ProgressDeadlineExceeded",
        )


@dataclass(frozen=True)
class Problem:
    """Why the operator could not reconcile a pool (reason is CamelCase, for conditions)."""

    reason: str
    message: str


def _condition(
    previous: Mapping[str, Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
) -> dict[str, Any]:
    value = "True" if status else "False"
    before = previous.get(kind, {})
    # lastTransitionTime moves only when the status flips, as Kubernetes conditions do.
    changed_at = before.get("lastTransitionTime") if before.get("status") == value else None
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": changed_at or now,
    }


def compute_status(
    *,
    pool_name: str,
    desired_replicas: int,
    deployment: DeploymentView | None,
    pods: Iterable[PodView],
    problem: Problem | None,
    previous_conditions: Iterable[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The pool's status (camelCase, without observedGeneration) from its children's state."""
    alive = sorted((pod for pod in pods if pod.alive), key=lambda pod: pod.name)
    serving = [pod for pod in alive if pod.serving]
    num_ready = len(serving)
    counts = f"{num_ready}/{desired_replicas} engine pods ready"
    previous = {c.get("type", ""): c for c in previous_conditions}

    stuck = next((pod for pod in alive if pod.stuck_reason), None)
    unschedulable = next((pod for pod in alive if pod.unschedulable_message), None)
    if problem is not None:
        degraded = (True, problem.reason, problem.message)
    elif stuck is not None:
        degraded = (True, stuck.stuck_reason, f"pod {stuck.name}: {stuck.stuck_message}".strip())
    elif unschedulable is not None:
        degraded = (
            True,
            "Unschedulable",
            f"pod {unschedulable.name}: {unschedulable.unschedulable_message}",
        )
    elif deployment is not None and deployment.deadline_exceeded:
        degraded = (True, "ProgressDeadlineExceeded", "the engine rollout is not progressing")
    else:
        degraded = (False, "AsExpected", "")

    # A problem stops changes, not the pods already serving the last good spec: Ready reports
    # what serves now, and names the problem only when nothing does.
    if problem is not None and num_ready == 0:
        ready = (False, problem.reason, problem.message)
    elif desired_replicas == 0:
        ready = (False, "ScaledToZero", "replicas is 0")
    elif num_ready == 0:
        ready = (False, "NoReplicasReady", counts)
    elif num_ready < desired_replicas:
        ready = (True, "SomeReplicasReady", counts)
    else:
        ready = (True, "AllReplicasReady", counts)

    if problem is not None:
        progressing = (False, problem.reason, problem.message)
    elif deployment is None:
        progressing = (True, "Creating", "creating the engine Deployment")
    elif (
        deployment.observed_generation < deployment.generation
        or deployment.updated_replicas < desired_replicas
    ):
        progressing = (
            True,
            "RollingOut",
            f"{deployment.updated_replicas}/{desired_replicas} engine pods updated",
        )
    elif num_ready != desired_replicas or len(alive) != desired_replicas:
        progressing = (True, "Scaling", f"{counts}, {len(alive)} exist")
    else:
        progressing = (False, "RolloutComplete", counts)

    return {
        "replicas": len(alive),
        "readyReplicas": num_ready,
        "selector": selector_string(pool_name),
        # Scaled to zero: nothing to route to, even while the last pods are still stopping.
        "endpoints": (
            sorted(f"{pod.ip}:{ENGINE_PORT}" for pod in serving) if desired_replicas else []
        ),
        "conditions": [
            _condition(previous, "Ready", *ready, now),
            _condition(previous, "Progressing", *progressing, now),
            _condition(previous, "Degraded", *degraded, now),
        ],
    }
