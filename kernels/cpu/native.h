/* Helpers shared by the native kernels: bf16 widening and rounding, the 8-lane blocks and lane tree
 * of rowdot's dot product, the AVX2 loads, CPU feature detection, and the kernels' entry points
 * (stack.c chains them).
 * Every function here is a fixed sequence of IEEE operations; the vector and portable forms of one
 * operation give the same bits. exp_ is the exponential every native kernel uses. */
#ifndef ONPOLICY_NATIVE_H
#define ONPOLICY_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NATIVE_X86 1
#endif

#define LANES 8

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f))
        u = 0x7fc00000u;
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* element i of an fp32 or bf16 array, widened to fp32 */
static inline float load1(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* stores v as element i of an fp32 or bf16 array (rounded to nearest even for bf16) */
static inline void store1(void *p, int is_bf16, int64_t i, float v) {
    if (is_bf16) {
        uint32_t u;
        v = round_bf16(v);
        memcpy(&u, &v, sizeof u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = v;
    }
}

/* lanes of one 8-wide block starting at element k of p (n <= 8 valid, rest zero) */
static inline void block_f32(const char *p, int is_bf16, int64_t k, int n, float out[LANES]) {
    for (int j = 0; j < LANES; j++) out[j] = 0.0f;
    if (is_bf16) {
        const uint16_t *q = (const uint16_t *)p + k;
        for (int j = 0; j < n; j++) out[j] = bf16_to_f32(q[j]);
    } else {
        const float *q = (const float *)p + k;
        for (int j = 0; j < n; j++) out[j] = q[j];
    }
}

static inline float lane_sum(const float a[LANES]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#ifdef NATIVE_X86
#define AVX2 __attribute__((target("avx2,fma")))
/* inlined into each dtype specialisation of dot_avx2, so the operand dtypes are constants there */
#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

AVX2_INLINE static __m256 load8(const char *p, int is_bf16, int64_t k) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + k);
}

AVX2_INLINE static __m256 load_tail(const char *p, int is_bf16, int64_t k, int n) {
    float t[LANES];
    block_f32(p, is_bf16, k, n, t);
    return _mm256_loadu_ps(t);
}

AVX2_INLINE static float hsum(__m256 a) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* a0+a4 .. a3+a7 */
    __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                                 /* t0+t2, t1+t3 */
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));                  /* u0 + u1 */
}

#endif

/* exp_(x): Cody-Waite reduction x = n ln2 + r (n rounded to nearest even by the 1.5 * 2^23
 * trick), a degree-7 Taylor polynomial in Horner form with FMAs, then a scale by 2^n built from
 * its exponent bits. Inputs below EXP_LO give +0 (so -inf gives 0); above 88 are clamped; NaN
 * passes through. Within 2 ulp of exp on its domain. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define ROUND_MAGIC 12582912.0f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_C[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline float exp_portable(float x) {
    if (isnan(x)) return x;
    if (x < EXP_LO) return 0.0f;
    if (x > EXP_HI) x = EXP_HI;
    float n = (x * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_C[0];
    for (int i = 1; i < 8; i++) p = fmaf(p, r, EXP_C[i]);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef NATIVE_X86
AVX2_INLINE static __m256 exp8(__m256 x) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    __m256 xc = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 magic = _mm256_set1_ps(ROUND_MAGIC);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), magic), magic);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_andnot_ps(low, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    return _mm256_blendv_ps(y, x, nan);
}

#endif

/* 1 when this build has a vector path and the CPU runs it. */
static inline int native_vector_path(void) {
#ifdef NATIVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* The kernels' entry points (rowdot.c, attention.c, rowwise.c), for stack.c, which chains them. */
void rowdot_chunked(const void *x, int x_bf16, int64_t ldx, const void *w, int w_bf16, int64_t ldw,
                    int64_t wchunk, int chunks, int64_t K, float *y, int64_t ldy, int64_t ychunk,
                    int round_partials_bf16, int64_t M, int64_t N, int threads, int force_portable);
int rowdot_group(const void *x, int x_bf16, int64_t ldx, int64_t K, int nw, const int64_t *meta, int w_bf16,
                 int64_t M, int threads, int force_portable);
void rowdot_pack(const void *w, int w_bf16, int64_t ldw, int64_t N, int chunks, int64_t K, void *out);
int rowdot_packed(const void *x, int x_bf16, int64_t ldx, int chunks, int64_t K, int nw, const int64_t *meta,
                  int w_bf16, int round_partials, int64_t M, int threads);
int attention_rows(const void *q, int q_bf16, int64_t q_row, int64_t q_head, const void *k, const void *v,
                   int kv_bf16, int64_t kv_row, const int64_t *idx, int64_t L, const int64_t *seq,
                   const int64_t *pos, int64_t N, int Hq, int Hkv, int D, int tile, float scale, float *out,
                   int threads, int force_portable);
void rmsnorm_rows(const void *x, int xb, int64_t ldx, const void *w, int wb, void *out, int ob, int64_t M,
                  int64_t H, float eps, int threads, int force_portable);
void rope_rows(const void *x, int xb, int64_t ldx, int64_t ldh, const float *cos_, const float *sin_, void *out,
               int64_t N, int64_t Hh, int64_t D, int threads);
void swiglu_rows(const void *gate, int gb, int64_t ldg, const void *up, int ub, int64_t ldu, void *out, int64_t M,
                 int64_t I, int threads, int force_portable);

#endif
