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
 * The portable task sums dot products in 8 lanes and rowdot's lane tree, one row at a time; the
 * AVX2 task (D a multiple of 8) runs the same steps as small GEMMs on register tiles (see below).
 * Each is deterministic on its own; they may differ from each other in the last bits. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define BQ 16 /* query rows per block in the AVX2 task */
#define TJ 16 /* positions per S / dP tile in the AVX2 task (two vectors) */

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
/* The AVX2 task for D a multiple of 8, as small GEMMs on register tiles. Per task it lays the K and
 * V rows it reads out transposed (KT, VT [D][Lp], zero-padded to Lp, a multiple of TJ positions),
 * then takes its sequence's query rows BQ at a time:
 *   S  = Q KT, dP = G VT        4 rows x TJ positions per tile, over d (positions past a row's p
 *                               are computed and then ignored: P and dS are set to 0 there);
 *   P, dS per row               (softmax over j <= p with exp8, delta = dot(grad, out));
 *   dq = dS K                   4 rows x 16 columns per tile, positions in order, each row only
 *                               over its own j <= p;
 *   dk_j += dS^T Q, dv_j += P^T G   4 positions x 16 columns per tile, the block's rows in order,
 *                               each row only into the positions it read (a non-finite row never
 *                               reaches another position as 0 * inf). */
AVX2_INLINE static __m256 fma_row(const float *a, const float *b, int d, __m256 acc) {
    for (int k = 0; k < d; k += LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    return acc;
}

/* The tiles below keep their 8 accumulators in named registers (an indexed array would live on
 * the stack); ACC(u) is row / position u's pair, over 16 columns (the second only when NV == 2). */
#define ACC_ZERO(u) __m256 a##u##0 = _mm256_setzero_ps(), a##u##1 = a##u##0
#define ACC_FMA(u, b) (a##u##0 = _mm256_fmadd_ps(b, r0, a##u##0), a##u##1 = NV > 1 ? _mm256_fmadd_ps(b, r1, a##u##1) : a##u##1)
#define ACC_LOAD(u, p) (a##u##0 = _mm256_loadu_ps(p), a##u##1 = NV > 1 ? _mm256_loadu_ps((p) + LANES) : a##u##1)
#define ACC_STORE(u, p) (_mm256_storeu_ps(p, a##u##0), NV > 1 ? _mm256_storeu_ps((p) + LANES, a##u##1) : (void)0)

/* out[u * ldo + j .. + TJ) = sum_d x[u][d] * T[d * ldt + j .. + TJ) for u < nr (x[nr..3] are
 * stand-ins, computed and not stored); r0/r1 are T's two vectors, broadcasts of x the multipliers */
AVX2_INLINE static void xt_tile(const float *const x[4], int nr, const float *T, int64_t ldt, int D, int64_t j,
                                float *out, int64_t ldo) {
    enum { NV = 2 };
    ACC_ZERO(0); ACC_ZERO(1); ACC_ZERO(2); ACC_ZERO(3);
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    for (int d = 0; d < D; d++) {
        const float *t = T + d * ldt + j;
        __m256 r0 = _mm256_loadu_ps(t), r1 = _mm256_loadu_ps(t + LANES);
        ACC_FMA(0, _mm256_broadcast_ss(x0 + d));
        ACC_FMA(1, _mm256_broadcast_ss(x1 + d));
        ACC_FMA(2, _mm256_broadcast_ss(x2 + d));
        ACC_FMA(3, _mm256_broadcast_ss(x3 + d));
    }
    out += j;
    ACC_STORE(0, out);
    if (nr > 1) ACC_STORE(1, out + ldo);
    if (nr > 2) ACC_STORE(2, out + 2 * ldo);
    if (nr > 3) ACC_STORE(3, out + 3 * ldo);
}

/* y[u][d0 .. d0 + 8 NV) = sum_t c[u][t] * rows[t][d0 ..] over t < live[u], in order of t (every u
 * takes t < common unchecked), stored for u < ny. */
AVX2_INLINE static void rows_tile(float *const y[4], int ny, const float *const c[4], const float *const *rows,
                                  int64_t n, int64_t common, const int64_t live[4], int d0, const int NV) {
    ACC_ZERO(0); ACC_ZERO(1); ACC_ZERO(2); ACC_ZERO(3);
    const float *c0 = c[0], *c1 = c[1], *c2 = c[2], *c3 = c[3];
    int64_t t = 0;
    for (; t < common; t++) {
        const float *r = rows[t] + d0;
        __m256 r0 = _mm256_loadu_ps(r), r1 = NV > 1 ? _mm256_loadu_ps(r + LANES) : r0;
        ACC_FMA(0, _mm256_broadcast_ss(c0 + t));
        ACC_FMA(1, _mm256_broadcast_ss(c1 + t));
        ACC_FMA(2, _mm256_broadcast_ss(c2 + t));
        ACC_FMA(3, _mm256_broadcast_ss(c3 + t));
    }
    for (; t < n; t++) {
        const float *r = rows[t] + d0;
        __m256 r0 = _mm256_loadu_ps(r), r1 = NV > 1 ? _mm256_loadu_ps(r + LANES) : r0;
        if (t < live[0]) ACC_FMA(0, _mm256_broadcast_ss(c0 + t));
        if (t < live[1]) ACC_FMA(1, _mm256_broadcast_ss(c1 + t));
        if (t < live[2]) ACC_FMA(2, _mm256_broadcast_ss(c2 + t));
        if (t < live[3]) ACC_FMA(3, _mm256_broadcast_ss(c3 + t));
    }
    ACC_STORE(0, y[0] + d0);
    if (ny > 1) ACC_STORE(1, y[1] + d0);
    if (ny > 2) ACC_STORE(2, y[2] + d0);
    if (ny > 3) ACC_STORE(3, y[3] + d0);
}

/* positions j0 .. j0 + nj - 1 (nj <= 4) of dst (dk or dv, rows of D), columns d0 .. d0 + 8 NV,
 * += the block's rows i, in order, each into the positions it read (p >= j): coefficient
 * w[i * ld + j] times row x[i]. */
AVX2_INLINE static void scatter_tile(float *dst, int D, int64_t j0, int nj, const float *w, int64_t ld,
                                     const float *const *x, const int64_t *ps, int nb, int d0, const int NV) {
    float *y = dst + j0 * D + d0;
    ACC_ZERO(0); ACC_ZERO(1); ACC_ZERO(2); ACC_ZERO(3);
    ACC_LOAD(0, y);
    if (nj > 1) ACC_LOAD(1, y + D);
    if (nj > 2) ACC_LOAD(2, y + 2 * D);
    if (nj > 3) ACC_LOAD(3, y + 3 * D);
    for (int i = 0; i < nb; i++) {
        int64_t cnt = ps[i] - j0 + 1; /* of positions j0.. row i read */
        if (cnt <= 0) continue;
        const float *r = x[i] + d0, *c = w + i * ld + j0;
        __m256 r0 = _mm256_loadu_ps(r), r1 = NV > 1 ? _mm256_loadu_ps(r + LANES) : r0;
        ACC_FMA(0, _mm256_broadcast_ss(c));
        if (cnt > 1) ACC_FMA(1, _mm256_broadcast_ss(c + 1));
        if (cnt > 2) ACC_FMA(2, _mm256_broadcast_ss(c + 2));
        if (cnt > 3) ACC_FMA(3, _mm256_broadcast_ss(c + 3));
    }
    ACC_STORE(0, y);
    if (nj > 1) ACC_STORE(1, y + D);
    if (nj > 2) ACC_STORE(2, y + 2 * D);
    if (nj > 3) ACC_STORE(3, y + 3 * D);
}

AVX2_INLINE static void scatter_block(float *dst, int D, int64_t j0, int nj, const float *w, int64_t ld,
                                      const float *const *x, const int64_t *ps, int nb) {
    int d0 = 0;
    for (; d0 + 2 * LANES <= D; d0 += 2 * LANES) scatter_tile(dst, D, j0, nj, w, ld, x, ps, nb, d0, 2);
    if (d0 < D) scatter_tile(dst, D, j0, nj, w, ld, x, ps, nb, d0, 1);
}

AVX2 static void task_avx2(const bwd *b, int64_t s, int h, float *scratch) {
    int D = b->D, kvh = h / (b->Hq / b->Hkv);
    int64_t L = b->L, len = b->lens[s], Lp = (L + TJ - 1) / TJ * TJ;
    float *KT = scratch, *VT = KT + (int64_t)D * Lp, *S = VT + (int64_t)D * Lp, *DP = S + BQ * Lp;
    const float **kp = (const float **)(DP + BQ * Lp);
    float *dk = b->dk + ((s * b->Hq + h) * L) * D, *dv = b->dv + ((s * b->Hq + h) * L) * D;
    const int64_t *ix = b->idx + (s * b->Hkv + kvh) * L;
    int64_t lp = (len + TJ - 1) / TJ * TJ;
    for (int64_t j = 0; j < len; j++) {
        const float *kj = b->k + ix[j] * D, *vj = b->v + ix[j] * D;
        kp[j] = kj;
        for (int d = 0; d < D; d++) KT[d * Lp + j] = kj[d], VT[d * Lp + j] = vj[d];
    }
    for (int d = 0; d < D; d++)
        for (int64_t j = len; j < lp; j++) KT[d * Lp + j] = VT[d * Lp + j] = 0.0f;
    memset(dk, 0, sizeof(float) * (size_t)(len * D));
    memset(dv, 0, sizeof(float) * (size_t)(len * D));
    for (int64_t r0 = b->starts[s]; r0 < b->starts[s + 1]; r0 += BQ) {
        int nb = b->starts[s + 1] - r0 < BQ ? (int)(b->starts[s + 1] - r0) : BQ;
        int64_t pmax = 0, ps[BQ];
        const float *qs[BQ], *gs[BQ];
        float *dqs[BQ];
        for (int i = 0; i < nb; i++) {
            int64_t n = b->order[r0 + i], at = (n * b->Hq + h) * D;
            ps[i] = b->pos[n], qs[i] = b->q + at, gs[i] = b->grad + at, dqs[i] = b->dq + at;
            pmax = ps[i] > pmax ? ps[i] : pmax;
        }
        for (int i0 = 0; i0 < nb; i0 += 4) { /* S = Q KT, dP = G VT */
            int nr = nb - i0 < 4 ? nb - i0 : 4;
            const float *xq[4], *xg[4];
            for (int u = 0; u < 4; u++) xq[u] = qs[i0 + (u < nr ? u : 0)], xg[u] = gs[i0 + (u < nr ? u : 0)];
            for (int64_t j = 0; j <= pmax; j += TJ) {
                xt_tile(xq, nr, KT, Lp, D, j, S + i0 * Lp, Lp);
                xt_tile(xg, nr, VT, Lp, D, j, DP + i0 * Lp, Lp);
            }
        }
        for (int i = 0; i < nb; i++) { /* P (in S) and dS (in DP) of row i, 0 past its position */
            int64_t p = ps[i], j = 0;
            float *Pi = S + i * Lp, *dSi = DP + i * Lp, m = -INFINITY, l;
            for (j = 0; j <= p; j++) {
                Pi[j] *= b->scale;
                m = Pi[j] > m ? Pi[j] : m;
            }
            __m256 mv = _mm256_set1_ps(m), lv = _mm256_setzero_ps();
            for (j = 0; j + LANES <= p + 1; j += LANES) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(Pi + j), mv));
                _mm256_storeu_ps(Pi + j, e);
                lv = _mm256_add_ps(lv, e);
            }
            l = hsum(lv);
            for (; j <= p; j++) {
                Pi[j] = exp_portable(Pi[j] - m);
                l += Pi[j];
            }
            float inv = 1.0f / l, delta = hsum(fma_row(gs[i], b->out + (qs[i] - b->q), D, _mm256_setzero_ps()));
            for (j = 0; j <= p; j++) {
                Pi[j] *= inv;
                dSi[j] = Pi[j] * (dSi[j] - delta) * b->scale;
            }
            for (; j <= pmax; j++) Pi[j] = dSi[j] = 0.0f;
        }
        for (int i0 = 0; i0 < nb; i0 += 4) { /* dq = dS K, each row over its own positions */
            int nr = nb - i0 < 4 ? nb - i0 : 4;
            float *y[4];
            const float *c[4];
            int64_t live[4], common = INT64_MAX, n = 0;
            for (int u = 0; u < 4; u++) {
                int i = i0 + (u < nr ? u : 0);
                y[u] = dqs[i], c[u] = DP + i * Lp, live[u] = ps[i] + 1;
                common = live[u] < common ? live[u] : common;
                n = live[u] > n ? live[u] : n;
            }
            int d0 = 0;
            for (; d0 + 2 * LANES <= D; d0 += 2 * LANES) rows_tile(y, nr, c, kp, n, common, live, d0, 2);
            if (d0 < D) rows_tile(y, nr, c, kp, n, common, live, d0, 1);
        }
        for (int64_t j0 = 0; j0 <= pmax; j0 += 4) { /* dk += dS^T Q, dv += P^T G */
            int nj = pmax + 1 - j0 < 4 ? (int)(pmax + 1 - j0) : 4;
            scatter_block(dk, D, j0, nj, DP, Lp, qs, ps, nb);
            scatter_block(dv, D, j0, nj, S, Lp, gs, ps, nb);
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
    int64_t Lp = ((L > 0 ? L : 1) + TJ - 1) / TJ * TJ;
    /* the AVX2 task's KT, VT [D][Lp], S, dP [BQ][Lp] and Lp row pointers, two floats' room each
     * (the portable task's: L floats); Lp is even, so the pointers stay 8-byte aligned */
    int64_t per = (2 * (int64_t)D + 2 * BQ + 2) * Lp;
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
