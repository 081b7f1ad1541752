"""Builds the torch_npu extension that registers ``torch.ops.onpolicy.*`` (package
``onpolicy_ascend_ops``). Needs torch, torch_npu (same version as torch) and the CANN toolkit; the
Ascend C operators themselves come from the custom OPP package built by ``../build.sh``.

    source $ASCEND_HOME_PATH/set_env.sh
    python setup.py bdist_wheel && pip install dist/onpolicy_ascend_ops-*.whl
"""

import glob
import os

import torch_npu
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension
from torch_npu.utils.cpp_extension import NpuExtension

HERE = os.path.dirname(os.path.realpath(__file__))
TORCH_NPU = os.path.dirname(os.path.abspath(torch_npu.__file__))

ext = NpuExtension(
    name="onpolicy_ascend_ops._C",
    sources=sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp"))),
    extra_compile_args=[
        "-O2",
        "-I" + os.path.join(TORCH_NPU, "include", "third_party", "acl", "inc"),
        "-I" + os.path.join(TORCH_NPU, "include", "third_party", "op-plugin"),
        "-I" + os.path.join(TORCH_NPU, "include", "third_party", "op-plugin", "op_plugin", "include"),
    ],
)

setup(
    name="onpolicy_ascend_ops",
    version="0.1.0",
    description="torch.ops.onpolicy.*: the onpolicy consistent operator set on Ascend NPUs",
    packages=find_packages(include=["onpolicy_ascend_ops"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=os.getenv("USE_NINJA") == "1")},
)
