"""The crc32c checksums of stored bytes, as zarr's ``crc32c`` codec lays them out.

Every chunk file, inner chunk and shard index ends with a 4-byte little-endian crc32c of the
bytes before it. Both the disk tier (chunk files) and the shard layout (shard indexes) compute
them, so they live here, below both: neither has to import the other for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c

#: bytes of the crc32c trailer after each payload
TRAILER = 4


def checksum(parts: Sequence[memoryview] | Sequence[object]) -> int:
    """crc32c over the concatenation of ``parts`` (anything with the buffer protocol)."""
    value = 0
    for p in parts:
        value = crc32c.crc32c(p, value)
    return value


def crc_trailer(crc: int) -> bytes:
    """The 4-byte little-endian crc32c trailer."""
    return crc.to_bytes(TRAILER, "little")
