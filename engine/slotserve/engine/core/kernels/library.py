"""Where the compiled kernel library comes from, and why it is trusted before ``dlopen``.

Loading a shared library runs its code, so a library is only loaded from a folder nobody else
can write, and only when its bytes hash to what was recorded when it was compiled:

1. **The image's prebuilt folder** (``kernels/prebuilt/`` beside these sources, filled at image
   build by ``python -m slotserve.engine.core.kernels --prebuilt``): owned by root or this user,
   writable by nobody else. Found there, the engine starts without a compiler.
2. **The private cache** ``$SLOTSERVE_HOME/kernels``: owned by this user, mode 0700 (created so;
   a folder of ours that others could only read is tightened to 0700; one that others could
   write, or that someone else owns, is refused).
3. Otherwise a fresh private folder (``mkdtemp``: 0700, unpredictable name), compiled into and
   removed once loaded. A shared, predictable folder (the old ``$TMPDIR/slotserve-kernels``) is
   never looked in.

A library's name holds its key (the sources, flags, ABI, the variants compiled in and the
machine, so a shared home serves each architecture its own), and a sidecar ``<name>.json``
holds the sha256 of its bytes, written at compile time. The bytes are read and hashed through
the file descriptor that is then loaded (``/proc/self/fd``), so what was checked is what runs.
Any failure (no sidecar, hash mismatch, truncated or foreign file, wrong owner or mode, an
``OSError`` from ``dlopen``, another ABI) rejects that candidate: the next place, or a fresh
compile, follows, with one warning naming why.

The compiler is never taken from the environment: ``$CC`` and ``$PATH`` are ignored (a pool's
env could name any program). The engine runs ``gcc`` (else ``cc``) from ``/usr/local/bin``,
``/usr/bin`` or ``/bin``, resolved to its real path, which with every folder above it must be
owned by root (or this user) and writable by nobody else; it runs with a scrubbed environment
(no ``CPATH``, ``C_INCLUDE_PATH``, ``LIBRARY_PATH``, ``COMPILER_PATH``, ``GCC_EXEC_PREFIX``...),
and only when a library has to be compiled.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels.elf import elf_problem

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (
    HERE / "dispatch.c",
    HERE / "products.c",
    HERE / "wide_avx2.c",
    HERE / "quantized_rows.c",
    HERE / "quantize.c",
    HERE / "qgemm_avx512.c",
    HERE / "bf16_avx512.c",
    HERE / "quantized_bf16.c",
    HERE / "int16_vnni.c",
    HERE / "int16_avx2.c",
    HERE / "int16.c",
    HERE / "attention_block.c",
    HERE / "attention_bf16.c",
    HERE / "attention_amx.c",
    HERE / "gemm_amx.c",
    HERE / "kv_half.c",
    HERE / "attention.c",
    HERE / "llama_step.c",
)
# What the compiler is given: every source above, included into one translation unit.
UNIT = HERE / "library.c"
HEADER = HERE / "kernels.h"
HEADERS = (HEADER, HERE / "qgemm.h", HERE / "gemm.h", HERE / "int16.h")
# No -march: the library runs on any CPU of its machine type; wider instructions live in
# functions of their own (target attributes), chosen at run time from cpuid.
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=gnu11")
# `make lint` only: never in the runtime build, where another compiler's new warning must not
# turn the kernels off.
LINT_FLAGS = ("-Wall", "-Wextra", "-Werror")


def header_define(name: str, header: Path = HEADER) -> int:
    """The integer ``#define name`` of ``kernels.h``: the header is the one source of the
    numbers both sides must agree on (the C code uses the macro, Python this)."""
    found = re.search(rf"^#define\s+{name}\s+(\d+)\s*$", header.read_text(), re.MULTILINE)
    if found is None:
        raise KernelUnavailable(f"{header} defines no {name}")
    return int(found.group(1))


# The instruction sets the library has code for (besides plain C), part of its key.
TARGETS = ("avx2,fma", "avx512f,avx512bw,avx512vl,avx512dq", "avx512bf16")
PREBUILT = HERE / "prebuilt"
COMPILER_NAMES = ("gcc", "cc")
COMPILER_FOLDERS = (Path("/usr/local/bin"), Path("/usr/bin"), Path("/bin"))
# The compiler's whole environment: nothing a caller's env could point elsewhere.
COMPILER_PATH_VAR = "/usr/local/bin:/usr/bin:/bin"

Origin = Literal["prebuilt", "cached", "compiled"]


class KernelUnavailable(UnsupportedSettingError):
    """No trusted C compiler, or the build failed: the native products cannot run here."""


class Rejected(Exception):
    """A library (or its folder) that must not be loaded; the message says why."""


ABI = header_define("SLOTSERVE_KERNEL_ABI")
GROUP_SIZE = header_define("SLOTSERVE_KERNEL_GROUP")  # quantized weights per scale along K


@dataclass(frozen=True)
class Build:
    path: Path  # where it was loaded from (a private temporary folder is gone afterwards)
    origin: Origin
    seconds: float
    sha256: str

    @property
    def compiled(self) -> bool:
        return self.origin == "compiled"


def library_name() -> str:
    """``qgemm-<key>.so``: the key covers the sources, flags, ABI, compiled-in instruction sets
    and the machine type, never the compiler (so a cached or prebuilt library needs none)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, UNIT, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    arch = f"{platform.system()}-{platform.machine()}"
    digest.update(json.dumps([ABI, FLAGS, TARGETS, arch]).encode())
    return f"qgemm-{digest.hexdigest()[:16]}-{platform.machine()}.so"


# -- trust ---------------------------------------------------------------------------------------


def _euid() -> int:
    return os.geteuid()


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def _open_private_folder(folder: Path) -> int:
    """A descriptor on ``folder`` if this user owns it and nobody else can write it (a folder
    others may only read is tightened to 0700); raises :class:`Rejected`."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise Rejected(f"{folder}: {error.strerror or error}") from error
    info = os.fstat(fd)
    reason = None
    if info.st_uid != _euid():
        reason = f"{folder} is owned by uid {info.st_uid}, not this user ({_euid()})"
    elif _writable_by_others(info.st_mode):
        reason = f"{folder} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    if reason is not None:
        os.close(fd)
        raise Rejected(reason)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # ours and written by us only: what is in it is ours
    return fd


def _open_image_folder(folder: Path) -> int:
    """A descriptor on the image's prebuilt folder: owned by root or this user, writable by
    nobody else; raises :class:`Rejected`."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise Rejected(f"{folder}: {error.strerror or error}") from error
    info = os.fstat(fd)
    if info.st_uid not in (0, _euid()) or _writable_by_others(info.st_mode):
        os.close(fd)
        raise Rejected(
            f"{folder} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"
        )
    return fd


def _read_sidecar(folder_fd: int, name: str) -> str:
    """The sha256 recorded for library ``name`` at compile time."""
    try:
        fd = os.open(f"{name}.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd)
        with os.fdopen(fd, "rb") as file:
            record = json.loads(file.read(65536))
        return str(record["sha256"])
    except FileNotFoundError as error:
        raise Rejected(f"{name} has no {name}.json (no recorded hash)") from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise Rejected(f"{name}.json unreadable: {error}") from error


def _load_verified(folder_fd: int, folder: Path, name: str) -> tuple[ctypes.CDLL, str]:
    """``dlopen`` ``name`` from the trusted folder if its bytes hash to its sidecar's record:
    the file is opened once, and the descriptor that was hashed is the one loaded."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd)
    except FileNotFoundError:
        raise  # not built here: not a rejection
    except OSError as error:
        raise Rejected(f"{folder / name}: {error.strerror or error}") from error
    try:
        expected = _read_sidecar(folder_fd, name)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Rejected(f"{folder / name} is not a regular file")
        if info.st_uid not in (0, _euid()) or _writable_by_others(info.st_mode):
            raise Rejected(f"{folder / name} is owned by uid {info.st_uid} or writable by others")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read()
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise Rejected(f"{folder / name}: its sha256 is not the one recorded at compile time")
        why = elf_problem(data)
        if why is not None:  # dlopen of a truncated file can die of SIGBUS, not fail
            raise Rejected(f"{folder / name} does not load: {why}")
        through = f"/proc/self/fd/{fd}" if Path("/proc/self/fd").is_dir() else str(folder / name)
        try:
            lib = ctypes.CDLL(through)
        except OSError as error:
            raise Rejected(f"{folder / name} does not load: {error}") from error
        # dlopen knows a library by the name it was opened with: this descriptor stays open
        # while the library is loaded (the process's life), so its name is never reused.
        _HELD.append(fd)
        fd = -1
        try:
            abi = lib.slotserve_kernel_abi()
        except AttributeError as error:
            raise Rejected(f"{folder / name} is not a slotserve kernel library") from error
        if abi != ABI:
            raise Rejected(f"{folder / name} is ABI {abi}, not {ABI}")
        return lib, actual
    finally:
        if fd >= 0:
            os.close(fd)


_HELD: list[int] = []  # descriptors of the loaded libraries (see _load_verified)


# -- the compiler --------------------------------------------------------------------------------


def _trusted_path(path: Path) -> str | None:
    """Why ``path`` (resolved) is not a program only root or this user could have put there,
    or None when it is: it and every folder above it owned by them and writable by no one else."""
    for part in (path, *path.parents):
        try:
            info = part.stat()
        except OSError as error:
            return f"{part}: {error.strerror or error}"
        if info.st_uid not in (0, _euid()):
            return f"{part} is owned by uid {info.st_uid}"
        if _writable_by_others(info.st_mode):
            return f"{part} is writable by others"
    return None


def find_compiler() -> Path:
    """The system C compiler (never ``$CC`` or ``$PATH``); raises :class:`KernelUnavailable`."""
    refused = []
    for name in COMPILER_NAMES:
        for folder in COMPILER_FOLDERS:
            candidate = folder / name
            if not candidate.exists():
                continue
            real = candidate.resolve()
            # The folder it was found in too: a link there could be pointed anywhere.
            why = _trusted_path(folder) or _trusted_path(real)
            if why is None and os.access(real, os.X_OK):
                return real
            refused.append(f"{candidate} ({why or 'not executable'})")
    searched = ", ".join(str(folder) for folder in COMPILER_FOLDERS)
    raise KernelUnavailable(
        "the native kernels need a C compiler: no trusted gcc or cc in "
        f"{searched}{'; refused ' + '; '.join(refused) if refused else ''} (install gcc; "
        "$CC and $PATH are not used)"
    )


def _compile(compiler: Path, folder: Path, name: str) -> str:
    """Compile into ``folder`` (private) as ``name`` beside its sidecar; returns the sha256."""
    env = {"PATH": COMPILER_PATH_VAR, "LC_ALL": "C", "TMPDIR": str(folder)}
    try:
        version = subprocess.run(
            [str(compiler), "--version"], capture_output=True, text=True, timeout=30, env=env
        ).stdout.splitlines()[:1]
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            env["TMPDIR"] = scratch
            output = Path(scratch) / name
            done = subprocess.run(
                [str(compiler), *FLAGS, "-o", str(output), str(UNIT), "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
            if done.returncode != 0:
                raise KernelUnavailable(f"compiling the kernels failed:\n{done.stderr}")
            sha256 = hashlib.sha256(output.read_bytes()).hexdigest()
            sidecar = Path(scratch) / f"{name}.json"
            sidecar.write_text(
                json.dumps(
                    {
                        "sha256": sha256,
                        "compiler": str(compiler),
                        "compiler_version": version[0] if version else "",
                        "flags": list(FLAGS),
                        "targets": list(TARGETS),
                        "machine": platform.machine(),
                        "abi": ABI,
                    },
                    indent=2,
                )
            )
            # The library first, then its record: a reader between the two finds the old
            # record (or none), rejects the pair and compiles; it never loads unchecked bytes.
            os.replace(output, folder / name)
            os.replace(sidecar, folder / f"{name}.json")
    except subprocess.TimeoutExpired as error:
        raise KernelUnavailable(f"compiling the kernels took over {error.timeout} s") from error
    except OSError as error:
        raise KernelUnavailable(f"compiling the kernels in {folder} failed: {error}") from error
    return sha256


def lint() -> None:
    """Compile the sources as the runtime build does, plus :data:`LINT_FLAGS`, into nothing;
    raises :class:`KernelUnavailable` with the compiler's messages on any warning."""
    compiler = find_compiler()
    env = {"PATH": COMPILER_PATH_VAR, "LC_ALL": "C"}
    command = [str(compiler), *FLAGS, *LINT_FLAGS, "-o", os.devnull, str(UNIT), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise KernelUnavailable(f"the kernels have warnings:\n{done.stderr}")


# -- finding, or building, the library -----------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    library: ctypes.CDLL
    build: Build


def load_library(home: Path, prebuilt: Path | None = None) -> Loaded:
    """The verified library: prebuilt, cached under ``home``, or compiled now (see the module
    doc). Raises :class:`KernelUnavailable` when none can be had."""
    start = time.perf_counter()
    name = library_name()
    prebuilt = PREBUILT if prebuilt is None else prebuilt
    rejected: list[str] = []
    if prebuilt.exists():
        try:
            fd = _open_image_folder(prebuilt)
            try:
                lib, sha256 = _load_verified(fd, prebuilt, name)
                return Loaded(lib, Build(prebuilt / name, "prebuilt", _since(start), sha256))
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass  # another build of the sources: the cache or a compile serves this one
        except Rejected as why:
            rejected.append(str(why))
    cache = home / "kernels"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = _open_private_folder(cache)
    except (OSError, Rejected) as why:
        rejected.append(f"cache {cache} refused: {why}")
        return _compile_privately(name, rejected, start)
    try:
        with _locked(fd):  # engines starting together: one compiles, the others load it
            try:
                lib, sha256 = _load_verified(fd, cache, name)
                _warn(rejected, "using the cached one")
                return Loaded(lib, Build(cache / name, "cached", _since(start), sha256))
            except FileNotFoundError:
                pass
            except Rejected as why:
                rejected.append(str(why))
            compiler = find_compiler()
            _compile(compiler, cache, name)
            try:
                lib, sha256 = _load_verified(fd, cache, name)
            except (FileNotFoundError, Rejected) as why:
                raise KernelUnavailable(f"the library just compiled does not load: {why}") from None
            _warn(rejected, "compiled anew")
            return Loaded(lib, Build(cache / name, "compiled", _since(start), sha256))
    except KernelUnavailable as error:
        raise KernelUnavailable("; ".join([str(error), *rejected])) from None
    finally:
        os.close(fd)


def _compile_privately(name: str, rejected: list[str], start: float) -> Loaded:
    """Compile into a fresh private temporary folder, load, and remove the folder."""
    try:
        compiler = find_compiler()
        folder = Path(tempfile.mkdtemp(prefix="slotserve-kernels-"))
    except KernelUnavailable as error:
        raise KernelUnavailable("; ".join([str(error), *rejected])) from None
    except OSError as error:
        raise KernelUnavailable(f"no private folder to compile the kernels in: {error}") from error
    try:
        _compile(compiler, folder, name)
        fd = _open_private_folder(folder)
        try:
            lib, sha256 = _load_verified(fd, folder, name)
        finally:
            os.close(fd)
    except (FileNotFoundError, Rejected) as why:
        raise KernelUnavailable(f"the library just compiled does not load: {why}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # loaded: the mapping outlives the file
    _warn(rejected, "compiled into a private temporary folder")
    return Loaded(lib, Build(folder / name, "compiled", _since(start), sha256))


def prebuild(folder: Path = PREBUILT) -> Path:
    """Compile into the image's read-only folder (at image build): the library and its sidecar
    readable by all and writable by none, the folder too. Returns the library's path."""
    name = library_name()
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    _compile(find_compiler(), folder, name)
    for path in (folder / name, folder / f"{name}.json"):
        path.chmod(0o444)
    folder.chmod(0o555)
    for stale in folder.iterdir():
        if stale.name not in (name, f"{name}.json"):
            logger.info("prebuilt folder %s also holds %s (ignored)", folder, stale.name)
    return folder / name


class _locked:
    """An exclusive ``flock`` on ``<folder>/.lock`` (opened through the folder's descriptor)."""

    def __init__(self, folder_fd: int) -> None:
        self.folder_fd = folder_fd
        self.fd = -1

    def __enter__(self) -> None:
        try:
            self.fd = os.open(
                ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=self.folder_fd
            )
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            self.fd = -1  # an unlockable folder only costs engines starting together a compile

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _warn(rejected: list[str], outcome: str) -> None:
    if rejected:
        logger.warning("native kernels: %s; %s", "; ".join(rejected), outcome)


def _since(start: float) -> float:
    return time.perf_counter() - start
