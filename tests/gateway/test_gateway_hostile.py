"""Hostile input and credentials: every bad body is a 400 in OpenAI's shape, a keys file without
keys stops the gateway, keys reload when the file changes (as Kubernetes swaps a mounted
Secret), and /metrics can require a key."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from tests.gateway.gateway_support import SLOTSERVE, pool, write_pools
from tests.gateway.test_gateway_http import completion
from tests.support import free_port

DEAD = "http://127.0.0.1:9"  # nothing listens: body checks come before any engine is needed


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
        (b'{"model": "m", "prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
        (b'{"model": "m", "temperature": -Infinity}', "Infinity is not a JSON number"),
        (b"", "not valid JSON"),
        (b"null", "JSON object"),
        (b'"a string"', "JSON object"),
        (b"42", "JSON object"),
        (b"\xc3\x28", "not valid JSON"),
        (b"model=m&prompt=hi", "not valid JSON"),
    ],
)
async def test_hostile_body_is_400_in_openai_shape(gw, client, data, needle):
    url = await gw([pool("m", [DEAD])])
    async with client.post(f"{url}/v1/chat/completions", data=data) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert needle in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


async def test_unknown_path_and_method_in_openai_shape(gw, client):
    url = await gw([pool("m", [DEAD])])
    async with client.get(f"{url}/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    async with client.get(f"{url}/v1/completions") as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == "method_not_allowed"


def run_gateway_cli(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    pools = write_pools(tmp_path / "pools.yaml", [pool("m", [DEAD])])
    argv = [str(SLOTSERVE), "gateway", "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--config", str(pools), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n  \n# another\n"])
def test_keys_file_without_keys_exits_2(tmp_path, content):
    keys = tmp_path / "keys"
    keys.write_text(content)
    result = run_gateway_cli(tmp_path, "--api-keys-file", str(keys))
    assert result.returncode == 2
    assert f"API keys file {keys} holds no key" in result.stderr


def test_missing_keys_file_and_metrics_auth_without_keys_exit_2(tmp_path):
    result = run_gateway_cli(tmp_path, "--api-keys-file", str(tmp_path / "absent"))
    assert result.returncode == 2
    assert "cannot read API keys file" in result.stderr
    result = run_gateway_cli(tmp_path, "--metrics-require-api-key")
    assert result.returncode == 2
    assert "metrics_require_api_key needs api_keys_file" in result.stderr


async def test_running_without_keys_warns_at_start(gw, caplog):
    caplog.set_level("WARNING")
    await gw([pool("m", [DEAD])])
    assert "no API keys file: every caller is accepted" in caplog.text


class MountedSecret:
    """A folder laid out as the kubelet mounts a Secret: ``keys -> ..data/keys`` and
    ``..data -> ..<timestamp>``; an update writes a new timestamped folder and swaps ``..data``
    atomically (rename of a new symlink over it), never touching ``keys`` itself."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.generation = 0
        self.update("")
        (root / "keys").symlink_to("..data/keys")

    @property
    def path(self) -> Path:
        return self.root / "keys"

    def update(self, content: str) -> None:
        self.generation += 1
        folder = self.root / f"..2026_11_30_{self.generation}"
        folder.mkdir()
        (folder / "keys").write_text(content)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(folder.name)
        os.replace(tmp, self.root / "..data")


async def status_with(client: aiohttp.ClientSession, url: str, key: str, path: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if path == "/metrics":
        async with client.get(f"{url}{path}", headers=headers) as resp:
            return resp.status
    body = completion(model="absent")  # 404 once past authentication: no engine needed
    async with client.post(f"{url}{path}", json=body, headers=headers) as resp:
        return resp.status


async def wait_for_status(client, url: str, key: str, expected: int, bound_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if await status_with(client, url, key, "/v1/completions") == expected:
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"key {key!r} did not get {expected} within {bound_s} s")


async def test_keys_reload_on_secret_symlink_swap_and_bad_update_keeps_old_keys(
    gw, client, tmp_path, caplog
):
    secret = MountedSecret(tmp_path / "secret")
    secret.update("old-key\n")
    settings = {"api_keys_file": secret.path, "api_keys_poll_interval_seconds": 0.1}
    url = await gw([pool("m", [DEAD])], **settings)
    assert await status_with(client, url, "old-key", "/v1/completions") == 404
    assert await status_with(client, url, "new-key", "/v1/completions") == 401

    secret.update("# rotated\nnew-key\n")
    took = await wait_for_status(client, url, "new-key", 404, bound_s=2)
    assert took < 1.0  # within a few poll intervals (0.1 s)
    assert await status_with(client, url, "old-key", "/v1/completions") == 401

    caplog.set_level("ERROR")
    secret.update("# emptied by mistake\n")
    await asyncio.sleep(0.5)
    assert "keeping the previous API keys" in caplog.text
    assert await status_with(client, url, "new-key", "/v1/completions") == 404

    secret.path.resolve().write_text("third-key\n")  # an in-place rewrite counts too
    await wait_for_status(client, url, "third-key", 404, bound_s=2)
    assert await status_with(client, url, "new-key", "/v1/completions") == 401


@pytest.mark.parametrize("protect", [False, True])
async def test_metrics_behind_keys_by_setting(gw, client, tmp_path, protect):
    keys = tmp_path / "keys"
    keys.write_text("metrics-key\n")
    url = await gw([pool("m", [DEAD])], api_keys_file=keys, metrics_require_api_key=protect)
    async with client.get(f"{url}/metrics") as resp:
        assert resp.status == (401 if protect else 200)
    assert await status_with(client, url, "metrics-key", "/metrics") == 200
    assert await status_with(client, url, "wrong", "/metrics") == (401 if protect else 200)
    for probe in ("/health", "/ready"):
        async with client.get(f"{url}{probe}") as resp:
            assert resp.status != 401


async def test_ready_details_only_with_a_key(gw, client, tmp_path):
    """Probes carry no key: /ready answers them the bare status; the pools and their endpoint
    counts only to a caller with a key (without a keys file, to everyone, as before)."""
    keys = tmp_path / "keys"
    keys.write_text("ops-key\n")
    url = await gw([pool("secret-model", [DEAD])], api_keys_file=keys)
    async with client.get(f"{url}/ready") as resp:
        assert resp.status in (200, 503)
        assert await resp.json() == {"ready": resp.status == 200}
    async with client.get(f"{url}/ready", headers={"Authorization": "Bearer ops-key"}) as resp:
        assert "secret-model" in (await resp.json())["pools"]
    async with client.get(f"{url}/ready", headers={"Authorization": "Bearer wrong"}) as resp:
        assert "pools" not in await resp.json()


def test_keys_compare_digests_whatever_the_lengths(tmp_path):
    from slotserve.gateway.http.api_keys import ApiKeys

    keys = tmp_path / "keys"
    keys.write_text("sk-the-real-key\nshort\n")
    api_keys = ApiKeys(keys)
    assert api_keys.accepts("Bearer sk-the-real-key") and api_keys.accepts("Bearer short")
    for wrong in ("sk-the-real-ke", "sk-the-real-key!", "", "x" * 10_000, "shor"):
        assert not api_keys.accepts(f"Bearer {wrong}")
    # Every comparison is of two SHA-256 digests: equal lengths, whatever the token's length.
    assert {len(digest) for digest in api_keys._digests} == {32}
