"""Set-up for the whole pytest run: the gloo worker pools of ``dist_harness`` end with the run, and on a GPU
each test hands its cached device memory back when it ends."""

from collections.abc import Iterator

import pytest
import torch
from dist_harness import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _close_gloo_pools() -> Iterator[None]:
    """Close the pooled gloo workers once the last test has run."""
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory() -> Iterator[None]:
    """After each test, give the memory torch's allocator keeps cached back to the GPU: ``make test-gpu`` runs
    several pytest workers, each with pools of rank processes, on one card, and blocks one test no longer uses
    would otherwise stay reserved beside the next test's (an H100's 80 GB ran out with four workers)."""
    yield
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
