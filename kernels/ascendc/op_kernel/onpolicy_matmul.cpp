/*
 * OnpolicyMatmul — batch-invariant y[M, N] = x[M, K] @ w[N, K]^T.
 *
 * One tiling for every M (tile_plan_core.h FillMatmulGeometry): output tiles of fixed
 * [base_m, base_n], K reduced by one AI Cube core over base_k chunks 0, 1, ... in order with fp32
 * accumulation in L0C — no split-K, no stream-K, no M-dependent kernel choice. Rows past M in the
 * last tile are a tail of the same tile shape; a row's dot products do not depend on how many
 * rows share its tile. Output dtype = input dtype (fp32 for the LM-head logits path).
 * Cube-only kernel: each AIC walks output tiles t = core, core + cores, ...
 */
#define ASCENDC_CUBE_ONLY
#define ONPOLICY_KERNEL_SIDE 1
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "op_tiling_data.h"

using namespace AscendC;
using namespace onpolicy;

namespace {

template <typename T>
class BatchInvariantMatmul {
public:
    matmul::Matmul<matmul::MatmulType<TPosition::GM, CubeFormat::ND, T>,
                   matmul::MatmulType<TPosition::GM, CubeFormat::ND, T, true>,
                   matmul::MatmulType<TPosition::GM, CubeFormat::ND, T>,
                   matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>>
        mm;

    __aicore__ inline void Init(const tp::MatmulGeometry &geo, GM_ADDR x, GM_ADDR w, GM_ADDR y)
    {
        g_ = geo;
        xGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(x), static_cast<int64_t>(geo.m) * geo.k);
        wGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(w), static_cast<int64_t>(geo.n) * geo.k);
        yGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(y), static_cast<int64_t>(geo.m) * geo.n);
    }

    __aicore__ inline void Process()
    {
        mm.SetOrgShape(g_.m, g_.n, g_.k);
        for (int64_t t = GetBlockIdx(); t < g_.num_tasks; t += GetBlockNum()) {
            int32_t mi = 0;
            int32_t ni = 0;
            tp::DecodeMatmulTask(g_, t, mi, ni);
            const int32_t rows = tp::MinI(g_.base_m, g_.m - mi * g_.base_m);
            const int32_t cols = tp::MinI(g_.base_n, g_.n - ni * g_.base_n);
            mm.SetTensorA(xGm_[static_cast<int64_t>(mi) * g_.base_m * g_.k]);
            mm.SetTensorB(wGm_[static_cast<int64_t>(ni) * g_.base_n * g_.k], true);
            mm.SetTail(rows, cols, g_.k);  // full K: the reduction is never split
            mm.template IterateAll<true>(yGm_[static_cast<int64_t>(mi) * g_.base_m * g_.n +
                                              static_cast<int64_t>(ni) * g_.base_n]);
        }
        mm.End();
    }

private:
    tp::MatmulGeometry g_{};
    GlobalTensor<T> xGm_, wGm_, yGm_;
};

}  // namespace

extern "C" __global__ __aicore__ void onpolicy_matmul(GM_ADDR x, GM_ADDR weight, GM_ADDR y, GM_ADDR workspace,
                                                      GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
    REGISTER_TILING_DEFAULT(OnpolicyMatmulTiling);
    GET_TILING_DATA_WITH_STRUCT(OnpolicyMatmulTiling, td, tiling);
    TPipe pipe;
    BatchInvariantMatmul<DTYPE_X> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mm, &td.mm);
    op.Init(td.geo, x, weight, y);
    op.Process();
}
