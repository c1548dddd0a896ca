/* batchspec's native kernels in plain C for any CPU with a C compiler and OpenMP (native.py's "portable" build: an
 * x86-64 CPU without AVX2, aarch64 without the dot product instructions, any other architecture), compiled with
 * -ffp-contract=off and no instruction-set flags: the compiler vectorizes the loops for whatever the target's
 * baseline is (SSE2 on x86-64, NEON on aarch64). plain.h holds the kernels this build shares with neon.c; this file
 * adds their two inner dot products in plain C. Every integer sum is exact, so in any order, and every float operation
 * is scalar.h's, in its order: this build gives the bits of avx512.c's, avx2.c's and neon.c's and of the torch code
 * they replace.
 *
 * 1. The int8 product (entry.h's batchspec_linear): q . w summed as such, q = code - 128 read from the codes as they
 * are (no zero point to subtract: the integer the x86 SIMD builds reach as sum(code w) - comp), on the weight
 * prepacked as theirs ([P, G, 64, 4] int8). A group's four products of one output are added as two int16 pairs
 * (|q w| <= 127 * 127, so a pair's sum fits in int16: the shape of a 16-bit multiply-add), the pairs into int32
 * (|q . w| <= 127 * 127 * K < 2^31 for K <= MAX_INNER, native.py); each output then as scalar.h's epilogue_value.
 * ROWS rows share each pass over a panel.
 *
 * 4. The int4 product's dots: a group's eight products of one output (|n q| <= 15 * 127 each, 15,240 in all) summed
 * in int16, the four groups in int32. */
#include "scalar.h"

#define ROWS 8  /* rows a pass over a panel of the int8 weight */
#define ROWS4 4 /* rows a pass over a panel of the int4 weight */

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

#include "plain.h"
