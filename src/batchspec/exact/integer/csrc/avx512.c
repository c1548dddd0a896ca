/* batchspec's native kernels for AVX-512 VNNI CPUs (native.py's "avx512vnni" build), compiled with
 * -ffp-contract=off: every float operation below is one correctly rounded IEEE operation, lane by lane the one its
 * scalar twin in scalar.h runs, so this build gives the bits of avx2.c's and of the torch code they replace.
 *
 * 1. The int8 product (entry.h's batchspec_linear, on panel_block below): out[n][o] = ((float)(q . w) * sx[n]) * sw[o]
 * (+ b[o]), with q . w computed as sum_k a[n][k] * w[o][k] - comp[o] for a[n][k] = q[n][k] + 128 as uint8 and comp[o] =
 * 128 * sum_k w[o][k]. vpdpbusd adds its four u8 x s8 products to the int32 accumulator and vpsubd subtracts, both
 * modulo 2^32 without saturating, so the difference is q . w modulo 2^32: q . w itself, since |q . w| <= 127 * 127 * K
 * < 2^31 for K <= MAX_INNER (native.py). It is rounded once to float32 by vcvtdq2ps under the default
 * round-to-nearest-even; the scales multiply in that order afterwards. No float operation depends on the row count or
 * the blocking, so every row gets the same bits in any batch.
 *
 * The weight is prepacked as panels of 64 outputs: w[p][g][j][i] = W[64 p + j][4 g + i] ([P, G, 64, 4] int8), so a
 * panel streams from memory in one pass and each group g is four 16-lane registers, one per 16 outputs. */
#include <immintrin.h>

#include "scalar.h"

#define ROWS 6 /* activation rows per micro-kernel pass: 24 accumulators + 4 weight registers */
/* Bytes of the weight the group loop asks for ahead of the group it multiplies (16 groups; near a panel's end, the
 * start of the next, which the same thread reads next). Without it a step of 2-8 rows waited on memory and
 * multiplied in turn: on a 2-core Xeon (family 6, model 207) at 28 GB/s the 1.5B int8 target's step of 4 rows took
 * 0.073 s and 8 rows 0.095 s against 0.052 s for one, now 0.059 and 0.077 s (and one row's 4 verified tokens
 * 0.071 s, now 0.058 s; one row alone and a prompt's product of 64-512 rows unchanged; `batchspec costs --context
 * 200`, each build run twice in alternation). 2 to 16 KiB ahead measured alike. A prefetch reads nothing into a
 * register, so no bit changes. */
#define PREFETCH_AHEAD 4096
typedef uint8_t activation_t; /* entry.h's batchspec_linear hands panel_block the codes as they are */
#define PREPARED_CODES 0

static inline __m512i broadcast_group(const uint8_t *a) {
    int32_t four;
    memcpy(&four, a, sizeof four);
    return _mm512_set1_epi32(four);
}

/* row r's four accumulators take the four products of x (row r's group of four codes, broadcast) with w0..w3 */
#define DOT_ROW(r)                                                     \
    if (NR > r) {                                                      \
        __m512i x = broadcast_group(a + r * lda + 4 * g);              \
        acc##r##_0 = _mm512_dpbusd_epi32(acc##r##_0, x, w0);           \
        acc##r##_1 = _mm512_dpbusd_epi32(acc##r##_1, x, w1);           \
        acc##r##_2 = _mm512_dpbusd_epi32(acc##r##_2, x, w2);           \
        acc##r##_3 = _mm512_dpbusd_epi32(acc##r##_3, x, w3);           \
    }
#define ACC_ROW(r) __m512i acc##r##_0 = zero, acc##r##_1 = zero, acc##r##_2 = zero, acc##r##_3 = zero;
#define KEEP_ROW(r) acc[r][0] = acc##r##_0, acc[r][1] = acc##r##_1, acc[r][2] = acc##r##_2, acc[r][3] = acc##r##_3;

/* outputs col .. col+valid-1 of rows r < rows (to out[r * ldo + 0 .. valid)) from their int32 sums of the codes,
 * acc[r][c] holding outputs col + 16 c .. col + 16 c + 15: scalar.h's epilogue_value lane by lane */
static inline __attribute__((always_inline)) void panel_outputs(
    int64_t NR, __m512i (*acc)[4], epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    for (int c = 0; c < 4 && 16 * c < valid; c++) {
        int64_t left = valid - 16 * c;
        __mmask16 lanes = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        int64_t o = col + 16 * c;
        __m512i zero_point = _mm512_maskz_loadu_epi32(lanes, e.comp + o);
        __m512 col_scale = _mm512_maskz_loadu_ps(lanes, e.col_scale + o);
        __m512 bias = e.bias ? _mm512_maskz_loadu_ps(lanes, e.bias + o) : _mm512_setzero_ps();
        for (int r = 0; r < NR; r++) {
            __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], zero_point));
            y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(e.row_scale[r])), col_scale);
            if (e.bias) y = _mm512_add_ps(y, bias);
            if (e.residual) y = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, e.residual + r * ldo + 16 * c), y);
            _mm512_mask_storeu_ps(out + r * ldo + 16 * c, lanes, y);
        }
    }
}

/* outputs col .. col+valid-1 of rows r < NR, to out[r * ldo + 0 .. valid); NR is a constant at each call so the
 * loops unroll. */
static inline __attribute__((always_inline)) void panel_rows(
    const int NR, const uint8_t *a, int64_t lda, const int8_t *panel, int64_t groups, epilogue_t e, int64_t col,
    float *out, int64_t ldo, int64_t valid) {
    /* the accumulators are named variables, not an array, so the compiler keeps all 24 in registers */
    const __m512i zero = _mm512_setzero_si512();
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 4 * PANEL;
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD + 64 * line), _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5)
    }
    __m512i acc[ROWS][4];
    KEEP_ROW(0) KEEP_ROW(1) KEEP_ROW(2) KEEP_ROW(3) KEEP_ROW(4) KEEP_ROW(5)
    panel_outputs(NR, acc, e, col, out, ldo, valid);
}

static void panel_vectors(const uint8_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        const uint8_t *ar = a + r * lda;
        float *outr = out + r * ldo;
        epilogue_t er = e;
        er.row_scale = e.row_scale + r;
        er.residual = e.residual ? e.residual + r * ldo : NULL;
        switch (rows - r < ROWS ? rows - r : ROWS) {
        case 1: panel_rows(1, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        case 2: panel_rows(2, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        case 3: panel_rows(3, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        case 4: panel_rows(4, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        case 5: panel_rows(5, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        default: panel_rows(6, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
        }
    }
}

#ifdef __AMX_INT8__
/* 1b. The same product on AMX tiles (the "amx" build: this file with -mamx-tile -mamx-int8, on CPUs with AMX-INT8,
 * Sapphire Rapids and later; native.py asks Linux for the tiles' state, ARCH_REQ_XCOMP_PERM, before it builds).
 * tdpbusd multiplies a tile of up to AMX_ROWS rows of 64 codes (u8) by a tile of 16 groups of four inputs of 16
 * outputs (s8: the weight's [G, 64, 4] panel read 16 outputs a tile, its groups 256 bytes apart, so the prepacked
 * layout is the tiles' own) and adds each output's 64 products to its int32 sum, modulo 2^32 as vpdpbusd does: the
 * same sums, the same integers, then the same epilogue (panel_outputs). Every tile's rows are set to the rows the
 * block has, so nothing past the last row is read. Panels whose groups are not a multiple of AMX_GROUPS, and products
 * of fewer than AMX_MIN_ROWS rows, run on the vector kernel above.
 *
 * Measured on 2 cores of a Sapphire Rapids-class Xeon (KVM, 19 GB/s read), the four products of a 1.5B layer
 * (46.8 MB of int8 weight, eight layers' copies so that each call reads from memory), ms a layer, vector / tiles:
 * 1 row 2.37 / 2.57, 4 rows 2.67 / 2.86, 8 rows 2.80 / 2.93 and 2.71 / 2.49 (two runs), 16 rows 3.41 / 2.67,
 * 32 rows 5.29 / 3.91, 64 rows 8.32 / 5.63, 240 rows 25.5 / 14.6; a step of the 1.5B target at B = 8, 0.106-0.117 s
 * / 0.102-0.108 s, and its verification of 4 drafts a row (40 rows), 0.282-0.293 s / 0.212-0.244 s (`batchspec
 * costs --batch-sizes 1,8 --draft-lengths 1,3,4 --context 200`, each build twice in alternation). */
#define AMX_ROWS 16    /* rows of a tile */
#define AMX_GROUPS 16  /* groups of four inputs in a tile's 64-byte row */
#define AMX_MIN_ROWS 8 /* fewer rows than this run on panel_vectors */
#define TILE_AHEAD 4096 /* bytes of the weight prefetched ahead of the tiles' loads (as PREFETCH_AHEAD) */

/* LDTILECFG's 64-byte operand (palette 1): each tile's bytes a row and rows */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} tile_config_t;

/* tiles 0-7 of 64-byte rows, tile t holding rows[t] rows */
static void configure_tiles(const uint8_t rows[8]) {
    tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.bytes[t] = 64, config.rows[t] = rows[t];
    _tile_loadconfig(&config);
}

/* the panel's weight ahead of the group it reaches, into L1 (as panel_rows' PREFETCH_AHEAD) */
static inline void prefetch_tiles(const int8_t *w) {
    for (int line = 0; line < AMX_GROUPS * 4; line++)
        _mm_prefetch((const char *)(w + TILE_AHEAD + 64 * line), _MM_HINT_T0);
}

/* sums[r][o] (int32 [16][64], r below the configured rows) of codes a (row stride lda) times the panel: tiles 0-3
 * the sums of outputs 0-15 .. 48-63, tile 4 the codes, tiles 5 and 6 the weight in turn */
static void tile_sums(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t groups, int32_t *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < groups; g += AMX_GROUPS) {
        const int8_t *w = panel + g * 4 * PANEL;
        prefetch_tiles(w);
        _tile_loadd(4, a + 4 * g, lda);
        _tile_loadd(5, w, 4 * PANEL);
        _tile_dpbusd(0, 4, 5);
        _tile_loadd(6, w + 64, 4 * PANEL);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(5, w + 128, 4 * PANEL);
        _tile_dpbusd(2, 4, 5);
        _tile_loadd(6, w + 192, 4 * PANEL);
        _tile_dpbusd(3, 4, 6);
    }
    _tile_stored(0, sums, 4 * PANEL);
    _tile_stored(1, sums + 16, 4 * PANEL);
    _tile_stored(2, sums + 32, 4 * PANEL);
    _tile_stored(3, sums + 48, 4 * PANEL);
}

/* the same for 32 rows (int32 [32][64]), each half of the panel's outputs in turn: tiles 0 and 1 the first 16 rows'
 * sums, 2 and 3 the rest's, tiles 4 and 5 their codes, 6 and 7 the half's two tiles of the weight; each weight tile
 * read once serves 32 rows (tile_sums': 16) */
static void tile_sums_pair(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t groups, int32_t *sums) {
    for (int half = 0; half < 2; half++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < groups; g += AMX_GROUPS) {
            const int8_t *w = panel + g * 4 * PANEL + 128 * half;
            if (!half) prefetch_tiles(w);
            _tile_loadd(4, a + 4 * g, lda);
            _tile_loadd(6, w, 4 * PANEL);
            _tile_dpbusd(0, 4, 6);
            _tile_loadd(7, w + 64, 4 * PANEL);
            _tile_dpbusd(1, 4, 7);
            _tile_loadd(5, a + AMX_ROWS * lda + 4 * g, lda);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
        _tile_stored(0, sums + 32 * half, 4 * PANEL);
        _tile_stored(1, sums + 32 * half + 16, 4 * PANEL);
        _tile_stored(2, sums + AMX_ROWS * PANEL + 32 * half, 4 * PANEL);
        _tile_stored(3, sums + AMX_ROWS * PANEL + 32 * half + 16, 4 * PANEL);
    }
}

/* the panel's outputs, 32 rows a pass (tile_sums_pair) and a last pass of 16 rows or fewer (tile_sums) */
static void panel_tiles(const uint8_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    __m512i sums[2 * AMX_ROWS][4];
    int64_t configured = 0;
    for (int64_t r = 0; r < rows; r += 2 * AMX_ROWS) {
        int64_t n = rows - r < 2 * AMX_ROWS ? rows - r : 2 * AMX_ROWS;
        if (n != configured) {
            uint8_t bottom = (uint8_t)(n > AMX_ROWS ? n - AMX_ROWS : n), top = n > AMX_ROWS ? AMX_ROWS : bottom;
            uint8_t pair[8] = {top, top, bottom, bottom, top, bottom, AMX_GROUPS, AMX_GROUPS};
            uint8_t single[8] = {bottom, bottom, bottom, bottom, bottom, AMX_GROUPS, AMX_GROUPS, AMX_GROUPS};
            configure_tiles(n > AMX_ROWS ? pair : single);
            configured = n;
        }
        if (n > AMX_ROWS)
            tile_sums_pair(a + r * lda, lda, panel, groups, (int32_t *)sums);
        else
            tile_sums(a + r * lda, lda, panel, groups, (int32_t *)sums);
        epilogue_t er = e;
        er.row_scale = e.row_scale + r;
        er.residual = e.residual ? e.residual + r * ldo : NULL;
        panel_outputs(n, sums, er, col, out + r * ldo, ldo, valid);
    }
    _tile_release();
}

static void panel_block(const uint8_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    if (groups % AMX_GROUPS || rows < AMX_MIN_ROWS)
        panel_vectors(a, rows, lda, panel, groups, e, col, out, ldo, valid);
    else
        panel_tiles(a, rows, lda, panel, groups, e, col, out, ldo, valid);
}
#else
#define panel_block panel_vectors
#endif

/* 2. Per-token quantization to the product's codes (entry.h's batchspec_quantize) */
static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* one row quantized to codes, sixteen values at a time: the maximum of |x|'s bits (scalar.h's magnitude_bits) is
 * exact in any order, the rest elementwise (roundscale to nearest is rintf's rounding); a row that is not finite
 * gets scale NaN and the codes of 0 (scalar.h's scale_of) */
static inline __attribute__((always_inline)) void quantize_values(const float *x, int64_t k,
                                                                  int64_t ldc, uint8_t *codes, float *scale) {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i most = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 16)
        most = _mm512_max_epu32(most, _mm512_and_si512(_mm512_maskz_loadu_epi32(first(k - i), x + i), magnitude));
    float s = scale_of((uint32_t)_mm512_reduce_max_epu32(most), 127.0f);
    if (isnan(s)) {
        memset(codes, 128, (size_t)ldc);
        *scale = s;
        return;
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / s), low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
    for (int64_t i = 0; i < k; i += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(first(k - i), x + i), inverse),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, low), high);
        _mm512_mask_cvtepi32_storeu_epi8(codes + i, first(k - i),
                                         _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128)));
    }
    for (int64_t i = k; i < ldc; i++) codes[i] = 128;
    *scale = s;
}

/* 2**t for sixteen t <= 0, each lane the bits of exp2_nonpositive (the same operations) */
static inline __m512 exp2_vector(__m512 t, const float *c) {
    __m512 v = _mm512_min_ps(_mm512_setzero_ps(), _mm512_max_ps(_mm512_set1_ps(-126.0f), t));
    __m512 whole = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(v, whole), power = _mm512_set1_ps(c[9]);
    for (int j = 8; j >= 0; j--) power = _mm512_add_ps(_mm512_mul_ps(power, f), _mm512_set1_ps(c[j]));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(power, _mm512_castsi512_ps(bits));
}

/* 2b. the MLP's activation (arithmetic.py's exact_silu or exact_gelu_tanh), sixteen values at a time (scalar.h's
 * activation_value in each lane): the sigmoid of z with e = 2**(-|z| log2 e), (z >= 0 ? 1 : e) / (1 + e), then x
 * times it, z being x (SiLU) or (x + x^3 GELU_CUBIC) GELU_SCALE */
static inline __m512 sigmoid_vector(__m512 z, const float *c) {
    __m512 e = exp2_vector(_mm512_mul_ps(_mm512_abs_ps(z), _mm512_set1_ps(-LOG2E)), c);
    __mmask16 positive = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 numerator = _mm512_mask_blend_ps(positive, e, _mm512_set1_ps(1.0f));
    return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 activation_vector(__m512 x, const float *c, int64_t activation) {
    __m512 z = x;
    if (activation == ACTIVATION_GELU_TANH) {
        __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        z = _mm512_mul_ps(_mm512_add_ps(x, _mm512_mul_ps(cube, _mm512_set1_ps(GELU_CUBIC))),
                          _mm512_set1_ps(GELU_SCALE));
    }
    return _mm512_mul_ps(x, sigmoid_vector(z, c));
}

static void activation_values(const float *x, const float *up, float *out, int64_t k, const float *c,
                              int64_t activation) {
    for (int64_t i = 0; i < k; i += 16) {
        __m512 y = activation_vector(_mm512_maskz_loadu_ps(first(k - i), x + i), c, activation);
        if (up) y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(first(k - i), up + i));
        _mm512_mask_storeu_ps(out + i, first(k - i), y);
    }
}

/* 3. The exact attention of one GQA group (entry.h states the arithmetic and its bounds): the dots in vpdpwssd on
 * the query's two halves, KEY_BLOCK keys at a time; the weighted sum in vpdpwssd on W's two halves, two keys a lane,
 * PASS_ROWS rows by 32 channels a pass. */
#define KEY_BLOCK 8 /* keys per score pass: their dots end as one vector of doubles */

static inline float token_scale_of(const int16_t *token) {
    uint32_t bits = (uint32_t)_mm512_test_epi16_mask(_mm512_loadu_si512(token), _mm512_set1_epi16(1));
    float s;
    memcpy(&s, &bits, sizeof s);
    return s;
}

static inline __mmask32 lanes32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

/* which of the first n <= 16 keys a query sees, from its visibility bytes `stride` apart */
static inline __mmask16 seen_mask(const uint8_t *seen, int64_t stride, int64_t n) {
    __mmask16 valid = (__mmask16)((1u << n) - 1);
    if (stride == 1) {
        __m128i bytes = _mm_maskz_loadu_epi8(valid, seen);
        return _mm_test_epi8_mask(bytes, bytes);
    }
    __mmask16 mask = 0;
    for (int64_t t = 0; t < n; t++) mask |= (__mmask16)((seen[t * stride] != 0) << t);
    return mask;
}

/* out[i] = the sum of a[i]'s sixteen int32 lanes for eight vectors (modulo 2**32, see quantize_queries), in int32
 * lanes 0..7: neighbours folded within 128-bit lanes, then the 128-bit lanes folded */
static inline __m256i lane_sums(const __m512i a[KEY_BLOCK]) {
    __m512i pair[4], quad[2];
    for (int i = 0; i < 4; i++)
        pair[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                   _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        quad[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pair[2 * i], pair[2 * i + 1]),
                                   _mm512_unpackhi_epi64(pair[2 * i], pair[2 * i + 1]));
    /* quad[0]: keys 0-3 in each 128-bit lane, quad[1]: keys 4-7; fold the four lanes of each */
    __m512i half = _mm512_add_epi32(_mm512_shuffle_i32x4(quad[0], quad[1], 0x88),
                                    _mm512_shuffle_i32x4(quad[0], quad[1], 0xDD));
    __m512i whole = _mm512_add_epi32(half, _mm512_shuffle_i32x4(half, half, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castsi512_si256(_mm512_shuffle_i32x4(whole, whole, _MM_SHUFFLE(2, 0, 2, 0)));
}

#define KEY_SUMS(i) __m512i h##i = zero, l##i = zero;
#define KEY_DOT(i)                                                         \
    {                                                                      \
        __m512i key = _mm512_loadu_si512(block + i * lanes + d);           \
        h##i = _mm512_dpwssd_epi32(h##i, qh, key);                         \
        l##i = _mm512_dpwssd_epi32(l##i, ql, key);                         \
    }

/* q . K[j] for one query row (its halves hi, lo) and a block of KEY_BLOCK keys (key i at block + i * lanes, zeros
 * past D and past the last key), as doubles: 256 * (hi . K) + lo . K (exact: below 2**53). The sums are named
 * variables, so the compiler keeps all 16 in registers. */
static inline __m512d block_dots(const int16_t *hi, const int16_t *lo, const int16_t *block, int64_t lanes) {
    const __m512i zero = _mm512_setzero_si512();
    KEY_SUMS(0) KEY_SUMS(1) KEY_SUMS(2) KEY_SUMS(3) KEY_SUMS(4) KEY_SUMS(5) KEY_SUMS(6) KEY_SUMS(7)
    for (int64_t d = 0; d < lanes; d += 32) {
        __m512i qh = _mm512_loadu_si512(hi + d), ql = _mm512_loadu_si512(lo + d);
        KEY_DOT(0) KEY_DOT(1) KEY_DOT(2) KEY_DOT(3) KEY_DOT(4) KEY_DOT(5) KEY_DOT(6) KEY_DOT(7)
    }
    __m512i high[KEY_BLOCK] = {h0, h1, h2, h3, h4, h5, h6, h7}, low[KEY_BLOCK] = {l0, l1, l2, l3, l4, l5, l6, l7};
    return _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(lane_sums(high)), _mm512_set1_pd(256.0)),
                         _mm512_cvtepi32_pd(lane_sums(low)));
}

/* score[r][j] = (float)((q[r] . K[j] * factor[r]) * sk[j]), -inf where query r % Q does not see key j; eight keys
 * at a time, read in place from the int16 cache where its rows are `lanes` wide (D a multiple of 32), else copied
 * into a block zero-padded to `lanes` (so every row's loads are whole). broken[r]: whether row r sees a score that
 * is not finite (an inf or a NaN). */
__attribute__((noinline)) static void scores(group_t g, const int16_t *hi, const int16_t *lo, const double *factor,
                                             const int16_t *k, const uint8_t *visible, float *score,
                                             uint8_t *broken) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
    __mmask8 seen[g.queries];
    for (int64_t r = 0; r < g.rows; r++) broken[r] = 0;
    int16_t *block = (int16_t *)__builtin_alloca_with_align((size_t)(KEY_BLOCK * g.lanes) * sizeof(int16_t), 512);
    for (int64_t j0 = 0; j0 < g.keys; j0 += KEY_BLOCK) {
        int64_t n = g.keys - j0 < KEY_BLOCK ? g.keys - j0 : KEY_BLOCK;
        double scales[KEY_BLOCK];
        for (int64_t i = 0; i < KEY_BLOCK; i++) scales[i] = i < n ? token_scale_of(k + (j0 + i) * g.width) : 0.0;
        const int16_t *keys = k + j0 * g.width; /* read in place where a token's row is already the block's */
        if (n < KEY_BLOCK || g.width != g.lanes) {
            keys = block;
            for (int64_t i = 0; i < KEY_BLOCK; i++)
                for (int64_t d = 0; d < g.lanes; d += 32) {
                    __mmask32 valid = i < n ? lanes32(g.size - d) : 0;
                    _mm512_store_si512(block + i * g.lanes + d,
                                       _mm512_maskz_loadu_epi16(valid, k + (j0 + i) * g.width + d));
                }
        }
        __m512d key_scale = _mm512_loadu_pd(scales);
        for (int64_t i = 0; i < g.queries; i++)
            seen[i] = (__mmask8)seen_mask(visible + i * g.visible_row + j0 * g.visible_stride, g.visible_stride, n);
        for (int64_t r = 0; r < g.rows; r++) {
            __m512d dot = block_dots(hi + r * g.lanes, lo + r * g.lanes, keys, g.lanes);
            __m512d value = _mm512_mul_pd(_mm512_mul_pd(dot, _mm512_set1_pd(factor[r])), key_scale);
            __m256 f = _mm512_cvtpd_ps(value);
            __mmask8 shown = seen[r % g.queries] & (__mmask8)((1u << n) - 1);
            broken[r] |= (_mm256_cmp_ps_mask(_mm256_and_ps(f, magnitude), inf, _CMP_NLT_UQ) & shown) != 0;
            f = _mm256_mask_blend_ps(seen[r % g.queries], _mm256_set1_ps(-INFINITY), f);
            _mm256_mask_storeu_ps(score + r * g.keys + j0, (__mmask8)((1u << n) - 1), f);
        }
    }
}

/* sixteen floats rounded to integers, ties to even (rintf's rounding) */
static inline __m512 rounded(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* sixteen floats as two vectors of eight doubles (exact) */
static inline void to_doubles(__m512 x, __m512d out[2]) {
    out[0] = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    out[1] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* One row's scores -> W[j] = rint(a[j] / max a * 2**20) as its halves wh[j] = W[j] / 1024, wl[j] = W[j] % 1024
 * (int16, zeros up to 2 * pairs), with e[j] = 2**(score - max) (0 where hidden), a[j] = e[j] * sv[j] (in place in
 * score, 0 where hidden); *scale = max a, *denominator = max(sum_j rint(e[j] * 2**20), 1). Sixteen keys at a time;
 * the sums are of integers below 2**21, exact in any order. A broken row (scalar.h's row_broken) is NaN (entry.h):
 * weights 0, *scale NaN, *denominator 1. */
static void softmax_weights(group_t g, float *score, const uint8_t *seen, const float *v_scale, int broken,
                            int16_t *wh, int16_t *wl, double *scale, double *denominator) {
    const __m512 unit = _mm512_set1_ps(1048576.0f);
    __m512 best = _mm512_set1_ps(-INFINITY), top = _mm512_setzero_ps();
    if (broken) {
        for (int64_t j = 0; j < (g.keys + 1) / 2 * 2; j++) wh[j] = wl[j] = 0;
        *scale = NAN;
        *denominator = 1.0;
        return;
    }
    for (int64_t j = 0; j < g.keys; j += 16) {
        __mmask16 valid = (__mmask16)((1u << (g.keys - j < 16 ? g.keys - j : 16)) - 1);
        best = _mm512_max_ps(best, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, score + j));
    }
    float most = _mm512_reduce_max_ps(best);
    __m512 shift = _mm512_set1_ps(most == -INFINITY ? 0.0f : most);
    __m512d total[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()}, part[2];
    for (int64_t j = 0; j < g.keys; j += 16) {
        int64_t n = g.keys - j < 16 ? g.keys - j : 16;
        __mmask16 valid = (__mmask16)((1u << n) - 1), visible = seen_mask(seen + j * g.visible_stride,
                                                                           g.visible_stride, n);
        __m512 e = exp2_vector(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, score + j), shift), g.c);
        e = _mm512_maskz_mov_ps(visible, e);
        to_doubles(rounded(_mm512_mul_ps(e, unit)), part);
        total[0] = _mm512_add_pd(total[0], part[0]);
        total[1] = _mm512_add_pd(total[1], part[1]);
        __m512 a = _mm512_maskz_mul_ps(visible, e, _mm512_maskz_loadu_ps(valid, v_scale + j));
        _mm512_mask_storeu_ps(score + j, valid, a);
        top = _mm512_max_ps(top, a);
    }
    float a_top = _mm512_reduce_max_ps(top);
    __m512 divisor = _mm512_set1_ps(a_top > 0.0f ? a_top : 1.0f);
    for (int64_t j = 0; j < g.keys; j += 16) {
        __mmask16 valid = (__mmask16)((1u << (g.keys - j < 16 ? g.keys - j : 16)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(valid, score + j);
        __m512i w = _mm512_cvtps_epi32(rounded(_mm512_mul_ps(_mm512_div_ps(a, divisor), unit)));
        _mm256_mask_storeu_epi16(wh + j, valid, _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 10)));
        _mm256_mask_storeu_epi16(wl + j, valid, _mm512_cvtepi32_epi16(_mm512_and_si512(w, _mm512_set1_epi32(1023))));
    }
    if (g.keys % 2) wh[g.keys] = wl[g.keys] = 0;
    double sum = _mm512_reduce_add_pd(_mm512_add_pd(total[0], total[1]));
    *scale = (double)a_top;
    *denominator = sum > 1.0 ? sum : 1.0;
}

/* channel k of 32 interleaved from two rows of 32 int16: (a[k/2], b[k/2]) in lanes k, k + 1, channels 0-15 by
 * PAIR_LOW, 16-31 by PAIR_HIGH (an index of 32 or more picks b) */
static const int16_t PAIR_LOW[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const int16_t PAIR_HIGH[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* the values by key pairs: vp[(p * lanes + d) * 2 + t] = V[2p + t][d], zeros past D and past the last key; so the
 * 32 int16 at vp + (p * lanes + d) * 2 are channels d .. d + 15 of keys 2p and 2p + 1, channel by channel */
static void pair_values(group_t g, const int16_t *v, int16_t *vp) {
    const __m512i low = _mm512_loadu_si512(PAIR_LOW), high = _mm512_loadu_si512(PAIR_HIGH);
    for (int64_t p = 0; p < (g.keys + 1) / 2; p++)
        for (int64_t d = 0; d < g.lanes; d += 32) {
            __mmask32 valid = lanes32(g.size - d);
            __m512i a = _mm512_maskz_loadu_epi16(valid, v + 2 * p * g.width + d);
            __m512i b = _mm512_maskz_loadu_epi16(2 * p + 1 < g.keys ? valid : 0, v + (2 * p + 1) * g.width + d);
            _mm512_storeu_si512(vp + (p * g.lanes + d) * 2, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(vp + (p * g.lanes + d) * 2 + 32, _mm512_permutex2var_epi16(a, high, b));
        }
}

/* s[0 .. 16) += unit * x, sixteen int32 lanes, in float64 (exact: integers below 2**53) */
static inline void join(double *s, __m512i x, __m512d unit) {
    __m512d low = _mm512_cvtepi32_pd(_mm512_castsi512_si256(x));
    __m512d high = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(x, 1));
    _mm512_storeu_pd(s, _mm512_add_pd(_mm512_loadu_pd(s), _mm512_mul_pd(low, unit)));
    _mm512_storeu_pd(s + 8, _mm512_add_pd(_mm512_loadu_pd(s + 8), _mm512_mul_pd(high, unit)));
}

#define PAIR_SUMS(i) __m512i s##i##a = zero, s##i##b = zero;
#define PAIR_ROW(i)                                                        \
    {                                                                      \
        __m512i weights = _mm512_set1_epi32(w[2 * i]);                     \
        s##i##a = _mm512_dpwssd_epi32(s##i##a, weights, va);               \
        s##i##b = _mm512_dpwssd_epi32(s##i##b, weights, vb);               \
    }
#define JOIN_ROW(i) join(sum + i * lanes, s##i##a, unit), join(sum + i * lanes + 16, s##i##b, unit);

/* PASS_ROWS rows' sums over `pairs` key pairs of one half of their weights (Wh, unit 1024, or Wl, unit 1) in 32
 * channels, added to sum (row i at sum + i * lanes): wp holds the rows' weights pair by pair (see weighted_sums,
 * offset to the half), vp the pairs' values (channels d .. d + 32 of pair_values' layout, pairs lanes * 2 apart). Its
 * own function, one half at a time, so that its 12 sums, two value vectors and the broadcasts stay in registers. */
__attribute__((noinline)) static void pair_block(const int32_t *wp, const int16_t *vp, int64_t pairs, int64_t lanes,
                                                 __m512d unit, double *sum) {
    const __m512i zero = _mm512_setzero_si512();
    PAIR_SUMS(0) PAIR_SUMS(1) PAIR_SUMS(2) PAIR_SUMS(3) PAIR_SUMS(4) PAIR_SUMS(5)
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t *w = wp + p * 2 * PASS_ROWS;
        __m512i va = _mm512_loadu_si512(vp + p * lanes * 2), vb = _mm512_loadu_si512(vp + p * lanes * 2 + 32);
        PAIR_ROW(0) PAIR_ROW(1) PAIR_ROW(2) PAIR_ROW(3) PAIR_ROW(4) PAIR_ROW(5)
    }
    JOIN_ROW(0) JOIN_ROW(1) JOIN_ROW(2) JOIN_ROW(3) JOIN_ROW(4) JOIN_ROW(5)
}

/* sum[r][d] = sum_j W[r][j] * V[j][d] for every padded row r and d < lanes: PASS_ROWS rows by 32 channels per pass,
 * one vpdpwssd adding two keys' products per int32 lane, on the rows' weights laid out pair by pair in wp
 * (wp[(p * PASS_ROWS + i) * 2 + t] the int32 (W[2p], W[2p + 1]) of row r0 + i, t = 0 for Wh and 1 for Wl). Over
 * PAIR_FLUSH pairs a lane's sum stays below 2**31 in magnitude (2 * PAIR_FLUSH * 1024 * 32767 < 2**31: Wh <= 1024,
 * Wl < 1024), and the int32 sums wrap modulo 2**32 without saturating, so they are the sums themselves; then they
 * join the float64 totals. */
static void weighted_sums(group_t g, const int16_t *wh, const int16_t *wl, const int16_t *vp, int32_t *wp,
                          double *sum) {
    int64_t pairs = (g.keys + 1) / 2, stride = 2 * pairs;
    for (int64_t i = 0; i < g.padded * g.lanes; i++) sum[i] = 0.0;
    for (int64_t r0 = 0; r0 < g.padded; r0 += PASS_ROWS) {
        for (int64_t i = 0; i < PASS_ROWS; i++)
            for (int64_t p = 0; p < pairs; p++) {
                memcpy(wp + (p * PASS_ROWS + i) * 2, wh + (r0 + i) * stride + 2 * p, sizeof(int32_t));
                memcpy(wp + (p * PASS_ROWS + i) * 2 + 1, wl + (r0 + i) * stride + 2 * p, sizeof(int32_t));
            }
        for (int64_t d = 0; d < g.lanes; d += 32)
            for (int64_t p0 = 0; p0 < pairs; p0 += PAIR_FLUSH)
                for (int t = 0; t < 2; t++)
                    pair_block(wp + p0 * 2 * PASS_ROWS + t, vp + (p0 * g.lanes + d) * 2,
                               pairs - p0 < PAIR_FLUSH ? pairs - p0 : PAIR_FLUSH, g.lanes,
                               _mm512_set1_pd(t == 0 ? (double)WEIGHT_HALF : 1.0), sum + r0 * g.lanes + d);
    }
}

/* out: row r at out + (r / Q) * out_head + (r % Q) * out_query */
static void attend_group(group_t g, const float *query, const int16_t *k, const int16_t *v, const uint8_t *visible,
                         scratch_t s, float *out, int64_t out_head, int64_t out_query) {
    double factor[g.padded], scale[g.padded], denominator[g.padded];
    uint8_t broken[g.rows];
    int64_t stride = 2 * ((g.keys + 1) / 2);
    for (int64_t j = 0; j < g.keys; j++) s.v_scale[j] = token_scale_of(v + j * g.width);
    int values_broken = any_nonfinite(s.v_scale, g.keys);
    quantize_queries(g, query, s.hi, s.lo, factor);
    scores(g, s.hi, s.lo, factor, k, visible, s.score, broken);
    softcap_scores(g, s.score);
    for (int64_t r = 0; r < g.padded; r++) {
        int16_t *wh = s.wh + r * stride, *wl = s.wl + r * stride;
        if (r < g.rows) {
            const uint8_t *seen = visible + (r % g.queries) * g.visible_row;
            softmax_weights(g, s.score + r * g.keys, seen, s.v_scale,
                            row_broken(g, broken[r], values_broken, seen, s.v_scale), wh, wl, scale + r,
                            denominator + r);
        } else {
            for (int64_t j = 0; j < stride; j++) wh[j] = wl[j] = 0;
        }
    }
    pair_values(g, v, s.vp);
    weighted_sums(g, s.wh, s.wl, s.vp, s.wp, s.sum);
    for (int64_t r = 0; r < g.rows; r++) {
        float *o = out + (r / g.queries) * out_head + (r % g.queries) * out_query;
        for (int64_t d = 0; d < g.size; d++) o[d] = (float)((s.sum[r * g.lanes + d] * scale[r]) / denominator[r]);
    }
}

/* query: float32 [B, H, Q, D] contiguous; keys, values: the int16 cache [B, Hk, L, width] with the given batch and
 * head strides (tokens `width` apart); visible: bool [B, 1, Q, L] with strides (vb, vq, vl); out: float32
 * [B, Q, H, D]. Returns 0, or 1 where scratch memory could not be allocated (out is then incomplete; the caller
 * raises). */

/* 4. The int4 product (batchspec_linear4): the weight as scalar.h lays it out, 16 outputs a panel, one 16-lane
 * vector; activations as int8 codes with a scale per super-block. vpdpbusd multiplies the unsigned nibbles by the
 * signed codes, four products a lane (|n q| <= 15 * 127: no saturation), into a sub-block's int32 sums; vpmulld
 * scales them by the sub-block's sc into the super-block's i1; vpmaddwd pairs each output's mins with the sub-block
 * sums of the codes into i2; then the float steps of scalar.h, lane by lane, into y (ROWS4 x 16 floats on the stack,
 * in L1). ROWS4 rows share each weight load and its unpacking. (Measured on a Zen 4 against two panels a pass, whose
 * broadcasts of the codes feed two vpdpbusd: as fast for 5-64 rows, and one panel streamed a row's weight 1.3x as
 * fast.) */
#define ROWS4 6

#define SUB_ROW(r) __m512i s##r = _mm512_setzero_si512();
#define DOT4_ROW(r)                                                                                       \
    if (NR > r) {                                                                                         \
        __m512i x0 = broadcast_group((const uint8_t *)(q + r * ldq + at));                                \
        __m512i x1 = broadcast_group((const uint8_t *)(q + r * ldq + at + 4));                            \
        s##r = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s##r, lo, x0), hi, x1);                            \
    }
#define SCALE_ROW(r) if (NR > r) one##r = subs > 1 ? _mm512_add_epi32(one##r, _mm512_mullo_epi32(s##r, scale)) : s##r;
#define SUPER_ROW(r) __m512i one##r = _mm512_setzero_si512();
#define MIN_ROW(r) if (NR > r) super_block_end(one##r, sums + r * lds + sub0, subs, even, block, xs[r * ldx + b], y[r]);
#define ROWS4_DO(M) M(0) M(1) M(2) M(3) M(4) M(5)

/* y = y + (((float)i1 * d - (float)i2 * dmin) * scale) for a panel's super-block at `block`, i1 given, i2 from the
 * mins and the row's sub-block sums */
static inline __attribute__((always_inline)) void super_block_end(
    __m512i i1, const int16_t *sums, int64_t subs, int64_t even, const uint8_t *block, float scale, float *y) {
    const uint8_t *mins = block + 64 + 16 * even;
    __m512i i2 = _mm512_setzero_si512();
    if (subs > 1)
        for (int64_t p = 0; p < even / 2; p++) {
            int32_t two;
            memcpy(&two, sums + 2 * p, sizeof two);
            __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mins + 32 * p)));
            i2 = _mm512_add_epi32(i2, _mm512_madd_epi16(mn, _mm512_set1_epi32(two)));
        }
    else
        i2 = _mm512_set1_epi32(sums[0]);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
    __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
    __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i1), d), _mm512_mul_ps(_mm512_cvtepi32_ps(i2), dmin));
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_mul_ps(t, _mm512_set1_ps(scale))));
}

/* the panel's outputs for rows r < NR, into y[r][0 .. 16) */
static inline __attribute__((always_inline)) void panel4_rows(
    const int NR, const int8_t *q, int64_t ldq, const float *xs, int64_t ldx, const int16_t *sums, int64_t lds,
    const uint8_t *panel, int64_t nsub, int64_t subs, float y[][PANEL4]) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(y[r], _mm512_setzero_ps());
    const uint8_t *block = panel;
    for (int64_t b = 0, sub0 = 0; sub0 < nsub; b++, sub0 += subs) {
        int64_t count = nsub - sub0 < subs ? nsub - sub0 : subs, even = (count + 1) / 2 * 2;
        const uint8_t *scales = block + 64, *nibbles = block + 64 + (subs > 1 ? 32 * even : 0);
        ROWS4_DO(SUPER_ROW)
        for (int64_t s = 0; s < count; s++) {
            ROWS4_DO(SUB_ROW)
            for (int64_t g = 0; g < 4; g++) {
                int64_t at = 32 * (sub0 + s) + 8 * g;
                __m512i raw = _mm512_loadu_si512(nibbles + 64 * (4 * s + g));
                __m512i lo = _mm512_and_si512(raw, low_nibbles);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
                ROWS4_DO(DOT4_ROW)
            }
            __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scales + 16 * s)));
            ROWS4_DO(SCALE_ROW)
        }
        ROWS4_DO(MIN_ROW)
        block += super_block_bytes(count, subs);
    }
}

/* one panel's outputs (entry.h's batchspec_linear4 hands it one at a time): ROWS4 rows a pass, then y + bias, then
 * residual + y, to the panel's valid columns */
#define PANELS4 1

static void panels4_block(const int8_t *q, int64_t rows, int64_t ldq, const float *xs, int64_t ldx,
                          const int16_t *sums, int64_t lds, const uint8_t *panel, int64_t panel_bytes, int64_t count,
                          int64_t nsub, int64_t subs, const out4_t *where) {
    (void)panel_bytes, (void)count;
    float y[ROWS4][PANEL4];
    __mmask16 lanes = first(where->valid);
    for (int64_t r = 0; r < rows; r += ROWS4) {
        int64_t n = rows - r < ROWS4 ? rows - r : ROWS4;
        const int8_t *qr = q + r * ldq;
        const float *xr = xs + r * ldx;
        const int16_t *sr = sums + r * lds;
        switch (n) {
        case 1: panel4_rows(1, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        case 2: panel4_rows(2, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        case 3: panel4_rows(3, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        case 4: panel4_rows(4, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        case 5: panel4_rows(5, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        default: panel4_rows(ROWS4, qr, ldq, xr, ldx, sr, lds, panel, nsub, subs, y); break;
        }
        for (int64_t i = 0; i < n; i++) {
            __m512 v = _mm512_loadu_ps(y[i]);
            if (where->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, where->bias));
            if (where->residual)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, where->residual + (r + i) * where->ldo), v);
            _mm512_mask_storeu_ps(where->out + (r + i) * where->ldo, lanes, v);
        }
    }
}

#include "entry.h"
