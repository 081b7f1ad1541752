/*
 * onpolicy Ascend C kernels — THE attention tile routine.
 *
 * One class, `AttentionTile<T>`, runs every forward attention of the operator set:
 *   - OnpolicyFlashAttention  (training forward, contiguous packed K/V, writes LSE for backward)
 *   - OnpolicyPagedAttention  (inference: prefill, chunked prefill, paged decode with block table)
 * The two entries differ only in how a KV tile's first physical row is found
 * (tp::KvTileRow: packed offset or block-table page), which is addressing, not arithmetic.
 * The backward kernel (onpolicy_flash_attention_grad.cpp) reuses its loaders and masking.
 *
 * Per task (a block of `block_rows` query rows of one sequence and KV head, decoded from the
 * shared tile plan, tile_plan_core.h) the worker executes — and replay/attention_replay.cpp
 * mirrors step for step:
 *
 *   for j = 0 .. num_kv_tiles-1            KV tiles from position 0 ascending, one worker
 *     S   = Cube(Q_blk @ K_j^T) * scale    fp32 (Q, K staged as fp32)
 *     S   = -inf where key pos > row pos   Select, BEFORE the row max
 *     mx  = rowmax(S);  m' = j ? max(m, mx) : mx
 *     P   = exp(S - m');  P = 0 where masked
 *     rs  = rowsum(P)                      RowReduce (64-lane fold + WholeReduceSum)
 *     PV  = Cube(P @ V_j)                  fp32
 *     j == 0:  l = rs, acc = PV
 *     j  > 0:  a = exp(m - m');  l = l*a + rs;  acc = acc*a + PV   (separate Mul and Add)
 *     m = m'
 *   out = acc / l  (Div), cast to T with round-to-nearest-even
 *
 * No split-KV, no cross-core merge, no atomics: a row's bits depend only on its own inputs and
 * the constants in AttnGeometry.
 */
#ifndef ONPOLICY_ASCENDC_ATTENTION_TILE_H
#define ONPOLICY_ASCENDC_ATTENTION_TILE_H

#include "kernel_common.h"
#include "lib/matmul_intf.h"

namespace onpolicy {
namespace kernel {

/* The two GEMM classes of every attention kernel; their tilings are fixed by the host for the
 * shapes [block_rows x kv_tile x head_dim] and [block_rows x head_dim x kv_tile]. */
using GmF32 = matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>;
using GmF32T = matmul::MatmulType<TPosition::GM, CubeFormat::ND, float, true>;
using QkMatmul = matmul::Matmul<GmF32, GmF32T, GmF32>;  // A[M,K] @ B[N,K]^T
using PvMatmul = matmul::Matmul<GmF32, GmF32, GmF32>;   // A[M,K] @ B[K,N]
using TnMatmul = matmul::Matmul<GmF32T, GmF32, GmF32>;  // A[K,M]^T @ B[K,N] (backward)

/* Per-worker fp32 GM workspace shared with the Cube. */
struct AttnWorkspace {
    GlobalTensor<float> q;   // [block_rows, D]  gathered query rows
    GlobalTensor<float> dout;  // [block_rows, D] gathered dO rows (backward)
    GlobalTensor<float> k;   // [kv_tile, D]
    GlobalTensor<float> v;   // [kv_tile, D]
    GlobalTensor<float> p;   // [block_rows, kv_tile]  probabilities (or dS)
    GlobalTensor<float> s;   // [block_rows, kv_tile]  QK^T / dO V^T result
    GlobalTensor<float> o;   // [max(block_rows, kv_tile), D]  P@V / dS@K / P^T@dO result

    __aicore__ inline void Bind(GM_ADDR base, const tp::AttnGeometry &g, bool backward)
    {
        const int64_t br = g.block_rows, kt = g.kv_tile, d = g.head_dim;
        __gm__ float *f = reinterpret_cast<__gm__ float *>(base);
        q.SetGlobalBuffer(f, br * d);
        f += br * d;
        if (backward) {
            dout.SetGlobalBuffer(f, br * d);
            f += br * d;
        }
        k.SetGlobalBuffer(f, kt * d);
        f += kt * d;
        v.SetGlobalBuffer(f, kt * d);
        f += kt * d;
        p.SetGlobalBuffer(f, br * kt);
        f += br * kt;
        s.SetGlobalBuffer(f, br * kt);
        f += br * kt;
        o.SetGlobalBuffer(f, (br > kt ? br : kt) * d);
    }

    /* Bytes per worker (host and device agree through this function). */
    __aicore__ static inline int64_t Bytes(const tp::AttnGeometry &g, bool backward)
    {
        const int64_t br = g.block_rows, kt = g.kv_tile, d = g.head_dim;
        return ((backward ? 2 : 1) * br * d + 2 * kt * d + 2 * br * kt + (br > kt ? br : kt) * d) * 4;
    }
};

template <typename T>
class AttentionTile {
public:
    QkMatmul mmQk;
    PvMatmul mmPv;

    __aicore__ inline AttentionTile() {}

    __aicore__ inline void Init(const tp::AttnGeometry &geo, int64_t ws_per_worker, bool write_lse, GM_ADDR q,
                                GM_ADDR k, GM_ADDR v, GM_ADDR seq_meta, GM_ADDR block_table, GM_ADDR out,
                                GM_ADDR lse, GM_ADDR workspace, TPipe *pipe)
    {
        g_ = geo;
        br_ = geo.block_rows;
        kt_ = geo.kv_tile;
        d_ = geo.head_dim;
        writeLse_ = write_lse;
        worker_ = WorkerIndex();
        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(q));
        kGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(k));
        vGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(v));
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out));
        if (write_lse) {
            lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse));
        }
        seqs_.meta.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(seq_meta));
        if (geo.kv_layout == tp::kKvPaged) {
            seqs_.table.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(block_table));
            seqs_.max_pages = geo.max_pages;
        }
        ws_.Bind(workspace + static_cast<int64_t>(worker_) * ws_per_worker, geo, false);
        InitBuffers(pipe, false);
    }

    __aicore__ inline void Process()
    {
        if (worker_ < g_.workers) {
            tp::TaskCursor cursor;
            for (int64_t t = worker_; t < g_.num_tasks; t += g_.workers) {
                tp::Task task;
                if (!tp::DecodeTaskFrom(g_, seqs_, t, cursor, task)) {
                    break;
                }
                RunTask(task);
            }
        }
        mmQk.End();
        mmPv.End();
    }

    /* ---- building blocks, shared with the backward kernel ---------------------------------- */

    __aicore__ inline void InitBuffers(TPipe *pipe, bool backward)
    {
        const int32_t rowsMax = br_ > kt_ ? br_ : kt_;
        pipe->InitBuffer(sBuf_, br_ * kt_ * sizeof(float));
        pipe->InitBuffer(diffBuf_, br_ * kt_ * sizeof(float));
        pipe->InitBuffer(cmpBuf_, (br_ * kt_ / 8 + 31) / 32 * 32);
        pipe->InitBuffer(colBuf_, kt_ * sizeof(float));
        pipe->InitBuffer(accBuf_, rowsMax * d_ * sizeof(float));
        pipe->InitBuffer(pvBuf_, rowsMax * d_ * sizeof(float));
        pipe->InitBuffer(stageTBuf_, rowsMax * d_ * sizeof(T));
        pipe->InitBuffer(stageFBuf_, rowsMax * d_ * sizeof(float));
        pipe->InitBuffer(statBuf_, 8 * br_ * sizeof(float));
        pipe->InitBuffer(lanesBuf_, br_ * kLanes * sizeof(float));
        pipe->InitBuffer(rowBuf_, (d_ > kLanes ? d_ : kLanes) * sizeof(float));
        if (backward) {
            pipe->InitBuffer(dpBuf_, br_ * kt_ * sizeof(float));
            pipe->InitBuffer(acc2Buf_, rowsMax * d_ * sizeof(float));
        }
        s_ = sBuf_.Get<float>();
        diff_ = diffBuf_.Get<float>();
        cmp_ = cmpBuf_.Get<uint8_t>();
        col_ = colBuf_.Get<float>();
        acc_ = accBuf_.Get<float>();
        pv_ = pvBuf_.Get<float>();
        stageT_ = stageTBuf_.Get<T>();
        stageF_ = stageFBuf_.Get<float>();
        LocalTensor<float> stats = statBuf_.Get<float>();
        m_ = stats;
        mNew_ = stats[br_];
        tmax_ = stats[2 * br_];
        alpha_ = stats[3 * br_];
        l_ = stats[4 * br_];
        rs_ = stats[5 * br_];
        stat6_ = stats[6 * br_];
        stat7_ = stats[7 * br_];
        lanes_ = lanesBuf_.Get<float>();
        row_ = rowBuf_.Get<float>();
        CreateVecIndex(col_, static_cast<float>(0), kt_);  // 0, 1, ..., kt-1 (exact in fp32)
        PipeBarrier<PIPE_V>();
    }

    /* Gathers the block's query rows of `src` ([N, Hq, D], dtype T) into UB fp32 (padding rows
     * zero) and, if `dst_ws`, into the GM workspace; records each row's position. */
    __aicore__ inline void LoadRows(const GlobalTensor<T> &src, const tp::Task &task, const LocalTensor<float> &dstF,
                                    const GlobalTensor<float> *dst_ws)
    {
        const int32_t qStart = seqs_.QStart(task.seq);
        Fence<HardEvent::V_MTE2>();  // the vector unit is done with stageT_
        DataCopyExtParams row{1, static_cast<uint32_t>(d_ * sizeof(T)), 0, 0, 0};
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            const int32_t rowIdx = task.first_row + r;
            const int32_t query = tp::RowQuery(g_, rowIdx);
            const int32_t head = tp::RowHead(g_, task.kv_head, rowIdx);
            rowPos_[r] = qStart + query;
            const int64_t off = ((task.q_offset + query) * g_.num_heads + head) * d_;
            DataCopyPad(stageT_[r * d_], src[off], row, DataCopyPadExtParams<T>{false, 0, 0, 0});
        }
        for (int32_t r = task.valid_rows; r < br_; ++r) {
            rowPos_[r] = task.first_pos;  // padding rows see position first_pos: never all-masked
        }
        Fence<HardEvent::MTE2_V>();
        ToFloat(dstF, stageT_, task.valid_rows * d_);
        if (task.valid_rows < br_) {
            Duplicate(dstF[task.valid_rows * d_], 0.0f, (br_ - task.valid_rows) * d_);
        }
        PipeBarrier<PIPE_V>();
        if (dst_ws != nullptr) {
            Fence<HardEvent::V_MTE3>();
            DataCopy(*dst_ws, dstF, br_ * d_);
            Fence<HardEvent::MTE3_MTE2>();
        }
    }

    /* Stages KV tile rows [kv_row, kv_row + valid) of head kv_head from `src` ([rows, Hkv, D]) as
     * fp32 [kv_tile, D] in `dst_ws`, zero-filling rows past the sequence; keeps a UB copy in
     * `keep` if given. */
    __aicore__ inline void StageTile(const GlobalTensor<T> &src, int64_t kv_row, int32_t valid, int32_t kv_head,
                                     const GlobalTensor<float> &dst_ws, const LocalTensor<float> *keep)
    {
        const LocalTensor<float> &f = keep != nullptr ? *keep : stageF_;
        Fence<HardEvent::V_MTE2>();  // the vector unit is done with the staging buffers
        if (valid > 0) {
            DataCopyExtParams rows{static_cast<uint16_t>(valid), static_cast<uint32_t>(d_ * sizeof(T)),
                                   static_cast<uint32_t>((g_.num_kv_heads - 1) * d_ * sizeof(T)), 0, 0};
            DataCopyPad(stageT_, src[(kv_row * g_.num_kv_heads + kv_head) * d_], rows,
                        DataCopyPadExtParams<T>{false, 0, 0, 0});
            Fence<HardEvent::MTE2_V>();
            ToFloat(f, stageT_, valid * d_);
        }
        if (valid < kt_) {
            Duplicate(f[valid * d_], 0.0f, (kt_ - valid) * d_);
        }
        PipeBarrier<PIPE_V>();
        Fence<HardEvent::V_MTE3>();
        DataCopy(dst_ws, f, kt_ * d_);
        Fence<HardEvent::MTE3_MTE2>();
    }

    /* out_ub = Cube result of `mm` (written to ws `res`), copied into UB. The GEMM shape is the
     * fixed one its host tiling was made for. */
    template <class MM>
    __aicore__ inline void CubeToUb(MM &mm, const GlobalTensor<float> &a, bool trans_a, const GlobalTensor<float> &b,
                                    bool trans_b, const GlobalTensor<float> &res, const LocalTensor<float> &out,
                                    int32_t count)
    {
        Fence<HardEvent::MTE3_S>();  // operands written by this core are in GM before the request
        mm.SetTensorA(a, trans_a);
        mm.SetTensorB(b, trans_b);
        mm.template IterateAll<true>(res);  // synchronous: the result is in GM on return
        Fence<HardEvent::V_MTE2>();          // the vector unit is done with `out`
        DataCopy(out, res, count);
        Fence<HardEvent::MTE2_V>();
    }

    /* s_ = (Q_blk @ K_j^T) * scale; then -inf where key position > row position (cmp_ keeps the
     * visibility mask for the re-zeroing after exp). */
    __aicore__ inline void ScoresMasked(QkMatmul &mm, const GlobalTensor<float> &a, int32_t tile)
    {
        CubeToUb(mm, a, false, ws_.k, true, ws_.s, s_, br_ * kt_);
        Muls(s_, s_, g_.scale, br_ * kt_);
        // diff[r, c] = c - (pos_r - tile*kv_tile): visible iff diff <= 0
        for (int32_t r = 0; r < br_; ++r) {
            const float limit = static_cast<float>(rowPos_[r] - tile * kt_);
            Adds(diff_[r * kt_], col_, -limit, kt_);
        }
        PipeBarrier<PIPE_V>();
        CompareScalar(cmp_, diff_, 0.0f, CMPMODE::LE, br_ * kt_);
        PipeBarrier<PIPE_V>();
        Select(s_, cmp_, s_, kNegInf, SELMODE::VSEL_TENSOR_SCALAR_MODE, br_ * kt_);
        PipeBarrier<PIPE_V>();
    }

    /* s_ = exp(s_ - rowval) with masked entries exactly 0 (rowval: running max or LSE). */
    __aicore__ inline void ExpMinusRow(const LocalTensor<float> &rowval)
    {
        Fence<HardEvent::V_S>();
        for (int32_t r = 0; r < br_; ++r) {
            Adds(s_[r * kt_], s_[r * kt_], -rowval.GetValue(r), kt_);  // x + (-m) == x - m exactly
        }
        PipeBarrier<PIPE_V>();
        Exp(s_, s_, br_ * kt_);
        PipeBarrier<PIPE_V>();
        Select(s_, cmp_, s_, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, br_ * kt_);
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void ToFloat(const LocalTensor<float> &dst, const LocalTensor<T> &src, int32_t count)
    {
        if constexpr (IsSameType<T, float>::value) {
            DataCopy(dst, src, count);
        } else {
            Cast(dst, src, RoundMode::CAST_NONE, count);
        }
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void FromFloat(const LocalTensor<T> &dst, const LocalTensor<float> &src, int32_t count)
    {
        if constexpr (IsSameType<T, float>::value) {
            DataCopy(dst, src, count);
        } else {
            Cast(dst, src, RoundMode::CAST_RINT, count);
        }
        PipeBarrier<PIPE_V>();
    }

    /* Writes valid rows of stageT_ back to `dst` ([N, Hq, D]) at the block's query rows. */
    __aicore__ inline void StoreRows(const GlobalTensor<T> &dst, const tp::Task &task)
    {
        Fence<HardEvent::V_MTE3>();
        DataCopyExtParams row{1, static_cast<uint32_t>(d_ * sizeof(T)), 0, 0, 0};
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            const int32_t rowIdx = task.first_row + r;
            const int64_t off =
                ((task.q_offset + tp::RowQuery(g_, rowIdx)) * g_.num_heads + tp::RowHead(g_, task.kv_head, rowIdx)) *
                d_;
            DataCopyPad(dst[off], stageT_[r * d_], row);
        }
        Fence<HardEvent::MTE3_MTE2>();
        Fence<HardEvent::MTE3_V>();
    }

protected:
    __aicore__ inline void RunTask(const tp::Task &task)
    {
        LoadRows(qGm_, task, stageF_, &ws_.q);
        const int32_t kvLen = seqs_.KvLen(task.seq);
        for (int32_t j = 0; j < task.num_kv_tiles; ++j) {
            const int64_t kvRow = tp::KvTileRow(g_, seqs_, task.seq, j);
            const int32_t validKv = tp::TileValidKv(g_, kvLen, j);
            StageTile(kGm_, kvRow, validKv, task.kv_head, ws_.k, nullptr);
            StageTile(vGm_, kvRow, validKv, task.kv_head, ws_.v, nullptr);
            ScoresMasked(mmQk, ws_.q, j);
            RowReduce<true>(tmax_, s_, br_, kt_, lanes_);
            if (j == 0) {
                DataCopy(mNew_, tmax_, br_);
            } else {
                Max(mNew_, m_, tmax_, br_);
            }
            PipeBarrier<PIPE_V>();
            ExpMinusRow(mNew_);
            RowReduce<false>(rs_, s_, br_, kt_, lanes_);
            Fence<HardEvent::V_MTE3>();
            DataCopy(ws_.p, s_, br_ * kt_);
            CubeToUb(mmPv, ws_.p, false, ws_.v, false, ws_.o, pv_, br_ * d_);
            if (j == 0) {
                DataCopy(l_, rs_, br_);
                DataCopy(acc_, pv_, br_ * d_);
                PipeBarrier<PIPE_V>();
            } else {
                Sub(alpha_, m_, mNew_, br_);
                PipeBarrier<PIPE_V>();
                Exp(alpha_, alpha_, br_);
                PipeBarrier<PIPE_V>();
                Mul(l_, l_, alpha_, br_);
                PipeBarrier<PIPE_V>();
                Add(l_, l_, rs_, br_);
                Fence<HardEvent::V_S>();
                for (int32_t r = 0; r < br_; ++r) {
                    Muls(acc_[r * d_], acc_[r * d_], alpha_.GetValue(r), d_);
                }
                PipeBarrier<PIPE_V>();
                Add(acc_, acc_, pv_, br_ * d_);
                PipeBarrier<PIPE_V>();
            }
            DataCopy(m_, mNew_, br_);
            PipeBarrier<PIPE_V>();
        }
        // out = acc / l (a true division per element, as the reference does)
        Fence<HardEvent::V_S>();
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            Duplicate(row_, l_.GetValue(r), d_);
            PipeBarrier<PIPE_V>();
            Div(acc_[r * d_], acc_[r * d_], row_, d_);
            PipeBarrier<PIPE_V>();
        }
        FromFloat(stageT_, acc_, br_ * d_);
        StoreRows(outGm_, task);
        if (writeLse_) {
            WriteLse(task);
        }
    }

    /* lse = m + log(l) per valid row, into lse [N, Hq] (fp32). */
    __aicore__ inline void WriteLse(const tp::Task &task)
    {
        Log(stat6_, l_, br_);
        PipeBarrier<PIPE_V>();
        Add(stat6_, m_, stat6_, br_);
        Fence<HardEvent::V_S>();
        DataCopyExtParams one{1, sizeof(float), 0, 0, 0};
        for (int32_t r = 0; r < task.valid_rows; ++r) {
            const int32_t rowIdx = task.first_row + r;
            const int64_t off =
                (task.q_offset + tp::RowQuery(g_, rowIdx)) * g_.num_heads + tp::RowHead(g_, task.kv_head, rowIdx);
            Duplicate(row_, stat6_.GetValue(r), kBlockFloats);  // 32-byte aligned UB source for the copy
            Fence<HardEvent::V_MTE3>();
            DataCopyPad(lseGm_[off], row_, one);
            Fence<HardEvent::MTE3_V>();
        }
        Fence<HardEvent::MTE3_MTE2>();
    }

    tp::AttnGeometry g_{};
    int32_t br_ = 0;
    int32_t kt_ = 0;
    int32_t d_ = 0;
    int32_t worker_ = 0;
    bool writeLse_ = false;
    int32_t rowPos_[128];

    GlobalTensor<T> qGm_, kGm_, vGm_, outGm_;
    GlobalTensor<float> lseGm_;
    GmSeqs seqs_;
    AttnWorkspace ws_;

    TBuf<TPosition::VECCALC> sBuf_, diffBuf_, cmpBuf_, colBuf_, accBuf_, pvBuf_, stageTBuf_, stageFBuf_, statBuf_,
        lanesBuf_, rowBuf_, dpBuf_, acc2Buf_;
    LocalTensor<float> s_, diff_, col_, acc_, pv_, stageF_, m_, mNew_, tmax_, alpha_, l_, rs_, stat6_, stat7_, lanes_,
        row_;
    LocalTensor<uint8_t> cmp_;
    LocalTensor<T> stageT_;
};

}  // namespace kernel
}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_ATTENTION_TILE_H
