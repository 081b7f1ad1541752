"""Fixtures of the data-parallel tests: an embedded Ray on loopback per test module (``batches``, the
real rollouts to train on, is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray(num_cpus=4)
    yield
    shutdown_ray()
