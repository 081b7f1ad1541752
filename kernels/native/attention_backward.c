/* attention_backward: the gradient of attention_rows (attention.c) for fp32 operands, in one call.
 *
 * Gradients carry no bitwise contract, but this one is deterministic: one task per (sequence s,
 * query head h) owns its outputs, and visits the sequence's query rows in the order given. For
 * query row n (position p = pos[n]) of s and head h (KV head h / (Hq / Hkv)), over positions
 * j = 0..p of storage rows idx[s, kvh, j]:
 *
 *   P_j   = softmax_j(dot(q, k_j) * scale)       (recomputed, with the kernels' exp_)
 *   delta = dot(grad, out)                       (= sum_j P_j dot(grad, v_j))
 *   dS_j  = P_j * (dot(grad, v_j) - delta) * scale
 *   dq    = sum_j dS_j k_j                       -> dq [N, Hq, D]
 *   dk_j += dS_j q,  dv_j += P_j grad            -> dk, dv [S, Hq, L, D] (positions 0..lens[s]-1)
 *
 * The caller sums dk/dv over the query heads of each KV head and adds them into the storage rows.
 * The portable task sums dot products in 8 lanes and rowdot's lane tree; the AVX2 task (D a
 * multiple of 8) with FMAs, four positions at a time, and updates dk/dv for BR query rows at once.
 * Each is deterministic on its own; they may differ from each other in the last bits. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define BR 4 /* query rows per block in the AVX2 task */

typedef struct {
    const float *q, *k, *v, *grad, *out; /* q, grad, out [N, Hq, D]; k, v: storage rows of D */
    const int64_t *idx;                  /* [S, Hkv, L] */
    int64_t L;
    const int64_t *pos, *order, *starts, *lens; /* pos [N]; rows of s: order[starts[s]..starts[s+1]) */
    int Hq, Hkv, D;
    float scale;
    float *dq, *dk, *dv;
} bwd;

/* portable task: dot products in 8 lanes and rowdot's lane tree, one row at a time */
static float dot_lanes(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    int k = 0;
    for (; k + LANES <= d; k += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[k + j] * b[k + j];
    for (; k < d; k++) acc[k % LANES] += a[k] * b[k];
    return lane_sum(acc);
}

static void axpy(float *y, float a, const float *x, int d) {
    for (int k = 0; k < d; k++) y[k] += a * x[k];
}

static void task_portable(const bwd *b, int64_t s, int h, float *sc) {
    int D = b->D, kvh = h / (b->Hq / b->Hkv);
    int64_t len = b->lens[s];
    float *dk = b->dk + ((s * b->Hq + h) * b->L) * D, *dv = b->dv + ((s * b->Hq + h) * b->L) * D;
    memset(dk, 0, sizeof(float) * (size_t)(len * D));
    memset(dv, 0, sizeof(float) * (size_t)(len * D));
    const int64_t *ix = b->idx + (s * b->Hkv + kvh) * b->L;
    for (int64_t r = b->starts[s]; r < b->starts[s + 1]; r++) {
        int64_t n = b->order[r], p = b->pos[n], at = (n * b->Hq + h) * D;
        const float *q = b->q + at, *g = b->grad + at;
        float *dq = b->dq + at, m = -INFINITY, l = 0.0f;
        for (int64_t j = 0; j <= p; j++) {
            sc[j] = dot_lanes(q, b->k + ix[j] * D, D) * b->scale;
            m = sc[j] > m ? sc[j] : m;
        }
        for (int64_t j = 0; j <= p; j++) {
            sc[j] = exp_portable(sc[j] - m);
            l += sc[j];
        }
        float inv = 1.0f / l, delta = dot_lanes(g, b->out + at, D);
        memset(dq, 0, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j <= p; j++) {
            const float *kj = b->k + ix[j] * D, *vj = b->v + ix[j] * D;
            float pj = sc[j] * inv, ds = pj * (dot_lanes(g, vj, D) - delta) * b->scale;
            axpy(dq, ds, kj, D);
            axpy(dk + j * D, ds, q, D);
            axpy(dv + j * D, pj, g, D);
        }
    }
}

#ifdef NATIVE_X86
/* The AVX2 task for D a multiple of 8: the same steps, with the dot products of four positions at a
 * time in four independent FMA chains (a lone chain waits on each FMA's latency). */
AVX2_INLINE static __m256 fma_row(const float *a, const float *b, int d, __m256 acc) {
    for (int k = 0; k < d; k += LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    return acc;
}

/* out[j] = dot(x, rows[ix[j]]) * mul for j = 0..p */
AVX2_INLINE static void dots(const float *x, const float *base, const int64_t *ix, int64_t p, int d, float mul,
                             float *out) {
    int64_t j = 0;
    for (; j + 4 <= p + 1; j += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        a0 = fma_row(x, base + ix[j] * d, d, a0);
        a1 = fma_row(x, base + ix[j + 1] * d, d, a1);
        a2 = fma_row(x, base + ix[j + 2] * d, d, a2);
        a3 = fma_row(x, base + ix[j + 3] * d, d, a3);
        out[j] = hsum(a0) * mul, out[j + 1] = hsum(a1) * mul, out[j + 2] = hsum(a2) * mul, out[j + 3] = hsum(a3) * mul;
    }
    for (; j <= p; j++) out[j] = hsum(fma_row(x, base + ix[j] * d, d, _mm256_setzero_ps())) * mul;
}

/* y[d] = (add ? y[d] : 0) + sum_i c[i * cs] * x_i[d] over i < n, where row x_i is base + ix[i] * D
 * (ix given) or rows[i]; D a multiple of 8, 32 elements at a time in four registers. */
AVX2_INLINE static void sum_rows(float *y, int add, const float *base, const int64_t *ix, const float *const *rows,
                                 const float *c, int64_t cs, int64_t n, int D) {
    int d = 0;
    for (; d + 4 * LANES <= D; d += 4 * LANES) {
        __m256 a[4];
        for (int u = 0; u < 4; u++) a[u] = add ? _mm256_loadu_ps(y + d + u * LANES) : _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const float *x = (ix ? base + ix[i] * D : rows[i]) + d;
            __m256 ci = _mm256_set1_ps(c[i * cs]);
            for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(ci, _mm256_loadu_ps(x + u * LANES), a[u]);
        }
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(y + d + u * LANES, a[u]);
    }
    for (; d < D; d += LANES) {
        __m256 a = add ? _mm256_loadu_ps(y + d) : _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(c[i * cs]), _mm256_loadu_ps((ix ? base + ix[i] * D : rows[i]) + d), a);
        _mm256_storeu_ps(y + d, a);
    }
}

/* The AVX2 task takes its sequence's query rows BR at a time: each row's softmax P and dS are
 * computed into scratch, dq is one register-held sum over the positions, and each position's dk/dv
 * row is loaded and stored once per block, taking the block's rows that read it in order (the same
 * FMAs in the same order as one row at a time). */

AVX2 static void task_avx2(const bwd *b, int64_t s, int h, float *sc) {
    int D = b->D, kvh = h / (b->Hq / b->Hkv);
    int64_t L = b->L, len = b->lens[s];
    float *dk = b->dk + ((s * b->Hq + h) * L) * D, *dv = b->dv + ((s * b->Hq + h) * L) * D;
    float *P = sc, *dS = sc + BR * L; /* [BR][L] each */
    memset(dk, 0, sizeof(float) * (size_t)(len * D));
    memset(dv, 0, sizeof(float) * (size_t)(len * D));
    const int64_t *ix = b->idx + (s * b->Hkv + kvh) * L;
    for (int64_t r0 = b->starts[s]; r0 < b->starts[s + 1]; r0 += BR) {
        int nb = b->starts[s + 1] - r0 < BR ? (int)(b->starts[s + 1] - r0) : BR;
        int64_t pmax = 0, ps[BR];
        const float *qs[BR], *gs[BR];
        for (int i = 0; i < nb; i++) {
            int64_t n = b->order[r0 + i], p = b->pos[n], at = (n * b->Hq + h) * D;
            float *Pi = P + i * L, *dSi = dS + i * L, m = -INFINITY;
            ps[i] = p, qs[i] = b->q + at, gs[i] = b->grad + at;
            pmax = p > pmax ? p : pmax;
            dots(qs[i], b->k, ix, p, D, b->scale, Pi);
            dots(gs[i], b->v, ix, p, D, 1.0f, dSi); /* dot(grad, v_j) for now */
            for (int64_t j = 0; j <= p; j++) m = Pi[j] > m ? Pi[j] : m;
            __m256 mv = _mm256_set1_ps(m), lv = _mm256_setzero_ps();
            int64_t j = 0;
            float l;
            for (; j + LANES <= p + 1; j += LANES) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(Pi + j), mv));
                _mm256_storeu_ps(Pi + j, e);
                lv = _mm256_add_ps(lv, e);
            }
            l = hsum(lv);
            for (; j <= p; j++) {
                Pi[j] = exp_portable(Pi[j] - m);
                l += Pi[j];
            }
            float inv = 1.0f / l, delta = hsum(fma_row(gs[i], b->out + at, D, _mm256_setzero_ps()));
            for (j = 0; j <= p; j++) {
                Pi[j] *= inv;
                dSi[j] = Pi[j] * (dSi[j] - delta) * b->scale;
            }
            sum_rows(b->dq + at, 0, b->k, ix, NULL, dSi, 1, p + 1, D);
        }
        for (int64_t j = 0; j <= pmax; j++) { /* the block's rows that read position j, in order */
            const float *qa[BR], *ga[BR];
            float ca[BR], pa[BR];
            int na = 0;
            for (int i = 0; i < nb; i++)
                if (ps[i] >= j) qa[na] = qs[i], ga[na] = gs[i], ca[na] = dS[i * L + j], pa[na++] = P[i * L + j];
            sum_rows(dk + j * D, 1, NULL, NULL, qa, ca, 1, na, D);
            sum_rows(dv + j * D, 1, NULL, NULL, ga, pa, 1, na, D);
        }
    }
}
#endif

/* q, grad, out: fp32 [N, Hq, D] contiguous; k, v: fp32 storage rows of D (contiguous); idx
 * [S, Hkv, L]; pos [N]; order: the query rows grouped by sequence, sequence s's at
 * order[starts[s]..starts[s+1]); lens[s]: positions of s any of its rows reads (max pos + 1, at
 * most L). dq [N, Hq, D]; dk, dv [S, Hq, L, D] (positions >= lens[s] are left as they are).
 * Returns 0, or -1 when scratch memory could not be allocated. */
int attention_backward_rows(const float *q, const float *k, const float *v, const float *grad, const float *out,
                            const int64_t *idx, int64_t L, const int64_t *pos, const int64_t *order,
                            const int64_t *starts, const int64_t *lens, int64_t S, int Hq, int Hkv, int D,
                            float scale, float *dq, float *dk, float *dv, int threads) {
    bwd b = {q, k, v, grad, out, idx, L, pos, order, starts, lens, Hq, Hkv, D, scale, dq, dk, dv};
    int64_t tasks = S * Hq;
    if (threads < 1) threads = 1;
    if (tasks < threads) threads = (int)(tasks > 0 ? tasks : 1);
    int64_t per = 2 * BR * (L > 0 ? L : 1); /* the AVX2 task's P and dS of BR rows (the portable one: L) */
    float *buf = malloc(sizeof(float) * (size_t)(per * threads));
    if (!buf) return -1;
    int vector = native_vector_path() && D % LANES == 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *sc = buf + per * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
#ifdef NATIVE_X86
            if (vector) {
                task_avx2(&b, t / Hq, (int)(t % Hq), sc);
                continue;
            }
#endif
            task_portable(&b, t / Hq, (int)(t % Hq), sc);
        }
    }
    (void)vector;
    free(buf);
    return 0;
}
