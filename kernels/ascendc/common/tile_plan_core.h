/*
 * onpolicy Ascend operator set — the tile plan core.
 *
 * ONE definition of how attention work is cut into tiles, shared verbatim by
 *   - the host tiling of the training attention ops (op_host/onpolicy_flash_attention*.cpp),
 *   - the host tiling of the inference attention op (op_host/onpolicy_paged_attention.cpp),
 *   - the AI Core kernels (op_kernel/attention_tile.h decodes its tasks with these functions),
 *   - the CPU checks (common/tile_plan.cpp C ABI, replay/attention_replay.cpp).
 *
 * Everything here is plain integer arithmetic on an `AttnGeometry` and a sequence accessor, so
 * it compiles with g++ on any machine and with the Ascend C compiler for the device.
 *
 * The numerical contract it encodes (DESIGN §3, alignments 1–3):
 *   - query rows of one (sequence, KV head) are ordered query-major then head-of-group and cut
 *     into blocks of `block_rows` (a fixed multiple of the config's row tile);
 *   - each block visits KV tiles 0, 1, ..., n-1 of `kv_tile` positions, ascending, where n is
 *     the tile holding the block's last query position (tiles past it are never visited);
 *   - one worker owns a block for its whole KV range: there is NO split-KV and no cross-worker
 *     merge, so the number of workers never changes the order of additions;
 *   - a row's visible columns in tile j are those at positions <= its own position.
 * Which physical K/V row backs a logical position (contiguous packing or paged cache) is pure
 * addressing and never changes the arithmetic.
 */
#ifndef ONPOLICY_ASCENDC_TILE_PLAN_CORE_H
#define ONPOLICY_ASCENDC_TILE_PLAN_CORE_H

#if defined(__CCE_AICORE__) || defined(__CCE_KT_TEST__) || defined(ONPOLICY_KERNEL_SIDE)
#define OP_TP_FN __aicore__ inline
#else
#include <cstdint>
#define OP_TP_FN inline
#endif

namespace onpolicy {
namespace tp {

constexpr int32_t kKvContiguous = 0;  // K/V packed per sequence: [rows, Hkv, D] + per-sequence offset
constexpr int32_t kKvPaged = 1;       // K/V in pages: [P, page_size, Hkv, D] + block table [S, max_pages]

/* The geometry every attention op's tiling data starts with (plain POD, same layout on host and
 * device). Only `num_seqs`, `num_tasks`, `num_kv_tasks` and `workers` depend on the call; every
 * other field is a constant of the operator set or of the model. */
struct AttnGeometry {
    int32_t num_seqs;
    int32_t num_heads;     // Hq
    int32_t num_kv_heads;  // Hkv
    int32_t group;         // Hq / Hkv (GQA ratio)
    int32_t head_dim;      // D
    int32_t kv_tile;       // KV positions per tile (KernelConfig.kv_tile)
    int32_t row_tile;      // KernelConfig.row_tile
    int32_t block_rows;    // rows per block: row_tile * row_tiles_per_block (a constant)
    int32_t kv_layout;     // kKvContiguous | kKvPaged
    int32_t page_size;     // paged: positions per page (a multiple of kv_tile)
    int32_t max_pages;     // paged: block-table row length
    int32_t workers;       // vector workers the tasks are dealt to (round-robin)
    int64_t num_tasks;     // forward / dQ tasks: (seq, kv head, row block)
    int64_t num_kv_tasks;  // dK/dV tasks: (seq, kv head, kv tile)
    float scale;           // softmax scale, applied to the fp32 QK^T result
    int32_t dtype_bytes;   // bytes of the compute dtype (2: bf16/fp16, 4: fp32)
};

/* One forward task: a block of query rows of one (sequence, KV head). */
struct Task {
    int32_t seq;
    int32_t kv_head;
    int32_t block;         // block index within (seq, kv head)
    int32_t first_row;     // first row of the block within (seq, kv head): query-major, head-minor
    int32_t valid_rows;    // rows < block_rows that belong to real queries (the rest is padding)
    int32_t first_query;   // query index (within the sequence's queries) of the first row
    int32_t last_query;    // query index of the last valid row
    int32_t first_pos;     // absolute position of first_query
    int32_t last_pos;      // absolute position of last_query
    int32_t num_kv_tiles;  // tiles visited: 0 .. last_pos / kv_tile
    int64_t q_offset;      // packed query row of the sequence's first query
};

/* One dK/dV task (training backward): one KV tile of one (sequence, KV head), accumulating the
 * contributions of the query blocks first_block .. first_block+num_blocks-1 in ascending order. */
struct KvTask {
    int32_t seq;
    int32_t kv_head;
    int32_t tile;
    int32_t valid_kv;      // positions of the tile that exist (< kv_len)
    int32_t first_block;
    int32_t num_blocks;
    int64_t kv_row;        // physical K/V row of the tile's first position
};

OP_TP_FN int32_t CeilDiv(int32_t a, int32_t b) { return (a + b - 1) / b; }
OP_TP_FN int32_t MinI(int32_t a, int32_t b) { return a < b ? a : b; }
OP_TP_FN int32_t MaxI(int32_t a, int32_t b) { return a > b ? a : b; }

/* Rows and blocks of one (sequence, KV head). */
OP_TP_FN int32_t RowsOf(const AttnGeometry &g, int32_t q_len) { return q_len * g.group; }
OP_TP_FN int32_t BlocksOf(const AttnGeometry &g, int32_t q_len) { return CeilDiv(q_len * g.group, g.block_rows); }

/* Row -> query index within the sequence and query head. */
OP_TP_FN int32_t RowQuery(const AttnGeometry &g, int32_t row) { return row / g.group; }
OP_TP_FN int32_t RowHead(const AttnGeometry &g, int32_t kv_head, int32_t row) { return kv_head * g.group + row % g.group; }

/* KV tiles a row at absolute position `pos` needs: the tile holding `pos` is the last. */
OP_TP_FN int32_t TilesForPos(const AttnGeometry &g, int32_t pos) { return pos / g.kv_tile + 1; }

/* Columns of tile `tile` visible to a row at `pos`: positions tile*kv_tile + c <= pos. */
OP_TP_FN int32_t VisibleCols(const AttnGeometry &g, int32_t pos, int32_t tile)
{
    return MaxI(0, MinI(g.kv_tile, pos - tile * g.kv_tile + 1));
}

/* Positions of tile `tile` that exist in a sequence of kv_len positions (rows past it are
 * zero-filled by the kernel and always masked). */
OP_TP_FN int32_t TileValidKv(const AttnGeometry &g, int32_t kv_len, int32_t tile)
{
    return MaxI(0, MinI(g.kv_tile, kv_len - tile * g.kv_tile));
}

/* Physical K/V row (index into the flattened [rows, Hkv, D] or [P*page_size, Hkv, D] buffer) of
 * the first position of tile `tile` of sequence `s`. A tile never straddles a page because
 * page_size is a multiple of kv_tile. */
template <class Seqs>
OP_TP_FN int64_t KvTileRow(const AttnGeometry &g, const Seqs &seqs, int32_t s, int32_t tile)
{
    const int32_t start = tile * g.kv_tile;
    if (g.kv_layout == kKvPaged) {
        const int32_t page = seqs.Page(s, start / g.page_size);
        return static_cast<int64_t>(page) * g.page_size + start % g.page_size;
    }
    return seqs.KvOffset(s) + start;
}

template <class Seqs>
OP_TP_FN int64_t CountTasks(const AttnGeometry &g, const Seqs &seqs)
{
    int64_t n = 0;
    for (int32_t s = 0; s < g.num_seqs; ++s) {
        n += static_cast<int64_t>(BlocksOf(g, seqs.QLen(s))) * g.num_kv_heads;
    }
    return n;
}

/* The task of block `block` of (sequence s, KV head kv_head). */
template <class Seqs>
OP_TP_FN void MakeTask(const AttnGeometry &g, const Seqs &seqs, int32_t s, int32_t kv_head, int32_t block, Task &out)
{
    const int32_t rows = RowsOf(g, seqs.QLen(s));
    out.seq = s;
    out.kv_head = kv_head;
    out.block = block;
    out.first_row = block * g.block_rows;
    out.valid_rows = MinI(g.block_rows, rows - out.first_row);
    out.first_query = RowQuery(g, out.first_row);
    out.last_query = RowQuery(g, out.first_row + out.valid_rows - 1);
    out.first_pos = seqs.QStart(s) + out.first_query;
    out.last_pos = seqs.QStart(s) + out.last_query;
    out.num_kv_tiles = TilesForPos(g, out.last_pos);
    out.q_offset = seqs.QOffset(s);
}

/* Position of a task walk: the sequence holding the next task and that sequence's first task.
 * Workers visit their tasks in increasing order (t = w, w + workers, ...), so a cursor never
 * moves backwards and the kernel reads each sequence's metadata once. */
struct TaskCursor {
    int32_t seq = 0;
    int64_t first_task = 0;
};

/* Task t in the canonical order (sequence-major, then KV head, then block), decoded by advancing
 * `cur`; requires t >= cur.first_task (a fresh cursor decodes any t). */
template <class Seqs>
OP_TP_FN bool DecodeTaskFrom(const AttnGeometry &g, const Seqs &seqs, int64_t t, TaskCursor &cur, Task &out)
{
    if (t < cur.first_task) {
        return false;
    }
    for (; cur.seq < g.num_seqs; ++cur.seq) {
        const int32_t q_len = seqs.QLen(cur.seq);
        const int32_t blocks = BlocksOf(g, q_len);
        const int64_t here = static_cast<int64_t>(blocks) * g.num_kv_heads;
        const int64_t rem = t - cur.first_task;
        if (rem >= here) {
            cur.first_task += here;
            continue;
        }
        MakeTask(g, seqs, cur.seq, static_cast<int32_t>(rem / blocks), static_cast<int32_t>(rem % blocks), out);
        return true;
    }
    return false;
}

template <class Seqs>
OP_TP_FN bool DecodeTask(const AttnGeometry &g, const Seqs &seqs, int64_t t, Task &out)
{
    TaskCursor cur;
    return DecodeTaskFrom(g, seqs, t, cur, out);
}

/* First query block of (sequence, kv head) whose rows can see tile `tile`. */
OP_TP_FN int32_t FirstBlockSeeing(const AttnGeometry &g, int32_t q_start, int32_t tile)
{
    const int32_t query = MaxI(0, tile * g.kv_tile - q_start);
    return (query * g.group) / g.block_rows;
}

template <class Seqs>
OP_TP_FN int64_t CountKvTasks(const AttnGeometry &g, const Seqs &seqs)
{
    int64_t n = 0;
    for (int32_t s = 0; s < g.num_seqs; ++s) {
        n += static_cast<int64_t>(CeilDiv(seqs.KvLen(s), g.kv_tile)) * g.num_kv_heads;
    }
    return n;
}

/* dK/dV task t in the canonical order (sequence-major, then KV head, then tile). */
template <class Seqs>
OP_TP_FN bool DecodeKvTaskFrom(const AttnGeometry &g, const Seqs &seqs, int64_t t, TaskCursor &cur, KvTask &out)
{
    if (t < cur.first_task) {
        return false;
    }
    for (; cur.seq < g.num_seqs; ++cur.seq) {
        const int32_t kv_len = seqs.KvLen(cur.seq);
        const int32_t tiles = CeilDiv(kv_len, g.kv_tile);
        const int64_t here = static_cast<int64_t>(tiles) * g.num_kv_heads;
        const int64_t rem = t - cur.first_task;
        if (rem >= here) {
            cur.first_task += here;
            continue;
        }
        const int32_t s = cur.seq;
        const int32_t q_len = seqs.QLen(s);
        const int32_t q_start = seqs.QStart(s);
        out.seq = s;
        out.kv_head = static_cast<int32_t>(rem / tiles);
        out.tile = static_cast<int32_t>(rem % tiles);
        out.valid_kv = TileValidKv(g, kv_len, out.tile);
        out.kv_row = KvTileRow(g, seqs, s, out.tile);
        const int32_t blocks = BlocksOf(g, q_len);
        if (out.tile * g.kv_tile - q_start >= q_len) {  // no query of this call reaches the tile
            out.first_block = blocks;
            out.num_blocks = 0;
        } else {
            out.first_block = FirstBlockSeeing(g, q_start, out.tile);
            out.num_blocks = blocks - out.first_block;
        }
        return true;
    }
    return false;
}

template <class Seqs>
OP_TP_FN bool DecodeKvTask(const AttnGeometry &g, const Seqs &seqs, int64_t t, KvTask &out)
{
    TaskCursor cur;
    return DecodeKvTaskFrom(g, seqs, t, cur, out);
}

/* Worker that owns task t: round-robin. Any dealing gives the same bits (no split-KV). */
OP_TP_FN int32_t WorkerOf(const AttnGeometry &g, int64_t t) { return static_cast<int32_t>(t % g.workers); }

/* ---------------------------------------------------------------------------------------------
 * Batch-invariant matmul: one tiling for every M, no split-K.
 * y[M, N] = x[M, K] @ w[N, K]^T. The K reduction of every output element runs over base_k
 * chunks 0, 1, ..., ceil(K/base_k)-1 in order, accumulating in fp32 in L0C, inside ONE worker;
 * base_m/base_n/base_k are constants of the dtype, never of the shape. */
struct MatmulGeometry {
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t base_m;
    int32_t base_n;
    int32_t base_k;
    int32_t m_tiles;
    int32_t n_tiles;
    int32_t k_steps;
    int32_t split_k;  // always 1
    int32_t workers;
    int32_t dtype_bytes;
    int64_t num_tasks;
};

OP_TP_FN void MatmulBases(int32_t dtype_bytes, int32_t &base_m, int32_t &base_n, int32_t &base_k)
{
    base_m = 128;
    base_n = dtype_bytes == 4 ? 128 : 256;
    base_k = dtype_bytes == 4 ? 32 : 64;
}

OP_TP_FN void FillMatmulGeometry(MatmulGeometry &g, int32_t m, int32_t n, int32_t k, int32_t dtype_bytes,
                                 int32_t max_workers)
{
    g.m = m;
    g.n = n;
    g.k = k;
    g.dtype_bytes = dtype_bytes;
    MatmulBases(dtype_bytes, g.base_m, g.base_n, g.base_k);
    g.m_tiles = CeilDiv(m, g.base_m);
    g.n_tiles = CeilDiv(n, g.base_n);
    g.k_steps = CeilDiv(k, g.base_k);
    g.split_k = 1;
    g.num_tasks = static_cast<int64_t>(g.m_tiles) * g.n_tiles;
    g.workers = static_cast<int32_t>(g.num_tasks < max_workers ? g.num_tasks : max_workers);
    if (g.workers < 1) {
        g.workers = 1;
    }
}

/* Output tile t: N-major so that consecutive tasks share an x row block. */
OP_TP_FN void DecodeMatmulTask(const MatmulGeometry &g, int64_t t, int32_t &m_tile, int32_t &n_tile)
{
    m_tile = static_cast<int32_t>(t / g.n_tiles);
    n_tile = static_cast<int32_t>(t % g.n_tiles);
}

/* ---------------------------------------------------------------------------------------------
 * Row reductions (RMSNorm sum of squares, log-softmax max and sum-exp): each row is reduced by
 * one worker. The row is consumed in chunks of `chunk` columns (a constant), every chunk is
 * folded lane-wise into a 64-lane fp32 accumulator in column order, and one final in-register
 * reduction of the 64 lanes ends the row. The order therefore depends on the row length only;
 * the chunk width only changes data movement. */
constexpr int32_t kReduceLanes = 64;  // fp32 lanes of one 256-byte vector repeat

struct RowGeometry {
    int32_t rows;
    int32_t cols;
    int32_t chunk;    // columns per UB chunk (a multiple of kReduceLanes)
    int32_t chunks;
    int32_t workers;
    int32_t dtype_bytes;
    float eps;        // RMSNorm only
    int32_t reserved;
};

OP_TP_FN void FillRowGeometry(RowGeometry &g, int32_t rows, int32_t cols, int32_t chunk, int32_t dtype_bytes,
                              int32_t max_workers)
{
    g.rows = rows;
    g.cols = cols;
    g.chunk = chunk;
    g.chunks = CeilDiv(cols, chunk);
    g.dtype_bytes = dtype_bytes;
    g.workers = rows < max_workers ? rows : max_workers;
    if (g.workers < 1) {
        g.workers = 1;
    }
}

}  // namespace tp
}  // namespace onpolicy

#endif  // ONPOLICY_ASCENDC_TILE_PLAN_CORE_H
