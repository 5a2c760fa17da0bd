"""The frames' CRC-32: zlib-ng's where it is installed, else zlib's.

Both compute the same function (CRC-32 of ISO 3309, zlib's ``crc32(data, value)``), so frames
written with one are read with the other. zlib-ng's folds 64 bytes at a time with carry-less
multiplication (PCLMULQDQ and its AVX-512 form on x86, PMULL on ARM): about 80 GB/s against
5 GB/s for zlib 1.2's on the development VM, so checking a replayed file's frames (a CRC over
every byte read) stops being a sixth of a large-batch replay. zlib-ng is in the daemon extra;
without it every frame is checked all the same, only slower.
"""

from __future__ import annotations

import importlib
import zlib
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


class Crc32(Protocol):
    def __call__(self, data: ReadableBuffer, value: int = 0, /) -> int: ...

#: What an implementation must give before it is used: zlib's own values on a few lengths and seeds
#: (short inputs take the bytewise path, long ones the folding path), for an installed zlib-ng that
#: was built wrong, or anything else that shadows its name, to fall back instead of refusing frames.
_PROBES: Final = (b"", b"123456789", bytes(range(256)) * 9)
_SEEDS: Final = (0, 0x1234_5678)


def agrees_with_zlib(crc32: Crc32) -> bool:
    try:
        return all(crc32(data, seed) == zlib.crc32(data, seed) for data in _PROBES for seed in _SEEDS) and \
            crc32(memoryview(_PROBES[2])[3:700], 7) == zlib.crc32(memoryview(_PROBES[2])[3:700], 7)
    except Exception:  # noqa: BLE001 - a module that cannot even be called is not used
        return False


def pick(module: str = "zlib_ng.zlib_ng") -> tuple[Crc32, str]:
    """(the fastest CRC-32 at hand that agrees with zlib's, its name)."""
    try:
        fast = importlib.import_module(module).crc32
    except (ImportError, AttributeError):
        return zlib.crc32, "zlib"
    if not callable(fast) or not agrees_with_zlib(fast):
        return zlib.crc32, "zlib"
    return fast, module


crc32: Crc32
IMPLEMENTATION: str
crc32, IMPLEMENTATION = pick()
