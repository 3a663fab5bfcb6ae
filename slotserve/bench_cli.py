"""``slotserve bench NAME [ARGS...]``: run a benchmark script from the checkout's bench/ folder."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def available() -> list[str]:
    """Benchmark names (script stems) found in bench/."""
    if not BENCH_DIR.is_dir():
        return []
    # The shared library is bench/lib/; a module here counts only if it runs as a script.
    return sorted(
        p.stem
        for p in BENCH_DIR.glob("*.py")
        if not p.name.startswith("_") and '__name__ == "__main__"' in p.read_text()
    )


def main(argv: list[str]) -> int:
    """Entry point of ``slotserve bench``."""
    names = available()
    if not argv or argv[0] in {"-h", "--help"}:
        listing = "\n".join(f"  {name}" for name in names) or "  (no bench/ folder here)"
        print(f"usage: slotserve bench NAME [ARGS...]\n\nbenchmarks:\n{listing}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"slotserve bench: unknown benchmark {name!r}; one of: {', '.join(names)}")
        return 2
    script = BENCH_DIR / f"{name}.py"
    sys.argv = [str(script), *rest]
    # The scripts import their shared library as the package `bench.lib`, from the checkout's
    # root (on the path already through the editable install; added for any other install).
    root = str(BENCH_DIR.parent)
    if root not in sys.path:
        sys.path.append(root)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0
