/* A candidate order for the reference linear, measured by bench/gemm.py (not the contract's kernel,
 * which is kernels/cpu/rowdot.c): y[m, n] = ONE fused multiply-add chain over k = 0 .. K-1 in
 * order, starting from +0. The chain does not depend on M, N, the tile or the threads, so the
 * vector and portable paths give the same bits (checked by the benchmark before it times anything).
 *
 * The AVX2 path is an outer-product GEMM in the BLIS style: vectorised over N, every task (NB
 * columns x MB rows) packs its rows of w into K-major panels of PANEL columns, KC values of k at a
 * time (bf16 widened exactly), packs MR rows of x the same way, and runs an MR x PANEL register
 * tile (12 accumulators) whose accumulators go to a task-local fp32 tile between K blocks (an exact
 * store and reload, so the chain is unbroken). A decode step's few rows read a copy of w packed once
 * (outer_pack: fp32 panels, or bf16 pairs over N: word j holds columns j and j + 8) with 4 panels
 * (8 accumulators) per pass. x is fp32; y is fp32 [M, N] with row stride ldy.
 * Compile with -ffp-contract=off and without -ffast-math. */
#include <stdlib.h>
#include <string.h>

#include "../kernels/cpu/native.h"

#define PANEL 16 /* columns of w per packed panel (two 8-lane vectors) */
#define MR 6     /* rows of x per register tile */
#define KC 192   /* values of k per packed block */
#define NB 192   /* columns per task (a multiple of PANEL) */
#define MB 288   /* rows per task (a multiple of MR) */

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Portable path: the same chain, one element at a time. */
void outer_gemm_portable(const float *x, int64_t ldx, const char *w, int wb, int64_t ldw, int64_t K, float *y,
                         int64_t ldy, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[m * ldx + k], load1(w, wb, n * ldw + k), acc);
            y[m * ldy + n] = acc;
        }
}

#ifdef NATIVE_X86
/* An R x (16 P) register tile over kc values of k: a [kc][MR] packed rows of x, b P panels [kc][16]
 * (bstride floats apart); c the fp32 tile (row stride ldc), started from +0 when `first`. */
#define MICRO(NAME, R, P)                                                                            \
    AVX2_INLINE static void NAME(const float *a, const float *b, int64_t bstride, int64_t kc, float *c,    \
                                 int64_t ldc, int first) {                                           \
        __m256 acc[R][2 * P];                                                                        \
        for (int r = 0; r < R; r++)                                                                  \
            for (int j = 0; j < 2 * P; j++)                                                          \
                acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8 * j);      \
        for (int64_t k = 0; k < kc; k++) {                                                           \
            __m256 bv[2 * P];                                                                        \
            for (int p = 0; p < P; p++) {                                                            \
                bv[2 * p] = _mm256_loadu_ps(b + p * bstride + k * PANEL);                            \
                bv[2 * p + 1] = _mm256_loadu_ps(b + p * bstride + k * PANEL + 8);                    \
            }                                                                                        \
            for (int r = 0; r < R; r++) {                                                            \
                __m256 av = _mm256_broadcast_ss(a + k * MR + r);                                     \
                for (int j = 0; j < 2 * P; j++) acc[r][j] = _mm256_fmadd_ps(av, bv[j], acc[r][j]);   \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int j = 0; j < 2 * P; j++) _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);        \
    }
MICRO(micro_6x1, 6, 1)
MICRO(micro_5x1, 5, 1)
MICRO(micro_4x1, 4, 1)
MICRO(micro_3x1, 3, 1)
MICRO(micro_2x1, 2, 1)
MICRO(micro_1x1, 1, 1)
MICRO(micro_1x4, 1, 4)
MICRO(micro_2x3, 2, 3)
MICRO(micro_3x2, 3, 2)

AVX2_INLINE static void micro_rows(int r, const float *a, const float *b, int64_t kc, float *c, int64_t ldc,
                                   int first) {
    switch (r) {
    case 6: micro_6x1(a, b, 0, kc, c, ldc, first); break;
    case 5: micro_5x1(a, b, 0, kc, c, ldc, first); break;
    case 4: micro_4x1(a, b, 0, kc, c, ldc, first); break;
    case 3: micro_3x1(a, b, 0, kc, c, ldc, first); break;
    case 2: micro_2x1(a, b, 0, kc, c, ldc, first); break;
    default: micro_1x1(a, b, 0, kc, c, ldc, first); break;
    }
}

/* 8x8 transpose of rows r[0..7] */
AVX2_INLINE static void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* pack rows n0..n0+rows-1 (rows<=16) of w, k0..k0+kc-1, into panel [kc][16] fp32 */
AVX2_INLINE static void pack_panel(const char *w, int wb, int64_t ldw, int64_t n0, int rows, int64_t k0, int64_t kc,
                                   float *out) {
    int64_t k = 0;
    if (rows == PANEL) {
        for (; k + 8 <= kc; k += 8)
            for (int h = 0; h < 2; h++) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = load8(w + (n0 + 8 * h + i) * ldw * (wb ? 2 : 4), wb, k0 + k);
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + (k + i) * PANEL + 8 * h, r[i]);
            }
    }
    for (; k < kc; k++)
        for (int i = 0; i < PANEL; i++)
            out[k * PANEL + i] = i < rows ? load1(w, wb, (n0 + i) * ldw + k0 + k) : 0.0f;
}

/* pack rows m0..m0+r-1 of x, k0..k0+kc-1, as [kc][MR] */
static inline void pack_a(const float *x, int64_t ldx, int64_t m0, int r, int64_t k0, int64_t kc, float *out) {
    for (int i = 0; i < r; i++)
        for (int64_t k = 0; k < kc; k++) out[k * MR + i] = x[(m0 + i) * ldx + k0 + k];
}

AVX2_INLINE static void gemm_task(const float *x, int64_t ldx, const char *w, int wb, int64_t ldw, int64_t K,
                                  float *y, int64_t ldy, int64_t m0, int64_t m1, int64_t n0, int64_t n1, float *bbuf,
                                  float *abuf, float *ctile) {
    int64_t np = cdiv(n1 - n0, PANEL);
    if (K == 0) memset(ctile, 0, (size_t)(m1 - m0) * NB * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = min64(KC, K - k0);
        for (int64_t p = 0; p < np; p++)
            pack_panel(w, wb, ldw, n0 + p * PANEL, (int)min64(PANEL, n1 - n0 - p * PANEL), k0, kc, bbuf + p * kc * PANEL);
        for (int64_t m = m0; m < m1; m += MR) {
            int r = (int)min64(MR, m1 - m);
            pack_a(x, ldx, m, r, k0, kc, abuf);
            int64_t p = 0;
            int64_t bs = kc * PANEL;
            float *cc = ctile + (m - m0) * NB;
            if (r == 1) for (; p + 4 <= np; p += 4) micro_1x4(abuf, bbuf + p * bs, bs, kc, cc + p * PANEL, NB, k0 == 0);
            if (r == 2) for (; p + 3 <= np; p += 3) micro_2x3(abuf, bbuf + p * bs, bs, kc, cc + p * PANEL, NB, k0 == 0);
            if (r == 3) for (; p + 2 <= np; p += 2) micro_3x2(abuf, bbuf + p * bs, bs, kc, cc + p * PANEL, NB, k0 == 0);
            for (; p < np; p++)
                micro_rows(r, abuf, bbuf + p * bs, kc, cc + p * PANEL, NB, k0 == 0);
        }
    }
    for (int64_t m = m0; m < m1; m++) memcpy(y + m * ldy + n0, ctile + (m - m0) * NB, (n1 - n0) * 4);
}

#define GEMM_TASK(WB)                                                                                \
    AVX2 static void gemm_task_##WB(const float *x, int64_t ldx, const char *w, int64_t ldw, int64_t K, float *y, \
                                    int64_t ldy, int64_t m0, int64_t m1, int64_t n0, int64_t n1, float *bb,   \
                                    float *ab, float *ct) {                                          \
        gemm_task(x, ldx, w, WB, ldw, K, y, ldy, m0, m1, n0, n1, bb, ab, ct);                        \
    }
GEMM_TASK(0)
GEMM_TASK(1)

/* y [M, N] = the chains of x [M, K] (fp32) and w [N, K] (bf16 when wb) on the AVX2 path; tasks of
 * NB columns x (at most) MB rows over `threads` threads. Returns -1 when scratch memory is short. */
int outer_gemm_avx2(const float *x, int64_t ldx, const char *w, int wb, int64_t ldw, int64_t K, float *y,
                    int64_t ldy, int64_t M, int64_t N, int threads) {
    /* rows per task: MB, halved (to a multiple of MR) while there are fewer than two tasks per thread */
    int64_t mb = MB;
    while (cdiv(N, NB) * cdiv(M, mb) < 2 * (int64_t)threads && mb > 4 * MR) mb = cdiv(mb / 2, MR) * MR;
    int64_t mtasks = cdiv(M, mb), tasks = cdiv(N, NB) * mtasks;
    int failed = 0;
    if (tasks == 0) return 0;
    if (threads > tasks) threads = (int)tasks;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *bb = aligned_alloc(64, NB * KC * 4), *ab = aligned_alloc(64, KC * MR * 4),
              *ct = aligned_alloc(64, (size_t)MB * NB * 4);
        failed = !bb || !ab || !ct;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t nt = t / mtasks, mt = t % mtasks;
            int64_t n0 = nt * NB, n1 = min64(n0 + NB, N), m0 = mt * mb, m1 = min64(m0 + mb, M);
            if (!failed) (wb ? gemm_task_1 : gemm_task_0)(x, ldx, w, ldw, K, y, ldy, m0, m1, n0, n1, bb, ab, ct);
        }
        free(bb), free(ab), free(ct);
    }
    return failed ? -1 : 0;
}

#endif

/* w [N, K] (bf16 when wb) packed for outer_gemv_packed: ceil(N / 16) panels of K x 16 fp32, or of K x 8
 * uint32 words (bf16: word j = column j | column j + 8 << 16); columns past N are zero. */
void outer_pack(const char *w, int wb, int64_t ldw, int64_t N, int64_t K, void *out) {
    int64_t np = cdiv(N, PANEL);
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < (wb ? 8 : 16); j++) {
                int64_t n = p * PANEL + j;
                if (wb) {
                    const uint16_t *q = (const uint16_t *)w;
                    uint32_t lo = n < N ? q[n * ldw + k] : 0, hi = n + 8 < N ? q[(n + 8) * ldw + k] : 0;
                    ((uint32_t *)out)[(p * K + k) * 8 + j] = lo | hi << 16;
                } else {
                    ((float *)out)[(p * K + k) * 16 + j] = n < N ? ((const float *)w)[n * ldw + k] : 0.0f;
                }
            }
}

#ifdef NATIVE_X86
/* one row of x against P packed panels: 16 P columns, all K */
#define GEMV(NAME, P, WB)                                                                            \
    AVX2_INLINE static void NAME(const float *xr, const char *panels, int64_t K, float *c) {         \
        __m256 acc[2 * P];                                                                           \
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);                                      \
        for (int j = 0; j < 2 * P; j++) acc[j] = _mm256_setzero_ps();                                \
        for (int64_t k = 0; k < K; k++) {                                                            \
            __m256 av = _mm256_broadcast_ss(xr + k);                                                 \
            for (int p = 0; p < P; p++) {                                                            \
                __m256 b0, b1;                                                                       \
                if (WB) {                                                                            \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(panels + (p * K + k) * 32));     \
                    b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                              \
                    b1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));                               \
                } else {                                                                             \
                    b0 = _mm256_loadu_ps((const float *)(panels + (p * K + k) * 64));                \
                    b1 = _mm256_loadu_ps((const float *)(panels + (p * K + k) * 64 + 32));           \
                }                                                                                    \
                acc[2 * p] = _mm256_fmadd_ps(av, b0, acc[2 * p]);                                    \
                acc[2 * p + 1] = _mm256_fmadd_ps(av, b1, acc[2 * p + 1]);                            \
            }                                                                                        \
        }                                                                                            \
        for (int j = 0; j < 2 * P; j++) _mm256_storeu_ps(c + 8 * j, acc[j]);                         \
    }
GEMV(gemv4_f32, 4, 0)
GEMV(gemv4_bf16, 4, 1)
GEMV(gemv1_f32, 1, 0)
GEMV(gemv1_bf16, 1, 1)

/* y [M, N] from the packed copy, one row of x at a time (a decode step's few rows); 6 panels per task */
AVX2 void outer_gemv_packed(const float *x, int64_t ldx, const char *packed, int wb, int64_t K, float *y,
                            int64_t ldy, int64_t M, int64_t N, int threads) {
    int64_t np = cdiv(N, PANEL), pb = (int64_t)K * (wb ? 32 : 64), tasks = cdiv(np, 6);
    if (tasks == 0 || M == 0) return;
    if (threads > tasks) threads = (int)tasks;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        float c[96];
        int64_t p0 = t * 6, p1 = min64(p0 + 6, np);
        for (int64_t m = 0; m < M; m++) {
            int64_t p = p0;
            for (; p + 4 <= p1; p += 4) (wb ? gemv4_bf16 : gemv4_f32)(x + m * ldx, packed + p * pb, K, c + (p - p0) * 16);
            for (; p < p1; p++) (wb ? gemv1_bf16 : gemv1_f32)(x + m * ldx, packed + p * pb, K, c + (p - p0) * 16);
            int64_t n0 = p0 * 16, n1 = min64(p1 * 16, N);
            memcpy(y + m * ldy + n0, c, (n1 - n0) * 4);
        }
    }
}
#endif
