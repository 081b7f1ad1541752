/*
 * OnpolicyPagedAttention — inference attention: prefill, chunked prefill and paged decode.
 *
 * The same tile routine as the training forward (attention_tile.h, AttentionTile<T>::RunTask);
 * only the K/V addressing differs: tile j of sequence s starts at page
 * block_table[s, j*kv_tile / page_size], offset (j*kv_tile) % page_size (page_size is a multiple
 * of kv_tile, so a tile never straddles pages). Prefill and decode requests may share one call:
 * every sequence has its own q_len / q_start / kv_len in seq_meta.
 * Inputs: q [N, Hq, D], k_pages/v_pages [P, page_size, Hkv, D], block_table [S, max_pages] int32,
 * seq_meta [S, 5] int64. Output: out [N, Hq, D].
 */
#include "attention_tile.h"

using namespace onpolicy;
using namespace onpolicy::kernel;

extern "C" __global__ __aicore__ void onpolicy_paged_attention(GM_ADDR q, GM_ADDR k_pages, GM_ADDR v_pages,
                                                               GM_ADDR block_table, GM_ADDR seq_meta, GM_ADDR out,
                                                               GM_ADDR workspace, GM_ADDR tiling)
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
    op.Init(td.geo, td.ws_per_worker, false, q, k_pages, v_pages, seq_meta, block_table, out, nullptr, user_ws,
            &pipe);
    op.Process();
}
