"""Whether a file is a whole shared library for this machine, checked before ``dlopen``: a
truncated library whose hash was recorded that way (or a foreign one) can kill the process
with SIGBUS inside ``dlopen`` rather than fail, when its segments point past the file's end."""

from __future__ import annotations

import platform
import struct

# ELF e_machine of the machine types Python reports.
ELF_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21}


def elf_problem(data: bytes) -> str | None:
    """Why ``data`` is not a whole little-endian 64-bit shared object for this machine, or None:
    every segment and the section table must lie within the file."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    if data[4] != 2 or data[5] != 1:
        return "not a little-endian 64-bit ELF file"
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    expected = ELF_MACHINES.get(platform.machine().lower())
    if e_type != 3:
        return "not a shared object"
    if expected is not None and e_machine != expected:
        return f"built for ELF machine {e_machine}, not this {platform.machine()} ({expected})"
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
        return "truncated (its headers point past its end)"
    for index in range(phnum):
        # Elf64_Phdr: type, flags, offset, vaddr, paddr, filesz, ...
        offset, filesz = struct.unpack_from("<Q16xQ", data, phoff + index * phentsize + 8)
        if offset + filesz > len(data):
            return "truncated (a segment lies past its end)"
    return None
