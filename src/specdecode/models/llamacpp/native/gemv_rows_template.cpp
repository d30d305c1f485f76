// specdecode: inserted into ggml-cpu/repack.cpp (namespace ggml::cpu::repack, before gemm's template) by
// src/specdecode/models/llamacpp/invariant_patch.py. While ggml's reference-kernel switch is on,
// forward_mul_mat_one_chunk multiplies every activation row alone, as a one-row pass does: the x86
// AVX2 kernel for repacked Q4_K (gemv_rows_q4_K_8x8.cpp), every other repacked type's gemv row by row.
// specdecode: every row alone, as a one-row pass computes it (used while use_ref is on)
template <typename BLOC_TYPE, int64_t INTER_SIZE, int64_t NB_COLS, ggml_type PARAM_TYPE>
static void gemv_rows(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    const size_t row_bytes = ggml_row_size(PARAM_TYPE, n);
    for (int y = 0; y < nr; y++) {
        gemv<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>(n, s + y * bs, bs, vx, (const char *) vy + y * row_bytes, 1, nc);
    }
}

#if defined(__AVX2__) && (defined(__x86_64__) || defined(_M_X64))
template <> void gemv_rows<block_q4_K, 8, 8, GGML_TYPE_Q8_K>(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) {
    ggml_gemv_rows_q4_K_8x8_q8_K(n, s, bs, vx, vy, nr, nc);
}
#endif

