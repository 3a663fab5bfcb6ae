"""lm-evaluation-harness (pinned) in a venv of its own, for the client tests.

Its ~35 dependencies (datasets, pyarrow, pandas, scikit-learn, nltk, ...; ~150 MB of wheels)
stay out of the project's .venv: the venv lives in the slotserve cache folder, is built once per
machine by the project's uv (~15 s; pip took ~3 minutes on a fresh machine; later runs reuse it),
and sees the project's .venv through a ``.pth`` file, so torch and transformers are the project's
pinned ones (lm-eval's own dependencies are installed with the project's constraints: the
packages both need are the same versions in either folder). The ``.pth`` is rewritten on every
use: a CI clone's .venv sits in another folder than the one that built the venv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from slotserve.settings import CommonSettings

LM_EVAL = "lm-eval[api]==0.4.13"
ROOT = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).with_name("lm_eval_tasks")
DRIVER = Path(__file__).with_name("lm_eval_driver.py")


class LmEvalUnavailableError(RuntimeError):
    """The venv could not be built (no registry reachable): the tests skip, saying why."""


def lm_eval_venv() -> Path:
    """The venv's folder, built on first use (raises LmEvalUnavailableError when it cannot be)."""
    venv = CommonSettings().home / "venvs" / "lm-eval-0.4.13"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _link_project_venv(venv)
    if not stamp.exists():
        # uv reads no pip configuration: the find-links folders pip has (a machine's own
        # wheels) are handed on, as the Makefile does for the project's venv.
        links = [arg for folder in pip_find_links() for arg in ("--find-links", folder)]
        result = subprocess.run(
            [str(Path(sys.executable).with_name("uv")), "pip", "install", "--quiet",
             "--python", str(python), *links, "-c", str(ROOT / "constraints.txt"), LM_EVAL],
            capture_output=True, text=True, timeout=1500,
        )  # fmt: skip
        if result.returncode != 0:
            raise LmEvalUnavailableError(
                f"uv pip install {LM_EVAL} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        stamp.write_text(LM_EVAL + "\n")
    return venv


def pip_find_links() -> list[str]:
    """The find-links folders pip is configured with (its files and PIP_FIND_LINKS)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    values = re.findall(r"find-links='([^']*)'", listed)
    return sorted({folder for value in values for folder in value.split()})


def _link_project_venv(venv: Path) -> None:
    site = next((venv / "lib").glob("python3*/site-packages"))
    project_site = sysconfig.get_paths()["purelib"]
    (site / "slotserve-project.pth").write_text(project_site + "\n")


def run_lm_eval(venv: Path, model_args: str, out: Path, tasks: str, timeout: float = 600) -> Path:
    """lm-eval offline on the shipped tasks (``lm_eval_driver.py``: ``lm-eval run`` less its index
    of the built-in tasks); returns the folder of its samples."""
    # The venv is installed without bytecode (pip would compile every module of ~35 packages, most
    # never imported, ~25 s of CPU); the first run writes it for what lm-eval imports.
    env = {
        **{key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"},
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    argv = [str(venv / "bin" / "python"), str(DRIVER), model_args, str(out), tasks, str(TASKS)]
    result = subprocess.run(
        argv, cwd=TASKS, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(f"lm-eval failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    (folder,) = [path for path in out.iterdir() if path.is_dir() and path.name != "datasets-cache"]
    return folder
