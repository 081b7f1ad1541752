/* Row-wise operators of the consistent set: RMSNorm, RoPE, SwiGLU (and exp_ for tests).
 *
 * RMSNorm of row x [H] with weight w: ss = rowdot's dot(x, x) (8 lanes of FMAs, lane tree);
 *   r = 1 / sqrt(ss / H + eps); y = cast_x(x * r); out = cast_out(y * w), where cast_x rounds to
 *   x's dtype, out is bf16 when x and w both are, else fp32 (HF's cast/multiply order).
 * RoPE of x [N, Hh, D] with fp32 cos, sin [N, D]: out = cast_x(x * cos + rotate_half(x) * sin),
 *   rotate_half(x) = (-x[D/2:], x[:D/2]); each product and the sum rounded once, as torch does it
 *   (the same bits as the torch expression).
 * SwiGLU: out = cast_gate((g / (exp_(-g) + 1)) * up), g and up widened to fp32.
 *
 * Only the sum of squares has a vector form that differs in code from the portable one; both
 * perform the same IEEE operations. Elementwise steps are the same in any vector width. */
#include "native.h"

static float sumsq_portable(const char *x, int xb, int64_t H) {
    float a[LANES] = {0}, b[LANES];
    for (int64_t k = 0; k < H; k += LANES) {
        block_f32(x, xb, k, H - k < LANES ? (int)(H - k) : LANES, b);
        for (int j = 0; j < LANES; j++) a[j] = fmaf(b[j], b[j], a[j]);
    }
    return lane_sum(a);
}

#ifdef NATIVE_X86
AVX2_INLINE static float sumsq_avx2_impl(const char *x, int xb, int64_t H) {
    int64_t full = H - H % LANES;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += LANES) {
        __m256 v = load8(x, xb, k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    if (full < H) {
        __m256 v = load_tail(x, xb, full, (int)(H - full));
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return hsum(acc);
}
AVX2 static float sumsq_avx2(const char *x, int xb, int64_t H) {
    return xb ? sumsq_avx2_impl(x, 1, H) : sumsq_avx2_impl(x, 0, H);
}
#endif

#ifdef NATIVE_X86
AVX2 static void exp_avx2(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i + LANES <= n; i += LANES) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
}
#endif

/* exp_ on n values (whole blocks of 8 on the vector path unless force_portable); tests compare the
 * paths and measure its accuracy */
void native_exp(const float *x, float *y, int64_t n, int force_portable) {
    int64_t i = 0;
#ifdef NATIVE_X86
    if (!force_portable && native_vector_path()) {
        exp_avx2(x, y, n);
        i = n - n % LANES;
    }
#endif
    for (; i < n; i++) y[i] = exp_portable(x[i]);
}

static int pool(int threads, int64_t work) {
    if (work < (1 << 15)) return 1; /* a decode step's rows: a parallel region costs more than it saves */
    return threads < 1 ? 1 : threads;
}

/* x [M, H] (row stride ldx elements), w [H]; out [M, H] contiguous */
void rmsnorm_rows(const void *x, int xb, int64_t ldx, const void *w, int wb, void *out, int ob, int64_t M,
                  int64_t H, float eps, int threads, int force_portable) {
    int vector = !force_portable && native_vector_path();
    (void)vector;
#pragma omp parallel for num_threads(pool(threads, M * H)) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const char *row = (const char *)x + m * ldx * (xb ? 2 : 4);
        float ss;
#ifdef NATIVE_X86
        if (vector)
            ss = sumsq_avx2(row, xb, H);
        else
#endif
            ss = sumsq_portable(row, xb, H);
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) {
            float y = load1(row, xb, i) * r;
            if (xb) y = round_bf16(y);
            store1(out, ob, m * H + i, y * load1(w, wb, i));
        }
    }
}

/* x [N, Hh, D] (row stride ldx, head stride ldh elements), cos/sin [N, D] fp32 contiguous; out
 * [N, Hh, D] contiguous in x's dtype */
void rope_rows(const void *x, int xb, int64_t ldx, int64_t ldh, const float *cos_, const float *sin_, void *out,
               int64_t N, int64_t Hh, int64_t D, int threads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(pool(threads, N * Hh * D)) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < Hh; h++) {
            const char *row = (const char *)x + (n * ldx + h * ldh) * (xb ? 2 : 4);
            const float *c = cos_ + n * D, *s = sin_ + n * D;
            int64_t o = (n * Hh + h) * D;
            for (int64_t i = 0; i < D; i++) {
                float rot = i < half ? -load1(row, xb, i + half) : load1(row, xb, i - half);
                float a = load1(row, xb, i) * c[i];
                float b = rot * s[i];
                store1(out, xb, o + i, a + b);
            }
        }
}

/* gate, up [M, I] (row strides ldg, ldu), out [M, I] contiguous in gate's dtype */
void swiglu_rows(const void *gate, int gb, int64_t ldg, const void *up, int ub, int64_t ldu, void *out, int64_t M,
                 int64_t I, int threads, int force_portable) {
    int vector = !force_portable && native_vector_path();
    (void)vector;
#pragma omp parallel for num_threads(pool(threads, M * I)) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const char *g = (const char *)gate + m * ldg * (gb ? 2 : 4), *u = (const char *)up + m * ldu * (ub ? 2 : 4);
        int64_t i = 0;
#ifdef NATIVE_X86
        if (vector) {
            float ng[LANES], e[LANES];
            for (; i + LANES <= I; i += LANES) {
                for (int j = 0; j < LANES; j++) ng[j] = -load1(g, gb, i + j);
                exp_avx2(ng, e, LANES);
                for (int j = 0; j < LANES; j++) {
                    float gf = load1(g, gb, i + j);
                    store1(out, gb, m * I + i + j, (gf / (e[j] + 1.0f)) * load1(u, ub, i + j));
                }
            }
        }
#endif
        for (; i < I; i++) {
            float gf = load1(g, gb, i);
            store1(out, gb, m * I + i, (gf / (exp_portable(-gf) + 1.0f)) * load1(u, ub, i));
        }
    }
}

/* SwiGLU's analytic gradient (no bitwise contract; one pass instead of a chain of torch ops):
 * sig = 1 / (1 + exp_(-g)); d_gate = dy * up * sig * (1 + g * (1 - sig)); d_up = dy * g * sig.
 * gate, up, dy [M, I] (row strides ldg, ldu, ldd); d_gate, d_up [M, I] contiguous, in gate's and
 * up's dtypes. */
#ifdef NATIVE_X86
/* one fp32 row of the gradient below, eight elements at a time (the tail is left to the caller) */
AVX2 static int64_t swiglu_backward_f32_avx2(const float *g, const float *u, const float *d, float *dg, float *du,
                                             int64_t I) {
    __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + LANES <= I; i += LANES) {
        __m256 gv = _mm256_loadu_ps(g + i), dv = _mm256_loadu_ps(d + i);
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        __m256 ds = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_loadu_ps(u + i)), sig);
        __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(gv, _mm256_sub_ps(one, sig)));
        _mm256_storeu_ps(dg + i, _mm256_mul_ps(ds, slope));
        _mm256_storeu_ps(du + i, _mm256_mul_ps(_mm256_mul_ps(dv, gv), sig));
    }
    return i;
}
#endif

void swiglu_backward_rows(const void *gate, int gb, int64_t ldg, const void *up, int ub, int64_t ldu,
                          const void *dy, int db, int64_t ldd, void *d_gate, void *d_up, int64_t M, int64_t I,
                          int threads) {
    int vector = native_vector_path();
    (void)vector;
#pragma omp parallel for num_threads(pool(threads, M * I)) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const char *g = (const char *)gate + m * ldg * (gb ? 2 : 4), *u = (const char *)up + m * ldu * (ub ? 2 : 4);
        const char *d = (const char *)dy + m * ldd * (db ? 2 : 4);
        float ng[LANES], e[LANES];
        int64_t start = 0;
#ifdef NATIVE_X86
        if (vector && !gb && !ub && !db)
            start = swiglu_backward_f32_avx2((const float *)g, (const float *)u, (const float *)d,
                                             (float *)d_gate + m * I, (float *)d_up + m * I, I);
#endif
        for (int64_t i0 = start; i0 < I; i0 += LANES) {
            int n = I - i0 < LANES ? (int)(I - i0) : LANES;
            for (int j = 0; j < n; j++) ng[j] = -load1(g, gb, i0 + j);
#ifdef NATIVE_X86
            if (vector && n == LANES)
                exp_avx2(ng, e, LANES);
            else
#endif
                for (int j = 0; j < n; j++) e[j] = exp_portable(ng[j]);
            for (int j = 0; j < n; j++) {
                float gf = -ng[j], uf = load1(u, ub, i0 + j), df = load1(d, db, i0 + j);
                float sig = 1.0f / (1.0f + e[j]);
                store1(d_gate, gb, m * I + i0 + j, df * uf * sig * (1.0f + gf * (1.0f - sig)));
                store1(d_up, ub, m * I + i0 + j, df * gf * sig);
            }
        }
    }
}
