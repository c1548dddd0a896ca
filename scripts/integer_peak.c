/* The integer products' inner instruction streams, in registers (scripts/integer_peak.py builds and runs this; its
 * docstring says what is counted and why).
 *
 * Each stream is the arithmetic of one product kernel's loop in src/batchspec/exact/integer/csrc/, written as inline
 * assembly so that the compiler can neither fold, hoist nor spill it: the same instructions on the same register
 * widths, with the kernel's accumulators as independent chains (its rows' named variables, each chained as the
 * kernel chains it), and every memory operand of the kernel (the weight's loads, the codes' broadcasts, the int4
 * weight's scales, mins, d and dmin) replaced by a register that already holds a value: nothing touches memory. The
 * values do not matter to the timing (integer instructions take the same time on any data); the float inputs are
 * kept finite and normal.
 *
 * Built with the package build's compiler and flags (native.py's _build_plan) plus one of -DPEAK_AMX (avx512.c with
 * its int8 product on AMX tiles), -DPEAK_AVX512 (avx512.c),
 * -DPEAK_AVXVNNI (avx2.c with VNNI) or -DPEAK_AVX2 (avx2.c without). Every stream runs on `threads` OpenMP threads (the
 * libgomp the products run on, one parallel region as each product call is), each thread `iters` iterations;
 * peak_run returns the region's wall seconds. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define S(x) #x
/* AT&T order: sources first, destination last; op(a, b, d) is Intel's op d, b, a */
#define OP3(op, a, b, d) op " %" S(a) ", %" S(b) ", %" S(d) "\n\t"

typedef void (*body_t)(int64_t iters, int32_t *sink);

typedef struct {
    const char *name;
    double ops; /* counted operations an iteration and thread: 2 per multiply-add of a code by a weight */
    body_t body;
} stream_t;

#if defined(PEAK_AMX) /* the amx build: avx512.c's streams, its int8 product's on tiles */
#define PEAK_AVX512 1
#include <string.h>
#endif

#if defined(PEAK_AVX512)
#define DP(a, b, d) OP3("vpdpbusd", a, b, d)

/* the ceiling docs/integer.md measured: twelve independent 512-bit vpdpbusd chains and nothing else (64 u8 x s8
 * products each: 128 operations) */
static void vpdpbusd_zmm(int64_t iters, int32_t *sink) {
    __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x01010101);
    __m512i c0 = a, c1 = a, c2 = a, c3 = a, c4 = a, c5 = a, c6 = a, c7 = a, c8 = a, c9 = a, c10 = a, c11 = a;
    for (int64_t it = 0; it < iters; it++)
        __asm__ volatile(DP(13, 12, 0) DP(13, 12, 1) DP(13, 12, 2) DP(13, 12, 3) DP(13, 12, 4) DP(13, 12, 5)
                         DP(13, 12, 6) DP(13, 12, 7) DP(13, 12, 8) DP(13, 12, 9) DP(13, 12, 10) DP(13, 12, 11)
                         : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7),
                           "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11)
                         : "v"(a), "v"(b));
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
    *sink = _mm512_reduce_add_epi32(s);
}

/* avx512.c's panel_rows, one step of its loop (a group of four inputs of 64 outputs): four weight vectors, six rows'
 * broadcast codes, 24 vpdpbusd into 24 independent accumulators; an asm statement a row (its accumulators operands
 * 0-3; weights 4-7, codes 8) */
#define ROW8(r)                                                                   \
    __asm__ volatile(DP(4, 8, 0) DP(5, 8, 1) DP(6, 8, 2) DP(7, 8, 3)             \
                     : "+v"(a##r##_0), "+v"(a##r##_1), "+v"(a##r##_2), "+v"(a##r##_3) \
                     : "v"(w0), "v"(w1), "v"(w2), "v"(w3), "v"(x));
#define R6(M) M(0) M(1) M(2) M(3) M(4) M(5)
/* the accumulators are named variables, not an array, so that the compiler keeps them in registers */
#define A_INIT(r) __m512i a##r##_0 = _mm512_setzero_si512(), a##r##_1 = a##r##_0, a##r##_2 = a##r##_0, a##r##_3 = a##r##_0;
#define A_SUM(r) s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a##r##_0, a##r##_1), \
                                                           _mm512_add_epi32(a##r##_2, a##r##_3)));
static void avx512_int8(int64_t iters, int32_t *sink) {
    __m512i w0 = _mm512_set1_epi32(0x01020304), w1 = _mm512_set1_epi32(0x05060708);
    __m512i w2 = _mm512_set1_epi32(0x090A0B0C), w3 = _mm512_set1_epi32(0x0D0E0F10), x = _mm512_set1_epi32(0x01010101);
    R6(A_INIT)
    for (int64_t it = 0; it < iters; it++) {
        R6(ROW8)
    }
    __m512i s = _mm512_setzero_si512();
    R6(A_SUM)
    *sink = _mm512_reduce_add_epi32(s);
}

/* avx512.c's panel4_rows over one super-block of 8 sub-blocks (Q4_K's and from_float's), six rows, 16 outputs.
 * A step (8 inputs): the nibbles unpacked (vpandd, vpsrlw, vpandd) and each row's two chained vpdpbusd (s0-s5:
 * operands 0-5; lo 6, hi 7; nibbles 8, mask 9, codes 10). */
#define NIBBLES(raw, mask, lo, hi) \
    "vpandd %" S(mask) ", %" S(raw) ", %" S(lo) "\n\t" "vpsrlw $4, %" S(raw) ", %" S(hi) "\n\t" \
    "vpandd %" S(mask) ", %" S(hi) ", %" S(hi) "\n\t"
#define DOT4(r) DP(10, 6, r) DP(10, 7, r)
/* a sub-block's end: the sc bytes widened (vpmovzxbd), each row's one += s * sc (vpmulld, vpaddd), s zeroed (one0-5:
 * operands 0-5, s0-5 6-11, scale 12, sc bytes 13) */
#define SCALE4(r, q) OP3("vpmulld", 12, q, q) OP3("vpaddd", q, r, r) OP3("vpxord", q, q, q)
/* a super-block's end for one row (avx512.c's super_block_end): i2 from the mins (four vpmovzxbw, vpmaddwd, vpaddd),
 * d and dmin (vcvtph2ps), ((float)i1 d - (float)i2 dmin) x added to y, i1 zeroed for the next (y 0, i2 1, t 2, d 3,
 * u 4, one 5; mins/sums/halves 6, x 7) */
#define MINS512 "vpmovzxbw %t6, %4\n\t" OP3("vpmaddwd", 6, 4, 4) OP3("vpaddd", 4, 1, 1)
#define END512                                                                                          \
    OP3("vpxord", 1, 1, 1) MINS512 MINS512 MINS512 MINS512                                              \
    "vcvtph2ps %t6, %3\n\t" "vcvtdq2ps %5, %2\n\t" OP3("vmulps", 3, 2, 2)                               \
    "vcvtph2ps %t6, %3\n\t" "vcvtdq2ps %1, %4\n\t" OP3("vmulps", 3, 4, 4) OP3("vsubps", 4, 2, 2)        \
    OP3("vmulps", 7, 2, 2) OP3("vaddps", 2, 0, 0) OP3("vpxord", 5, 5, 5)
#define S4_INIT(r) __m512i s##r = _mm512_setzero_si512(), one##r = s##r; __m512 y##r = _mm512_setzero_ps();
#define END4(r) \
    __asm__ volatile(END512 : "+v"(y##r), "=&v"(i2), "=&v"(t), "=&v"(d), "=&v"(u), "+v"(one##r) : "v"(v), "v"(x));
#define Y_SUM(r) total = _mm512_add_ps(total, y##r);
static void avx512_int4(int64_t iters, int32_t *sink) {
    const __m512i mask = _mm512_set1_epi8(0x0F), v = _mm512_set1_epi32(0x3C013C01); /* every integer input */
    const __m512 x = _mm512_set1_ps(0.5f);
    __m512i lo, hi, scale, i2, d, u;
    __m512 t;
    R6(S4_INIT)
    for (int64_t it = 0; it < iters; it++) {
        for (int sub = 0; sub < 8; sub++) {
            for (int g = 0; g < 4; g++)
                __asm__ volatile(NIBBLES(8, 9, 6, 7) DOT4(0) DOT4(1) DOT4(2) DOT4(3) DOT4(4) DOT4(5)
                                 : "+v"(s0), "+v"(s1), "+v"(s2), "+v"(s3), "+v"(s4), "+v"(s5),
                                   "=&v"(lo), "=&v"(hi)
                                 : "v"(v), "v"(mask), "v"(v));
            __asm__ volatile("vpmovzxbd %x13, %12\n\t" SCALE4(0, 6) SCALE4(1, 7) SCALE4(2, 8) SCALE4(3, 9)
                             SCALE4(4, 10) SCALE4(5, 11)
                             : "+v"(one0), "+v"(one1), "+v"(one2), "+v"(one3), "+v"(one4), "+v"(one5),
                               "+v"(s0), "+v"(s1), "+v"(s2), "+v"(s3), "+v"(s4), "+v"(s5), "=&v"(scale)
                             : "v"(v));
        }
        R6(END4)
    }
    __m512 total = _mm512_setzero_ps();
    R6(Y_SUM)
    *sink = _mm512_reduce_add_epi32(_mm512_cvttps_epi32(total));
}

#if defined(PEAK_AMX)
/* avx512.c's tile_sums_pair, one step of its loop (16 groups of four inputs, 32 rows by 32 outputs): four tdpbusd
 * into the four tiles of sums, tiles 4 and 5 holding the codes, 6 and 7 the weight already (a tdpbusd on full tiles:
 * 16 x 16 x 64 u8 x s8 products) */
static void amx_int8(int64_t iters, int32_t *sink) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.bytes[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t it = 0; it < iters; it++) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    int32_t sums[16 * 16];
    _tile_stored(0, sums, 64);
    _tile_release();
    *sink = sums[0];
}
#endif

static const stream_t STREAMS[] = {
    {"vpdpbusd_zmm_12", 12 * 64 * 2, vpdpbusd_zmm},
#if defined(PEAK_AMX)
    {"int8", 4 * 16 * 16 * 64 * 2, amx_int8},
#else
    {"int8", 24 * 64 * 2, avx512_int8},
#endif
    {"int4", 8 * 4 * 6 * 2 * 64 * 2, avx512_int4},
};

#elif defined(PEAK_AVXVNNI) || defined(PEAK_AVX2)
#if defined(__AVX512VL__) /* registers 16-31 may be allocated: the logical operations' EVEX forms */
#define VPAND "vpandd"
#define VPXOR "vpxord"
#define VPOR "vpord"
#else
#define VPAND "vpand"
#define VPXOR "vpxor"
#define VPOR "vpor"
#endif
#if defined(PEAK_AVXVNNI)
#if defined(__AVXVNNI__)
#define DP(a, b, d) OP3("%{vex%} vpdpbusd", a, b, d) /* AVX-VNNI */
#else
#define DP(a, b, d) OP3("%{evex%} vpdpbusd", a, b, d) /* AVX-512 VNNI on 256 bits */
#endif
#define ROWS 6
#define ROWS4 4
#else
#define ROWS 4
#define ROWS4 3
#endif

#if defined(PEAK_AVXVNNI)
/* avx2.c's chunk_sums with VNNI, one step (a group of four inputs of 16 outputs): two weight vectors, six rows'
 * broadcast codes, 12 vpdpbusd into 12 accumulators (operands 0-11; weights 12-13, codes 14) */
#define ROW8(a, b) DP(12, 14, a) DP(13, 14, b)
static void avx2_int8(int64_t iters, int32_t *sink) {
    __m256i w0 = _mm256_set1_epi32(0x01020304), w1 = _mm256_set1_epi32(0x05060708), x = _mm256_set1_epi32(0x01010101);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
    for (int64_t it = 0; it < iters; it++)
        __asm__ volatile(ROW8(0, 1) ROW8(2, 3) ROW8(4, 5) ROW8(6, 7) ROW8(8, 9) ROW8(10, 11)
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                           "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11)
                         : "v"(w0), "v"(w1), "v"(x));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                 _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(a8, a9), _mm256_add_epi32(a10, a11)));
    *sink = _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#else
/* avx2.c's chunk_sums without VNNI, one step: two weight vectors, four rows' two broadcasts (|q|, q); for each row and
 * weight vector vpsignb, vpmaddubsw, vpmaddwd by ones and vpaddd into 8 accumulators (operands 0-7; product 8;
 * weights 9-10, |q| 11, q 12, ones 13) */
#define PRODUCT(w, acc) \
    OP3("vpsignb", 12, w, 8) OP3("vpmaddubsw", 8, 11, 8) OP3("vpmaddwd", 13, 8, 8) OP3("vpaddd", 8, acc, acc)
#define ROW8(a, b) PRODUCT(9, a) PRODUCT(10, b)
static void avx2_int8(int64_t iters, int32_t *sink) {
    __m256i w0 = _mm256_set1_epi32(0x01020304), w1 = _mm256_set1_epi32(0x05060708);
    __m256i size = _mm256_set1_epi32(0x01010101), sign = _mm256_set1_epi32(0x01FF01FF), ones = _mm256_set1_epi16(1);
    __m256i p, a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t it = 0; it < iters; it++)
        __asm__ volatile(ROW8(0, 1) ROW8(2, 3) ROW8(4, 5) ROW8(6, 7)
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                           "+v"(a7), "=&v"(p)
                         : "v"(w0), "v"(w1), "v"(size), "v"(sign), "v"(ones));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                 _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
    *sink = _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#endif

/* avx2.c's half_panel4_rows over one super-block of 8 sub-blocks, 8 outputs (half a panel; the kernel runs two such
 * passes a panel). A step: the nibbles unpacked (vpand, vpsrlw, vpand) and each row's nibble_dots (VNNI: two chained
 * vpdpbusd; without: vpmaddubsw and vpaddw twice). Operands: s 0-3, lo 4, hi 5, product 6; nibbles/codes 7, mask 8. */
#define NIBBLES(raw, mask, lo, hi) \
    OP3(VPAND, mask, raw, lo) "vpsrlw $4, %" S(raw) ", %" S(hi) "\n\t" OP3(VPAND, mask, hi, hi)
#if defined(PEAK_AVXVNNI)
#define DOT4(r) DP(7, 4, r) DP(7, 5, r)
/* a sub-block's end (scaled_sums): sc widened (vpmovzxbd), each row's one += s * sc (vpmulld, vpaddd), s zeroed.
 * Operands: one 0-3, s 4-7, scale 8, tmp 9, sc 10 */
#define SCALE_OF "vpmovzxbd %x10, %8\n\t"
#define SCALE4(r, q) OP3("vpmulld", 8, q, q) OP3("vpaddd", q, r, r) OP3(VPXOR, q, q, q)
#else
#define DOT4(r) OP3("vpmaddubsw", 7, 4, 6) OP3("vpaddw", 6, r, r) OP3("vpmaddubsw", 7, 5, 6) OP3("vpaddw", 6, r, r)
/* scaled_sums without VNNI: sc widened and doubled into both int16 halves (vpmovzxbd, vpslld, vpor), each row's
 * one += vpmaddwd(s, sc), s zeroed */
#define SCALE_OF "vpmovzxbd %x10, %8\n\t" "vpslld $16, %8, %9\n\t" OP3(VPOR, 9, 8, 8)
#define SCALE4(r, q) OP3("vpmaddwd", 8, q, q) OP3("vpaddd", q, r, r) OP3(VPXOR, q, q, q)
#endif
/* a super-block's end for one row (super_step), d and dmin converted once per super-block as avx2.c does: i2 from
 * the mins (four vpmovzxbw, vpmaddwd, vpaddd), ((float)i1 d - (float)i2 dmin) x added to y, i1 zeroed. Operands: y 0,
 * i2 1, t 2, u 3, one 4; mins/sums 5, d 6, dmin 7, x 8 */
#define MINS256 "vpmovzxbw %x5, %3\n\t" OP3("vpmaddwd", 5, 3, 3) OP3("vpaddd", 3, 1, 1)
#define END256                                                                                                   \
    OP3(VPXOR, 1, 1, 1) MINS256 MINS256 MINS256 MINS256 "vcvtdq2ps %4, %2\n\t" OP3("vmulps", 6, 2, 2)         \
    "vcvtdq2ps %1, %3\n\t" OP3("vmulps", 7, 3, 3) OP3("vsubps", 3, 2, 2) OP3("vmulps", 8, 2, 2)                   \
    OP3("vaddps", 2, 0, 0) OP3(VPXOR, 4, 4, 4)
#if ROWS4 == 4
#define RR4(M) M(0) M(1) M(2) M(3)
#define DOTS4 DOT4(0) DOT4(1) DOT4(2) DOT4(3)
#define SCALES4 SCALE4(0, 4) SCALE4(1, 5) SCALE4(2, 6) SCALE4(3, 7)
#define S_OUT "+v"(s0), "+v"(s1), "+v"(s2), "+v"(s3)
#define ONE_OUT "+v"(one0), "+v"(one1), "+v"(one2), "+v"(one3)
#define UNUSED
#else /* three rows: operands 3 and 7 are the second list's placeholders, never named in the assembly */
#define RR4(M) M(0) M(1) M(2)
#define DOTS4 DOT4(0) DOT4(1) DOT4(2)
#define SCALES4 SCALE4(0, 4) SCALE4(1, 5) SCALE4(2, 6)
#define S_OUT "+v"(s0), "+v"(s1), "+v"(s2), "=v"(unused)
#define ONE_OUT "+v"(one0), "+v"(one1), "+v"(one2), "=v"(unused)
#define UNUSED __m256i unused;
#endif
#define S4H_INIT(r) __m256i s##r = _mm256_setzero_si256(), one##r = s##r; __m256 y##r = _mm256_setzero_ps();
#define END4H(r) \
    __asm__ volatile(END256 : "+v"(y##r), "=&v"(i2), "=&v"(t), "=&v"(u), "+v"(one##r) : "v"(v), "v"(dd), "v"(dm), "v"(x));
#define Y4_SUM(r) total = _mm256_add_ps(total, y##r);
static void avx2_int4(int64_t iters, int32_t *sink) {
    const __m256i mask = _mm256_set1_epi8(0x0F), v = _mm256_set1_epi32(0x3C013C01); /* every integer input */
    const __m256 x = _mm256_set1_ps(0.5f);
    __m256i lo, hi, p, scale, tmp, i2, dd, dm;
    UNUSED
    __m256 t, u;
    RR4(S4H_INIT)
    for (int64_t it = 0; it < iters; it++) {
        for (int sub = 0; sub < 8; sub++) {
            for (int g = 0; g < 4; g++)
                __asm__ volatile(NIBBLES(7, 8, 4, 5) DOTS4 : S_OUT, "=&v"(lo), "=&v"(hi), "=&v"(p) : "v"(v), "v"(mask));
            __asm__ volatile(SCALE_OF SCALES4 : ONE_OUT, S_OUT, "=&v"(scale), "=&v"(tmp) : "v"(v));
        }
        __asm__ volatile("vcvtph2ps %x2, %0\n\t" "vcvtph2ps %x2, %1\n\t" : "=&v"(dd), "=&v"(dm) : "v"(v));
        RR4(END4H)
    }
    __m256 total = _mm256_setzero_ps();
    RR4(Y4_SUM)
    __m256i c = _mm256_cvttps_epi32(total);
    *sink = _mm256_extract_epi32(c, 0) + _mm256_extract_epi32(c, 7);
}

/* ops an iteration: a 256-bit instruction's 32 u8 x s8 products, 2 operations each */
static const stream_t STREAMS[] = {
    {"int8", ROWS * 2 * 32 * 2, avx2_int8},
    {"int4", 8 * 4 * ROWS4 * 2 * 32 * 2, avx2_int4},
};
#else
#error "build with -DPEAK_AVX512, -DPEAK_AVXVNNI or -DPEAK_AVX2"
#endif

int peak_count(void) { return (int)(sizeof STREAMS / sizeof STREAMS[0]); }
const char *peak_name(int i) { return STREAMS[i].name; }
double peak_ops(int i) { return STREAMS[i].ops; }

/* seconds for `threads` threads to run stream i's `iters` iterations each (one OpenMP parallel region) */
double peak_run(int i, int64_t iters, int threads) {
    static int32_t sinks[64 * 16];
    double started = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    STREAMS[i].body(iters, &sinks[16 * (omp_get_thread_num() % 64)]);
    return omp_get_wtime() - started;
}
