"""Generated gRPC modules of ``protos/onpolicy/v1`` (never edited, never committed, not linted).

Import them as ``from onpolicy.services.generated.onpolicy.v1 import rollout_pb2, rollout_pb2_grpc``
or, nicer, ``from onpolicy.services import api`` (``api.rollout_pb2`` ...).

They are produced by the project's build: ``setup.py``'s ``build_py`` hook runs
``onpolicy.services.common.protogen`` for wheel builds and for ``pip install -e .``. Importing this
package also calls :func:`ensure`, the fallback for source checkouts: when the .proto files are
present (a checkout, an editable install) and the generated modules are missing or were generated
from different .proto sources (a content stamp, not mtimes), they are regenerated here with
``grpc_tools.protoc`` (grpcio-tools must be installed). An installed wheel ships the modules and no
.proto files, so nothing is checked there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from onpolicy.services.common import protogen

OUT_ROOT = Path(__file__).resolve().parent
#: Where the .proto sources live in a checkout / editable install (absent in an installed wheel).
PROTO_ROOT = OUT_ROOT.parents[1] / "protos"


def ensure() -> bool:
    """Make sure the generated modules exist and match the .proto files; returns True if it
    (re)generated them. Raises ImportError when they are missing and cannot be generated."""
    if not protogen.proto_files(PROTO_ROOT):
        if protogen.has_modules(OUT_ROOT):
            return False
        raise ImportError(f"onpolicy gRPC modules are missing from {OUT_ROOT} and there are no .proto files "
                          f"at {PROTO_ROOT} to generate them from; reinstall onpolicy")
    if protogen.is_current(PROTO_ROOT, OUT_ROOT):
        return False
    try:
        return bool(protogen.generate(PROTO_ROOT, OUT_ROOT))
    except (protogen.ProtogenError, OSError) as e:
        if protogen.has_modules(OUT_ROOT):
            warnings.warn(f"onpolicy gRPC modules are stale and could not be regenerated ({e}); using them anyway",
                          RuntimeWarning, stacklevel=2)
            return False
        raise ImportError(f"onpolicy gRPC modules are missing and could not be generated: {e} "
                          f"(run `python setup.py build_py` or `pip install -e .`)") from e


ensure()
