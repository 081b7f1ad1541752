/*
 * torch_npu extension: registers torch.ops.onpolicy.* and binds them to the onpolicy Ascend C
 * operators (custom OPP package built by kernels/ascendc/build.sh) through the aclnn two-stage
 * API (aclnnXxxGetWorkspaceSize + aclnnXxx) via EXEC_NPU_CMD_EXT.
 *
 * Schemas (every service calls exactly these):
 *   flash_attention(q, k, v, seq_meta, scale, kv_tile, row_tile, row_tiles_per_block) -> (out, lse)
 *   flash_attention_grad(q, k, v, out, dout, lse, seq_meta, scale, kv_tile, row_tile,
 *                        row_tiles_per_block) -> (dq, dk, dv)
 *   paged_attention(q, k_pages, v_pages, block_table, seq_meta, scale, kv_tile, row_tile,
 *                   row_tiles_per_block) -> out
 *   matmul(x, weight) -> y                 y = x @ weight^T, batch-invariant
 *   rms_norm(x, weight, eps) -> y
 *   log_softmax(logits, temperature) -> out   fp32 log_softmax(logits / temperature[:, None])
 *
 * seq_meta is an int64 [S, 5] tensor (q_offset, q_len, q_start, kv_offset, kv_len), normally on
 * the CPU: the host tiling reads it as an attribute and the kernel reads a device copy.
 */
#include <torch/extension.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "npu_cpp_extension.h"  // EXEC_NPU_CMD_EXT (torch_npu / op-plugin headers)

namespace {

constexpr int64_t kSeqMetaCols = 5;

std::vector<int64_t> HostMeta(const at::Tensor &seq_meta)
{
    TORCH_CHECK(seq_meta.dim() == 2 && seq_meta.size(1) == kSeqMetaCols, "seq_meta must be [S, 5] int64");
    const at::Tensor cpu = seq_meta.to(at::kCPU, at::kLong).contiguous();
    return std::vector<int64_t>(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
}

at::Tensor DeviceMeta(const at::Tensor &seq_meta, const at::Tensor &like)
{
    return seq_meta.to(like.device(), at::kLong).contiguous();
}

void CheckAttentionInputs(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v)
{
    TORCH_CHECK(q.dim() == 3, "q must be [N, Hq, D]");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "q, k and v must share one dtype");
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "attention inputs must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> flash_attention_npu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                                       const at::Tensor &seq_meta, double scale, int64_t kv_tile,
                                                       int64_t row_tile, int64_t row_tiles_per_block)
{
    const c10::OptionalDeviceGuard guard(device_of(q));
    CheckAttentionInputs(q, k, v);
    const std::vector<int64_t> host = HostMeta(seq_meta);
    const at::IntArrayRef host_ref(host);
    const at::Tensor meta = DeviceMeta(seq_meta, q);
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
    EXEC_NPU_CMD_EXT(aclnnOnpolicyFlashAttention, q, k, v, meta, host_ref, scale, kv_tile, row_tile,
                     row_tiles_per_block, out, lse);
    return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_grad_npu(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out, const at::Tensor &dout,
    const at::Tensor &lse, const at::Tensor &seq_meta, double scale, int64_t kv_tile, int64_t row_tile,
    int64_t row_tiles_per_block)
{
    const c10::OptionalDeviceGuard guard(device_of(q));
    CheckAttentionInputs(q, k, v);
    const std::vector<int64_t> host = HostMeta(seq_meta);
    const at::IntArrayRef host_ref(host);
    const at::Tensor meta = DeviceMeta(seq_meta, q);
    const at::Tensor dout_c = dout.contiguous();
    at::Tensor dq = at::empty_like(q);
    at::Tensor dk = at::empty_like(k);
    at::Tensor dv = at::empty_like(v);
    EXEC_NPU_CMD_EXT(aclnnOnpolicyFlashAttentionGrad, q, k, v, out, dout_c, lse, meta, host_ref, scale, kv_tile,
                     row_tile, row_tiles_per_block, dq, dk, dv);
    return {dq, dk, dv};
}

at::Tensor paged_attention_npu(const at::Tensor &q, const at::Tensor &k_pages, const at::Tensor &v_pages,
                               const at::Tensor &block_table, const at::Tensor &seq_meta, double scale,
                               int64_t kv_tile, int64_t row_tile, int64_t row_tiles_per_block)
{
    const c10::OptionalDeviceGuard guard(device_of(q));
    CheckAttentionInputs(q, k_pages, v_pages);
    TORCH_CHECK(k_pages.dim() == 4, "k_pages must be [P, page_size, Hkv, D]");
    const std::vector<int64_t> host = HostMeta(seq_meta);
    const at::IntArrayRef host_ref(host);
    const at::Tensor meta = DeviceMeta(seq_meta, q);
    const at::Tensor table = block_table.to(q.device(), at::kInt).contiguous();
    at::Tensor out = at::empty_like(q);
    EXEC_NPU_CMD_EXT(aclnnOnpolicyPagedAttention, q, k_pages, v_pages, table, meta, host_ref, scale, kv_tile,
                     row_tile, row_tiles_per_block, out);
    return out;
}

at::Tensor matmul_npu(const at::Tensor &x, const at::Tensor &weight)
{
    const c10::OptionalDeviceGuard guard(device_of(x));
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "matmul expects x [M, K], w [N, K]");
    const at::Tensor xc = x.contiguous();
    const at::Tensor wc = weight.to(x.scalar_type()).contiguous();
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    EXEC_NPU_CMD_EXT(aclnnOnpolicyMatmul, xc, wc, y);
    return y;
}

at::Tensor rms_norm_npu(const at::Tensor &x, const at::Tensor &weight, double eps)
{
    const c10::OptionalDeviceGuard guard(device_of(x));
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const at::Tensor wc = weight.to(x.scalar_type()).contiguous();
    at::Tensor y = at::empty_like(x2);
    EXEC_NPU_CMD_EXT(aclnnOnpolicyRmsNorm, x2, wc, eps, y);
    return y.view(x.sizes());
}

at::Tensor log_softmax_npu(const at::Tensor &logits, const at::Tensor &temperature)
{
    const c10::OptionalDeviceGuard guard(device_of(logits));
    TORCH_CHECK(logits.dim() == 2 && temperature.dim() == 1 && temperature.size(0) == logits.size(0),
                "log_softmax expects logits [N, V] and temperature [N]");
    const at::Tensor lc = logits.to(at::kFloat).contiguous();
    const at::Tensor tc = temperature.to(logits.device(), at::kFloat).contiguous();
    at::Tensor out = at::empty_like(lc);
    EXEC_NPU_CMD_EXT(aclnnOnpolicyLogSoftmax, lc, tc, out);
    return out;
}

/* Meta (shape-only) implementations, for torch.compile / fake tensors. */
std::tuple<at::Tensor, at::Tensor> flash_attention_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &,
                                                        const at::Tensor &, double, int64_t, int64_t, int64_t)
{
    return {at::empty_like(q), at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_grad_meta(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &, const at::Tensor &,
    const at::Tensor &, const at::Tensor &, double, int64_t, int64_t, int64_t)
{
    return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

at::Tensor paged_attention_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                const at::Tensor &, double, int64_t, int64_t, int64_t)
{
    return at::empty_like(q);
}

at::Tensor matmul_meta(const at::Tensor &x, const at::Tensor &weight)
{
    return at::empty({x.size(0), weight.size(0)}, x.options());
}

at::Tensor rms_norm_meta(const at::Tensor &x, const at::Tensor &, double) { return at::empty_like(x); }

at::Tensor log_softmax_meta(const at::Tensor &logits, const at::Tensor &)
{
    return at::empty_like(logits, logits.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY(onpolicy, m)
{
    m.def("flash_attention(Tensor q, Tensor k, Tensor v, Tensor seq_meta, float scale, int kv_tile, int row_tile, "
          "int row_tiles_per_block=1) -> (Tensor, Tensor)");
    m.def("flash_attention_grad(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor seq_meta, "
          "float scale, int kv_tile, int row_tile, int row_tiles_per_block=1) -> (Tensor, Tensor, Tensor)");
    m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_meta, "
          "float scale, int kv_tile, int row_tile, int row_tiles_per_block=1) -> Tensor");
    m.def("matmul(Tensor x, Tensor weight) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("log_softmax(Tensor logits, Tensor temperature) -> Tensor");
}

// NPU device: PrivateUse1 since torch 2.1.
TORCH_LIBRARY_IMPL(onpolicy, PrivateUse1, m)
{
    m.impl("flash_attention", &flash_attention_npu);
    m.impl("flash_attention_grad", &flash_attention_grad_npu);
    m.impl("paged_attention", &paged_attention_npu);
    m.impl("matmul", &matmul_npu);
    m.impl("rms_norm", &rms_norm_npu);
    m.impl("log_softmax", &log_softmax_npu);
}

TORCH_LIBRARY_IMPL(onpolicy, Meta, m)
{
    m.impl("flash_attention", &flash_attention_meta);
    m.impl("flash_attention_grad", &flash_attention_grad_meta);
    m.impl("paged_attention", &paged_attention_meta);
    m.impl("matmul", &matmul_meta);
    m.impl("rms_norm", &rms_norm_meta);
    m.impl("log_softmax", &log_softmax_meta);
}
