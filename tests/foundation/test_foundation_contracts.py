"""slotserve.contracts is the one source of what crosses a process boundary.

The CRD (model and generated schema), the engine's settings and its scheduler take their batching
fields from one declaration; the operator and the local stack start engines with one argv builder
that the engine's own parser reads back; the engine's ``/load`` body is the model the gateway
parses; and a pool's ``maxBatchSize`` reaches the gateway's slot count under one name.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from slotserve.contracts import crd as coordinates
from slotserve.contracts.engine_argv import EngineLaunch, engine_argv
from slotserve.contracts.engine_load import EngineLoadReport
from slotserve.contracts.headers import SLOTS_FREE_HEADER, SLOTS_TOTAL_HEADER
from slotserve.contracts.pool_spec import BATCHING_POLICIES, BatchingSpec
from slotserve.contracts.redis_keys import DispatchArgs
from slotserve.contracts.weights import QUANTIZATIONS, WeightDType, WeightQuantization
from slotserve.engine.cli import build_parser
from slotserve.engine.core.scheduler import SchedulerConfig
from slotserve.engine.settings import EngineSettings
from slotserve.local import stack
from slotserve.operator import builders, crd
from slotserve.operator.models import InferencePoolSpec, ModelSpec
from slotserve.settings import settings_from_args

# (field, values every part accepts, values every part refuses): the edges of each bound.
BATCHING_BOUNDS: list[tuple[str, list[Any], list[Any]]] = [
    ("policy", list(BATCHING_POLICIES), ["greedy", ""]),
    ("max_batch_size", [1, 1024], [0, 1025]),
    ("max_queue_delay_microseconds", [0, 60_000_000], [-1, 60_000_001]),
    ("max_batched_tokens", [16, 1_048_576], [15, 1_048_577]),
]
CAMEL = {
    "policy": "policy",
    "max_batch_size": "maxBatchSize",
    "max_queue_delay_microseconds": "maxQueueDelayMicroseconds",
    "max_batched_tokens": "maxBatchedTokens",
}


def crd_batching_schema() -> dict[str, Any]:
    version = crd.build_crd()["spec"]["versions"][0]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["batching"]


def accepted_by_engine(field: str, value: Any) -> bool:
    try:
        EngineSettings(**{field: value})
    except ValidationError:
        return False
    return True


def accepted_by_crd_model(field: str, value: Any) -> bool:
    try:
        BatchingSpec.model_validate({CAMEL[field]: value})
    except ValidationError:
        return False
    return True


def accepted_by_crd_schema(field: str, value: Any) -> bool:
    try:
        jsonschema.validate({CAMEL[field]: value}, crd_batching_schema())
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(("field", "good", "bad"), BATCHING_BOUNDS)
def test_engine_settings_crd_model_and_crd_schema_accept_the_same_batching_values(
    field: str, good: list[Any], bad: list[Any]
) -> None:
    for value in good:
        assert accepted_by_engine(field, value), value
        assert accepted_by_crd_model(field, value), value
        assert accepted_by_crd_schema(field, value), value
    for value in bad:
        assert not accepted_by_engine(field, value), value
        assert not accepted_by_crd_model(field, value), value
        assert not accepted_by_crd_schema(field, value), value


def test_preferred_batch_sizes_must_fit_the_slots_everywhere() -> None:
    with pytest.raises(ValidationError):
        EngineSettings(max_batch_size=4, preferred_batch_sizes=[2, 5])
    with pytest.raises(ValidationError):
        BatchingSpec(max_batch_size=4, preferred_batch_sizes=[2, 5])
    assert EngineSettings(max_batch_size=4, preferred_batch_sizes=[2, 4]).max_batch_size == 4


def test_engine_scheduler_and_crd_start_from_the_same_defaults() -> None:
    spec, settings, config = BatchingSpec(), EngineSettings(), SchedulerConfig()
    defaults = (spec.policy, spec.max_batch_size, spec.max_queue_delay_microseconds)
    assert defaults == ("continuous", 32, 100)  # DESIGN.md's InferencePool sketch
    assert (settings.policy, settings.max_batch_size, settings.max_queue_delay_microseconds) == (
        defaults
    )
    assert (
        config.policy,
        config.max_batch_size,
        round(config.max_queue_delay_seconds * 1e6),
    ) == defaults
    # The step budget is the device's unless set: DESIGN.md's 2,048 on a GPU, 1,024 on a CPU.
    assert spec.max_batched_tokens is None and settings.max_batched_tokens is None
    assert "default" not in crd_batching_schema()["properties"]["maxBatchedTokens"]
    assert settings.step_token_budget("cuda") == config.max_batched_tokens == 2048
    assert settings.step_token_budget("mps") == 2048
    assert settings.step_token_budget("cpu") == 1024
    assert EngineSettings(max_batched_tokens=4096).step_token_budget("cpu") == 4096
    # Unset, the pod gets no flag: the engine decides on its device.
    unset = engine_argv(EngineLaunch(model="m", served_model_name="m", batching=BatchingSpec()))
    assert "--max-batched-tokens" not in unset
    assert parse_engine_argv(unset).max_batched_tokens is None


def parse_engine_argv(argv: list[str]) -> EngineSettings:
    assert argv[0] == "engine"
    return settings_from_args(EngineSettings, build_parser().parse_args(argv[1:]))


def test_every_launch_setting_round_trips_through_the_engine_parser() -> None:
    batching = BatchingSpec(
        policy="dynamic",
        max_batch_size=6,
        max_queue_delay_microseconds=2500,
        preferred_batch_sizes=[2, 4],
        max_batched_tokens=96,
    )
    launch = EngineLaunch(
        model="/models/m",
        served_model_name="m",
        batching=batching,
        host="127.0.0.1",
        port=8123,
        max_model_len=512,
        dtype="float32",
        drain_timeout_seconds=7.5,
        generation_config="none",
        tool_call_parser="hermes",
        override_generation_config='{"temperature": 0.5}',
        kv_cache_tokens=1024,
        num_threads=2,
        quantization="int4",
        device="cuda",
        prefix_cache_rows=12,
    )
    settings = parse_engine_argv(engine_argv(launch))
    assert settings.model_dump(include=set(BatchingSpec.model_fields)) == batching.model_dump()
    for name, value in vars(launch).items():
        if name != "batching":
            assert getattr(settings, name) == value, name


def test_operator_and_local_stack_start_engines_with_the_same_flags() -> None:
    spec = InferencePoolSpec.model_validate(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2"}, "maxModelLen": 512},
            "batching": {"policy": "static", "maxBatchSize": 5, "maxBatchedTokens": 64},
            "engine": {"drainTimeoutSeconds": 5},
        }
    )
    pod = parse_engine_argv(builders.engine_args(spec, "smollm2"))
    options = stack.EngineOptions(
        model="smollm2",
        served_model_name="m",
        batching=spec.batching,
        max_model_len=512,
        drain_timeout_seconds=5,
    )
    local = parse_engine_argv(stack.engine_argv(options, "0.0.0.0", 8000)[3:])
    fields = {*BatchingSpec.model_fields, "model", "served_model_name", "max_model_len"}
    assert pod.model_dump(include=fields) == local.model_dump(include=fields)
    assert (pod.policy, pod.max_batch_size, pod.max_batched_tokens) == ("static", 5, 64)
    # Unset stays the engine's default (the pool defaults of the contract, not a copy).
    assert pod.max_queue_delay_microseconds == BatchingSpec().max_queue_delay_microseconds


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_pool_quantization_reaches_the_engine(quantization: str) -> None:
    model = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = model["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]
    assert field["enum"] == list(QUANTIZATIONS) and field["default"] == "none"
    spec = InferencePoolSpec.model_validate(
        {"model": {"name": "m", "source": {"builtin": "smollm2"}, "quantization": quantization}}
    )
    args = builders.engine_args(spec, "smollm2")
    assert parse_engine_argv(args).quantization == quantization
    # "none" is the engine's default: no flag, so pools made before the field keep their args.
    assert ("--quantization" in args) == (quantization != "none")


def test_an_unknown_quantization_is_refused_by_crd_operator_and_engine() -> None:
    model = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = model["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]
    assert "int3" not in field["enum"]
    with pytest.raises(ValidationError, match="quantization"):
        InferencePoolSpec.model_validate(
            {"model": {"name": "m", "source": {"builtin": "smollm2"}, "quantization": "int3"}}
        )
    assert not accepted_by_engine("quantization", "int3")


@pytest.mark.parametrize(
    ("field", "declared"), [("dtype", WeightDType), ("quantization", WeightQuantization)]
)
def test_weight_fields_are_declared_once(field: str, declared: Any) -> None:
    values, *metadata = get_args(declared)
    description = next(item.description for item in metadata if isinstance(item, FieldInfo))
    model = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    in_crd = model["properties"]["spec"]["properties"]["model"]["properties"][field]
    # The CRD, the operator's model and the engine's settings (its --help) say the same thing.
    assert in_crd["description"] == description
    assert ModelSpec.model_fields[field].description == description
    assert EngineSettings.model_fields[field].description == description
    assert in_crd["enum"] == list(get_args(values))
    help_text = " ".join(build_parser().format_help().split())
    assert f"--{field} {{{','.join(get_args(values))}}} {description}" in help_text


def test_the_quantization_description_says_what_the_kernels_do() -> None:
    from slotserve.engine.core.kernels import GROUP_SIZE  # the C source's group (torch loads)

    description = ModelSpec.model_fields["quantization"].description or ""
    assert "per-channel" not in description
    assert f"int8 (one scale per group of {GROUP_SIZE} weights" in description
    assert f"int4 (a scale and a minimum per group of {GROUP_SIZE} weights" in description


def test_the_generated_crd_lives_where_the_gateway_looks() -> None:
    from slotserve.gateway.pools import discovery, endpointslices

    built = crd.build_crd()
    assert built["metadata"]["name"] == f"{coordinates.PLURAL}.{coordinates.GROUP}"
    assert built["spec"]["group"] == coordinates.GROUP
    assert built["spec"]["names"]["kind"] == coordinates.KIND
    assert [v["name"] for v in built["spec"]["versions"]] == [coordinates.VERSION]
    assert discovery.REQUIRED_RULES[0]["apiGroups"] == [coordinates.GROUP]
    assert discovery.REQUIRED_RULES[0]["resources"] == [coordinates.PLURAL]
    # The operator labels the pool's Service with it; the gateway selects slices by it.
    assert coordinates.POOL_LABEL in builders.selector_labels("p")
    assert coordinates.POOL_LABEL in endpointslices.SLICE_SELECTOR


def test_the_lua_scripts_read_each_argument_where_the_backend_puts_it(redis_server) -> None:
    import redis

    args = DispatchArgs(
        prefix="p",
        pool="m",
        caller="r1",
        lease_ttl_us=7,
        state_ttl_ms=11,
        known_epoch="e",
        sweep_batch=13,
        max_queue=17,
        preempt=True,
        num_offers=1,
    )
    names = [name.upper() for name in vars(args)]
    script = (
        DispatchArgs.lua_locals()
        + f"return {{{', '.join(f'tostring({name})' for name in names)}, "
        + f"ARGV[{DispatchArgs.first_offer_index()}]}}"
    )
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        reply = client.eval(script, 0, *args.argv(), "http://a", 4, "0.5")
    finally:
        client.close()
    # A bool travels as 1 or 0 (``ScriptArgs.argv``), a number to Lua.
    sent = [str(int(v) if isinstance(v, bool) else v) for v in vars(args).values()]
    assert reply == [*sent, "http://a"]


async def test_max_batch_size_reaches_the_gateway_slot_count_under_one_name(
    tiny_model_dir: Path,
) -> None:
    """CRD maxBatchSize -> operator argv -> engine settings -> scheduler -> /load -> gateway."""
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.http.server import create_app
    from slotserve.gateway.pools.config import Pool, PoolRegistry
    from slotserve.gateway.pools.engines import EngineMonitor

    spec = InferencePoolSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"builtin": "smollm2"}, "maxModelLen": 256},
            "batching": {"policy": "dynamic", "maxBatchSize": 3, "maxQueueDelayMicroseconds": 0},
        }
    )
    settings = parse_engine_argv(builders.engine_args(spec, str(tiny_model_dir)))
    settings = settings.model_copy(update={"num_threads": 1, "port": 0})
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    assert engine.engine.scheduler.config.max_batch_size == 3
    assert engine.engine.scheduler.config.policy == "dynamic"
    client = TestClient(TestServer(create_app(engine)))
    await client.start_server()
    monitor = EngineMonitor(PoolRegistry([Pool("tiny", (str(client.make_url("")).rstrip("/"),))]))
    await monitor.start()
    try:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        resp = await client.get("/load")
        report = EngineLoadReport.model_validate(await resp.json())
        assert (report.model, report.policy, report.slots_total) == ("tiny", "dynamic", 3)
        assert resp.headers[SLOTS_TOTAL_HEADER] == "3"
        assert resp.headers[SLOTS_FREE_HEADER] == "3"
        await asyncio.wait_for(monitor.first_round.wait(), timeout=10)
        await monitor.poll_once()
        [offer] = monitor.offers("tiny")
        assert offer.slots_total == 3
    finally:
        await monitor.close()
        await client.close()
