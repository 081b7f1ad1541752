"""The layer rule: the domain imports no Ray, gRPC or Prometheus, and nothing from the services.

Layers, bottom to top: the domain (``kernels/``, ``onpolicy/{models,rollout,trainer,verification,
parallel,jobs}`` and the top-level ``onpolicy/*.py`` modules), the runtime (``services/cluster/``:
Ray actors, peer ranks, placement), the services (``services/``: gRPC servicers, metrics
exporters) and the entry layer (``onpolicy/cli``). An AST walk over every domain module finds
every import — at module level, inside functions, under ``if TYPE_CHECKING``, and
``importlib.import_module("…")`` / ``__import__("…")`` with a literal name — resolves relative ones
against the module's installed name (``kernels/`` is ``onpolicy.kernels``) and fails on a forbidden
one, naming the file and line. The runtime in turn imports no gRPC or Prometheus and nothing
from the services above it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = {  # source folder -> its installed package name
    ROOT / "kernels": "onpolicy.kernels",
    **{ROOT / "onpolicy" / name: f"onpolicy.{name}"
       for name in ("models", "rollout", "trainer", "verification", "parallel", "jobs")},
}
RUNTIME_LIBRARIES = ("ray", "grpc", "grpc_health", "grpc_reflection", "grpc_status", "prometheus_client")
SERVICES = ("services", "onpolicy.services")
FORBIDDEN = RUNTIME_LIBRARIES + SERVICES
"""Modules (and their submodules) the domain must not import."""


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of a ``from … import`` in a module of ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(source: str, package: str) -> Iterator[tuple[int, str]]:
    """``(line, absolute module)`` for every import in ``source``, a module of ``package``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            yield node.lineno, module
            for alias in node.names:  # ``from onpolicy import services``
                yield node.lineno, f"{module}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            yield node.lineno, node.args[0].value


def violations(source: str, package: str, where: str, roots: tuple[str, ...] = FORBIDDEN) -> list[str]:
    """``where:line imports module`` for each import in ``source`` of a module under ``roots``."""
    return [f"{where}:{line} imports {module}" for line, module in imported_modules(source, package)
            if _under(module, roots)]


def domain_files() -> Iterator[tuple[Path, str]]:
    """Every domain ``.py`` with the package its imports resolve against."""
    for folder, name in DOMAIN.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            yield path, ".".join([name, *rel[:-1]])  # a package's __init__ resolves against itself
    for path in sorted((ROOT / "onpolicy").glob("*.py")):
        yield path, "onpolicy"


def test_the_domain_folders_exist() -> None:
    files = list(domain_files())
    assert all(folder.is_dir() for folder in DOMAIN)
    assert len(files) > 50, f"only {len(files)} domain modules found"


def _domain_violations(roots: tuple[str, ...]) -> list[str]:
    return [v for path, package in domain_files()
            for v in violations(path.read_text(encoding="utf-8"), package, str(path.relative_to(ROOT)), roots)]


def test_the_domain_imports_no_ray_grpc_or_prometheus() -> None:
    found = _domain_violations(RUNTIME_LIBRARIES)
    assert found == [], "the domain must not import Ray, gRPC or Prometheus:\n" + "\n".join(found)


def test_the_domain_imports_nothing_from_the_services() -> None:
    found = _domain_violations(SERVICES)
    assert found == [], "the domain must not import the runtime or the services:\n" + "\n".join(found)


RUNTIME = ROOT / "services" / "cluster"
ABOVE_THE_RUNTIME = {"actors.py"}
"""``services/cluster/actors.py`` starts the role services as Ray actors, so it sits with the services."""


def test_the_runtime_imports_no_grpc_and_no_services_above_it() -> None:
    """``services/cluster`` (Ray, peer ranks, placement) builds on the domain only: no gRPC or
    Prometheus, and from ``services`` only its own package."""
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        if path.name in ABOVE_THE_RUNTIME:
            continue
        for line, module in imported_modules(path.read_text(encoding="utf-8"), "onpolicy.services.cluster"):
            above = _under(module, SERVICES) and not _under(module, ("onpolicy.services.cluster",))
            if above or _under(module, tuple(m for m in RUNTIME_LIBRARIES if m != "ray")):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert (RUNTIME / "peers.py").is_file() and (RUNTIME / "placement.py").is_file()
    assert found == [], "the runtime must not import gRPC, Prometheus or the services above it:\n" + "\n".join(found)


NEGATIVE = '''
import os
import ray
from prometheus_client import CollectorRegistry

def serve():
    import grpc
    from onpolicy.services.cluster.local_ray import ray_env
    from ...services import api
    importlib.import_module("ray.util")
'''


def test_the_check_catches_every_kind_of_violating_import() -> None:
    """Negative control: a synthetic module of ``onpolicy.kernels.ascend`` with each kind of violation."""
    found = violations(NEGATIVE, "onpolicy.kernels.ascend", "synthetic.py")
    assert found == ["synthetic.py:3 imports ray",
                     "synthetic.py:4 imports prometheus_client",
                     "synthetic.py:4 imports prometheus_client.CollectorRegistry",
                     "synthetic.py:7 imports grpc",
                     "synthetic.py:8 imports onpolicy.services.cluster.local_ray",
                     "synthetic.py:8 imports onpolicy.services.cluster.local_ray.ray_env",
                     "synthetic.py:9 imports onpolicy.services",
                     "synthetic.py:9 imports onpolicy.services.api",
                     "synthetic.py:10 imports ray.util"]


@pytest.mark.parametrize(("source", "package", "module"), [
    ("from . import layout", "onpolicy.parallel", "onpolicy.parallel"),
    ("from ..models import registry", "onpolicy.parallel", "onpolicy.models"),
    ("from .backend import SINGLE", "onpolicy.kernels", "onpolicy.kernels.backend"),
    ("from ..services import api", "onpolicy.kernels", "onpolicy.services"),
])
def test_relative_imports_resolve_against_the_installed_name(source: str, package: str, module: str) -> None:
    assert next(m for _, m in imported_modules(source, package)) == module


def test_a_clean_module_passes() -> None:
    assert violations("import torch\nfrom onpolicy.kernels import KernelConfig\n", "onpolicy.trainer", "x.py") == []
