/* batchspec's own kernels for the exact int8 forward on AVX-512 VNNI CPUs, built and loaded by
 * batchspec/int8/native.py. Compiled with -ffp-contract=off: every float operation below is one correctly rounded
 * IEEE operation, the same one torch runs in the Python path it replaces, so the bits are the same.
 *
 * 1. The int8 product (batchspec_linear): out[n][o] = ((float)(q . w) * sx[n]) * sw[o] (+ b[o]), where
 * out[n][o] = (float)(sum_k a[n][k] * w[o][k] - comp[o]) with a[n][k] = q[n][k] + 128 as uint8 and
 * comp[o] = 128 * sum_k w[o][k]. vpdpbusd adds its four u8 x s8 products to the int32 accumulator and vpsubd
 * subtracts, both modulo 2^32 without saturating, so the difference is q . w modulo 2^32: q . w itself, since
 * |q . w| <= 127 * 127 * K < 2^31 for K <= MAX_INNER (vnni.py). It is rounded once to float32 by vcvtdq2ps under the
 * default round-to-nearest-even: the bits of (float)(q . w); the scales multiply in that order afterwards. No float
 * operation depends on the row count or the blocking, so every row gets the same bits in any batch.
 *
 * The weight is prepacked as panels of 64 outputs: w[p][g][j][i] = W[64 p + j][4 g + i] ([P, G, 64, 4] int8), so a
 * panel streams from memory in one pass and each group g is four 16-lane registers, one per 16 outputs. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 64     /* outputs per panel: four 16-lane int32 accumulators per row */
#define ROWS 6       /* activation rows per micro-kernel pass: 24 accumulators + 4 weight registers */
#define ROW_BLOCK 60 /* rows per pass over the weight: their outputs stay in cache while a panel is reused */

static inline __m512i broadcast_group(const uint8_t *a) {
    int32_t four;
    memcpy(&four, a, sizeof four);
    return _mm512_set1_epi32(four);
}

/* out[r][0..valid) for rows r < NR of one panel; NR is a constant at each call so the loops unroll. */
typedef struct {
    const int32_t *comp;    /* [o] 128 * sum_k w[o][k] */
    const float *row_scale; /* [n] */
    const float *col_scale; /* [o] */
    const float *bias;      /* [o], or NULL */
} epilogue_t;

static inline __attribute__((always_inline)) void panel_rows(
    const int NR, const uint8_t *a, int64_t lda, const int8_t *panel, int64_t groups, epilogue_t e, int64_t col,
    float *out, int64_t ldo, int64_t valid) {
    __m512i acc[ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 4 * PANEL;
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        for (int r = 0; r < NR; r++) {
            __m512i x = broadcast_group(a + r * lda + 4 * g);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, w0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, w1);
            acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], x, w2);
            acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], x, w3);
        }
    }
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
            _mm512_mask_storeu_ps(out + r * ldo + o, lanes, y);
        }
    }
}

static void panel_block(const uint8_t *a, int64_t rows, int64_t lda, const int8_t *panel, int64_t groups,
                        epilogue_t e, int64_t col, float *out, int64_t ldo, int64_t valid) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        const uint8_t *ar = a + r * lda;
        float *outr = out + r * ldo;
        epilogue_t er = e;
        er.row_scale = e.row_scale + r;
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

/* a: uint8 [n, 4 groups] (row stride lda); w: int8 [panels, groups, 64, 4]; comp, col_scale, bias: [o] (bias may
 * be NULL); row_scale: [n]; out: float32 [n, o], 64 (panels - 1) < o <= 64 panels. */
void batchspec_linear(const uint8_t *a, int64_t n, int64_t lda, const int8_t *w, const int32_t *comp,
                      const float *row_scale, const float *col_scale, const float *bias, int64_t groups,
                      int64_t panels, int64_t o, float *out, int threads) {
    for (int64_t r0 = 0; r0 < n; r0 += ROW_BLOCK) {
        int64_t rows = n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK;
        epilogue_t e = {comp, row_scale + r0, col_scale, bias};
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t p = 0; p < panels; p++) {
            int64_t valid = o - p * PANEL < PANEL ? o - p * PANEL : PANEL;
            panel_block(a + r0 * lda, rows, lda, w + p * groups * 4 * PANEL, groups, e, p * PANEL,
                        out + r0 * o, o, valid);
        }
    }
}

/* 2. Per-token quantization to the product's codes (batchspec_quantize), as int8/arithmetic.py's quantize_rows and
 * product.py's activation_codes compute it in float32: top = max |x|; scale = top > 0 ? top / 127 : 1;
 * q = clamp(rint(x * (1 / scale)), -127, 127); code = q + 128, and 128 in the padding columns k..ldc. */
void batchspec_quantize(const float *x, int64_t n, int64_t k, int64_t ldc, uint8_t *codes, float *scale,
                        int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * k;
        float top = 0.0f;
        for (int64_t i = 0; i < k; i++) top = fmaxf(top, fabsf(xr[i]));
        float s = top > 0.0f ? top / 127.0f : 1.0f;
        float inverse = 1.0f / s;
        uint8_t *cr = codes + r * ldc;
        for (int64_t i = 0; i < k; i++) {
            float q = rintf(xr[i] * inverse);
            q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
            cr[i] = (uint8_t)(int32_t)(q + 128.0f);
        }
        for (int64_t i = k; i < ldc; i++) cr[i] = 128;
        scale[r] = s;
    }
}

/* 3. RMSNorm as int8/model.py's exact_rms_norm computes it in float32, in two halves around torch's own sqrt (torch's
 * vectorized sqrt is not always the correctly rounded one that sqrtf is, so it stays torch's):
 * batchspec_rms_mean gives t = sum / h + eps with the squares summed by arithmetic.py's row_sum tree (padded with
 * zeros to a power of two w, then s[i] += s[i + w / 2], halving w), and batchspec_rms_apply gives
 * out = weight * (x * (1 / root)) for root = sqrt(t). */
void batchspec_rms_mean(const float *x, int64_t n, int64_t h, float eps, float *t, int threads) {
    int64_t width = 1;
    while (width < h) width *= 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * h;
        float sums[width];
        for (int64_t i = 0; i < h; i++) sums[i] = xr[i] * xr[i];
        for (int64_t i = h; i < width; i++) sums[i] = 0.0f;
        for (int64_t half = width / 2; half >= 1; half /= 2)
            for (int64_t i = 0; i < half; i++) sums[i] = sums[i] + sums[i + half];
        t[r] = sums[0] / (float)h + eps;
    }
}

void batchspec_rms_apply(const float *x, int64_t n, int64_t h, const float *root, const float *weight, float *out,
                         int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        float inverse = 1.0f / root[r];
        for (int64_t i = 0; i < h; i++) out[r * h + i] = weight[i] * (x[r * h + i] * inverse);
    }
}

/* 4. Per-token quantization to `levels` held in float64 (batchspec_quantize_wide), as attention.py's keys, values
 * and queries take it from quantize_rows in float32: q[r][i] at q + r * ldq + i, the scale at scale + r * lds. */
void batchspec_quantize_wide(const float *x, int64_t n, int64_t k, float levels, double *q, int64_t ldq,
                             double *scale, int64_t lds, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * k;
        float top = 0.0f;
        for (int64_t i = 0; i < k; i++) top = fmaxf(top, fabsf(xr[i]));
        float s = top > 0.0f ? top / levels : 1.0f;
        float inverse = 1.0f / s;
        for (int64_t i = 0; i < k; i++) {
            float v = rintf(xr[i] * inverse);
            q[r * ldq + i] = v < -levels ? -levels : (v > levels ? levels : v);
        }
        scale[r * lds] = s;
    }
}

/* 5. 2**t for t <= 0 in place (batchspec_exp2_nonpositive), as arithmetic.py's exp2_nonpositive computes it in
 * float32: t clamped to [-126, 0], n = floor(t), f = t - n, Horner's rule on the ten coefficients c (each product
 * and sum rounded), times 2**n written as exponent bits. */
static inline float exp2_nonpositive(float t, const float *c) {
    float v = t < -126.0f ? -126.0f : (t > 0.0f ? 0.0f : t);
    float whole = floorf(v), f = v - whole, power = c[9];
    for (int j = 8; j >= 0; j--) {
        power = power * f;
        power = power + c[j];
    }
    int32_t bits = ((int32_t)whole + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return power * scale;
}

void batchspec_exp2_nonpositive(float *t, int64_t count, const float *c, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (count > 65536)
    for (int64_t i = 0; i < count; i++) t[i] = exp2_nonpositive(t[i], c);
}

/* 6. The exact attention of one query row (batchspec_attention), as attention.py's _attend computes it: the query
 * quantized to 15 bits; dot[j] = q . K[j] (an exact integer in float64, so in any order); the score
 * (float)((dot * (sq * scaling / ln 2)) * sk[j]), -inf where hidden; e[j] = 2**(score - max) (0 where hidden);
 * a[j] = e[j] * (float)sv[j]; W[j] = rint(a[j] / max a * 2**20), E[j] = rint(e[j] * 2**20); out = (double)(sum_j
 * W[j] V[j]) * max a / max(sum_j E[j], 1), exact integer sums again, rounded to float32 at the end. */
/* k, v: one head's packed keys and values, a key's row D + 1 doubles (D integers, then the scale) */
static void attend_row(const float *query, const double *k, const double *v, const uint8_t *visible, int64_t visible_stride,
                       int64_t keys, int64_t size, double factor, float levels, const float *c, float *scratch,
                       float *out) {
    double q[size], sum[size];
    float top = 0.0f;
    for (int64_t d = 0; d < size; d++) top = fmaxf(top, fabsf(query[d]));
    float s = top > 0.0f ? top / levels : 1.0f, inverse = 1.0f / s;
    for (int64_t d = 0; d < size; d++) {
        float x = rintf(query[d] * inverse);
        q[d] = x < -levels ? -levels : (x > levels ? levels : x);
    }
    factor = (double)s * factor;
    float *score = scratch, *a = scratch + keys;
    float best = -INFINITY;
    for (int64_t j = 0; j < keys; j++) {
        if (!visible[j * visible_stride]) {
            score[j] = -INFINITY;
            continue;
        }
        const double *kj = k + j * (size + 1);
        double dot = 0.0;
        #pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < size; d++) dot += q[d] * kj[d];
        score[j] = (float)((dot * factor) * kj[size]);
        best = fmaxf(best, score[j]);
    }
    if (best == -INFINITY) best = 0.0f;
    float a_top = 0.0f;
    double total = 0.0;
    for (int64_t j = 0; j < keys; j++) {
        float e = visible[j * visible_stride] ? exp2_nonpositive(score[j] - best, c) : 0.0f;
        a[j] = e * (float)v[j * (size + 1) + size];
        a_top = fmaxf(a_top, a[j]);
        total += (double)rintf(e * 1048576.0f);
    }
    float divisor = a_top > 0.0f ? a_top : 1.0f;
    for (int64_t d = 0; d < size; d++) sum[d] = 0.0;
    for (int64_t j = 0; j < keys; j++) {
        double w = (double)rintf((a[j] / divisor) * 1048576.0f);
        if (w == 0.0) continue;
        const double *vj = v + j * (size + 1);
        #pragma omp simd
        for (int64_t d = 0; d < size; d++) sum[d] += w * vj[d];
    }
    double scale = (double)a_top, denominator = total > 1.0 ? total : 1.0;
    for (int64_t d = 0; d < size; d++) out[d] = (float)((sum[d] * scale) / denominator);
}

/* query: float32 [B, H, Q, D] contiguous; keys, values: packed float64 [B, Hk, L, D + 1] with the given batch and
 * head strides; visible: bool [B, 1, Q, L] with strides (vb, vq, vl); out: float32 [B, Q, H, D]. */
void batchspec_attention(const float *query, const double *keys, int64_t k_batch, int64_t k_head,
                         const double *values, int64_t v_batch, int64_t v_head, const uint8_t *visible, int64_t vb,
                         int64_t vq, int64_t vl, int64_t batch, int64_t heads, int64_t kv_heads, int64_t queries,
                         int64_t length, int64_t size, double factor, float levels, const float *c, float *out,
                         int threads) {
    int64_t units = batch * heads * queries, group = heads / kv_heads;
    #pragma omp parallel num_threads(threads)
    {
        float *scratch = (float *)malloc(2 * (size_t)(length > 0 ? length : 1) * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int64_t b = u / (heads * queries), h = (u / queries) % heads, i = u % queries, hk = h / group;
            const double *k = keys + b * k_batch + hk * k_head, *v = values + b * v_batch + hk * v_head;
            attend_row(query + u * size, k, v, visible + b * vb + i * vq, vl, length, size, factor, levels, c,
                       scratch, out + ((b * queries + i) * heads + h) * size);
        }
        free(scratch);
    }
}
