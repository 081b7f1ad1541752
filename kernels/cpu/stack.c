/* stack: every dense decoder layer of one forward pass over packed rows, in one call, without
 * autograd: the model's per-operator path (onpolicy/models/layers.py) with the Python between the
 * kernels taken out. Each step calls the same kernel entry point with the same operands that the
 * per-operator path reaches through the reference backend, and the glue between them (dtype casts,
 * bias and residual adds, the K/V write) performs the same IEEE operations torch does, so every
 * output has the per-operator path's bits (asserted by the tests with torch.equal).
 *
 * Layer l, with act the model's dtype (fp32 or bf16; "to act" rounds fp32 to bf16, to nearest
 * even, or is the identity):
 *   h = rmsnorm(x, input_norm)                         rmsnorm_rows, out in act
 *   q, k, v = to act(rowdot_group(h, [Wq, Wk, Wv]))   + bias in act (one rounding), if any
 *   q, k = rmsnorm per head (q_norm, k_norm)           Qwen3 only
 *   q, k = rope(q), rope(k)                            rope_rows
 *   K/V cache rows slots[n] of layer l = k, v          a copy (the cache is in act)
 *   a = to act(attention_rows(q, cache of layer l))
 *   x = x + (to act(rowdot_chunked(a, Wo chunks)) + bias)       the canonical chunked reduction
 *   h = rmsnorm(x, post_norm)
 *   g, u = to act(rowdot_group(h, [Wgate, Wup]))
 *   x = x + to act(rowdot_chunked(swiglu(g, u), Wdown chunks))
 * Each addition of two act tensors is an fp32 addition rounded to act, as torch's. The weights of
 * layer l are the addresses weights[l * STACK_PTRS + i] in the order of the enum below (0 for an
 * absent bias or q/k norm), every one contiguous in act; the chunked ones [chunks, Out, K/chunks].
 * P_Q .. P_DOWN are the same weights packed (rowdot_pack; o and down with `chunks` chunks), or 0:
 * a few rows then read those instead (the same bits, read as one stream per 8-row tile). */
#include <stdlib.h>

#include "native.h"

enum { W_IN_NORM, W_Q, W_K, W_V, B_Q, B_K, B_V, W_Q_NORM, W_K_NORM, W_O, B_O, W_POST_NORM, W_GATE, W_UP, W_DOWN,
       P_Q, P_K, P_V, P_O, P_GATE, P_UP, P_DOWN, STACK_PTRS };

/* Most rows that read the packed copies (P_*, rowdot.c) where the table has them: every row then
 * reuses each weight tile from L1; more rows take the plain weights' 4-row micro-tiles. */
#define PACKED_ROWS 4

typedef struct {
    int64_t rows, hidden, q_heads, kv_heads, head_dim, inter, layers, chunks;
    const int64_t *weights;   /* [layers][STACK_PTRS] addresses */
    const float *cos, *sin;   /* [rows, head_dim] fp32 */
    char *k_cache, *v_cache;  /* layer 0's cache: slot s is [kv_heads, head_dim] at element s * kv_heads * head_dim */
    int64_t cache_layer;      /* elements between two layers' caches */
    const int64_t *slots;     /* [rows]: the cache slot each row's K/V is written to */
    const int64_t *idx;       /* [seqs, kv_heads, kv_len]: attention's storage-row index (rows of head_dim) */
    int64_t kv_len;
    const int64_t *seq, *pos; /* [rows] */
    void *x;                  /* [rows, hidden] in act: the residual stream, updated in place */
    float eps, scale;
    int bf16, tile, threads, force_portable;
} stack_args;

int stack_ptrs(void) { return STACK_PTRS; }

/* Elementwise steps split over threads only when large (a prefill); a decode step's rows are cheaper
 * on one thread than a parallel region's fork. */
#define ELEMENTWISE_PARALLEL (1 << 16)

/* y (fp32, n elements) in act: y itself for fp32, else rounded into buf */
static void *to_act(float *y, void *buf, int64_t n, int bf16, int threads) {
    if (!bf16) return y;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= ELEMENTWISE_PARALLEL)
    for (int64_t i = 0; i < n; i++) store1(buf, 1, i, y[i]);
    return buf;
}

/* y [rows, n] in act += bias [n] (absent: nothing) */
static void add_bias(void *y, const void *bias, int64_t rows, int64_t n, int bf16, int threads) {
    if (!bias) return;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            store1(y, bf16, r * n + i, load1(y, bf16, r * n + i) + load1(bias, bf16, i));
}

/* x += y, both n elements in act */
static void add_into(void *x, const void *y, int64_t n, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= ELEMENTWISE_PARALLEL)
    for (int64_t i = 0; i < n; i++) store1(x, bf16, i, load1(x, bf16, i) + load1(y, bf16, i));
}

static inline const void *ptr(const int64_t *w, int i) { return (const void *)(intptr_t)w[i]; }

/* The projections of one input in [N, K] (act) onto nw weights of layer w (table slots plain[s],
 * packed slots pk[s], rows ns[s]): fp32 outs[s] [N, ns[s]], in one rowdot call (the packed copies
 * when `packed` and every weight has one). */
static int project(const stack_args *a, const int64_t *w, int packed, const void *in, int64_t K, int nw,
                   const int *plain, const int *pk, const int64_t *ns, float *const *outs) {
    int64_t meta[4 * 3];
    for (int s = 0; s < nw; s++) packed = packed && w[pk[s]];
    if (packed) {
        for (int s = 0; s < nw; s++) {
            meta[s] = w[pk[s]];
            meta[nw + s] = ns[s];
            meta[2 * nw + s] = (int64_t)(intptr_t)outs[s];
        }
        return rowdot_packed(in, a->bf16, K, 1, K, nw, meta, a->bf16, 0, a->rows, a->threads) ? -2 : 0;
    }
    for (int s = 0; s < nw; s++) {
        meta[s] = w[plain[s]];
        meta[nw + s] = K;
        meta[2 * nw + s] = ns[s];
        meta[3 * nw + s] = (int64_t)(intptr_t)outs[s];
    }
    return rowdot_group(in, a->bf16, K, K, nw, meta, a->bf16, a->rows, a->threads, a->force_portable) ? -2 : 0;
}

/* A row-parallel linear (o_proj, down_proj) of in [N, K] (act): fp32 out [N, hidden] with the
 * canonical chunked reduction, from table slot `plain` (chunk-major) or `pk` (packed, when `packed`
 * and present). */
static int row_linear(const stack_args *a, const int64_t *w, int packed, const void *in, int64_t K, int plain, int pk,
                      float *out) {
    const int b = a->bf16;
    const int64_t C = a->chunks, H = a->hidden;
    if (packed && w[pk]) {
        int64_t meta[3] = {w[pk], H, (int64_t)(intptr_t)out};
        return rowdot_packed(in, b, K, (int)C, K / C, 1, meta, b, b, a->rows, a->threads) ? -2 : 0;
    }
    rowdot_chunked(in, b, K, ptr(w, plain), b, K / C, H * (K / C), (int)C, K / C, out, H, 0, b, a->rows, H,
                   a->threads, a->force_portable);
    return 0;
}

/* Runs the layers; returns 0, -1 when scratch memory could not be allocated, -2 when a kernel
 * refused its operands (then x holds a partial result). */
int decoder_stack(const stack_args *a) {
    const int b = a->bf16, T = a->threads < 1 ? 1 : a->threads;
    const size_t es = b ? 2 : 4;
    const int64_t N = a->rows, H = a->hidden, D = a->head_dim, QD = a->q_heads * D, KD = a->kv_heads * D,
                  I = a->inter;
    /* fp32 kernel outputs (q, k, v, attention, o/down, gate, up), then the act intermediates */
    size_t f32 = (size_t)(N * (2 * QD + 2 * KD + H + 2 * I)), act = (size_t)(N * (H + 3 * QD + 3 * KD + 3 * I));
    char *mem = malloc(f32 * 4 + act * es);
    if (!mem) return -1;
    float *qf = (float *)mem, *kf = qf + N * QD, *vf = kf + N * KD, *af = vf + N * KD, *of = af + N * QD,
          *gf = of + N * H, *uf = gf + N * I;
    char *p = (char *)(uf + N * I);
    void *h = p, *qa = p + N * H * es, *ka = (char *)qa + N * QD * es, *va = (char *)ka + N * KD * es,
         *qn = (char *)va + N * KD * es, *qr = (char *)qn + N * QD * es, *kn = (char *)qr + N * QD * es,
         *ga = (char *)kn + N * KD * es, *ua = (char *)ga + N * I * es, *sa = (char *)ua + N * I * es;
    void *kr = ka; /* k after rope: k's act buffer is free by then (written to the cache from here) */
    int rc = 0;
    for (int64_t l = 0; l < a->layers && rc == 0; l++) {
        const int64_t *w = a->weights + l * STACK_PTRS;
        const int packed = N <= PACKED_ROWS && !a->force_portable; /* where the table has packed copies */
        char *kc = a->k_cache + l * a->cache_layer * es, *vc = a->v_cache + l * a->cache_layer * es;
        rmsnorm_rows(a->x, b, H, ptr(w, W_IN_NORM), b, h, b, N, H, a->eps, a->threads, a->force_portable);
        static const int qkv_w[3] = {W_Q, W_K, W_V}, qkv_p[3] = {P_Q, P_K, P_V};
        const int64_t qkv_n[3] = {QD, KD, KD};
        float *const qkv_out[3] = {qf, kf, vf};
        if ((rc = project(a, w, packed, h, H, 3, qkv_w, qkv_p, qkv_n, qkv_out))) break;
        void *q = to_act(qf, qa, N * QD, b, T), *k = to_act(kf, ka, N * KD, b, T);
        void *v = to_act(vf, va, N * KD, b, T);
        add_bias(q, ptr(w, B_Q), N, QD, b, T);
        add_bias(k, ptr(w, B_K), N, KD, b, T);
        add_bias(v, ptr(w, B_V), N, KD, b, T);
        if (w[W_Q_NORM]) {
            rmsnorm_rows(q, b, D, ptr(w, W_Q_NORM), b, qn, b, N * a->q_heads, D, a->eps, a->threads,
                         a->force_portable);
            q = qn;
        }
        if (w[W_K_NORM]) {
            rmsnorm_rows(k, b, D, ptr(w, W_K_NORM), b, kn, b, N * a->kv_heads, D, a->eps, a->threads,
                         a->force_portable);
            k = kn;
        }
        rope_rows(q, b, QD, D, a->cos, a->sin, qr, N, a->q_heads, D, a->threads);
        void *kdst = k == kr ? kn : kr; /* rope must not write the buffer it reads */
        rope_rows(k, b, KD, D, a->cos, a->sin, kdst, N, a->kv_heads, D, a->threads);
        for (int64_t n = 0; n < N; n++) {
            memcpy(kc + a->slots[n] * KD * es, (char *)kdst + n * KD * es, (size_t)KD * es);
            memcpy(vc + a->slots[n] * KD * es, (char *)v + n * KD * es, (size_t)KD * es);
        }
        if (attention_rows(qr, b, QD, D, kc, vc, b, D, a->idx, a->kv_len, a->seq, a->pos, N, (int)a->q_heads,
                           (int)a->kv_heads, (int)D, a->tile, a->scale, af, a->threads, a->force_portable)) {
            rc = -1;
            break;
        }
        void *at = to_act(af, qn, N * QD, b, T); /* q's norm buffer is free again */
        if ((rc = row_linear(a, w, packed, at, QD, W_O, P_O, of))) break;
        void *o = to_act(of, h, N * H, b, T); /* h is free until the next norm */
        add_bias(o, ptr(w, B_O), N, H, b, T);
        add_into(a->x, o, N * H, b, T);
        rmsnorm_rows(a->x, b, H, ptr(w, W_POST_NORM), b, h, b, N, H, a->eps, a->threads, a->force_portable);
        static const int gu_w[2] = {W_GATE, W_UP}, gu_p[2] = {P_GATE, P_UP};
        const int64_t gu_n[2] = {I, I};
        float *const gu_out[2] = {gf, uf};
        if ((rc = project(a, w, packed, h, H, 2, gu_w, gu_p, gu_n, gu_out))) break;
        void *g = to_act(gf, ga, N * I, b, T), *u = to_act(uf, ua, N * I, b, T);
        swiglu_rows(g, b, I, u, b, I, sa, N, I, a->threads, a->force_portable);
        if ((rc = row_linear(a, w, packed, sa, I, W_DOWN, P_DOWN, of))) break;
        add_into(a->x, to_act(of, h, N * H, b, T), N * H, b, T);
    }
    free(mem);
    return rc;
}
