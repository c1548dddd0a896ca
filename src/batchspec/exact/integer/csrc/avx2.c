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
 * - without (the "avx2" build), the codes are widened to int16 once per call and the weights as they are read, and
 *   vpmaddwd adds two int16 products per lane (|a w| <= 255 * 127, so a pair's sum fits, and vpmaddwd does not
 *   saturate); the two lanes of a group of four are added at the end. (vpmaddubsw, which multiplies u8 by s8
 *   directly, saturates its int16 pair sums at 2 * 255 * 127.)
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
#define WIDE_CODES 0
#else
#define VNNI 0
#define ROWS 3 /* 12 accumulators + 4 widened weight registers (one reloaded) */
typedef int16_t activation_t; /* the codes widened to int16 (entry.h's batchspec_linear, once per row block) */
#define WIDE_CODES 1
#endif

/* the first n of 8 lanes, as a mask vector for maskload / maskstore */
static inline __m256i first8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
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
#define ACCS 4 /* accumulators a row and chunk: outputs 4i .. 4i + 3, each in two lanes (its products 0-1 and 2-3) */
/* row r's four accumulators take the pair sums of row r's group of four codes, broadcast as int16, with the group's
 * four widened weight vectors */
#define DOT_ROW(r)                                                                 \
    if (NR > r) {                                                                  \
        int64_t four;                                                              \
        memcpy(&four, a + r * lda + 4 * g, sizeof four);                           \
        __m256i x = _mm256_set1_epi64x(four);                                      \
        acc##r##_0 = _mm256_add_epi32(acc##r##_0, _mm256_madd_epi16(x, w0));       \
        acc##r##_1 = _mm256_add_epi32(acc##r##_1, _mm256_madd_epi16(x, w1));       \
        acc##r##_2 = _mm256_add_epi32(acc##r##_2, _mm256_madd_epi16(x, w2));       \
        acc##r##_3 = _mm256_add_epi32(acc##r##_3, _mm256_madd_epi16(x, w3));       \
    }
#define ACC_ROW(r) __m256i acc##r##_0 = acc[r][0], acc##r##_1 = acc[r][1], acc##r##_2 = acc[r][2], acc##r##_3 = acc[r][3];
#define KEEP_ROW(r) if (NR > r) acc[r][0] = acc##r##_0, acc[r][1] = acc##r##_1, acc[r][2] = acc##r##_2, acc[r][3] = acc##r##_3;
#define WIDENED(i) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 * i)))
#define WEIGHTS __m256i w0 = WIDENED(0), w1 = WIDENED(1), w2 = WIDENED(2), w3 = WIDENED(3);
#define DOT_ROWS DOT_ROW(0) DOT_ROW(1) DOT_ROW(2)
#define ACC_ROWS ACC_ROW(0) ACC_ROW(1) ACC_ROW(2)
#define KEEP_ROWS KEEP_ROW(0) KEEP_ROW(1) KEEP_ROW(2)

/* a row's accumulators as the sums of outputs 0-7 and 8-15: each output's two lanes added (hadd within 128-bit
 * halves), then put in order */
static inline void outputs16(const __m256i acc[ACCS], __m256i sums[2]) {
    sums[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), 0xD8);
    sums[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2], acc[3]), 0xD8);
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
#if VNNI
    case 3: chunk_sums(3, a, lda, chunk, g0, g1, first, acc); break;
    case 4: chunk_sums(4, a, lda, chunk, g0, g1, first, acc); break;
    case 5: chunk_sums(5, a, lda, chunk, g0, g1, first, acc); break;
#endif
    default: chunk_sums(ROWS, a, lda, chunk, g0, g1, first, acc); break;
    }
}

/* one panel's outputs (col .. col + valid - 1) for `rows` rows: ROWS rows at a time, each pass over the panel
 * GROUP_BLOCK groups at a time, its chunks of 16 outputs one after another within a block */
static void panel_block(const activation_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    int64_t chunks = (valid + 15) / 16;
    for (int64_t r = 0; r < rows; r += ROWS) {
        int64_t count = rows - r < ROWS ? rows - r : ROWS;
        __m256i acc[PANEL / 16][ROWS][ACCS];
        memset(acc, 0, sizeof acc);
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

/* 2b. arithmetic.py's exact_silu, eight values at a time (scalar.h's silu_value in each lane) */
static inline __m256 exp2_8(__m256 t, const float *c) {
    __m256 v = _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(_mm256_set1_ps(-126.0f), t));
    __m256 whole = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(v, whole), power = _mm256_set1_ps(c[9]);
    for (int j = 8; j >= 0; j--) power = _mm256_add_ps(_mm256_mul_ps(power, f), _mm256_set1_ps(c[j]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(power, _mm256_castsi256_ps(bits));
}

static inline __m256 silu8(__m256 x, const float *c) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 magnitude = _mm256_and_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), x);
    __m256 e = exp2_8(_mm256_mul_ps(magnitude, _mm256_set1_ps(-LOG2E)), c);
    __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(x, _mm256_div_ps(numerator, _mm256_add_ps(one, e)));
}

static void silu_values(const float *x, const float *up, float *out, int64_t k, const float *c) {
    for (int64_t i = 0; i < k; i += 8) {
        __m256i lanes = first8(k - i);
        __m256 y = silu8(_mm256_maskload_ps(x + i, lanes), c);
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
#if VNNI
#define ROWS4 4
#define SUB_ROW(r) __m256i s##r = _mm256_setzero_si256();
#define DOT4_ROW(r)                                                                  \
    if (NR > r) {                                                                    \
        s##r = DPBUSD(s##r, lo, broadcast4(q + r * ldq + at));                       \
        s##r = DPBUSD(s##r, hi, broadcast4(q + r * ldq + at + 4));                   \
    }
#define SCALE_ROW(r) if (NR > r) one##r = subs > 1 ? _mm256_add_epi32(one##r, _mm256_mullo_epi32(s##r, scale)) : s##r;
#define SUB_SCALE _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scales + 16 * s + 8 * half)))
#else
#define ROWS4 3
#define SUB_ROW(r) __m256i s##r = _mm256_setzero_si256();
#define DOT4_ROW(r)                                                                                      \
    if (NR > r) {                                                                                        \
        s##r = _mm256_add_epi16(s##r, _mm256_maddubs_epi16(lo, broadcast4(q + r * ldq + at)));           \
        s##r = _mm256_add_epi16(s##r, _mm256_maddubs_epi16(hi, broadcast4(q + r * ldq + at + 4)));       \
    }
#define SCALE_ROW(r) if (NR > r) one##r = _mm256_add_epi32(one##r, _mm256_madd_epi16(s##r, scale));
/* each output's sc in both int16 halves of its lane (1 where subs == 1) */
#define SUB_SCALE                                                                                        \
    (subs > 1 ? pair16(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scales + 16 * s + 8 * half)))) \
              : _mm256_set1_epi16(1))
/* each int32 lane's value (below 2**15) in both of its int16 halves */
static inline __m256i pair16(__m256i x) { return _mm256_or_si256(x, _mm256_slli_epi32(x, 16)); }
#endif
#define SUPER_ROW(r) __m256i one##r = _mm256_setzero_si256();
#define Y_ROW(r) __m256 y##r = _mm256_setzero_ps();
#define MIN_ROW(r)                                                                                                \
    if (NR > r) {                                                                                                 \
        __m256i i2 = _mm256_setzero_si256();                                                                      \
        if (subs > 1)                                                                                             \
            for (int64_t p = 0; p < even / 2; p++) {                                                              \
                int32_t two;                                                                                      \
                memcpy(&two, sums + r * lds + sub0 + 2 * p, sizeof two);                                          \
                __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(mins + 32 * p + 16 * half))); \
                i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(mn, _mm256_set1_epi32(two)));                          \
            }                                                                                                     \
        else                                                                                                      \
            i2 = _mm256_set1_epi32(sums[r * lds + sub0]);                                                         \
        __m256 t = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(one##r), d), _mm256_mul_ps(_mm256_cvtepi32_ps(i2), dmin)); \
        y##r = _mm256_add_ps(y##r, _mm256_mul_ps(t, _mm256_set1_ps(xs[r * ldx + b])));                           \
    }
#define STORE_ROW(r)                                                                                              \
    if (NR > r) {                                                                                                 \
        __m256 y = y##r;                                                                                          \
        if (bias) y = _mm256_add_ps(y, _mm256_maskload_ps(bias + 8 * half, lanes));                               \
        if (residual) y = _mm256_add_ps(_mm256_maskload_ps(residual + r * ldo + 8 * half, lanes), y);             \
        _mm256_maskstore_ps(out + r * ldo + 8 * half, lanes, y);                                                  \
    }
#if VNNI
#define ROWS4_DO(M) M(0) M(1) M(2) M(3)
#else
#define ROWS4_DO(M) M(0) M(1) M(2)
#endif

/* four int8 codes broadcast to every lane */
static inline __m256i broadcast4(const int8_t *q) {
    int32_t four;
    memcpy(&four, q, sizeof four);
    return _mm256_set1_epi32(four);
}

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
            __m256i scale = SUB_SCALE;
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

#define PANELS4 1 /* panels a pass */

/* one panel's outputs (entry.h's batchspec_linear4 hands it one at a time) */
static void panels4_block(const int8_t *q, int64_t rows, int64_t ldq, const float *xs, int64_t ldx,
                          const int16_t *sums, int64_t lds, const uint8_t *panel, int64_t panel_bytes, int64_t count,
                          int64_t nsub, int64_t subs, const out4_t *where) {
    (void)panel_bytes, (void)count;
    const float *bias = where->bias, *residual = where->residual;
    float *out = where->out;
    int64_t ldo = where->ldo, valid = where->valid;
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
