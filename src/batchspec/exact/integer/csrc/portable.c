/* batchspec's native kernels in plain C for any CPU with a C compiler and OpenMP (native.py's "portable" build: an
 * x86-64 CPU without AVX2, aarch64, any other architecture), compiled with -ffp-contract=off and no instruction-set
 * flags: the compiler vectorizes the loops below for whatever the target's baseline is (SSE2 on x86-64, NEON on
 * aarch64). Every float operation is one correctly rounded IEEE operation, the one its scalar twin in scalar.h runs,
 * in the same order; every integer sum is exact, so in any order. So this build gives the bits of avx512.c's and
 * avx2.c's and of the torch code they replace.
 *
 * 1. The int8 product (entry.h's batchspec_linear): q . w summed as such, q = code - 128 read from the codes as they
 * are (no zero point to subtract: the integer the SIMD builds reach as sum(code w) - comp), on the weight prepacked
 * as theirs ([P, G, 64, 4] int8). A group's four products of one output are added as two int16 pairs (|q w| <= 127 *
 * 127, so a pair's sum fits in int16: the shape of a 16-bit multiply-add), the pairs into int32 (|q . w| <= 127 *
 * 127 * K < 2^31 for K <= MAX_INNER, native.py); each output then as scalar.h's epilogue_value. ROWS rows share each
 * pass over a panel. */
#include "scalar.h"

/* The bits below need each float operation rounded to its own type: a target that evaluates floats in wider
 * registers (x87) would round differently, and fails to build instead (native.py then runs the torch path). */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the portable build needs FLT_EVAL_METHOD == 0 (each float operation rounded to float)"
#endif

#define ROWS 8 /* rows a pass over a panel of the int8 weight */
typedef uint8_t activation_t; /* entry.h's batchspec_linear hands panel_block the codes as they are */
#define WIDE_CODES 0

/* acc[r][j] = q[r] . w[j] for the 64 outputs j of one panel and rows r < count (codes a, row stride lda): each
 * group's weights laid out by input position as int16 once (wide[i][j] = w[j][i]), then multiplied by every row's
 * four codes, contiguous vectors whatever the vector width */
static void panel_dots(const uint8_t *a, int64_t count, int64_t lda, const int8_t *panel, int64_t groups,
                       int32_t acc[ROWS][PANEL]) {
    int16_t wide[4][PANEL];
    memset(acc, 0, sizeof(int32_t) * ROWS * PANEL);
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 4 * PANEL;
        for (int j = 0; j < PANEL; j++)
            for (int i = 0; i < 4; i++) wide[i][j] = w[4 * j + i];
        for (int64_t r = 0; r < count; r++) {
            const uint8_t *x = a + r * lda + 4 * g;
            int16_t x0 = (int16_t)(x[0] - 128), x1 = (int16_t)(x[1] - 128);
            int16_t x2 = (int16_t)(x[2] - 128), x3 = (int16_t)(x[3] - 128);
            int32_t *sums = acc[r];
            for (int j = 0; j < PANEL; j++)
                sums[j] += (int16_t)(x0 * wide[0][j] + x1 * wide[1][j]) + (int16_t)(x2 * wide[2][j] + x3 * wide[3][j]);
        }
    }
}

/* one panel's outputs (col .. col + valid - 1) for `rows` rows, ROWS at a time */
static void panel_block(const activation_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    int32_t acc[ROWS][PANEL];
    for (int64_t r = 0; r < rows; r += ROWS) {
        int64_t count = rows - r < ROWS ? rows - r : ROWS;
        panel_dots(a + r * lda, count, lda, panel, groups, acc);
        for (int64_t i = 0; i < count; i++)
            for (int64_t j = 0; j < valid; j++) {
                int64_t at = (r + i) * ldo + j;
                out[at] = epilogue_value(acc[i][j], e.row_scale[r + i], e, col + j,
                                         e.residual ? e.residual + at : NULL);
            }
    }
}

/* 2. One row quantized to the product's codes (entry.h's batchspec_quantize): scalar.h's token_scale (the maximum of
 * |x|'s bits, exact in any order) and row_codes */
static void quantize_values(const float *x, int64_t k, int64_t ldc, uint8_t *codes, float *scale) {
    row_codes(x, k, ldc, token_scale(x, k, 127.0f), codes, scale);
}

/* 2b. arithmetic.py's exact_silu (scalar.h's silu_value), times up where up is not NULL */
static void silu_values(const float *x, const float *up, float *out, int64_t k, const float *c) {
    for (int64_t i = 0; i < k; i++) {
        float y = silu_value(x[i], c);
        out[i] = up ? y * up[i] : y;
    }
}

/* 3. The exact attention of one GQA group: scalar.h's plain C, as the avx2 build runs it */
#define attend_group plain_attend_group

/* 4. The int4 product (entry.h's batchspec_linear4): the weight as scalar.h lays it out, one panel of 16 outputs at
 * a time, ROWS4 rows sharing each pass over it. A sub-block's nibbles times the codes: a group's eight products of
 * one output (|n q| <= 15 * 127 each, 15,240 in all) summed in int16, the four groups in int32, then scaled by the
 * sub-block's sc into i1 (subs > 1; the sum itself where subs == 1); i2 from the mins and the codes' sub-block sums;
 * then scalar.h's float steps, d and dmin read with half_to_float (the bits of vcvtph2ps). */
#define ROWS4 4
#define PANELS4 1 /* panels a pass */

/* dots[r][j] = n[j] . q[r] over one sub-block (its nibbles [4][16][4], 32 codes of row r at q + r * ldq), a group's
 * eight products of an output summed in int16. (Laying a group's nibbles out by input as int16 first, as panel_dots
 * does the int8 weight, was slower here: 1.4 against 1.2 ms for one row of a 1536 x 8960 weight, 2 threads.) */
static void sub_block_dots(const int8_t *q, int64_t count, int64_t ldq, const uint8_t *nibbles,
                           int32_t dots[ROWS4][PANEL4]) {
    memset(dots, 0, sizeof(int32_t) * ROWS4 * PANEL4);
    for (int64_t g = 0; g < 4; g++) {
        const uint8_t *bytes = nibbles + 64 * g;
        for (int64_t r = 0; r < count; r++) {
            const int8_t *x = q + r * ldq + 8 * g;
            for (int j = 0; j < PANEL4; j++) {
                const uint8_t *b = bytes + 4 * j;
                dots[r][j] += (int16_t)((b[0] & 15) * x[0] + (b[1] & 15) * x[1] + (b[2] & 15) * x[2] +
                                        (b[3] & 15) * x[3] + (b[0] >> 4) * x[4] + (b[1] >> 4) * x[5] +
                                        (b[2] >> 4) * x[6] + (b[3] >> 4) * x[7]);
            }
        }
    }
}

/* i2 = sum_s mn[s] * sums[s] of one output j over a super-block's `even` sub-blocks (mins [even / 2][16][2]) */
static inline int32_t min_sum(const uint8_t *mins, const int16_t *sums, int64_t even, int j) {
    int32_t total = 0;
    for (int64_t p = 0; p < even / 2; p++)
        total += mins[32 * p + 2 * j] * sums[2 * p] + mins[32 * p + 2 * j + 1] * sums[2 * p + 1];
    return total;
}

/* the panel's outputs for rows r < count, into y[r][0 .. 16): y = y + (((float)i1 * d - (float)i2 * dmin) * scale)
 * over the super-blocks in order, from y = 0 */
static void panel4_rows(int64_t count, const int8_t *q, int64_t ldq, const float *xs, int64_t ldx,
                        const int16_t *sums, int64_t lds, const uint8_t *panel, int64_t nsub, int64_t subs,
                        float y[ROWS4][PANEL4]) {
    memset(y, 0, sizeof(float) * ROWS4 * PANEL4);
    const uint8_t *block = panel;
    for (int64_t b = 0, sub0 = 0; sub0 < nsub; b++, sub0 += subs) {
        int64_t subs_here = nsub - sub0 < subs ? nsub - sub0 : subs, even = (subs_here + 1) / 2 * 2;
        const uint8_t *scales = block + 64, *mins = scales + 16 * even;
        const uint8_t *nibbles = subs > 1 ? mins + 16 * even : block + 64;
        int32_t i1[ROWS4][PANEL4], dots[ROWS4][PANEL4];
        memset(i1, 0, sizeof i1);
        for (int64_t s = 0; s < subs_here; s++) {
            sub_block_dots(q + 32 * (sub0 + s), count, ldq, nibbles + 256 * s, dots);
            for (int64_t r = 0; r < count; r++)
                for (int j = 0; j < PANEL4; j++) i1[r][j] += subs > 1 ? scales[16 * s + j] * dots[r][j] : dots[r][j];
        }
        float d[PANEL4], dmin[PANEL4];
        for (int j = 0; j < PANEL4; j++) {
            uint16_t bits[2];
            memcpy(&bits[0], block + 2 * j, sizeof bits[0]);
            memcpy(&bits[1], block + 32 + 2 * j, sizeof bits[1]);
            d[j] = half_to_float(bits[0]);
            dmin[j] = half_to_float(bits[1]);
        }
        for (int64_t r = 0; r < count; r++) {
            const int16_t *row_sums = sums + r * lds + sub0;
            float scale = xs[r * ldx + b];
            for (int j = 0; j < PANEL4; j++) {
                int32_t i2 = subs > 1 ? min_sum(mins, row_sums, even, j) : row_sums[0];
                float t = (float)i1[r][j] * d[j] - (float)i2 * dmin[j];
                y[r][j] = y[r][j] + t * scale;
            }
        }
        block += super_block_bytes(subs_here, subs);
    }
}

/* one panel's outputs (entry.h's batchspec_linear4 hands it one at a time): ROWS4 rows a pass, then y + bias, then
 * residual + y, to the panel's valid columns */
static void panels4_block(const int8_t *q, int64_t rows, int64_t ldq, const float *xs, int64_t ldx,
                          const int16_t *sums, int64_t lds, const uint8_t *panel, int64_t panel_bytes, int64_t count,
                          int64_t nsub, int64_t subs, const out4_t *where) {
    (void)panel_bytes, (void)count;
    float y[ROWS4][PANEL4];
    for (int64_t r = 0; r < rows; r += ROWS4) {
        int64_t n = rows - r < ROWS4 ? rows - r : ROWS4;
        panel4_rows(n, q + r * ldq, ldq, xs + r * ldx, ldx, sums + r * lds, lds, panel, nsub, subs, y);
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < where->valid; j++) {
                float v = y[i][j];
                if (where->bias) v = v + where->bias[j];
                if (where->residual) v = where->residual[(r + i) * where->ldo + j] + v;
                where->out[(r + i) * where->ldo + j] = v;
            }
    }
}

#include "entry.h"
