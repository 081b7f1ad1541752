"""Code generation for the gRPC API: ``protos/onpolicy/v1/*.proto`` -> ``services/generated/onpolicy/v1``.

One implementation serves two callers:

* ``setup.py``'s ``build_py`` hook (every wheel build and every ``pip install -e .``), which loads this
  file by path — so it must import nothing beyond the standard library at module level;
* ``python -m onpolicy.services.common.protogen``, after a .proto is edited in a checkout (importing
  ``onpolicy.services.generated`` checks the stamp below and names this command when it is stale).

``grpc_tools.protoc`` writes modules that import each other absolutely (``from onpolicy.v1 import
common_pb2``); ``onpolicy`` is our real package, so those imports are rewritten to relative ones
(``from . import common_pb2``). The output carries a stamp (sha256 of the .proto sources and of this
generator's format version); ``is_current`` compares it, so an edited .proto regenerates and an
untouched one never does. Generation is atomic per file and serialised by a lock file, so parallel
processes importing a stale checkout cannot observe a half-written module set.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: Bump when the post-processing below changes, so existing output is regenerated.
FORMAT_VERSION = 1
#: The proto package directory, relative to both the proto root and the output root.
PACKAGE_DIR = Path("onpolicy") / "v1"
STAMP = ".protos.sha256"
_ABSOLUTE_IMPORT = re.compile(r"^from onpolicy\.v1 import (\w+_pb2)\b", re.MULTILINE)
_INIT = '"""Generated from protos/{pkg} by onpolicy.services.common.protogen; do not edit."""\n'


class ProtogenError(RuntimeError):
    """protoc failed, or there is nothing to generate from."""


def proto_files(proto_root: Path) -> list[Path]:
    return sorted((proto_root / PACKAGE_DIR).glob("*.proto"))


def expected_modules(proto_root: Path) -> list[str]:
    """Module file names generation produces (every .proto gets a ``_pb2`` and a ``_pb2_grpc``)."""
    return [f"{p.stem}{suffix}.py" for p in proto_files(proto_root) for suffix in ("_pb2", "_pb2_grpc")]


def sources_digest(proto_root: Path) -> str:
    h = hashlib.sha256(f"format {FORMAT_VERSION}\n".encode())
    for p in proto_files(proto_root):
        h.update(f"{p.relative_to(proto_root).as_posix()}\n".encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def is_current(proto_root: Path, out_root: Path) -> bool:
    """True when ``out_root`` holds every module generated from exactly the current .proto files."""
    pkg = out_root / PACKAGE_DIR
    try:
        stamp = (pkg / STAMP).read_text().strip()
    except OSError:
        return False
    return stamp == sources_digest(proto_root) and all((pkg / m).is_file() for m in expected_modules(proto_root))


def has_modules(out_root: Path) -> bool:
    """True when some generated output exists (e.g. an installed wheel, which ships no .proto files)."""
    return (out_root / PACKAGE_DIR / "common_pb2.py").is_file()


def relativize(source: str) -> str:
    """``from onpolicy.v1 import x_pb2`` -> ``from . import x_pb2`` (the generated package is nested)."""
    return _ABSOLUTE_IMPORT.sub(r"from . import \1", source)


@contextlib.contextmanager
def _locked(out_root: Path) -> Iterator[None]:
    out_root.mkdir(parents=True, exist_ok=True)
    with open(out_root / ".protogen.lock", "w") as lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: per-file atomic renames still keep every module whole
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_protoc(proto_root: Path, files: list[Path], dest: Path) -> None:
    try:
        from importlib.resources import files as resource_files

        from grpc_tools import protoc
    except ImportError as e:
        raise ProtogenError("generating the gRPC modules needs grpcio-tools (pip install grpcio-tools)") from e
    well_known = resource_files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={dest}",
            f"--grpc_python_out={dest}", f"--pyi_out={dest}", *(str(f) for f in files)]
    rc = protoc.main(args)
    if rc != 0:
        raise ProtogenError(f"grpc_tools.protoc exited with {rc} on {proto_root / PACKAGE_DIR}")


def generate(proto_root: Path, out_root: Path) -> list[Path]:
    """(Re)generate the modules of every ``proto_root/onpolicy/v1/*.proto`` under ``out_root``.

    Writes ``out_root/onpolicy/__init__.py``, ``out_root/onpolicy/v1/__init__.py``, the ``*_pb2.py``,
    ``*_pb2.pyi`` and ``*_pb2_grpc.py`` modules with relative imports, removes modules of deleted
    .proto files, and writes the stamp last. Returns the module paths written.
    """
    proto_root, out_root = Path(proto_root).resolve(), Path(out_root).resolve()
    files = proto_files(proto_root)
    if not files:
        raise ProtogenError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    with _locked(out_root):
        if is_current(proto_root, out_root):
            return []
        pkg = out_root / PACKAGE_DIR
        pkg.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".protogen-", dir=out_root))
        try:
            _run_protoc(proto_root, files, tmp)
            produced = sorted((tmp / PACKAGE_DIR).iterdir())
            names = {p.name for p in produced}
            for stale in pkg.glob("*_pb2*.py*"):
                if stale.name not in names:
                    stale.unlink()
            written = []
            for src in produced:
                src.write_text(relativize(src.read_text()))
                os.replace(src, pkg / src.name)
                written.append(pkg / src.name)
            for init, name in ((out_root / "onpolicy", "onpolicy"), (pkg, PACKAGE_DIR.as_posix())):
                (init / "__init__.py").write_text(_INIT.format(pkg=name))
            (pkg / STAMP).write_text(sources_digest(proto_root) + "\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return written


def main() -> int:
    """``python -m onpolicy.services.common.protogen``: regenerate a checkout's gRPC modules."""
    import sys

    root = Path(__file__).resolve().parents[2]
    try:
        written = generate(root / "protos", root / "services" / "generated")
    except ProtogenError as e:
        print(f"protogen: {e}", file=sys.stderr)
        return 2
    print(f"generated {len(written)} modules" if written else "the gRPC modules are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
