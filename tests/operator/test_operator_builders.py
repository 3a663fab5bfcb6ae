"""The pure builders: every object they return is a valid Kubernetes object (strict, 1.37)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from slotserve.engine.cli import build_parser
from slotserve.operator import builders
from slotserve.operator.models import InferencePool

K8S_VERSION = "1.37.0"
IMAGE = "registry.example/engine:1"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_pool(name: str = "chat", namespace: str = "ml", **spec: Any) -> InferencePool:
    body = {"model": {"name": "smollm2", "source": {"builtin": "smollm2"}}, **spec}
    return InferencePool.from_body(
        {"metadata": {"name": name, "namespace": namespace}, "spec": body}
    )


def example_pool(file: str) -> InferencePool:
    return InferencePool.from_body(yaml.safe_load((EXAMPLES / file).read_text()))


SOURCES = {
    "builtin": {"builtin": "smollm2"},
    "hub": {"hub": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "tokenSecretRef": {"name": "hf"}}},
    "pvc": {"pvc": {"claimName": "models", "path": "llama/8b"}},
    "hostPath": {"hostPath": {"path": "/srv/models/smollm2"}},
}


def pool_with_source(kind: str) -> InferencePool:
    return make_pool(model={"name": "m", "source": SOURCES[kind]})


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    return engine


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


ALL_POOLS = [
    make_pool(),
    example_pool("smollm2-cpu.yaml"),
    example_pool("llama-8b-gpu.yaml"),
    *[pool_with_source(kind) for kind in SOURCES],
    make_pool(
        engine={
            "image": "other/engine:2",
            "imagePullPolicy": "Always",
            "imagePullSecrets": ["regcred"],
            "serviceAccountName": "engine",
            "priorityClassName": "high",
            "podAnnotations": {"prometheus.io/scrape": "true"},
            "env": [{"name": "HF_HOME", "value": "/cache/hf2"}, {"name": "X", "value": "1"}],
            "tolerations": [
                {
                    "key": "k",
                    "operator": "Equal",
                    "value": "v",
                    "effect": "NoExecute",
                    "tolerationSeconds": 30,
                }
            ],
        },
        batching={"policy": "dynamic", "maxBatchSize": 8, "preferredBatchSizes": [4, 8]},
    ),
]


@pytest.mark.parametrize("pool", ALL_POOLS, ids=lambda pool: pool.metadata.name)
def test_every_built_object_is_valid_kubernetes(pool: InferencePool):
    for obj in (builders.build_deployment(pool, engine_image=IMAGE), builders.build_service(pool)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_engine_container_follows_the_contract():
    pool = make_pool(
        batching={
            "policy": "dynamic",
            "maxBatchSize": 8,
            "maxQueueDelayMicroseconds": 500,
            "maxBatchedTokens": 4096,
        },
        model={
            "name": "chat-model",
            "source": {"builtin": "smollm2"},
            "dtype": "bfloat16",
            "maxModelLen": 4096,
        },
    )
    engine = container(builders.build_deployment(pool, engine_image=IMAGE))
    assert engine["image"] == IMAGE
    assert engine["command"] == ["slotserve"] and engine["args"][0] == "engine"
    args = engine["args"]
    assert flag(args, "--model") == "smollm2"
    assert flag(args, "--served-model-name") == "chat-model"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--policy") == "dynamic"
    assert flag(args, "--max-batch-size") == "8"
    assert flag(args, "--max-queue-delay-microseconds") == "500"
    assert flag(args, "--max-batched-tokens") == "4096"
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--dtype") == "bfloat16"
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert engine["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_reaches_the_engine_args(quantization: str):
    pool = make_pool(
        model={"name": "m", "source": {"builtin": "smollm2"}, "quantization": quantization}
    )
    args = container(builders.build_deployment(pool, engine_image=IMAGE))["args"]
    # Appended after the older flags (then --device): pools made before keep their order.
    assert args[-4:] == ["--quantization", quantization, "--device", "cpu"]


@pytest.mark.parametrize("model", [{}, {"quantization": "none"}])
def test_no_quantization_flag_when_none_or_absent(model: dict[str, Any]):
    pool = make_pool(model={"name": "m", "source": {"builtin": "smollm2"}, **model})
    assert pool.spec.model.quantization == "none"
    # No flag for the engine's default, so existing pools' pod templates (and pods) stay as is.
    assert (
        "--quantization"
        not in container(builders.build_deployment(pool, engine_image=IMAGE))["args"]
    )


def test_prefix_cache_rows_reach_the_engine_args_last_and_only_when_set():
    model = {"name": "m", "source": {"builtin": "smollm2"}}
    pool = make_pool(model=model, batching={"maxBatchSize": 4}, engine={"prefixCacheRows": 12})
    args = container(builders.build_deployment(pool, engine_image=IMAGE))["args"]
    # After --device: pools made before the field keep their order, and their pods.
    assert args[-4:] == ["--device", "cpu", "--prefix-cache-rows", "12"]
    plain = make_pool(model=model, engine={"prefixCacheRows": 0})
    assert (
        "--prefix-cache-rows"
        not in container(builders.build_deployment(plain, engine_image=IMAGE))["args"]
    )


def test_startup_probe_covers_the_model_load_timeout():
    engine = container(
        builders.build_deployment(
            make_pool(engine={"startupTimeoutSeconds": 1200}), engine_image=IMAGE
        )
    )
    probe = engine["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1200


def test_grace_period_outlasts_the_drain():
    deployment = builders.build_deployment(
        make_pool(engine={"drainTimeoutSeconds": 120}), engine_image=IMAGE
    )
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert flag(container(deployment)["args"], "--drain-timeout-seconds") == "120"
    assert pod["terminationGracePeriodSeconds"] > 120 + pre_stop


def test_engine_runs_non_root_with_a_read_only_root_and_writable_scratch():
    deployment = builders.build_deployment(make_pool(), engine_image=IMAGE)
    pod = deployment["spec"]["template"]["spec"]
    engine = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine["securityContext"]["allowPrivilegeEscalation"] is False
    assert engine["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in engine["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for path in ("/tmp", "/cache"):
        assert "emptyDir" in volumes[mounts[path]]
    env = {var["name"]: var.get("value") for var in engine["env"]}
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith("/cache")


def test_gpu_pool_passes_resources_node_selector_and_tolerations():
    deployment = builders.build_deployment(example_pool("llama-8b-gpu.yaml"), engine_image=IMAGE)
    pod = deployment["spec"]["template"]["spec"]
    engine = container(deployment)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["resources"]["requests"]["memory"] == "32Gi"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


@pytest.mark.parametrize(
    ("kind", "model_arg", "volume_key"),
    [
        ("builtin", "smollm2", None),
        ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct", None),
        ("pvc", "/models/llama/8b", "persistentVolumeClaim"),
        ("hostPath", "/models", "hostPath"),
    ],
)
def test_model_volume_per_source(kind: str, model_arg: str, volume_key: str | None):
    deployment = builders.build_deployment(pool_with_source(kind), engine_image=IMAGE)
    engine = container(deployment)
    assert flag(engine["args"], "--model") == model_arg
    volumes = {
        volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]
    }
    if volume_key is None:
        assert "model" not in volumes
    else:
        assert volume_key in volumes["model"]
        (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True and mount["mountPath"] == "/models"
    if kind == "pvc":
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "models",
            "readOnly": True,
        }


def test_hub_token_comes_from_the_secret():
    engine = container(builders.build_deployment(pool_with_source("hub"), engine_image=IMAGE))
    (token,) = [var for var in engine["env"] if var["name"] == "HF_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}


def test_our_env_wins_over_the_pool_s_and_preferred_sizes_reach_the_engine_flags():
    # The policy refuses a pool that sets HF_HOME; one that reaches the builder anyway still
    # cannot move the operator's variables (issue 27: the pool's env used to win).
    pool = ALL_POOLS[-1]
    engine = container(builders.build_deployment(pool, engine_image=IMAGE))
    names = [var["name"] for var in engine["env"]]
    assert names.count("HF_HOME") == 1
    env = {var["name"]: var.get("value") for var in engine["env"]}
    assert env["HF_HOME"] == "/cache/huggingface" and env["X"] == "1"
    at = engine["args"].index("--preferred-batch-sizes")
    assert engine["args"][at : at + 3] == ["--preferred-batch-sizes", "4", "8"]
    assert engine["image"] == "other/engine:2" and engine["imagePullPolicy"] == "Always"


def test_labels_selectors_and_service_line_up():
    pool = make_pool(name="chat", replicas=3)
    deployment = builders.build_deployment(pool, engine_image=IMAGE)
    service = builders.build_service(pool)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"slotserve.dev/pool": "chat", "app.kubernetes.io/component": "engine"}
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == "ml"
    assert builders.selector_string("chat") == (
        "app.kubernetes.io/component=engine,slotserve.dev/pool=chat"
    )


def test_rollout_never_drops_capacity():
    deployment = builders.build_deployment(make_pool(), engine_image=IMAGE)
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("pool", ALL_POOLS, ids=lambda pool: pool.metadata.name)
def test_engine_cli_accepts_the_built_arguments(pool: InferencePool):
    """The contract check: the real `slotserve engine` parser and settings take our args."""
    engine_cli = pytest.importorskip("slotserve.engine.cli")
    from slotserve.engine.settings import EngineSettings
    from slotserve.settings import settings_from_args

    args = container(builders.build_deployment(pool, engine_image=IMAGE))["args"]
    assert args[0] == "engine"
    settings = settings_from_args(EngineSettings, engine_cli.build_parser().parse_args(args[1:]))
    assert settings.port == 8000 and settings.host == "0.0.0.0"
    assert settings.served_model_name == pool.spec.model.name
    assert settings.max_batch_size == pool.spec.batching.max_batch_size
    assert settings.preferred_batch_sizes == pool.spec.batching.preferred_batch_sizes
    assert settings.generation_config == pool.spec.model.generation_config
    assert settings.tool_call_parser == pool.spec.model.tool_call_parser


def test_sampling_defaults_and_tool_parser_reach_the_engine():
    """spec.model.samplingDefaults becomes the engine's generation-config override, as JSON."""
    engine_cli = pytest.importorskip("slotserve.engine.cli")
    from slotserve.engine.core.generation_defaults import parse_override
    from slotserve.engine.settings import EngineSettings
    from slotserve.settings import settings_from_args

    pool = make_pool()
    pool.spec.model = pool.spec.model.model_validate(
        {
            **pool.spec.model.model_dump(by_alias=True),
            "generationConfig": "none",
            "toolCallParser": "hermes",
            "samplingDefaults": {"temperature": 0.6, "topP": 0.9, "maxNewTokens": 256},
        }
    )
    args = container(builders.build_deployment(pool, engine_image=IMAGE))["args"]
    settings = settings_from_args(EngineSettings, engine_cli.build_parser().parse_args(args[1:]))
    assert settings.generation_config == "none" and settings.tool_call_parser == "hermes"
    assert parse_override(settings.override_generation_config) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 256,
    }
    # Without overrides the flag is left out, so the model's own defaults stand.
    plain = container(builders.build_deployment(make_pool(), engine_image=IMAGE))["args"]
    assert "--override-generation-config" not in plain


@pytest.mark.parametrize(
    ("engine", "device"),
    [
        ({}, "cpu"),
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "cuda"),
        ({"resources": {"limits": {"nvidia.com/gpu": "2"}}}, "cuda"),
        ({"resources": {"limits": {"nvidia.com/gpu": 0}}}, "cpu"),
        ({"device": "cpu", "resources": {"limits": {"nvidia.com/gpu": 1}}}, "cpu"),
        ({"device": "cuda", "resources": {"limits": {"nvidia.com/gpu": 1}}}, "cuda"),
    ],
)
def test_the_device_is_explicit_in_the_engine_args(engine: dict[str, Any], device: str):
    # A CPU pool's engine never picks up a GPU it was not given (a pod without a GPU limit may
    # still see the node's GPUs), and a GPU pool's engine never falls back to the CPU: told
    # cuda, it exits 2 without a usable GPU (tests/engine/test_engine_device.py).
    args = container(builders.build_deployment(make_pool(engine=engine), engine_image=IMAGE))[
        "args"
    ]
    assert args[-2:] == ["--device", device]
    assert build_parser().parse_args(args[1:]).device == device


def test_the_gpu_example_runs_on_cuda_and_says_why_when_it_cannot():
    engine = container(
        builders.build_deployment(example_pool("llama-8b-gpu.yaml"), engine_image=IMAGE)
    )
    assert flag(engine["args"], "--device") == "cuda"
    # The engine's last log line becomes the termination message the pool's status shows.
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_platform_names_the_hub_and_no_pool_can_change_it():
    pool = make_pool(
        model={"name": "m", "source": {"hub": {"id": "org/m", "tokenSecretRef": {"name": "hf"}}}},
        engine={"env": [{"name": "HF_ENDPOINT", "value": "https://collector.example"}]},
    )
    engine = container(
        builders.build_deployment(pool, engine_image=IMAGE, hub_endpoint="http://hub.mirror:8080")
    )
    env = [(var["name"], var.get("value")) for var in engine["env"]]
    assert [value for name, value in env if name == "HF_ENDPOINT"] == ["http://hub.mirror:8080"]
    # Without a platform hub there is no HF_ENDPOINT at all, whatever the pool says.
    engine = container(builders.build_deployment(pool, engine_image=IMAGE))
    assert "HF_ENDPOINT" not in [var["name"] for var in engine["env"]]
