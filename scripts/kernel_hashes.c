/* Hashes of batchspec's native kernels on random cases, to compare builds and architectures bit for bit
 * (scripts/aarch64_check.py compiles this file with each build's source and compares what each prints).
 *
 * Usage: kernel_hashes [cases] [threads]. Each case draws its shapes and values from a fixed xorshift generator (so
 * every build and machine sees the same inputs, made from integers by exact float operations), calls every kernel
 * (the float16 conversion of all 65,536 patterns once; per case the int8 quantization and product with bias and, in
 * odd cases, a residual; the int4 activations' quantization and the int4 product; SiLU; GELU with tanh; RMSNorm; the
 * gated quantization; KV packing; the attention over packed keys and values with holes in its causal mask) and folds
 * each kernel's output bytes into that kernel's FNV-1a hash; every seventh case puts an inf or a NaN in one row. It
 * prints one line per kernel: its name and its hash. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the exported functions (entry.h) this driver calls */
void batchspec_half_to_float(const uint16_t *h, int64_t n, float *out);
void batchspec_quantize(const float *x, int64_t n, int64_t k, int64_t ldc, uint8_t *codes, float *scale, int threads);
void batchspec_linear(const uint8_t *a, int64_t n, int64_t lda, const int8_t *w, const int32_t *comp,
                      const float *row_scale, const float *col_scale, const float *bias, int64_t groups,
                      int64_t panels, int64_t o, float *const *outs, const int64_t *starts, int64_t segments,
                      const float *residual, int threads);
void batchspec_quantize_blocks(const float *x, int64_t n, int64_t k, int64_t block, int64_t padded, int8_t *q,
                               float *scale, int64_t lds, int16_t *sums, int64_t counted, int threads);
void batchspec_linear4(const int8_t *q, int64_t n, int64_t ldq, const float *xs, int64_t ldx, const int16_t *sums,
                       int64_t lds, const uint8_t *w, int64_t panel_bytes, int64_t panels, int64_t nsub,
                       int64_t subs, int64_t o, const float *bias, float *const *outs, const int64_t *starts,
                       int64_t segments, const float *residual, int threads);
void batchspec_activation(const float *x, float *y, int64_t count, const float *c, int64_t activation, int threads);
void batchspec_rms_norm(const float *x, int64_t n, int64_t h, float eps, const float *weight, float *out, int threads);
void batchspec_quantize_gated(const float *gate, const float *up, int64_t n, int64_t k, int64_t ldc, uint8_t *codes,
                              float *scale, const float *c, int64_t activation, int threads);
void batchspec_pack_kv(const float *x, int64_t n, int64_t k, float levels, int16_t *out, int64_t width, int threads);
int batchspec_attention(const float *query, const int16_t *keys, int64_t k_batch, int64_t k_head,
                        const int16_t *values, int64_t v_batch, int64_t v_head, int64_t width,
                        const uint8_t *visible, int64_t vb, int64_t vq, int64_t vl, int64_t batch, int64_t heads,
                        int64_t kv_heads, int64_t queries, int64_t length, int64_t size, double factor, float softcap,
                        float levels, const float *c, float *out, int threads);

/* 2**t's polynomial (arithmetic.py's EXP2_COEFFICIENTS, lowest degree first) */
static const float C[10] = {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.055504108664821576f,
                            0.009618129107628477f, 0.0013333558146428441f, 0.00015403530393381606f,
                            1.5252733804059838e-05f, 1.3215486790144305e-06f, 1.0178086009239696e-07f};
static const float LEVELS = 32767.0f; /* the KV cache's and the attention's 15-bit levels */

enum { HALF, QUANTIZE, LINEAR, QUANTIZE_BLOCKS, LINEAR4, SILU, GELU_TANH, RMS_NORM, QUANTIZE_GATED, PACK_KV,
       ATTENTION, KERNELS };
static const char *NAMES[KERNELS] = {"half_to_float", "quantize", "linear", "quantize_blocks", "linear4", "silu",
                                     "gelu_tanh", "rms_norm", "quantize_gated", "pack_kv", "attention"};
static uint64_t hashes[KERNELS];

/* folds n bytes at p into kernel's FNV-1a hash */
static void mix(int kernel, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) hashes[kernel] = (hashes[kernel] ^ b[i]) * 1099511628211ull;
}

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static int64_t below(int64_t n) { return (int64_t)(next() % (uint64_t)n); }

/* a float in (-1, 1) times 2**s, s uniform in [-e, e]: exact from the integers, so the same on every machine */
static float value(int e) {
    float x = (float)((int64_t)(next() >> 40) - (1 << 23)) / 8388608.0f;
    return ldexpf(x, (int)below(2 * e + 1) - e);
}

/* a case's activations: n rows of k values, of exponents up to e, and where broken one inf or NaN */
typedef struct {
    int64_t n, k, o;
    float *x, *up, *weight, *bias, *residual; /* [n, k], [n, k], [k], [o], [n, o] or NULL */
} case_t;

/* the int8 quantization and product (panels [P, G, 64, 4] of a random int8 weight in [-127, 127]) */
static void check_int8(const case_t *t, int threads) {
    int64_t groups = (t->k + 3) / 4, lda = 4 * groups, panels = (t->o + 63) / 64, starts[2] = {0, t->o};
    uint8_t *codes = malloc(t->n * lda);
    float *scale = malloc(t->n * sizeof(float)), *col = malloc(t->o * sizeof(float));
    float *out = malloc(t->n * t->o * sizeof(float)), *outs[1] = {out};
    int8_t *w = calloc(panels * groups * 256, 1);
    int32_t *comp = calloc(t->o, sizeof(int32_t));
    batchspec_quantize(t->x, t->n, t->k, lda, codes, scale, threads);
    mix(QUANTIZE, codes, t->n * lda);
    mix(QUANTIZE, scale, t->n * sizeof(float));
    for (int64_t o = 0; o < t->o; o++)
        for (int64_t i = 0; i < t->k; i++) {
            int8_t v = (int8_t)(below(255) - 127);
            w[((o / 64 * groups + i / 4) * 64 + o % 64) * 4 + i % 4] = v;
            comp[o] += 128 * v;
        }
    for (int64_t o = 0; o < t->o; o++) col[o] = value(4);
    batchspec_linear(codes, t->n, lda, w, comp, scale, col, t->bias, groups, panels, t->o, outs, starts, 1,
                     t->residual, threads);
    mix(LINEAR, out, t->n * t->o * sizeof(float));
    free(codes), free(scale), free(col), free(out), free(w), free(comp);
}

/* a random int4 weight of `panels` panels laid out as scalar.h describes, with finite float16 scales and zero
 * padding; its bytes a panel */
static uint8_t *int4_weight(int64_t panels, int64_t nsub, int64_t subs, int64_t *bytes) {
    *bytes = 0;
    for (int64_t s0 = 0; s0 < nsub; s0 += subs) {
        int64_t count = nsub - s0 < subs ? nsub - s0 : subs;
        *bytes += 64 + (subs > 1 ? 32 * ((count + 1) / 2 * 2) : 0) + 256 * count;
    }
    uint8_t *w = malloc(panels * *bytes);
    for (int64_t i = 0; i < panels * *bytes; i++) w[i] = (uint8_t)below(256);
    for (uint8_t *b = w; b < w + panels * *bytes;)
        for (int64_t s0 = 0; s0 < nsub; s0 += subs) {
            int64_t count = nsub - s0 < subs ? nsub - s0 : subs, even = (count + 1) / 2 * 2;
            for (int j = 0; j < 32; j++) {
                uint16_t half = (uint16_t)(below(0x7C00) | below(2) << 15); /* d and dmin: finite */
                memcpy(b + 2 * j, &half, sizeof half);
            }
            if (subs > 1 && count < even) {
                memset(b + 64 + 16 * count, 0, 16);                                   /* sc's padding */
                for (int j = 0; j < 16; j++) b[64 + 16 * even + 32 * (even / 2 - 1) + 2 * j + 1] = 0; /* mn's */
            }
            b += 64 + (subs > 1 ? 32 * even : 0) + 256 * count;
        }
    return w;
}

/* the int4 activations' quantization (blocks of 32 or 256) and the int4 product */
static void check_int4(const case_t *t, int64_t subs, int threads) {
    int64_t nsub = (t->k + 31) / 32, blocks = (nsub + subs - 1) / subs, padded = 32 * nsub;
    int64_t counted = nsub + nsub % 2, panels = (t->o + 15) / 16, bytes, starts[2] = {0, t->o};
    int8_t *q = malloc(t->n * padded);
    float *scales = malloc(t->n * blocks * sizeof(float)), *out = malloc(t->n * t->o * sizeof(float));
    float *outs[1] = {out};
    int16_t *sums = malloc(t->n * counted * sizeof(int16_t));
    batchspec_quantize_blocks(t->x, t->n, t->k, 32 * subs, padded, q, scales, blocks, sums, counted, threads);
    mix(QUANTIZE_BLOCKS, q, t->n * padded);
    mix(QUANTIZE_BLOCKS, scales, t->n * blocks * sizeof(float));
    mix(QUANTIZE_BLOCKS, sums, t->n * counted * sizeof(int16_t));
    uint8_t *w = int4_weight(panels, nsub, subs, &bytes);
    batchspec_linear4(q, t->n, padded, scales, blocks, sums, counted, w, bytes, panels, nsub, subs, t->o, t->bias,
                      outs, starts, 1, t->residual, threads);
    mix(LINEAR4, out, t->n * t->o * sizeof(float));
    free(q), free(scales), free(out), free(sums), free(w);
}

/* SiLU, GELU with tanh, RMSNorm, the gated quantization (with each activation) and the KV cache's packing of the
 * case's rows */
static void check_rows(const case_t *t, int threads) {
    int64_t n = t->n, k = t->k, lda = (k + 3) / 4 * 4, width = k > 32 ? k : 32;
    float *y = malloc(n * k * sizeof(float)), *scale = malloc(n * sizeof(float));
    uint8_t *codes = malloc(n * lda);
    int16_t *packed = malloc(n * width * sizeof(int16_t));
    batchspec_activation(t->x, y, n * k, C, 0, threads);
    mix(SILU, y, n * k * sizeof(float));
    batchspec_activation(t->x, y, n * k, C, 1, threads);
    mix(GELU_TANH, y, n * k * sizeof(float));
    batchspec_rms_norm(t->x, n, k, 1e-6f, t->weight, y, threads);
    mix(RMS_NORM, y, n * k * sizeof(float));
    for (int64_t activation = 0; activation < 2; activation++) {
        batchspec_quantize_gated(t->x, t->up, n, k, lda, codes, scale, C, activation, threads);
        mix(QUANTIZE_GATED, codes, n * lda);
        mix(QUANTIZE_GATED, scale, n * sizeof(float));
    }
    batchspec_pack_kv(t->x, n, k, LEVELS, packed, width, threads);
    mix(PACK_KV, packed, n * width * sizeof(int16_t));
    free(y), free(scale), free(codes), free(packed);
}

/* length tokens of `size` random values packed into the KV cache's rows of `width` int16 */
static void random_tokens(int64_t length, int64_t size, int16_t *out, int64_t width) {
    float *x = malloc(length * size * sizeof(float));
    for (int64_t i = 0; i < length * size; i++) x[i] = value(3);
    batchspec_pack_kv(x, length, size, LEVELS, out, width, 1);
    free(x);
}

/* the attention of a random GQA shape over random packed keys and values, causal with random holes, its scores
 * soft-capped or not */
static void check_attention(int threads) {
    int64_t kv_heads = 1 + below(2), heads = kv_heads * (1 + below(3)), queries = 1 + below(20);
    int64_t length = queries + below(90), size = (int64_t[]){8, 32, 64, 100}[below(4)];
    int64_t width = size > 32 ? size : 32, head = length * width, count = heads * queries * size;
    float *query = malloc(count * sizeof(float)), *out = malloc(count * sizeof(float));
    int16_t *keys = malloc(kv_heads * head * sizeof(int16_t)), *values = malloc(kv_heads * head * sizeof(int16_t));
    uint8_t *visible = malloc(queries * length);
    for (int64_t i = 0; i < count; i++) query[i] = value(3);
    for (int64_t h = 0; h < kv_heads; h++) {
        random_tokens(length, size, keys + h * head, width);
        random_tokens(length, size, values + h * head, width);
    }
    for (int64_t q = 0; q < queries; q++)
        for (int64_t j = 0; j < length; j++) visible[q * length + j] = j <= length - queries + q && below(10) > 0;
    float softcap = below(2) ? 0.0f : (float)(3.0 / 0.6931471805599453); /* none, or Gemma 2's cap of 3, in log2 units */
    batchspec_attention(query, keys, 0, head, values, 0, head, width, visible, 0, length, 1, 1, heads, kv_heads,
                        queries, length, size, 0.125 / 0.6931471805599453, softcap, LEVELS, C, out, threads);
    mix(ATTENTION, out, count * sizeof(float));
    free(query), free(out), free(keys), free(values), free(visible);
}

/* case number c: its shapes and values, then every kernel on them */
static void check_case(int c, int threads) {
    case_t t = {1 + below(13), 1 + below(700), 1 + below(200), NULL, NULL, NULL, NULL, NULL};
    int e = (int)below(30);
    t.x = malloc(t.n * t.k * sizeof(float)), t.up = malloc(t.n * t.k * sizeof(float));
    t.weight = malloc(t.k * sizeof(float)), t.bias = malloc(t.o * sizeof(float));
    for (int64_t i = 0; i < t.n * t.k; i++) t.x[i] = value(e), t.up[i] = value(3);
    for (int64_t i = 0; i < t.k; i++) t.weight[i] = 0.5f + (float)below(1 << 20) / 1048576.0f;
    if (c % 7 == 3) t.x[below(t.n * t.k)] = c % 2 ? INFINITY : NAN;
    for (int64_t i = 0; i < t.o; i++) t.bias[i] = value(2);
    if (c % 2) {
        t.residual = malloc(t.n * t.o * sizeof(float));
        for (int64_t i = 0; i < t.n * t.o; i++) t.residual[i] = value(2);
    }
    check_int8(&t, threads);
    check_int4(&t, c % 3 == 0 ? 1 : 8, threads);
    check_rows(&t, threads);
    free(t.x), free(t.up), free(t.weight), free(t.bias), free(t.residual);
    check_attention(threads);
}

int main(int argc, char **argv) {
    int cases = argc > 1 ? atoi(argv[1]) : 1000, threads = argc > 2 ? atoi(argv[2]) : 2;
    uint16_t *halves = malloc(65536 * sizeof(uint16_t));
    float *floats = malloc(65536 * sizeof(float));
    for (int k = 0; k < KERNELS; k++) hashes[k] = 1469598103934665603ull;
    for (int i = 0; i < 65536; i++) halves[i] = (uint16_t)i;
    batchspec_half_to_float(halves, 65536, floats);
    mix(HALF, floats, 65536 * sizeof(float));
    free(halves), free(floats);
    for (int c = 0; c < cases; c++) check_case(c, threads);
    for (int k = 0; k < KERNELS; k++) printf("%-16s %016llx\n", NAMES[k], (unsigned long long)hashes[k]);
    return 0;
}
