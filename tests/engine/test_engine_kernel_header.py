"""kernels.h is the kernel library's one interface: its prototypes against the ctypes table
(signatures.py), the built library's exported symbols against its prototypes, and its ABI
number, group size and enums against what Python uses."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slotserve.engine.core.kernels import ISAS, NativeKernels, Scratch, library, load_kernels
from slotserve.engine.core.kernels.signatures import SIGNATURES
from slotserve.engine.core.model import native_decode
from slotserve.settings import CommonSettings

HEADER = library.HEADER.read_text()

# A C parameter or result type, reduced to what ctypes must pass for it.
CTYPE_KINDS = {
    ctypes.c_void_p: "pointer",
    ctypes.c_int64: "int64",
    ctypes.c_int: "int",
    ctypes.c_uint64: "uint64",
    ctypes.c_float: "float",
    None: "void",
}


def c_kind(declaration: str) -> str:
    """``const float *scale`` -> pointer, ``int64_t n`` -> int64, ``int threads`` -> int..."""
    if "*" in declaration:
        return "pointer"
    words = declaration.replace("const ", "").split()
    base = words[0] if words else "void"
    kinds = {"int64_t": "int64", "int": "int", "uint64_t": "uint64", "float": "float"}
    if base == "void":
        return "void"
    if base not in kinds:
        raise AssertionError(f"kernels.h: a parameter type the test does not know: {declaration}")
    return kinds[base]


def prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """Every ``slotserve_*`` prototype of a header: name -> (result kind, parameter kinds)."""
    code = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    found: dict[str, tuple[str, list[str]]] = {}
    pattern = r"^([A-Za-z_][\w ]*?\**)\s*\b(slotserve_\w+)\s*\(([^)]*)\)\s*;"
    for result, name, params in re.findall(pattern, code, flags=re.MULTILINE):
        assert name not in found, f"kernels.h declares {name} twice"
        params = " ".join(params.split())
        kinds = [] if params in ("", "void") else [c_kind(p) for p in params.split(",")]
        found[name] = (c_kind(result), kinds)
    return found


def ctypes_kinds(restype: object, argtypes: list[object]) -> tuple[str, list[str]]:
    return CTYPE_KINDS[restype], [CTYPE_KINDS[a] for a in argtypes]  # type: ignore[index]


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


def test_the_parser_reads_the_kinds_a_prototype_has():
    parsed = prototypes("/* x */\nint slotserve_f(const float *a, int64_t n,\n  float s, int t);")
    assert parsed == {"slotserve_f": ("int", ["pointer", "int64", "float", "int"])}
    assert prototypes("uint64_t slotserve_g(void);") == {"slotserve_g": ("uint64", [])}


def test_every_prototype_matches_its_ctypes_declaration():
    header = prototypes(HEADER)
    assert len(header) >= 16
    assert sorted(header) == sorted(SIGNATURES), "kernels.h and signatures.py name other functions"
    for name, (restype, argtypes) in SIGNATURES.items():
        assert ctypes_kinds(restype, argtypes) == header[name], name


def test_the_loaded_library_is_declared_as_the_table_says(kernels):
    lib = kernels._lib
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        assert function.restype is restype and list(function.argtypes) == argtypes, name


def test_the_library_exports_exactly_the_header(kernels, tmp_path: Path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    path = kernels.build.path
    if not path.exists():  # compiled into a private folder that is gone: build a copy
        path = library.prebuild(tmp_path / "prebuilt")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    exported = {
        line.split()[2] for line in listing.splitlines() if line.split()[1:2] in (["T"], ["W"])
    }
    assert exported == set(prototypes(HEADER))


def test_abi_and_group_size_come_from_the_header_and_the_library_agrees(kernels):
    assert re.search(rf"#define SLOTSERVE_KERNEL_ABI {library.ABI}\n", HEADER)
    assert re.search(rf"#define SLOTSERVE_KERNEL_GROUP {library.GROUP_SIZE}\n", HEADER)
    assert kernels._lib.slotserve_kernel_abi() == library.ABI
    assert kernels._lib.slotserve_kernel_group_size() == library.GROUP_SIZE
    # The C sources use the macros, never the numbers themselves.
    qgemm = (library.HERE / "dispatch.c").read_text() + (library.HERE / "gemm.h").read_text()
    assert "return SLOTSERVE_KERNEL_ABI;" in qgemm
    assert "#define GROUP SLOTSERVE_KERNEL_GROUP" in qgemm


def test_the_enums_match_what_python_passes():
    kind = re.search(r"enum kind \{([^}]*)\}", HEADER)
    assert kind is not None
    kinds = dict(re.findall(r"(\w+) = (\d+)", kind.group(1)))
    assert {k: int(v) for k, v in kinds.items()} == {
        "F32": 0,
        "Q8": 1,
        "Q4": 2,
        "BF16": 3,
        "I16": 4,
    }
    assert native_decode.KINDS == {
        "float32": 0, "int8": 1, "int4": 2, "bfloat16": 3, "int16": 4
    }  # fmt: skip
    isa = re.search(r"enum \{ (ISA_C[^}]*)\}", HEADER)
    assert isa is not None
    levels = [int(v) for _, v in re.findall(r"(ISA_\w+) = (\d+)", isa.group(1))]
    assert levels == list(range(len(ISAS)))


def test_struct_scratch_has_the_fields_python_lays_out():
    body = re.search(r"struct scratch \{([^}]*)\}", HEADER)
    assert body is not None
    names = re.findall(r"\*?(\w+)\s*[,;]", body.group(1))
    assert names == [field[0] for field in Scratch._fields_]


def test_the_compiled_unit_includes_every_source_once():
    """The compiler is given library.c alone: a source it does not include would never be built
    (its functions missing at load). The cache key hashes SOURCES and the unit, so this also
    keeps every compiled file in the key."""
    included = re.findall(r'^#include "(\w+\.c)"$', library.UNIT.read_text(), re.MULTILINE)
    assert included == [path.name for path in library.SOURCES]
    assert {path.name for path in library.HERE.glob("*.c")} == {*included, library.UNIT.name}


def test_lint_refuses_a_warning_the_runtime_build_lets_pass(tmp_path: Path, monkeypatch):
    try:
        library.find_compiler()
    except library.KernelUnavailable as error:
        pytest.skip(str(error))
    source = tmp_path / "warns.c"
    source.write_text("int slotserve_unused(int a, int b) { int c; return a; }\n")
    monkeypatch.setattr(library, "UNIT", source)
    with pytest.raises(library.KernelUnavailable, match="unused"):
        library.lint()
    assert "-Werror" not in library.FLAGS  # a new compiler's warning never stops the engine
