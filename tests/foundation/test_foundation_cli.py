"""The command-line tool, settings precedence and the packaging layout."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from slotserve.cli import SUBCOMMANDS, main
from slotserve.models.generate import GenerateSettings
from slotserve.settings import settings_from_args

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_GENERATE_MAX_TOKENS", "7")
    monkeypatch.setenv("SLOTSERVE_GENERATE_TEMPERATURE", "0.5")
    args = argparse.Namespace(max_tokens=None, temperature=0.9, prompt="ignored")
    settings = settings_from_args(GenerateSettings, args)
    assert settings.max_tokens == 7  # from env: the flag was not given
    assert settings.temperature == 0.9  # the flag wins over env


def test_stdlib_operator_is_not_shadowed_from_the_checkout_root() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    proc = subprocess.run(
        [sys.executable, "-c", "import operator, numpy; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "site-packages" not in proc.stdout
    assert proc.stdout.strip().endswith("operator.py")
    assert str(ROOT / "operator") not in proc.stdout


def test_parts_import_under_the_slotserve_namespace() -> None:
    import slotserve.engine
    import slotserve.gateway
    import slotserve.operator

    assert Path(slotserve.engine.__file__).parent == ROOT / "engine" / "slotserve" / "engine"
    assert Path(slotserve.gateway.__file__).parent == ROOT / "gateway" / "slotserve" / "gateway"
    assert Path(slotserve.operator.__file__).parent == ROOT / "operator" / "slotserve" / "operator"


def test_editable_install_is_plain_path_entries() -> None:
    """Type checkers and IDEs follow .pth path lines, not import hooks: no finder may remain."""
    site = Path(slotserve_cli_file()).parents[1]
    pth_lines = {
        line.strip()
        for pth in Path(sys.prefix).glob("lib/python3*/site-packages/__editable__*slotserve*.pth")
        for line in pth.read_text().splitlines()
        if line.strip()
    }
    assert pth_lines == {
        str(site),
        str(ROOT / "engine"),
        str(ROOT / "gateway"),
        str(ROOT / "operator"),
    }


def slotserve_cli_file() -> str:
    import slotserve.cli

    return slotserve.cli.__file__


@pytest.mark.parametrize(
    ("folder", "wheel_glob", "present", "absent"),
    [
        (".", "slotserve-*.whl", ["slotserve/cli.py", "slotserve/models/pull.py"], ["engine"]),
        (
            "engine",
            "slotserve_engine-*.whl",
            ["slotserve/engine/core/model/runner.py"],
            ["gateway"],
        ),
        ("gateway", "slotserve_gateway-*.whl", ["slotserve/gateway/http/app.py"], ["engine"]),
        ("operator", "slotserve_operator-*.whl", ["slotserve/operator/handlers.py"], ["engine"]),
    ],
)
def test_each_part_is_its_own_wheel(
    tmp_path: Path, folder: str, wheel_glob: str, present: list[str], absent: list[str]
) -> None:
    # Built from a copy: setuptools leaves build/ beside the sources, and a stale build/lib
    # would both litter the checkout and slip removed modules into later wheels.
    source = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    if folder == ".":
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, source / name)
        shutil.copytree(ROOT / "slotserve", source / "slotserve", ignore=skip)
    else:
        shutil.copytree(ROOT / folder, source, ignore=skip)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        timeout=240,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob(wheel_glob)
    names = zipfile.ZipFile(wheel).namelist()
    for module in present:
        assert module in names, module
    # No namespace __init__ (each part would overwrite the others') and no other part's code.
    assert "slotserve/__init__.py" not in names
    for other in absent:
        assert not any(n.startswith(f"slotserve/{other}/") for n in names)
    assert not any(n.startswith(("operator/", "engine/", "gateway/", "tests/")) for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    if folder in ("gateway", "operator"):
        # Their images need no torch.
        assert not any(r.startswith("torch") for r in requires)


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [str(BIN / "slotserve"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
        check=True,
    )
    assert proc.stdout.strip() == "0.1.0"


def test_bench_lists_runnable_scripts_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("engine_bench", "engine_http_bench", "gateway_bench"):
        assert f"  {name}\n" in listed
    assert "engine_plots" not in listed  # a helper module, not a benchmark
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().out
