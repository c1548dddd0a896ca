/* batchspec's native kernels for 256-bit CPUs (native.py's "avx2" and "avxvnni" builds), compiled with
 * -ffp-contract=off: every float operation below is one correctly rounded IEEE operation, lane by lane the one its
 * scalar twin in scalar.h runs, so both builds give the bits of avx512.c's and of the torch code they replace.
 *
 * 1. The int8 product (entry.h's batchspec_linear, on panel_block below): out[n][o] = ((float)(q . w) * sx[n]) *
 * sw[o] (+ b[o]) on the weight prepacked as avx512.c's (panels of 64 outputs, [P, G, 64, 4] int8), q . w computed
 * as sum_k a[n][k] * w[o][k] - comp[o] for the codes a = q + 128, comp[o] = 128 * sum_k w[o][k], every sum in int32
 * lanes modulo 2^32:
 *
 * - with VNNI (the "avxvnni" build: VEX vpdpbusd where the CPU has AVX-VNNI, its EVEX form on AVX-512 VNNI CPUs),
 *   each lane adds four u8 x s8 products, as avx512.c does on 16 lanes;
 * - without (the "avx2" build), llama.cpp's exact trick: the codes are made signed once per row block, q = a - 128,
 *   and laid out per group of four as |q| (uint8) then q (prepare_codes); vpsignb moves each q's sign onto the
 *   weight it meets, vpmaddubsw multiplies |q| <= 128 by that signed weight (|w| <= 127: pack never holds -128) and
 *   adds a pair (at most 2 * 128 * 127 = 32,512 in magnitude: no saturation), and vpmaddwd by ones adds the two
 *   pairs of a group into the output's int32 lane. The sums then are q . w itself; they start at comp so that the
 *   epilogue's subtraction, shared with the unsigned codes, leaves them unchanged. (vpmaddubsw on the unsigned
 *   codes would saturate its pair sums at 2 * 255 * 127.)
 *
 * Either way the difference is q . w modulo 2^32, which is q . w itself (|q . w| <= 127 * 127 * K < 2^31 for
 * K <= MAX_INNER), rounded once to float32 and scaled as scalar.h's epilogue (after epilogue_t) does. A micro-kernel takes 16
 * outputs (a quarter panel: 64 contiguous bytes a group) and up to ROWS rows. */
#include <immintrin.h>

#include "scalar.h"

#if defined(__AVXVNNI__) || defined(__AVX512VNNI__)
#define VNNI 1
#define ROWS 6 /* 12 accumulators + 2 weight registers + 1 broadcast */
#if defined(__AVXVNNI__)
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
#define DPBUSD _mm256_dpbusd_epi32
#endif
typedef uint8_t activation_t; /* the codes as they are */
#define PREPARED_CODES 0
#else
#define VNNI 0
#define ROWS 4 /* 8 accumulators + 2 weight registers + ones + 2 broadcasts + 1 product */
typedef int8_t activation_t; /* per group of four codes |q| then q, 8 bytes (prepare_codes, once per row block) */
#define PREPARED_CODES 2     /* bytes of prepared codes a code */
#endif

/* the first n of 8 lanes, as a mask vector for maskload / maskstore */
static inline __m256i first8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* four bytes at p, as an int32 */
static inline int32_t load4(const void *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    return four;
}

/* outputs o .. o + valid - 1 (valid <= 8) of one row from their eight int32 sums, as scalar.h's epilogue (after epilogue_t) */
static inline void store8(__m256i sums, int64_t o, int64_t valid, epilogue_t e, float row_scale, const float *residual,
                          float *out) {
    __m256i lanes = first8(valid);
    __m256 y = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_maskload_epi32((const int *)(e.comp + o), lanes)));
    y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_set1_ps(row_scale)), _mm256_maskload_ps(e.col_scale + o, lanes));
    if (e.bias) y = _mm256_add_ps(y, _mm256_maskload_ps(e.bias + o, lanes));
    if (residual) y = _mm256_add_ps(_mm256_maskload_ps(residual, lanes), y);
    _mm256_maskstore_ps(out, lanes, y);
}

#define GROUP_BLOCK 64 /* groups of a panel (16 KB) whose four chunks are summed before the next: read from L1 */

#if VNNI
#define ACCS 2 /* accumulators a row and chunk: outputs 0-7 and 8-15 */
/* row r's two accumulators take the products of row r's group of four codes, broadcast, with the group's two weight
 * vectors */
#define DOT_ROW(r)                                                     \
    if (NR > r) {                                                      \
        int32_t four;                                                  \
        memcpy(&four, a + r * lda + 4 * g, sizeof four);               \
        __m256i x = _mm256_set1_epi32(four);                           \
        acc##r##_0 = DPBUSD(acc##r##_0, x, w0);                        \
        acc##r##_1 = DPBUSD(acc##r##_1, x, w1);                        \
    }
#define ACC_ROW(r) __m256i acc##r##_0 = acc[r][0], acc##r##_1 = acc[r][1];
#define KEEP_ROW(r) if (NR > r) acc[r][0] = acc##r##_0, acc[r][1] = acc##r##_1;
#define WEIGHTS                                                                                                   \
    __m256i w0 = _mm256_loadu_si256((const __m256i *)w), w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
#define DOT_ROWS DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5)
#define ACC_ROWS ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
#define KEEP_ROWS KEEP_ROW(0) KEEP_ROW(1) KEEP_ROW(2) KEEP_ROW(3) KEEP_ROW(4) KEEP_ROW(5)

/* a row's accumulators as the sums of outputs 0-7 and 8-15 */
static inline void outputs16(const __m256i acc[ACCS], __m256i sums[2]) { sums[0] = acc[0], sums[1] = acc[1]; }
#else
#define ACCS 2 /* accumulators a row and chunk: outputs 0-7 and 8-15 */
/* row r's two accumulators take the products of row r's group of four codes (|q| and q broadcast) with the group's
 * two weight vectors, each weight signed by the code it meets */
#define PRODUCT(w) _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(w, sign)), _mm256_set1_epi16(1))
#define DOT_ROW(r)                                                       \
    if (NR > r) {                                                        \
        __m256i size = _mm256_set1_epi32(load4(a + r * lda + 8 * g));    \
        __m256i sign = _mm256_set1_epi32(load4(a + r * lda + 8 * g + 4)); \
        acc##r##_0 = _mm256_add_epi32(acc##r##_0, PRODUCT(w0));          \
        acc##r##_1 = _mm256_add_epi32(acc##r##_1, PRODUCT(w1));          \
    }
#define ACC_ROW(r) __m256i acc##r##_0 = acc[r][0], acc##r##_1 = acc[r][1];
#define KEEP_ROW(r) if (NR > r) acc[r][0] = acc##r##_0, acc[r][1] = acc##r##_1;
#define WEIGHTS                                                                                                   \
    __m256i w0 = _mm256_loadu_si256((const __m256i *)w), w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
#define DOT_ROWS DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3)
#define ACC_ROWS ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3)
#define KEEP_ROWS KEEP_ROW(0) KEEP_ROW(1) KEEP_ROW(2) KEEP_ROW(3)

/* a row's accumulators as the sums of outputs 0-7 and 8-15 */
static inline void outputs16(const __m256i acc[ACCS], __m256i sums[2]) { sums[0] = acc[0], sums[1] = acc[1]; }

/* count codes a (uint8, a multiple of four) prepared as this build's product reads them: per group of four, |q| then
 * q (q = a - 128; |-128| is 128 as a uint8), into `out` (2 count bytes), which it returns. 32 codes a step: within
 * each 128-bit half, unpacking by int32 pairs groups 4 i and 4 i + 1 of |q| and q, and the halves are put in order. */
static const activation_t *prepare_codes(const uint8_t *a, int64_t count, activation_t *out) {
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + i)), _mm256_set1_epi8((char)0x80));
        __m256i size = _mm256_abs_epi8(q);
        __m256i low = _mm256_unpacklo_epi32(size, q), high = _mm256_unpackhi_epi32(size, q);
        _mm256_storeu_si256((__m256i *)(out + 2 * i), _mm256_permute2x128_si256(low, high, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 2 * i + 32), _mm256_permute2x128_si256(low, high, 0x31));
    }
    for (; i < count; i += 4)
        for (int j = 0; j < 4; j++) {
            int q = (int)a[i + j] - 128;
            out[2 * i + j] = (int8_t)(uint8_t)(q < 0 ? -q : q), out[2 * i + 4 + j] = (int8_t)q;
        }
    return out;
}
#endif

/* adds to acc (rows r < NR of one chunk of 16 outputs) the products of groups g0 .. g1 - 1; chunk: the outputs' 64
 * bytes of group 0, a panel's 256 bytes apart. The first chunk's pass also asks for the group's other three cache
 * lines, so memory streams the panel in order and the other chunks' passes find them in L1. */
static inline __attribute__((always_inline)) void chunk_sums(const int NR, const activation_t *a, int64_t lda,
                                                             const int8_t *chunk, int64_t g0, int64_t g1,
                                                             int first, __m256i acc[ROWS][ACCS]) {
    ACC_ROWS
    for (int64_t g = g0; g < g1; g++) {
        const int8_t *w = chunk + g * 4 * PANEL;
        if (first)
            for (int line = 1; line < 4; line++) _mm_prefetch((const char *)(w + 64 * line), _MM_HINT_T0);
        WEIGHTS
        DOT_ROWS
    }
    KEEP_ROWS
}

/* chunk_sums for the first `count` (<= ROWS) rows, NR a constant at each call so the loops unroll */
static void chunk_pass(int64_t count, const activation_t *a, int64_t lda, const int8_t *chunk, int64_t g0,
                       int64_t g1, int first, __m256i acc[ROWS][ACCS]) {
    switch (count) {
    case 1: chunk_sums(1, a, lda, chunk, g0, g1, first, acc); break;
    case 2: chunk_sums(2, a, lda, chunk, g0, g1, first, acc); break;
    case 3: chunk_sums(3, a, lda, chunk, g0, g1, first, acc); break;
#if VNNI
    case 4: chunk_sums(4, a, lda, chunk, g0, g1, first, acc); break;
    case 5: chunk_sums(5, a, lda, chunk, g0, g1, first, acc); break;
#endif
    default: chunk_sums(ROWS, a, lda, chunk, g0, g1, first, acc); break;
    }
}

#if VNNI
#define ROW_CODES(g) __m256i x = _mm256_set1_epi32(load4(a + 4 * (g)));
#define DOT1(acc, w) DPBUSD(acc, x, w)
#else
#define ROW_CODES(g) __m256i size = _mm256_set1_epi32(load4(a + 8 * (g))), sign = _mm256_set1_epi32(load4(a + 8 * (g) + 4));
#define DOT1(acc, w) _mm256_add_epi32(acc, PRODUCT(w))
#endif

/* one row's outputs of one panel (col .. col + valid - 1): the panel read once and in order, its 64 outputs in
 * eight accumulators (a plain decode step: memory streams each panel as avx512.c's loop streams it, where the
 * passes of 16 outputs below read a quarter of each group's bytes a pass) */
static void panel_row(const activation_t *a, const int8_t *panel, int64_t groups, epilogue_t e, int64_t col,
                      float *out, int64_t valid) {
    __m256i acc[PANEL / 8];
    for (int j = 0; j < PANEL / 8; j++) /* the signed codes' sums start at comp (see the top of this file) */
        acc[j] = VNNI ? _mm256_setzero_si256()
                      : _mm256_maskload_epi32((const int *)(e.comp + col + 8 * j), first8(valid - 8 * j));
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 4 * PANEL;
        ROW_CODES(g)
        for (int j = 0; j < PANEL / 8; j++) acc[j] = DOT1(acc[j], _mm256_loadu_si256((const __m256i *)(w + 32 * j)));
    }
    for (int j = 0; j < PANEL / 8 && 8 * j < valid; j++)
        store8(acc[j], col + 8 * j, valid - 8 * j, e, e.row_scale[0], e.residual ? e.residual + 8 * j : NULL,
               out + 8 * j);
}

/* one panel's outputs (col .. col + valid - 1) for `rows` rows: one row as panel_row reads it, more ROWS rows at a
 * time, each pass over the panel GROUP_BLOCK groups at a time, its chunks of 16 outputs one after another within a
 * block */
static void panel_block(const activation_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    if (rows == 1 && valid > PANEL - 16) { /* every chunk of the panel: a narrower last panel takes the passes */
        panel_row(a, panel, groups, e, col, out, valid);
        return;
    }
    int64_t chunks = (valid + 15) / 16;
    for (int64_t r = 0; r < rows; r += ROWS) {
        int64_t count = rows - r < ROWS ? rows - r : ROWS;
        __m256i acc[PANEL / 16][ROWS][ACCS];
        memset(acc, 0, sizeof acc);
        if (!VNNI) /* the signed codes' sums start at comp (see the top of this file) */
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t i = 0; i < count; i++)
                    for (int h = 0; h < 2; h++)
                        acc[c][i][h] = _mm256_maskload_epi32((const int *)(e.comp + col + 16 * c + 8 * h),
                                                             first8(valid - 16 * c - 8 * h));
        for (int64_t g0 = 0; g0 < groups; g0 += GROUP_BLOCK)
            for (int64_t c = 0; c < chunks; c++)
                chunk_pass(count, a + r * lda, lda, panel + 64 * c, g0, g0 + GROUP_BLOCK < groups ? g0 + GROUP_BLOCK
                           : groups, c == 0, acc[c]);
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t i = 0; i < count; i++) {
                __m256i sums[2];
                outputs16(acc[c][i], sums);
                for (int h = 0; h < 2 && 16 * c + 8 * h < valid; h++) {
                    int64_t at = (r + i) * ldo + 16 * c + 8 * h;
                    store8(sums[h], col + 16 * c + 8 * h, valid - 16 * c - 8 * h, e, e.row_scale[r + i],
                           e.residual ? e.residual + at : NULL, out + at);
                }
            }
    }
}

/* 2. One row quantized to the product's codes (entry.h's batchspec_quantize): the maximum of |x|'s bits (scalar.h's
 * magnitude_bits) eight lanes at a time (exact in any order), the codes from it by scalar.h's row_codes; a row that
 * is not finite gets scale NaN and the codes of 0 (scalar.h's scale_of). */
static void quantize_values(const float *x, int64_t k, int64_t ldc, uint8_t *codes, float *scale) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i most = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i += 8)
        most = _mm256_max_epu32(most, _mm256_and_si256(magnitude, _mm256_maskload_epi32((const int *)(x + i),
                                                                                         first8(k - i))));
    __m128i half = _mm_max_epu32(_mm256_castsi256_si128(most), _mm256_extracti128_si256(most, 1));
    half = _mm_max_epu32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
    half = _mm_max_epu32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(2, 3, 0, 1)));
    row_codes(x, k, ldc, scale_of((uint32_t)_mm_cvtsi128_si32(half), 127.0f), codes, scale);
}

/* 2b. the MLP's activation (arithmetic.py's exact_silu or exact_gelu_tanh), eight values at a time */
static inline __m256 exp2_8(__m256 t, const float *c) {
    __m256 v = _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(_mm256_set1_ps(-126.0f), t));
    __m256 whole = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(v, whole), power = _mm256_set1_ps(c[9]);
    for (int j = 8; j >= 0; j--) power = _mm256_add_ps(_mm256_mul_ps(power, f), _mm256_set1_ps(c[j]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(power, _mm256_castsi256_ps(bits));
}

/* scalar.h's sigmoid_value in each lane */
static inline __m256 sigmoid8(__m256 z, const float *c) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 magnitude = _mm256_and_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), z);
    __m256 e = exp2_8(_mm256_mul_ps(magnitude, _mm256_set1_ps(-LOG2E)), c);
    __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_div_ps(numerator, _mm256_add_ps(one, e));
}

/* scalar.h's activation_value in each lane: x * sigmoid(x), or x * sigmoid(z) with GELU's z */
static inline __m256 activation8(__m256 x, const float *c, int64_t activation) {
    __m256 z = x;
    if (activation == ACTIVATION_GELU_TANH) {
        __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        z = _mm256_mul_ps(_mm256_add_ps(x, _mm256_mul_ps(cube, _mm256_set1_ps(GELU_CUBIC))),
                          _mm256_set1_ps(GELU_SCALE));
    }
    return _mm256_mul_ps(x, sigmoid8(z, c));
}

static void activation_values(const float *x, const float *up, float *out, int64_t k, const float *c,
                              int64_t activation) {
    for (int64_t i = 0; i < k; i += 8) {
        __m256i lanes = first8(k - i);
        __m256 y = activation8(_mm256_maskload_ps(x + i, lanes), c, activation);
        if (up) y = _mm256_mul_ps(y, _mm256_maskload_ps(up + i, lanes));
        _mm256_maskstore_ps(out + i, lanes, y);
    }
}

/* 3. The exact attention of one GQA group: scalar.h's plain C (plain_attend_group), whose integer loops the
 * compiler vectorizes (vpmaddwd for the dots): the same sums, so the same bits as avx512.c's. */
#define attend_group plain_attend_group

/* 4. The int4 product (batchspec_linear4, entry.h): the weight as scalar.h lays it out, a panel of 16 outputs in two
 * passes of 8 (one 8-lane vector each). A sub-block's nibbles times the codes, the unsigned nibbles first:
 *
 * - with VNNI, vpdpbusd adds four products a lane into int32 sums, scaled by the sub-block's sc with vpmulld;
 * - without, vpmaddubsw adds two (|n q| <= 15 * 127, a pair at most 3,810: no saturation) into int16 lanes, and a
 *   sub-block's eight of them sum to at most 30,480 < 2**15 in each lane, still exact; vpmaddwd then multiplies each
 *   output's two lanes by its sc and adds them, into int32.
 *
 * Either way i1 is the same integer, as are i2 (vpmaddwd on the mins and the codes' sub-block sums) and the float
 * steps of scalar.h, lane by lane: the bits of avx512.c's. ROWS4 rows share each weight load. */
/* four int8 codes broadcast to every lane */
static inline __m256i broadcast4(const int8_t *q) { return _mm256_set1_epi32(load4(q)); }

#if VNNI
#define ROWS4 4
/* s plus one group's products: the low nibbles by codes q[0..3], the high by q[4..7] */
static inline __m256i nibble_dots(__m256i s, __m256i lo, __m256i hi, const int8_t *q) {
    return DPBUSD(DPBUSD(s, lo, broadcast4(q)), hi, broadcast4(q + 4));
}
/* one plus a sub-block's sums s times its outputs' sc (8 bytes at sc; the sums themselves where subs == 1) */
static inline __m256i scaled_sums(__m256i one, __m256i s, const uint8_t *sc, int64_t subs) {
    if (subs == 1) return s;
    return _mm256_add_epi32(one, _mm256_mullo_epi32(s, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
}
#else
#define ROWS4 3
static inline __m256i nibble_dots(__m256i s, __m256i lo, __m256i hi, const int8_t *q) {
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo, broadcast4(q)));
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(hi, broadcast4(q + 4)));
}
/* each int32 lane's value (below 2**15) in both of its int16 halves */
static inline __m256i pair16(__m256i x) { return _mm256_or_si256(x, _mm256_slli_epi32(x, 16)); }
/* vpmaddwd by each output's sc in both int16 halves of its lane (1 where subs == 1) */
static inline __m256i scaled_sums(__m256i one, __m256i s, const uint8_t *sc, int64_t subs) {
    __m256i scale = subs > 1 ? pair16(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)))
                             : _mm256_set1_epi16(1);
    return _mm256_add_epi32(one, _mm256_madd_epi16(s, scale));
}
#endif

/* y plus one super-block's float steps for 8 outputs: i1 = one, i2 from their mins (16-byte pairs 32 apart at mins)
 * and the row's sub-block sums, then ((float)i1 * d - (float)i2 * dmin) * x */
static inline __m256 super_step(__m256 y, __m256i one, const int16_t *sums, const uint8_t *mins, int64_t even,
                                int64_t subs, __m256 d, __m256 dmin, float x) {
    __m256i i2 = _mm256_setzero_si256();
    if (subs > 1)
        for (int64_t p = 0; p < even / 2; p++) {
            __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(mins + 32 * p)));
            i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(mn, _mm256_set1_epi32(load4(sums + 2 * p))));
        }
    else
        i2 = _mm256_set1_epi32(sums[0]);
    __m256 t = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(one), d), _mm256_mul_ps(_mm256_cvtepi32_ps(i2), dmin));
    return _mm256_add_ps(y, _mm256_mul_ps(t, _mm256_set1_ps(x)));
}

/* 8 outputs' y plus bias, then residual (each where not NULL), stored in the lanes' outputs */
static inline void store_half(__m256 y, const float *bias, const float *residual, float *out, __m256i lanes) {
    if (bias) y = _mm256_add_ps(y, _mm256_maskload_ps(bias, lanes));
    if (residual) y = _mm256_add_ps(_mm256_maskload_ps(residual, lanes), y);
    _mm256_maskstore_ps(out, lanes, y);
}

#define SUB_ROW(r) __m256i s##r = _mm256_setzero_si256();
#define DOT4_ROW(r) if (NR > r) s##r = nibble_dots(s##r, lo, hi, q + r * ldq + at);
#define SCALE_ROW(r) if (NR > r) one##r = scaled_sums(one##r, s##r, scales + 16 * s + 8 * half, subs);
#define SUPER_ROW(r) __m256i one##r = _mm256_setzero_si256();
#define Y_ROW(r) __m256 y##r = _mm256_setzero_ps();
#define MIN_ROW(r)                                                                                               \
    if (NR > r) y##r = super_step(y##r, one##r, sums + r * lds + sub0, mins + 16 * half, even, subs, d, dmin,  \
                                  xs[r * ldx + b]);
#define STORE_ROW(r)                                                                                             \
    if (NR > r) store_half(y##r, bias ? bias + 8 * half : NULL, residual ? residual + r * ldo + 8 * half : NULL, \
                           out + r * ldo + 8 * half, lanes);
#if VNNI
#define ROWS4_DO(M) M(0) M(1) M(2) M(3)
#else
#define ROWS4_DO(M) M(0) M(1) M(2)
#endif

/* outputs col + 8 half .. of rows r < NR (half a panel), to out[r * ldo + 8 half ..) */
static inline __attribute__((always_inline)) void half_panel4_rows(
    const int NR, int half, const int8_t *q, int64_t ldq, const float *xs, int64_t ldx, const int16_t *sums,
    int64_t lds, const uint8_t *panel, int64_t nsub, int64_t subs, const float *bias, const float *residual,
    float *out, int64_t ldo, int64_t valid) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    ROWS4_DO(Y_ROW)
    const uint8_t *block = panel;
    for (int64_t b = 0, sub0 = 0; sub0 < nsub; b++, sub0 += subs) {
        int64_t count = nsub - sub0 < subs ? nsub - sub0 : subs, even = (count + 1) / 2 * 2;
        const uint8_t *scales = block + 64, *mins = scales + 16 * even;
        const uint8_t *nibbles = subs > 1 ? mins + 16 * even : block + 64;
        ROWS4_DO(SUPER_ROW)
        for (int64_t s = 0; s < count; s++) {
            ROWS4_DO(SUB_ROW)
            for (int64_t g = 0; g < 4; g++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(nibbles + 64 * (4 * s + g) + 32 * half));
                __m256i lo = _mm256_and_si256(raw, low_nibbles);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
                int64_t at = 32 * (sub0 + s) + 8 * g;
                ROWS4_DO(DOT4_ROW)
            }
            ROWS4_DO(SCALE_ROW)
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * half)));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 32 + 16 * half)));
        ROWS4_DO(MIN_ROW)
        block += super_block_bytes(count, subs);
    }
    __m256i lanes = first8(valid - 8 * half);
    ROWS4_DO(STORE_ROW)
}

/* one row's 16 outputs of a panel in one pass over it, both halves at once (a plain decode step: the panel read once
 * and in order, where half_panel4_rows reads half of each line a pass): the same sums and steps, the same bits */
static void panel4_row(const int8_t *q, const float *xs, const int16_t *sums, const uint8_t *panel, int64_t nsub,
                       int64_t subs, const out4_t *where) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    __m256 y[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t *block = panel;
    for (int64_t b = 0, sub0 = 0; sub0 < nsub; b++, sub0 += subs) {
        int64_t count = nsub - sub0 < subs ? nsub - sub0 : subs, even = (count + 1) / 2 * 2;
        const uint8_t *scales = block + 64, *mins = scales + 16 * even;
        const uint8_t *nibbles = subs > 1 ? mins + 16 * even : block + 64;
        __m256i one[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int64_t s = 0; s < count; s++) {
            __m256i sub[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int64_t g = 0; g < 4; g++)
                for (int h = 0; h < 2; h++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(nibbles + 64 * (4 * s + g) + 32 * h));
                    sub[h] = nibble_dots(sub[h], _mm256_and_si256(raw, low_nibbles),
                                         _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles),
                                         q + 32 * (sub0 + s) + 8 * g);
                }
            for (int h = 0; h < 2; h++) one[h] = scaled_sums(one[h], sub[h], scales + 16 * s + 8 * h, subs);
        }
        for (int h = 0; h < 2; h++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * h)));
            __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 32 + 16 * h)));
            y[h] = super_step(y[h], one[h], sums + sub0, mins + 16 * h, even, subs, d, dmin, xs[b]);
        }
        block += super_block_bytes(count, subs);
    }
    for (int h = 0; h < 2 && 8 * h < where->valid; h++)
        store_half(y[h], where->bias ? where->bias + 8 * h : NULL, where->residual ? where->residual + 8 * h : NULL,
                   where->out + 8 * h, first8(where->valid - 8 * h));
}

#define PANELS4 1 /* panels a pass */

/* one panel's outputs (entry.h's batchspec_linear4 hands it one at a time) */
static void panels4_block(const int8_t *q, int64_t rows, int64_t ldq, const float *xs, int64_t ldx,
                          const int16_t *sums, int64_t lds, const uint8_t *panel, int64_t panel_bytes, int64_t count,
                          int64_t nsub, int64_t subs, const out4_t *where) {
    (void)panel_bytes, (void)count;
    const float *bias = where->bias, *residual = where->residual;
    float *out = where->out;
    int64_t ldo = where->ldo, valid = where->valid;
    if (rows == 1) {
        panel4_row(q, xs, sums, panel, nsub, subs, where);
        return;
    }
    for (int64_t r = 0; r < rows; r += ROWS4)
        for (int half = 0; half < 2 && 8 * half < valid; half++) {
            const int8_t *qr = q + r * ldq;
            const float *xr = xs + r * ldx, *rr = residual ? residual + r * ldo : NULL;
            const int16_t *sr = sums + r * lds;
            float *o = out + r * ldo;
            switch (rows - r < ROWS4 ? rows - r : ROWS4) {
            case 1: half_panel4_rows(1, half, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, bias, rr, o, ldo, valid); break;
            case 2: half_panel4_rows(2, half, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, bias, rr, o, ldo, valid); break;
#if VNNI
            case 3: half_panel4_rows(3, half, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, bias, rr, o, ldo, valid); break;
#endif
            default: half_panel4_rows(ROWS4, half, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, bias, rr, o, ldo, valid); break;
            }
        }
}

#include "entry.h"
