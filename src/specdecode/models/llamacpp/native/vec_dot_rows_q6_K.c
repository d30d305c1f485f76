// specdecode: the rows of a Q6_K matrix product that share their weights (x86 AVX2), inserted into
// ggml-cpu/arch/x86/quants.c by src/specdecode/models/llamacpp/invariant_patch.py.
//
// ggml multiplies Q6_K weights (not repacked) by each activation row alone, one ggml_vec_dot_q6_K_q8_K
// call per weight row and activation row, so every product is already batch-invariant, but the
// weights are unpacked (6-bit values from ql/qh, the sub-block scales) once per activation row.
// This computes nr (1-4) activation rows against one weight row with exactly ggml_vec_dot_q6_K_q8_K's
// arithmetic for each (the same integer sums, the same float multiply-adds in the same order and the
// same horizontal sum), unpacking the weights once: s[r * bs] is, bit for bit, what
// ggml_vec_dot_q6_K_q8_K gives for the activation row at vy + r * by.
#if defined __AVX2__
static inline __attribute__((always_inline)) void ggml_vec_dot_rows_q6_K_q8_K_R(const int n, float * GGML_RESTRICT s, const size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, const size_t by, const int R) {
    const block_q6_K * GGML_RESTRICT x = vx;
    const int nb = n / QK_K;

    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);

    __m256 acc[4];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
    }

    for (int i = 0; i < nb; ++i) {
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const uint8_t * GGML_RESTRICT q4 = x[i].ql;
        const uint8_t * GGML_RESTRICT qh = x[i].qh;
        const __m128i scales = _mm_loadu_si128((const __m128i*)x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);

        __m256i sumi[4];
        for (int r = 0; r < R; ++r) {
            sumi[r] = _mm256_setzero_si256();
        }

        int is = 0;
        for (int j = 0; j < QK_K/128; ++j) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i*)qh); qh += 32;

            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);

            const __m256i q4_0 = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            const __m256i q4_1 = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            const __m256i q4_2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            const __m256i q4_3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);

            const __m256i scale_0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + 0)));
            const __m256i scale_1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + 1)));
            const __m256i scale_2 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + 2)));
            const __m256i scale_3 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + 3)));
            is += 4;

            for (int r = 0; r < R; ++r) {
                const int8_t * GGML_RESTRICT q8 = ((const block_q8_K *)((const char *)vy + r * by))[i].qs + j * 128;
                const __m256i p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q4_0, _mm256_loadu_si256((const __m256i*)(q8 + 0))));
                const __m256i p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q4_1, _mm256_loadu_si256((const __m256i*)(q8 + 32))));
                const __m256i p16_2 = _mm256_madd_epi16(scale_2, _mm256_maddubs_epi16(q4_2, _mm256_loadu_si256((const __m256i*)(q8 + 64))));
                const __m256i p16_3 = _mm256_madd_epi16(scale_3, _mm256_maddubs_epi16(q4_3, _mm256_loadu_si256((const __m256i*)(q8 + 96))));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16_0, p16_1));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16_2, p16_3));
            }
        }

        for (int r = 0; r < R; ++r) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *)((const char *)vy + r * by) + i;
            const float d = y->d * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const __m256i sumi_r = _mm256_sub_epi32(sumi[r], q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi_r), acc[r]);
        }
    }

    for (int r = 0; r < R; ++r) {
        s[r * bs] = hsum_float_8(acc[r]);
    }
}

void ggml_vec_dot_rows_q6_K_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by, int nr) {
    switch (nr) {
        case 4: ggml_vec_dot_rows_q6_K_q8_K_R(n, s, bs, vx, vy, by, 4); break;
        case 3: ggml_vec_dot_rows_q6_K_q8_K_R(n, s, bs, vx, vy, by, 3); break;
        case 2: ggml_vec_dot_rows_q6_K_q8_K_R(n, s, bs, vx, vy, by, 2); break;
        default: ggml_vec_dot_q6_K_q8_K(n, s, bs, vx, 0, vy, by, 1); break;  // ggml's own, one row
    }
}
#endif  // __AVX2__
