"""Static checks of the CANN-only sources (kernels/ascendc) that need no CANN.

* every op_host / op_kernel file passes ``g++ -fsyntax-only`` against tools/api_stubs — our own
  model of the CANN API (catches our C++ mistakes, NOT disagreements with a real CANN release);
* the operator interface is written once per layer and the layers agree: msopgen JSON, OpDef
  inputs/outputs/attributes, kernel entry parameters, the aclnn calls of the torch extension and
  its TORCH_LIBRARY schemas, and the emulation used by the CPU backend tests.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess

import pytest
from ascend_cpu_support import ASCENDC
from test_ascend_backend_cpu import ReplayOps

OPS = {  # op type -> (kernel source, torch op name)
    "OnpolicyFlashAttention": ("onpolicy_flash_attention", "flash_attention"),
    "OnpolicyFlashAttentionGrad": ("onpolicy_flash_attention_grad", "flash_attention_grad"),
    "OnpolicyPagedAttention": ("onpolicy_paged_attention", "paged_attention"),
    "OnpolicyMatmul": ("onpolicy_matmul", "matmul"),
    "OnpolicyRmsNorm": ("onpolicy_rms_norm", "rms_norm"),
    "OnpolicyLogSoftmax": ("onpolicy_log_softmax", "log_softmax"),
}


def opdef(source: str) -> tuple[list[str], list[str], list[str]]:
    """Input, output and attribute names of the OpDef in an op_host file, in order."""
    inputs = re.findall(r'this->Input\("(\w+)"\)', source)
    loop = re.search(r"for \(const char \*name_in : \{([^}]*)\}\)", source)
    if loop:  # the grad op declares its first inputs in a loop
        inputs = re.findall(r'"(\w+)"', loop.group(1)) + inputs
    return inputs, re.findall(r'this->Output\("(\w+)"\)', source), re.findall(r'this->Attr\("(\w+)"\)', source)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.parametrize("dtype", ["float", "bfloat16_t"])
def test_cann_sources_compile_against_the_api_stand_ins(dtype: str) -> None:
    flags = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
             f"-I{ASCENDC / 'tools' / 'api_stubs'}", f"-I{ASCENDC / 'common'}"]
    files = [(p, "op_host") for p in sorted((ASCENDC / "op_host").glob("*.cpp"))]
    files += [(p, "op_kernel") for p in sorted((ASCENDC / "op_kernel").glob("*.cpp"))]
    assert len(files) == 12
    for path, side in files:
        cmd = [*flags, f"-I{ASCENDC / side}", f"-DDTYPE_Q={dtype}", f"-DDTYPE_X={dtype}", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{path.name}:\n{done.stderr[-3000:]}"


def test_operator_interface_agrees_across_layers() -> None:
    spec = {op["op"]: op for op in json.loads((ASCENDC / "onpolicy_ops.json").read_text())}
    assert set(spec) == set(OPS)
    ext = (ASCENDC / "torch_ext" / "csrc" / "onpolicy_ops.cpp").read_text()
    for op_type, (stem, torch_name) in OPS.items():
        inputs, outputs, attrs = opdef((ASCENDC / "op_host" / f"{stem}.cpp").read_text())
        js = spec[op_type]
        assert inputs == [d["name"] for d in js["input_desc"]], op_type
        assert outputs == [d["name"] for d in js["output_desc"]], op_type
        assert attrs == [a["name"] for a in js.get("attr", [])], op_type
        # kernel entry: inputs, outputs, workspace, tiling — same names, same order
        kernel = (ASCENDC / "op_kernel" / f"{stem}.cpp").read_text()
        entry = re.search(rf"void {stem}\(([^)]*)\)", kernel)
        assert entry, f"no kernel entry {stem}"
        params = [p.split()[-1] for p in entry.group(1).split(",")]
        assert params == [*inputs, *outputs, "workspace", "tiling"], (op_type, params)
        # aclnn call of the torch extension: inputs, then attributes, then outputs
        call = re.search(rf"EXEC_NPU_CMD_EXT\(aclnn{op_type},([^;]*)\);", ext)
        assert call, f"no aclnn{op_type} call"
        args = [a.strip() for a in call.group(1).split(",")]
        assert len(args) == len(inputs) + len(attrs) + len(outputs), (op_type, args)
        # the schema registered for torch.ops.onpolicy.<name> and the CPU emulation take the same arguments
        schema = re.search(rf'm\.def\("{torch_name}\(([^)]*)\)', ext.replace('"\n          "', ""))
        assert schema, f"no schema for {torch_name}"
        names = [p.split("=")[0].split()[-1] for p in schema.group(1).split(",")]
        emulated = list(inspect.signature(getattr(ReplayOps, torch_name)).parameters)[1:]
        assert names == emulated, (torch_name, names, emulated)


def test_tiling_structs_are_registered_by_every_kernel() -> None:
    for _op_type, (stem, _) in OPS.items():
        kernel = (ASCENDC / "op_kernel" / f"{stem}.cpp").read_text()
        registered = re.search(r"REGISTER_TILING_DEFAULT\((\w+)\)", kernel).group(1)
        got = re.search(r"GET_TILING_DATA_WITH_STRUCT\((\w+),", kernel).group(1)
        host = (ASCENDC / "op_host" / f"{stem}.cpp").read_text()
        assert registered == got and f"GetTilingData<onpolicy::{registered}>" in host, stem
