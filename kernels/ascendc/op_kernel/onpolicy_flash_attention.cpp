/*
 * OnpolicyFlashAttention — training forward attention (packed sequences, contiguous K/V).
 *
 * Runs the shared tile routine (attention_tile.h) on the training view of the tile plan and also
 * writes the per-row softmax statistics lse = m + log(l) that OnpolicyFlashAttentionGrad uses.
 * Inputs: q [T, Hq, D], k/v [Tk, Hkv, D] (T = fp16/bf16/fp32), seq_meta [S, 5] int64.
 * Outputs: out [T, Hq, D] (T), lse [T, Hq] fp32.
 */
#include "attention_tile.h"

using namespace onpolicy;
using namespace onpolicy::kernel;

extern "C" __global__ __aicore__ void onpolicy_flash_attention(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR seq_meta,
                                                               GM_ADDR out, GM_ADDR lse, GM_ADDR workspace,
                                                               GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    REGISTER_TILING_DEFAULT(OnpolicyAttentionTiling);
    GET_TILING_DATA_WITH_STRUCT(OnpolicyAttentionTiling, td, tiling);
    GM_ADDR user_ws = GetUserWorkspace(workspace);
    if (user_ws == nullptr) {
        return;
    }
    TPipe pipe;
    AttentionTile<DTYPE_Q> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mmQk, &td.qk, op.mmPv, &td.pv);
    op.Init(td.geo, td.ws_per_worker, true, q, k, v, seq_meta, nullptr, out, lse, user_ws, &pipe);
    op.Process();
}
