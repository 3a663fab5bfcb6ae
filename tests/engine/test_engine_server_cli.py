"""`slotserve engine` flags: one per EngineSettings field, overriding SLOTSERVE_ENGINE_* env."""

from __future__ import annotations

import pytest

from slotserve.engine.cli import build_parser, flag_name, main
from slotserve.engine.settings import EngineSettings
from slotserve.settings import settings_from_args


def settings_for(argv: list[str]) -> EngineSettings:
    return settings_from_args(EngineSettings, build_parser().parse_args(argv))


def test_every_setting_has_a_flag():
    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    missing = [name for name in EngineSettings.model_fields if flag_name(name) not in options]
    assert missing == []


def test_flags_reach_settings_with_their_types(tmp_path):
    settings = settings_for(
        [
            "--model", str(tmp_path),
            "--served-model-name", "tiny",
            "--policy", "dynamic",
            "--max-batch-size", "8",
            "--preferred-batch-sizes", "2", "4",
            "--max-queue-delay-microseconds", "500",
            "--kv-cache-memory-fraction", "0.25",
            "--drain-timeout-seconds", "2.5",
            "--dtype", "float32",
            "--quantization", "int8",
            "--port", "9123",
        ]
    )  # fmt: skip
    assert settings.model == str(tmp_path)
    assert settings.served_model_name == "tiny"
    assert settings.policy == "dynamic"
    assert settings.max_batch_size == 8
    assert settings.preferred_batch_sizes == [2, 4]
    assert settings.max_queue_delay_microseconds == 500
    assert settings.kv_cache_memory_fraction == 0.25
    assert settings.drain_timeout_seconds == 2.5
    assert settings.quantization == "int8"
    assert settings.port == 9123


def test_flags_override_env_and_env_fills_the_rest(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_ENGINE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("SLOTSERVE_ENGINE_POLICY", "static")
    settings = settings_for(["--max-batch-size", "16"])
    assert settings.max_batch_size == 16
    assert settings.policy == "static"


def test_unset_flags_keep_defaults():
    assert settings_for([]) == EngineSettings()


def test_invalid_values_exit_2_with_a_message(capsys):
    assert main(["--max-batch-size", "0", "--port", "1"]) == 2
    assert "max_batch_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--policy", "fastest"])
    assert info.value.code == 2


def test_an_unknown_quantization_exits_2_naming_the_choices(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        main(["--quantization", "int3"])
    assert info.value.code == 2
    assert "--quantization: invalid choice: 'int3'" in capsys.readouterr().err
    monkeypatch.setenv("SLOTSERVE_ENGINE_QUANTIZATION", "int3")
    assert main(["--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "quantization" in err and "'none', 'int8' or 'int4'" in err
