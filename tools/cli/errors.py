"""Errors of the command-line tools, each carrying the exit code the command returns."""

from __future__ import annotations

from tierstore.errors import MalformedFile, StoreError

#: exit codes of every ``tierstore`` command
EXIT_OK = 0
EXIT_FAULT = 1  # the command ran and found a fault (corrupt store, malformed input file)
EXIT_USAGE = 2  # the command could not run as asked (arguments, missing paths, missing modules)


class ToolError(StoreError):
    """A failure the command reports as one line on stderr, then exits with ``exit_code``.

    Part of the one error hierarchy: ``except tierstore.StoreError`` catches these too.
    """

    exit_code = EXIT_FAULT


class UsageError(ToolError):
    """The arguments name something that does not exist or cannot be used; exit code 2."""

    exit_code = EXIT_USAGE


#: an input file (safetensors, index, config) breaks its format; exit code 1. The store's
#: safetensors parser raises it too, so it is tierstore's class under the tools' name.
MalformedInput = MalformedFile
