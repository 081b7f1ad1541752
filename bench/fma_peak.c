/* The FMA peak of one core: 12 independent chains of 8-wide fp32 fused multiply-adds (AVX2+FMA),
 * enough to cover the FMA latency on every x86 core with two FMA pipes. Each OpenMP thread runs
 * its own chains; prints the best of three runs in GFLOP/s (2 flops per lane per FMA). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12

__attribute__((target("avx2,fma"), noinline)) static float chains(long iters) {
    __m256 a[CHAINS], m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], m, c);
    }
    __m256 s = a[0];
    for (int i = 1; i < CHAINS; i++) s = _mm256_add_ps(s, a[i]);
    return _mm256_cvtss_f32(s);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    long iters = argc > 2 ? atol(argv[2]) : 100000000L;
    double best = 0;
    float sink = chains(iters / 10);
    for (int rep = 0; rep < 3; rep++) {
        double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += chains(iters);
        double gflops = threads * (double)iters * CHAINS * 8 * 2 / (omp_get_wtime() - t0) / 1e9;
        if (gflops > best) best = gflops;
    }
    printf("%.2f %g\n", best, (double)sink);
    return 0;
}
