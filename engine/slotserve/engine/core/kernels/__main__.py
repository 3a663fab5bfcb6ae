"""``python -m slotserve.engine.core.kernels``: build the native kernels into the cache now.

Images run it at build time, so that engines on a read-only root filesystem find the library.
"""

from __future__ import annotations

import sys

from slotserve.engine.core.kernels import KernelUnavailable, load_kernels
from slotserve.settings import CommonSettings

try:
    kernels = load_kernels(CommonSettings().home)
except KernelUnavailable as exc:
    print(f"slotserve kernels: {exc}", file=sys.stderr)
    sys.exit(2)
print(kernels.build.path)
