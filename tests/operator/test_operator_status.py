"""Pure status computation: counts, endpoints and conditions from pods and the Deployment."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slotserve.operator.models import InferencePoolStatus
from slotserve.operator.status import DeploymentView, PodView, Problem, compute_status

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def pod(name: str, ip: str = "", *, ready: bool = False, **extra: Any) -> PodView:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    body: dict[str, Any] = {
        "metadata": {"name": name, **extra.pop("metadata", {})},
        "status": {"podIP": ip, "phase": "Running", "conditions": conditions, **extra},
    }
    return PodView.from_body(body)


def rolled_out(replicas: int, generation: int = 1) -> DeploymentView:
    return DeploymentView.from_body(
        {
            "metadata": {"generation": generation},
            "status": {"observedGeneration": generation, "updatedReplicas": replicas},
        }
    )


def status(desired: int = 2, pods: Iterable[PodView] = (), deployment: Any = None, **kw: Any):
    return compute_status(
        pool_name="chat",
        desired_replicas=desired,
        deployment=deployment,
        pods=pods,
        problem=kw.get("problem"),
        previous_conditions=kw.get("previous", []),
        now=kw.get("now", NOW),
    )


def conditions(result: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


def test_only_ready_live_pods_with_an_ip_are_endpoints():
    pods = [
        pod("a", "10.0.0.2", ready=True),
        pod("b", "10.0.0.1", ready=True),
        pod("c", "10.0.0.3", ready=False),
        pod("d", "", ready=True),
        pod("e", "10.0.0.5", ready=True, metadata={"deletionTimestamp": NOW}),
        pod("f", "10.0.0.6", ready=True, phase="Failed"),
    ]
    result = status(desired=4, pods=pods, deployment=rolled_out(4))
    assert result["endpoints"] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert result["readyReplicas"] == 2
    assert result["replicas"] == 4  # a, b, c, d exist; e terminates, f failed
    assert result["selector"] == "app.kubernetes.io/component=engine,slotserve.dev/pool=chat"
    assert conditions(result)["Ready"] == ("True", "SomeReplicasReady")
    assert conditions(result)["Progressing"] == ("True", "Scaling")


def test_all_ready_and_rolled_out():
    pods = [pod("a", "10.0.0.1", ready=True), pod("b", "10.0.0.2", ready=True)]
    result = status(pods=pods, deployment=rolled_out(2))
    assert conditions(result) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }


def test_new_pool_is_creating_and_not_ready():
    assert conditions(status()) == {
        "Ready": ("False", "NoReplicasReady"),
        "Progressing": ("True", "Creating"),
        "Degraded": ("False", "AsExpected"),
    }


def test_rollout_in_progress_until_the_controller_observed_the_new_generation():
    deployment = DeploymentView.from_body(
        {"metadata": {"generation": 3}, "status": {"observedGeneration": 2, "updatedReplicas": 2}}
    )
    pods = [pod("a", "10.0.0.1", ready=True), pod("b", "10.0.0.2", ready=True)]
    assert conditions(status(pods=pods, deployment=deployment))["Progressing"] == (
        "True",
        "RollingOut",
    )


def test_stuck_pods_and_problems_degrade_the_pool():
    crashing = pod(
        "a",
        containerStatuses=[
            {"name": "engine", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "x"}}}
        ],
    )
    result = status(pods=[crashing], deployment=rolled_out(2))
    assert conditions(result)["Degraded"] == ("True", "ImagePullBackOff")
    assert "pod a" in result["conditions"][2]["message"]

    pending = pod(
        "b",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes have nvidia.com/gpu",
            }
        ],
    )
    assert conditions(status(pods=[pending]))["Degraded"] == ("True", "Unschedulable")

    problem = Problem("InvalidSpec", "bad")
    assert conditions(status(problem=problem)) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    # Pods of the last good spec keep serving: still Ready, but degraded and not progressing.
    serving = [pod("a", "10.0.0.1", ready=True), pod("b", "10.0.0.2", ready=True)]
    result = status(pods=serving, deployment=rolled_out(2), problem=problem)
    assert result["endpoints"] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert conditions(result) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }


def test_scaled_to_zero_is_not_ready_but_complete():
    result = status(desired=0, deployment=rolled_out(0))
    assert conditions(result)["Ready"] == ("False", "ScaledToZero")
    assert conditions(result)["Progressing"] == ("False", "RolloutComplete")
    assert result["endpoints"] == []
    # Just scaled down: the last pod still serves, but nothing is routed to it any more.
    stopping = status(desired=0, pods=[pod("a", "10.0.0.1", ready=True)], deployment=rolled_out(0))
    assert conditions(stopping)["Ready"] == ("False", "ScaledToZero")
    assert stopping["endpoints"] == [] and stopping["readyReplicas"] == 1
    assert conditions(stopping)["Progressing"][1] == "Scaling"


def test_transition_time_moves_only_when_the_status_flips():
    first = status()
    unchanged = status(previous=first["conditions"], now=LATER)
    assert [c["lastTransitionTime"] for c in unchanged["conditions"]] == [NOW, NOW, NOW]
    pods = [pod("a", "10.0.0.1", ready=True), pod("b", "10.0.0.2", ready=True)]
    flipped = status(pods=pods, deployment=rolled_out(2), previous=first["conditions"], now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


def test_computed_status_fits_the_status_model_of_the_crd():
    pods = [pod("a", "10.0.0.1", ready=True)]
    result = status(pods=pods, deployment=rolled_out(2), problem=Problem("ChildConflict", "x"))
    parsed = InferencePoolStatus.model_validate({**result, "observedGeneration": 3})
    assert parsed.model_dump(by_alias=True, exclude_none=True) == {
        **result,
        "observedGeneration": 3,
    }


# The kubelet's view of an engine that exited 2 (``--device cuda`` on a node whose GPU is not
# usable): policy FallbackToLogsOnError keeps the log tail as the termination message.
NO_GPU_LOG = (
    "2026-01-01 00:00:00,000 WARNING py.warnings: CUDA initialization: no NVIDIA driver\n"
    "slotserve engine: cannot start: --device cuda: no usable GPU (torch sees 0 CUDA devices)\n"
)


def engine_container(state: dict[str, Any], last: dict[str, Any] | None = None) -> dict:
    return {"name": "engine", "ready": False, "state": state, "lastState": last or {}}


def test_an_engine_that_cannot_start_says_why_in_the_pool_status():
    exited = {"terminated": {"exitCode": 2, "reason": "Error", "message": NO_GPU_LOG}}
    for container in (
        engine_container(exited),  # just exited
        engine_container(  # waiting to be restarted: the exit is the last state
            {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}, exited
        ),
        engine_container({"running": {}}, exited),  # restarted, about to exit 2 again
    ):
        result = status(desired=1, pods=[pod("a", "10.0.0.1", containerStatuses=[container])])
        (degraded,) = [c for c in result["conditions"] if c["type"] == "Degraded"]
        assert (degraded["status"], degraded["reason"]) == ("True", "EngineCannotStart")
        assert degraded["message"] == (
            "pod a: the engine exited 2: slotserve engine: cannot start: --device cuda: "
            "no usable GPU (torch sees 0 CUDA devices)"
        )


def test_a_crash_loop_names_the_last_exit():
    crashed = {"terminated": {"exitCode": 1, "message": "Traceback ...\nRuntimeError: boom\n"}}
    container = engine_container(
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}, crashed
    )
    result = status(desired=1, pods=[pod("a", "10.0.0.1", containerStatuses=[container])])
    assert conditions(result)["Degraded"] == ("True", "CrashLoopBackOff")
    (degraded,) = [c for c in result["conditions"] if c["type"] == "Degraded"]
    assert degraded["message"] == "pod a: back-off 20s; last exit 1: RuntimeError: boom"
    # A ready container that once exited 2 is serving now: not degraded.
    healthy = {**engine_container({"running": {}}, crashed | {}), "ready": True}
    healthy["lastState"] = {"terminated": {"exitCode": 2, "message": NO_GPU_LOG}}
    result = status(desired=1, pods=[pod("a", "10.0.0.1", ready=True, containerStatuses=[healthy])])
    assert conditions(result)["Degraded"] == ("False", "AsExpected")
