"""Fixtures of the trainer tests."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.data import default_dataset


@pytest.fixture(scope="session")
def dataset() -> Any:
    """32-token blocks of the embedded corpus (64 KiB of it)."""
    return default_dataset(block_size=32, max_bytes=64 * 1024)
