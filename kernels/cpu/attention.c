/* attention: causal attention of packed query rows over keys and values named by a row index, in
 * the order of the tile routine (DESIGN: "Attention"), with every addition's order fixed here.
 *
 * Query row n (sequence s = seq[n], position p = pos[n]) and query head h read KV head
 * h / (Hq / Hkv); position j of its sequence is storage row idx[s, kvh, j] of k and v. Only
 * positions 0..p are read. They are visited in tiles of `tile` positions from position 0 ascending;
 * in tile t (positions j0 = t*tile .. j1 = min(j0 + tile, p + 1) - 1):
 *
 *   s_j   = dot(q, k_j) * scale           dot: rowdot's order (8 lanes of FMAs over D, lane tree)
 *   m_t   = max(m_{t-1}, max_j s_j)       (m_0 = the tile's max; max is exact in any order)
 *   e_j   = exp_(s_j - m_t)               exp_: the polynomial below, not libm's
 *   r_t   = the e_j summed in 8 lanes (lane i takes j0 + i, j0 + i + 8, ...; from +0) and the lane
 *           tree of rowdot
 *   pv_t  = per element d, fma(e_j, v_j[d], .) over j ascending from +0
 *   t = 0: l = r_0, acc = pv_0;  t > 0: a = exp_(m_{t-1} - m_t), l = l * a + r_t,
 *          acc[d] = acc[d] * a + pv_t[d]
 *   out[d] = acc[d] / l
 *
 * Nothing here depends on the other rows, on how many positions the index has past p, on the
 * thread count or on the vector width: a row's bits are the same in a training forward, a prefill,
 * a chunked prefill and a decode step. The AVX2+FMA path and the portable path run the same IEEE
 * operations. q, k, v may each be fp32 or bf16 (k and v alike); out is fp32. */
#include <omp.h>
#include <stdlib.h>

#include "native.h"

typedef struct {
    const char *q;
    int qb;
    int64_t q_row, q_head; /* elements between query rows / heads */
    const char *k, *v;
    int kvb;
    int64_t kv_row; /* elements between storage rows */
    const int64_t *idx;
    int64_t L;      /* positions per (sequence, KV head) in idx */
    const int64_t *seq, *pos;
    int Hq, Hkv, D, tile;
    float scale;
    float *out;     /* [N, Hq, D] */
} attn;

/* per-thread scratch: q widened and zero-padded, scores (padded with -inf), pv and acc */
typedef struct {
    float *q, *s, *pv, *acc;
} scratch;

static inline int64_t round8(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

static inline void load_query(const attn *a, int64_t n, int h, float *qf) {
    int64_t dp = round8(a->D);
    const char *row = a->q + (n * a->q_row + h * a->q_head) * (a->qb ? 2 : 4);
    for (int64_t k = 0; k < dp; k += LANES) {
        int len = a->D - k < LANES ? (int)(a->D - k) : LANES;
        block_f32(row, a->qb, k, len, qf + k);
    }
}

static inline const char *kv_ptr(const attn *a, const char *base, int64_t row) {
    return base + row * a->kv_row * (a->kvb ? 2 : 4);
}

/* the online-softmax update after a tile: shared by both paths (scalar arithmetic over D) */
static inline void update(const attn *a, int t, float m_old, float m_new, float r, float *l, scratch *w) {
    if (t == 0) {
        *l = r;
        for (int d = 0; d < a->D; d++) w->acc[d] = w->pv[d];
        return;
    }
    float al = exp_portable(m_old - m_new);
    *l = *l * al + r;
    for (int d = 0; d < a->D; d++) w->acc[d] = w->acc[d] * al + w->pv[d];
}

static inline void finish(const attn *a, int64_t n, int h, float l, const scratch *w) {
    float *o = a->out + (n * a->Hq + h) * a->D;
    for (int d = 0; d < a->D; d++) o[d] = w->acc[d] / l;
}

static void row_portable(const attn *a, int64_t n, int h, scratch *w) {
    int64_t p = a->pos[n];
    const int64_t *rows = a->idx + (a->seq[n] * a->Hkv + h / (a->Hq / a->Hkv)) * a->L;
    load_query(a, n, h, w->q);
    float m = 0.0f, l = 0.0f, kv[LANES], acc8[LANES];
    for (int64_t j0 = 0, t = 0; j0 <= p; j0 += a->tile, t++) {
        int64_t cnt = (j0 + a->tile <= p + 1 ? a->tile : p + 1 - j0);
        float mt = -INFINITY;
        for (int64_t j = 0; j < cnt; j++) {
            const char *kr = kv_ptr(a, a->k, rows[j0 + j]);
            for (int i = 0; i < LANES; i++) acc8[i] = 0.0f;
            for (int64_t k = 0; k < a->D; k += LANES) {
                block_f32(kr, a->kvb, k, a->D - k < LANES ? (int)(a->D - k) : LANES, kv);
                for (int i = 0; i < LANES; i++) acc8[i] = fmaf(w->q[k + i], kv[i], acc8[i]);
            }
            w->s[j] = lane_sum(acc8) * a->scale;
            if (w->s[j] > mt) mt = w->s[j];
        }
        for (int64_t j = cnt; j < round8(cnt); j++) w->s[j] = -INFINITY;
        float m_new = t == 0 || mt > m ? mt : m;
        for (int i = 0; i < LANES; i++) acc8[i] = 0.0f;
        for (int64_t j = 0; j < round8(cnt); j++) {
            w->s[j] = exp_portable(w->s[j] - m_new);
            acc8[j % LANES] = acc8[j % LANES] + w->s[j];
        }
        for (int d = 0; d < a->D; d++) w->pv[d] = 0.0f;
        for (int64_t j = 0; j < cnt; j++) {
            const char *vr = kv_ptr(a, a->v, rows[j0 + j]);
            for (int64_t k = 0; k < a->D; k += LANES) {
                int len = a->D - k < LANES ? (int)(a->D - k) : LANES;
                block_f32(vr, a->kvb, k, len, kv);
                for (int i = 0; i < len; i++) w->pv[k + i] = fmaf(w->s[j], kv[i], w->pv[k + i]);
            }
        }
        update(a, (int)t, m, m_new, lane_sum(acc8), &l, w);
        m = m_new;
    }
    finish(a, n, h, l, w);
}

#ifdef NATIVE_X86
/* scores of `cnt` keys (rows[0..cnt)) against the widened query, times scale */
AVX2_INLINE static void scores_avx2(const attn *a, int kvb, const int64_t *rows, int64_t cnt, const float *qf,
                                    float *s) {
    int64_t dfull = a->D - a->D % LANES;
    int tail = (int)(a->D - dfull);
    int64_t j = 0;
    for (; j + 4 <= cnt; j += 4) {
        const char *kr[4];
        __m256 acc[4];
        for (int c = 0; c < 4; c++) kr[c] = kv_ptr(a, a->k, rows[j + c]), acc[c] = _mm256_setzero_ps();
        for (int64_t k = 0; k < dfull; k += LANES) {
            __m256 qv = _mm256_loadu_ps(qf + k);
            for (int c = 0; c < 4; c++) acc[c] = _mm256_fmadd_ps(qv, load8(kr[c], kvb, k), acc[c]);
        }
        if (tail) {
            __m256 qv = _mm256_loadu_ps(qf + dfull);
            for (int c = 0; c < 4; c++) acc[c] = _mm256_fmadd_ps(qv, load_tail(kr[c], kvb, dfull, tail), acc[c]);
        }
        for (int c = 0; c < 4; c++) s[j + c] = hsum(acc[c]) * a->scale;
    }
    for (; j < cnt; j++) {
        const char *kr = kv_ptr(a, a->k, rows[j]);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < dfull; k += LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + k), load8(kr, kvb, k), acc);
        if (tail) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + dfull), load_tail(kr, kvb, dfull, tail), acc);
        s[j] = hsum(acc) * a->scale;
    }
}

/* pv[d] = sum_j e[j] * v_j[d] (fma, j ascending from +0), four 8-wide column blocks at a time */
AVX2_INLINE static void pv_avx2(const attn *a, int kvb, const int64_t *rows, int64_t cnt, const float *e, float *pv) {
    int64_t dfull = a->D - a->D % LANES;
    int tail = (int)(a->D - dfull);
    int64_t k = 0;
    for (; k + 4 * LANES <= dfull; k += 4 * LANES) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < cnt; j++) {
            const char *vr = kv_ptr(a, a->v, rows[j]);
            __m256 ej = _mm256_set1_ps(e[j]);
            for (int c = 0; c < 4; c++) acc[c] = _mm256_fmadd_ps(ej, load8(vr, kvb, k + c * LANES), acc[c]);
        }
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(pv + k + c * LANES, acc[c]);
    }
    for (; k < a->D; k += LANES) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < cnt; j++) {
            const char *vr = kv_ptr(a, a->v, rows[j]);
            __m256 vv = k < dfull ? load8(vr, kvb, k) : load_tail(vr, kvb, k, tail);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), vv, acc);
        }
        float t[LANES];
        _mm256_storeu_ps(t, acc);
        for (int i = 0; i < LANES && k + i < a->D; i++) pv[k + i] = t[i];
    }
}

AVX2_INLINE static void row_avx2_impl(const attn *a, int kvb, int64_t n, int h, scratch *w) {
    int64_t p = a->pos[n];
    const int64_t *rows = a->idx + (a->seq[n] * a->Hkv + h / (a->Hq / a->Hkv)) * a->L;
    load_query(a, n, h, w->q);
    float m = 0.0f, l = 0.0f;
    for (int64_t j0 = 0, t = 0; j0 <= p; j0 += a->tile, t++) {
        int64_t cnt = (j0 + a->tile <= p + 1 ? a->tile : p + 1 - j0), c8 = round8(cnt);
        scores_avx2(a, kvb, rows + j0, cnt, w->q, w->s);
        float mt = -INFINITY;
        for (int64_t j = 0; j < cnt; j++)
            if (w->s[j] > mt) mt = w->s[j];
        for (int64_t j = cnt; j < c8; j++) w->s[j] = -INFINITY;
        float m_new = t == 0 || mt > m ? mt : m;
        __m256 mv = _mm256_set1_ps(m_new), racc = _mm256_setzero_ps();
        for (int64_t j = 0; j < c8; j += LANES) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w->s + j), mv));
            _mm256_storeu_ps(w->s + j, e);
            racc = _mm256_add_ps(racc, e);
        }
        pv_avx2(a, kvb, rows + j0, cnt, w->s, w->pv);
        update(a, (int)t, m, m_new, hsum(racc), &l, w);
        m = m_new;
    }
    finish(a, n, h, l, w);
}

AVX2 static void row_avx2_f32(const attn *a, int64_t n, int h, scratch *w) { row_avx2_impl(a, 0, n, h, w); }
AVX2 static void row_avx2_bf16(const attn *a, int64_t n, int h, scratch *w) { row_avx2_impl(a, 1, n, h, w); }

#endif

/* q: row n, head h at element n*q_row + h*q_head (D contiguous); k, v: storage row r at element
 * r*kv_row (D contiguous); idx [S, Hkv, L]; seq, pos [N]; out [N, Hq, D]. Requires pos[n] < L and
 * Hq a multiple of Hkv. Returns 0, or -1 when scratch memory could not be allocated. */
int attention_rows(const void *q, int q_bf16, int64_t q_row, int64_t q_head, const void *k, const void *v,
                   int kv_bf16, int64_t kv_row, const int64_t *idx, int64_t L, const int64_t *seq,
                   const int64_t *pos, int64_t N, int Hq, int Hkv, int D, int tile, float scale, float *out,
                   int threads, int force_portable) {
    attn a = {(const char *)q, q_bf16, q_row, q_head, (const char *)k, (const char *)v, kv_bf16, kv_row,
              idx, L, seq, pos, Hq, Hkv, D, tile, scale, out};
    int vector = !force_portable && native_vector_path();
    int64_t items = N * Hq, dp = round8(D), per = 3 * dp + round8(tile);
    if (threads < 1) threads = 1;
    if (items < threads) threads = (int)(items > 0 ? items : 1);
    float *buf = malloc(sizeof(float) * (size_t)(per * threads));
    if (!buf) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *b = buf + per * omp_get_thread_num();
        scratch w = {b, b + dp, b + dp + round8(tile), b + 2 * dp + round8(tile)};
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t n = it / Hq;
            int h = (int)(it % Hq);
#ifdef NATIVE_X86
            if (vector) {
                (kv_bf16 ? row_avx2_bf16 : row_avx2_f32)(&a, n, h, &w);
                continue;
            }
#endif
            row_portable(&a, n, h, &w);
        }
    }
    free(buf);
    return 0;
}
