/* rowdot: y[m, n] = sum_k x[m, k] * w[n, k] (a linear, weight in torch's [Out, K] layout) with an
 * order of additions fixed by the algorithm alone, never by the call's shape, tiling or threads.
 *
 * The order: K is read in blocks of 8 (the last one zero-padded); lane j (0..7) accumulates
 * x[k+j] * w[k+j] over the blocks in order with fused multiply-adds, starting from +0; the 8 lanes
 * are then summed as ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). Every output element is computed by one
 * thread in exactly that way whatever M, N, the micro-tile it falls in or the thread count, so a
 * row's result does not depend on the other rows (batch invariance) or on which columns the call
 * computes (column-slice invariance). The AVX2+FMA path and the portable path perform the same
 * IEEE operations (fmaf is the same correctly rounded fused multiply-add), so they give the same
 * bits; this file must be compiled without -ffast-math and with -ffp-contract=off.
 *
 * Chunked form (the canonical row-parallel reduction): K is `chunks` chunks of `K` elements each;
 * chunk c's partial is the dot product above over that chunk alone, optionally rounded to bf16
 * (round to nearest even, as torch's fp32 -> bf16 cast for every finite and infinite value; a NaN
 * stays a NaN, its payload bits may differ from torch's), and the partials are either written out
 * one by one or folded left to right in fp32 (((p0 + p1) + p2) + ...). One chunk is plain rowdot.
 *
 * x and w may each be fp32 or bf16 (bf16 -> fp32 is exact); y is fp32. Strides in elements. */
#include "native.h"

#define MR 4      /* rows of x per micro-tile */
#define NR 3      /* rows of w per micro-tile */
#define NBLOCK 96 /* rows of w per parallel task (a multiple of NR and of 8) */
#define MBLOCK 64 /* rows of x per parallel task (a multiple of MR) */

typedef struct {
    size_t xrow, wrow;     /* bytes between rows of x / of w */
    size_t xchunk, wchunk; /* bytes between chunks of x (K elements on) / of w */
    int64_t K;             /* elements per chunk */
    int chunks;
    int round_bf16;        /* round each partial to bf16 */
    int64_t ldy, ychunk;   /* y: elements between rows; between partials (0: fold them) */
    int accumulate;        /* fold into y: y + the (single) chunk's partial, instead of storing it */
} geom;

/* a finished partial of chunk c: rounded if asked, then stored or folded into *total */
static inline void emit(const geom *g, float p, int c, float *total, float *out) {
    if (g->round_bf16) p = round_bf16(p);
    if (g->ychunk) {
        out[c * g->ychunk] = p;
        return;
    }
    *total = c ? *total + p : p;
    if (c == g->chunks - 1) *out = g->accumulate ? *out + *total : *total;
}

/* Portable path: one element at a time, the same operations as the vector path. */
static void dot_portable(const char *x, int xb, const char *w, int wb, float *y, const geom *g,
                         int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    float xa[LANES], wa[LANES], acc[LANES];
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t n = n0; n < n1; n++) {
            float total = 0.0f;
            for (int c = 0; c < g->chunks; c++) {
                const char *xr = x + m * g->xrow + c * g->xchunk, *wr = w + n * g->wrow + c * g->wchunk;
                for (int j = 0; j < LANES; j++) acc[j] = 0.0f;
                for (int64_t k = 0; k < g->K; k += LANES) {
                    int len = (g->K - k) < LANES ? (int)(g->K - k) : LANES;
                    block_f32(xr, xb, k, len, xa);
                    block_f32(wr, wb, k, len, wa);
                    for (int j = 0; j < LANES; j++) acc[j] = fmaf(xa[j], wa[j], acc[j]);
                }
                emit(g, lane_sum(acc), c, &total, y + m * g->ldy + n);
            }
        }
    }
}

#ifdef NATIVE_X86
/* One micro-tile of R rows of x by C rows of w (R <= MR, C <= 8): NAME##_chunk computes the
 * partials of one chunk, NAME all chunks (one chunk stored directly); fully unrolled by the compiler
 * for the constant shapes below. A lone row of x (decode) takes 8 rows of w at a time: eight
 * concurrent streams of weights read faster than four (measured: +5 % GB/s at batch 1). bf16 rows
 * are short streams for the hardware prefetcher (1,152 bytes in SmolLM2's LM head), so the 8-row
 * tile also prefetches the next tile's rows at the same k, one cache line of each per 32 elements:
 * a hint, no bit changes (measured: the bf16 LM head at batch 1 4.2 -> 3.6 ms, medians of 5
 * alternating runs; fp32 rows gained nothing measurable and are left to the hardware). */
#define TILE(NAME, R, C)                                                                           \
    AVX2_INLINE static void NAME##_chunk(const char *x, int xb, const char *w, int wb, const geom *g, \
                                         float p[R][C]) {                                          \
        int64_t K = g->K, kfull = K - K % LANES;                                                   \
        __m256 acc[R][C];                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                           \
        for (int64_t k = 0; k < kfull; k += LANES) {                                               \
            if (R == 1) { /* x first, each w vector used as it is loaded: no accumulator spills */  \
                __m256 xv = load8(x, xb, k);                                                       \
                if (C == 8 && wb && k % 32 == 0) /* bf16: the next 8 rows' cache line at this k */   \
                    for (int c = 0; c < C; c++)                                                    \
                        _mm_prefetch(w + (C + c) * g->wrow + 2 * k, _MM_HINT_T0);                  \
                for (int c = 0; c < C; c++)                                                        \
                    acc[0][c] = _mm256_fmadd_ps(xv, load8(w + c * g->wrow, wb, k), acc[0][c]);     \
                continue;                                                                          \
            }                                                                                      \
            __m256 wv[C];                                                                          \
            for (int c = 0; c < C; c++) wv[c] = load8(w + c * g->wrow, wb, k);                     \
            for (int r = 0; r < R; r++) {                                                          \
                __m256 xv = load8(x + r * g->xrow, xb, k);                                         \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);    \
            }                                                                                      \
        }                                                                                          \
        if (kfull < K) {                                                                           \
            int n = (int)(K - kfull);                                                              \
            __m256 wv[C];                                                                          \
            for (int c = 0; c < C; c++) wv[c] = load_tail(w + c * g->wrow, wb, kfull, n);         \
            for (int r = 0; r < R; r++) {                                                          \
                __m256 xv = load_tail(x + r * g->xrow, xb, kfull, n);                              \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);    \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int c = 0; c < C; c++) p[r][c] = hsum(acc[r][c]);                                 \
    }                                                                                              \
    AVX2_INLINE static void NAME(const char *x, int xb, const char *w, int wb, float *y,           \
                                 const geom *g) {                                                  \
        float p[R][C];                                                                             \
        if (g->chunks == 1 && !g->ychunk) {                                                        \
            NAME##_chunk(x, xb, w, wb, g, p);                                                      \
            for (int r = 0; r < R; r++)                                                            \
                for (int c = 0; c < C; c++) {                                                      \
                    float v = g->round_bf16 ? round_bf16(p[r][c]) : p[r][c], *o = y + r * g->ldy + c; \
                    *o = g->accumulate ? *o + v : v;                                               \
                }                                                                                  \
            return;                                                                                \
        }                                                                                          \
        float total[R][C] = {{0}};                                                                 \
        for (int ch = 0; ch < g->chunks; ch++) {                                                   \
            NAME##_chunk(x + ch * g->xchunk, xb, w + ch * g->wchunk, wb, g, p);                    \
            for (int r = 0; r < R; r++)                                                            \
                for (int c = 0; c < C; c++) emit(g, p[r][c], ch, &total[r][c], y + r * g->ldy + c); \
        }                                                                                          \
    }

TILE(tile_4x3, 4, 3)
TILE(tile_1x8, 1, 8)
TILE(tile_1x1, 1, 1)

AVX2_INLINE static void dot_avx2_impl(const char *x, int xb, const char *w, int wb, float *y, const geom *g,
                                      int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    int64_t mfull = m1 - (m1 - m0) % MR;
    for (int64_t m = m0; m < mfull; m += MR) {
        int64_t n = n0;
        for (; n + NR <= n1; n += NR)
            tile_4x3(x + m * g->xrow, xb, w + n * g->wrow, wb, y + m * g->ldy + n, g);
        for (; n < n1; n++)
            for (int r = 0; r < MR; r++)
                tile_1x1(x + (m + r) * g->xrow, xb, w + n * g->wrow, wb, y + (m + r) * g->ldy + n, g);
    }
    for (int64_t m = mfull; m < m1; m++) {
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8)
            tile_1x8(x + m * g->xrow, xb, w + n * g->wrow, wb, y + m * g->ldy + n, g);
        for (; n < n1; n++)
            tile_1x1(x + m * g->xrow, xb, w + n * g->wrow, wb, y + m * g->ldy + n, g);
    }
}

#define DOT_AVX2(XB, WB)                                                                           \
    AVX2 static void dot_avx2_##XB##WB(const char *x, const char *w, float *y, const geom *g,        \
                                       int64_t m0, int64_t m1, int64_t n0, int64_t n1) {            \
        dot_avx2_impl(x, XB, w, WB, y, g, m0, m1, n0, n1);                                         \
    }
DOT_AVX2(0, 0)
DOT_AVX2(0, 1)
DOT_AVX2(1, 0)
DOT_AVX2(1, 1)

static void dot_avx2(const char *x, int xb, const char *w, int wb, float *y, const geom *g,
                     int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (xb)
        (wb ? dot_avx2_11 : dot_avx2_10)(x, w, y, g, m0, m1, n0, n1);
    else
        (wb ? dot_avx2_01 : dot_avx2_00)(x, w, y, g, m0, m1, n0, n1);
}
#endif

/* 1 when this build has a vector path and the CPU runs it. */
int rowdot_vector_path(void) { return native_vector_path(); }

/* rows m0..m1 x n0..n1 of one geometry, on the vector path when asked and present */
static void dot_block(const char *x, int xb, const char *w, int wb, float *y, const geom *g, int vector,
                      int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
#ifdef NATIVE_X86
    if (vector) {
        dot_avx2(x, xb, w, wb, y, g, m0, m1, n0, n1);
        return;
    }
#else
    (void)vector;
#endif
    dot_portable(x, xb, w, wb, y, g, m0, m1, n0, n1);
}

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* A group's task list: weight s (ns[s] rows) gives ceil(ns[s] / rows_per_task) * mult tasks,
 * first[s] .. first[s + 1] - 1; returns the total. */
static int64_t group_tasks(int nw, const int64_t *ns, int64_t rows_per_task, int64_t mult, int64_t *first) {
    first[0] = 0;
    for (int s = 0; s < nw; s++) first[s + 1] = first[s] + ceil_div(ns[s], rows_per_task) * mult;
    return first[nw];
}

/* the weight task t belongs to */
static inline int task_weight(const int64_t *first, int64_t t) {
    int s = 0;
    while (t >= first[s + 1]) s++;
    return s;
}

/* threads for `tasks` tasks: at least 1, at most one per task */
static inline int team(int threads, int64_t tasks) {
    if (threads < 1) threads = 1;
    return tasks < threads ? (int)tasks : threads;
}

/* x [M, chunks*K] (row stride ldx; chunk c starts K*c elements into a row), w: chunk c, row n at
 * element c*wchunk + n*ldw. y: folded [M, N] (ychunk 0) or partials, partial c of element (m, n)
 * at c*ychunk + m*ldy + n. x_bf16 / w_bf16: 1 when that operand is bf16. threads: OpenMP threads
 * (>= 1). force_portable: 1 to run the portable path (tests compare both paths' bits). */
void rowdot_chunked(const void *x, int x_bf16, int64_t ldx, const void *w, int w_bf16, int64_t ldw,
                    int64_t wchunk, int chunks, int64_t K, float *y, int64_t ldy, int64_t ychunk,
                    int round_partials_bf16, int64_t M, int64_t N, int threads, int force_portable) {
    size_t xs = x_bf16 ? 2 : 4, ws = w_bf16 ? 2 : 4;
    geom g = {(size_t)ldx * xs, (size_t)ldw * ws, (size_t)K * xs, (size_t)wchunk * ws, K,
              chunks, round_partials_bf16, ldy, ychunk, 0};
    /* Folded chunks run chunk by chunk inside each task (y holds the running fold between them):
     * the same additions in the same order, with one chunk's rows of w in cache at a time. */
    int chunk_outer = chunks > 1 && !ychunk;
    geom one = g;
    one.chunks = 1;
    int vector = !force_portable && rowdot_vector_path();
    int64_t ntasks = ceil_div(N, NBLOCK), mtasks = ceil_div(M, MBLOCK);
    int64_t tasks = ntasks * mtasks;
    threads = team(threads, tasks);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) { /* weight-block-major: a thread's next task reuses the rows of w in cache */
        int64_t nt = t / mtasks, mt = t % mtasks;
        int64_t n0 = nt * NBLOCK, n1 = n0 + NBLOCK < N ? n0 + NBLOCK : N;
        int64_t m0 = mt * MBLOCK, m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
        for (int ch = 0; ch < (chunk_outer ? chunks : 1); ch++) {
            geom gc = one;
            gc.accumulate = ch > 0;
            const char *xc = (const char *)x + ch * g.xchunk, *wc = (const char *)w + ch * g.wchunk;
            dot_block(xc, x_bf16, wc, w_bf16, y, chunk_outer ? &gc : &g, vector, m0, m1, n0, n1);
        }
    }
}

/* A group of weights applied to one x in one parallel region (the projections of one input: q/k/v,
 * gate/up). meta holds 4 * nw int64: the weights' addresses, their row strides, their row counts
 * ns and the outputs' addresses. Weight s is [ns[s], K] (all fp32, or all bf16); its output is
 * [M, ns[s]] fp32, contiguous. Every element is computed exactly as above, so each output has the
 * bits of its own rowdot_chunked call (one chunk); the group only shares the fork and join, and
 * gives the threads the weights' rows as one list of tasks. At most ROWDOT_GROUP weights; returns
 * -1 (computing nothing) for more. */
#define ROWDOT_GROUP 8

int rowdot_group(const void *x, int x_bf16, int64_t ldx, int64_t K, int nw, const int64_t *meta, int w_bf16,
                 int64_t M, int threads, int force_portable) {
    if (nw < 0 || nw > ROWDOT_GROUP) return -1;
    const int64_t *ldw = meta + nw, *ns = meta + 2 * nw;
    size_t xs = x_bf16 ? 2 : 4, wsz = w_bf16 ? 2 : 4;
    int64_t mtasks = ceil_div(M, MBLOCK), first[ROWDOT_GROUP + 1];
    int64_t tasks = group_tasks(nw, ns, NBLOCK, mtasks, first);
    if (tasks == 0) return 0;
    int vector = !force_portable && rowdot_vector_path();
    threads = team(threads, tasks);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        int s = task_weight(first, t);
        int64_t local = t - first[s];
        int64_t nt = local / mtasks, mt = local % mtasks; /* weight-block-major, as rowdot_chunked */
        int64_t n0 = nt * NBLOCK, n1 = n0 + NBLOCK < ns[s] ? n0 + NBLOCK : ns[s];
        int64_t m0 = mt * MBLOCK, m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
        geom g = {(size_t)ldx * xs, (size_t)ldw[s] * wsz, 0, 0, K, 1, 0, ns[s], 0, 0};
        const char *w = (const char *)(intptr_t)meta[s];
        float *y = (float *)(intptr_t)meta[3 * nw + s];
        dot_block((const char *)x, x_bf16, w, w_bf16, y, &g, vector, m0, m1, n0, n1);
    }
    return 0;
}

/* Packed weights, for rows of x few enough to share every weight tile (decode): tiles of 8 rows
 * (N padded with zero rows to a multiple of 8) whose bytes are contiguous, one sequential stream
 * per tile instead of 8 short row streams. In a tile, chunk by chunk:
 *  - fp32 (K % 8 == 0): block b of the chunk (elements k = 8b .. 8b+7), row by row, 8 floats;
 *  - bf16, pair-packed (K % 16 == 0): pair p of blocks (k = 16p .. 16p+15), row by row, 8 uint32
 *    words, word j = w[k + j] | w[k + 8 + j] << 16: one 256-bit load holds two blocks of a row whose
 *    fp32 lanes come out in rowdot's lane order with one shift (block 2p) and one mask (2p + 1).
 * Each row's lane j accumulates the blocks in order with the same FMAs as rowdot, then the same lane
 * tree; partials are rounded and folded as rowdot_chunked does: the same bits. AVX2 only (the
 * caller packs only where rowdot_vector_path() holds). */
#define PACK_TILE 8
#define PACKED_TASK 12 /* tiles per parallel task (96 rows, as NBLOCK) */

/* packs rows [0, N) of w (row stride ldw elements; bf16 when w_bf16, else fp32) into out
 * (ceil(N / 8) tiles of chunks * K * 8 elements' bytes; the padding rows zero) */
void rowdot_pack(const void *w, int w_bf16, int64_t ldw, int64_t N, int chunks, int64_t K, void *out) {
    int64_t step = w_bf16 ? 16 : LANES, steps = K / step, tiles = ceil_div(N, PACK_TILE);
    for (int64_t t = 0; t < tiles; t++)
        for (int c = 0; c < chunks; c++)
            for (int64_t p = 0; p < steps; p++)
                for (int r = 0; r < PACK_TILE; r++) {
                    int64_t n = t * PACK_TILE + r, at = (((t * chunks + c) * steps + p) * PACK_TILE + r) * LANES;
                    int64_t src = n * ldw + c * K + p * step;
                    for (int j = 0; j < LANES; j++) {
                        if (w_bf16) {
                            const uint16_t *q = (const uint16_t *)w + src;
                            ((uint32_t *)out)[at + j] = n < N ? (uint32_t)q[j] | (uint32_t)q[j + LANES] << 16 : 0u;
                        } else {
                            ((float *)out)[at + j] = n < N ? ((const float *)w)[src + j] : 0.0f;
                        }
                    }
                }
}

#ifdef NATIVE_X86
/* rows m0..m1 of x against packed tile `tile`: y[m, r] for the tile's valid rows */
AVX2_INLINE static void packed_tile(const char *x, int xb, size_t xrow, const char *tile, int wb, int chunks,
                                    int64_t K, int rows, int round_partials, float *y, int64_t ldy, int64_t m0,
                                    int64_t m1) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t step = wb ? 16 : LANES, steps = K / step;
    const size_t chunk_bytes = (size_t)K * PACK_TILE * (wb ? 2 : 4), step_bytes = PACK_TILE * 32;
    for (int64_t m = m0; m < m1; m++) {
        const char *xm = x + m * xrow;
        float total[PACK_TILE] = {0};
        for (int c = 0; c < chunks; c++) {
            const char *wc = tile + c * chunk_bytes;
            __m256 acc[PACK_TILE];
            for (int r = 0; r < PACK_TILE; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t p = 0; p < steps; p++) {
                int64_t k = c * K + step * p;
                const char *wp = wc + p * step_bytes;
                __m256 xa = load8(xm, xb, k);
                if (wb) {
                    __m256 xc = load8(xm, xb, k + LANES);
                    for (int r = 0; r < PACK_TILE; r++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(wp + r * 32));
                        acc[r] = _mm256_fmadd_ps(xa, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc[r]);
                        acc[r] = _mm256_fmadd_ps(xc, _mm256_castsi256_ps(_mm256_and_si256(v, hi)), acc[r]);
                    }
                } else {
                    for (int r = 0; r < PACK_TILE; r++)
                        acc[r] = _mm256_fmadd_ps(xa, _mm256_loadu_ps((const float *)(wp + r * 32)), acc[r]);
                }
            }
            for (int r = 0; r < PACK_TILE; r++) {
                float part = hsum(acc[r]);
                if (round_partials) part = round_bf16(part);
                total[r] = c ? total[r] + part : part;
            }
        }
        for (int r = 0; r < rows; r++) y[m * ldy + r] = total[r];
    }
}

#define PACKED_TILE(XB, WB)                                                                        \
    AVX2 static void packed_tile_##XB##WB(const char *x, size_t xrow, const char *tile, int chunks,  \
                                          int64_t K, int rows, int round_partials, float *y,         \
                                          int64_t ldy, int64_t m0, int64_t m1) {                     \
        packed_tile(x, XB, xrow, tile, WB, chunks, K, rows, round_partials, y, ldy, m0, m1);       \
    }
PACKED_TILE(0, 0)
PACKED_TILE(0, 1)
PACKED_TILE(1, 0)
PACKED_TILE(1, 1)
#endif

/* y_s [M, ns[s]] (fp32, row stride ns[s]) = x [M, chunks*K] against packed weight s (all bf16
 * pair-packed when w_bf16, else all fp32), with rowdot_chunked's bits (chunks folded; each partial
 * rounded to bf16 when round_partials). meta holds 3 * nw int64: the packed weights' addresses,
 * their row counts ns and the outputs' addresses. The threads share every weight's tasks (12 tiles
 * each) as one list. Returns -1 (computing nothing) without the AVX2 path, for a K the layout does
 * not take, or for more than ROWDOT_GROUP weights. */
int rowdot_packed(const void *x, int x_bf16, int64_t ldx, int chunks, int64_t K, int nw, const int64_t *meta,
                  int w_bf16, int round_partials, int64_t M, int threads) {
#ifdef NATIVE_X86
    if (nw < 0 || nw > ROWDOT_GROUP || K % (w_bf16 ? 16 : LANES) || !rowdot_vector_path()) return -1;
    const int64_t *ns = meta + nw;
    int64_t first[ROWDOT_GROUP + 1];
    int64_t tasks = group_tasks(nw, ns, PACK_TILE * PACKED_TASK, 1, first);
    if (tasks == 0 || M == 0) return 0;
    size_t xrow = (size_t)ldx * (x_bf16 ? 2 : 4), tile_bytes = (size_t)chunks * K * PACK_TILE * (w_bf16 ? 2 : 4);
    void (*run)(const char *, size_t, const char *, int, int64_t, int, int, float *, int64_t, int64_t, int64_t) =
        x_bf16 ? (w_bf16 ? packed_tile_11 : packed_tile_10) : (w_bf16 ? packed_tile_01 : packed_tile_00);
    threads = team(threads, tasks);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        int s = task_weight(first, t);
        int64_t n = ns[s], tiles = ceil_div(n, PACK_TILE), t0 = (t - first[s]) * PACKED_TASK;
        int64_t t1 = t0 + PACKED_TASK < tiles ? t0 + PACKED_TASK : tiles;
        const char *w = (const char *)(intptr_t)meta[s];
        float *y = (float *)(intptr_t)meta[2 * nw + s];
        for (int64_t i = t0; i < t1; i++) {
            int rows = n - i * PACK_TILE < PACK_TILE ? (int)(n - i * PACK_TILE) : PACK_TILE;
            run((const char *)x, xrow, w + i * tile_bytes, chunks, K, rows, round_partials, y + i * PACK_TILE, n, 0,
                M);
        }
    }
    return 0;
#else
    (void)x, (void)x_bf16, (void)ldx, (void)chunks, (void)K, (void)nw, (void)meta, (void)w_bf16, (void)round_partials,
        (void)M, (void)threads;
    return -1;
#endif
}
