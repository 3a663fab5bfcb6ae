"""Turn what a user names as a model into something ``from_pretrained`` can load."""

from __future__ import annotations

from pathlib import Path

from slotserve.models.pull import KNOWN_MODELS, pull_model


class ModelNotFoundError(ValueError):
    """The source is neither a known model, nor a local folder with a config.json."""


def resolve_model(source: str, home: Path | None = None, show_progress: bool = False) -> str:
    """Return a local folder (or hub id) for ``source``.

    ``source`` is a known name such as ``smollm2`` (pulled on first use), a local Hugging Face
    folder, or a hub id (``org/name``) for machines that reach a hub.
    """
    if source in KNOWN_MODELS:
        return str(pull_model(source, home=home, show_progress=show_progress))
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but holds no config.json")
        return str(path.resolve())
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFoundError(
            f"model {source!r} is not a known name ({known}), a local folder, or a hub id"
        )
    return source


def default_served_name(source: str) -> str:
    """The name clients send in the OpenAI ``model`` field when none is configured."""
    if source in KNOWN_MODELS:
        return source
    return Path(source.rstrip("/")).name or source
