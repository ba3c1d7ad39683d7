"""The ``tierstore`` console script: parses the command line and dispatches to one module each.

Exit codes: 0 ok; 1 the command found a fault (a corrupt chunk, a malformed input file, a store
error); 2 a usage error (bad arguments, a path that is not there, a module that is not installed).
Errors print one line on stderr, never a traceback (``TIERSTORE_TRACEBACK=1`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from types import ModuleType

import tierstore
from tools.cli.errors import EXIT_FAULT, EXIT_USAGE, ToolError

#: command name -> the module holding its ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "inspect": "tools.cli.inspect_cmd",
    "verify": "tools.cli.verify_cmd",
    "export": "tools.cli.export_cmd",
    "import": "tools.cli.import_cmd",
    "bench": "tools.cli.bench_cmd",
    "trace": "tools.cli.trace_cmd",
    "train": "tools.cli.train_cmd",
    "generate": "tools.cli.generate_cmd",
}


def _summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (each module adds its own arguments)."""
    parser = argparse.ArgumentParser(
        prog="tierstore", description="Inspect, verify, convert and benchmark tierstore stores.",
        epilog="exit codes: 0 ok, 1 a fault was found, 2 usage error")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS.items():
        module = importlib.import_module(modname)
        p = sub.add_parser(name, help=_summary(module), description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="no progress bars")
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def _fail(command: str, message: str, code: int) -> int:
    print(f"tierstore {command}: error: {message}", file=sys.stderr)
    if os.environ.get("TIERSTORE_TRACEBACK"):
        traceback.print_exc()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 1 fault found, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 0 after --help and 2 on bad arguments
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    name = args.command
    try:
        return int(args._module.run(args))
    except ToolError as e:
        return _fail(name, str(e), e.exit_code)
    except tierstore.MalformedFile as e:
        return _fail(name, str(e), EXIT_FAULT)
    except (tierstore.StoreNotFound, tierstore.InvalidKey) as e:  # a path or a key that cannot be used
        return _fail(name, str(e), EXIT_USAGE)
    except tierstore.StoreLocked as e:
        return _fail(name, str(e), EXIT_USAGE)
    except tierstore.StoreError as e:
        return _fail(name, f"{type(e).__name__}: {e}", EXIT_FAULT)
    except FileNotFoundError as e:
        return _fail(name, f"{e.filename or e}: no such file or folder", EXIT_USAGE)
    except OSError as e:
        return _fail(name, f"{e.filename or ''} {e.strerror or e}".strip(), EXIT_FAULT)
    except KeyboardInterrupt:
        return _fail(name, "interrupted", 130)
    except Exception as e:  # noqa: BLE001  (one line, never a traceback: TIERSTORE_TRACEBACK=1 shows it)
        first = (str(e).strip().splitlines() or [""])[0]
        return _fail(name, f"{type(e).__name__}: {first}", EXIT_FAULT)


if __name__ == "__main__":
    sys.exit(main())
