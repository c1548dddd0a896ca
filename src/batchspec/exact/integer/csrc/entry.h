/* The exported functions every build of batchspec's native kernels shares, built on what the including file
 * (avx512.c, avx2.c, portable.c and neon.c through plain.h) defines for its instruction set before it includes this one:
 *
 *   panel_block(a, rows, lda, panel, groups, e, col, out, ldo, valid)   the int8 product of one panel of 64 outputs,
 *                                                the codes a as activation_t (as they are, or as the build's
 *                                                prepare_codes lays them out where PREPARED_CODES is its bytes
 *                                                a code);
 *   quantize_values(x, k, ldc, codes, scale)     one row quantized to the product's codes;
 *   activation_values(x, up, out, k, c, a)       out = activation_value(x, c, a) (times up where up is not NULL);
 *   attend_group(g, query, k, v, visible, s, out, out_head, out_query)   one GQA group's exact attention;
 *   panels4_block(...), PANELS4                  the int4 product of PANELS4 panels of 16 outputs;
 *
 * each giving, lane by lane, the bits of its scalar twin in scalar.h. Rows are split between threads whole, so no
 * float operation depends on the thread count either, and every thread of every parallel region computes under
 * scalar.h's fixed floating-point environment (fp_enter at the start of its part, fp_leave at the end), whatever
 * the caller's thread or OpenMP's workers had set.
 *
 * Values that are not finite: every quantizer gives a row (or an int4 block) holding an inf or a NaN the scale NaN
 * and the codes of 0 (scalar.h's scale_of), so each output a product computes from it is NaN; an attention query
 * that sees such a key or value, or is such a query, is NaN in every channel (batchspec_attention). */

/* The int8 product (batchspec_linear): out[n][o] = ((float)(q . w) * sx[n]) * sw[o] (+ b[o]) (+ residual), each
 * output as scalar.h's epilogue_value, the build's panel_block on one panel of 64 outputs at a time, ROW_BLOCK rows
 * at a time (a build whose panel_block reads the codes prepared, PREPARED_CODES, gets them so once per row block).
 * a: uint8 [n, 4 groups] (row stride lda); w: int8 [panels, groups, 64, 4]; comp, col_scale, bias: [o] (bias may
 * be NULL); row_scale: [n]; 64 (panels - 1) < o <= 64 panels. The outputs go to `segments` float32 matrices:
 * outs[s] is [n, starts[s + 1] - starts[s]] and takes outputs starts[s] .. starts[s + 1] - 1, with starts[0] = 0,
 * starts[segments] = o and every other start a multiple of 64 (the layers of one stacked weight each get their own
 * output; one layer is one segment). With one segment, `residual` (float32 [n, o], or NULL) is added to each output
 * last: a decoder layer's residual connection, residual + y rounded once as torch's addition rounds it. */
void batchspec_linear(const uint8_t *a, int64_t n, int64_t lda, const int8_t *w, const int32_t *comp,
                      const float *row_scale, const float *col_scale, const float *bias, int64_t groups,
                      int64_t panels, int64_t o, float *const *outs, const int64_t *starts, int64_t segments,
                      const float *residual, int threads) {
#if PREPARED_CODES
    activation_t *prepared = malloc((size_t)((n < ROW_BLOCK ? n : ROW_BLOCK) * lda * PREPARED_CODES));
    int64_t ldp = PREPARED_CODES * lda;
#else
    int64_t ldp = lda;
#endif
    for (int64_t r0 = 0; r0 < n; r0 += ROW_BLOCK) {
        int64_t rows = n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK;
#if PREPARED_CODES
        const activation_t *codes = prepare_codes(a + r0 * lda, rows * lda, prepared);
#else
        const activation_t *codes = (const activation_t *)(a + r0 * lda);
#endif
        epilogue_t e = {comp, row_scale + r0, col_scale, bias, NULL};
        #pragma omp parallel num_threads(threads)
        {
            unsigned saved = fp_enter(); /* scalar.h: the epilogue's float steps under one environment */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                int64_t col = p * PANEL, s = 0;
                while (s + 1 < segments && starts[s + 1] <= col) s++;
                int64_t width = starts[s + 1] - starts[s], end = starts[s + 1];
                int64_t valid = end - col < PANEL ? end - col : PANEL, at = r0 * width + (col - starts[s]);
                epilogue_t ep = e;
                ep.residual = residual ? residual + at : NULL;
                panel_block(codes, rows, ldp, w + p * groups * 4 * PANEL, groups, ep, col,
                            outs[s] + at, width, valid);
            }
            fp_leave(saved);
        }
    }
#if PREPARED_CODES
    free(prepared);
#endif
}

/* Per-token quantization to the product's codes, as int8/arithmetic.py's quantize_rows and product.py's
 * activation_codes compute it in float32: top = max |x|; scale = scale_of(top, 127) (scalar.h);
 * q = clamp(rint(x * (1 / scale)), -127, 127); code = q + 128, and 128 in the padding columns k .. ldc. */
void batchspec_quantize(const float *x, int64_t n, int64_t k, int64_t ldc, uint8_t *codes, float *scale,
                        int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) quantize_values(x + r * k, k, ldc, codes + r * ldc, scale + r);
        fp_leave(saved);
    }
}

/* arithmetic.py's exact_silu (activation ACTIVATION_SILU) or exact_gelu_tanh (ACTIVATION_GELU_TANH), elementwise */
void batchspec_activation(const float *x, float *y, int64_t count, const float *c, int64_t activation, int threads) {
    int64_t chunk = 1 << 14;
    #pragma omp parallel num_threads(threads) if (count > 65536)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < count; i += chunk)
            activation_values(x + i, NULL, y + i, count - i < chunk ? count - i : chunk, c, activation);
        fp_leave(saved);
    }
}

/* batchspec_quantize of activation(gate) * up (each value rounded as arithmetic.py's torch code rounds it), a row
 * at a time through a buffer on the stack: the MLP's activation on its way to the down projection, never written
 * out */
void batchspec_quantize_gated(const float *gate, const float *up, int64_t n, int64_t k, int64_t ldc, uint8_t *codes,
                              float *scale, const float *c, int64_t activation, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            float row[k];
            activation_values(gate + r * k, up + r * k, row, k, c, activation);
            quantize_values(row, k, ldc, codes + r * ldc, scale + r);
        }
        fp_leave(saved);
    }
}

/* The int4 product's activations (scalar.h's quantize_block_row), a row at a time: codes q [n, padded] int8,
 * scales [n, ceil(k / block)] float32, sub-block sums [n, counted] int16 */
void batchspec_quantize_blocks(const float *x, int64_t n, int64_t k, int64_t block, int64_t padded, int8_t *q,
                               float *scale, int64_t lds, int16_t *sums, int64_t counted, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++)
            quantize_block_row(x + r * k, k, block, padded, q + r * padded, scale + r * lds, sums + r * counted,
                               counted);
        fp_leave(saved);
    }
}

/* batchspec_quantize_blocks of activation(gate) * up, a row at a time, never written out (as
 * batchspec_quantize_gated) */
void batchspec_quantize_gated_blocks(const float *gate, const float *up, int64_t n, int64_t k, int64_t block,
                                     int64_t padded, int8_t *q, float *scale, int64_t lds, int16_t *sums,
                                     int64_t counted, const float *c, int64_t activation, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            float row[k];
            activation_values(gate + r * k, up + r * k, row, k, c, activation);
            quantize_block_row(row, k, block, padded, q + r * padded, scale + r * lds, sums + r * counted, counted);
        }
        fp_leave(saved);
    }
}

/* RMSNorm as model.py's exact_rms_norm computes it in float32 (scalar.h's rms_root, then rms_apply_row) */
void batchspec_rms_norm(const float *x, int64_t n, int64_t h, float eps, const float *weight, float *out,
                        int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) rms_apply_row(x + r * h, h, rms_root(x + r * h, h, eps), weight, out + r * h);
        fp_leave(saved);
    }
}

/* batchspec_rms_norm, then batchspec_quantize of its rows, without writing the normalized rows out: a decoder
 * layer's norm feeds only the quantization of its products' input */
void batchspec_norm_quantize(const float *x, int64_t n, int64_t h, float eps, const float *weight, int64_t ldc,
                             uint8_t *codes, float *scale, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            float normed[h];
            rms_apply_row(x + r * h, h, rms_root(x + r * h, h, eps), weight, normed);
            quantize_values(normed, h, ldc, codes + r * ldc, scale + r);
        }
        fp_leave(saved);
    }
}

/* batchspec_rms_norm, then batchspec_quantize_blocks of its rows (as batchspec_norm_quantize) */
void batchspec_norm_quantize_blocks(const float *x, int64_t n, int64_t h, float eps, const float *weight,
                                    int64_t block, int64_t padded, int8_t *q, float *scale, int64_t lds,
                                    int16_t *sums, int64_t counted, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            float normed[h];
            rms_apply_row(x + r * h, h, rms_root(x + r * h, h, eps), weight, normed);
            quantize_block_row(normed, h, block, padded, q + r * padded, scale + r * lds, sums + r * counted,
                               counted);
        }
        fp_leave(saved);
    }
}

/* 15-bit quantization (scalar.h's token_scale and token_code) with q and the scale in float64 (q[r][i] at
 * q + r * ldq + i, the scale at scale + r * lds; a row that is not finite: q 0, scale NaN) */
void batchspec_quantize_wide(const float *x, int64_t n, int64_t k, float levels, double *q, int64_t ldq,
                             double *scale, int64_t lds, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) {
            const float *xr = x + r * k;
            float s = token_scale(xr, k, levels), inverse = 1.0f / s;
            for (int64_t i = 0; i < k; i++) q[r * ldq + i] = isnan(s) ? 0.0 : token_code(xr[i], inverse, levels);
            scale[r * lds] = s;
        }
        fp_leave(saved);
    }
}

/* keys or values packed for the KV cache (scalar.h's pack_token), a token at a time */
void batchspec_pack_kv(const float *x, int64_t n, int64_t k, float levels, int16_t *out, int64_t width,
                       int threads) {
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < n; r++) pack_token(x + r * k, k, levels, out + r * width, width);
        fp_leave(saved);
    }
}

/* A layer's queries, keys and values on their way to the attention: queries rotated into `query` (float32), keys
 * rotated and values as they are packed into the KV cache as batchspec_pack_kv packs them. q is
 * [batch, seq, heads, d] contiguous, k and v [batch, seq, kv_heads, d], cos and sin [batch, seq, rotated] (both NULL:
 * a layer without a rotary embedding, queries and keys taken as they are), each head's first `rotated` values turned
 * over halves or, with `pairs`, over adjacent pairs (scalar.h's rotate); token (b, s) of head h goes to
 * out + b * st[0] + h * st[1] + s * st[2] of its output. */
void batchspec_rotary_into(const float *q, const float *k, const float *v, int64_t batch, int64_t seq,
                           int64_t heads, int64_t kv_heads, int64_t d, const float *cos, const float *sin,
                           int64_t rotated, int64_t pairs, float *query, const int64_t *qst, int16_t *keys,
                           const int64_t *kst, int16_t *values, const int64_t *vst, int64_t width, float levels,
                           int threads) {
    int64_t per_token = heads + 2 * kv_heads, rows = batch * seq * per_token;
    #pragma omp parallel num_threads(threads) if (rows * d > 65536)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++) {
            int64_t token = r / per_token, j = r % per_token, b = token / seq, s = token % seq;
            const float *c = cos ? cos + token * rotated : NULL, *n = sin ? sin + token * rotated : NULL;
            if (j < heads) {
                const float *x = q + (token * heads + j) * d;
                float *y = query + b * qst[0] + j * qst[1] + s * qst[2];
                if (c) rotate(x, c, n, d, rotated, (int)pairs, y);
                else memcpy(y, x, (size_t)d * sizeof(float));
            } else if (j < heads + kv_heads) {
                int64_t h = j - heads;
                float rotated_key[d];
                const float *x = k + (token * kv_heads + h) * d;
                if (c) rotate(x, c, n, d, rotated, (int)pairs, rotated_key);
                pack_token(c ? rotated_key : x, d, levels, keys + b * kst[0] + h * kst[1] + s * kst[2], width);
            } else {
                int64_t h = j - heads - kv_heads;
                pack_token(v + (token * kv_heads + h) * d, d, levels, values + b * vst[0] + h * vst[1] + s * vst[2],
                           width);
            }
        }
        fp_leave(saved);
    }
}

/* 2**t for t <= 0 in place (scalar.h's exp2_nonpositive) */
void batchspec_exp2_nonpositive(float *t, int64_t count, const float *c, int threads) {
    #pragma omp parallel num_threads(threads) if (count > 65536)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < count; i++) t[i] = exp2_nonpositive(t[i], c);
        fp_leave(saved);
    }
}

/* What one batch row of the attention must compute (batchspec_attention): its first `queries` queries, those up to
 * the last that sees a key, over keys first .. first + keys - 1, from the first key any of them sees to the last.
 * A key no query sees has weight 0 in every sum and no part in any maximum, and a query that sees no key is 0 in
 * every channel, so leaving them out changes no bit (the sums are exact in any order and any blocking): a ragged
 * verification's unscored drafts and a short row's padding beside long rows cost nothing. */
typedef struct {
    int64_t queries, first, keys;
} span_t;

static span_t seen_span(const uint8_t *visible, int64_t vq, int64_t vl, int64_t queries, int64_t length) {
    span_t p = {0, length, 0};
    int64_t last = -1;
    for (int64_t i = 0; i < queries; i++) {
        const uint8_t *row = visible + i * vq;
        int64_t j = 0, k = length - 1;
        while (j < length && !row[j * vl]) j++;
        if (j == length) continue;
        while (!row[k * vl]) k--;
        p.queries = i + 1;
        p.first = j < p.first ? j : p.first;
        last = k > last ? k : last;
    }
    p.keys = last - p.first + 1;
    if (p.queries == 0) p.first = 0, p.keys = 0;
    return p;
}

/* The exact attention (batchspec_attention), as attention.py's _attend computes it: each query quantized to 15
 * bits; dot[j] = q . K[j] (an exact integer, so in any order); the score (float)((dot * (sq * scaling / ln 2)) *
 * sk[j]), -inf where hidden, soft-capped where softcap is not 0 (scalar.h's softcap_scores); e[j] = 2**(score - max) (0 where hidden); a[j] = e[j] * sv[j];
 * W[j] = rint(a[j] / max a * 2**20), E[j] = rint(e[j] * 2**20); out = (double)(sum_j W[j] V[j]) * max a /
 * max(sum_j E[j], 1), exact integer sums again, rounded to float32 at the end. A query that sees a key whose score is
 * not finite (the key or the query holds an inf or a NaN, so its scale is NaN; or the score overflows float32) or a
 * value whose scale is NaN is NaN in every channel (its weights 0, max a NaN: (0 * NaN) / 1), as attention.py's
 * _attend defines it; a key or value it does not see changes nothing.
 *
 * One attend_group call handles one KV head of one batch row and reads each key and value once from the int16 cache
 * (a token's row is `width` int16: its D integers, the scale's bits in their parities). The dots are summed in
 * int32 on the query's two halves (quantize_queries states the bound), then joined in float64. The weighted sum is
 * summed in int32 too, on W's two halves W = 1024 * Wh + Wl, for at most PAIR_FLUSH key pairs (2 * PAIR_FLUSH * 1024
 * * 32767 < 2**31: Wh <= 1024, Wl < 1024), then joined in float64: every partial sum an integer below 2**53
 * (|V| <= 2**15 - 1, W <= 2**20 and L < 2**18, attention.py's bounds). Both are exact, so no blocking can change a
 * bit.
 *
 * query: float32 [B, H, Q, D] contiguous; keys, values: the int16 cache [B, Hk, L, width] with the given batch and
 * head strides (tokens `width` apart); visible: bool [B, 1, Q, L] with strides (vb, vq, vl); out: float32
 * [B, Q, H, D]. Returns 0, or 1 where scratch memory could not be allocated (out is then incomplete; the caller
 * raises). */
int batchspec_attention(const float *query, const int16_t *keys, int64_t k_batch, int64_t k_head,
                        const int16_t *values, int64_t v_batch, int64_t v_head, int64_t width,
                        const uint8_t *visible, int64_t vb, int64_t vq, int64_t vl, int64_t batch, int64_t heads,
                        int64_t kv_heads, int64_t queries, int64_t length, int64_t size, double factor, float softcap,
                        float levels, const float *c, float *out, int threads) {
    int64_t group = heads / kv_heads, rows = group * queries;
    int64_t padded = (rows + PASS_ROWS - 1) / PASS_ROWS * PASS_ROWS, columns = length > 0 ? length : 1;
    int64_t lanes = (size + 31) / 32 * 32;
    int64_t pairs = length > 0 ? (length + 1) / 2 : 1;
    size_t sizes[8] = {(size_t)(padded * lanes) * sizeof(double), (size_t)((padded + 1) * columns) * sizeof(float),
                       (size_t)(padded * lanes) * sizeof(int16_t), (size_t)(padded * lanes) * sizeof(int16_t),
                       (size_t)(4 * padded * pairs) * sizeof(int16_t), (size_t)(2 * pairs * lanes) * sizeof(int16_t),
                       (size_t)(2 * PASS_ROWS * pairs) * sizeof(int32_t), (size_t)(rows * size) * sizeof(float)};
    size_t offsets[9] = {0}; /* sum, score and v_scale, hi, lo, wh and wl, vp, wp, the queries seen: 64-byte aligned */
    for (int i = 0; i < 8; i++) offsets[i + 1] = offsets[i] + (sizes[i] + 63) / 64 * 64;
    span_t *spans = malloc((size_t)(batch > 0 ? batch : 1) * sizeof(span_t));
    if (spans == NULL) return 1;
    for (int64_t b = 0; b < batch; b++) spans[b] = seen_span(visible + b * vb, vq, vl, queries, length);
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        unsigned saved = fp_enter();
        char *memory = (char *)scratch(offsets[8]);
        failed = memory == NULL;
        scratch_t s = {0};
        float *seen_queries = NULL;
        if (!failed) {
            s.sum = (double *)memory;
            s.score = (float *)(memory + offsets[1]);
            s.v_scale = s.score + padded * columns;
            s.hi = (int16_t *)(memory + offsets[2]);
            s.lo = (int16_t *)(memory + offsets[3]);
            s.wh = (int16_t *)(memory + offsets[4]);
            s.wl = s.wh + 2 * padded * pairs;
            s.vp = (int16_t *)(memory + offsets[5]);
            s.wp = (int32_t *)(memory + offsets[6]);
            seen_queries = (float *)(memory + offsets[7]);
        }
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < batch * kv_heads; u++) {
            if (failed) continue;
            int64_t b = u / kv_heads, hk = u % kv_heads;
            span_t p = spans[b];
            const float *q = query + (b * heads + hk * group) * queries * size;
            float *o = out + (b * queries * heads + hk * group) * size;
            for (int64_t i = p.queries; i < queries; i++) /* a query that sees no key attends to nothing: zeros */
                memset(o + i * heads * size, 0, (size_t)(group * size) * sizeof(float));
            if (p.queries == 0) continue;
            if (p.queries < queries) { /* the group's queries seen, [G, p.queries, D] */
                for (int64_t h = 0; h < group; h++)
                    memcpy(seen_queries + h * p.queries * size, q + h * queries * size,
                           (size_t)(p.queries * size) * sizeof(float));
                q = seen_queries;
            }
            int64_t seen_rows = group * p.queries;
            group_t g = {p.queries, seen_rows, (seen_rows + PASS_ROWS - 1) / PASS_ROWS * PASS_ROWS, p.keys, size,
                         lanes, width, vl, vq, factor, levels, softcap, c};
            attend_group(g, q, keys + b * k_batch + hk * k_head + p.first * width,
                         values + b * v_batch + hk * v_head + p.first * width, visible + b * vb + p.first * vl, s, o,
                         size, heads * size);
        }
        scratch_done();
        fp_leave(saved);
    }
    free(spans);
    return failed;
}

/* The int4 product with its bias and residual (each build's panels4_block on PANELS4 panels of PANEL4 outputs at a
 * time): q int8 [n, 32 nsub] (row stride ldq), xs float32 [n, ldx] (one scale per super-block), sums int16 [n, lds]
 * (one per sub-block, zero-padded to even), w the packed weight (`panels` panels of panel_bytes, scalar.h), bias [o]
 * or NULL; the outputs go to `segments` float32 matrices as batchspec_linear's do, residual ([n, o], one segment)
 * added last. Panels are split between threads; each row's outputs come from one thread, the super-blocks in order. */
void batchspec_linear4(const int8_t *q, int64_t n, int64_t ldq, const float *xs, int64_t ldx, const int16_t *sums,
                       int64_t lds, const uint8_t *w, int64_t panel_bytes, int64_t panels, int64_t nsub,
                       int64_t subs, int64_t o, const float *bias, float *const *outs, const int64_t *starts,
                       int64_t segments, const float *residual, int threads) {
    int64_t steps = (panels + PANELS4 - 1) / PANELS4;
    #pragma omp parallel num_threads(threads)
    {
        unsigned saved = fp_enter();
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < steps; i++) {
            int64_t first = i * PANELS4, count = panels - first < PANELS4 ? panels - first : PANELS4;
            out4_t where[PANELS4];
            for (int64_t c = 0; c < count; c++) {
                int64_t col = (first + c) * PANEL4, s = 0;
                while (s + 1 < segments && starts[s + 1] <= col) s++;
                int64_t width = starts[s + 1] - starts[s], end = starts[s + 1], at = col - starts[s];
                where[c] = (out4_t){outs[s] + at, width, end - col < PANEL4 ? end - col : PANEL4,
                                    bias ? bias + col : NULL, residual ? residual + at : NULL};
            }
            panels4_block(q, n, ldq, xs, ldx, sums, lds, w + first * panel_bytes, panel_bytes, count, nsub, subs,
                          where);
        }
        fp_leave(saved);
    }
}

/* float16 bits as float32 (scalar.h's half_to_float, with which the portable build reads the int4 weight's d and
 * dmin; tests/test_int4.py compares it with torch's conversion for every bit pattern) */
void batchspec_half_to_float(const uint16_t *h, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(h[i]);
}

#include "decoder.h"
