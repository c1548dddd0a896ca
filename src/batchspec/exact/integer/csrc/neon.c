/* batchspec's native kernels for aarch64 CPUs with the dot product instructions (ARMv8.2's DotProd, "asimddp" in
 * /proc/cpuinfo: native.py's "neon" build, compiled with -march=armv8.2-a+dotprod and -ffp-contract=off): the
 * portable build's plain C (plain.h), with its two inner dot products in NEON's sdot (vdotq_s32), which adds four
 * int8 x int8 products into each int32 lane. Integer sums are exact in any order, and every float operation is
 * plain.h's, so this build gives the bits of portable.c's, avx512.c's and avx2.c's and of the torch code they replace.
 *
 * 1. The int8 product (entry.h's batchspec_linear): q = code - 128, the code's top bit flipped (an int8 in
 * [-127, 127]: no zero point to subtract), times the weight prepacked as every build's ([P, G, 64, 4] int8). A 16-byte
 * load of it is four outputs' four inputs of one group, and sdot with a row's four q broadcast adds each output's
 * four products into its lane: q . w in int32, exact (|q . w| <= 127 * 127 * K < 2^31 for K <= MAX_INNER,
 * native.py). A pass takes 16 outputs (a quarter panel, 64 contiguous bytes a group) and up to ROWS rows.
 *
 * 4. The int4 product's dots: a 16-byte load of a sub-block's nibbles is four outputs' bytes of one pair of groups;
 * its low nibbles (inputs 8 g .. 8 g + 3) and its high nibbles (8 g + 4 .. 8 g + 7), 0 .. 15 read as int8, times the
 * codes by sdot: each output's dot over the sub-block in int32 (at most 32 * 15 * 127), exact. */
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "the neon build needs aarch64 and its dot product instructions (-march=armv8.2-a+dotprod)"
#endif

#include <arm_neon.h>

#include "scalar.h"

#define ROWS 5         /* rows a pass over a panel: 20 accumulators, 4 weights and 5 broadcasts (of 32 registers) */
#define ROWS4 4        /* rows a pass over a panel of the int4 weight: 16 accumulators, 8 broadcasts */
#define GROUP_BLOCK 64 /* groups of a panel (16 KB) whose four quarters are summed before the next: read from L1 */

/* the four bytes at p in every 32-bit lane */
static inline int8x16_t broadcast4(const void *p) {
    uint32_t four;
    memcpy(&four, p, sizeof four);
    return vreinterpretq_s8_u32(vdupq_n_u32(four));
}

/* adds to acc[r][16 c ..] (rows r < NR, outputs 16 c .. 16 c + 15 of the panel) the products of a block's n groups
 * with q[r] (the block's codes less 128); quarter: those outputs' 64 bytes of the block's first group, a panel's 256
 * bytes apart. NR is a constant at each call, so the loops over rows unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void quarter_sums(const int NR, const int8_t q[ROWS][4 * GROUP_BLOCK],
                                                               const int8_t *quarter, int64_t n, int c,
                                                               int32_t acc[ROWS][PANEL]) {
    int32x4_t s[ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) s[r][i] = vld1q_s32(acc[r] + 16 * c + 4 * i);
    for (int64_t g = 0; g < n; g++) {
        const int8_t *w = quarter + g * 4 * PANEL;
        int8x16_t w0 = vld1q_s8(w), w1 = vld1q_s8(w + 16), w2 = vld1q_s8(w + 32), w3 = vld1q_s8(w + 48);
        for (int r = 0; r < NR; r++) {
            int8x16_t x = broadcast4(q[r] + 4 * g);
            s[r][0] = vdotq_s32(s[r][0], w0, x);
            s[r][1] = vdotq_s32(s[r][1], w1, x);
            s[r][2] = vdotq_s32(s[r][2], w2, x);
            s[r][3] = vdotq_s32(s[r][3], w3, x);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) vst1q_s32(acc[r] + 16 * c + 4 * i, s[r][i]);
}

/* quarter_sums for the first count (<= ROWS) rows */
static void quarter_pass(int64_t count, const int8_t q[ROWS][4 * GROUP_BLOCK], const int8_t *quarter, int64_t n,
                         int c, int32_t acc[ROWS][PANEL]) {
    switch (count) {
    case 1: quarter_sums(1, q, quarter, n, c, acc); break;
    case 2: quarter_sums(2, q, quarter, n, c, acc); break;
    case 3: quarter_sums(3, q, quarter, n, c, acc); break;
    case 4: quarter_sums(4, q, quarter, n, c, acc); break;
    default: quarter_sums(ROWS, q, quarter, n, c, acc); break;
    }
}

/* acc[r][j] = q[r] . w[j] for the 64 outputs j of one panel and rows r < count (plain.h): GROUP_BLOCK groups at a
 * time, their codes made q = code - 128 once (the top bit flipped), then the block's four quarters in turn */
static void panel_dots(const uint8_t *a, int64_t count, int64_t lda, const int8_t *panel, int64_t groups,
                       int32_t acc[ROWS][PANEL]) {
    int8_t q[ROWS][4 * GROUP_BLOCK];
    memset(acc, 0, sizeof(int32_t) * ROWS * PANEL);
    for (int64_t g0 = 0; g0 < groups; g0 += GROUP_BLOCK) {
        int64_t n = groups - g0 < GROUP_BLOCK ? groups - g0 : GROUP_BLOCK;
        for (int64_t r = 0; r < count; r++)
            for (int64_t i = 0; i < 4 * n; i++) q[r][i] = (int8_t)(a[r * lda + 4 * g0 + i] ^ 0x80u);
        for (int c = 0; c < PANEL / 16; c++) quarter_pass(count, q, panel + g0 * 4 * PANEL + 64 * c, n, c, acc);
    }
}

/* dots[r][j] = n[j] . q[r] over one sub-block (nibbles [4][16][4]) for rows r < NR, as sub_block_dots */
static inline __attribute__((always_inline)) void sub_block_rows(const int NR, const int8_t *q, int64_t ldq,
                                                                 const uint8_t *nibbles,
                                                                 int32_t dots[ROWS4][PANEL4]) {
    const uint8x16_t low = vdupq_n_u8(15);
    int32x4_t s[ROWS4][4];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) s[r][i] = vdupq_n_s32(0);
#pragma GCC unroll 1 /* a group at a time: unrolled, its loads are hoisted past the 32 registers */
    for (int g = 0; g < 4; g++) {
        int8x16_t first[ROWS4], second[ROWS4]; /* row r's codes 8 g .. 8 g + 3 and 8 g + 4 .. 8 g + 7, broadcast */
        for (int r = 0; r < NR; r++) {
            first[r] = broadcast4(q + r * ldq + 8 * g);
            second[r] = broadcast4(q + r * ldq + 8 * g + 4);
        }
        for (int i = 0; i < 4; i++) { /* outputs 4 i .. 4 i + 3 */
            uint8x16_t bytes = vld1q_u8(nibbles + 64 * g + 16 * i);
            int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(bytes, low)), hi = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
            for (int r = 0; r < NR; r++) s[r][i] = vdotq_s32(vdotq_s32(s[r][i], lo, first[r]), hi, second[r]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 4; i++) vst1q_s32(dots[r] + 4 * i, s[r][i]);
}

/* dots[r][j] = n[j] . q[r] over one sub-block (its nibbles [4][16][4], 32 codes of row r at q + r * ldq) for rows
 * r < count (plain.h) */
static void sub_block_dots(const int8_t *q, int64_t count, int64_t ldq, const uint8_t *nibbles,
                           int32_t dots[ROWS4][PANEL4]) {
    switch (count) {
    case 1: sub_block_rows(1, q, ldq, nibbles, dots); break;
    case 2: sub_block_rows(2, q, ldq, nibbles, dots); break;
    case 3: sub_block_rows(3, q, ldq, nibbles, dots); break;
    default: sub_block_rows(ROWS4, q, ldq, nibbles, dots); break;
    }
}

#include "plain.h"
