"""Generated gRPC modules of ``protos/onpolicy/v1`` (never edited, never committed, not linted).

Import them as ``from onpolicy.services.generated.onpolicy.v1 import rollout_pb2, rollout_pb2_grpc``
or, nicer, ``from onpolicy.services import api`` (``api.rollout_pb2`` ...).

The build produces them: ``setup.py``'s ``build_py`` hook runs ``onpolicy.services.common.protogen``
for wheel builds and for ``pip install -e .``; after editing a .proto in a checkout, run
``python -m onpolicy.services.common.protogen``. Importing this package generates nothing: it checks
that the modules exist and, where the .proto files are present (a checkout), that they were generated
from these very sources (a content stamp), and otherwise fails with an ``ImportError`` naming the
command to run. An installed wheel ships the modules and no .proto files, so nothing is compared there.
"""

from __future__ import annotations

from pathlib import Path

from onpolicy.services.common import protogen

OUT_ROOT = Path(__file__).resolve().parent
#: Where the .proto sources live in a checkout / editable install (absent in an installed wheel).
PROTO_ROOT = OUT_ROOT.parents[1] / "protos"
REGENERATE = "python -m onpolicy.services.common.protogen"


def check() -> None:
    """``ImportError`` naming the fix when the generated modules are missing or, in a checkout, were
    generated from other .proto sources than the ones there."""
    if not protogen.has_modules(OUT_ROOT):
        fix = REGENERATE if protogen.proto_files(PROTO_ROOT) else "reinstall onpolicy"
        raise ImportError(f"onpolicy's gRPC modules are missing from {OUT_ROOT}: run `{fix}` (or `pip install -e .`)")
    if protogen.proto_files(PROTO_ROOT) and not protogen.is_current(PROTO_ROOT, OUT_ROOT):
        raise ImportError(f"onpolicy's gRPC modules in {OUT_ROOT} were generated from other .proto sources than "
                          f"{PROTO_ROOT}: run `{REGENERATE}`")


check()
