/*
 * onpolicy Ascend operator set — host-side tiling shared by the training and inference ops.
 *
 * Plain C++17, no CANN dependency: the op_host tiling functions of
 *   OnpolicyFlashAttention / OnpolicyFlashAttentionGrad (training) and
 *   OnpolicyPagedAttention (inference: prefill, chunked prefill, paged decode)
 * all build their tiling data through BuildAttentionPlan() below, and the CPU tests call the same
 * code through the C ABI in tile_plan.cpp. The kernels decode their tasks with the functions of
 * tile_plan_core.h, so host and device agree on the plan by construction.
 */
#ifndef ONPOLICY_ASCENDC_TILE_PLAN_H
#define ONPOLICY_ASCENDC_TILE_PLAN_H

#include <cstdint>
#include <string>
#include <vector>

#include "tile_plan_core.h"

namespace onpolicy {
namespace tp {

/* Constants of the operator set and the model (KernelConfig + attention shape). */
struct AttnConsts {
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;
    int32_t kv_tile = 64;
    int32_t row_tile = 8;
    int32_t row_tiles_per_block = 1;
    int32_t dtype_bytes = 4;
    float scale = 1.0f;
};

/* Host view of the sequences of one call. Training: q_start = 0, kv_len = q_len,
 * kv_offset = cu_seqlens[s]. Inference: q_start = cached length, paged K/V. */
struct HostSeqs {
    std::vector<int32_t> q_len;
    std::vector<int32_t> q_start;
    std::vector<int32_t> kv_len;
    std::vector<int64_t> q_offset;   // packed query row of the first query of each sequence
    std::vector<int64_t> kv_offset;  // contiguous layout only
    std::vector<int32_t> block_table;  // paged layout only: [num_seqs * max_pages]
    int32_t max_pages = 0;

    int32_t QLen(int32_t s) const { return q_len[static_cast<size_t>(s)]; }
    int32_t QStart(int32_t s) const { return q_start[static_cast<size_t>(s)]; }
    int32_t KvLen(int32_t s) const { return kv_len[static_cast<size_t>(s)]; }
    int64_t QOffset(int32_t s) const { return q_offset[static_cast<size_t>(s)]; }
    int64_t KvOffset(int32_t s) const { return kv_offset[static_cast<size_t>(s)]; }
    int32_t Page(int32_t s, int32_t p) const
    {
        return block_table[static_cast<size_t>(s) * static_cast<size_t>(max_pages) + static_cast<size_t>(p)];
    }
};

/* The plan of one attention call. */
struct AttentionPlan {
    AttnGeometry geometry{};
    HostSeqs seqs;
    std::vector<Task> tasks;       // forward / dQ tasks in canonical order
    std::vector<KvTask> kv_tasks;  // dK/dV tasks (training backward) in canonical order
    std::vector<int64_t> task_of_seq;  // first task index of each sequence
};

/* What one query row (sequence s, query index i within the call's queries of s, query head h)
 * gets from a plan: its block, worker and the KV tiles it visits. Training and inference views
 * of the same token must give identical `Effective*` fields (tested on CPU). */
struct TokenPlan {
    int64_t task = -1;
    int32_t worker = 0;
    int32_t kv_head = 0;
    int32_t block = 0;
    int32_t row_in_block = 0;
    int32_t block_rows = 0;
    int32_t kv_tile = 0;
    int32_t head_dim = 0;
    int32_t position = 0;
    int32_t kv_split = 1;          // workers that share the row's KV range (always 1)
    int32_t tiles_visited = 0;     // tiles the row's block visits
    int32_t tiles_effective = 0;   // tiles with at least one visible column for this row
    std::vector<int64_t> tile_kv_row;  // per visited tile: physical K/V row of its first position
    std::vector<int32_t> tile_cols;    // per visited tile: visible columns for this row
};

/* Workspace and unified-buffer budget of the forward attention kernel (bytes). */
struct AttnBudget {
    int64_t ub_bytes = 0;
    int64_t workspace_per_worker = 0;
};

constexpr int64_t kUbBytesLimit = 180 * 1024;  // of 192 KiB UB on Atlas A2/A3 vector cores

/* Validates constants and sequences; returns an empty string when the call is supported. */
std::string ValidateAttention(const AttnConsts &c, int32_t kv_layout, int32_t page_size, const HostSeqs &seqs);

/* Builds the plan. `max_workers` is the number of vector workers available (AIV cores).
 * Throws std::invalid_argument with the ValidateAttention message on unsupported input. */
AttentionPlan BuildAttentionPlan(const AttnConsts &c, int32_t kv_layout, int32_t page_size, HostSeqs seqs,
                                 int32_t max_workers);

/* Training view (contiguous, q == kv per sequence) from cu_seqlens [S+1]. */
HostSeqs TrainingSeqs(const std::vector<int64_t> &cu_seqlens);

/* Inference view (paged) from per-sequence query lengths/starts, KV lengths and block table. */
HostSeqs PagedSeqs(const std::vector<int32_t> &q_lens, const std::vector<int32_t> &q_starts,
                   const std::vector<int32_t> &kv_lens, const std::vector<int32_t> &block_table, int32_t max_pages);

TokenPlan TokenOf(const AttentionPlan &plan, int32_t seq, int32_t query, int32_t head);

/* UB bytes and per-worker GM workspace of the attention kernels; mirrors
 * AttentionTile::InitBuffers and AttnWorkspace::Bytes in op_kernel/attention_tile.h. */
AttnBudget ForwardBudget(const AttnGeometry &g);
AttnBudget BackwardBudget(const AttnGeometry &g);

/* Matmul and row-op plans (shape-independent constants; see tile_plan_core.h). */
MatmulGeometry BuildMatmulPlan(int32_t m, int32_t n, int32_t k, int32_t dtype_bytes, int32_t max_workers);
RowGeometry BuildRowPlan(int32_t rows, int32_t cols, int32_t dtype_bytes, int32_t max_workers);

constexpr int32_t kRowChunk = 4096;  // columns per UB chunk of the row operators

}  // namespace tp
}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_TILE_PLAN_H
