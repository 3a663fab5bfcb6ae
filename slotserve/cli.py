"""The ``slotserve`` command: one tool, a subcommand per job.

Each subcommand lives with the part it runs and parses its own flags, so the gateway image never
imports torch and a part can grow its flags without touching this file.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). The module exposes ``main(argv: list[str]) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "model": ("slotserve.models.cli", "pull and list models (slotserve model pull smollm2)"),
    "generate": ("slotserve.models.generate", "generate one answer locally, no server"),
    "engine": ("slotserve.engine.cli", "serve one model over the OpenAI API"),
    "gateway": ("slotserve.gateway.cli", "admit and route requests to engine pools"),
    "operator": ("slotserve.operator.cli", "run the Kubernetes operator (kopf)"),
    "up": ("slotserve.local.up", "run engines and a gateway on this machine"),
    "demo": ("slotserve.local.demo", "run the batching and admission demo end to end"),
    "bench": ("slotserve.bench_cli", "run a benchmark from bench/"),
}


def _usage() -> str:
    lines = ["usage: slotserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'slotserve COMMAND --help' for a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand's ``main``; returns the process exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from importlib.metadata import version

        print(version("slotserve"))
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"slotserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
