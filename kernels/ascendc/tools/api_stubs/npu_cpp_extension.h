// Stand-in for torch_npu's npu_cpp_extension.h (syntax check only).
#pragma once
template <typename... Args> void ExecNpuCmdStub(const char *, const Args &...) {}
#define EXEC_NPU_CMD_EXT(api, ...) ExecNpuCmdStub(#api, __VA_ARGS__)
