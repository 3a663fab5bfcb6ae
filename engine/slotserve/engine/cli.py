"""``slotserve engine``: serve one model over the OpenAI API.

Every ``EngineSettings`` field has a flag (``max_batch_size`` -> ``--max-batch-size``), generated
from the settings class so the two never drift apart; flags override ``SLOTSERVE_ENGINE_*``.
Settings that cannot run here end the process with status 2 and one line on stderr, before the
model loads: invalid values, and ``--device cuda`` without a usable GPU (never a silent fall back
to the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
import types
import warnings
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from slotserve.contracts.engine_argv import flag_name
from slotserve.engine.core.openmp import apply_openmp_environment
from slotserve.engine.settings import EngineSettings
from slotserve.settings import cli_settings, configure_logging
from slotserve.tracing import TracingUnavailableError, tracer_provider_from_env

ENV_PREFIX = EngineSettings.model_config["env_prefix"]


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _flag_kwargs(name: str, field: FieldInfo) -> dict[str, Any]:
    annotation = _strip_optional(field.annotation)
    default = field.get_default(call_default_factory=True)
    doc = field.description or ""
    kwargs: dict[str, Any] = {
        "dest": name,
        "default": None,
        "help": f"{doc} (env {ENV_PREFIX}{name.upper()}; default {default!r})".strip(),
    }
    origin = get_origin(annotation)
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        choices = list(get_args(annotation))
        kwargs.update(choices=choices, type=type(choices[0]))
    elif origin is list:
        (item,) = get_args(annotation) or (str,)
        kwargs.update(nargs="*", type=item, metavar=item.__name__.upper())
    elif annotation in (int, float, str):
        kwargs["type"] = annotation
    else:
        kwargs["type"] = str  # pydantic converts it (paths and the like)
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve engine",
        description="Serve one model over the OpenAI API with continuous batching.",
    )
    for name, field in EngineSettings.model_fields.items():
        parser.add_argument(flag_name(name), **_flag_kwargs(name, field))
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Logging level (default INFO).",
    )
    return parser


def device_problem(device: str) -> str | None:
    """Why the engine cannot compute on ``device`` (``cuda``, ``cuda:N``) here; None when it
    can, and for every other device (``auto`` picks at load, ``cpu`` always works)."""
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        return None
    import torch

    index = int(match[1] or 0)
    if torch.version.cuda is None:
        return f"--device {device}: no usable GPU (torch {torch.__version__} has no CUDA)"
    # A driver that does not match, or no device node, is a warning of torch's: say it here.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count <= index:
        said = [str(warning.message).strip().splitlines()[0] for warning in caught]
        why = said[0] if said else f"torch sees {count} CUDA device{'s' * (count != 1)}"
        return f"--device {device}: no usable GPU ({why})"
    try:
        torch.empty(1, device=device)  # the context: a broken or busy GPU fails here
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0]
        return f"--device {device}: GPU {index} is not usable ({first_line})"
    return None


def main(argv: list[str]) -> int:
    """Parse flags, build ``EngineSettings`` and serve until SIGTERM, then exit the process."""
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = cli_settings(EngineSettings, args, "slotserve engine")
    if settings is None:
        return 2
    configure_logging(args.log_level)
    try:
        tracer_provider = tracer_provider_from_env("slotserve-engine", os.environ)
    except TracingUnavailableError as error:
        print(f"slotserve engine: {error}", file=sys.stderr)
        return 2
    # Before anything imports torch (the model loads in serve): libgomp reads it then.
    apply_openmp_environment()
    problem = device_problem(settings.device)
    if problem is not None:
        print(f"slotserve engine: cannot start: {problem}", file=sys.stderr)
        return 2
    from slotserve.engine.http.server import serve  # imports torch: only once flags are valid

    exit_code = asyncio.run(serve(settings, tracer_provider))
    # Everything is closed by now; skip interpreter teardown, which spends seconds freeing the
    # model and joining torch's worker threads while the pod's grace period ticks.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
