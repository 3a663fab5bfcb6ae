"""Pure parts of slotserve.local: workloads, pool file, command lines, table and plots."""

from __future__ import annotations

import json

import pytest
import yaml
from PIL import Image
from PIL.PngImagePlugin import PngImageFile

from slotserve.contracts.pool_spec import AdmissionSpec, BatchingPolicy, BatchingSpec
from slotserve.contracts.weights import Quantization
from slotserve.local import demo, stack, up
from slotserve.local.enginestats import OccupancySample, parse_counters, phase_utilisation
from slotserve.local.report import percentile, summarise, write_results
from slotserve.local.workload import RequestResult, burst_workload, seed_workload
from slotserve.models.resolve import default_served_name


def test_seed_workload_is_the_seed_plus_late_arrivals_triggered_by_the_longest():
    specs = seed_workload()
    seed = [s for s in specs if s.group == "seed"]
    late = [s for s in specs if s.group == "late"]
    assert [s.max_tokens for s in seed] == [20, 50, 100, 500]
    assert late and all(s.trigger_id == "seed-500" for s in late)
    assert all(0 < s.after_tokens < 500 for s in late)
    assert len({s.request_id for s in specs}) == len(specs)


def test_scaled_workload_keeps_its_shape_and_never_asks_for_zero_tokens():
    specs = seed_workload(0.1)
    assert [s.max_tokens for s in specs if s.group == "seed"] == [2, 5, 10, 50]
    assert all(s.max_tokens >= 1 and s.after_tokens < 50 for s in specs)
    assert len(burst_workload(7, 0.01)) == 7
    assert all(s.max_tokens == 16 for s in burst_workload(3, 0.01))
    assert all(s.max_tokens == 16 for s in burst_workload(3, 2.0 / 3))
    assert all(s.max_tokens == 32 for s in burst_workload(3, 2.0))


def test_percentile_interpolates_and_has_no_value_for_no_data():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


def _pool(
    policy: BatchingPolicy, ports: list[int], quantization: Quantization | None = None
) -> stack.PoolPlan:
    engine = stack.EngineOptions(
        model="/models/tiny",
        served_model_name=f"tiny-{policy}",
        batching=BatchingSpec(policy=policy, max_batch_size=4),
        max_model_len=512,
        kv_cache_tokens=2048,
        num_threads=1,
        quantization=quantization,
    )
    return stack.PoolPlan(
        engine=engine,
        num_engines=len(ports),
        admission=AdmissionSpec(max_queue_size=10),
        engine_ports=ports,
    )


def test_pool_file_is_the_gateway_contract_format():
    pools = [_pool("static", [9001]), _pool("continuous", [9002, 9003])]
    content = yaml.safe_load(yaml.safe_dump(stack.pool_file_content(pools, "127.0.0.1")))
    first, second = content["pools"]
    assert first["model"] == "tiny-static"
    assert second["endpoints"] == ["http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert first["batching"]["maxBatchSize"] == 4
    assert second["admission"]["maxQueueSize"] == 10
    # The gateway validates these with the shared pydantic models: they must round-trip.
    assert BatchingSpec.model_validate(first["batching"]).policy == "static"
    assert AdmissionSpec.model_validate(second["admission"]).max_queue_size == 10


def test_engine_command_line_is_accepted_by_the_engine_cli():
    engine_cli = pytest.importorskip("slotserve.engine.cli")
    argv = stack.engine_argv(_pool("dynamic", [9001]).engine, "127.0.0.1", 9001)
    assert argv[1:4] == ["-m", "slotserve.cli", "engine"]
    args = engine_cli.build_parser().parse_args(argv[4:])
    assert (args.policy, args.max_batch_size, args.port) == ("dynamic", 4, 9001)
    assert (args.kv_cache_tokens, args.max_model_len, args.num_threads) == (2048, 512, 1)
    assert args.served_model_name == "tiny-dynamic"
    assert args.quantization is None  # not asked: the engine's default


def test_up_and_demo_pass_the_quantization_to_their_engines():
    engine_cli = pytest.importorskip("slotserve.engine.cli")
    argv = stack.engine_argv(_pool("continuous", [9001], "int4").engine, "127.0.0.1", 9001)
    assert engine_cli.build_parser().parse_args(argv[4:]).quantization == "int4"
    for command in (up, demo):
        assert command.build_parser().parse_args(["--quantization", "int8"]).quantization == "int8"


def test_redis_plan_prefers_a_given_url_then_a_local_binary():
    assert stack.plan_redis("redis://h:1/0", use_redis=True).mode == "external"
    assert stack.plan_redis(None, use_redis=False).mode == "memory"
    spawned = stack.plan_redis(None, use_redis=True)
    assert spawned.mode == "spawn" and spawned.url is not None
    assert spawned.url.endswith(f":{spawned.port}/0")


def test_served_name_follows_the_model_source():
    assert default_served_name("smollm2") == "smollm2"
    assert default_served_name("/tmp/models/tiny-llama/") == "tiny-llama"


METRICS_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 120.0
# TYPE slotserve_slots_total gauge
slotserve_slots_total{model_name="m"} 4.0
# TYPE slotserve_slot_utilisation gauge
slotserve_slot_utilisation{model_name="m"} 0.75
# TYPE slotserve_engine_steps counter
slotserve_engine_steps_total{model_name="m"} 40.0
"""


def test_engine_counters_give_the_utilisation_of_one_phase():
    after = parse_counters(METRICS_TEXT)
    assert (after.running, after.waiting, after.slots_total, after.steps) == (3, 1, 4, 40)
    assert after.useful_slot_steps == pytest.approx(120.0)
    before = parse_counters(METRICS_TEXT.replace("0.75", "0.5").replace(" 40.0", " 10.0"))
    # 120 - 20 useful slot-steps over 30 steps of 4 slots
    assert phase_utilisation({"e": before}, {"e": after}) == pytest.approx(100 / 120)


def _result(request_id, group, status, sent, first, finished, tokens, retry_after=None):
    return RequestResult(
        request_id=request_id,
        group=group,
        max_tokens=tokens,
        status=status,
        sent_at=sent,
        first_token_at=first,
        finished_at=finished,
        num_tokens=tokens if status == 200 else 0,
        retry_after=retry_after,
        error=None if status == 200 else "queue full",
    )


def test_results_table_and_plots_carry_the_same_numbers(tmp_path):
    results = [
        _result("a", "seed", 200, 0.0, 0.5, 2.5, 21),
        _result("b", "seed", 200, 0.0, 1.0, 5.0, 41),
        _result("c", "burst", 429, 0.1, None, 0.1, 8, retry_after="2"),
    ]
    samples = [OccupancySample("e", 0.1 * i, float(i), float(min(i, 2)), 0.0) for i in range(5)]
    phase = summarise(
        "continuous",
        "continuous",
        "m",
        results,
        5.0,
        slot_utilisation=0.5,
        num_steps=40,
        num_slots=4,
        occupancy=samples,
    )
    assert (phase.num_ok, phase.num_rejected, phase.useful_tokens) == (2, 1, 62)
    assert phase.tokens_per_second == pytest.approx(62 / 5.0)
    assert phase.ttft_p50 == pytest.approx(0.75)
    assert phase.retry_after == ["2"]
    row = phase.row()
    assert row[3:6] == ["5.0", "12.4", "50.0%"]
    paths = write_results(tmp_path, "run-1", [phase], {"model": "m"}, "title")
    document = json.loads(paths["json"].read_text())
    assert document["run_id"] == "run-1"
    assert document["phases"][0]["row"] == row
    table = paths["table"].read_text()
    assert all(cell in table for cell in row)
    for key in ("occupancy", "latency"):
        image = Image.open(paths[key])
        assert isinstance(image, PngImageFile)
        assert image.size[0] > 300
        assert image.text["slotserve-run-id"] == "run-1"
        data = json.loads(image.text["slotserve-data"])
        assert data["continuous"]["row"] == row


def test_an_unknown_model_is_a_clear_error_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="not a known name"):
        stack.resolve_model_once(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"no config\.json"):
        stack.resolve_model_once(str(tmp_path / "empty"))
