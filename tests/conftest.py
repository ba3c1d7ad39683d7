"""Shared fixtures, and the audit of exceptions that escape the store's public API.

``tools.harness.modelcheck.audit`` wraps the public methods of ``Store``, ``AsyncStore`` and
``tierstore.open*`` at import time; the autouse fixture fails any test during which an
exception other than ``StoreError``, ``TypeError`` or ``ValueError`` escaped one of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tools.harness.modelcheck import audit

audit.install()


@pytest.fixture(autouse=True)
def _public_api_raises_only_documented_errors() -> Iterator[None]:
    """Fail the test during which an undocumented exception type escaped a public call."""
    start = len(audit.ESCAPED)
    yield
    new = audit.ESCAPED[start:]
    if new:
        del audit.ESCAPED[start:]
        pytest.fail("exceptions of undocumented types escaped the store's public API "
                    "(want StoreError, TypeError or ValueError):\n  " + "\n  ".join(new[:5]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip CUDA-marked tests on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
