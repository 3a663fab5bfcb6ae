"""Typed settings shared by every part, and the rule that flags override the environment."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

from pydantic import Field
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
