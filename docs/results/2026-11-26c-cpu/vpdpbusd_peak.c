/* Issue 35: the int8 product's compute ceiling on this CPU, 12 independent 512-bit vpdpbusd chains a core in
 * registers on 2 threads (each instruction 64 u8 x s8 products summed into 16 int32: 128 operations).
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vnni -fopenmp vpdpbusd_peak.c -o /tmp/vpdpbusd_peak && /tmp/vpdpbusd_peak */
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#define STEP(x) x = _mm512_dpbusd_epi32(x, a, b);
int main() {
    long iters = 100000000;
    for (int rep = 0; rep < 2; rep++) {
    double t0 = omp_get_wtime();
    int sum = 0;
    #pragma omp parallel num_threads(2) reduction(+:sum)
    {
        __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x01010101);
        __m512i c0=_mm512_set1_epi32(0),c1=_mm512_set1_epi32(1),c2=_mm512_set1_epi32(2),c3=_mm512_set1_epi32(3),c4=_mm512_set1_epi32(4),c5=_mm512_set1_epi32(5),c6=_mm512_set1_epi32(6),c7=_mm512_set1_epi32(7),c8=_mm512_set1_epi32(8),c9=_mm512_set1_epi32(9),c10=_mm512_set1_epi32(10),c11=_mm512_set1_epi32(11);
        for (long it = 0; it < iters; it++) {
            STEP(c0) STEP(c1) STEP(c2) STEP(c3) STEP(c4) STEP(c5) STEP(c6) STEP(c7) STEP(c8) STEP(c9) STEP(c10) STEP(c11)
        }
        __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0,c1),_mm512_add_epi32(c2,c3)),_mm512_add_epi32(_mm512_add_epi32(c4,c5),_mm512_add_epi32(c6,c7)));
        s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8,c9),_mm512_add_epi32(c10,c11)));
        sum += _mm512_reduce_add_epi32(s);
    }
    double t = omp_get_wtime() - t0;
    printf("%d: %.3f s, %.2f G vpdpbusd/s per thread, %.3f TOP/s (2 threads)\n", sum & 1, t, iters * 12 / t / 1e9, 2.0 * iters * 12 * 128 / t / 1e12);
    }
}
