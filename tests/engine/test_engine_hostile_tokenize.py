"""The prompt tokenizer's worker process: same ids as the tokenizer, bounds before any work, the
lowest CPU priority, and a worker that dies costs only the prompts it held."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from transformers import AutoTokenizer

from slotserve.engine.core.tokenize import (
    TOKENIZER_NICENESS,
    ChatTemplateError,
    PromptTokenizer,
    PromptTooLongError,
    TokenizerUnavailableError,
)

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture
async def prompts(tokenizer):
    prompts = PromptTokenizer(tokenizer, MAX_MODEL_LEN)
    await prompts.start()
    yield prompts
    prompts.close()


def worker_process() -> psutil.Process:
    """The newest worker: an earlier test's may still be exiting beside it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = []
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                    workers.append(child)
        if workers:
            return max(workers, key=lambda worker: worker.create_time())
        time.sleep(0.1)
    raise AssertionError("no tokenizer worker process")


async def test_ids_are_the_tokenizers(prompts, tokenizer):
    for text in ["hello", "Héllo 日本語 🎉", "<|im_start|>user\nhi<|im_end|>", "a\x00b"]:
        assert await prompts.encode(text) == tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = tokenizer.encode(rendered, add_special_tokens=False)
    assert await prompts.encode_chat(messages) == want


async def test_what_cannot_fit_is_refused(prompts, tokenizer):
    assert prompts.max_prompt_chars == MAX_MODEL_LEN * 81  # SmolLM2's longest piece
    cases = [
        (prompts.encode("x" * (prompts.max_prompt_chars + 1)), "characters"),
        (prompts.encode("word " * MAX_MODEL_LEN), "more than 64 tokens"),
        (prompts.encode_chat([{"role": "user", "content": "hi"}] * 65), "65 messages"),
        (prompts.encode_chat([{"role": "user", "content": "word " * 60}]), "more than 64 tokens"),
    ]
    for call, words in cases:
        with pytest.raises(PromptTooLongError, match=words) as caught:
            await call
        assert caught.value.param in {"prompt", "messages"}


async def test_a_template_that_refuses_is_a_chat_template_error(prompts):
    with pytest.raises(ChatTemplateError) as caught:
        await prompts.encode_chat([{"role": "user", "content": "hi"}, {"role": 5, "content": "x"}])
    assert caught.value.param == "messages"


async def test_start_returns_once_the_worker_has_loaded_and_lowered_its_priority(prompts):
    """The engine takes work only once its worker answers; the worker loads at normal priority
    (at nice 19 on busy cores its imports took over a minute) and drops to 19 when ready."""
    assert worker_process().nice() == TOKENIZER_NICENESS  # no prompt sent yet


async def test_the_worker_runs_at_the_lowest_priority(prompts):
    await prompts.encode("warm")
    assert worker_process().nice() == TOKENIZER_NICENESS
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the engine itself keeps its priority


async def test_a_dead_worker_fails_its_prompts_and_the_next_starts_a_new_one(prompts, tokenizer):
    await prompts.encode("warm")
    first = worker_process()
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    with pytest.raises(TokenizerUnavailableError):
        await prompts.encode("hello")
    assert await prompts.encode("hello") == tokenizer.encode("hello")
    assert worker_process().pid != first.pid


def test_the_worker_exits_with_its_engine(tokenizer, tmp_path):
    """An engine that ends with os._exit (as the CLI does) or is killed leaves no worker."""
    script = tmp_path / "engine.py"
    script.write_text(
        "import asyncio, os, sys\n"
        "from transformers import AutoTokenizer\n"
        "from slotserve.engine.core.tokenize import PromptTokenizer\n"
        "if __name__ == '__main__':\n"
        "    prompts = PromptTokenizer(AutoTokenizer.from_pretrained(sys.argv[1]), 64)\n"
        "    asyncio.run(prompts.start())\n"
        "    print(asyncio.run(prompts.encode('hi')), flush=True)\n"
        "    sys.stdin.readline()\n"
        "    os._exit(0)\n"
    )
    engine = psutil.Popen(
        [sys.executable, str(script), tokenizer.name_or_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert engine.stdout.readline().startswith(b"[")
    # The engine waits for the go before it exits: listed after its exit, its worker is no
    # longer its child (once seen on a busy machine: an empty list, the test proving nothing).
    workers = [c for c in engine.children() if "spawn_main" in " ".join(c.cmdline())]
    assert workers
    engine.stdin.write(b"exit\n")
    engine.stdin.close()
    engine.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


async def test_a_wait_behind_a_busy_worker_is_bounded(prompts, tokenizer, monkeypatch):
    await prompts.encode("warm")
    worker = worker_process()
    worker.suspend()  # a worker stuck behind a flood of huge prompts, as the caller sees it
    try:
        monkeypatch.setattr("slotserve.engine.core.tokenize.TOKENIZE_WAIT_SECONDS", 0.5)
        started = time.monotonic()
        with pytest.raises(TokenizerUnavailableError, match="waited over"):
            await prompts.encode("hello")
        assert time.monotonic() - started < 5
    finally:
        worker.resume()
    assert await prompts.encode("hello") == tokenizer.encode("hello")
