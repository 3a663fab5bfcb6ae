"""Where the kernel library is loaded from, and what is refused (issue 27's second item).

Loading a library runs its code: a planted one (here a real shared library whose constructor
writes a marker file) must never be loaded, from the old shared ``$TMPDIR/slotserve-kernels``
folder, from a cache folder someone else owns or can write, or in place of the library whose
hash was recorded at compile time. A damaged or foreign library falls back to a fresh compile
with one warning. ``$CC`` is never run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.engine.core.kernels import NativeKernels, library
from slotserve.engine.core.kernels.library import (
    KernelUnavailable,
    find_compiler,
    library_name,
    load_library,
    prebuild,
)

PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int slotserve_kernel_abi(void) { return %d; }
"""


@pytest.fixture(scope="module", autouse=True)
def unoptimized() -> Iterator[None]:
    """Every build of this module at -O0: real gcc on the real sources, ~2 s where -O3 takes
    ~7 s on a 2-core Zen 3, and the module compiles ~12 times (its fallbacks compile anew by
    design). What these tests check is where a library comes from and what is refused, not its
    speed; the -O3 build is what every engine of the suite loads, and ``make lint`` compiles it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(library, "FLAGS", ("-O0", *library.FLAGS[1:]))
        assert library.FLAGS[0] == "-O0" and "-O3" not in library.FLAGS
        yield


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library and its sidecar, compiled once for the module (copies are hashed alike)."""
    try:
        find_compiler()
    except KernelUnavailable as error:
        pytest.skip(str(error))
    folder = tmp_path_factory.mktemp("pristine")
    prebuild(folder)
    return folder


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "planted-ran"


@pytest.fixture
def planted(tmp_path: Path, marker: Path) -> Path:
    """A real shared library whose constructor writes ``marker`` when it is loaded."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C % (marker, library.ABI))  # as the real one answers
    output = tmp_path / "planted.so"
    subprocess.run(
        [str(find_compiler()), "-shared", "-fPIC", "-o", str(output), str(source)], check=True
    )
    return output


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary folder of the test's own in place of the system's."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def cache_of(home: Path) -> Path:
    return home / "kernels"


def seed_cache(home: Path, pristine: Path) -> Path:
    """A cache under ``home`` holding a copy of the pristine build, as a first start leaves it."""
    cache = cache_of(home)
    cache.mkdir(parents=True, mode=0o700)
    name = library_name()
    for suffix in ("", ".json"):
        shutil.copyfile(pristine / f"{name}{suffix}", cache / f"{name}{suffix}")
    return cache / name


def record_hash(path: Path) -> None:
    """Rewrite ``path``'s sidecar to its current bytes: only ``dlopen`` can refuse it now."""
    import hashlib

    sidecar = path.with_name(path.name + ".json")
    record = json.loads(sidecar.read_text())
    record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    sidecar.write_text(json.dumps(record))


def assert_products_work(loaded) -> None:
    kernels = NativeKernels(loaded)
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    torch.testing.assert_close(kernels.gemm_f32(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == library.__name__
    ]


def test_compiled_once_into_a_private_cache_then_loaded_from_it(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    first = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    again = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert (first.build.origin, again.build.origin) == ("compiled", "cached")
    assert again.build.path == first.build.path == cache_of(tmp_path / "home") / library_name()
    assert again.build.sha256 == first.build.sha256
    cache = cache_of(tmp_path / "home")
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [".lock", library_name(), f"{library_name()}.json"]
    )  # no leftovers of the compile
    record = json.loads((cache / f"{library_name()}.json").read_text())
    assert record["sha256"] == first.build.sha256 and record["machine"]
    assert warnings_of(caplog) == []
    assert_products_work(again)


def test_the_key_holds_the_machine_type(monkeypatch):
    here = library_name()
    monkeypatch.setattr(library.platform, "machine", lambda: "aarch64")
    there = library_name()
    assert here != there and there.endswith("-aarch64.so")


def test_a_planted_library_in_the_old_shared_tmp_folder_is_never_loaded(
    tmp_path, private_tmp, planted, marker, caplog
):
    old = private_tmp / "slotserve-kernels"
    old.mkdir()
    for name in ("qgemm-cccc908bfe6f0bcf.so", library_name()):  # the old key, and the new one
        shutil.copyfile(planted, old / name)
        (old / f"{name}.json").write_text(json.dumps({"sha256": "x"}))
        record_hash(old / name)
    home = tmp_path / "home-is-a-file"
    home.write_text("")  # no cache can be made under it: the old code compiled into old/
    loaded = load_library(home, prebuilt=tmp_path / "none")
    assert not marker.exists()
    assert loaded.build.origin == "compiled"
    assert loaded.build.path.parent.parent == private_tmp
    assert loaded.build.path.parent.name.startswith("slotserve-kernels-")
    assert not loaded.build.path.parent.exists()  # the private folder went once loaded
    (warning,) = warnings_of(caplog)
    assert "private temporary folder" in warning
    assert_products_work(loaded)


@pytest.mark.parametrize("damage", ["truncated", "foreign", "not_elf"])
def test_a_damaged_or_foreign_cached_library_falls_back_with_one_warning(
    tmp_path, pristine, caplog, damage
):
    path = seed_cache(tmp_path / "home", pristine)
    data = path.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 3]
    elif damage == "foreign":
        data = data[:18] + (183).to_bytes(2, "little") + data[20:]  # e_machine: AArch64
    else:
        data = b"#!/bin/sh\necho not a library\n"
    path.write_bytes(data)
    record_hash(path)  # the hash agrees: dlopen itself must refuse it
    loaded = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert loaded.build.origin == "compiled"
    (warning,) = warnings_of(caplog)
    assert "does not load" in warning and "compiled anew" in warning
    assert path.read_bytes() != data  # replaced by the fresh build
    assert_products_work(loaded)
    assert load_library(tmp_path / "home", prebuilt=tmp_path / "none").build.origin == "cached"


@pytest.mark.parametrize("sidecar", ["kept", "missing"])
def test_a_library_whose_hash_is_not_the_recorded_one_is_never_loaded(
    tmp_path, pristine, planted, marker, caplog, sidecar
):
    path = seed_cache(tmp_path / "home", pristine)
    shutil.copyfile(planted, path)  # the sidecar still holds the real library's hash
    if sidecar == "missing":
        path.with_name(path.name + ".json").unlink()
    loaded = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert not marker.exists()
    assert loaded.build.origin == "compiled"
    (warning,) = warnings_of(caplog)
    assert ("sha256" if sidecar == "kept" else "no recorded hash") in warning
    assert_products_work(loaded)


@pytest.mark.parametrize("wrong", ["mode_777", "mode_770", "owner"])
def test_a_cache_folder_others_own_or_can_write_is_refused(
    tmp_path, pristine, planted, marker, caplog, monkeypatch, wrong
):
    path = seed_cache(tmp_path / "home", pristine)
    shutil.copyfile(planted, path)
    record_hash(path)  # a hash that agrees proves nothing in a folder others can write
    cache = path.parent
    if wrong == "owner":
        if os.geteuid() == 0:
            os.chown(cache, 12345, 12345)
        else:  # not root: the folder is ours, so this user is made someone else
            monkeypatch.setattr(library, "_euid", lambda: os.geteuid() + 1)
    else:
        cache.chmod(int(wrong[-3:], 8))
    loaded = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert not marker.exists()
    assert loaded.build.origin == "compiled"
    assert not loaded.build.path.is_relative_to(cache)
    (warning,) = warnings_of(caplog)
    assert f"cache {cache} refused" in warning
    assert ("owned by uid" if wrong == "owner" else "writable by others") in warning


def test_a_cache_folder_of_ours_that_others_could_read_is_tightened(tmp_path, pristine, caplog):
    path = seed_cache(tmp_path / "home", pristine)
    path.parent.chmod(0o755)  # as engines before this check made it: only we could write it
    loaded = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert loaded.build.origin == "cached"
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    assert warnings_of(caplog) == []


def test_cc_and_path_from_the_environment_are_never_run(tmp_path, monkeypatch, marker):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("evil-cc", "gcc", "cc", "as", "ld"):
        (fake / name).write_text(f"#!/bin/sh\necho ran > {marker}\nexit 1\n")
        (fake / name).chmod(0o755)
    monkeypatch.setenv("CC", str(fake / "evil-cc"))
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    include = tmp_path / "include"
    include.mkdir()
    (include / "omp.h").write_text('#error "a planted omp.h was included"\n')
    for var in ("CPATH", "C_INCLUDE_PATH"):
        monkeypatch.setenv(var, str(include))
    monkeypatch.setenv("GCC_EXEC_PREFIX", f"{fake}/")
    monkeypatch.setenv("COMPILER_PATH", str(fake))
    loaded = load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    assert loaded.build.origin == "compiled"
    assert not marker.exists()
    assert_products_work(loaded)


def test_no_trusted_compiler_is_a_clear_error(tmp_path, monkeypatch):
    open_folder = tmp_path / "bin"
    open_folder.mkdir()
    os.symlink(find_compiler(), open_folder / "gcc")
    open_folder.chmod(0o777)  # anyone could have put this gcc here
    monkeypatch.setattr(library, "COMPILER_FOLDERS", (open_folder, tmp_path / "none"))
    with pytest.raises(KernelUnavailable, match=r"C compiler.*writable by others"):
        load_library(tmp_path / "home", prebuilt=tmp_path / "none")
    monkeypatch.setattr(library, "COMPILER_FOLDERS", (tmp_path / "none",))
    with pytest.raises(KernelUnavailable, match="no trusted gcc or cc"):
        load_library(tmp_path / "home", prebuilt=tmp_path / "none")


def test_the_prebuilt_folder_comes_first_and_needs_no_compiler(tmp_path, pristine, monkeypatch):
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(pristine, prebuilt)
    monkeypatch.setattr(library, "COMPILER_FOLDERS", ())  # an image without gcc
    loaded = load_library(tmp_path / "home", prebuilt=prebuilt)
    assert (loaded.build.origin, loaded.build.path) == ("prebuilt", prebuilt / library_name())
    assert not (cache_of(tmp_path / "home") / library_name()).exists()
    assert_products_work(loaded)


def test_the_prebuilt_folder_is_read_only(tmp_path):
    """What ``--prebuilt`` leaves: the folder and files writable by nobody."""
    try:
        find_compiler()
    except KernelUnavailable as error:
        pytest.skip(str(error))
    path = prebuild(tmp_path / "prebuilt")
    for item in (path.parent, path, path.with_name(path.name + ".json")):
        assert item.stat().st_mode & 0o222 == 0, item
    path.parent.chmod(0o755)  # pytest must be able to clean up


@pytest.mark.parametrize("damage", ["hash", "writable"])
def test_a_damaged_or_open_prebuilt_folder_falls_back_to_the_cache(
    tmp_path, pristine, planted, marker, caplog, damage
):
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(pristine, prebuilt)
    if damage == "hash":
        shutil.copyfile(planted, prebuilt / library_name())
    else:
        shutil.copyfile(planted, prebuilt / library_name())
        record_hash(prebuilt / library_name())
        prebuilt.chmod(0o777)
    seed_cache(tmp_path / "home", pristine)
    loaded = load_library(tmp_path / "home", prebuilt=prebuilt)
    assert not marker.exists()
    assert loaded.build.origin == "cached"
    (warning,) = warnings_of(caplog)
    assert "using the cached one" in warning
