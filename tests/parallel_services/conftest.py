"""Fixtures of the parallel-services tests: an embedded Ray on loopback per test module (the ``job_service``
fixture of tests/conftest.py runs on it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray(num_cpus=8)  # logical CPUs: two jobs side by side, one with a peer rank
    yield
    shutdown_ray()

