"""Codecs: the ``Codec`` contract, the registry, and the built-in codecs.

``get(name, **params)`` returns an instance; ``register(cls)`` adds a user codec.
"""

from tierstore.codecs import raw as _raw  # noqa: F401  (registers "raw")
from tierstore.codecs import zstd as _zstd  # noqa: F401  (registers "zstd")
from tierstore.codecs.base import Codec
from tierstore.codecs.registry import from_spec, get, names, register, resolve

__all__ = ["Codec", "from_spec", "get", "names", "register", "resolve"]
