// specdecode: attention for the reference-kernel switch, inserted into ggml-cpu/ops.cpp (before
// ggml_compute_forward_flash_attn_ext_f16) by src/specdecode/models/llamacpp/invariant_patch.py.
//
// While use_ref is on, ggml computes flash attention one query row (and head) at a time, on one
// thread, in ggml_compute_forward_flash_attn_ext_f16_one_chunk: per cached position a dot product,
// a scalar expf and a multiply-add into an FP16 accumulator. Every row is computed alone, so the
// result is batch-invariant, which exact mode's one-token passes and its verification passes rely
// on. This function keeps that: each (query row, head) alone on one thread, in the same order
// whatever else the pass holds, but per block of 64 cached positions: the block's scores
// (ggml's own K dot product), one rescale of the FP32 accumulator where the block raises the
// maximum, the block's exponentials vectorized (ggml_vec_soft_max_f32) and the V rows added into an
// FP32 accumulator held in registers (x86 F16C; elsewhere ggml's conversions and vec_mad_f32).
// It is the online softmax of the reference path (Rabe & Staats, arXiv:2112.05682) by blocks, as
// FlashAttention (Dao et al., arXiv:2205.14135) tiles it. Called only for F16 K and V, F32 Q, no
// logit softcap and no attention sinks (the caller checks: specdecode_flash_attn_rows_fits).
static bool specdecode_flash_attn_rows_fits(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    float logit_softcap = 0.0f;
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 &&
           dst->src[4] == nullptr && logit_softcap == 0.0f;
}

static void specdecode_flash_attn_rows(const ggml_compute_params * params, ggml_tensor * dst, int ir0, int ir1) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(int64_t, nev, v,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t DK = nek0;
    const int64_t DV = nev0;

    const int64_t rk2 = neq2/nek2;
    const int64_t rk3 = neq3/nek3;
    const int64_t rv2 = neq2/nev2;
    const int64_t rv3 = neq3/nev3;

    float scale    = 1.0f;
    float max_bias = 0.0f;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    ggml_vec_dot_t const kq_vec_dot = ggml_get_type_traits_cpu(GGML_TYPE_F16)->vec_dot;

    // the reference path's per-thread scratch: an FP32 accumulator, an FP32 V row, Q in FP16
    float       * VKQ32 = (float *) params->wdata + params->ith*(1*DK + 2*DV + CACHE_LINE_SIZE_F32);
    float       * V32   = VKQ32 + 1*DV;
    ggml_fp16_t * Q_q   = (ggml_fp16_t *) (VKQ32 + 2*DV);

    constexpr int64_t BLOCK = 64;
    float scores[BLOCK];
    float weights[BLOCK];

    for (int ir = ir0; ir < ir1; ++ir) {
        const int iq3 = ir/(neq2*neq1);
        const int iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);

        const uint32_t h = iq2;
        const float slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;

        const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *)((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : NULL;

        const int ik3 = iq3 / rk3;
        const int ik2 = iq2 / rk2;
        const int iv3 = iq3 / rv3;
        const int iv2 = iq2 / rv2;

        const float * pq = (const float *) ((const char *) q->data + (iq1*nbq1 + iq2*nbq2 + iq3*nbq3));
        ggml_cpu_fp32_to_fp16(pq, Q_q, DK);

        memset(VKQ32, 0, DV*sizeof(float));
        float M = -INFINITY;  // the largest score so far
        float S = 0.0f;       // the sum of exp(score - M) so far

        for (int64_t ic0 = 0; ic0 < nek1; ic0 += BLOCK) {
            const int n = (int) MIN(BLOCK, nek1 - ic0);
            float block_max = -INFINITY;
            for (int j = 0; j < n; ++j) {
                const int64_t ic = ic0 + j;
                const float mv = mp ? slope*GGML_CPU_FP16_TO_FP32(mp[ic]) : 0.0f;
                if (mv == -INFINITY) {
                    scores[j] = -INFINITY;
                    continue;
                }
                float s;
                kq_vec_dot(DK, &s, 0, (const char *) k->data + (ic*nbk1 + ik2*nbk2 + ik3*nbk3), 0, Q_q, 0, 1);
                s = s*scale + mv;
                scores[j] = s;
                block_max = MAX(block_max, s);
            }
            if (block_max == -INFINITY) {
                continue;  // every position of the block masked
            }
            if (block_max > M) {
                const float ms = expf(M - block_max);  // 0 for the first block
                ggml_vec_scale_f32(DV, VKQ32, ms);
                S *= ms;
                M = block_max;
            }
            S += (float) ggml_vec_soft_max_f32(n, weights, scores, M);  // weights[j] = exp(scores[j] - M)

            const char * v_base = (const char *) v->data + ic0*nbv1 + iv2*nbv2 + iv3*nbv3;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
            if (DV % 64 == 0) {
                for (int64_t d0 = 0; d0 < DV; d0 += 64) {
                    __m256 acc[8];
                    for (int u = 0; u < 8; ++u) {
                        acc[u] = _mm256_loadu_ps(VKQ32 + d0 + 8*u);
                    }
                    for (int j = 0; j < n; ++j) {
                        if (weights[j] == 0.0f) {
                            continue;
                        }
                        const __m256 w = _mm256_set1_ps(weights[j]);
                        const ggml_fp16_t * vr = (const ggml_fp16_t *) (v_base + j*nbv1) + d0;
                        for (int u = 0; u < 8; ++u) {
                            const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (vr + 8*u)));
                            acc[u] = _mm256_fmadd_ps(vv, w, acc[u]);
                        }
                    }
                    for (int u = 0; u < 8; ++u) {
                        _mm256_storeu_ps(VKQ32 + d0 + 8*u, acc[u]);
                    }
                }
                continue;
            }
#endif
            for (int j = 0; j < n; ++j) {
                if (weights[j] == 0.0f) {
                    continue;
                }
                ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) (v_base + j*nbv1), V32, DV);
                ggml_vec_mad_f32(DV, VKQ32, V32, weights[j]);
            }
        }

        const float S_inv = S == 0.0f ? 0.0f : 1.0f/S;
        ggml_vec_scale_f32(DV, VKQ32, S_inv);

        // permute(0, 2, 1, 3), as the reference path writes it
        memcpy((char *) dst->data + (iq3*ne2*ne1 + iq2 + iq1*ne1)*nb1, VKQ32, nb1);
    }
}

