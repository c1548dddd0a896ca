/* A decoder's layers in one call (forward.py's IntegerForward): each Llama-like layer the sequence of entry.h's
 * functions that forward.py once ran from Python, a call at a time, on the same buffers, so every value has the bits
 * it had (each function's own bits are argued where it is defined). Per layer:
 *
 *   activations of RMSNorm(x) in each form the q, k, v products read   batchspec_norm_quantize(_blocks), or
 *   (of x itself where the layer has no norm before its attention)     batchspec_rms_norm then a quantizer each
 *   q, k, v = the products (stacked weights: one product, several outputs)
 *   spread to the [B, S] layout (zeros at padding), q and k normed per head (Qwen3) or whole (OLMo 2)
 *   query = rotary(q); cache[start:end] = pack(rotary(k)), pack(v)      batchspec_rotary_into (unrotated: NoPE;
 *                                                                      a head's first `rotated` values: partial)
 *   attended = attention(query, cache[:end]) in blocks of `chunk` queries, each over the keys it can see
 *   h = x + o(quantize(attended at the rows read)) (normed first: OLMo 2; times a multiplier: Granite)
 *   gate, up = the products of RMSNorm(h)'s activations
 *   x = h + down(quantize(act(gate) * up)) (normed, times it too)      batchspec_quantize_gated(_blocks)
 *
 * act is SiLU or GELU with tanh (the layer's `activation`). A mixture of experts' layer (`experts` > 0: Qwen3-MoE's,
 * OLMoE's, Mixtral's) runs moe.py's SparseMoE in place of the MLP: the router's product of RMSNorm(h)'s activations,
 * each row's top_k experts by route_row (exact softmax, ties to the lower expert), each expert's gate, up and down on
 * the rows that chose it, gathered, and x = h + each row's outputs weighted and summed by rank (moe.py's combine). A sliding layer (Gemma 3's local layers) reads the
 * windowed mask and the sliding layers' rotary table in place of the others'.
 *
 * Every field is 8 bytes wide (pointers, int64_t, double). plan.py's ctypes structs mirror these typedefs; LAYOUT
 * below gives each typedef's size and each field's offset as this compiler lays them out, and plan.check_layout
 * compares the mirror with it when the library is loaded, so a field added, moved or retyped on one side only is an
 * error at once, not a forward that reads the wrong bytes. */

#include <stddef.h>

/* One product: an int8 weight as batchspec_linear reads it (bits 8) or an int4 one as batchspec_linear4 does (bits
 * 4), its outputs split into `segments` (at most 3) matrices: segment s holds outputs starts[s] .. starts[s + 1] - 1. */
typedef struct {
    int64_t bits, inner, outputs, panels, segments;
    int64_t starts[4];
    const void *weight;    /* int8: [panels, groups, 64, 4]; int4: [panels, panel_bytes] */
    const int32_t *comp;   /* int8: the weight's compensation sums [outputs] */
    const float *scale;    /* int8: [outputs] */
    const float *bias;     /* [outputs], or NULL */
    int64_t groups;        /* int8: groups of 4 inputs */
    int64_t panel_bytes, subs, block; /* int4: bytes a panel, sub-blocks a super-block, inputs per activation scale */
} product_t;

/* One layer's constant parts. qkv: 1 to 3 products giving q, k and v in that order; gate_up: 1 or 2 giving gate and
 * up. The RMSNorm weights, each NULL where the layer has no such norm: before (the attention's input), after (the
 * MLP's input), attention_out and mlp_out (their outputs, before the residual sum: OLMo 2's). q_norm, k_norm: RMSNorm
 * weights over each head (whole 0) or over the whole projection (whole 1, OLMo 2's), or NULL. factor: the attention's
 * scaling / ln 2. residual: what the attention's and the MLP's outputs are multiplied by before they join the
 * residual stream (1: nothing; Granite's residual_multiplier). softcap: the attention's scores soft-capped at it, in
 * units of log2 (the cap / ln 2; Gemma 2's attn_logit_softcapping), or 0: not capped. rotary: 0 where the layer takes its queries and keys
 * unrotated (SmolLM3's NoPE layers), else 1. activation: the MLP's (scalar.h's ACTIVATION_SILU or
 * ACTIVATION_GELU_TANH).
 * sliding: 1 where the layer attends over decoder_t's `windowed` mask and rotates by `cos_sliding`, `sin_sliding`
 * (Gemma 3's sliding-window layers), 0 where it reads `visible`, `cos` and `sin`. */
/* One expert of a mixture of experts: its gate and up (1 or 2 products, as layer_t's gate_up) and its down. */
typedef struct {
    int64_t gate_up_count;
    product_t gate_up[2], down;
} expert_t;

/* experts: the number of a mixture of experts' experts (0: the layer's MLP is gate_up and down), each in `expert`,
 * its router the product `router` (outputs: one logit per expert), top_k of them per row, their weights divided by
 * their sum where normalize is 1. */
typedef struct {
    const float *before, *after, *attention_out, *mlp_out, *q_norm, *k_norm;
    double eps_before, eps_after, eps_attention_out, eps_mlp_out, eps_q, eps_k, factor, residual, softcap;
    int64_t rotary, whole, qkv_count, gate_up_count, activation, sliding;
    product_t qkv[3], o, gate_up[2], down;
    int64_t experts, top_k, normalize;
    product_t router;
    const expert_t *expert;
} layer_t;

/* One forward's shapes, inputs and buffers (shared by every layer, which run one after another). n rows are read
 * (index: their flat positions b * seq + s in [batch, seq], or NULL where they are every position); the KV cache
 * `store` is [layers, 2, batch, kv_heads, capacity, width] with the given strides (a token's `width` int16
 * contiguous); visible: bool [batch, 1, seq, end] with strides vb, vq, vl, and windowed (NULL where no layer is
 * sliding) the same over a sliding window only, laid out alike. x [n, hidden] holds the embedded rows on
 * entry and the last layer's output on return. */
typedef struct {
    int64_t n, batch, seq, hidden, heads, kv_heads, size, width, start, end, chunk, threads;
    const int64_t *index;
    const float *cos, *sin, *cos_sliding, *sin_sliding; /* [batch, seq, rotated] each: each head's first `rotated`
                                                           * values turn (partial rotary); the sliding layers' pair
                                                           * NULL where no layer slides */
    int64_t rotated, pairs; /* pairs: turned over adjacent pairs (GLM-4's), not halves (scalar.h's rotate) */
    const uint8_t *visible, *windowed;
    int64_t vb, vq, vl;
    int16_t *store;
    int64_t s_layer, s_kv, s_batch, s_head, s_token;
    double levels;
    const float *coefficients;
    float *x, *h, *normed;             /* [n, hidden] */
    float *q, *k, *v;                  /* [n, heads * size], [n, kv_heads * size] x 2 */
    float *qs, *ks, *vs;               /* as q, k, v over [batch * seq] rows, zero at padding (index only) */
    float *query, *block_query;        /* [batch, heads, seq, size], [batch, heads, chunk, size] */
    float *attended, *block_out;       /* [batch, seq, heads, size], [batch, chunk, heads, size] */
    float *gathered;                   /* [n, heads * size] (index only) */
    float *gate, *up;                  /* [n, ffn] */
    uint8_t *codes8;                   /* int8 activations [n, 4 groups] and their scales [n] */
    float *scale8;
    int8_t *codes4;                    /* int4 activations: codes [n, padded], scales [n, blocks], sums [n, counted] */
    float *xs;
    int16_t *sums4;
    float *routed, *grouped, *expert_out; /* a mixture of experts': [n, hidden] each (normed, an expert's rows, its out) */
    float *ranked, *logits, *weights;  /* [n, top_k, hidden], [n, experts], [n, top_k] */
    int64_t *chosen, *members;         /* [n, top_k] experts by rank; [n] an expert's rows as row * top_k + rank */
    uint8_t *touched;                  /* [layers, most_experts]: 1 where the layer's expert ran on a row */
    int64_t most_experts;
} decoder_t;

/* the typedefs' layout: a size (field "") then every field's offset, for plan.check_layout */
typedef struct { const char *type, *field; int64_t value; } layout_t;
#define SIZE_OF(t) {#t, "", (int64_t)sizeof(t)}
#define AT(t, f) {#t, #f, (int64_t)offsetof(t, f)}
static const layout_t LAYOUT[] = {
    SIZE_OF(product_t), AT(product_t, bits), AT(product_t, inner), AT(product_t, outputs), AT(product_t, panels),
    AT(product_t, segments), AT(product_t, starts), AT(product_t, weight), AT(product_t, comp), AT(product_t, scale),
    AT(product_t, bias), AT(product_t, groups), AT(product_t, panel_bytes), AT(product_t, subs), AT(product_t, block),
    SIZE_OF(layer_t), AT(layer_t, before), AT(layer_t, after), AT(layer_t, attention_out), AT(layer_t, mlp_out),
    AT(layer_t, q_norm), AT(layer_t, k_norm), AT(layer_t, eps_before), AT(layer_t, eps_after),
    AT(layer_t, eps_attention_out), AT(layer_t, eps_mlp_out), AT(layer_t, eps_q), AT(layer_t, eps_k),
    AT(layer_t, factor), AT(layer_t, residual), AT(layer_t, softcap), AT(layer_t, rotary), AT(layer_t, whole), AT(layer_t, qkv_count), AT(layer_t, gate_up_count),
    AT(layer_t, activation), AT(layer_t, sliding), AT(layer_t, qkv), AT(layer_t, o), AT(layer_t, gate_up),
    AT(layer_t, down), AT(layer_t, experts), AT(layer_t, top_k), AT(layer_t, normalize), AT(layer_t, router),
    AT(layer_t, expert), SIZE_OF(expert_t), AT(expert_t, gate_up_count), AT(expert_t, gate_up), AT(expert_t, down),
    SIZE_OF(decoder_t), AT(decoder_t, n), AT(decoder_t, batch), AT(decoder_t, seq), AT(decoder_t, hidden),
    AT(decoder_t, heads), AT(decoder_t, kv_heads), AT(decoder_t, size), AT(decoder_t, width), AT(decoder_t, start),
    AT(decoder_t, end), AT(decoder_t, chunk), AT(decoder_t, threads), AT(decoder_t, index), AT(decoder_t, cos),
    AT(decoder_t, sin), AT(decoder_t, cos_sliding), AT(decoder_t, sin_sliding), AT(decoder_t, rotated),
    AT(decoder_t, pairs), AT(decoder_t, visible), AT(decoder_t, windowed), AT(decoder_t, vb), AT(decoder_t, vq),
    AT(decoder_t, vl),
    AT(decoder_t, store), AT(decoder_t, s_layer), AT(decoder_t, s_kv), AT(decoder_t, s_batch), AT(decoder_t, s_head),
    AT(decoder_t, s_token), AT(decoder_t, levels), AT(decoder_t, coefficients), AT(decoder_t, x), AT(decoder_t, h),
    AT(decoder_t, normed), AT(decoder_t, q), AT(decoder_t, k), AT(decoder_t, v), AT(decoder_t, qs), AT(decoder_t, ks),
    AT(decoder_t, vs), AT(decoder_t, query), AT(decoder_t, block_query), AT(decoder_t, attended),
    AT(decoder_t, block_out), AT(decoder_t, gathered), AT(decoder_t, gate), AT(decoder_t, up), AT(decoder_t, codes8),
    AT(decoder_t, scale8), AT(decoder_t, codes4), AT(decoder_t, xs), AT(decoder_t, sums4), AT(decoder_t, routed),
    AT(decoder_t, grouped), AT(decoder_t, expert_out), AT(decoder_t, ranked), AT(decoder_t, logits),
    AT(decoder_t, weights), AT(decoder_t, chosen), AT(decoder_t, members), AT(decoder_t, touched),
    AT(decoder_t, most_experts),
};
#undef SIZE_OF
#undef AT

/* entry i of LAYOUT: 1, or 0 past the last */
int batchspec_layout(int64_t i, const char **type, const char **field, int64_t *value) {
    if (i < 0 || i >= (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]))) return 0;
    *type = LAYOUT[i].type;
    *field = LAYOUT[i].field;
    *value = LAYOUT[i].value;
    return 1;
}

static inline int64_t sub_blocks(int64_t inner) { return (inner + 31) / 32; }
static inline int64_t counted_sums(int64_t inner) { return sub_blocks(inner) + sub_blocks(inner) % 2; }
static inline int64_t block_scales(const product_t *p) { return (p->inner + p->block - 1) / p->block; }

/* whether two products read the same activations of one input */
static inline int same_form(const product_t *a, const product_t *b) {
    return a->bits == b->bits && (a->bits == 8 || a->block == b->block);
}

/* x [n, p->inner] quantized as p reads it, RMSNorm (norm, eps) first where norm is not NULL */
static void quantize_for(const decoder_t *f, const product_t *p, const float *x, const float *norm, float eps) {
    int64_t k = p->inner, nsub = sub_blocks(k);
    int threads = (int)f->threads;
    if (p->bits == 8 && norm)
        batchspec_norm_quantize(x, f->n, k, eps, norm, 4 * p->groups, f->codes8, f->scale8, threads);
    else if (p->bits == 8)
        batchspec_quantize(x, f->n, k, 4 * p->groups, f->codes8, f->scale8, threads);
    else if (norm)
        batchspec_norm_quantize_blocks(x, f->n, k, eps, norm, p->block, 32 * nsub, f->codes4, f->xs,
                                       block_scales(p), f->sums4, counted_sums(k), threads);
    else
        batchspec_quantize_blocks(x, f->n, k, p->block, 32 * nsub, f->codes4, f->xs, block_scales(p), f->sums4,
                                  counted_sums(k), threads);
}

/* the product p of the activations quantize_for made last, into outs (residual added where not NULL) */
static void product_for(const decoder_t *f, const product_t *p, float *const *outs, const float *residual) {
    int threads = (int)f->threads;
    if (p->bits == 8)
        batchspec_linear(f->codes8, f->n, 4 * p->groups, (const int8_t *)p->weight, p->comp, f->scale8, p->scale,
                         p->bias, p->groups, p->panels, p->outputs, outs, p->starts, p->segments, residual, threads);
    else
        batchspec_linear4(f->codes4, f->n, 32 * sub_blocks(p->inner), f->xs, block_scales(p), f->sums4,
                          counted_sums(p->inner), (const uint8_t *)p->weight, p->panel_bytes, p->panels,
                          sub_blocks(p->inner), p->subs, p->outputs, p->bias, outs, p->starts, p->segments, residual,
                          threads);
}

/* out = residual + p's product of the activations quantize_for made last; where the layer has them, the product
 * RMSNorm-ed by norm first (OLMo 2) or multiplied by multiplier (Granite), rounded as transformers' layers round
 * them: the product, its norm, its multiple, the sum */
static void add_product(const decoder_t *f, const product_t *p, float *out, const float *residual, const float *norm,
                        double eps, double multiplier) {
    float *outs[1] = {out};
    if (norm == NULL && multiplier == 1.0) {
        product_for(f, p, outs, residual);
        return;
    }
    product_for(f, p, outs, NULL);
    if (norm) batchspec_rms_norm(out, f->n, p->outputs, (float)eps, norm, out, (int)f->threads);
    float m = (float)multiplier;
    unsigned saved = fp_enter();
    if (multiplier == 1.0)
        for (int64_t i = 0, count = f->n * p->outputs; i < count; i++) out[i] = residual[i] + out[i];
    else
        for (int64_t i = 0, count = f->n * p->outputs; i < count; i++) out[i] = residual[i] + out[i] * m;
    fp_leave(saved);
}

/* the products ps[0 .. count) of RMSNorm(x), their segments into targets in order: the norm fused into the one
 * quantization where all read one form, else normed once and quantized per form */
static void products_of_normed(const decoder_t *f, const product_t *ps, int64_t count, const float *x,
                               const float *norm, float eps, float **targets) {
    int one_form = 1;
    for (int64_t i = 1; i < count; i++) one_form = one_form && same_form(&ps[0], &ps[i]);
    if (!one_form && norm) batchspec_rms_norm(x, f->n, f->hidden, eps, norm, f->normed, (int)f->threads);
    const float *read = one_form || !norm ? x : f->normed; /* each form's activations are quantized from it */
    const product_t *made = NULL;
    for (int64_t i = 0; i < count; i++) {
        if (made == NULL || !same_form(made, &ps[i])) {
            quantize_for(f, &ps[i], read, one_form ? norm : NULL, eps);
            made = &ps[i];
        }
        product_for(f, &ps[i], targets, NULL);
        targets += ps[i].segments;
    }
}

/* rows [n, width] to their positions index[i] of [batch * seq, width] (spread), or back (gather) */
static void spread_rows(const float *rows, float *out, const int64_t *index, int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) memcpy(out + index[i] * width, rows + i * width, (size_t)width * sizeof(float));
}
static void gather_rows(const float *all, float *rows, const int64_t *index, int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) memcpy(rows + i * width, all + index[i] * width, (size_t)width * sizeof(float));
}

/* attended = batchspec_attention of query over the cache's first `end` tokens, in blocks of `chunk` queries, each
 * over the keys a causal block can see (attention.py's exact_attention); 1 where scratch memory ran out */
static int attend(const decoder_t *f, const layer_t *l, const int16_t *keys, const int16_t *values) {
    int64_t seq = f->seq, heads = f->heads, size = f->size, rows = f->batch * heads;
    const uint8_t *visible = l->sliding ? f->windowed : f->visible;
    if (seq <= f->chunk)
        return batchspec_attention(f->query, keys, f->s_batch, f->s_head, values, f->s_batch, f->s_head, f->width,
                                   visible, f->vb, f->vq, f->vl, f->batch, heads, f->kv_heads, seq, f->end, size,
                                   l->factor, (float)l->softcap, (float)f->levels, f->coefficients, f->attended,
                                   (int)f->threads);
    for (int64_t s0 = 0; s0 < seq; s0 += f->chunk) {
        int64_t count = seq - s0 < f->chunk ? seq - s0 : f->chunk;
        int64_t seen = f->end - seq + (s0 + f->chunk < seq ? s0 + f->chunk : seq);
        for (int64_t r = 0; r < rows; r++) /* query[b, h, s0 .. s0 + count) */
            memcpy(f->block_query + r * count * size, f->query + (r * seq + s0) * size,
                   (size_t)(count * size) * sizeof(float));
        if (batchspec_attention(f->block_query, keys, f->s_batch, f->s_head, values, f->s_batch, f->s_head, f->width,
                                visible + s0 * f->vq, f->vb, f->vq, f->vl, f->batch, heads, f->kv_heads, count,
                                seen, size, l->factor, (float)l->softcap, (float)f->levels, f->coefficients, f->block_out,
                                (int)f->threads))
            return 1;
        for (int64_t b = 0; b < f->batch; b++)
            memcpy(f->attended + (b * seq + s0) * heads * size, f->block_out + b * count * heads * size,
                   (size_t)(count * heads * size) * sizeof(float));
    }
    return 0;
}

/* quantize(act(gate) * up) as down reads it, from f->gate and f->up (f->n rows) */
static void gated_down(const decoder_t *f, const product_t *down, int64_t activation) {
    int threads = (int)f->threads;
    int64_t ffn = down->inner, nsub = sub_blocks(ffn);
    if (down->bits == 8)
        batchspec_quantize_gated(f->gate, f->up, f->n, ffn, 4 * down->groups, f->codes8, f->scale8, f->coefficients,
                                 activation, threads);
    else
        batchspec_quantize_gated_blocks(f->gate, f->up, f->n, ffn, down->block, 32 * nsub, f->codes4, f->xs,
                                        block_scales(down), f->sums4, counted_sums(ffn), f->coefficients, activation,
                                        threads);
}

/* x[0 .. width) summed as arithmetic.py's row_sum: padded with zeros to a power of two, halved elementwise; x is
 * overwritten (it holds at least that power of two) */
static float tree_sum(float *x, int64_t width) {
    int64_t span = 1;
    while (span < width) span *= 2;
    for (int64_t i = width; i < span; i++) x[i] = 0.0f;
    for (span /= 2; span >= 1; span /= 2)
        for (int64_t i = 0; i < span; i++) x[i] = x[i] + x[i + span];
    return x[0];
}

#define MAX_EXPERTS 256 /* plan.py's: the experts a layer may have */

/* moe.py's route for one row of `count` router logits (count <= MAX_EXPERTS): the softmax (exact exp, tree_sum),
 * the top_k by a selection that keeps the lower index on a tie (a stable descending sort's first k), their weights
 * divided by their tree_sum where normalize */
static void route_row(const float *logits, int64_t count, int64_t top_k, int64_t normalize, const float *c,
                      int64_t *chosen, float *weights) {
    float p[MAX_EXPERTS], sums[MAX_EXPERTS], top = logits[0];
    unsigned char taken[MAX_EXPERTS] = {0};
    for (int64_t e = 1; e < count; e++) top = larger(top, logits[e]);
    for (int64_t e = 0; e < count; e++) p[e] = exp2_nonpositive((logits[e] - top) * LOG2E, c);
    memcpy(sums, p, (size_t)count * sizeof(float));
    float total = tree_sum(sums, count);
    for (int64_t e = 0; e < count; e++) p[e] = p[e] / total;
    for (int64_t r = 0; r < top_k; r++) {
        int64_t best = -1;
        for (int64_t e = 0; e < count; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        chosen[r] = best, weights[r] = sums[r] = p[best];
    }
    if (!normalize) return;
    float kept = tree_sum(sums, top_k);
    for (int64_t r = 0; r < top_k; r++) weights[r] = weights[r] / kept;
}

/* expert e's gate, up and down on the rows that chose it (their normed rows gathered), each output row into its
 * place in f->ranked (row * top_k + rank); `touched` marks it where it ran */
static void run_expert(const decoder_t *f, const layer_t *l, int64_t e, uint8_t *touched) {
    int64_t m = 0, hidden = f->hidden, k = l->top_k;
    for (int64_t i = 0; i < f->n * k; i++)
        if (f->chosen[i] == e) f->members[m++] = i;
    if (m == 0) return;
    touched[e] = 1;
    for (int64_t j = 0; j < m; j++)
        memcpy(f->grouped + j * hidden, f->routed + f->members[j] / k * hidden, (size_t)hidden * sizeof(float));
    decoder_t g = *f;
    g.n = m;
    const expert_t *x = &l->expert[e];
    float *gate_up[2] = {g.gate, g.up}, *out[1] = {g.expert_out};
    products_of_normed(&g, x->gate_up, x->gate_up_count, g.grouped, NULL, 0.0f, gate_up);
    gated_down(&g, &x->down, l->activation);
    product_for(&g, &x->down, out, NULL);
    for (int64_t j = 0; j < m; j++)
        memcpy(f->ranked + f->members[j] * hidden, g.expert_out + j * hidden, (size_t)hidden * sizeof(float));
}

/* the mixture of experts of layer `layer` (l) on f->h into f->x (see the top of this file) */
static void mixture(const decoder_t *f, const layer_t *l, int64_t layer) {
    int64_t n = f->n, hidden = f->hidden, k = l->top_k;
    float *logits[1] = {f->logits};
    batchspec_rms_norm(f->h, n, hidden, (float)l->eps_after, l->after, f->routed, (int)f->threads);
    quantize_for(f, &l->router, f->routed, NULL, 0.0f);
    product_for(f, &l->router, logits, NULL);
    unsigned saved = fp_enter();
    for (int64_t i = 0; i < n; i++)
        route_row(f->logits + i * l->experts, l->experts, k, l->normalize, f->coefficients, f->chosen + i * k,
                  f->weights + i * k);
    fp_leave(saved);
    for (int64_t e = 0; e < l->experts; e++) run_expert(f, l, e, f->touched + layer * f->most_experts);
    saved = fp_enter();
    for (int64_t i = 0; i < n; i++) {
        const float *ranked = f->ranked + i * k * hidden, *w = f->weights + i * k;
        float *x = f->x + i * hidden;
        for (int64_t c = 0; c < hidden; c++) {
            float sum = ranked[c] * w[0];
            for (int64_t r = 1; r < k; r++) sum = sum + ranked[r * hidden + c] * w[r];
            x[c] = f->h[i * hidden + c] + sum;
        }
    }
    fp_leave(saved);
}

/* one layer on f->x (see the top of this file); 1 where scratch memory ran out */
static int decoder_layer(const decoder_t *f, const layer_t *l, int64_t layer) {
    int threads = (int)f->threads;
    int64_t wq = f->heads * f->size, wk = f->kv_heads * f->size, all = f->batch * f->seq;
    float *qkv[3] = {f->q, f->k, f->v}, *gate_up[2] = {f->gate, f->up};
    products_of_normed(f, l->qkv, l->qkv_count, f->x, l->before, (float)l->eps_before, qkv);
    float *q = f->q, *k = f->k, *v = f->v;
    if (f->index) {
        spread_rows(f->q, f->qs, f->index, f->n, wq);
        spread_rows(f->k, f->ks, f->index, f->n, wk);
        spread_rows(f->v, f->vs, f->index, f->n, wk);
        q = f->qs, k = f->ks, v = f->vs;
    }
    if (l->q_norm && l->whole) {
        batchspec_rms_norm(q, all, wq, (float)l->eps_q, l->q_norm, q, threads);
        batchspec_rms_norm(k, all, wk, (float)l->eps_k, l->k_norm, k, threads);
    } else if (l->q_norm) {
        batchspec_rms_norm(q, all * f->heads, f->size, (float)l->eps_q, l->q_norm, q, threads);
        batchspec_rms_norm(k, all * f->kv_heads, f->size, (float)l->eps_k, l->k_norm, k, threads);
    }
    int16_t *keys = f->store + layer * f->s_layer, *values = keys + f->s_kv;
    int64_t query_strides[3] = {f->heads * f->seq * f->size, f->seq * f->size, f->size};
    int64_t cache_strides[3] = {f->s_batch, f->s_head, f->s_token};
    const float *cos = l->sliding ? f->cos_sliding : f->cos, *sin = l->sliding ? f->sin_sliding : f->sin;
    if (!l->rotary) cos = sin = NULL;
    batchspec_rotary_into(q, k, v, f->batch, f->seq, f->heads, f->kv_heads, f->size, cos, sin, f->rotated, f->pairs,
                          f->query, query_strides, keys + f->start * f->s_token, cache_strides,
                          values + f->start * f->s_token, cache_strides, f->width, (float)f->levels, threads);
    if (attend(f, l, keys, values)) return 1;
    const float *attended = f->attended;
    if (f->index) {
        gather_rows(f->attended, f->gathered, f->index, f->n, wq);
        attended = f->gathered;
    }
    quantize_for(f, &l->o, attended, NULL, 0.0f);
    add_product(f, &l->o, f->h, f->x, l->attention_out, l->eps_attention_out, l->residual);
    if (l->experts) {
        mixture(f, l, layer);
        return 0;
    }
    products_of_normed(f, l->gate_up, l->gate_up_count, f->h, l->after, (float)l->eps_after, gate_up);
    gated_down(f, &l->down, l->activation);
    add_product(f, &l->down, f->x, f->h, l->mlp_out, l->eps_mlp_out, l->residual);
    return 0;
}

/* every layer in order; 0, or 1 where the attention's scratch memory ran out (the caller raises) */
int batchspec_decoder(const decoder_t *f, const layer_t *layers, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (decoder_layer(f, &layers[i], i)) return 1;
    return 0;
}
