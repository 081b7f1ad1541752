"""Fixtures of the tensor/expert-parallel trainer tests: an embedded Ray on loopback per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray(num_cpus=8)  # logical CPUs: a job's role actors and the trainer's peer ranks
    yield
    shutdown_ray()
