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
    metrics = {
        (sample.name, sample.labels["source"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("slotserve_load_calibration")
    }
    return load, metrics


async def test_calibrations_are_counted_and_the_second_start_reads_them(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SLOTSERVE_HOME", str(tmp_path))
    caplog.set_level(logging.INFO, logger="slotserve.engine.core.runner")
    first, first_metrics = await load_report(tiny_model_dir)
    second, second_metrics = await load_report(tiny_model_dir)

    (measured,) = first["calibrations"]
    (cached,) = second["calibrations"]
    assert measured["name"] == cached["name"] == "linear_backend"
    assert (measured["source"], cached["source"]) == ("measured", "cached")
    assert cached["choice"] == measured["choice"] in ("onednn", "aten")
    assert cached["figures"] == measured["figures"]  # the first start's measurement
    assert first_metrics[("slotserve_load_calibrations_total", "measured")] == 1
    assert second_metrics[("slotserve_load_calibrations_total", "cached")] == 1
    assert ("slotserve_load_calibrations_total", "measured") not in second_metrics
    assert second_metrics[("slotserve_load_calibration_seconds", "cached")] >= 0
    assert list((tmp_path / "calibration").glob("linear_backend-*.json"))
    lines = [r.getMessage() for r in caplog.records if "calibrated at load" in r.getMessage()]
    assert [("(measured," in line, "(cached," in line) for line in lines] == [
        (True, False),
        (False, True),
    ]
    assert any("1 calibrations" in r.getMessage() for r in caplog.records)
