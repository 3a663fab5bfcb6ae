"""The static decode step's inputs: one device-resident block per batch-size bucket.

A captured step (a CUDA graph) replays fixed kernels on fixed addresses, so its inputs cannot be
fresh tensors: every bucket of rows (1, 2, 4, ... up to the slots) owns one ``[NUM_COLUMNS,
rows]`` int64 block on the device, written by one copy per step from a host staging block of the
same shape (pinned, so the copy is asynchronous on CUDA). Float columns travel as the bits of
float64 values in the same block (a view of the same storage), so one copy moves everything.
Rows past the step's own are padding: token 0 at position 0 of the scratch slot, greedy.

Every host-device transfer of the static step goes through :class:`Transfers`: the two it
allows per step are counted there, and :mod:`slotserve.engine.core.model.host_sync` turns any other
into a test failure. The result's copy back is started when the step is launched and waited for
later (:class:`PendingResult`), so with overlapped steps the host stages step N+1 while the
device still runs step N: each bucket therefore stages into two host blocks in turn (the copy
from the one staged last may not have run yet).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

# Row layout of an input block (int64 columns, then float64 bits).
TOKEN, POSITION, SLOT, TOP_K, SEED, FLAGS, PROMPT_LEN, PREVIOUS_ROW = range(8)
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(8, 14)
NUM_COLUMNS = 14
# PREVIOUS_ROW of a row whose input token is in TOKEN; any other value: the row's input token is
# the one the previous step sampled in that row (still on the device: overlapped steps).
FROM_HOST = -1
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
class PendingResult:
    """A step's result on its way to the host: a non-blocking copy into pinned memory and the
    event that marks it done (CUDA); on a CPU the copy has already happened."""

    host: torch.Tensor
    event: torch.cuda.Event | None


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
            # two stagings later, after a later step's result came back (see StepBuffers).
            device_block.copy_(host, non_blocking=host.is_pinned())
        self.num_to_device += 1

    def set_up(self, host: torch.Tensor, device_row: torch.Tensor) -> None:
        with self._allowed():
            device_row.copy_(host)
        self.num_set_ups += 1

    def start_to_host(self, result: torch.Tensor) -> PendingResult:
        """Queue the copy of a step's result behind the step; returns at once on CUDA."""
        cuda = result.device.type == "cuda"
        with self._allowed():
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=cuda)
            host.copy_(result, non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
        return PendingResult(host, event)

    def wait_to_host(self, pending: PendingResult) -> list[list[float]]:
        """The result's rows, once its copy is done (the one wait for the device per step)."""
        with self._allowed():
            if pending.event is not None:
                pending.event.synchronize()
            rows: list[list[float]] = pending.host.tolist()
        self.num_to_host += 1
        return rows

    def to_host(self, result: torch.Tensor) -> list[list[float]]:
        return self.wait_to_host(self.start_to_host(result))


@dataclass
class StepBuffers:
    """One bucket's input block: the device copy the step reads and two host staging twins,
    used in turn."""

    rows: int
    device_block: torch.Tensor  # [NUM_COLUMNS, rows] int64
    device_floats: torch.Tensor  # the same storage as float64
    host_blocks: tuple[torch.Tensor, torch.Tensor]
    host_ints: tuple[np.ndarray, np.ndarray]  # numpy views of the host blocks
    current: int = 0  # the host block staged last

    @classmethod
    def allocate(cls, rows: int, device: torch.device) -> StepBuffers:
        device_block = torch.zeros((NUM_COLUMNS, rows), dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        host_blocks = tuple(
            torch.zeros((NUM_COLUMNS, rows), dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        )
        return cls(
            rows=rows,
            device_block=device_block,
            device_floats=device_block.view(torch.float64),
            host_blocks=(host_blocks[0], host_blocks[1]),
            host_ints=(host_blocks[0].numpy(), host_blocks[1].numpy()),
        )

    @property
    def host_block(self) -> torch.Tensor:
        return self.host_blocks[self.current]

    def stage(
        self, columns: dict[int, list[int]], floats: dict[int, list[float]], scratch: int
    ) -> None:
        """Write the step's rows into the next host block; the rest become padding rows.
        Columns left out of ``columns`` hold their defaults (PREVIOUS_ROW: FROM_HOST)."""
        self.current = 1 - self.current
        n = len(columns[TOKEN])
        ints = self.host_ints[self.current]
        reals = ints.view(np.float64)
        if PREVIOUS_ROW not in columns:
            ints[PREVIOUS_ROW, :n] = FROM_HOST
        for column, values in columns.items():
            ints[column, :n] = values
        for column, reals_in in floats.items():
            reals[column, :n] = reals_in
        if n < self.rows:
            ints[:, n:] = 0
            ints[SLOT, n:] = scratch
            ints[FLAGS, n:] = GREEDY
            ints[PREVIOUS_ROW, n:] = FROM_HOST
            reals[TEMPERATURE, n:] = 1.0
            reals[TOP_P, n:] = 1.0
            reals[MIN_P, n:] = 0.0
            reals[REPETITION, n:] = 1.0
            reals[FREQUENCY, n:] = 0.0
            reals[PRESENCE, n:] = 0.0
