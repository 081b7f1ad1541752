/*
 * CPU replay of the attention kernel's arithmetic order (not part of the device build).
 *
 * This is the loop nest of op_kernel/attention_tile.h (AttentionTile::RunTask) written as plain
 * C++ over host arrays, step for step:
 *
 *   for every task t of worker w (t = w, w + workers, ...):         tile_plan_core.h DecodeTask
 *     gather the block's query rows (query-major, head-minor), zero padding rows
 *     for j = 0 .. num_kv_tiles-1 (ascending, one worker, no split-KV):
 *       S   = Cube(Q_blk @ K_j^T)                     [hook qk]     fp32
 *       S   = S * scale                                (Muls)
 *       S   = -inf where position > row position       (CompareScalar + Select)
 *       mx  = row max of S                             (RowReduce max; exact)
 *       m'  = j == 0 ? mx : max(m, mx)                 (Max)
 *       S   = S - m'                                   (per-row Adds of -m')
 *       P   = exp(S)                                   [hook exp]    (Exp)
 *       P   = 0 where masked                           (Select; exp(-inf) is already 0)
 *       rs  = row sum of P                             [hook rowsum] (RowReduce add)
 *       PV  = Cube(P @ V_j)                            [hook pv]     fp32
 *       j == 0:  l = rs;  acc = PV                     (DataCopy)
 *       j  > 0:  a = exp(m - m')                       [hook exp]    (Sub, Exp)
 *                l = l * a;  l = l + rs                (Mul, Add: two roundings, no FMA)
 *                acc = acc * a;  acc = acc + PV        (per-row Muls, Add)
 *       m = m'
 *     out = acc / l                                    (Div)
 *
 * Compiled with -O2 -ffp-contract=off -fno-fast-math so every step is one IEEE fp32 operation.
 *
 * Hooks: the Cube GEMMs, the transcendental and the in-repeat reduction are hardware primitives
 * whose bits this file cannot reproduce; the caller may supply them (the CPU test feeds the
 * reference backend's own torch results, after checking that the replay hands them bit-identical
 * inputs). A NULL hook selects the native model below (fixed-order dot products, expf, and the
 * kernel's 64-lane fold + pairwise tree for row sums), used to check train/infer parity of the
 * loop structure itself.
 */
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "tile_plan.h"

using onpolicy::tp::AttentionPlan;
using onpolicy::tp::AttnGeometry;
using onpolicy::tp::KvTask;
using onpolicy::tp::Task;

extern "C" {

typedef struct {
    void *ctx;
    /* Raw Q_blk @ K_j^T (before scale): out[block_rows * kv_tile]. q_block[block_rows * head_dim]. */
    void (*qk)(void *ctx, const Task *task, int32_t tile, int64_t kv_row, const float *q_block, float *out);
    /* P @ V_j: out[block_rows * head_dim], p[block_rows * kv_tile]. */
    void (*pv)(void *ctx, const Task *task, int32_t tile, int64_t kv_row, const float *p, float *out);
    /* In-place elementwise exp of n values. */
    void (*exp)(void *ctx, float *x, int64_t n);
    /* Row sums of p[rows * cols] into out[rows]. */
    void (*rowsum)(void *ctx, const float *p, int32_t rows, int32_t cols, float *out);
} op_rp_hooks;

}  // extern "C"

namespace {

thread_local std::string g_error;

/* The kernel's row reduction (RowReduce in attention_tile.h): fold 64-lane chunks in column
 * order, then a pairwise tree over the lanes (model of WholeReduceSum within one repeat). */
float NativeRowSum(const float *x, int32_t cols)
{
    constexpr int32_t lanes = onpolicy::tp::kReduceLanes;
    float acc[lanes];
    const int32_t width = cols < lanes ? cols : lanes;
    for (int32_t i = 0; i < width; ++i) {
        acc[i] = x[i];
    }
    for (int32_t c = lanes; c < cols; c += lanes) {
        for (int32_t i = 0; i < lanes; ++i) {
            acc[i] = acc[i] + x[c + i];
        }
    }
    int32_t n = width;
    while (n > 1) {
        const int32_t half = n / 2;
        for (int32_t i = 0; i < half; ++i) {
            acc[i] = acc[2 * i] + acc[2 * i + 1];
        }
        if (n % 2) {
            acc[half] = acc[n - 1];
            n = half + 1;
        } else {
            n = half;
        }
    }
    return acc[0];
}

struct Replay {
    const AttentionPlan &plan;
    const AttnGeometry &g;
    const float *q;
    const float *k;
    const float *v;
    int64_t kv_rows_total;
    op_rp_hooks hooks;

    int64_t KvIndex(int64_t row, int32_t kv_head, int32_t d) const
    {
        return (row * g.num_kv_heads + kv_head) * g.head_dim + d;
    }

    /* K_j or V_j staged as the kernel stages it: [kv_tile, D], rows past the sequence zeroed. */
    void StageTile(const float *src, int64_t kv_row, int32_t valid, int32_t kv_head, std::vector<float> &out) const
    {
        out.assign(static_cast<size_t>(g.kv_tile) * g.head_dim, 0.0f);
        for (int32_t c = 0; c < valid; ++c) {
            if (kv_row + c >= kv_rows_total) {
                throw std::out_of_range("K/V row outside the buffer");
            }
            std::memcpy(&out[static_cast<size_t>(c) * g.head_dim], &src[KvIndex(kv_row + c, kv_head, 0)],
                        sizeof(float) * static_cast<size_t>(g.head_dim));
        }
    }

    void Exp(float *x, int64_t n) const
    {
        if (hooks.exp) {
            hooks.exp(hooks.ctx, x, n);
            return;
        }
        for (int64_t i = 0; i < n; ++i) {
            x[i] = std::exp(x[i]);
        }
    }

    void RunTask(const Task &task, float *out) const
    {
        const int32_t br = g.block_rows, kt = g.kv_tile, d = g.head_dim;
        const int32_t kv_len = plan.seqs.KvLen(task.seq);
        const float neg_inf = -std::numeric_limits<float>::infinity();

        // Gather the block's query rows and their positions.
        std::vector<float> q_blk(static_cast<size_t>(br) * d, 0.0f);
        std::vector<int32_t> pos(static_cast<size_t>(br), task.first_pos);
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            const int32_t row = task.first_row + r;
            const int32_t query = onpolicy::tp::RowQuery(g, row);
            const int32_t head = onpolicy::tp::RowHead(g, task.kv_head, row);
            pos[static_cast<size_t>(r)] = plan.seqs.QStart(task.seq) + query;
            const int64_t src = ((task.q_offset + query) * g.num_heads + head) * static_cast<int64_t>(d);
            std::memcpy(&q_blk[static_cast<size_t>(r) * d], &q[src], sizeof(float) * static_cast<size_t>(d));
        }

        std::vector<float> s(static_cast<size_t>(br) * kt), pv(static_cast<size_t>(br) * d),
            acc(static_cast<size_t>(br) * d, 0.0f), k_tile, v_tile;
        std::vector<float> m(static_cast<size_t>(br), neg_inf), m_new(static_cast<size_t>(br)),
            tmax(static_cast<size_t>(br)), l(static_cast<size_t>(br), 0.0f), rs(static_cast<size_t>(br)),
            alpha(static_cast<size_t>(br));

        for (int32_t j = 0; j < task.num_kv_tiles; ++j) {
            const int64_t kv_row = onpolicy::tp::KvTileRow(g, plan.seqs, task.seq, j);
            const int32_t valid_kv = onpolicy::tp::TileValidKv(g, kv_len, j);

            // S = Q_blk @ K_j^T (Cube), then * scale.
            if (hooks.qk) {
                hooks.qk(hooks.ctx, &task, j, kv_row, q_blk.data(), s.data());
            } else {
                StageTile(k, kv_row, valid_kv, task.kv_head, k_tile);
                for (int32_t r = 0; r < br; ++r) {
                    for (int32_t c = 0; c < kt; ++c) {
                        float dot = 0.0f;
                        for (int32_t e = 0; e < d; ++e) {
                            dot = dot + q_blk[static_cast<size_t>(r) * d + e] * k_tile[static_cast<size_t>(c) * d + e];
                        }
                        s[static_cast<size_t>(r) * kt + c] = dot;
                    }
                }
            }
            for (auto &x : s) {
                x = x * g.scale;
            }
            // Mask positions after the row's own, then the tile max and the running max.
            for (int32_t r = 0; r < br; ++r) {
                const int32_t vis = onpolicy::tp::VisibleCols(g, pos[static_cast<size_t>(r)], j);
                float mx = neg_inf;
                for (int32_t c = 0; c < kt; ++c) {
                    float &x = s[static_cast<size_t>(r) * kt + c];
                    if (c >= vis) {
                        x = neg_inf;
                    }
                    mx = x > mx ? x : mx;
                }
                tmax[static_cast<size_t>(r)] = mx;
                m_new[static_cast<size_t>(r)] =
                    j == 0 ? mx : (m[static_cast<size_t>(r)] > mx ? m[static_cast<size_t>(r)] : mx);
            }
            // P = exp(S - m'), masked entries exactly 0.
            for (int32_t r = 0; r < br; ++r) {
                for (int32_t c = 0; c < kt; ++c) {
                    float &x = s[static_cast<size_t>(r) * kt + c];
                    x = x - m_new[static_cast<size_t>(r)];
                }
            }
            Exp(s.data(), static_cast<int64_t>(s.size()));
            for (int32_t r = 0; r < br; ++r) {
                const int32_t vis = onpolicy::tp::VisibleCols(g, pos[static_cast<size_t>(r)], j);
                for (int32_t c = vis; c < kt; ++c) {
                    s[static_cast<size_t>(r) * kt + c] = 0.0f;
                }
            }
            // Row sums (vector unit) and P @ V_j (Cube).
            if (hooks.rowsum) {
                hooks.rowsum(hooks.ctx, s.data(), br, kt, rs.data());
            } else {
                for (int32_t r = 0; r < br; ++r) {
                    rs[static_cast<size_t>(r)] = NativeRowSum(&s[static_cast<size_t>(r) * kt], kt);
                }
            }
            if (hooks.pv) {
                hooks.pv(hooks.ctx, &task, j, kv_row, s.data(), pv.data());
            } else {
                StageTile(v, kv_row, valid_kv, task.kv_head, v_tile);
                for (int32_t r = 0; r < br; ++r) {
                    for (int32_t e = 0; e < d; ++e) {
                        float dot = 0.0f;
                        for (int32_t c = 0; c < kt; ++c) {
                            dot = dot + s[static_cast<size_t>(r) * kt + c] * v_tile[static_cast<size_t>(c) * d + e];
                        }
                        pv[static_cast<size_t>(r) * d + e] = dot;
                    }
                }
            }
            // The one update formula.
            if (j == 0) {
                l = rs;
                acc = pv;
            } else {
                for (int32_t r = 0; r < br; ++r) {
                    alpha[static_cast<size_t>(r)] = m[static_cast<size_t>(r)] - m_new[static_cast<size_t>(r)];
                }
                Exp(alpha.data(), br);
                for (int32_t r = 0; r < br; ++r) {
                    const float a = alpha[static_cast<size_t>(r)];
                    l[static_cast<size_t>(r)] = l[static_cast<size_t>(r)] * a;
                    l[static_cast<size_t>(r)] = l[static_cast<size_t>(r)] + rs[static_cast<size_t>(r)];
                    for (int32_t e = 0; e < d; ++e) {
                        float &o = acc[static_cast<size_t>(r) * d + e];
                        o = o * a;
                        o = o + pv[static_cast<size_t>(r) * d + e];
                    }
                }
            }
            m = m_new;
        }
        // out = acc / l, scattered back to [N, Hq, D].
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            const int32_t row = task.first_row + r;
            const int32_t query = onpolicy::tp::RowQuery(g, row);
            const int32_t head = onpolicy::tp::RowHead(g, task.kv_head, row);
            const int64_t dst = ((task.q_offset + query) * g.num_heads + head) * static_cast<int64_t>(d);
            for (int32_t e = 0; e < d; ++e) {
                out[dst + e] = acc[static_cast<size_t>(r) * d + e] / l[static_cast<size_t>(r)];
            }
        }
    }
};

}  // namespace

extern "C" {

const char *op_rp_last_error(void) { return g_error.c_str(); }

/* Runs the forward kernel's loop over every task of `plan`, worker by worker.
 * q: [N, Hq, D] fp32 (N = sum of q_len); k, v: [kv_rows_total, Hkv, D] fp32 (packed rows or
 * flattened pages); out: [N, Hq, D] fp32. Returns 0, or -1 with op_rp_last_error(). */
int op_rp_attention(const void *plan_ptr, const float *q, const float *k, const float *v, int64_t kv_rows_total,
                    const op_rp_hooks *hooks, float *out)
{
    try {
        const auto &plan = *static_cast<const AttentionPlan *>(plan_ptr);
        Replay replay{plan, plan.geometry, q, k, v, kv_rows_total, hooks ? *hooks : op_rp_hooks{}};
        const AttnGeometry &g = plan.geometry;
        for (int32_t w = 0; w < g.workers; ++w) {
            for (int64_t t = w; t < g.num_tasks; t += g.workers) {
                replay.RunTask(plan.tasks[static_cast<size_t>(t)], out);
            }
        }
        return 0;
    } catch (const std::exception &e) {
        g_error = e.what();
        return -1;
    }
}

/* The native row-sum model, exposed so the test can check it on its own. */
float op_rp_native_rowsum(const float *x, int32_t cols) { return NativeRowSum(x, cols); }

}  // extern "C"
