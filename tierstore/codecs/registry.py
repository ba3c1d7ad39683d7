"""The codec registry: one string-keyed table of codec classes, fed by ``register``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierstore.codecs.base import Codec
from tierstore.errors import CodecError

_CODECS: dict[str, type[Codec]] = {}


def register(codec_cls: type[Codec]) -> type[Codec]:
    """Add a codec class under its ``name``; usable as a class decorator."""
    name = getattr(codec_cls, "name", None)
    if not isinstance(name, str) or not name:
        raise CodecError(f"{codec_cls!r} has no string `name` to register under")
    if not (isinstance(codec_cls, type) and issubclass(codec_cls, Codec)):
        raise CodecError(f"{codec_cls!r} is not a subclass of tierstore.codecs.Codec")
    existing = _CODECS.get(name)
    if existing is not None and existing is not codec_cls:
        raise CodecError(f"a different codec is already registered as {name!r}: {existing!r}")
    _CODECS[name] = codec_cls
    return codec_cls


def names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_CODECS)


def _lookup(name: str) -> type[Codec]:
    """The codec class registered as ``name``; CodecError naming the registered ones."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; registered: {', '.join(names())}") from None


def _build(name: str, make: Callable[[], Codec]) -> Codec:
    """Call ``make()``, turning a constructor's TypeError into CodecError."""
    try:
        return make()
    except CodecError:
        raise
    except TypeError as e:
        raise CodecError(f"bad parameters for codec {name!r}: {e}") from None


def get(name: str, **params: Any) -> Codec:
    """A codec instance by registry name and parameters."""
    cls = _lookup(name)
    return _build(name, lambda: cls(**params))


def from_spec(spec: dict[str, Any]) -> Codec:
    """Rebuild a codec from the JSON-able spec that ``Codec.spec()`` produced."""
    if not isinstance(spec, dict) or "name" not in spec:
        raise CodecError(f"a codec spec is a dict with a 'name', got {spec!r}")
    params = {k: v for k, v in spec.items() if k != "name"}
    cls = _lookup(spec["name"])
    return _build(spec["name"], lambda: cls.from_params(params))


def resolve(codec: str | dict[str, Any] | Codec | None) -> Codec:
    """A codec from what ``put`` accepts: a name, a spec dict, an instance or None (raw)."""
    if codec is None:
        return get("raw")
    if isinstance(codec, Codec):
        return codec
    if isinstance(codec, str):
        return get(codec)
    if isinstance(codec, dict):
        return from_spec(codec)
    raise CodecError(f"codec must be a name, a spec dict or a Codec, got {type(codec).__name__}")
