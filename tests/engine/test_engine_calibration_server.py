"""What an engine calibrated at load is logged, and reported on ``/load`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import logging

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from slotserve.engine.http.server import create_app
from slotserve.engine.settings import EngineSettings


async def load_report(tiny_model_dir) -> tuple[dict, dict[tuple[str, str], float]]:
    """One engine's /load body, and its calibration metrics by (metric, source)."""
    from slotserve.engine.core.async_engine import AsyncEngine

    settings = EngineSettings(model=str(tiny_model_dir), served_model_name="tiny", num_threads=1)
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    client = TestClient(TestServer(create_app(engine)))
    await client.start_server()
    try:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        load = await (await client.get("/load")).json()
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    metrics: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("slotserve_load_calibration"):
                key = (sample.name, sample.labels["source"])
                metrics[key] = metrics.get(key, 0.0) + sample.value  # summed over names
    return load, metrics


async def test_calibrations_are_counted_and_the_second_start_reads_them(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SLOTSERVE_HOME", str(tmp_path))
    caplog.set_level(logging.INFO, logger="slotserve.engine.core.model.loader")
    first, first_metrics = await load_report(tiny_model_dir)
    second, second_metrics = await load_report(tiny_model_dir)

    # The last record: which instruction set the native kernels run and what loading them cost
    # (compiled into this fresh home at the first start; this process loads a library once, so
    # the second start reports that same build).
    *measured, first_kernels = first["calibrations"]
    *cached, second_kernels = second["calibrations"]
    assert first_kernels["name"] == second_kernels["name"] == "native_kernels"
    assert first_kernels["choice"] == second_kernels["choice"]
    assert first_kernels["choice"] in ("avx512_bf16", "avx512", "avx2_fma", "plain_c")
    assert first_kernels["source"] == second_kernels["source"] == "built"
    names = [c["name"] for c in measured]
    # Up to how many rows the native kernels run; when that is none, oneDNN or aten.
    assert names in (["native_rows"], ["native_rows", "linear_backend"])
    assert [c["name"] for c in cached] == names
    # "rule": the trials waited for a CPU (other work on this machine), the CPU-feature rule held.
    assert {c["source"] for c in measured} <= {"measured", "rule"}
    assert {c["source"] for c in cached} == {"cached"}
    for first_choice, second_choice in zip(measured, cached, strict=True):
        assert second_choice["choice"] == first_choice["choice"]
        assert second_choice["figures"] == first_choice["figures"]  # the first start's
    if len(names) == 2:
        assert measured[1]["choice"] in ("onednn", "aten")
    count = len(names)
    decided = ("measured", "rule")
    total = "slotserve_load_calibrations_total"
    assert sum(first_metrics.get((total, source), 0) for source in decided) == count
    assert first_metrics[(total, "built")] == second_metrics[(total, "built")] == 1
    assert second_metrics[(total, "cached")] == count
    assert not any((total, source) in second_metrics for source in decided)
    assert second_metrics[("slotserve_load_calibration_seconds", "cached")] >= 0
    for name in names:
        assert list((tmp_path / "calibration").glob(f"{name}-*.json"))
    lines = [r.getMessage() for r in caplog.records if "calibrated at load" in r.getMessage()]
    assert [("(measured," in line or "(rule," in line, "(cached," in line) for line in lines] == [
        (True, False)
    ] * count + [(False, False)] + [(False, True)] * count + [(False, False)]
    assert any(f"{count + 1} calibrations" in r.getMessage() for r in caplog.records)
