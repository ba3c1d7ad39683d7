"""The audit of exceptions that escape the store's public API.

Every exception that escapes the public API must be a ``StoreError`` subclass or a documented
Python one (``TypeError``/``ValueError`` for arguments of the wrong type or value). ``install``
wraps the public methods of ``Store`` (the sync facade) and ``AsyncStore`` and the
``tierstore.open``/``open_async`` functions; an escaping exception of another type is appended
to ``ESCAPED``. ``tests/conftest.py`` installs it for the whole suite and fails the test during
which a record appeared. A wrapper costs one ``try`` per call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import tierstore
import tierstore.api
from tierstore.errors import StoreError

#: what may escape a public call: the store's own errors and Python's for bad arguments
ALLOWED_ESCAPES = (StoreError, TypeError, ValueError)
#: "Class.method raised Type: message" of each other exception that escaped, in order
ESCAPED: list[str] = []


def _record(where: str, exc: Exception) -> None:
    if not isinstance(exc, ALLOWED_ESCAPES):
        ESCAPED.append(f"{where} raised {type(exc).__module__}.{type(exc).__name__}: {exc}")


def _audited(where: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def audited_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as e:  # BaseExceptions (cancellation, interrupts) pass unjudged
                _record(where, e)
                raise
        return audited_async

    @functools.wraps(fn)
    def audited(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            _record(where, e)
            raise
    return audited


def _audit_class(cls: type) -> None:
    """Wrap every public method (and ``__contains__``) of ``cls``, inherited ones included."""
    for name in dir(cls):
        if name.startswith("_") and name != "__contains__":
            continue
        raw = inspect.getattr_static(cls, name)
        where = f"{cls.__name__}.{name}"
        if isinstance(raw, classmethod):
            setattr(cls, name, classmethod(_audited(where, raw.__func__)))
        elif isinstance(raw, staticmethod):
            setattr(cls, name, staticmethod(_audited(where, raw.__func__)))
        elif inspect.isfunction(raw):
            setattr(cls, name, _audited(where, raw))
        # properties and plain attributes are not calls


_installed = False


def install() -> None:
    """Wrap the public API (once per process): ``Store``, ``AsyncStore``, ``tierstore.open*``."""
    global _installed
    if _installed:
        return
    _installed = True
    _audit_class(tierstore.Store)
    _audit_class(tierstore.AsyncStore)
    for mod in (tierstore, tierstore.api):
        mod.open = _audited("tierstore.open", tierstore.api.open)  # type: ignore[assignment]
        mod.open_async = _audited("tierstore.open_async", tierstore.api.open_async)  # type: ignore[assignment]
