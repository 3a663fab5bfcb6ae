"""A controllable engine double over real HTTP, for the gateway's admission tests and benchmark.

It speaks the engine's HTTP surface the gateway relies on (``GET /load``, ``POST
/v1/completions``, ``POST /v1/chat/completions`` with SSE streaming, the slot headers) and
RECORDS what a real engine would feel: the peak number of sequences in flight at once (a
request asking for ``n`` choices runs ``n``, one slot each, as the real engine does), the order
in which prompts arrived, and how many requests were aborted by a closed connection. It never
pretends to generate text: answers are fixed strings. A request can ask it to fail the way a
broken engine does (``x_fail``, after ``x_fail_after`` stream chunks; see ``FAILURES``). Run it
as a process:

    python tests/gateway/gateway_engine_double.py --port 9001 --slots 2 --delay 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

STATE = web.AppKey("state", dict)

# x_fail: how to fail. Streams: "error_event" (the engine's OpenAI-shaped error event, then the
# end without [DONE], as the real engine does), "drop" (connection cut after whole events),
# "partial" (cut in the middle of an event), "eof" (a clean end without [DONE]), "stall" (silent
# for x_stall seconds, then carry on). Non-streaming: "drop" (half the body, then cut), "stall"
# (silent before answering), "error_500" (an error status with an OpenAI body).
FAILURES = ("error_event", "drop", "partial", "eof", "stall", "error_500")
ENGINE_ERROR = {
    "error": {"message": "NaN in logits", "type": "server_error", "code": "engine_failed"}
}


def _prompt_of(payload: dict) -> str:
    if "messages" in payload:
        messages = payload.get("messages") or [{}]
        return str(messages[-1].get("content", ""))
    return str(payload.get("prompt", ""))


def _envelope(s: dict, kind: str, choice: dict) -> dict:
    """The OpenAI response (or stream chunk) around one choice."""
    return {
        "id": "cmpl-double",
        "object": kind,
        "created": int(time.time()),
        "model": s["model"],
        "choices": [choice],
    }


def cut(request: web.Request) -> None:
    """Break the connection mid-answer, as a crashing engine does."""
    assert request.transport is not None  # a request being answered has its connection
    request.transport.abort()


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def load(request: web.Request) -> web.Response:
    s = request.app[STATE]
    s["num_load_polls"] += 1  # so a test can tell an address was never even polled
    running = min(s["inflight"], s["slots"])
    return web.json_response(
        {
            "model": s["model"],
            "policy": "continuous",
            "slots_total": s["slots"],
            "slots_free": max(0, s["slots"] - s["inflight"]),
            "running": running,
            "waiting": max(0, s["inflight"] - s["slots"]),
            "kv_cache_usage": running / s["slots"],
            "draining": False,
            "prefix_keys": s["prefix_keys"],
        }
    )


async def completion(request: web.Request) -> web.StreamResponse:
    s = request.app[STATE]
    if s["fail"] == "503":
        return web.json_response({"error": {"message": "draining"}}, status=503)
    payload = await request.json()
    n = payload.get("n")
    num_sequences = n if isinstance(n, int) and n > 1 else 1  # one slot per choice
    if (
        num_sequences > s["slots"]
    ):  # the real engine's answer (slotserve/engine/http/openai_routes.py)
        error = {"message": f"'n' ({n}) exceeds this engine's slots", "param": "n"}
        return web.json_response({"error": error}, status=400)
    # A request its client gave up on (the gateway then frees its slot) ends here when the
    # loop runs its cancellation; the real engine drops it at the next step, before admitting
    # this one. Let pending cancellations run first, as that step would, then count.
    for _ in range(3):
        await asyncio.sleep(0)
    s["inflight"] += num_sequences
    s["max_inflight"] = max(s["max_inflight"], s["inflight"])
    s["num_requests"] += 1
    s["arrivals"].append(_prompt_of(payload))
    delay = float(payload.get("x_delay", s["delay"]))
    num_chunks = int(payload.get("max_tokens", 4))
    chat = request.path.endswith("chat/completions")
    headers = {
        "x-slotserve-slots-total": str(s["slots"]),
        "x-slotserve-slots-free": str(max(0, s["slots"] - s["inflight"])),
    }
    fail = payload.get("x_fail")
    fail_after = int(payload.get("x_fail_after", 2))
    try:
        if not payload.get("stream"):
            if fail == "error_500":
                return web.json_response(ENGINE_ERROR, status=500, headers=headers)
            if fail == "stall":
                await asyncio.sleep(float(payload.get("x_stall", 60)))
            if delay:
                await asyncio.sleep(delay)
            text = "ok " * num_chunks
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            body = _envelope(s, "chat.completion" if chat else "text_completion", choice)
            body["usage"] = {
                "prompt_tokens": 1,
                "completion_tokens": num_chunks,
                "total_tokens": 1 + num_chunks,
            }
            if fail == "drop":
                data = json.dumps(body).encode()
                resp = web.StreamResponse(headers={**headers, "Content-Type": "application/json"})
                resp.content_length = len(data)
                await resp.prepare(request)
                await resp.write(data[: len(data) // 2])
                cut(request)
                return resp
            return web.json_response(body, headers=headers)
        resp = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for i in range(num_chunks):
            if fail and i == fail_after:
                return await _fail_stream(request, resp, fail, payload)
            await asyncio.sleep(delay / max(num_chunks, 1))
            piece = f"t{i} "
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            chunk = _envelope(s, "chat.completion.chunk" if chat else "text_completion", choice)
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        s["num_aborted"] += 1
        raise
    finally:
        s["inflight"] -= num_sequences


async def _fail_stream(
    request: web.Request, resp: web.StreamResponse, fail: str, payload: dict
) -> web.StreamResponse:
    if fail == "error_event":
        await resp.write(f"data: {json.dumps(ENGINE_ERROR)}\n\n".encode())
    elif fail == "stall":
        await asyncio.sleep(float(payload.get("x_stall", 60)))
        await resp.write(b"data: [DONE]\n\n")
    elif fail == "partial":
        await resp.write(b'data: {"id": "cmpl-double", "choi')
        await asyncio.sleep(0.05)  # let the half event leave before the cut
        cut(request)
        return resp
    elif fail == "drop":
        await asyncio.sleep(0.05)
        cut(request)
        return resp
    await resp.write_eof()  # error_event and eof: a clean end, but no [DONE]
    return resp


async def stats(request: web.Request) -> web.Response:
    s = request.app[STATE]
    return web.json_response(dict(s))


async def control(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = await request.json()
    if body.get("reset"):
        s.update(max_inflight=0, num_requests=0, num_aborted=0, arrivals=[])
    for key in ("fail", "delay", "slots", "prefix_keys"):
        if key in body:
            s[key] = body[key]
    return web.json_response({"ok": True})


def create_double_app(
    slots: int = 2, delay: float = 0.05, model: str = "double"
) -> web.Application:
    app = web.Application()
    app[STATE] = {
        "slots": slots,
        "delay": delay,
        "model": model,
        "fail": None,
        "inflight": 0,
        "max_inflight": 0,
        "num_requests": 0,
        "num_aborted": 0,
        "num_load_polls": 0,
        "arrivals": [],
        "prefix_keys": [],  # what its /load says its rows hold (set by a test: any value)
    }
    app.router.add_get("/load", load)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/control", control)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--model", default="double")
    args = parser.parse_args()
    app = create_double_app(args.slots, args.delay, args.model)
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
