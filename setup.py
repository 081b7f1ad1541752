"""Maps the top-level folders into the ``onpolicy.*`` namespace (DESIGN §2).

``kernels/`` installs as ``onpolicy.kernels``, ``services/`` as ``onpolicy.services`` and ``bench/`` as
``onpolicy.bench``; nothing is installed as a top-level ``kernels``, ``services`` or ``bench`` package.
"""

from setuptools import find_packages, setup

ROOTS = {
    "onpolicy": "onpolicy",
    "onpolicy.kernels": "kernels",
    "onpolicy.services": "services",
    "onpolicy.bench": "bench",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, include_package_data=True)
