"""Maps the top-level folders into the ``onpolicy.*`` namespace and generates the gRPC
modules at build time.

``kernels/`` installs as ``onpolicy.kernels``, ``services/`` as ``onpolicy.services`` and ``bench/`` as
``onpolicy.bench``; nothing is installed as a top-level ``kernels``, ``services`` or ``bench`` package.

``build_py`` first runs ``grpc_tools.protoc`` on ``protos/onpolicy/v1/*.proto`` into
``services/generated/onpolicy/v1`` (relative imports, gitignored; see
``services/common/protogen.py``). It writes into the source tree so that regular builds (which copy
it into the wheel) and editable installs (which import it from there) see the same modules.
"""

import importlib.util
import logging
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ROOTS = {
    "onpolicy": "onpolicy",
    "onpolicy.kernels": "kernels",
    "onpolicy.services": "services",
    "onpolicy.bench": "bench",
}
# Created by the build hook, so find_packages does not see them in a fresh checkout (and egg_info
# would refuse them there as missing directories): the hook adds them once they exist.
GENERATED_PACKAGES = ["onpolicy.services.generated.onpolicy", "onpolicy.services.generated.onpolicy.v1"]


def _protogen():
    """``services/common/protogen.py`` loaded by path (the package is not importable at build time)."""
    spec = importlib.util.spec_from_file_location("_onpolicy_protogen", HERE / "services" / "common" / "protogen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """``build_py`` that generates the gRPC modules first (also in editable mode, where setuptools'
    own ``build_py`` copies nothing)."""

    def run(self):
        protogen = _protogen()
        out_root = HERE / "services" / "generated"
        proto_root = HERE / "protos"
        if protogen.proto_files(proto_root):
            written = protogen.generate(proto_root, out_root)
            self.announce(f"generated {len(written)} gRPC modules in {out_root}" if written
                          else "gRPC modules are up to date", level=logging.INFO)
        elif not protogen.has_modules(out_root):
            raise RuntimeError(f"no .proto files in {proto_root} and no generated modules in {out_root}")
        self.packages = [*self.packages, *(p for p in GENERATED_PACKAGES if p not in self.packages)]
        super().run()


packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, include_package_data=True,
      package_data={"onpolicy.services.generated.onpolicy.v1": ["*.pyi"], "onpolicy.kernels.cpu": ["*.c", "*.h"],
                    "onpolicy.bench": ["*.c"]},
      cmdclass={"build_py": BuildPyWithProtos})
