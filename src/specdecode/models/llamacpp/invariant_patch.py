"""Batch-invariant passes of any width on llama.cpp's CPU kernels: the patch the set-up applies.

Why. Exact mode needs every row of a verification pass to equal what a one-token pass computes,
bit for bit (docs/llamacpp.md, "Exact mode"). With ggml's reference-kernel switch on, flash
attention runs each query row alone and operator fusion is off; what was left is the matrix product
of repacked Q4_K weights (llama.cpp's default on x86 CPUs with AVX2): 1-3 activation rows go
through ``ggml_gemv_q4_K_8x8_q8_K``, groups of 4 through ``ggml_gemm_q4_K_8x8_q8_K``, which adds
its float partial sums per 64-value sub-block pair instead of per 256-value super-block and
quantizes the activations four rows at a time. So exact mode had to split verification into chunks
of at most 3 tokens, and on two cores a 3-token chunk costs ~2.6 one-token passes.

What. Twelve anchored edits of llama-cpp-python's vendored ggml in seven files (:func:`edits`),
applied to its source before the build (``build.py``):

- ``ggml-cpu/arch/x86/repack.cpp`` (declared in ``repack.h``) gets ``ggml_gemv_rows_q4_K_8x8_q8_K``
  (``native/gemv_rows_q4_K_8x8.cpp``): gemv's arithmetic, row by row, bit for bit, with the
  weights loaded and unpacked once for every 4 rows; where the compiler targets VNNI (AVX512-VNNI
  with AVX512VL, or AVX-VNNI), groups of 2-4 rows take VNNI's 4-byte dot products straight on
  the repacked bytes (the activations broadcast 8 bytes at a time, no rearranging of the
  weights): the integer sums are exact either way, so the bits are gemv's, and passes of 5-17
  rows cost 5-12% less in two of three rounds on 2 threads of the AMD EPYC, the same in the
  third (one row keeps ggml's own kernel);
- ``ggml-cpu/repack.cpp`` (``native/gemv_rows_template.cpp`` and two edits of the product's
  chunk and quantization): while the reference-kernel switch is on (``params->use_ref``), a
  repacked matrix product quantizes every activation row alone (``quantize_row_q8_K``, as one row
  is) and multiplies all rows with that kernel (other repacked types: their gemv, row by row);
  with the switch off nothing changes;
- ``ggml-cpu/arch/x86/quants.c`` (declared in ``quants.h``) gets ``ggml_vec_dot_rows_q6_K_q8_K``
  (``native/vec_dot_rows_q6_K.c``) and ``ggml-cpu/ggml-cpu.c``'s product of weights that are not
  repacked uses it while the switch is on (``native/mul_mat_rows_q6_K.c``): Q6_K weights (the
  default target's LM head and half its ``ffn_down``) were already multiplied row by row, each
  row alone, by ``ggml_vec_dot_q6_K_q8_K``; the kernel does that arithmetic for up to 4 rows,
  bit for bit, unpacking the weights once;
- ``ggml-cpu/ops.cpp`` (``native/flash_attn_rows.cpp``): while the switch is on, flash attention
  with F16 K and V still computes every query row and head alone on one thread (what makes it
  batch-invariant), but by blocks of 64 cached positions: vectorized exponentials and an FP32
  accumulator instead of a scalar ``expf`` and an FP16 multiply-add per position (its numbers
  differ from ggml's reference path in the last bits, the same in every pass of every width);
- ``ggml-cpu/ggml-cpu.cpp``: the CPU backend's registry answers
  :data:`MARKER` (``ggml_backend_reg_get_proc_address``), so the runner can tell a patched build
  (:func:`specdecode.models.llamacpp.kernels.invariant_rows`) and verify any width in one pass.

An edit whose anchor text is missing (another llama.cpp version) fails the whole patch with a
message; the set-up then builds the source as it is, and exact mode keeps its 3-token chunks.

Standard library only (``build.py`` imports it before specdecode is installed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

MARKER = "ggml_backend_cpu_specdecode_invariant_rows"
"""The name a patched CPU backend's registry answers (an ``int (void)`` returning :data:`VERSION`)."""

VERSION = 4
"""What the marker function returns: this patch's version (2: Q6_K rows share their weights; 3: the
reference switch's attention by blocks of positions; 4: 2-4 rows of repacked Q4_K by VNNI dot
products where the CPU has them, the same bits)."""

NATIVE = Path(__file__).parent / "native"
KERNEL_FILE = NATIVE / "gemv_rows_q4_K_8x8.cpp"
"""The AVX2 kernel inserted into ggml-cpu/arch/x86/repack.cpp."""
TEMPLATE_FILE = NATIVE / "gemv_rows_template.cpp"
"""``gemv_rows``, the templates inserted into ggml-cpu/repack.cpp."""

Q6_K_KERNEL_FILE = NATIVE / "vec_dot_rows_q6_K.c"
"""The AVX2 kernel inserted into ggml-cpu/arch/x86/quants.c."""
Q6_K_HOOK_FILE = NATIVE / "mul_mat_rows_q6_K.c"
"""Its use, inserted into ggml-cpu/ggml-cpu.c's ``ggml_compute_forward_mul_mat_one_chunk``."""
ATTENTION_FILE = NATIVE / "flash_attn_rows.cpp"
"""The reference switch's attention by blocks of positions, inserted into ggml-cpu/ops.cpp."""

GGML_CPU = Path("vendor/llama.cpp/ggml/src/ggml-cpu")
"""ggml's CPU backend inside llama-cpp-python's source tree."""


@dataclass(frozen=True)
class Edit:
    """Insert ``text`` into ``path`` before (or, with ``after``, after) the only occurrence of
    ``anchor``; with ``replace``, ``text`` replaces the anchor."""

    path: Path
    anchor: str
    text: str
    after: bool = False
    replace: bool = False


_ROWS_DECL = (
    "\nvoid ggml_gemv_rows_q4_K_8x8_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,"
    " const void * GGML_RESTRICT vy, int nr, int nc);"
)


_Q6_K_DECL = """
#if defined(__AVX2__) && (defined(__x86_64__) || defined(_M_X64))
// specdecode: nr (1-4) activation rows at vy + r * by against one Q6_K weight row, each bit for bit
// ggml_vec_dot_q6_K_q8_K's result, the weights unpacked once (arch/x86/quants.c)
#define GGML_SPECDECODE_Q6_K_ROWS 1
void ggml_vec_dot_rows_q6_K_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                 const void * GGML_RESTRICT vy, size_t by, int nr);
#endif"""

_VEC_DOT_Q6_K = (
    "void ggml_vec_dot_q6_K_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,"
    " size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);"
)

_MUL_MAT_TILE = """    // attempt to reduce false-sharing (does not seem to make a difference)
    // 16 * 2, accounting for mmla kernels
    float tmp[32];
"""

_ATTENTION_CALL = (
    "                ggml_compute_forward_flash_attn_ext_f16_one_chunk(params, dst, ir0, ir1, 0, nek1, nullptr, 0);"
)

_ATTENTION_ROWS = """                if (use_ref && specdecode_flash_attn_rows_fits(dst)) {  // specdecode
                    specdecode_flash_attn_rows(params, dst, ir0, ir1);
                } else
"""

_ONE_CHUNK = """        if (params->use_ref) {  // specdecode: batch-invariant rows
            gemv_rows<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>(ne00, (float *) (dst_ptr) + src0_start, nb1 / nb0,
                                                                  src0_ptr + src0_start * nb01, src1_ptr, nrows, ncols);
            return;
        }
"""

_QUANTIZE_OLD = """            for (int64_t i11 = ith * 4; i11 < ne11 - ne11 % 4; i11 += nth * 4) {
                ggml_quantize_mat_t<INTER_SIZE, PARAM_TYPE>((float *) (data_ptr + i11 * nb11),
                                                            (void *) (wdata_ptr + i11 * nbw1), 4, ne10);
            }

            const int64_t i11_processed = ne11 - ne11 % 4;"""

_QUANTIZE_NEW = """            // specdecode: with use_ref every row is quantized alone (as a one-row pass quantizes it)
            const int64_t n_grouped = params->use_ref ? 0 : ne11 - ne11 % 4;
            for (int64_t i11 = ith * 4; i11 < n_grouped; i11 += nth * 4) {
                ggml_quantize_mat_t<INTER_SIZE, PARAM_TYPE>((float *) (data_ptr + i11 * nb11),
                                                            (void *) (wdata_ptr + i11 * nbw1), 4, ne10);
            }

            const int64_t i11_processed = n_grouped;"""

_MARKER_FN = f"""// specdecode: this build's repacked matrix products are batch-invariant while use_ref is on
static int ggml_backend_cpu_specdecode_invariant_rows(void) {{
    return {VERSION};
}}

"""

_MARKER_PROC = f"""    if (strcmp(name, "{MARKER}") == 0) {{
        return (void *)ggml_backend_cpu_specdecode_invariant_rows;
    }}
"""


def edits() -> tuple[Edit, ...]:
    """The patch's edits, paths relative to llama-cpp-python's source root."""
    return (
        Edit(
            GGML_CPU / "repack.h",
            "void ggml_gemv_q4_K_8x8_q8_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,"
            " const void * GGML_RESTRICT vy, int nr, int nc);",
            _ROWS_DECL,
            after=True,
        ),
        Edit(GGML_CPU / "arch/x86/repack.cpp", "void ggml_gemv_iq4_nl_8x8_q8_0(", KERNEL_FILE.read_text() + "\n"),
        Edit(GGML_CPU / "repack.cpp", "// gemm\ntemplate <typename BLOC_TYPE", TEMPLATE_FILE.read_text() + "\n"),
        Edit(GGML_CPU / "repack.cpp", "        // If there are more than three rows in src1, use gemm;", _ONE_CHUNK),
        Edit(GGML_CPU / "repack.cpp", _QUANTIZE_OLD, _QUANTIZE_NEW, replace=True),
        Edit(GGML_CPU / "quants.h", _VEC_DOT_Q6_K, _Q6_K_DECL, after=True),
        Edit(
            GGML_CPU / "arch/x86/quants.c",
            "#if defined (__AVX__) || defined (__AVX2__)\nstatic const int8_t keven_signs_q2xs[1024]",
            Q6_K_KERNEL_FILE.read_text() + "\n",
        ),
        Edit(GGML_CPU / "ggml-cpu.c", _MUL_MAT_TILE, Q6_K_HOOK_FILE.read_text(), after=True),
        Edit(
            GGML_CPU / "ops.cpp",
            "static void ggml_compute_forward_flash_attn_ext_f16(\n",
            ATTENTION_FILE.read_text(),
        ),
        Edit(GGML_CPU / "ops.cpp", _ATTENTION_CALL, _ATTENTION_ROWS),
        Edit(GGML_CPU / "ggml-cpu.cpp", "static void * ggml_backend_cpu_get_proc_address(", _MARKER_FN),
        Edit(GGML_CPU / "ggml-cpu.cpp", '    if (strcmp(name, "ggml_backend_cpu_set_use_ref") == 0) {', _MARKER_PROC),
    )


def fingerprint() -> str:
    """A short hash of the patch (its edits and kernel): part of the build's cache key."""
    digest = hashlib.sha256()
    for edit in edits():
        digest.update(repr(edit).encode())
    return digest.hexdigest()[:12]


class PatchError(RuntimeError):
    """An edit's anchor is missing or not unique in the source (another llama.cpp version)."""


def apply(source: str | Path) -> None:
    """Apply every edit to llama-cpp-python's unpacked source tree ``source``, or none.

    Raises:
        PatchError: an anchor is missing or found more than once; no file was changed.
    """
    root = Path(source)
    texts: dict[Path, str] = {}
    for edit in edits():
        path = root / edit.path
        if path not in texts:
            if not path.is_file():
                raise PatchError(f"invariant patch: {edit.path} not in {root}")
            texts[path] = path.read_text()
        text = texts[path]
        count = text.count(edit.anchor)
        if count != 1:
            raise PatchError(f"invariant patch: anchor {edit.anchor[:60]!r} found {count} times in {edit.path}")
        at = text.index(edit.anchor)
        if edit.replace:
            texts[path] = text[:at] + edit.text + text[at + len(edit.anchor) :]
        elif edit.after:
            end = at + len(edit.anchor)
            texts[path] = text[:end] + edit.text + text[end:]
        else:
            texts[path] = text[:at] + edit.text + text[at:]
    for path, text in texts.items():
        path.write_text(text)
