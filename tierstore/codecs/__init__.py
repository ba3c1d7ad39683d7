"""Codecs: the ``Codec`` contract, the registry, and the built-in codecs.

``get(name, **params)`` returns an instance; ``register(cls)`` adds a user codec. Importing this
package also registers the quantized codecs with zarr (``tierstore.q4`` etc.).
"""

from tierstore.codecs import blosc as _blosc  # noqa: F401  (registers "blosc")
from tierstore.codecs import quant_codecs as _quant_codecs  # noqa: F401  (registers "q8".."q2")
from tierstore.codecs import raw as _raw  # noqa: F401  (registers "raw")
from tierstore.codecs import zarr_quant as _zarr_quant  # noqa: F401  (zarr "tierstore.q*")
from tierstore.codecs import zstd as _zstd  # noqa: F401  (registers "zstd")
from tierstore.codecs.base import Codec
from tierstore.codecs.policy import choose_codec
from tierstore.codecs.registry import from_spec, get, names, register, resolve

__all__ = ["Codec", "choose_codec", "from_spec", "get", "names", "register", "resolve"]
