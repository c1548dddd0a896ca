/* batchspec's own kernels for the exact int8 forward on AVX-512 VNNI CPUs, built and loaded by
 * batchspec/int8/native.py. Compiled with -ffp-contract=off: every float operation below is one correctly rounded
 * IEEE operation, the same one torch runs in the Python path it replaces, so the bits are the same.
 *
 * 1. The int8 product (batchspec_linear): out[n][o] = ((float)(q . w) * sx[n]) * sw[o] (+ b[o]), with q . w computed
 * as sum_k a[n][k] * w[o][k] - comp[o] for a[n][k] = q[n][k] + 128 as uint8 and comp[o] = 128 * sum_k w[o][k].
 * vpdpbusd adds its four u8 x s8 products to the int32 accumulator and vpsubd subtracts, both modulo 2^32 without
 * saturating, so the difference is q . w modulo 2^32: q . w itself, since |q . w| <= 127 * 127 * K < 2^31 for
 * K <= MAX_INNER (native.py). It is rounded once to float32 by vcvtdq2ps under the default round-to-nearest-even;
 * the scales multiply in that order afterwards. No float operation depends on the row count or the blocking, so
 * every row gets the same bits in any batch.
 *
 * The weight is prepacked as panels of 64 outputs: w[p][g][j][i] = W[64 p + j][4 g + i] ([P, G, 64, 4] int8), so a
 * panel streams from memory in one pass and each group g is four 16-lane registers, one per 16 outputs. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 64     /* outputs per panel: four 16-lane int32 accumulators per row */
#define ROWS 4       /* activation rows per micro-kernel pass: 16 accumulators + 4 weight registers */
#define ROW_BLOCK 60 /* rows per pass over the weight: their outputs stay in cache while a panel is reused */

/* the larger of two floats (neither is NaN here); fmaxf is a library call */
static inline float larger(float a, float b) { return a > b ? a : b; }

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
        default: panel_rows(4, ar, lda, panel, groups, er, col, outr, ldo, valid); break;
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
        for (int64_t i = 0; i < k; i++) top = larger(top, fabsf(xr[i]));
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
        for (int64_t i = 0; i < k; i++) top = larger(top, fabsf(xr[i]));
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
/* sum_d q[d] * k[d] for integer-valued doubles whose partial sums stay below 2**53: exact in any order, so four
 * independent vector chains (the FMA's latency hidden) give the same value as any other order. */
static inline double integer_dot(const double *q, const double *k, int64_t size) {
    int64_t d = 0;
    double dot = 0.0;
    if (size >= 32) {
        __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
        __m512d acc2 = _mm512_setzero_pd(), acc3 = _mm512_setzero_pd();
        for (; d + 32 <= size; d += 32) {
            acc0 = _mm512_fmadd_pd(_mm512_loadu_pd(q + d), _mm512_loadu_pd(k + d), acc0);
            acc1 = _mm512_fmadd_pd(_mm512_loadu_pd(q + d + 8), _mm512_loadu_pd(k + d + 8), acc1);
            acc2 = _mm512_fmadd_pd(_mm512_loadu_pd(q + d + 16), _mm512_loadu_pd(k + d + 16), acc2);
            acc3 = _mm512_fmadd_pd(_mm512_loadu_pd(q + d + 24), _mm512_loadu_pd(k + d + 24), acc3);
        }
        dot = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(acc0, acc1), _mm512_add_pd(acc2, acc3)));
    }
    for (; d < size; d++) dot += q[d] * k[d];
    return dot;
}

/* out[d] = sum_j w[j] * v[j][d] for integer-valued w (below 2**21) and v (below 2**15), v's rows D + 1 doubles
 * apart: products and sums exact integers below 2**53, so in any order; 64 channels at a time in registers. */
static void weighted_sum(const float *w, const double *v, int64_t keys, int64_t size, double *out) {
    int64_t d = 0;
    for (; d + 64 <= size; d += 64) {
        __m512d acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_pd();
        for (int64_t j = 0; j < keys; j++) {
            if (w[j] == 0.0f) continue;
            __m512d wj = _mm512_set1_pd((double)w[j]);
            const double *vj = v + j * (size + 1) + d;
            for (int t = 0; t < 8; t++) acc[t] = _mm512_fmadd_pd(wj, _mm512_loadu_pd(vj + 8 * t), acc[t]);
        }
        for (int t = 0; t < 8; t++) _mm512_storeu_pd(out + d + 8 * t, acc[t]);
    }
    for (; d < size; d++) {
        double total = 0.0;
        for (int64_t j = 0; j < keys; j++) total += (double)w[j] * v[j * (size + 1) + d];
        out[d] = total;
    }
}

/* One KV head of one batch row (a GQA group): its R = G * Q query rows, r = g * Q + i for head hk * G + g and query
 * i, read each key and value once. Keys and values are packed, a key's row D + 1 doubles (D integers, the scale). */
typedef struct {
    int64_t queries, rows, keys, size, visible_stride, visible_row;
    double factor; /* scaling / ln 2 */
    float levels;
    const float *c;
} group_t;

/* q[r] = the 15-bit integers of query row r (in doubles); factor[r] = its scale * scaling / ln 2 */
static void quantize_queries(group_t g, const float *query, double *q, double *factor) {
    for (int64_t r = 0; r < g.rows; r++) {
        const float *x = query + r * g.size;
        float top = 0.0f;
        for (int64_t d = 0; d < g.size; d++) top = larger(top, fabsf(x[d]));
        float s = top > 0.0f ? top / g.levels : 1.0f, inverse = 1.0f / s;
        for (int64_t d = 0; d < g.size; d++) {
            float y = rintf(x[d] * inverse);
            q[r * g.size + d] = y < -g.levels ? -g.levels : (y > g.levels ? g.levels : y);
        }
        factor[r] = (double)s * g.factor;
    }
}

/* score[r][j] = (float)((q[r] . K[j] * factor[r]) * sk[j]), -inf where query r % Q does not see key j */
static void scores(group_t g, const double *q, const double *factor, const double *k, const uint8_t *visible,
                   float *score) {
    for (int64_t j = 0; j < g.keys; j++) {
        const double *kj = k + j * (g.size + 1);
        for (int64_t r = 0; r < g.rows; r++) {
            int seen = visible[(r % g.queries) * g.visible_row + j * g.visible_stride];
            score[r * g.keys + j] = seen ? (float)((integer_dot(q + r * g.size, kj, g.size) * factor[r]) * kj[g.size])
                                         : -INFINITY;
        }
    }
}

/* One row's scores in place -> W[j] = rint(a[j] / max a * 2**20) with e[j] = 2**(score - max), a[j] = e[j] * sv[j];
 * *scale = max a, *denominator = max(sum_j rint(e[j] * 2**20), 1). */
static void softmax_weights(group_t g, float *score, const uint8_t *seen, const double *v, double *scale,
                            double *denominator) {
    float best = -INFINITY, a_top = 0.0f;
    for (int64_t j = 0; j < g.keys; j++) best = larger(best, score[j]);
    if (best == -INFINITY) best = 0.0f;
    for (int64_t j = 0; j < g.keys; j++) score[j] = exp2_nonpositive(score[j] - best, g.c); /* one vector loop */
    double total = 0.0;
    for (int64_t j = 0; j < g.keys; j++) {
        float e = seen[j * g.visible_stride] ? score[j] : 0.0f;
        total += (double)rintf(e * 1048576.0f);
        score[j] = e * (float)v[j * (g.size + 1) + g.size]; /* a[j] */
        a_top = larger(a_top, score[j]);
    }
    float divisor = a_top > 0.0f ? a_top : 1.0f;
    for (int64_t j = 0; j < g.keys; j++) score[j] = rintf((score[j] / divisor) * 1048576.0f);
    *scale = (double)a_top;
    *denominator = total > 1.0 ? total : 1.0;
}

/* q, sum: [R, D] doubles of scratch; score: [R, L] floats; out: row r at out + (r / Q) * out_head + (r % Q) *
 * out_query */
static void attend_group(group_t g, const float *query, const double *k, const double *v, const uint8_t *visible,
                         double *q, double *sum, float *score, float *out, int64_t out_head, int64_t out_query) {
    double factor[g.rows], scale[g.rows], denominator[g.rows];
    quantize_queries(g, query, q, factor);
    scores(g, q, factor, k, visible, score);
    for (int64_t r = 0; r < g.rows; r++) {
        const uint8_t *seen = visible + (r % g.queries) * g.visible_row;
        softmax_weights(g, score + r * g.keys, seen, v, scale + r, denominator + r);
        weighted_sum(score + r * g.keys, v, g.keys, g.size, sum + r * g.size);
    }
    for (int64_t r = 0; r < g.rows; r++) {
        float *o = out + (r / g.queries) * out_head + (r % g.queries) * out_query;
        for (int64_t d = 0; d < g.size; d++) o[d] = (float)((sum[r * g.size + d] * scale[r]) / denominator[r]);
    }
}

/* query: float32 [B, H, Q, D] contiguous; keys, values: packed float64 [B, Hk, L, D + 1] with the given batch and
 * head strides; visible: bool [B, 1, Q, L] with strides (vb, vq, vl); out: float32 [B, Q, H, D]. Returns 0, or 1
 * where scratch memory could not be allocated (out is then incomplete; the caller raises). */
int batchspec_attention(const float *query, const double *keys, int64_t k_batch, int64_t k_head,
                        const double *values, int64_t v_batch, int64_t v_head, const uint8_t *visible, int64_t vb,
                        int64_t vq, int64_t vl, int64_t batch, int64_t heads, int64_t kv_heads, int64_t queries,
                        int64_t length, int64_t size, double factor, float levels, const float *c, float *out,
                        int threads) {
    int64_t group = heads / kv_heads, rows = group * queries;
    group_t g = {queries, rows, length, size, vl, vq, factor, levels, c};
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        double *q = (double *)malloc(2 * (size_t)(rows * size) * sizeof(double));
        float *score = (float *)malloc((size_t)(rows * (length > 0 ? length : 1)) * sizeof(float));
        failed = q == NULL || score == NULL;
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < batch * kv_heads; u++) {
            if (failed) continue;
            int64_t b = u / kv_heads, hk = u % kv_heads;
            attend_group(g, query + (b * heads + hk * group) * queries * size, keys + b * k_batch + hk * k_head,
                         values + b * v_batch + hk * v_head, visible + b * vb, q, q + rows * size, score,
                         out + (b * queries * heads + hk * group) * size, size, heads * size);
        }
        free(q);
        free(score);
    }
    return failed;
}
