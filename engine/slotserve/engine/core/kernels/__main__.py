"""``python -m slotserve.engine.core.kernels [--prebuilt]``: build the native kernels now.

``--prebuilt`` (images, at build time, as root): compile into the package's read-only
``prebuilt/`` folder, which engines look in first, so that pods start without a compiler.
Without it: find or compile the library as an engine would (under ``SLOTSERVE_HOME``).
``--lint`` (``make lint``): compile the sources with ``-Wall -Wextra -Werror`` into nothing.
Exit status 2 with one line when no library can be had (or, with ``--lint``, on a warning).
"""

from __future__ import annotations

import argparse
import sys

from slotserve.engine.core.kernels import KernelUnavailable, load_kernels, load_library, prebuild
from slotserve.engine.core.kernels.library import lint
from slotserve.settings import CommonSettings

parser = argparse.ArgumentParser(prog="python -m slotserve.engine.core.kernels")
parser.add_argument(
    "--prebuilt", action="store_true", help="compile into the image's read-only prebuilt folder"
)
parser.add_argument(
    "--lint", action="store_true", help="compile with -Wall -Wextra -Werror, into nothing"
)
args = parser.parse_args()
if args.lint:
    try:
        lint()
    except KernelUnavailable as exc:
        print(f"slotserve kernels: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
try:
    if args.prebuilt:
        path = prebuild()
        # Load it as an engine would (the prebuilt folder first): proves it verifies and loads.
        loaded = load_library(CommonSettings().home)
        if loaded.build.origin != "prebuilt":
            raise KernelUnavailable(f"{path} was compiled but is not what engines would load")
    else:
        path = load_kernels(CommonSettings().home).build.path
except KernelUnavailable as exc:
    print(f"slotserve kernels: {exc}", file=sys.stderr)
    sys.exit(2)
print(path)
