/*
 * onpolicy Ascend C kernels — helpers shared by every operator of the set.
 *
 * The row reductions here are the ONLY reduction primitives the operator set uses on the vector
 * unit, so a row is always reduced by the same instruction sequence:
 *   fold:  64-lane fp32 accumulator, 64-column groups added lane-wise in column order
 *          (one Add/Max per group, never a multi-repeat instruction with a dependent destination);
 *   tree:  one WholeReduceSum/WholeReduceMax over the 64 lanes (its in-repeat order is fixed by
 *          the hardware and is the same for every call).
 * The CPU replay (replay/attention_replay.cpp, NativeRowSum) models exactly this sequence.
 */
#ifndef ONPOLICY_ASCENDC_KERNEL_COMMON_H
#define ONPOLICY_ASCENDC_KERNEL_COMMON_H

#ifndef ONPOLICY_KERNEL_SIDE
#define ONPOLICY_KERNEL_SIDE 1  // tile_plan_core.h functions become __aicore__ inline
#endif
#include "kernel_operator.h"
#include "op_tiling_data.h"

namespace onpolicy {
namespace kernel {

using namespace AscendC;

constexpr int32_t kLanes = 64;          // fp32 elements per 256-byte repeat
constexpr int32_t kBlockFloats = 8;     // fp32 elements per 32-byte block
constexpr float kNegInf = -__builtin_inff();

/* Fence between pipes on this core (fetch an event id, set, wait). */
template <HardEvent E>
__aicore__ inline void Fence()
{
    const event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(E));
    SetFlag<E>(id);
    WaitFlag<E>(id);
}

/* Row-wise reduction of src[rows, cols] (row stride `cols`, cols a multiple of 8) into dst[rows].
 * lanes: scratch of rows * 64 floats. IS_MAX selects max (exact, order-free) or sum. */
template <bool IS_MAX>
__aicore__ inline void RowReduce(const LocalTensor<float> &dst, const LocalTensor<float> &src, int32_t rows,
                                 int32_t cols, const LocalTensor<float> &lanes)
{
    const uint8_t src_rep_blocks = static_cast<uint8_t>(cols / kBlockFloats);
    if (cols <= kLanes) {
        if constexpr (IS_MAX) {
            WholeReduceMax<float>(dst, src, cols, rows, 1, 1, src_rep_blocks, ReduceOrder::ORDER_ONLY_VALUE);
        } else {
            WholeReduceSum<float>(dst, src, cols, rows, 1, 1, src_rep_blocks);
        }
        PipeBarrier<PIPE_V>();
        return;
    }
    // lanes[r, :] = src[r, 0:64]   (strided UB->UB copy: rows blocks of 8 x 32 bytes)
    DataCopyParams first;
    first.blockCount = static_cast<uint16_t>(rows);
    first.blockLen = kLanes / kBlockFloats;
    first.srcStride = static_cast<uint16_t>((cols - kLanes) / kBlockFloats);
    first.dstStride = 0;
    DataCopy(lanes, src, first);
    PipeBarrier<PIPE_V>();
    // lanes[r, :] op= src[r, g*64 : (g+1)*64] for g = 1, 2, ... in column order; one instruction
    // per group, each repeat r touching a different row (no dependent repeats).
    BinaryRepeatParams rp(1, 1, 1, kLanes / kBlockFloats, kLanes / kBlockFloats, src_rep_blocks);
    for (int32_t g = 1; g < cols / kLanes; ++g) {
        if constexpr (IS_MAX) {
            Max(lanes, lanes, src[g * kLanes], kLanes, static_cast<uint8_t>(rows), rp);
        } else {
            Add(lanes, lanes, src[g * kLanes], kLanes, static_cast<uint8_t>(rows), rp);
        }
        PipeBarrier<PIPE_V>();
    }
    if constexpr (IS_MAX) {
        WholeReduceMax<float>(dst, lanes, kLanes, rows, 1, 1, kLanes / kBlockFloats, ReduceOrder::ORDER_ONLY_VALUE);
    } else {
        WholeReduceSum<float>(dst, lanes, kLanes, rows, 1, 1, kLanes / kBlockFloats);
    }
    PipeBarrier<PIPE_V>();
}

/* Long-row fold for the row operators: acc[64] op= x[g*64 : (g+1)*64] for every 64-column group
 * of one chunk, in column order. `first` initialises acc with the first group (a copy, so the
 * sign of zero is kept). `valid` may end mid-group: the tail group is padded by the caller with
 * the neutral element (0 for sum, -inf for max). */
template <bool IS_MAX>
__aicore__ inline void LaneFold(const LocalTensor<float> &acc, const LocalTensor<float> &x, int32_t groups, bool first)
{
    int32_t g = 0;
    if (first) {
        DataCopy(acc, x, kLanes);
        PipeBarrier<PIPE_V>();
        g = 1;
    }
    for (; g < groups; ++g) {
        if constexpr (IS_MAX) {
            Max(acc, acc, x[g * kLanes], kLanes);
        } else {
            Add(acc, acc, x[g * kLanes], kLanes);
        }
        PipeBarrier<PIPE_V>();
    }
}

template <bool IS_MAX>
__aicore__ inline float LaneTree(const LocalTensor<float> &acc, const LocalTensor<float> &out)
{
    if constexpr (IS_MAX) {
        WholeReduceMax<float>(out, acc, kLanes, 1, 1, 1, kLanes / kBlockFloats, ReduceOrder::ORDER_ONLY_VALUE);
    } else {
        WholeReduceSum<float>(out, acc, kLanes, 1, 1, 1, kLanes / kBlockFloats);
    }
    Fence<HardEvent::V_S>();
    return out.GetValue(0);
}

/* Sequence metadata read from GM (the device twin of tp::HostSeqs). */
struct GmSeqs {
    GlobalTensor<int64_t> meta;    // [num_seqs, kSeqMetaCols]
    GlobalTensor<int32_t> table;   // paged: [num_seqs, max_pages]
    int32_t max_pages = 0;

    __aicore__ inline int64_t Meta(int32_t s, int32_t col) const { return meta.GetValue(s * kSeqMetaCols + col); }
    __aicore__ inline int32_t QLen(int32_t s) const { return static_cast<int32_t>(Meta(s, kMetaQLen)); }
    __aicore__ inline int32_t QStart(int32_t s) const { return static_cast<int32_t>(Meta(s, kMetaQStart)); }
    __aicore__ inline int32_t KvLen(int32_t s) const { return static_cast<int32_t>(Meta(s, kMetaKvLen)); }
    __aicore__ inline int64_t QOffset(int32_t s) const { return Meta(s, kMetaQOffset); }
    __aicore__ inline int64_t KvOffset(int32_t s) const { return Meta(s, kMetaKvOffset); }
    __aicore__ inline int32_t Page(int32_t s, int32_t p) const { return table.GetValue(s * max_pages + p); }
};

/* Number of vector workers of this launch and this core's index among them. */
__aicore__ inline int32_t WorkerIndex() { return static_cast<int32_t>(GetBlockIdx()); }

}  // namespace kernel
}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_KERNEL_COMMON_H
