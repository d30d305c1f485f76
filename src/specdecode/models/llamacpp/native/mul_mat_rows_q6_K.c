
#ifdef GGML_SPECDECODE_Q6_K_ROWS
    // specdecode: inserted into ggml_compute_forward_mul_mat_one_chunk (ggml-cpu/ggml-cpu.c) by
    // src/specdecode/models/llamacpp/invariant_patch.py. While use_ref is on, a 2-D product of Q6_K
    // weights meets up to 4 activation rows at once (ggml_vec_dot_rows_q6_K_q8_K), every result bit
    // for bit what vec_dot gives its row alone, in the same 16 x 16 tiles as below.
    if (params->use_ref && type == GGML_TYPE_Q6_K && num_rows_per_vec_dot == 1 && ne02 == 1 && ne03 == 1 &&
        ne12 == 1 && ne13 == 1 && (src1_cont || src1->type != vec_dot_type)) {
        float tmp4[4 * 16];
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
            const int64_t ir1_stop = MIN(iir1 + blck_1, ir1_end);
            for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += blck_0) {
                const int64_t ir0_stop = MIN(iir0 + blck_0, ir0_end);
                for (int64_t ir1 = iir1; ir1 < ir1_stop; ir1 += 4) {
                    const int nr = (int) MIN(4, ir1_stop - ir1);
                    const char * src1_col = (const char *) wdata + ir1 * row_size;
                    for (int64_t ir0 = iir0; ir0 < ir0_stop; ++ir0) {
                        ggml_vec_dot_rows_q6_K_q8_K(ne00, &tmp4[ir0 - iir0], 16, (const char *) src0->data + ir0 * nb01,
                                                    src1_col, row_size, nr);
                    }
                    for (int cn = 0; cn < nr; ++cn) {
                        float * dst_col = (float *) ((char *) dst->data + (ir1 + cn) * nb1);
                        memcpy(&dst_col[iir0], tmp4 + cn * 16, (ir0_stop - iir0) * sizeof(float));
                    }
                }
            }
        }
        return;
    }
#endif
