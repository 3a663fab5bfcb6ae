"""The static decode step's inputs: one device-resident block per batch-size bucket.

A captured step (a CUDA graph) replays fixed kernels on fixed addresses, so its inputs cannot be
fresh tensors: every bucket of rows (1, 2, 4, ... up to the slots) owns one ``[NUM_COLUMNS,
rows]`` int64 block on the device, written by one copy per step from a host staging block of the
same shape (pinned, so the copy is asynchronous on CUDA). Float columns travel as the bits of
float64 values in the same block (a view of the same storage), so one copy moves everything.
Rows past the step's own are padding: token 0 at position 0 of the scratch slot, greedy.

Every host-device transfer of the static step goes through :class:`Transfers`: the two it
allows per step are counted there, and :mod:`slotserve.engine.core.host_sync` turns any other
into a test failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

# Row layout of an input block (int64 columns, then float64 bits).
TOKEN, POSITION, SLOT, TOP_K, SEED, FLAGS, PROMPT_LEN = range(7)
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(7, 13)
NUM_COLUMNS = 13
# FLAGS bits.
GREEDY = 1
BAN_EOS = 2  # min_tokens not reached: EOS ids are banned for this row


def bucket_sizes(num_slots: int) -> tuple[int, ...]:
    """Powers of two below ``num_slots``, then ``num_slots`` itself."""
    sizes = []
    size = 1
    while size < num_slots:
        sizes.append(size)
        size *= 2
    return (*sizes, num_slots)


def kv_buckets(max_model_len: int, smallest: int = 256) -> tuple[int, ...]:
    """Attention spans the step's longest row rounded up to one of these: reading every row to
    ``max_model_len`` would cost a long-context read at every short step."""
    sizes = []
    size = min(smallest, max_model_len)
    while size < max_model_len:
        sizes.append(size)
        size *= 2
    return (*sizes, max_model_len)


def pick(buckets: tuple[int, ...], need: int) -> int:
    for size in buckets:
        if size >= need:
            return size
    raise ValueError(f"{need} exceeds the largest bucket {buckets[-1]}")


@dataclass
class Transfers:
    """The static step's only host-device transfers: one copy in, one copy out, counted."""

    num_to_device: int = 0
    num_to_host: int = 0
    num_set_ups: int = 0  # penalty rows rebuilt for a new owner (not in the steady state)
    active: bool = field(default=False, repr=False)  # inside an allowed transfer

    @contextmanager
    def _allowed(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def to_device(self, host: torch.Tensor, device_block: torch.Tensor) -> None:
        with self._allowed():
            # From pinned memory this returns at once on CUDA; the host block is written again
            # only after the step's result came back, when this copy has long finished.
            device_block.copy_(host, non_blocking=host.is_pinned())
        self.num_to_device += 1

    def set_up(self, host: torch.Tensor, device_row: torch.Tensor) -> None:
        with self._allowed():
            device_row.copy_(host)
        self.num_set_ups += 1

    def to_host(self, result: torch.Tensor) -> list[list[float]]:
        with self._allowed():
            rows: list[list[float]] = result.tolist()
        self.num_to_host += 1
        return rows


@dataclass
class StepBuffers:
    """One bucket's input block: the device copy the step reads and its host staging twin."""

    rows: int
    device_block: torch.Tensor  # [NUM_COLUMNS, rows] int64
    device_floats: torch.Tensor  # the same storage as float64
    host_block: torch.Tensor
    host_ints: np.ndarray
    host_floats: np.ndarray

    @classmethod
    def allocate(cls, rows: int, device: torch.device) -> StepBuffers:
        device_block = torch.zeros((NUM_COLUMNS, rows), dtype=torch.int64, device=device)
        host_block = torch.zeros(
            (NUM_COLUMNS, rows), dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        host_ints = host_block.numpy()
        return cls(
            rows=rows,
            device_block=device_block,
            device_floats=device_block.view(torch.float64),
            host_block=host_block,
            host_ints=host_ints,
            host_floats=host_ints.view(np.float64),
        )

    def stage(
        self, columns: dict[int, list[int]], floats: dict[int, list[float]], scratch: int
    ) -> None:
        """Write the step's rows into the host block; the rest become padding rows."""
        n = len(columns[TOKEN])
        ints, reals = self.host_ints, self.host_floats
        for column, values in columns.items():
            ints[column, :n] = values
        for column, reals_in in floats.items():
            reals[column, :n] = reals_in
        if n < self.rows:
            ints[:, n:] = 0
            ints[SLOT, n:] = scratch
            ints[FLAGS, n:] = GREEDY
            reals[TEMPERATURE, n:] = 1.0
            reals[TOP_P, n:] = 1.0
            reals[MIN_P, n:] = 0.0
            reals[REPETITION, n:] = 1.0
            reals[FREQUENCY, n:] = 0.0
            reals[PRESENCE, n:] = 0.0
