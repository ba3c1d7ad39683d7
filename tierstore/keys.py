"""Key rules, and the only place where a key becomes a relative file-system path."""

from __future__ import annotations

import functools
import re

from tierstore.errors import InvalidKey

MAX_KEY_BYTES = 512
#: a key segment becomes a folder name: file systems cap a name at 255 bytes (NAME_MAX)
MAX_SEGMENT_BYTES = 255
_ALLOWED = re.compile(r"[A-Za-z0-9._/-]+")
_BAD_CHAR = re.compile(r"[^A-Za-z0-9._/-]")


def validate_key(key: object) -> str:
    """Return ``key`` if it obeys the key rules, else raise InvalidKey saying which rule broke."""
    if not isinstance(key, str):
        raise InvalidKey(f"a key is a str, got {type(key).__name__}")
    return _valid(key)


#: keys remembered as valid: a trainer's state of a 70B model is about 3,000 keys; at the 512-byte
#: key limit the memo holds under 6 MiB
VALID_KEYS_REMEMBERED = 8192


@functools.lru_cache(maxsize=VALID_KEYS_REMEMBERED)
def _valid(key: str) -> str:
    """``key`` once ``_check`` passed (remembered: every store call checks its key; a refusal is not)."""
    _check(key)
    return key


def _check(key: str) -> None:
    """Raise InvalidKey if ``key`` breaks a key rule."""
    if not key:
        raise InvalidKey("the key is empty")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {len(key.encode())} bytes long; the limit is {MAX_KEY_BYTES}")
    if not _ALLOWED.fullmatch(key):
        bad = _BAD_CHAR.search(key)
        assert bad is not None
        raise InvalidKey(
            f"key {key[:80]!r} holds {bad.group()!r} at {bad.start()}; allowed: A-Z a-z 0-9 . _ / -"
        )
    segments = key.split("/")
    for i, seg in enumerate(segments):
        if seg == "":
            raise InvalidKey(f"key {key!r} has an empty segment (leading, trailing or double '/')")
        if seg in (".", ".."):
            raise InvalidKey(f"key {key!r} has a {seg!r} segment")
        # refused at put: a name the file system refuses would fail every later commit
        n = len(seg.encode("utf-8"))
        if n > MAX_SEGMENT_BYTES:
            raise InvalidKey(f"key {key[:60]!r}...: segment {i} is {n} bytes long; a segment is a "
                             f"file name and may be at most {MAX_SEGMENT_BYTES} bytes; split it "
                             "with '/'")


def generation_relpath(key: str, generation: int) -> str:
    """The folder of one generation of ``key``, relative to the data root.

    ``@`` is not a key character, so ``a@3`` can never collide with another key's folder.
    The last segment plus ``@<generation>`` is one file name, so it too must fit the limit: a
    put checks this before it writes anything (``InvalidKey``), rather than failing every later
    commit.
    """
    validate_key(key)
    last = key.rpartition("/")[2]
    name = f"{last}@{generation}"
    if len(name.encode("utf-8")) > MAX_SEGMENT_BYTES:
        raise InvalidKey(f"key {key[:60]!r}...: its last segment ({len(last.encode())} bytes) "
                         f"plus the suffix '@{generation}' makes a folder name over the "
                         f"{MAX_SEGMENT_BYTES}-byte file-name limit; shorten it or split it with '/'")
    return f"{key}@{generation}"


def parse_generation_relpath(relpath: str) -> tuple[str, int] | None:
    """The (key, generation) of a generation folder's relative path, None if it is not one."""
    key, sep, gen = relpath.rpartition("@")
    if not sep or not gen.isdigit():
        return None
    try:
        return validate_key(key), int(gen)
    except InvalidKey:
        return None
