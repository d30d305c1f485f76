// specdecode: batch-invariant rows for ggml's repacked Q4_K weights (x86 AVX2), inserted into
// ggml-cpu/arch/x86/repack.cpp by src/specdecode/models/llamacpp/invariant_patch.py.
//
// ggml multiplies repacked Q4_K weights by 1-3 activation rows with ggml_gemv_q4_K_8x8_q8_K and by
// groups of 4 with ggml_gemm_q4_K_8x8_q8_K, which adds its float partial sums in another order (per
// 64-value sub-block pair, not per 256-value super-block). So a row's result depends on how many
// rows share its pass. This kernel computes every row with exactly ggml_gemv_q4_K_8x8_q8_K's
// arithmetic (the same integer products and sums, the same float multiply-adds in the same order),
// so each row is bit for bit what a one-row pass gives, while the rows of a pass share the loading
// and unpacking of the weights. Row y's activations are the y-th block_q8_K row of vy (quantized by
// quantize_row_q8_K, as a one-row pass does), its nc outputs go to s + y * bs.
// Where the compiler targets VNNI, groups of 2-4 rows go through gemv_rows_q4_K_8x8_q8_K_vnni (below):
// other instructions, the same integers and float operations, so the same bits.
#if defined(__AVX2__)
// Sub-block pair sb's scales and mins of 8 repacked Q4_K columns, as gemv unpacks them (6 bits each
// from 12 bytes per 32-value sub-block): scales_0 / scales_1, the int16 scale of values 0-31 / 32-63
// twice per int32 lane in gemv's column order 0 4 1 5 2 6 3 7; mins_01, both sub-blocks' mins.
static inline void q4_K_8x8_scales(const uint8_t * scales, int sb, __m128i scalemask, __m256i * scales_0,
                                   __m256i * scales_1, __m256i * mins_01) {
    const uint32_t kmask1 = 0x3f3f3f3f;
    const uint32_t kmask2 = 0x0f0f0f0f;
    const uint32_t kmask3 = 0x03030303;
    uint32_t utmp_0[4], utmp_1[4];
    memcpy(utmp_0, scales + 24 * sb, 12);
    utmp_0[3] = ((utmp_0[2] >> 4) & kmask2) | (((utmp_0[1] >> 6) & kmask3) << 4);
    const uint32_t uaux_0 = utmp_0[1] & kmask1;
    utmp_0[1] = (utmp_0[2] & kmask2) | (((utmp_0[0] >> 6) & kmask3) << 4);
    utmp_0[2] = uaux_0;
    utmp_0[0] &= kmask1;
    memcpy(utmp_1, scales + 12 + sb * 24, 12);
    utmp_1[3] = ((utmp_1[2] >> 4) & kmask2) | (((utmp_1[1] >> 6) & kmask3) << 4);
    const uint32_t uaux_1 = utmp_1[1] & kmask1;
    utmp_1[1] = (utmp_1[2] & kmask2) | (((utmp_1[0] >> 6) & kmask3) << 4);
    utmp_1[2] = uaux_1;
    utmp_1[0] &= kmask1;
    const __m128i mins_and_scales_0 = _mm_set_epi32(utmp_0[3], utmp_0[2], utmp_0[1], utmp_0[0]);
    const __m128i mins_and_scales_1 = _mm_set_epi32(utmp_1[3], utmp_1[2], utmp_1[1], utmp_1[0]);
    *scales_0 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mins_and_scales_0, scalemask));
    *scales_1 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mins_and_scales_1, scalemask));
    *mins_01 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_shuffle_epi32(mins_and_scales_0, 78), _mm_shuffle_epi32(mins_and_scales_1, 78)));
}

// R rows (y0 .. y0 + R - 1) at once: R is a compile-time constant so that the rows' accumulators
// stay in registers.
template <int R>
static inline void gemv_rows_q4_K_8x8_q8_K_R(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int y0, int nc) {
    const int nb = n / QK_K;

    const __m128i deltamask = _mm_set_epi8(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
    const __m128i scalemask = _mm_set_epi8(7, 7, 3, 3, 6, 6, 2, 2, 5, 5, 1, 1, 4, 4, 0, 0);
    const __m256i finalpermutemask = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
    const __m256i m4b = _mm256_set1_epi8(0x0F);

    const block_q4_Kx8 * b_ptr_start = (const block_q4_Kx8 *) vx;
    const block_q8_K * a_ptr_start = (const block_q8_K *) vy;

    for (int64_t x = 0; x < nc / 8; x++) {
        const block_q4_Kx8 * b_ptr = b_ptr_start + (x * nb);
        __m256 acc_row[R];
        __m256 acc_min_rows[R];
        for (int r = 0; r < R; r++) {
            acc_row[r] = _mm256_setzero_ps();
            acc_min_rows[r] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const __m256 col_scale_f32 = GGML_F32Cx8_REARRANGE_LOAD(b_ptr[b].d, deltamask);
            const __m256 col_dmin_f32 = GGML_F32Cx8_LOAD(b_ptr[b].dmin);
            __m256i iacc_b[R];
            __m256i iacc_min_b[R];
            __m256i q8s[R];
            for (int r = 0; r < R; r++) {
                const block_q8_K * a = a_ptr_start + ((y0 + r) * nb) + b;
                iacc_b[r] = _mm256_setzero_si256();
                iacc_min_b[r] = _mm256_setzero_si256();
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *) (a->bsums));
                __m256i h = _mm256_castsi128_si256(_mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1)));
                q8s[r] = _mm256_permute2f128_si256(h, h, 0);
            }
            for (int sb = 0; sb < QK_K / 64; sb++) {
                const __m256i raw_0123_0 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + sb * 256));
                const __m256i raw_4567_0 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 32 + sb * 256));
                const __m256i raw_0123_1 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 64 + sb * 256));
                const __m256i raw_4567_1 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 96 + sb * 256));
                const __m256i raw_0123_2 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 128 + sb * 256));
                const __m256i raw_4567_2 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 160 + sb * 256));
                const __m256i raw_0123_3 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 192 + sb * 256));
                const __m256i raw_4567_3 = _mm256_loadu_si256((const __m256i *) (b_ptr[b].qs + 224 + sb * 256));

                const __m256i v0123_00 = _mm256_and_si256(raw_0123_0, m4b);
                const __m256i v4567_00 = _mm256_and_si256(raw_4567_0, m4b);
                const __m256i v0123_01 = _mm256_and_si256(raw_0123_1, m4b);
                const __m256i v4567_01 = _mm256_and_si256(raw_4567_1, m4b);
                const __m256i v0123_02 = _mm256_and_si256(raw_0123_2, m4b);
                const __m256i v4567_02 = _mm256_and_si256(raw_4567_2, m4b);
                const __m256i v0123_03 = _mm256_and_si256(raw_0123_3, m4b);
                const __m256i v4567_03 = _mm256_and_si256(raw_4567_3, m4b);
                const __m256i v0123_10 = _mm256_and_si256(_mm256_srli_epi16(raw_0123_0, 4), m4b);
                const __m256i v4567_10 = _mm256_and_si256(_mm256_srli_epi16(raw_4567_0, 4), m4b);
                const __m256i v0123_11 = _mm256_and_si256(_mm256_srli_epi16(raw_0123_1, 4), m4b);
                const __m256i v4567_11 = _mm256_and_si256(_mm256_srli_epi16(raw_4567_1, 4), m4b);
                const __m256i v0123_12 = _mm256_and_si256(_mm256_srli_epi16(raw_0123_2, 4), m4b);
                const __m256i v4567_12 = _mm256_and_si256(_mm256_srli_epi16(raw_4567_2, 4), m4b);
                const __m256i v0123_13 = _mm256_and_si256(_mm256_srli_epi16(raw_0123_3, 4), m4b);
                const __m256i v4567_13 = _mm256_and_si256(_mm256_srli_epi16(raw_4567_3, 4), m4b);

                // the weight operands of gemv's 16 maddubs, formed once for all rows
                __m256i w[16];
                w[0]  = _mm256_blend_epi32(v0123_00, _mm256_shuffle_epi32(v4567_00, 177), 170);
                w[1]  = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_00, 177), v4567_00, 170);
                w[2]  = _mm256_blend_epi32(v0123_01, _mm256_shuffle_epi32(v4567_01, 177), 170);
                w[3]  = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_01, 177), v4567_01, 170);
                w[4]  = _mm256_blend_epi32(v0123_02, _mm256_shuffle_epi32(v4567_02, 177), 170);
                w[5]  = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_02, 177), v4567_02, 170);
                w[6]  = _mm256_blend_epi32(v0123_03, _mm256_shuffle_epi32(v4567_03, 177), 170);
                w[7]  = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_03, 177), v4567_03, 170);
                w[8]  = _mm256_blend_epi32(v0123_10, _mm256_shuffle_epi32(v4567_10, 177), 170);
                w[9]  = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_10, 177), v4567_10, 170);
                w[10] = _mm256_blend_epi32(v0123_11, _mm256_shuffle_epi32(v4567_11, 177), 170);
                w[11] = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_11, 177), v4567_11, 170);
                w[12] = _mm256_blend_epi32(v0123_12, _mm256_shuffle_epi32(v4567_12, 177), 170);
                w[13] = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_12, 177), v4567_12, 170);
                w[14] = _mm256_blend_epi32(v0123_13, _mm256_shuffle_epi32(v4567_13, 177), 170);
                w[15] = _mm256_blend_epi32(_mm256_shuffle_epi32(v0123_13, 177), v4567_13, 170);

                __m256i scales_0, scales_1, mins_01;
                q4_K_8x8_scales(b_ptr[b].scales, sb, scalemask, &scales_0, &scales_1, &mins_01);

                for (int r = 0; r < R; r++) {
                    const block_q8_K * a = a_ptr_start + ((y0 + r) * nb) + b;
                    // gemv broadcasts the row's activations 4 bytes at a time (shuffle_epi32 of 16 loaded
                    // bytes); a broadcast load gives the same operands without the shuffle unit
                    const int8_t * q8 = a->qs + sb * 64;
                    __m256i iacc_0 = _mm256_setzero_si256();
                    __m256i iacc_1 = _mm256_setzero_si256();
                    for (int k = 0; k < 8; k++) {
                        int32_t a4;
                        memcpy(&a4, q8 + 4 * k, 4);
                        iacc_0 = _mm256_add_epi16(iacc_0, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(a4)));
                    }
                    iacc_0 = _mm256_madd_epi16(iacc_0, scales_0);
                    for (int k = 8; k < 16; k++) {
                        int32_t a4;
                        memcpy(&a4, q8 + 4 * k, 4);
                        iacc_1 = _mm256_add_epi16(iacc_1, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(a4)));
                    }
                    iacc_1 = _mm256_madd_epi16(iacc_1, scales_1);

                    const __m256i iacc_sb = _mm256_add_epi32(iacc_0, iacc_1);
                    const __m256i q8s_sb = _mm256_shuffle_epi32(q8s[r], 0);
                    const __m256i iacc_min_sb = _mm256_madd_epi16(q8s_sb, mins_01);
                    q8s[r] = _mm256_bsrli_epi128(q8s[r], 4);
                    iacc_b[r] = _mm256_add_epi32(iacc_b[r], iacc_sb);
                    iacc_min_b[r] = _mm256_add_epi32(iacc_min_b[r], iacc_min_sb);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 row_scale_f32 = _mm256_set1_ps((a_ptr_start + ((y0 + r) * nb) + b)->d);
                acc_row[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_b[r]), _mm256_mul_ps(col_scale_f32, row_scale_f32), acc_row[r]);
                acc_min_rows[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b[r]), _mm256_mul_ps(col_dmin_f32, row_scale_f32), acc_min_rows[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 acc = _mm256_permutevar8x32_ps(acc_row[r], finalpermutemask);
            _mm256_storeu_ps(s + ((y0 + r) * bs + x * 8), _mm256_sub_ps(acc, acc_min_rows[r]));
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDECODE_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define SPECDECODE_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#endif
#if defined(SPECDECODE_DPBUSD)
// R rows at once with VNNI's (AVX512-VNNI or AVX-VNNI) dot products of 4 unsigned x 4 signed bytes into int32 lanes, straight
// on the repacked layout: no rearranging of the weights (gemv's 32 blends and shuffles per 64
// values); instead the activations are broadcast 8 bytes at a time, so lane 2c / 2c + 1 of a
// product with 4 columns' raw bytes holds column c's first / last 4 values. The integer sums per
// column and 32-value sub-block are exact either way (no int16 saturation in gemv: at most
// 8 x 2 x 15 x 128 = 30720), so after the same scales the same float operations in the same order
// give gemv's result bit for bit.
template <int R>
static inline void gemv_rows_q4_K_8x8_q8_K_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int y0, int nc) {
    const int nb = n / QK_K;

    const __m128i deltamask = _mm_set_epi8(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
    const __m128i scalemask = _mm_set_epi8(7, 7, 3, 3, 6, 6, 2, 2, 5, 5, 1, 1, 4, 4, 0, 0);
    const __m256i finalpermutemask = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
    // hadd of (columns 0-3, 4-7) gives the columns in order 0 1 4 5 2 3 6 7; gemv's lanes hold 0 4 1 5 2 6 3 7
    const __m256i tohadd = _mm256_set_epi32(7, 5, 6, 4, 3, 1, 2, 0);
    const __m256i m4b = _mm256_set1_epi8(0x0F);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);

    const block_q4_Kx8 * b_ptr_start = (const block_q4_Kx8 *) vx;
    const block_q8_K * a_ptr_start = (const block_q8_K *) vy;

    for (int64_t x = 0; x < nc / 8; x++) {
        const block_q4_Kx8 * b_ptr = b_ptr_start + (x * nb);
        __m256 acc_row[R];
        __m256 acc_min_rows[R];
        for (int r = 0; r < R; r++) {
            acc_row[r] = _mm256_setzero_ps();
            acc_min_rows[r] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const __m256 col_scale_f32 = GGML_F32Cx8_REARRANGE_LOAD(b_ptr[b].d, deltamask);
            const __m256 col_dmin_f32 = GGML_F32Cx8_LOAD(b_ptr[b].dmin);
            __m256i iacc_b[R];  // in hadd's column order
            __m256i iacc_min_b[R];
            __m256i q8s[R];
            for (int r = 0; r < R; r++) {
                const block_q8_K * a = a_ptr_start + ((y0 + r) * nb) + b;
                iacc_b[r] = _mm256_setzero_si256();
                iacc_min_b[r] = _mm256_setzero_si256();
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *) (a->bsums));
                __m256i h = _mm256_castsi128_si256(_mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1)));
                q8s[r] = _mm256_permute2f128_si256(h, h, 0);
            }
            for (int sb = 0; sb < QK_K / 64; sb++) {
                const uint8_t * q = b_ptr[b].qs + sb * 256;
                __m256i lo[8], hi[8];  // [2j]: columns 0-3, [2j + 1]: columns 4-7, their bytes 8j .. 8j + 7
                for (int i = 0; i < 8; i++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *) (q + 32 * i));
                    lo[i] = _mm256_and_si256(raw, m4b);
                    hi[i] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4b);
                }

                __m256i scales_0, scales_1, mins_01;
                q4_K_8x8_scales(b_ptr[b].scales, sb, scalemask, &scales_0, &scales_1, &mins_01);
                // gemv's int16 scale pairs (one scale twice per int32 lane), as int32 in hadd's order
                const __m256i sc_0 = _mm256_permutevar8x32_epi32(_mm256_and_si256(scales_0, low16), tohadd);
                const __m256i sc_1 = _mm256_permutevar8x32_epi32(_mm256_and_si256(scales_1, low16), tohadd);

                for (int r = 0; r < R; r++) {
                    const block_q8_K * a = a_ptr_start + ((y0 + r) * nb) + b;
                    const int8_t * q8 = a->qs + sb * 64;
                    __m256i d0_0123 = _mm256_setzero_si256(), d0_4567 = _mm256_setzero_si256();
                    __m256i d1_0123 = _mm256_setzero_si256(), d1_4567 = _mm256_setzero_si256();
                    for (int j = 0; j < 4; j++) {
                        int64_t a8_0, a8_1;
                        memcpy(&a8_0, q8 + 8 * j, 8);       // values 8j .. 8j + 7: the low nibbles
                        memcpy(&a8_1, q8 + 32 + 8 * j, 8);  // values 32 + 8j ..: the high nibbles
                        const __m256i v0 = _mm256_set1_epi64x(a8_0);
                        const __m256i v1 = _mm256_set1_epi64x(a8_1);
                        d0_0123 = SPECDECODE_DPBUSD(d0_0123, lo[2 * j], v0);
                        d0_4567 = SPECDECODE_DPBUSD(d0_4567, lo[2 * j + 1], v0);
                        d1_0123 = SPECDECODE_DPBUSD(d1_0123, hi[2 * j], v1);
                        d1_4567 = SPECDECODE_DPBUSD(d1_4567, hi[2 * j + 1], v1);
                    }
                    const __m256i iacc_0 = _mm256_mullo_epi32(_mm256_hadd_epi32(d0_0123, d0_4567), sc_0);
                    const __m256i iacc_1 = _mm256_mullo_epi32(_mm256_hadd_epi32(d1_0123, d1_4567), sc_1);
                    const __m256i iacc_sb = _mm256_add_epi32(iacc_0, iacc_1);
                    const __m256i q8s_sb = _mm256_shuffle_epi32(q8s[r], 0);
                    const __m256i iacc_min_sb = _mm256_madd_epi16(q8s_sb, mins_01);
                    q8s[r] = _mm256_bsrli_epi128(q8s[r], 4);
                    iacc_b[r] = _mm256_add_epi32(iacc_b[r], iacc_sb);
                    iacc_min_b[r] = _mm256_add_epi32(iacc_min_b[r], iacc_min_sb);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i iacc = _mm256_permutevar8x32_epi32(iacc_b[r], tohadd);  // back to gemv's order
                const __m256 row_scale_f32 = _mm256_set1_ps((a_ptr_start + ((y0 + r) * nb) + b)->d);
                acc_row[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_mul_ps(col_scale_f32, row_scale_f32), acc_row[r]);
                acc_min_rows[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min_b[r]), _mm256_mul_ps(col_dmin_f32, row_scale_f32), acc_min_rows[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 acc = _mm256_permutevar8x32_ps(acc_row[r], finalpermutemask);
            _mm256_storeu_ps(s + ((y0 + r) * bs + x * 8), _mm256_sub_ps(acc, acc_min_rows[r]));
        }
    }
}
#endif  // SPECDECODE_DPBUSD

void ggml_gemv_rows_q4_K_8x8_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, int nr, int nc) {
    const block_q8_K * a = (const block_q8_K *) vy;
    const int nb = n / QK_K;
    int y0 = 0;
    for (; y0 + 4 <= nr; y0 += 4) {
#if defined(SPECDECODE_DPBUSD)
        // 2-4 rows with VNNI (the same bits): passes of 5-17 rows 5-12% faster in 2 of 3 rounds on
        // 2 threads of the AMD EPYC (lab/notebook/2026-11-28-vnni-rows.md); one row keeps ggml's own kernel (with
        // VNNI ~3% slower there: a one-row product is bound by memory, not arithmetic)
        gemv_rows_q4_K_8x8_q8_K_vnni<4>(n, s, bs, vx, vy, y0, nc);
#else
        gemv_rows_q4_K_8x8_q8_K_R<4>(n, s, bs, vx, vy, y0, nc);
#endif
    }
    switch (nr - y0) {
#if defined(SPECDECODE_DPBUSD)
        case 3: gemv_rows_q4_K_8x8_q8_K_vnni<3>(n, s, bs, vx, vy, y0, nc); break;
        case 2: gemv_rows_q4_K_8x8_q8_K_vnni<2>(n, s, bs, vx, vy, y0, nc); break;
#else
        case 3: gemv_rows_q4_K_8x8_q8_K_R<3>(n, s, bs, vx, vy, y0, nc); break;
        case 2: gemv_rows_q4_K_8x8_q8_K_R<2>(n, s, bs, vx, vy, y0, nc); break;
#endif
        case 1: ggml_gemv_q4_K_8x8_q8_K(n, s + y0 * bs, bs, vx, a + y0 * nb, 1, nc); break;  // ggml's own one-row kernel
        default: break;
    }
}
#endif  // __AVX2__
