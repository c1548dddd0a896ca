/* The kernels in plain C that the portable and NEON builds share (portable.c, neon.c): everything but the two
 * products' inner dot products, which the including file defines first, after scalar.h and with ROWS and ROWS4:
 *
 *   panel_dots(a, count, lda, panel, groups, acc)   acc[r][j] = q[r] . w[j] for the 64 outputs j of one panel of the
 *                                                   int8 weight ([G, 64, 4] int8 at panel) and rows r < count
 *                                                   (<= ROWS) of the codes a = q + 128 (uint8, row stride lda);
 *   sub_block_dots(q, count, ldq, nibbles, dots)    dots[r][j] = n[j] . q[r] over one sub-block of the int4 weight
 *                                                   (its nibbles [4][16][4], scalar.h) for rows r < count (<= ROWS4)
 *                                                   of the int8 codes q (row stride ldq);
 *
 * each an exact integer sum, so the same integers in any order and on any instruction set. Every float operation is
 * one correctly rounded IEEE operation, the one its scalar twin in scalar.h runs, in the same order (the compiler
 * vectorizes the loops for the target's baseline, without contracting multiply-adds). Then entry.h's exported
 * functions. */

/* The bits below need each float operation rounded to its own type: a target that evaluates floats in wider
 * registers (x87) would round differently, and fails to build instead (native.py then runs the torch path). */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the portable and neon builds need FLT_EVAL_METHOD == 0 (each float operation rounded to float)"
#endif

typedef uint8_t activation_t; /* entry.h's batchspec_linear hands panel_block the codes as they are */
#define PREPARED_CODES 0

/* 1. The int8 product (entry.h's batchspec_linear): one panel's outputs (col .. col + valid - 1) for `rows` rows,
 * ROWS at a time, each from its exact q . w (panel_dots) as scalar.h's epilogue_value */
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

/* 2b. the MLP's activation (scalar.h's activation_value: arithmetic.py's exact_silu or exact_gelu_tanh), times up
 * where up is not NULL */
static void activation_values(const float *x, const float *up, float *out, int64_t k, const float *c,
                              int64_t activation) {
    for (int64_t i = 0; i < k; i++) {
        float y = activation_value(x[i], c, activation);
        out[i] = up ? y * up[i] : y;
    }
}

/* 3. The exact attention of one GQA group: scalar.h's plain C, as the avx2 build runs it */
#define attend_group plain_attend_group

/* 4. The int4 product (entry.h's batchspec_linear4): the weight as scalar.h lays it out, one panel of 16 outputs at
 * a time, ROWS4 rows sharing each pass over it. A sub-block's nibbles times the codes (sub_block_dots), scaled by the
 * sub-block's sc into i1 (subs > 1; the sum itself where subs == 1); i2 from the mins and the codes' sub-block sums;
 * then scalar.h's float steps, d and dmin read with half_to_float (the bits of vcvtph2ps). */
#define PANELS4 1 /* panels a pass */

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
