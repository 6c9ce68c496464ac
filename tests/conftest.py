"""Set-up for the whole pytest run: the gloo worker pools of ``dist_harness`` end with the run."""

from collections.abc import Iterator

import pytest
from dist_harness import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _close_gloo_pools() -> Iterator[None]:
    """Close the pooled gloo workers once the last test has run."""
    yield
    shutdown_pools()
