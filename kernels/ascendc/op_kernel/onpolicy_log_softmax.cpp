/*
 * OnpolicyLogSoftmax — out = log_softmax(logits / temperature[:, None]) over the full vocabulary,
 * fp32 throughout (the LM-head path of the operator set).
 *
 * One vector worker owns a row; three passes over the row in fixed-width chunks:
 *   1. z = x / t;  mx = max(z)                      (LaneFold max + LaneTree max; exact)
 *   2. sum = sum(exp(z - mx))                        (LaneFold add in column order + LaneTree)
 *   3. out = (z - mx) - log(sum)
 * z is recomputed with the same division in every pass, so every pass sees identical values.
 * Inputs: logits [N, V] fp32, temperature [N] fp32. Output: [N, V] fp32.
 */
#include "kernel_common.h"

using namespace onpolicy;
using namespace onpolicy::kernel;

namespace {

class LogSoftmax {
public:
    __aicore__ inline void Init(const tp::RowGeometry &geo, GM_ADDR logits, GM_ADDR temperature, GM_ADDR out,
                                TPipe *pipe)
    {
        g_ = geo;
        xGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(logits));
        tGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(temperature));
        yGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(out));
        pipe->InitBuffer(xBuf_, geo.chunk * sizeof(float));
        pipe->InitBuffer(tBuf_, geo.chunk * sizeof(float));
        pipe->InitBuffer(accBuf_, 2 * kLanes * sizeof(float));
        x_ = xBuf_.Get<float>();
        t_ = tBuf_.Get<float>();
        acc_ = accBuf_.Get<float>();
        red_ = acc_[kLanes];
    }

    __aicore__ inline void Process()
    {
        const int32_t worker = WorkerIndex();
        if (worker >= g_.workers) {
            return;
        }
        for (int32_t row = worker; row < g_.rows; row += g_.workers) {
            RunRow(row);
        }
    }

private:
    /* x_[0:n] = logits[row, c0:c0+n] / t; returns the 64-column groups covering n. */
    __aicore__ inline int32_t LoadScaled(int64_t base, int32_t c0, int32_t n)
    {
        Fence<HardEvent::V_MTE2>();  // the vector unit is done with x_
        DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(float)), 0, 0, 0};
        DataCopyPad(x_, xGm_[base + c0], p, DataCopyPadExtParams<float>{false, 0, 0, 0});
        Fence<HardEvent::MTE2_V>();
        Div(x_, x_, t_, n);
        PipeBarrier<PIPE_V>();
        Fence<HardEvent::V_MTE2>();
        return (n + kLanes - 1) / kLanes;
    }

    __aicore__ inline void PadTail(int32_t n, int32_t groups, float neutral)
    {
        if (groups * kLanes > n) {
            Duplicate(x_[n], neutral, groups * kLanes - n);
            PipeBarrier<PIPE_V>();
        }
    }

    __aicore__ inline void RunRow(int32_t row)
    {
        const int64_t base = static_cast<int64_t>(row) * g_.cols;
        const float t = tGm_.GetValue(row);
        Duplicate(t_, t, g_.chunk);  // divisor vector: x / t is an element-wise true division
        PipeBarrier<PIPE_V>();
        // 1. row max
        for (int32_t c = 0; c < g_.chunks; ++c) {
            const int32_t n = tp::MinI(g_.chunk, g_.cols - c * g_.chunk);
            const int32_t groups = LoadScaled(base, c * g_.chunk, n);
            PadTail(n, groups, kNegInf);
            LaneFold<true>(acc_, x_, groups, c == 0);
        }
        const float mx = LaneTree<true>(acc_, red_);
        // 2. sum of exp(z - mx)
        for (int32_t c = 0; c < g_.chunks; ++c) {
            const int32_t n = tp::MinI(g_.chunk, g_.cols - c * g_.chunk);
            const int32_t groups = LoadScaled(base, c * g_.chunk, n);
            Adds(x_, x_, -mx, n);
            PipeBarrier<PIPE_V>();
            Exp(x_, x_, n);
            PipeBarrier<PIPE_V>();
            PadTail(n, groups, 0.0f);
            LaneFold<false>(acc_, x_, groups, c == 0);
        }
        const float sum = LaneTree<false>(acc_, red_);
        Duplicate(red_, sum, kBlockFloats);
        PipeBarrier<PIPE_V>();
        Log(red_, red_, kBlockFloats);
        Fence<HardEvent::V_S>();
        const float lse = red_.GetValue(0);
        // 3. out = (z - mx) - log(sum)
        for (int32_t c = 0; c < g_.chunks; ++c) {
            const int32_t c0 = c * g_.chunk;
            const int32_t n = tp::MinI(g_.chunk, g_.cols - c0);
            LoadScaled(base, c0, n);
            Adds(x_, x_, -mx, n);
            PipeBarrier<PIPE_V>();
            Adds(x_, x_, -lse, n);
            Fence<HardEvent::V_MTE3>();
            DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(float)), 0, 0, 0};
            DataCopyPad(yGm_[base + c0], x_, p);
            Fence<HardEvent::MTE3_MTE2>();
            Fence<HardEvent::MTE3_V>();
        }
    }

    tp::RowGeometry g_{};
    GlobalTensor<float> xGm_, tGm_, yGm_;
    TBuf<TPosition::VECCALC> xBuf_, tBuf_, accBuf_;
    LocalTensor<float> x_, t_, acc_, red_;
};

}  // namespace

extern "C" __global__ __aicore__ void onpolicy_log_softmax(GM_ADDR logits, GM_ADDR temperature, GM_ADDR out,
                                                           GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    REGISTER_TILING_DEFAULT(OnpolicyRowTiling);
    GET_TILING_DATA_WITH_STRUCT(OnpolicyRowTiling, td, tiling);
    TPipe pipe;
    LogSoftmax op;
    op.Init(td.geo, logits, temperature, out, &pipe);
    op.Process();
}
