/*
 * onpolicy Ascend operator set — host-side tiling (see tile_plan.h) and its C ABI.
 *
 * Compiled three ways:
 *   - into the CANN op_host library (optiling) by build.sh,
 *   - into libonpolicy_tile_plan.so by kernels/ascendc/CMakeLists.txt (host check),
 *   - by the CPU tests with plain g++ (tests/ascend), which call the C ABI through ctypes.
 */
#include "tile_plan.h"

#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

namespace onpolicy {
namespace tp {

namespace {

bool PowerOfTwo(int32_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

std::string ValidateAttention(const AttnConsts &c, int32_t kv_layout, int32_t page_size, const HostSeqs &seqs)
{
    std::ostringstream err;
    if (c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0) {
        err << "num_heads (" << c.num_heads << ") must be a positive multiple of num_kv_heads (" << c.num_kv_heads
            << ")";
        return err.str();
    }
    if (c.head_dim < 8 || c.head_dim > 256 || c.head_dim % 8 != 0) {
        err << "head_dim must be a multiple of 8 in [8, 256], got " << c.head_dim;
        return err.str();
    }
    if ((c.head_dim * c.dtype_bytes) % 32 != 0) {  // one query/key row = whole 32-byte UB blocks
        err << "head_dim * dtype bytes must be a multiple of 32, got " << c.head_dim << " x " << c.dtype_bytes;
        return err.str();
    }
    if (!PowerOfTwo(c.kv_tile) || c.kv_tile < 8 || c.kv_tile > 512) {
        err << "kv_tile must be a power of two in [8, 512], got " << c.kv_tile;
        return err.str();
    }
    if (!PowerOfTwo(c.row_tile) || c.row_tile > 128) {
        err << "row_tile must be a power of two <= 128, got " << c.row_tile;
        return err.str();
    }
    if (c.row_tiles_per_block < 1 || c.row_tile * c.row_tiles_per_block > 128 ||
        (c.row_tile * c.row_tiles_per_block) % 8 != 0) {
        // per-row statistics are fp32 vectors of block_rows elements: whole 32-byte blocks
        err << "rows per block (row_tile * row_tiles_per_block) must be a multiple of 8 in [8, 128], got "
            << c.row_tile * c.row_tiles_per_block;
        return err.str();
    }
    if (c.dtype_bytes != 2 && c.dtype_bytes != 4) {
        err << "dtype_bytes must be 2 or 4, got " << c.dtype_bytes;
        return err.str();
    }
    if (kv_layout != kKvContiguous && kv_layout != kKvPaged) {
        err << "unknown kv_layout " << kv_layout;
        return err.str();
    }
    if (kv_layout == kKvPaged && (page_size < c.kv_tile || page_size % c.kv_tile != 0)) {
        err << "page_size (" << page_size << ") must be a positive multiple of kv_tile (" << c.kv_tile << ")";
        return err.str();
    }
    const size_t n = seqs.q_len.size();
    if (n == 0 || seqs.q_start.size() != n || seqs.kv_len.size() != n || seqs.q_offset.size() != n) {
        return "q_len, q_start, kv_len and q_offset must be non-empty and equally long";
    }
    if (kv_layout == kKvContiguous && seqs.kv_offset.size() != n) {
        return "contiguous K/V needs one kv_offset per sequence";
    }
    if (kv_layout == kKvPaged && seqs.block_table.size() != n * static_cast<size_t>(seqs.max_pages)) {
        return "block table must hold num_seqs * max_pages entries";
    }
    for (size_t s = 0; s < n; ++s) {
        const int32_t q = seqs.q_len[s], st = seqs.q_start[s], kv = seqs.kv_len[s];
        if (q < 1 || st < 0 || kv < st + q) {
            err << "sequence " << s << ": q_len=" << q << ", q_start=" << st << ", kv_len=" << kv
                << " are inconsistent";
            return err.str();
        }
        if (kv_layout == kKvPaged && static_cast<int64_t>(kv) > static_cast<int64_t>(seqs.max_pages) * page_size) {
            err << "sequence " << s << ": kv_len " << kv << " exceeds the block table (" << seqs.max_pages
                << " pages of " << page_size << ")";
            return err.str();
        }
    }
    return "";
}

HostSeqs TrainingSeqs(const std::vector<int64_t> &cu_seqlens)
{
    HostSeqs seqs;
    for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
        const auto len = static_cast<int32_t>(cu_seqlens[s + 1] - cu_seqlens[s]);
        seqs.q_len.push_back(len);
        seqs.q_start.push_back(0);
        seqs.kv_len.push_back(len);
        seqs.q_offset.push_back(cu_seqlens[s]);
        seqs.kv_offset.push_back(cu_seqlens[s]);
    }
    return seqs;
}

HostSeqs PagedSeqs(const std::vector<int32_t> &q_lens, const std::vector<int32_t> &q_starts,
                   const std::vector<int32_t> &kv_lens, const std::vector<int32_t> &block_table, int32_t max_pages)
{
    HostSeqs seqs;
    seqs.q_len = q_lens;
    seqs.q_start = q_starts;
    seqs.kv_len = kv_lens;
    int64_t row = 0;
    for (int32_t q : q_lens) {
        seqs.q_offset.push_back(row);
        row += q;
    }
    seqs.block_table = block_table;
    seqs.max_pages = max_pages;
    return seqs;
}

namespace {

AttnBudget Budget(const AttnGeometry &g, bool backward)
{
    const auto align32 = [](int64_t bytes) { return (bytes + 31) / 32 * 32; };
    const int64_t br = g.block_rows, kt = g.kv_tile, d = g.head_dim, eb = g.dtype_bytes;
    const int64_t rows_max = br > kt ? br : kt;
    AttnBudget b;
    b.ub_bytes = 2 * align32(br * kt * 4)          // scores, key-minus-row positions
                 + align32(br * kt / 8)            // visibility bit mask
                 + align32(kt * 4)                 // column index 0..kv_tile-1
                 + 2 * align32(rows_max * d * 4)   // accumulator, Cube result
                 + align32(rows_max * d * eb)      // staging in the compute dtype
                 + align32(rows_max * d * 4)       // staging in fp32
                 + align32(8 * br * 4)             // m, m', tile max, alpha, l, rowsum, 2 spare
                 + align32(br * kReduceLanes * 4)  // row-reduce lanes
                 + align32((d > kReduceLanes ? d : kReduceLanes) * 4);
    if (backward) {
        b.ub_bytes += align32(br * kt * 4)         // dP / dS
                      + align32(rows_max * d * 4)  // second accumulator (dV)
                      + align32(br * d * 4);       // dO rows
    }
    b.workspace_per_worker = ((backward ? 2 : 1) * br * d + 2 * kt * d + 2 * br * kt + rows_max * d) * 4;
    return b;
}

}  // namespace

AttnBudget ForwardBudget(const AttnGeometry &g) { return Budget(g, false); }

AttnBudget BackwardBudget(const AttnGeometry &g) { return Budget(g, true); }

AttentionPlan BuildAttentionPlan(const AttnConsts &c, int32_t kv_layout, int32_t page_size, HostSeqs seqs,
                                 int32_t max_workers)
{
    const std::string err = ValidateAttention(c, kv_layout, page_size, seqs);
    if (!err.empty()) {
        throw std::invalid_argument(err);
    }
    AttentionPlan plan;
    AttnGeometry &g = plan.geometry;
    g.num_seqs = static_cast<int32_t>(seqs.q_len.size());
    g.num_heads = c.num_heads;
    g.num_kv_heads = c.num_kv_heads;
    g.group = c.num_heads / c.num_kv_heads;
    g.head_dim = c.head_dim;
    g.kv_tile = c.kv_tile;
    g.row_tile = c.row_tile;
    g.block_rows = c.row_tile * c.row_tiles_per_block;
    g.kv_layout = kv_layout;
    g.page_size = kv_layout == kKvPaged ? page_size : 0;
    g.max_pages = kv_layout == kKvPaged ? seqs.max_pages : 0;
    g.scale = c.scale;
    g.dtype_bytes = c.dtype_bytes;
    g.workers = 1;  // set below; DecodeTask does not read it
    const AttnBudget budget = ForwardBudget(g);
    if (budget.ub_bytes > kUbBytesLimit) {
        std::ostringstream e;
        e << "rows per block " << g.block_rows << " x kv_tile " << g.kv_tile << " x head_dim " << g.head_dim
          << " needs " << budget.ub_bytes << " bytes of UB, more than " << kUbBytesLimit;
        throw std::invalid_argument(e.str());
    }
    g.num_tasks = CountTasks(g, seqs);
    g.num_kv_tasks = CountKvTasks(g, seqs);
    const int64_t busiest = g.num_tasks > g.num_kv_tasks ? g.num_tasks : g.num_kv_tasks;
    g.workers = static_cast<int32_t>(busiest < max_workers ? busiest : max_workers);
    if (g.workers < 1) {
        g.workers = 1;
    }
    // Tasks are enumerated the way a worker walks them (a monotone cursor); the C ABI also
    // exposes the cursor-free DecodeTask so the tests can check that both agree.
    plan.tasks.reserve(static_cast<size_t>(g.num_tasks));
    TaskCursor cursor;
    for (int64_t t = 0; t < g.num_tasks; ++t) {
        Task task{};
        if (!DecodeTaskFrom(g, seqs, t, cursor, task)) {
            throw std::logic_error("task enumeration out of range");
        }
        if (task.block == 0 && task.kv_head == 0) {
            plan.task_of_seq.push_back(t);
        }
        plan.tasks.push_back(task);
    }
    plan.kv_tasks.reserve(static_cast<size_t>(g.num_kv_tasks));
    TaskCursor kv_cursor;
    for (int64_t t = 0; t < g.num_kv_tasks; ++t) {
        KvTask task{};
        if (!DecodeKvTaskFrom(g, seqs, t, kv_cursor, task)) {
            throw std::logic_error("kv task enumeration out of range");
        }
        plan.kv_tasks.push_back(task);
    }
    plan.seqs = std::move(seqs);
    return plan;
}

TokenPlan TokenOf(const AttentionPlan &plan, int32_t seq, int32_t query, int32_t head)
{
    const AttnGeometry &g = plan.geometry;
    if (seq < 0 || seq >= g.num_seqs || query < 0 || query >= plan.seqs.QLen(seq) || head < 0 ||
        head >= g.num_heads) {
        throw std::out_of_range("token outside the plan");
    }
    TokenPlan tok;
    tok.kv_head = head / g.group;
    const int32_t row = query * g.group + head % g.group;
    tok.block = row / g.block_rows;
    tok.row_in_block = row % g.block_rows;
    tok.task = plan.task_of_seq[static_cast<size_t>(seq)] +
               static_cast<int64_t>(tok.kv_head) * BlocksOf(g, plan.seqs.QLen(seq)) + tok.block;
    const Task &task = plan.tasks[static_cast<size_t>(tok.task)];
    if (task.seq != seq || task.kv_head != tok.kv_head || task.block != tok.block ||
        tok.row_in_block >= task.valid_rows) {
        throw std::logic_error("token does not map back to its task");
    }
    tok.worker = WorkerOf(g, tok.task);
    tok.block_rows = g.block_rows;
    tok.kv_tile = g.kv_tile;
    tok.head_dim = g.head_dim;
    tok.position = plan.seqs.QStart(seq) + query;
    tok.kv_split = 1;
    tok.tiles_visited = task.num_kv_tiles;
    tok.tiles_effective = TilesForPos(g, tok.position);
    for (int32_t j = 0; j < task.num_kv_tiles; ++j) {
        tok.tile_kv_row.push_back(KvTileRow(g, plan.seqs, seq, j));
        tok.tile_cols.push_back(VisibleCols(g, tok.position, j));
    }
    return tok;
}

MatmulGeometry BuildMatmulPlan(int32_t m, int32_t n, int32_t k, int32_t dtype_bytes, int32_t max_workers)
{
    if (m < 1 || n < 1 || k < 1) {
        throw std::invalid_argument("matmul dimensions must be positive");
    }
    if (dtype_bytes != 2 && dtype_bytes != 4) {
        throw std::invalid_argument("dtype_bytes must be 2 or 4");
    }
    MatmulGeometry g{};
    FillMatmulGeometry(g, m, n, k, dtype_bytes, max_workers);
    return g;
}

RowGeometry BuildRowPlan(int32_t rows, int32_t cols, int32_t dtype_bytes, int32_t max_workers)
{
    if (rows < 1 || cols < 1) {
        throw std::invalid_argument("row operator dimensions must be positive");
    }
    if (cols % 8 != 0) {
        throw std::invalid_argument("row length must be a multiple of 8 (32-byte fp32 blocks)");
    }
    RowGeometry g{};
    FillRowGeometry(g, rows, cols, kRowChunk, dtype_bytes, max_workers);
    return g;
}

}  // namespace tp
}  // namespace onpolicy

/* ------------------------------------------------------------------------------------------------
 * C ABI (ctypes): used by tests/ascend and by tools/tile_plan_cli.cpp. Not used on the device.
 */
extern "C" {

typedef struct {
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t kv_tile;
    int32_t row_tile;
    int32_t row_tiles_per_block;
    int32_t dtype_bytes;
    float scale;
} op_tp_consts;

typedef struct {
    int64_t task;
    int32_t worker;
    int32_t kv_head;
    int32_t block;
    int32_t row_in_block;
    int32_t block_rows;
    int32_t kv_tile;
    int32_t head_dim;
    int32_t position;
    int32_t kv_split;
    int32_t tiles_visited;
    int32_t tiles_effective;
} op_tp_token;

typedef onpolicy::tp::Task op_tp_task;
typedef onpolicy::tp::KvTask op_tp_kv_task;
typedef onpolicy::tp::AttnGeometry op_tp_geometry;
typedef onpolicy::tp::MatmulGeometry op_tp_matmul;
typedef onpolicy::tp::RowGeometry op_tp_rows;

static thread_local std::string g_last_error;

static onpolicy::tp::AttnConsts ToConsts(const op_tp_consts *c)
{
    onpolicy::tp::AttnConsts k;
    k.num_heads = c->num_heads;
    k.num_kv_heads = c->num_kv_heads;
    k.head_dim = c->head_dim;
    k.kv_tile = c->kv_tile;
    k.row_tile = c->row_tile;
    k.row_tiles_per_block = c->row_tiles_per_block;
    k.dtype_bytes = c->dtype_bytes;
    k.scale = c->scale;
    return k;
}

const char *op_tp_last_error(void) { return g_last_error.c_str(); }

/* Training view: cu_seqlens[num_seqs + 1] (int64), contiguous K/V. Returns NULL on error. */
void *op_tp_plan_training(const op_tp_consts *c, int32_t num_seqs, const int64_t *cu_seqlens, int32_t max_workers)
{
    try {
        std::vector<int64_t> cu(cu_seqlens, cu_seqlens + num_seqs + 1);
        auto plan = std::make_unique<onpolicy::tp::AttentionPlan>(onpolicy::tp::BuildAttentionPlan(
            ToConsts(c), onpolicy::tp::kKvContiguous, 0, onpolicy::tp::TrainingSeqs(cu), max_workers));
        return plan.release();
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return nullptr;
    }
}

/* General contiguous view (q_start may be > 0): used for prefill over a packed prefix. */
void *op_tp_plan_contiguous(const op_tp_consts *c, int32_t num_seqs, const int32_t *q_lens, const int32_t *q_starts,
                            const int32_t *kv_lens, const int64_t *kv_offsets, int32_t max_workers)
{
    try {
        onpolicy::tp::HostSeqs seqs;
        int64_t row = 0;
        for (int32_t s = 0; s < num_seqs; ++s) {
            seqs.q_len.push_back(q_lens[s]);
            seqs.q_start.push_back(q_starts[s]);
            seqs.kv_len.push_back(kv_lens[s]);
            seqs.q_offset.push_back(row);
            seqs.kv_offset.push_back(kv_offsets[s]);
            row += q_lens[s];
        }
        auto plan = std::make_unique<onpolicy::tp::AttentionPlan>(onpolicy::tp::BuildAttentionPlan(
            ToConsts(c), onpolicy::tp::kKvContiguous, 0, std::move(seqs), max_workers));
        return plan.release();
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return nullptr;
    }
}

/* Inference view: paged K/V with block_table[num_seqs * max_pages]. Returns NULL on error. */
void *op_tp_plan_paged(const op_tp_consts *c, int32_t num_seqs, const int32_t *q_lens, const int32_t *q_starts,
                       const int32_t *kv_lens, const int32_t *block_table, int32_t max_pages, int32_t page_size,
                       int32_t max_workers)
{
    try {
        std::vector<int32_t> ql(q_lens, q_lens + num_seqs), qs(q_starts, q_starts + num_seqs),
            kl(kv_lens, kv_lens + num_seqs),
            bt(block_table, block_table + static_cast<size_t>(num_seqs) * static_cast<size_t>(max_pages));
        auto plan = std::make_unique<onpolicy::tp::AttentionPlan>(onpolicy::tp::BuildAttentionPlan(
            ToConsts(c), onpolicy::tp::kKvPaged, page_size, onpolicy::tp::PagedSeqs(ql, qs, kl, bt, max_pages),
            max_workers));
        return plan.release();
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return nullptr;
    }
}

void op_tp_plan_free(void *plan) { delete static_cast<onpolicy::tp::AttentionPlan *>(plan); }

int op_tp_plan_geometry(const void *plan, op_tp_geometry *out)
{
    *out = static_cast<const onpolicy::tp::AttentionPlan *>(plan)->geometry;
    return 0;
}

int64_t op_tp_plan_num_tasks(const void *plan)
{
    return static_cast<int64_t>(static_cast<const onpolicy::tp::AttentionPlan *>(plan)->tasks.size());
}

int op_tp_plan_task(const void *plan, int64_t i, op_tp_task *out)
{
    const auto &tasks = static_cast<const onpolicy::tp::AttentionPlan *>(plan)->tasks;
    if (i < 0 || static_cast<size_t>(i) >= tasks.size()) {
        g_last_error = "task index out of range";
        return -1;
    }
    *out = tasks[static_cast<size_t>(i)];
    return 0;
}

/* Cursor-free decoding of task i (what a worker starting at i computes). */
int op_tp_decode_task(const void *plan, int64_t i, op_tp_task *out)
{
    const auto *p = static_cast<const onpolicy::tp::AttentionPlan *>(plan);
    if (!onpolicy::tp::DecodeTask(p->geometry, p->seqs, i, *out)) {
        g_last_error = "task index out of range";
        return -1;
    }
    return 0;
}

int op_tp_decode_kv_task(const void *plan, int64_t i, op_tp_kv_task *out)
{
    const auto *p = static_cast<const onpolicy::tp::AttentionPlan *>(plan);
    if (!onpolicy::tp::DecodeKvTask(p->geometry, p->seqs, i, *out)) {
        g_last_error = "kv task index out of range";
        return -1;
    }
    return 0;
}

int64_t op_tp_plan_num_kv_tasks(const void *plan)
{
    return static_cast<int64_t>(static_cast<const onpolicy::tp::AttentionPlan *>(plan)->kv_tasks.size());
}

int op_tp_plan_kv_task(const void *plan, int64_t i, op_tp_kv_task *out)
{
    const auto &tasks = static_cast<const onpolicy::tp::AttentionPlan *>(plan)->kv_tasks;
    if (i < 0 || static_cast<size_t>(i) >= tasks.size()) {
        g_last_error = "kv task index out of range";
        return -1;
    }
    *out = tasks[static_cast<size_t>(i)];
    return 0;
}

/* Token projection; tile arrays must hold `cap` entries. Returns the number of visited tiles,
 * or -1 on error (message in op_tp_last_error). */
int32_t op_tp_plan_token(const void *plan, int32_t seq, int32_t query, int32_t head, op_tp_token *out,
                         int64_t *tile_kv_row, int32_t *tile_cols, int32_t cap)
{
    try {
        const auto tok = onpolicy::tp::TokenOf(*static_cast<const onpolicy::tp::AttentionPlan *>(plan), seq, query,
                                               head);
        out->task = tok.task;
        out->worker = tok.worker;
        out->kv_head = tok.kv_head;
        out->block = tok.block;
        out->row_in_block = tok.row_in_block;
        out->block_rows = tok.block_rows;
        out->kv_tile = tok.kv_tile;
        out->head_dim = tok.head_dim;
        out->position = tok.position;
        out->kv_split = tok.kv_split;
        out->tiles_visited = tok.tiles_visited;
        out->tiles_effective = tok.tiles_effective;
        const auto n = static_cast<int32_t>(tok.tile_kv_row.size());
        if (n > cap) {
            g_last_error = "tile buffer too small";
            return -1;
        }
        for (int32_t j = 0; j < n; ++j) {
            tile_kv_row[j] = tok.tile_kv_row[static_cast<size_t>(j)];
            tile_cols[j] = tok.tile_cols[static_cast<size_t>(j)];
        }
        return n;
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return -1;
    }
}

int op_tp_matmul_plan(int32_t m, int32_t n, int32_t k, int32_t dtype_bytes, int32_t max_workers, op_tp_matmul *out)
{
    try {
        *out = onpolicy::tp::BuildMatmulPlan(m, n, k, dtype_bytes, max_workers);
        return 0;
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return -1;
    }
}

int op_tp_row_plan(int32_t rows, int32_t cols, int32_t dtype_bytes, int32_t max_workers, op_tp_rows *out)
{
    try {
        *out = onpolicy::tp::BuildRowPlan(rows, cols, dtype_bytes, max_workers);
        return 0;
    } catch (const std::exception &e) {
        g_last_error = e.what();
        return -1;
    }
}

int32_t op_tp_sizeof_geometry(void) { return static_cast<int32_t>(sizeof(op_tp_geometry)); }
int32_t op_tp_sizeof_task(void) { return static_cast<int32_t>(sizeof(op_tp_task)); }
int32_t op_tp_sizeof_kv_task(void) { return static_cast<int32_t>(sizeof(op_tp_kv_task)); }

}  // extern "C"
