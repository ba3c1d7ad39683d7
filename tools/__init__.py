"""The ``tierstore`` command and the project's tools, one package per role.

- ``tools.cli``: the ``tierstore`` console script, one ``*_cmd`` module per subcommand, and the
  helpers only the commands use (exit codes and errors, sizes, the zarr writer, the timeline).
- ``tools.bench``: the benchmarks (``python -m tools.bench.<name>``; ``tierstore bench --list``
  says what each measures) and what they share (tiny models and their Adam moments).
- ``tools.harness``: crash, fuzz and model checks of the store and the trainer.
- ``tools.gpu``: the prepared, time-boxed check for a GPU machine and its benchmark.
- ``tools.table`` (plain-text tables, used by commands and benchmarks) and
  ``tools.hf_args_table`` (generates a table of docs/hf-trainer.md).

Layering: tools -> trainer -> tierstore; nothing below imports from here.
"""

from tools import moved

moved.install()  # the old flat names (tools.bench_store, ...) for one release
