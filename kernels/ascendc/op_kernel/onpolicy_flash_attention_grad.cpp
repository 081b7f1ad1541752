/*
 * OnpolicyFlashAttentionGrad — training backward attention, deterministic.
 *
 * Reuses the forward tile routine's loaders, masking and exp (attention_tile.h), and the same
 * tile plan: probabilities are recomputed as P = exp(S - lse) with S masked exactly like the
 * forward. Two kinds of tasks, dealt round-robin to the vector workers in one launch:
 *
 *   dQ task  = a forward task (seq, kv head, row block):
 *       for j = 0 .. num_kv_tiles-1 ascending:  dS = P * (dO V_j^T - Dsum);  dQ += dS @ K_j
 *       dQ *= scale
 *   dKV task = (seq, kv head, kv tile j):
 *       for row blocks b = first_block .. ascending:  dV_j += P^T @ dO_b;  dK_j += dS^T @ Q_b
 *       dK_j *= scale
 *
 * Dsum = rowsum(dO * O) is recomputed per block with the same row reduction. Every output element
 * is accumulated by one worker in a fixed order: no atomics, no split reductions, so gradients
 * are bitwise reproducible and do not depend on the worker count.
 * Inputs: q, k, v, out, dout (T), lse [T, Hq] fp32, seq_meta [S, 5] int64.
 * Outputs: dq, dk, dv (T).
 */
#include "attention_tile.h"

using namespace onpolicy;
using namespace onpolicy::kernel;

namespace {

template <typename T>
class AttentionGrad : public AttentionTile<T> {
    using Base = AttentionTile<T>;

public:
    TnMatmul mmTn;

    __aicore__ inline void Init(const tp::AttnGeometry &geo, int64_t ws_per_worker, GM_ADDR q, GM_ADDR k, GM_ADDR v,
                                GM_ADDR out, GM_ADDR dout, GM_ADDR lse, GM_ADDR seq_meta, GM_ADDR dq, GM_ADDR dk,
                                GM_ADDR dv, GM_ADDR workspace, TPipe *pipe)
    {
        this->g_ = geo;
        this->br_ = geo.block_rows;
        this->kt_ = geo.kv_tile;
        this->d_ = geo.head_dim;
        this->worker_ = WorkerIndex();
        this->qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(q));
        this->kGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(k));
        this->vGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(v));
        oGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out));
        doGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(dout));
        this->lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse));
        dqGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(dq));
        dkGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(dk));
        dvGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(dv));
        this->seqs_.meta.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(seq_meta));
        this->ws_.Bind(workspace + static_cast<int64_t>(this->worker_) * ws_per_worker, geo, true);
        this->InitBuffers(pipe, true);
        pipe->InitBuffer(doBuf_, this->br_ * this->d_ * sizeof(float));
        dp_ = this->dpBuf_.template Get<float>();
        acc2_ = this->acc2Buf_.template Get<float>();
        doF_ = doBuf_.Get<float>();
    }

    __aicore__ inline void Process()
    {
        const tp::AttnGeometry &g = this->g_;
        if (this->worker_ < g.workers) {
            tp::TaskCursor qCursor, kvCursor;
            const int64_t total = g.num_tasks + g.num_kv_tasks;
            for (int64_t t = this->worker_; t < total; t += g.workers) {
                if (t < g.num_tasks) {
                    tp::Task task;
                    if (tp::DecodeTaskFrom(g, this->seqs_, t, qCursor, task)) {
                        RunDq(task);
                    }
                } else {
                    tp::KvTask task;
                    if (tp::DecodeKvTaskFrom(g, this->seqs_, t - g.num_tasks, kvCursor, task)) {
                        RunDkv(task);
                    }
                }
            }
        }
        this->mmQk.End();
        this->mmPv.End();
        mmTn.End();
    }

private:
    /* Q -> ws.q, dO -> ws.dout and doF_, Dsum = rowsum(dO * O) -> stat7_, lse rows -> stat6_. */
    __aicore__ inline void PrepareBlock(const tp::Task &task)
    {
        const int32_t br = this->br_, d = this->d_;
        this->LoadRows(this->qGm_, task, this->stageF_, &this->ws_.q);
        this->LoadRows(doGm_, task, doF_, &this->ws_.dout);
        this->LoadRows(oGm_, task, this->pv_, nullptr);
        Mul(this->pv_, this->pv_, doF_, br * d);
        PipeBarrier<PIPE_V>();
        RowReduce<false>(this->stat7_, this->pv_, br, d, this->lanes_);
        Fence<HardEvent::V_S>();
        for (int32_t r = 0; r < br; ++r) {
            float value = 0.0f;  // padding rows: finite statistics, zero dO => zero contribution
            if (r < task.valid_rows) {
                const int32_t rowIdx = task.first_row + r;
                value = this->lseGm_.GetValue((task.q_offset + tp::RowQuery(this->g_, rowIdx)) * this->g_.num_heads +
                                              tp::RowHead(this->g_, task.kv_head, rowIdx));
            }
            this->stat6_.SetValue(r, value);
        }
        Fence<HardEvent::S_V>();
    }

    /* s_ = P (recomputed), dp_ = dS = P * (dO V_j^T - Dsum); dS also written to ws.p. */
    __aicore__ inline void ProbsAndDs(int32_t tile, bool keep_p_in_ws)
    {
        const int32_t br = this->br_, kt = this->kt_;
        this->ScoresMasked(this->mmQk, this->ws_.q, tile);
        this->ExpMinusRow(this->stat6_);
        if (keep_p_in_ws) {
            Fence<HardEvent::V_MTE3>();
            DataCopy(this->ws_.p, this->s_, br * kt);
        }
        this->CubeToUb(this->mmQk, this->ws_.dout, false, this->ws_.v, true, this->ws_.s, dp_, br * kt);
        Fence<HardEvent::V_S>();
        for (int32_t r = 0; r < br; ++r) {
            Adds(dp_[r * kt], dp_[r * kt], -this->stat7_.GetValue(r), kt);
        }
        PipeBarrier<PIPE_V>();
        Mul(dp_, dp_, this->s_, br * kt);
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void Accumulate(const LocalTensor<float> &acc, const LocalTensor<float> &part, int32_t count,
                                      bool first)
    {
        if (first) {
            DataCopy(acc, part, count);
        } else {
            Add(acc, acc, part, count);
        }
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void RunDq(const tp::Task &task)
    {
        const int32_t br = this->br_, kt = this->kt_, d = this->d_;
        PrepareBlock(task);
        const int32_t kvLen = this->seqs_.KvLen(task.seq);
        for (int32_t j = 0; j < task.num_kv_tiles; ++j) {
            const int64_t kvRow = tp::KvTileRow(this->g_, this->seqs_, task.seq, j);
            const int32_t validKv = tp::TileValidKv(this->g_, kvLen, j);
            this->StageTile(this->kGm_, kvRow, validKv, task.kv_head, this->ws_.k, nullptr);
            this->StageTile(this->vGm_, kvRow, validKv, task.kv_head, this->ws_.v, nullptr);
            ProbsAndDs(j, false);
            Fence<HardEvent::V_MTE3>();
            DataCopy(this->ws_.p, dp_, br * kt);
            this->CubeToUb(this->mmPv, this->ws_.p, false, this->ws_.k, false, this->ws_.o, this->pv_, br * d);
            Accumulate(this->acc_, this->pv_, br * d, j == 0);
        }
        Muls(this->acc_, this->acc_, this->g_.scale, br * d);
        PipeBarrier<PIPE_V>();
        this->FromFloat(this->stageT_, this->acc_, br * d);
        this->StoreRows(dqGm_, task);
    }

    __aicore__ inline void RunDkv(const tp::KvTask &kv)
    {
        const int32_t br = this->br_, kt = this->kt_, d = this->d_;
        this->StageTile(this->kGm_, kv.kv_row, kv.valid_kv, kv.kv_head, this->ws_.k, nullptr);
        this->StageTile(this->vGm_, kv.kv_row, kv.valid_kv, kv.kv_head, this->ws_.v, nullptr);
        bool first = true;
        for (int32_t b = kv.first_block; b < kv.first_block + kv.num_blocks; ++b) {
            tp::Task task;
            tp::MakeTask(this->g_, this->seqs_, kv.seq, kv.kv_head, b, task);
            PrepareBlock(task);
            ProbsAndDs(kv.tile, true);
            // dV_j += P^T @ dO_b
            this->CubeToUb(mmTn, this->ws_.p, true, this->ws_.dout, false, this->ws_.o, this->pv_, kt * d);
            Accumulate(acc2_, this->pv_, kt * d, first);
            // dK_j += dS^T @ Q_b
            Fence<HardEvent::V_MTE3>();
            DataCopy(this->ws_.p, dp_, br * kt);
            this->CubeToUb(mmTn, this->ws_.p, true, this->ws_.q, false, this->ws_.o, this->pv_, kt * d);
            Accumulate(this->acc_, this->pv_, kt * d, first);
            first = false;
        }
        if (first) {  // no query of this call sees the tile
            Duplicate(this->acc_, 0.0f, kt * d);
            Duplicate(acc2_, 0.0f, kt * d);
            PipeBarrier<PIPE_V>();
        }
        Muls(this->acc_, this->acc_, this->g_.scale, kt * d);
        PipeBarrier<PIPE_V>();
        StoreTile(dkGm_, this->acc_, kv);
        StoreTile(dvGm_, acc2_, kv);
    }

    /* Writes the valid rows of a [kv_tile, D] fp32 tile to dst ([Tk, Hkv, D], dtype T). */
    __aicore__ inline void StoreTile(const GlobalTensor<T> &dst, const LocalTensor<float> &tile, const tp::KvTask &kv)
    {
        this->FromFloat(this->stageT_, tile, this->kt_ * this->d_);
        Fence<HardEvent::V_MTE3>();
        const int32_t d = this->d_;
        DataCopyExtParams rows{static_cast<uint16_t>(kv.valid_kv), static_cast<uint32_t>(d * sizeof(T)), 0,
                               static_cast<uint32_t>((this->g_.num_kv_heads - 1) * d * sizeof(T)), 0};
        DataCopyPad(dst[(kv.kv_row * this->g_.num_kv_heads + kv.kv_head) * d], this->stageT_, rows);
        Fence<HardEvent::MTE3_V>();
    }

    GlobalTensor<T> oGm_, doGm_, dqGm_, dkGm_, dvGm_;
    TBuf<TPosition::VECCALC> doBuf_;
    LocalTensor<float> dp_, acc2_, doF_;
};

}  // namespace

extern "C" __global__ __aicore__ void onpolicy_flash_attention_grad(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR out,
                                                                    GM_ADDR dout, GM_ADDR lse, GM_ADDR seq_meta,
                                                                    GM_ADDR dq, GM_ADDR dk, GM_ADDR dv,
                                                                    GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    REGISTER_TILING_DEFAULT(OnpolicyAttentionGradTiling);
    GET_TILING_DATA_WITH_STRUCT(OnpolicyAttentionGradTiling, td, tiling);
    GM_ADDR user_ws = GetUserWorkspace(workspace);
    if (user_ws == nullptr) {
        return;
    }
    TPipe pipe;
    AttentionGrad<DTYPE_Q> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mmQk, &td.qk, op.mmPv, &td.dsk, op.mmTn, &td.ptdo);
    op.Init(td.geo, td.ws_per_worker, q, k, v, out, dout, lse, seq_meta, dq, dk, dv, user_ws, &pipe);
    op.Process();
}
