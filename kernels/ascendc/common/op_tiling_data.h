/*
 * Tiling data of the onpolicy Ascend operators: plain structs (CANN "standard C++ tiling
 * structs", REGISTER_TILING_DEFAULT / GET_TILING_DATA_WITH_STRUCT), identical on host and device.
 *
 * Every GEMM tiling inside (AscendC::tiling::TCubeTiling) is computed by the host for a FIXED
 * shape that depends only on the operator set's constants (block_rows, kv_tile, head_dim, the
 * matmul bases, K) — never on the number of tokens in the call — so every call, training or
 * inference, drives the Cube with identical tilings.
 *
 * CANN-only header (needs kernel_tiling/kernel_tiling.h); the plain geometry it embeds lives in
 * tile_plan_core.h and is what the CPU tests check.
 */
#ifndef ONPOLICY_ASCENDC_OP_TILING_DATA_H
#define ONPOLICY_ASCENDC_OP_TILING_DATA_H

#include "kernel_tiling/kernel_tiling.h"
#include "tile_plan_core.h"

namespace onpolicy {

/* Sequence metadata columns of the `seq_meta` int64 input, [num_seqs, kSeqMetaCols]. */
constexpr int32_t kMetaQOffset = 0;   // packed row of the sequence's first query
constexpr int32_t kMetaQLen = 1;      // queries of the sequence in this call
constexpr int32_t kMetaQStart = 2;    // absolute position of the first query
constexpr int32_t kMetaKvOffset = 3;  // contiguous K/V: packed row of position 0 (paged: unused)
constexpr int32_t kMetaKvLen = 4;     // K/V positions the sequence may read
constexpr int32_t kSeqMetaCols = 5;

/* Forward attention (training forward and inference). */
struct OnpolicyAttentionTiling {
    tp::AttnGeometry geo;
    int64_t ws_per_worker;          // bytes of user workspace per vector worker
    int32_t write_lse;              // training forward: 1 (softmax statistics for the backward)
    int32_t reserved;
    AscendC::tiling::TCubeTiling qk;  // S  = Q_blk[br, D] @ K_j[kt, D]^T      (M=br, N=kt, K=D)
    AscendC::tiling::TCubeTiling pv;  // PV = P[br, kt] @ V_j[kt, D]            (M=br, N=D, K=kt)
};

/* Training backward. dQ tasks are the forward tasks; dK/dV tasks are (seq, kv head, kv tile). */
struct OnpolicyAttentionGradTiling {
    tp::AttnGeometry geo;
    int64_t ws_per_worker;
    int64_t reserved;
    AscendC::tiling::TCubeTiling qk;   // S = Q_blk @ K_j^T and dP = dO_blk @ V_j^T (br, kt, D)
    AscendC::tiling::TCubeTiling dsk;  // dQ += dS @ K_j                        (br, D, kt)
    AscendC::tiling::TCubeTiling ptdo; // dV += P^T @ dO_blk, dK += dS^T @ Q_blk (kt, D, br)
};

/* Batch-invariant matmul: one tiling of the fixed [base_m, base_n, K] output tile. */
struct OnpolicyMatmulTiling {
    tp::MatmulGeometry geo;
    AscendC::tiling::TCubeTiling mm;
};

/* RMSNorm and log-softmax. */
struct OnpolicyRowTiling {
    tp::RowGeometry geo;
};

}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_OP_TILING_DATA_H
