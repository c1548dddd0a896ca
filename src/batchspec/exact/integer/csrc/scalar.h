/* The arithmetic every build of batchspec's native kernels shares (avx512.c, avx2.c, portable.c, neon.c): plain C,
 * compiled with -ffp-contract=off and run under one floating-point environment (fp_enter), so every float operation is
 * one correctly rounded IEEE operation and the bits cannot depend on the instruction set, the vector width or the
 * thread that runs a row. Each function below is the C twin of a torch function in arithmetic.py, model.py or
 * attention.py, with the same operations in the same order. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The floating-point environment every exported function computes in, on each thread that runs a part of it: SSE's
 * MXCSR at FP_DEFAULT (round to nearest even, no flush-to-zero, no denormals-are-zero, every exception masked). Each
 * thread keeps its own MXCSR: torch.set_flush_denormal(True) sets FTZ and DAZ on the calling thread only, and OpenMP's
 * workers keep whatever they had, so without this a row's subnormal values would round one way on the caller and
 * another on a worker. fp_enter sets it where the control bits differ and returns the thread's own value, which
 * fp_leave puts back (the exception flags, bits 0-5, are not part of the environment: they change no result). On
 * aarch64 (the neon and portable builds there) FPCR holds the same controls, and FP_CONTROL's bits of it are set to 0:
 * round to nearest, no flush-to-zero (FZ, which torch.set_flush_denormal sets there), no default NaN, IEEE half
 * precision, no traps. Elsewhere both do nothing: the threads keep the C default, round to nearest. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FP_DEFAULT 0x1F80u
#define FP_CONTROL 0xFFC0u /* MXCSR's control bits: rounding, flush-to-zero, denormals-are-zero, exception masks */
static inline unsigned fp_enter(void) {
    unsigned previous = _mm_getcsr();
    if ((previous & FP_CONTROL) != FP_DEFAULT) _mm_setcsr(FP_DEFAULT);
    return previous;
}
static inline void fp_leave(unsigned previous) {
    if ((previous & FP_CONTROL) != FP_DEFAULT) _mm_setcsr(previous);
}
#elif defined(__aarch64__)
#define FP_CONTROL 0x07C89F00u /* FPCR's AHP, DN, FZ, RMode, FZ16 and trap enables */
static inline unsigned fp_enter(void) {
    uint64_t previous;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(previous));
    if (previous & FP_CONTROL) __asm__ __volatile__("msr fpcr, %0" : : "r"(previous & ~(uint64_t)FP_CONTROL));
    return (unsigned)previous;
}
static inline void fp_leave(unsigned previous) {
    if (previous & FP_CONTROL) __asm__ __volatile__("msr fpcr, %0" : : "r"((uint64_t)previous));
}
#else
static inline unsigned fp_enter(void) { return 0; }
static inline void fp_leave(unsigned previous) { (void)previous; }
#endif

#define PANEL 64      /* outputs per panel of the prepacked weight [P, G, 64, 4] */
#define ROW_BLOCK 240 /* rows per pass over the weight: their outputs stay in cache while a panel is reused */
#define SCALE_BITS 32 /* the KV cache's scale bits, one in the parity of each of a token's first 32 integers */
#define LOG2E 1.44269504088896340736f /* log2(e) rounded to float32, as torch rounds arithmetic.py's LOG2E */
/* arithmetic.py's GELU_CUBIC and GELU_SCALE (0.044715 and 2 sqrt(2 / pi)), each already a float32 value there */
#define GELU_CUBIC 0.04471499845385551453f
#define GELU_SCALE 1.59576916694641113281f
/* the MLP's activation (layer_t's `activation`, arithmetic.py's ACTIVATIONS): SiLU or GELU with tanh */
#define ACTIVATION_SILU 0
#define ACTIVATION_GELU_TANH 1

/* the larger of two floats (neither is NaN here); fmaxf is a library call */
static inline float larger(float a, float b) { return a > b ? a : b; }

/* What the product's epilogue applies to columns col .. col + valid - 1 of its rows (see batchspec_linear). */
typedef struct {
    const int32_t *comp;    /* [o] 128 * sum_k w[o][k] */
    const float *row_scale; /* [n] */
    const float *col_scale; /* [o] */
    const float *bias;      /* [o], or NULL */
    const float *residual;  /* added last, laid out as the output (offset to the panel's first column), or NULL */
} epilogue_t;

/* The epilogue of one output of the product (every build's vector epilogue computes it lane by lane):
 * ((float)(acc - comp[o]) * row_scale) * col_scale[o] (+ bias[o]) (+ residual), the int32 difference wrapping, each
 * float operation rounded once, in that order. `dot` is that difference, q . w (the SIMD builds sum the codes q + 128
 * and subtract comp[o]; the portable build sums q . w itself: the same integer); `residual` points at the output's
 * own residual value, or is NULL. */
static inline float epilogue_value(int32_t dot, float row_scale, epilogue_t e, int64_t o, const float *residual) {
    float y = ((float)dot * row_scale) * e.col_scale[o];
    if (e.bias) y = y + e.bias[o];
    return residual ? *residual + y : y;
}

/* 2**t for t <= 0, as arithmetic.py's exp2_nonpositive computes it in float32: t clamped to [-126, 0],
 * n = floor(t), f = t - n, Horner's rule on the ten coefficients c (each product and sum rounded), times 2**n
 * written as exponent bits. A NaN t stays NaN through the clamp and the polynomial (n is then taken as 0, never
 * converted: a NaN's conversion to an integer is undefined in C), so its 2**t is NaN, as in the vector twins. */
static inline float exp2_nonpositive(float t, const float *c) {
    float v = t < -126.0f ? -126.0f : (t > 0.0f ? 0.0f : t);
    float whole = floorf(v), f = v - whole, power = c[9];
    for (int j = 8; j >= 0; j--) {
        power = power * f;
        power = power + c[j];
    }
    int32_t bits = ((isnan(whole) ? 0 : (int32_t)whole) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return power * scale;
}

/* The sigmoid of z as arithmetic.py's _sigmoid computes it: e = 2**(|z| * -log2 e) (exp2_nonpositive), then
 * (z >= 0 ? 1 : e) / (1 + e). */
static inline float sigmoid_value(float z, const float *c) {
    float e = exp2_nonpositive(fabsf(z) * -LOG2E, c);
    return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* SiLU as arithmetic.py's exact_silu computes it: x * sigmoid(x). */
static inline float silu_value(float x, const float *c) { return x * sigmoid_value(x, c); }

/* GELU with tanh as arithmetic.py's exact_gelu_tanh computes it: z = (x + ((x * x) * x) * GELU_CUBIC) * GELU_SCALE,
 * then x * sigmoid(z) (0.5 (1 + tanh(z / 2)) is sigmoid(z)). */
static inline float gelu_tanh_value(float x, const float *c) {
    float z = (x + ((x * x) * x) * GELU_CUBIC) * GELU_SCALE;
    return x * sigmoid_value(z, c);
}

/* Soft-capping as arithmetic.py's exact_softcap computes it: z = x / cap, e = 2**((|z| * 2) * -log2 e), then
 * (1 - e) / (1 + e) given z's sign, times cap (tanh(z) * cap). */
static inline float softcap_value(float x, float cap, const float *c) {
    float z = x / cap;
    float e = exp2_nonpositive((fabsf(z) * 2.0f) * -LOG2E, c);
    return copysignf((1.0f - e) / (e + 1.0f), z) * cap;
}

/* the MLP's activation of x: ACTIVATION_SILU or ACTIVATION_GELU_TANH */
static inline float activation_value(float x, const float *c, int64_t activation) {
    return activation == ACTIVATION_GELU_TANH ? gelu_tanh_value(x, c) : silu_value(x, c);
}

/* RMSNorm's root as model.py's exact_rms_norm computes it in float32: the squares summed by arithmetic.py's
 * row_sum tree (padded with zeros to a power of two w, then s[i] += s[i + w / 2], halving w), t = sum / h + eps,
 * root = sqrt(t) correctly rounded (sqrtf; torch's side takes float64's root and rounds it, the same value). */
static inline float rms_root(const float *x, int64_t h, float eps) {
    int64_t width = 1;
    while (width < h) width *= 2;
    float sums[width];
    for (int64_t i = 0; i < h; i++) sums[i] = x[i] * x[i];
    for (int64_t i = h; i < width; i++) sums[i] = 0.0f;
    for (int64_t half = width / 2; half >= 1; half /= 2)
        for (int64_t i = 0; i < half; i++) sums[i] = sums[i] + sums[i + half];
    return sqrtf(sums[0] / (float)h + eps);
}

/* a * b with x86-64's NaNs on every architecture: a NaN operand's NaN (its payload kept: the same on x86-64 and on
 * aarch64 with FPCR.DN at 0, fp_enter), and for an invalid product (0 * inf) the default NaN of x86-64 (SSE's,
 * 0xFFC00000, the sign bit set) where aarch64's is 0x7FC00000. RMSNorm's output for a row holding an inf is then
 * the same bits on every build (an x86-64 build multiplies as it is). */
#if defined(__x86_64__) || defined(__i386__)
static inline float product_x86_nan(float a, float b) { return a * b; }
#else
static inline float product_x86_nan(float a, float b) {
    const uint32_t default_nan = 0xFFC00000u;
    float p = a * b, nan;
    memcpy(&nan, &default_nan, sizeof nan);
    return isnan(p) && !isnan(a) && !isnan(b) ? nan : p;
}
#endif

/* out = weight * (x * (1 / root)), each product as product_x86_nan */
static inline void rms_apply_row(const float *x, int64_t h, float root, const float *weight, float *out) {
    float inverse = 1.0f / root;
    for (int64_t i = 0; i < h; i++) out[i] = product_x86_nan(weight[i], product_x86_nan(x[i], inverse));
}

/* |x| as its float32 bits (the sign bit cleared). These order as the magnitudes do, and +inf's (NONFINITE) and every
 * NaN's lie above every finite value's, so the largest bits of a row are max |x|'s, or at least NONFINITE where a
 * value is not finite: an integer maximum, which a NaN cannot slip past as it slips past a float comparison. */
#define NONFINITE 0x7F800000u
static inline uint32_t magnitude_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & 0x7FFFFFFFu;
}

/* A token's scale from the bits of top = max |x| (magnitude_bits), as arithmetic.quantize_rows defines it: top /
 * levels, at least FLT_MIN (so 1 / scale is finite and a zero's code is 0, however small the row), and 1 for a row of
 * zeros; NaN for a row holding an inf or a NaN, whose codes are then all 0 (every quantizer below and in the builds
 * writes them so), so that everything computed from the row is NaN: NaN in, NaN out, the same bits on every build. */
static inline float scale_of(uint32_t top, float levels) {
    if (top >= NONFINITE) return NAN;
    float value;
    memcpy(&value, &top, sizeof value);
    return top > 0 ? fmaxf(value / levels, FLT_MIN) : 1.0f;
}

/* Per-token quantization to 15 bits, as attention.py takes it from quantize_rows in float32: top = max |x|,
 * scale = scale_of(top, levels), q = clamp(rint(x * (1 / scale)), -levels, levels) (0 where the scale is NaN:
 * token_code is only called on a finite row). */
static inline float token_scale(const float *x, int64_t k, float levels) {
    uint32_t top = 0;
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits = magnitude_bits(x[i]);
        top = bits > top ? bits : top;
    }
    return scale_of(top, levels);
}

static inline float token_code(float x, float inverse, float levels) {
    float v = rintf(x * inverse);
    return v < -levels ? -levels : (v > levels ? levels : v);
}

/* A row's codes for the int8 product from its scale s = scale_of(max |x|, 127) (each build finds that maximum its own
 * way; it is exact in any order): code = token_code(x, 1 / s, 127) + 128, and 128 in the padding columns k .. ldc;
 * every code 128 (q = 0) where s is NaN. */
static inline void row_codes(const float *x, int64_t k, int64_t ldc, float s, uint8_t *codes, float *scale) {
    *scale = s;
    if (isnan(s)) {
        memset(codes, 128, (size_t)ldc);
        return;
    }
    float inverse = 1.0f / s;
    for (int64_t i = 0; i < k; i++) codes[i] = (uint8_t)((int32_t)token_code(x[i], inverse, 127.0f) + 128);
    for (int64_t i = k; i < ldc; i++) codes[i] = 128;
}

/* the integer next to code whose parity differs, towards t (away from it where t == code), within +-levels */
static inline float other_parity(float code, float t, float levels) {
    float step = t >= code ? 1.0f : -1.0f, moved = code + step;
    return moved > levels || moved < -levels ? code - step : moved;
}

/* a token's keys or values as attention.py's pack stores them in the KV cache: its `width` int16 (k, at least
 * SCALE_BITS) are its q (0 past k), except that q[i], i < SCALE_BITS, whose parity is not bit i of the float32
 * scale moves one step towards x[i] / scale (away where they are equal; back inside +-levels at the edge). A token
 * that is not finite has q = 0 and x / scale taken as 0, so it stores the NaN scale's bits as 1s among zeros. */
static inline void pack_token(const float *x, int64_t k, float levels, int16_t *o, int64_t width) {
    float s = token_scale(x, k, levels), inverse = 1.0f / s;
    int finite = !isnan(s);
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    for (int64_t i = 0; i < width; i++) {
        float t = finite && i < k ? x[i] * inverse : 0.0f;
        float code = finite ? token_code(i < k ? x[i] : 0.0f, inverse, levels) : 0.0f;
        if (i < SCALE_BITS && ((int32_t)code & 1) != (int32_t)((bits >> i) & 1u))
            code = other_parity(code, t, levels);
        o[i] = (int16_t)code;
    }
}

/* a packed token's scale: the parities of its first SCALE_BITS integers, as float32 bits */
static inline float token_scale_bits(const int16_t *token) {
    uint32_t bits = 0;
    for (int i = 0; i < SCALE_BITS; i++) bits |= (uint32_t)(token[i] & 1) << i;
    float s;
    memcpy(&s, &bits, sizeof s);
    return s;
}

/* the rotary embedding as transformers' apply_rotary_pos_emb computes it in float32 (its rotate_half, then two
 * products and a sum, each rounded) on a head's first `rotated` values, the other d - rotated passed through as they
 * are (partial rotary: Phi-4-mini's, GLM-4's): y[i] = x[i] * c[i] + r[i] * s[i] for i < rotated, y[i] = x[i] after.
 * Over halves (pairs 0: Llama's, Phi-3's) c = cos, s = sin and r[i] = -x[i + h] for i < h = rotated / 2, x[i - h]
 * after; over adjacent pairs (pairs 1: GLM-4's, which repeats each of the first h values of cos and sin twice)
 * c[i] = cos[i / 2], s[i] = sin[i / 2] and r[2j] = -x[2j + 1], r[2j + 1] = x[2j]. cos and sin hold `rotated` values. */
static inline void rotate(const float *x, const float *cos, const float *sin, int64_t d, int64_t rotated, int pairs,
                          float *y) {
    int64_t half = rotated / 2;
    for (int64_t i = 0; i < rotated; i++) {
        float r, c, s;
        if (pairs) {
            r = i % 2 ? x[i - 1] : -x[i + 1];
            c = cos[i / 2], s = sin[i / 2];
        } else {
            r = i < half ? -x[i + half] : x[i - half];
            c = cos[i], s = sin[i];
        }
        y[i] = x[i] * c + r * s;
    }
    for (int64_t i = rotated; i < d; i++) y[i] = x[i];
}

/* The int4 product's activations (batchspec_quantize_blocks): a row of k values quantized per block of `block`
 * values (a super-block of the weight, 32 * sub-blocks) as quantize_rows quantizes a token, block by block: top =
 * max |x| over the block, scale = scale_of(top, 127), q = clamp(rint(x * (1 / scale)), -127, 127) as int8 (a
 * block that is not finite: scale NaN, q 0), zeros from k up to `padded` (a multiple of 32); sums[s] = the sum of
 * the 32 codes of sub-block s, for s < `counted` (zero past the codes: the int4 kernels read the sums in pairs). */
static inline void quantize_block_row(const float *x, int64_t k, int64_t block, int64_t padded, int8_t *q,
                                      float *scale, int16_t *sums, int64_t counted) {
    for (int64_t b0 = 0, j = 0; b0 < k; b0 += block, j++) {
        int64_t length = k - b0 < block ? k - b0 : block;
        float s = token_scale(x + b0, length, 127.0f), inverse = 1.0f / s;
        if (isnan(s))
            memset(q + b0, 0, (size_t)length);
        else
            for (int64_t i = 0; i < length; i++) q[b0 + i] = (int8_t)token_code(x[b0 + i], inverse, 127.0f);
        scale[j] = s;
    }
    for (int64_t i = k; i < padded; i++) q[i] = 0;
    for (int64_t s = 0; s < counted; s++) {
        int32_t total = 0;
        for (int64_t i = 32 * s; i < 32 * s + 32 && i < padded; i++) total += q[i];
        sums[s] = (int16_t)total;
    }
}

/* The int4 weight as the kernels read it (int4.py's pack): panels of PANEL4 outputs, each the same number of bytes;
 * a panel holds the weight's super-blocks in order, each of `count` sub-blocks of 32 inputs (`subs`, the last one
 * fewer where the inner size ends):
 *   d[16], dmin[16]                 float16: the super-block's scale and min scale per output;
 *   sc[even][16], mn[even / 2][16][2]  uint8, only where subs > 1: each sub-block's integer scale and min per output
 *                                   (mn interleaved by pairs of sub-blocks; `even`: count rounded up to even, zeros);
 *   nibbles[count][4][16][4]        uint8: for sub-block s, pair of groups g and output j, byte i holds the weight's
 *                                   input 32 s + 8 g + i in its low nibble and input 32 s + 8 g + 4 + i in its high.
 * The weight is w = (d sc) n - (dmin mn) per input (subs == 1: sc = mn = 1), as gguf expands a Q4_K block. A row's
 * output sums the super-blocks in order: y = y + (((float)i1 * d - (float)i2 * dmin) * scale), each operation
 * rounded once, from y = 0, where i1 = sum_s sc[s] (q . n over sub-block s) and i2 = sum_s mn[s] (sum of the codes of
 * sub-block s) are exact in int32 (|i1| <= 8 * 255 * 32 * 127 * 15 < 2**31) and scale is the activations' for the
 * super-block; then + bias, then residual + y, as the int8 product's epilogue. */
#define PANEL4 16

/* A float16's value as float32, exactly, from its bits (the int4 weight's d and dmin; F16C's vcvtph2ps gives the same
 * bits where a build has it): sign, exponent e (5 bits) and mantissa m (10). 0 < e < 31 is 2**(e - 15) (1 + m / 1024),
 * the float32 exponent e + 112 and m its top 10 bits; e = 0 is m 2**-24, zero or a subnormal that is normal in
 * float32 (m shifted up until its leading 1 is the implicit bit, the exponent one lower a shift); e = 31 is an
 * infinity (m = 0) or a NaN, its payload kept and its quiet bit set, as vcvtph2ps and torch's conversion of a
 * float16 tensor set it. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa ? 0x400000u : 0u) | (mantissa << 13);
    } else if (exponent > 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {
        uint32_t e = 113; /* the float32 exponent of 2**-14, a subnormal's scale before its first shift */
        for (; !(mantissa & 0x400u); e--) mantissa <<= 1;
        bits = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* where one panel's outputs go: out (row stride ldo, `valid` columns), plus bias and residual where not NULL */
typedef struct {
    float *out;
    int64_t ldo, valid;
    const float *bias, *residual;
} out4_t;

static inline int64_t super_block_bytes(int64_t count, int64_t subs) {
    return 64 + (subs > 1 ? 32 * ((count + 1) / 2 * 2) : 0) + 256 * count;
}

/* The attention (batchspec_attention) of one KV head of one batch row: its R = G * Q query rows, r = g * Q + i
 * for head hk * G + g and query i (see entry.h for the arithmetic and its bounds). */
#define PASS_ROWS 6      /* query rows per weighted-sum pass; R is padded with zero rows to a multiple of it */
#define PAIR_FLUSH 32    /* key pairs summed in int32 before the sums join the float64 totals */
#define WEIGHT_HALF 1024 /* W = WEIGHT_HALF * Wh + Wl, 0 <= Wl < WEIGHT_HALF */
#define WEIGHT_UNIT 1048576.0f /* 2**20: W[j] = rint(a[j] / max a * 2**20) */

typedef struct {
    int64_t queries, rows, padded, keys, size, lanes, width, visible_stride, visible_row;
    double factor; /* scaling / ln 2 */
    float levels, softcap; /* softcap: the scores' soft-cap in units of log2 (the cap / ln 2), or 0: none */
    const float *c;
} group_t;

/* one thread's scratch: the queries' halves hi, lo [padded, lanes] int16; the weights' halves wh, wl
 * [padded, 2 * pairs] int16 and PASS_ROWS rows of them by pairs, wp [pairs, PASS_ROWS, 2] int32; the values by key
 * pairs vp [pairs, lanes, 2] int16; sum [padded, lanes] doubles; score [padded, L] and the values' scales v_scale
 * [L] floats (lanes: D rounded up to a multiple of 32; pairs: L / 2 rounded up) */
typedef struct {
    int16_t *hi, *lo, *wh, *wl, *vp;
    int32_t *wp;
    double *sum;
    float *score, *v_scale;
} scratch_t;

/* one thread's scratch memory, kept from call to call up to SCRATCH_KEPT bytes (so a decode step's calls do not
 * fault in fresh pages); NULL where it cannot be had */
#define SCRATCH_KEPT ((size_t)1 << 25)
static __thread void *scratch_memory = NULL;
static __thread size_t scratch_size = 0;

static void *scratch(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes <= scratch_size) return scratch_memory;
    free(scratch_memory);
    scratch_memory = aligned_alloc(64, bytes);
    scratch_size = scratch_memory == NULL ? 0 : bytes;
    return scratch_memory;
}

static void scratch_done(void) {
    if (scratch_size <= SCRATCH_KEPT) return;
    free(scratch_memory);
    scratch_memory = NULL;
    scratch_size = 0;
}

/* Whether a row of the attention is NaN (entry.h's batchspec_attention): it sees a key whose score is not finite
 * (`score_broken`, which each build's scores() records as it writes the scores), or, where the group holds a value
 * whose scale is not finite (`values_broken`, any_nonfinite of the scales once per group), it sees such a value. */
static inline int any_nonfinite(const float *x, int64_t n) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = magnitude_bits(x[i]);
        top = bits > top ? bits : top;
    }
    return top >= NONFINITE;
}

static inline int row_broken(group_t g, int score_broken, int values_broken, const uint8_t *seen,
                             const float *v_scale) {
    if (score_broken || !values_broken) return score_broken;
    for (int64_t j = 0; j < g.keys; j++)
        if (seen[j * g.visible_stride] && magnitude_bits(v_scale[j]) >= NONFINITE) return 1;
    return 0;
}

/* Each score a row sees (not -inf) soft-capped (softcap_value, attention.py's _attend), where g.softcap is set:
 * after the scores are written and their rows marked broken, before the softmax. */
static inline void softcap_scores(group_t g, float *score) {
    if (g.softcap == 0.0f) return;
    for (int64_t i = 0; i < g.rows * g.keys; i++)
        if (score[i] != -INFINITY) score[i] = softcap_value(score[i], g.softcap, g.c);
}

/* Query row r's 15-bit integers q split as q = 256 * hi + lo with lo in [0, 255] and hi in [-128, 127], each as
 * int16 zero-padded to `lanes` (D rounded up to 32), with zero rows up to `padded`; factor[r] = its scale *
 * scaling / ln 2. hi . K and lo . K then stay below 2**31 in magnitude (256 * 32767 * D < 2**31 for D <= 256,
 * native.py's MAX_HEAD_SIZE), so int32 sums of their products are exact in any order (they wrap modulo 2**32 without
 * saturating, so they are the sums themselves). A query that is not finite keeps its zeros, and its factor is NaN. */
static void quantize_queries(group_t g, const float *query, int16_t *hi, int16_t *lo, double *factor) {
    for (int64_t i = 0; i < g.padded * g.lanes; i++) hi[i] = lo[i] = 0;
    for (int64_t r = 0; r < g.rows; r++) {
        const float *x = query + r * g.size;
        float s = token_scale(x, g.size, g.levels), inverse = 1.0f / s;
        factor[r] = (double)s * g.factor;
        if (isnan(s)) continue;
        for (int64_t d = 0; d < g.size; d++) {
            int32_t q = (int32_t)token_code(x[d], inverse, g.levels);
            hi[r * g.lanes + d] = (int16_t)(q >> 8);
            lo[r * g.lanes + d] = (int16_t)(q & 0xFF);
        }
    }
}

/* The exact attention of one GQA group in plain C (entry.h states the arithmetic and its bounds): the avx2 and
 * portable builds' attend_group, whose integer loops the compiler vectorizes (vpmaddwd for the dots on x86); avx512.c
 * has its own. The same exact sums and the same float steps as avx512.c's, so the same bits. */
/* score[r][j] = (float)((q[r] . K[j] * factor[r]) * sk[j]), -inf where query r % Q does not see key j; broken[r]:
 * whether row r sees a score that is not finite (an inf or a NaN) */
static inline void plain_scores(group_t g, const int16_t *hi, const int16_t *lo, const double *factor,
                                const int16_t *k, const uint8_t *visible, float *score, uint8_t *broken) {
    for (int64_t r = 0; r < g.rows; r++) broken[r] = 0;
    for (int64_t j = 0; j < g.keys; j++) {
        const int16_t *key = k + j * g.width;
        double key_scale = (double)token_scale_bits(key);
        for (int64_t r = 0; r < g.rows; r++) {
            const int16_t *h = hi + r * g.lanes, *l = lo + r * g.lanes;
            int32_t high = 0, low = 0;
            for (int64_t d = 0; d < g.size; d++) {
                high += (int32_t)h[d] * key[d];
                low += (int32_t)l[d] * key[d];
            }
            double dot = (double)high * 256.0 + (double)low;
            int seen = visible[(r % g.queries) * g.visible_row + j * g.visible_stride] != 0;
            float value = (float)((dot * factor[r]) * key_scale);
            broken[r] |= seen & (magnitude_bits(value) >= NONFINITE);
            score[r * g.keys + j] = seen ? value : -INFINITY;
        }
    }
}

/* One row's scores -> W[j] = rint(a[j] / max a * 2**20) as its halves wh[j] = W[j] / 1024, wl[j] = W[j] % 1024,
 * with e[j] = 2**(score - max) (0 where hidden), a[j] = e[j] * sv[j] (in place in score, 0 where hidden);
 * *scale = max a, *denominator = max(sum_j rint(e[j] * 2**20), 1), a sum of integers below 2**21, exact in any
 * order. A broken row (row_broken) is NaN (entry.h): weights 0, *scale NaN, *denominator 1. */
static inline void plain_softmax_weights(group_t g, float *score, const uint8_t *seen, const float *v_scale,
                                         int broken, int16_t *wh, int16_t *wl, double *scale, double *denominator) {
    if (broken) {
        for (int64_t j = 0; j < g.keys; j++) wh[j] = wl[j] = 0;
        *scale = NAN;
        *denominator = 1.0;
        return;
    }
    float most = -INFINITY, top = 0.0f;
    for (int64_t j = 0; j < g.keys; j++) most = larger(most, score[j]);
    float shift = most == -INFINITY ? 0.0f : most;
    double total = 0.0;
    for (int64_t j = 0; j < g.keys; j++) {
        int visible = seen[j * g.visible_stride] != 0;
        float e = visible ? exp2_nonpositive(score[j] - shift, g.c) : 0.0f;
        total += (double)rintf(e * WEIGHT_UNIT);
        score[j] = visible ? e * v_scale[j] : 0.0f;
        top = larger(top, score[j]);
    }
    float divisor = top > 0.0f ? top : 1.0f;
    for (int64_t j = 0; j < g.keys; j++) {
        int32_t w = (int32_t)rintf((score[j] / divisor) * WEIGHT_UNIT);
        wh[j] = (int16_t)(w >> 10);
        wl[j] = (int16_t)(w & (WEIGHT_HALF - 1));
    }
    *scale = (double)top;
    *denominator = total > 1.0 ? total : 1.0;
}

/* sum[d] = sum_j W[j] V[j][d] for one row, in int32 on W's halves PAIR_FLUSH key pairs at a time, then in float64 */
static inline void plain_weighted_sum(group_t g, const int16_t *wh, const int16_t *wl, const int16_t *v, double *sum) {
    int32_t high[g.size], low[g.size];
    for (int64_t d = 0; d < g.size; d++) sum[d] = 0.0;
    for (int64_t j0 = 0; j0 < g.keys; j0 += 2 * PAIR_FLUSH) {
        int64_t end = g.keys - j0 < 2 * PAIR_FLUSH ? g.keys : j0 + 2 * PAIR_FLUSH;
        for (int64_t d = 0; d < g.size; d++) high[d] = low[d] = 0;
        for (int64_t j = j0; j < end; j++) {
            const int16_t *value = v + j * g.width;
            int32_t h = wh[j], l = wl[j];
            for (int64_t d = 0; d < g.size; d++) {
                high[d] += h * value[d];
                low[d] += l * value[d];
            }
        }
        for (int64_t d = 0; d < g.size; d++) sum[d] = sum[d] + (double)high[d] * (double)WEIGHT_HALF + (double)low[d];
    }
}

/* out: row r at out + (r / Q) * out_head + (r % Q) * out_query */
static inline void plain_attend_group(group_t g, const float *query, const int16_t *k, const int16_t *v,
                                      const uint8_t *visible, scratch_t s, float *out, int64_t out_head,
                                      int64_t out_query) {
    double factor[g.padded];
    uint8_t broken[g.rows];
    for (int64_t j = 0; j < g.keys; j++) s.v_scale[j] = token_scale_bits(v + j * g.width);
    int values_broken = any_nonfinite(s.v_scale, g.keys);
    quantize_queries(g, query, s.hi, s.lo, factor);
    plain_scores(g, s.hi, s.lo, factor, k, visible, s.score, broken);
    softcap_scores(g, s.score);
    for (int64_t r = 0; r < g.rows; r++) {
        double scale, denominator, *sum = s.sum + r * g.lanes;
        const uint8_t *seen = visible + (r % g.queries) * g.visible_row;
        plain_softmax_weights(g, s.score + r * g.keys, seen, s.v_scale,
                              row_broken(g, broken[r], values_broken, seen, s.v_scale), s.wh, s.wl, &scale,
                              &denominator);
        plain_weighted_sum(g, s.wh, s.wl, v, sum);
        float *o = out + (r / g.queries) * out_head + (r % g.queries) * out_query;
        for (int64_t d = 0; d < g.size; d++) o[d] = (float)((sum[d] * scale) / denominator);
    }
}
