"""Typed settings shared by every part, the rule that flags override the environment, and the
start of every command: settings from flags, one log format."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

SettingsT = TypeVar("SettingsT", bound=BaseSettings)


class CommonSettings(BaseSettings):
    """Settings every slotserve command reads (env prefix ``SLOTSERVE_``)."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_", extra="ignore")

    home: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "slotserve",
        description="Cache folder for pulled models and downloaded tools.",
    )


def settings_from_args(cls: type[SettingsT], args: argparse.Namespace) -> SettingsT:
    """Build ``cls`` from the environment, overridden by every flag the user actually gave.

    Flags are declared with ``default=None`` so that "not given" is distinguishable from a value;
    only fields that ``cls`` declares are taken from ``args``.
    """
    given = {
        name: value
        for name, value in vars(args).items()
        if value is not None and name in cls.model_fields
    }
    return cls(**given)


def cli_settings(cls: type[SettingsT], args: argparse.Namespace, prog: str) -> SettingsT | None:
    """:func:`settings_from_args` for a command's ``main``: on invalid values, print why to
    stderr (prefixed with ``prog``) and return None, for the command to exit with status 2."""
    try:
        return settings_from_args(cls, args)
    except ValidationError as error:
        print(f"{prog}: invalid settings:\n{error}", file=sys.stderr)
        return None


def configure_logging(level: str) -> None:
    """One log format for every slotserve process."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
