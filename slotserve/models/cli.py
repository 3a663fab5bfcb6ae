"""``slotserve model``: pull and list models."""

from __future__ import annotations

import argparse

from slotserve.models.pull import KNOWN_MODELS, ModelPullError, is_pulled, model_dir, pull_model
from slotserve.settings import CommonSettings, settings_from_args


def main(argv: list[str]) -> int:
    """Entry point of ``slotserve model``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", default=None, help="cache folder (env SLOTSERVE_HOME)")
    parser = argparse.ArgumentParser(prog="slotserve model", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    pull = sub.add_parser(
        "pull", parents=[common], help="download and convert a known model (no-op when present)"
    )
    pull.add_argument("name", choices=sorted(KNOWN_MODELS))
    pull.add_argument("--quiet", action="store_true", help="no progress display")
    sub.add_parser("list", parents=[common], help="known models and whether they are pulled")
    args = parser.parse_args(argv)
    home = settings_from_args(CommonSettings, args).home

    if args.action == "pull":
        try:
            path = pull_model(args.name, home=home, show_progress=not args.quiet)
        except ModelPullError as exc:
            print(f"slotserve model pull: {exc}")
            return 1
        print(path)
        return 0
    for name, source in sorted(KNOWN_MODELS.items()):
        state = f"pulled: {model_dir(name, home)}" if is_pulled(name, home) else "not pulled"
        print(f"{name:<10} {source.description} [{state}]")
    return 0
