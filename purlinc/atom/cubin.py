"""What a CUBIN says about its entry points beyond what one driver call reports: the per-thread
stack each one needs.

A launch whose kernel needs more stack than the CUDA context has grows the context's stack
first, and that waits for every kernel running on the device (``runtime.driver.reserve_stack``
says why that matters).  The amount is recorded by ptxas in the CUBIN's ``.nv.info`` section:
``EIATTR_MIN_STACK_SIZE`` (the stack the function needs, the functions it calls included) and
``EIATTR_FRAME_SIZE`` per symbol.  ``cuobjdump -res-usage`` prints the same number as STACK.

The section is a list of records: a format byte (1: no value, 2: one byte, 3: two bytes,
4: a 16-bit size and that many bytes), an attribute byte, then the value.  The two attributes
read here are format 4 with 8 bytes: the symbol's index in ``.symtab``, then the byte count.
"""

from __future__ import annotations

import struct

_FRAME_SIZE = 0x11
_MIN_STACK_SIZE = 0x12
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_SYMBOL = struct.Struct("<IBBHQQ")  # Elf64_Sym


def stack_bytes(cubin: bytes) -> dict[str, int]:
    """Symbol name -> per-thread stack bytes it needs (the larger of its frame and its minimum
    stack size).  Empty for anything that is not a 64-bit ELF CUBIN with an ``.nv.info``
    section: the caller then relies on the driver's local-size attribute alone."""
    try:
        return _stack_bytes(cubin)
    except (struct.error, ValueError, IndexError, KeyError, UnicodeDecodeError):
        return {}


def _sections(data: bytes) -> dict[str, tuple]:
    if data[:4] != b"\x7fELF" or data[4] != 2:  # ELFCLASS64
        raise ValueError("not a 64-bit ELF file")
    (offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [_SECTION_HEADER.unpack_from(data, offset + i * entry_size) for i in range(count)]
    names = headers[names_index]
    return {_string(data, names[4] + h[0]): h for h in headers} | {"#": headers}


def _string(data: bytes, start: int) -> str:
    return data[start:data.index(b"\0", start)].decode()


def _symbols(data: bytes, sections: dict) -> list[str]:
    table = sections[".symtab"]
    strings = sections["#"][table[6]]  # sh_link: the symbol names' string table
    return [_string(data, strings[4] + _SYMBOL.unpack_from(data, table[4] + i * _SYMBOL.size)[0])
            for i in range(table[5] // _SYMBOL.size)]


def _stack_bytes(data: bytes) -> dict[str, int]:
    sections = _sections(data)
    if ".nv.info" not in sections:
        return {}
    symbols = _symbols(data, sections)
    info = sections[".nv.info"]
    at, end = info[4], info[4] + info[5]
    found: dict[str, int] = {}
    while at < end:
        form, attribute = data[at], data[at + 1]
        at += 2
        if form == 4:
            (size,) = struct.unpack_from("<H", data, at)
            at += 2
            if attribute in (_FRAME_SIZE, _MIN_STACK_SIZE) and size == 8:
                index, value = struct.unpack_from("<II", data, at)
                name = symbols[index]
                found[name] = max(found.get(name, 0), value)
            at += size
        else:
            at += {1: 0, 2: 1, 3: 2}[form]  # another format: KeyError, the CUBIN counts as unreadable
    return found
