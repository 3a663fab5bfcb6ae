"""Priority policy through real gateway processes (in-process admission and Redis): the levels a
key may ask for (403 beyond them, the default level brought into them), the pool's default level
and number of levels, and a level's own queue size as a 429 naming the level."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from slotserve.gateway.http.api_keys import ALL_LEVELS, ApiKeys, ApiKeysError, parse_api_keys
from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_http import completion


def test_keys_file_levels_parse_and_errors_never_show_the_key(tmp_path):
    keys = parse_api_keys("sk-a\n  # comment\nsk-b levels=5-9\nsk-c\tlevels=3\n", "f")
    assert [(k.secret, k.levels) for k in keys] == [
        ("sk-a", ALL_LEVELS),
        ("sk-b", range(5, 10)),
        ("sk-c", range(3, 4)),
    ]
    assert "sk-b" not in repr(keys)
    for bad in (
        "sk-secret levels=0-3",
        "sk-secret levels=7-2",
        "sk-secret levels=x",
        "sk-secret tier=1",
    ):
        with pytest.raises(ApiKeysError) as info:
            parse_api_keys(bad, "f")
        assert "sk-secret" not in str(info.value) and "line 1" in str(info.value)
    path = tmp_path / "keys"
    path.write_text("sk-a\nsk-b levels=5-9\n")
    assert ApiKeys(path).allowed_levels("Bearer sk-b") == range(5, 10)
    assert ApiKeys(path).allowed_levels("Bearer sk-a") == ALL_LEVELS
    assert not ApiKeys(path).allowed_levels("Bearer sk-z")
    assert ApiKeys().allowed_levels("") == ALL_LEVELS  # no keys file: any level


async def _post(
    client: aiohttp.ClientSession, url: str, key: str, prompt: str, **headers: str
) -> tuple[int, dict, dict]:
    body = completion(prompt=prompt, x_delay=0.8 if prompt == "hold" else 0.01)
    async with client.post(
        f"{url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **headers},
    ) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_key_levels_default_level_and_level_queue_size(
    backend, spawn, client, tmp_path, request
):
    redis_url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    engine = spawn.double(slots=1, delay=0.01)
    keys = tmp_path / "keys"
    keys.write_text("# batch jobs may not jump the queue\nsk-all\nsk-batch  levels=5-9\n")
    pools = write_pools(
        tmp_path / "pools.yaml",
        [
            pool(
                "m",
                [engine.url],
                defaultPriorityLevel=3,
                priorityQueuePolicy={"5": {"maxQueueSize": 2}},
            ),
            pool("few", [engine.url], priorityLevels=3),
        ],
    )
    gateway = spawn.gateway(pools, redis_url, extra=["--api-keys-file", str(keys)])
    url = gateway.url

    # A level the key may not ask for: 403 before any queue; beyond the pool's levels: 400.
    status, body, _ = await _post(client, url, "sk-batch", "x", **{"x-slotserve-priority": "2"})
    assert (status, body["error"]["code"]) == (403, "priority_not_allowed")
    assert body["error"]["type"] == "permission_error"
    few = completion(model="few")
    async with client.post(
        f"{url}/v1/completions",
        json=few,
        headers={"Authorization": "Bearer sk-all", "x-slotserve-priority": "4"},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_header"

    # The slot is busy; sk-batch's requests without the header go to level 5 (the pool's
    # default 3 brought into 5-9), whose own queue holds 2.
    hold = asyncio.create_task(_post(client, url, "sk-all", "hold"))
    await asyncio.sleep(0.15)
    batch = [asyncio.create_task(_post(client, url, "sk-batch", f"b{i}")) for i in (1, 2)]
    await asyncio.sleep(0.2)
    status, body, headers = await _post(client, url, "sk-batch", "b3")
    assert status == 429, body
    assert "level 5" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    # Level 3 (sk-all's default) still queues, and goes ahead of the earlier level-5 ones.
    first = asyncio.create_task(_post(client, url, "sk-all", "a1"))
    results = await asyncio.wait_for(asyncio.gather(hold, first, *batch), 20)
    assert [status for status, _, _ in results] == [200] * 4
    assert engine.stats()["arrivals"] == ["hold", "a1", "b1", "b2"]
