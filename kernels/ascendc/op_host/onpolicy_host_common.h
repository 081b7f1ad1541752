/*
 * onpolicy Ascend operators — host helpers shared by every op_host file (CANN build only).
 *
 * The attention ops (training forward, training backward, inference) all build their tiling
 * through AttentionTilingCommon(), i.e. through tp::BuildAttentionPlan() of common/tile_plan.cpp:
 * the same function the CPU tests call. Every Cube tiling is made for a fixed shape derived
 * from the operator set's constants, never from the token count.
 */
#ifndef ONPOLICY_ASCENDC_HOST_COMMON_H
#define ONPOLICY_ASCENDC_HOST_COMMON_H

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "op_tiling_data.h"
#include "register/op_def_registry.h"
#include "tile_plan.h"
#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"

namespace onpolicy {
namespace host {

/* Attribute order shared by the three attention ops. */
constexpr size_t kAttrSeqMeta = 0;       // ListInt: seq_meta flattened [S * kSeqMetaCols]
constexpr size_t kAttrScale = 1;         // Float
constexpr size_t kAttrKvTile = 2;        // Int
constexpr size_t kAttrRowTile = 3;       // Int
constexpr size_t kAttrRowTilesPerBlock = 4;  // Int

inline int32_t DtypeBytes(ge::DataType dt)
{
    return dt == ge::DT_FLOAT ? 4 : 2;
}

inline matmul_tiling::DataType CubeDtype(ge::DataType dt)
{
    switch (dt) {
        case ge::DT_FLOAT16:
            return matmul_tiling::DataType::DT_FLOAT16;
        case ge::DT_BF16:
            return matmul_tiling::DataType::DT_BFLOAT16;
        default:
            return matmul_tiling::DataType::DT_FLOAT;
    }
}

/* One Cube tiling for a fixed [m, n, k] GEMM with GM operands and a GM result. */
inline bool CubeTiling(const platform_ascendc::PlatformAscendC &plat, int32_t m, int32_t n, int32_t k, bool trans_a,
                       bool trans_b, matmul_tiling::DataType in_dt, matmul_tiling::DataType out_dt,
                       AscendC::tiling::TCubeTiling &out, int32_t fix_m = -1, int32_t fix_n = -1,
                       int32_t fix_k = -1)
{
    matmul_tiling::MatmulApiTiling t(plat);
    t.SetAType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, in_dt, trans_a);
    t.SetBType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, in_dt, trans_b);
    t.SetCType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, out_dt);
    t.SetBiasType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
    t.SetShape(m, n, k);
    t.SetOrgShape(m, n, k);
    t.SetBias(false);
    if (fix_m > 0) {
        t.SetFixSplit(fix_m, fix_n, fix_k);
    }
    t.SetBufferSpace(-1, -1, -1);
    return t.GetTiling(out) != -1;
}

/* Sequence metadata from the ListInt attribute ([S, 5] flattened, see op_tiling_data.h). */
inline tp::HostSeqs SeqsFromMeta(const int64_t *meta, size_t count, int32_t kv_layout, int32_t max_pages)
{
    if (count == 0 || count % kSeqMetaCols != 0) {
        throw std::invalid_argument("seq_meta_host must hold 5 integers per sequence");
    }
    tp::HostSeqs seqs;
    for (size_t s = 0; s < count / kSeqMetaCols; ++s) {
        const int64_t *row = meta + s * kSeqMetaCols;
        seqs.q_offset.push_back(row[kMetaQOffset]);
        seqs.q_len.push_back(static_cast<int32_t>(row[kMetaQLen]));
        seqs.q_start.push_back(static_cast<int32_t>(row[kMetaQStart]));
        seqs.kv_offset.push_back(row[kMetaKvOffset]);
        seqs.kv_len.push_back(static_cast<int32_t>(row[kMetaKvLen]));
    }
    if (kv_layout == tp::kKvPaged) {
        // The page indices live on the device (block_table input); the host plan only needs the
        // table's width. A placeholder table keeps ValidateAttention's size check meaningful.
        seqs.max_pages = max_pages;
        seqs.block_table.assign(seqs.q_len.size() * static_cast<size_t>(max_pages), 0);
        seqs.kv_offset.clear();
    }
    return seqs;
}

struct AttentionCall {
    tp::AttentionPlan plan;
    ge::DataType dtype = ge::DT_FLOAT;
    int32_t block_dim = 1;  // AIC cores; each drives 2 AIV workers (MIX_AIC_1_2)
};

/* Reads shapes and attributes, builds the shared plan. q: input 0 [N, Hq, D]; K/V: input 1
 * [rows, Hkv, D] (contiguous) or [P, page_size, Hkv, D] (paged); block table: input `table_idx`. */
inline ge::graphStatus AttentionTilingCommon(gert::TilingContext *ctx, int32_t kv_layout, int32_t table_idx,
                                             bool backward, AttentionCall &call)
{
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    const gert::Shape &q = ctx->GetInputShape(0)->GetStorageShape();
    const gert::Shape &kv = ctx->GetInputShape(1)->GetStorageShape();
    const gert::RuntimeAttrs *attrs = ctx->GetAttrs();
    const auto *meta = attrs->GetAttrPointer<gert::ContinuousVector>(kAttrSeqMeta);
    const float *scale = attrs->GetAttrPointer<float>(kAttrScale);
    const int64_t *kv_tile = attrs->GetAttrPointer<int64_t>(kAttrKvTile);
    const int64_t *row_tile = attrs->GetAttrPointer<int64_t>(kAttrRowTile);
    const int64_t *rtpb = attrs->GetAttrPointer<int64_t>(kAttrRowTilesPerBlock);
    if (meta == nullptr || scale == nullptr || kv_tile == nullptr || row_tile == nullptr || rtpb == nullptr ||
        q.GetDimNum() != 3) {
        return ge::GRAPH_FAILED;
    }
    call.dtype = ctx->GetInputDesc(0)->GetDataType();
    tp::AttnConsts c;
    c.num_heads = static_cast<int32_t>(q.GetDim(1));
    c.head_dim = static_cast<int32_t>(q.GetDim(2));
    c.kv_tile = static_cast<int32_t>(*kv_tile);
    c.row_tile = static_cast<int32_t>(*row_tile);
    c.row_tiles_per_block = static_cast<int32_t>(*rtpb);
    c.dtype_bytes = DtypeBytes(call.dtype);
    c.scale = *scale;
    int32_t page_size = 0;
    int32_t max_pages = 0;
    if (kv_layout == tp::kKvPaged) {
        if (kv.GetDimNum() != 4) {
            return ge::GRAPH_FAILED;
        }
        page_size = static_cast<int32_t>(kv.GetDim(1));
        c.num_kv_heads = static_cast<int32_t>(kv.GetDim(2));
        max_pages = static_cast<int32_t>(ctx->GetInputShape(table_idx)->GetStorageShape().GetDim(1));
    } else {
        if (kv.GetDimNum() != 3) {
            return ge::GRAPH_FAILED;
        }
        c.num_kv_heads = static_cast<int32_t>(kv.GetDim(1));
    }
    try {
        const auto *data = reinterpret_cast<const int64_t *>(meta->GetData());
        call.plan = tp::BuildAttentionPlan(c, kv_layout, page_size, SeqsFromMeta(data, meta->GetSize(), kv_layout,
                                                                               max_pages),
                                           static_cast<int32_t>(plat.GetCoreNumAiv()));
    } catch (const std::exception &) {
        return ge::GRAPH_FAILED;
    }
    const tp::AttnBudget budget = backward ? tp::BackwardBudget(call.plan.geometry) : tp::ForwardBudget(call.plan.geometry);
    if (budget.ub_bytes > tp::kUbBytesLimit) {
        return ge::GRAPH_FAILED;
    }
    call.block_dim = (call.plan.geometry.workers + 1) / 2;
    ctx->SetBlockDim(static_cast<uint32_t>(call.block_dim));
    size_t *ws = ctx->GetWorkspaceSizes(1);
    ws[0] = static_cast<size_t>(plat.GetLibApiWorkSpaceSize()) +
            static_cast<size_t>(2 * call.block_dim) * static_cast<size_t>(budget.workspace_per_worker);
    ctx->SetTilingKey(0);
    return ge::GRAPH_SUCCESS;
}

}  // namespace host
}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_HOST_COMMON_H
