/*
 * OnpolicyRmsNorm — y = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype), per row,
 * in the Hugging Face cast/multiply order (kernels/reference/elementwise.py).
 *
 * One vector worker owns a row. Sum of squares: 64-lane fold over the row's 64-column groups in
 * column order (LaneFold), one WholeReduceSum at the end (LaneTree) — the order depends on the
 * row length only, never on the number of rows or the chunking.
 * Inputs: x [N, H] (T), weight [H] (T), attr eps. Output: y [N, H] (T).
 */
#include "kernel_common.h"

using namespace onpolicy;
using namespace onpolicy::kernel;

namespace {

template <typename T>
class RmsNorm {
public:
    __aicore__ inline void Init(const tp::RowGeometry &geo, GM_ADDR x, GM_ADDR w, GM_ADDR y, TPipe *pipe)
    {
        g_ = geo;
        xGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(x));
        wGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(w));
        yGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(y));
        pipe->InitBuffer(inBuf_, geo.chunk * sizeof(T));
        pipe->InitBuffer(xBuf_, geo.chunk * sizeof(float));
        pipe->InitBuffer(wBuf_, geo.chunk * sizeof(float));
        pipe->InitBuffer(accBuf_, 2 * kLanes * sizeof(float));
        in_ = inBuf_.Get<T>();
        x_ = xBuf_.Get<float>();
        w_ = wBuf_.Get<float>();
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
    /* Loads columns [c0, c0 + n) of `src` row into x_ as fp32; zero-pads to a 64-column group. */
    __aicore__ inline int32_t Load(const GlobalTensor<T> &src, int64_t base, int32_t c0, int32_t n,
                                   const LocalTensor<float> &dst)
    {
        Fence<HardEvent::V_MTE2>();  // the vector unit is done with in_
        DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
        DataCopyPad(in_, src[base + c0], p, DataCopyPadExtParams<T>{false, 0, 0, 0});
        Fence<HardEvent::MTE2_V>();
        if constexpr (IsSameType<T, float>::value) {
            DataCopy(dst, in_, (n + kBlockFloats - 1) / kBlockFloats * kBlockFloats);
        } else {
            Cast(dst, in_, RoundMode::CAST_NONE, n);
        }
        const int32_t groups = (n + kLanes - 1) / kLanes;
        if (groups * kLanes > n) {
            PipeBarrier<PIPE_V>();
            Duplicate(dst[n], 0.0f, groups * kLanes - n);  // neutral element of the sum
        }
        PipeBarrier<PIPE_V>();
        Fence<HardEvent::V_MTE2>();
        return groups;
    }

    __aicore__ inline void RunRow(int32_t row)
    {
        const int64_t base = static_cast<int64_t>(row) * g_.cols;
        // sum of squares
        for (int32_t c = 0; c < g_.chunks; ++c) {
            const int32_t c0 = c * g_.chunk;
            const int32_t n = tp::MinI(g_.chunk, g_.cols - c0);
            const int32_t groups = Load(xGm_, base, c0, n, x_);
            Mul(x_, x_, x_, groups * kLanes);
            PipeBarrier<PIPE_V>();
            LaneFold<false>(acc_, x_, groups, c == 0);
        }
        const float sumsq = LaneTree<false>(acc_, red_);
        // r = 1 / sqrt(sumsq / H + eps), on the vector unit
        Duplicate(red_, sumsq, kBlockFloats);
        Duplicate(red_[kBlockFloats], static_cast<float>(g_.cols), kBlockFloats);
        PipeBarrier<PIPE_V>();
        Div(red_, red_, red_[kBlockFloats], kBlockFloats);
        PipeBarrier<PIPE_V>();
        Adds(red_, red_, g_.eps, kBlockFloats);
        PipeBarrier<PIPE_V>();
        Sqrt(red_, red_, kBlockFloats);
        Duplicate(red_[kBlockFloats], 1.0f, kBlockFloats);
        PipeBarrier<PIPE_V>();
        Div(red_, red_[kBlockFloats], red_, kBlockFloats);
        Fence<HardEvent::V_S>();
        const float r = red_.GetValue(0);
        // y = weight * (x * r).to(T)
        for (int32_t c = 0; c < g_.chunks; ++c) {
            const int32_t c0 = c * g_.chunk;
            const int32_t n = tp::MinI(g_.chunk, g_.cols - c0);
            Load(xGm_, base, c0, n, x_);
            Muls(x_, x_, r, n);
            PipeBarrier<PIPE_V>();
            if constexpr (!IsSameType<T, float>::value) {
                Cast(in_, x_, RoundMode::CAST_RINT, n);  // .to(input dtype)
                PipeBarrier<PIPE_V>();
                Cast(x_, in_, RoundMode::CAST_NONE, n);
                PipeBarrier<PIPE_V>();
            }
            Load(wGm_, 0, c0, n, w_);
            Mul(x_, w_, x_, n);  // weight * y, computed in fp32 and rounded once to T
            PipeBarrier<PIPE_V>();
            if constexpr (IsSameType<T, float>::value) {
                DataCopy(in_, x_, (n + kBlockFloats - 1) / kBlockFloats * kBlockFloats);
            } else {
                Cast(in_, x_, RoundMode::CAST_RINT, n);
            }
            Fence<HardEvent::V_MTE3>();
            DataCopyExtParams p{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0};
            DataCopyPad(yGm_[base + c0], in_, p);
            Fence<HardEvent::MTE3_MTE2>();
            Fence<HardEvent::MTE3_V>();
        }
    }

    tp::RowGeometry g_{};
    GlobalTensor<T> xGm_, wGm_, yGm_;
    TBuf<TPosition::VECCALC> inBuf_, xBuf_, wBuf_, accBuf_;
    LocalTensor<T> in_;
    LocalTensor<float> x_, w_, acc_, red_;
};

}  // namespace

extern "C" __global__ __aicore__ void onpolicy_rms_norm(GM_ADDR x, GM_ADDR weight, GM_ADDR y, GM_ADDR workspace,
                                                        GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    REGISTER_TILING_DEFAULT(OnpolicyRowTiling);
    GET_TILING_DATA_WITH_STRUCT(OnpolicyRowTiling, td, tiling);
    TPipe pipe;
    RmsNorm<DTYPE_X> op;
    op.Init(td.geo, x, weight, y, &pipe);
    op.Process();
}
