"""Counts host-device synchronisations on any device, CPU included (where none costs a thing).

A step that reads a value from the device (``item``, ``tolist``, ``bool(tensor)``, ``cpu()``),
builds a tensor from Python data (``torch.tensor(list, device=...)``), or runs an operation whose
output size depends on values (``nonzero``, ``masked_select``, ``unique``) waits for the device on
CUDA. :class:`HostSyncCounter` sees those calls through torch's function and dispatch modes and
sorts them: inside one of the static step's :class:`static_buffers.Transfers` (allowed) or
anywhere else (a finding, named). Device-agnostic, so a CPU test can fail on a sync that only a
GPU would feel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from slotserve.engine.core.model.static_buffers import Transfers

# Tensor methods and torch functions that read device values into Python, or Python data into
# a tensor.
SYNC_FUNCTIONS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "cpu",
        "numpy",
        "tensor",
        "as_tensor",
    }
)
# aten operations that wait for the device: a scalar read, or an output sized by values.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "unique",
        "_unique2",
        "unique_consecutive",
        "repeat_interleave",
    }
)


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_FUNCTIONS or (name in ("to", "copy_") and _crosses(args, kwargs)):
            self.counter.record(name)
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counter.record(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _crosses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``to``/``copy_`` between devices (never true on a CPU-only run: there, the allowed
    transfers are told apart by :class:`Transfers`, not by device)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    devices = {t.device for t in tensors}
    targets = [a for a in (*args, *kwargs.values()) if isinstance(a, (str, torch.device))]
    for target in targets:
        try:
            devices.add(torch.device(target))
        except (RuntimeError, TypeError):
            continue
    return len({device.type for device in devices}) > 1


class HostSyncCounter:
    """``with HostSyncCounter(transfers) as counter:``: ``counter.allowed`` counts sync points
    inside ``transfers``' copies, ``counter.others`` names every other one."""

    def __init__(self, transfers: Transfers | None = None) -> None:
        self.transfers = transfers
        self.allowed = 0
        self.others: list[str] = []
        self._modes = (_Functions(self), _Ops(self))

    def record(self, name: str) -> None:
        if self.transfers is not None and self.transfers.active:
            self.allowed += 1
        else:
            self.others.append(name)

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
