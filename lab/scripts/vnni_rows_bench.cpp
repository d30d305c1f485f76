// The batch-invariance patch's repacked-Q4_K row kernels in isolation (lab/notebook/2026-11-28-vnni-rows.md):
// gemv_rows_q4_K_8x8_q8_K_vnni<R> (VNNI dot products on the repacked bytes) against the AVX2 template
// gemv_rows_q4_K_8x8_q8_K_R<R> (gemv's own arithmetic), on random weights of the default target's
// shapes: first bit identity for 1-4 rows, then milliseconds per product, weights cycled through 40
// matrices (from memory, as in a pass; M=1: from cache), on 1 and 2 OpenMP threads. No ggml needed:
// the two blocks' layouts and ggml's two F16 load macros are declared here.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -DRR=4 lab/scripts/vnni_rows_bench.cpp -o /tmp/vnni_rows
//   /tmp/vnni_rows 1536 8960 300        # n (inner size), nc (columns), repetitions
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define QK_K 256
#define GGML_RESTRICT __restrict__
#ifndef RR
#define RR 4
#endif
#ifndef M
#define M 40
#endif
typedef uint16_t ggml_half;
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
struct block_q4_Kx8 { ggml_half d[8]; ggml_half dmin[8]; uint8_t scales[96]; uint8_t qs[1024]; };
#define GGML_F32Cx8_LOAD(x) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x)))
#define GGML_F32Cx8_REARRANGE_LOAD(x, mask) _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *) x), mask))
void ggml_gemv_q4_K_8x8_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int nr, int nc);
#include "../../src/specdecode/models/llamacpp/native/gemv_rows_q4_K_8x8.cpp"
void ggml_gemv_q4_K_8x8_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int nr, int nc) {
    gemv_rows_q4_K_8x8_q8_K_R<1>(n, s, bs, vx, vy, 0, nc);  // gemv's arithmetic (the patch's claim, checked by its tests)
}

int main(int argc, char ** argv) {
#if !defined(SPECDECODE_DPBUSD)
    std::printf("this compiler target has no VNNI: nothing to compare\n");
    return 0;
#else
    if (argc < 4) { std::printf("usage: %s n nc reps\n", argv[0]); return 2; }
    const int n = std::atoi(argv[1]), nc = std::atoi(argv[2]), reps = std::atoi(argv[3]), nb = n / QK_K;
    std::vector<block_q4_Kx8> W((size_t) M * nb * nc / 8);
    std::srand(1);
    for (auto & b : W) {
        for (int i = 0; i < 8; i++) { b.d[i] = _cvtss_sh((std::rand() % 1000) / 1e5f + 1e-4f, 0); b.dmin[i] = _cvtss_sh((std::rand() % 1000) / 1e5f, 0); }
        for (auto & x : b.scales) x = std::rand();
        for (auto & x : b.qs) x = std::rand();
    }
    std::vector<block_q8_K> A((size_t) 4 * nb);
    for (auto & a : A) {
        a.d = (std::rand() % 1000) / 1e4f + 1e-3f;
        for (auto & q : a.qs) q = (int8_t) (std::rand() % 256 - 128);
        for (int i = 0; i < 16; i++) { int s = 0; for (int j = 0; j < 16; j++) s += a.qs[16 * i + j]; a.bsums[i] = s; }
    }
    std::vector<float> s1((size_t) 4 * nc), s2((size_t) 4 * nc);
    for (int r = 0; r < RR; r++) ggml_gemv_q4_K_8x8_q8_K(n, s1.data() + r * nc, nc, W.data(), A.data() + r * nb, 1, nc);
    gemv_rows_q4_K_8x8_q8_K_vnni<RR>(n, s2.data(), nc, W.data(), A.data(), 0, nc);
    long differ = 0;
    for (int i = 0; i < RR * nc; i++) differ += std::memcmp(&s1[i], &s2[i], 4) != 0;
    std::printf("%d rows: %ld of %d results differ from gemv's\n", RR, differ, RR * nc);
    for (int threads : {1, 2}) {
        auto run = [&](bool vnni) {
            auto tic = std::chrono::steady_clock::now();
            for (int i = 0; i < reps; i++) {
#pragma omp parallel num_threads(threads)
                {
                    const int th = omp_get_thread_num(), per = (nc / 8 + threads - 1) / threads;
                    const int c0 = th * per * 8, c1 = std::min(nc, (th + 1) * per * 8);
                    const block_q4_Kx8 * w = W.data() + (size_t) (i % M) * nb * nc / 8 + (size_t) (c0 / 8) * nb;
                    if (c1 > c0) {
                        if (vnni) gemv_rows_q4_K_8x8_q8_K_vnni<RR>(n, s2.data() + c0, nc, w, A.data(), 0, c1 - c0);
                        else gemv_rows_q4_K_8x8_q8_K_R<RR>(n, s1.data() + c0, nc, w, A.data(), 0, c1 - c0);
                    }
                }
            }
            return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tic).count() / reps;
        };
        const double avx2 = run(false), vnni = run(true), avx2_again = run(false), vnni_again = run(true);
        std::printf("%d threads: AVX2 %.3f %.3f ms, VNNI %.3f %.3f ms\n", threads, avx2, avx2_again, vnni, vnni_again);
    }
    return differ != 0;
#endif
}
