/*
 * OLED-MoE CPU SwiGLU expert kernel.
 *
 * Computes, for a batch of (expert, tokens) jobs of one MoE layer,
 *     out[p] = down( silu(gate x_p) * (up x_p) )
 * with each expert's weights in ONE contiguous blob  gate[I,H] | up[I,H] | down[H,I]  (the same blob is copied
 * to the GPU as-is, so we do not repack it). With 1-32 tokens per expert the work is bound by reading the
 * weights from DRAM, so the whole design is about reading every weight byte exactly once per call, on all cores:
 *
 *   phase 0  gather the tokens of every job into a padded bf16 (or fp32) scratch, row p = x[token_idx[p]]
 *   phase 1  all jobs' gate/up rows are cut into equal-cost chunks over the threads; each thread streams its
 *            gate and up rows once, dotting every row with all of the job's tokens (vdpbf16ps, fp32 accumulate),
 *            and writes act[p, i] = silu(g) * u
 *   phase 2  the same for the down rows: out[p, h] = down[h, :] . act[p, :]
 * Equal-cost chunks that cross expert boundaries keep every core busy even when one expert has 32 tokens and the
 * others 1 (a per-expert split would leave cores idle).
 *
 * Threads: a persistent pool (created once, pinned to distinct physical cores chosen by the Python side); a call
 * wakes the workers through a futex word after they have spun briefly, and the caller sleeps until the last worker
 * is done. Only the calling thread's GIL matters to Python, and ctypes releases it around the call.
 *
 * Two code paths: "avx512_bf16" (bf16 weights, AVX-512 BF16 dot products, compiled with target attributes so the
 * rest of the file stays baseline x86-64) and "portable" (plain C, fp32 accumulate, bf16 or fp32 weights).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if defined(__x86_64__) && !defined(OLED_NO_AVX512BF16)
#define OLED_FAST 1
#include <cpuid.h>
#include <immintrin.h>
#define FAST __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define FAST_INLINE FAST __attribute__((always_inline)) static inline
#else
#define OLED_FAST 0
#endif

#define CACHE_LINE 64

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------------------------- */
/* bf16 helpers (portable)                                                                                        */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, keep NaN a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------------------------------------------------- */
/* CPU feature checks (the Python side also reads /proc/cpuinfo; both must agree before the fast path is used)     */

int oled_has_avx512bf16(void) {
#if OLED_FAST
    unsigned a, b, c, d;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
        return 0;
    /* CPUID.(EAX=7,ECX=1):EAX bit 5 = AVX512_BF16; checked directly because older compilers' cpu_supports lacks it */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    if (!((a >> 5) & 1)) return 0;
    /* the OS must save the zmm/opmask state (XCR0 bits 1,2,5,6,7) */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xe6u) == 0xe6u;
#else
    return 0;
#endif
}

int oled_compiled_fast(void) { return OLED_FAST; }

/* ------------------------------------------------------------------------------------------------------------- */
/* task description and thread pool                                                                               */

enum { MODE_PORTABLE = 0, MODE_AVX512BF16 = 1 };

typedef struct {
    int mode;
    int x_bf16, w_bf16;
    const void *x;
    int64_t T, H, I, P, J;
    const int64_t *tok, *off, *blobs;
    float *out;
    void *xs;           /* gathered tokens [P, xs_stride], bf16 (fast) or fp32 (portable) */
    int64_t xs_stride;
    void *act;          /* activations [P, act_stride], bf16 (fast) or fp32 (portable) */
    int64_t act_stride;
    int64_t tokw;       /* cost of one token per weight element, in 1/64 of the cost of reading that element */
} task_t;

typedef struct {
    _Alignas(CACHE_LINE) _Atomic uint32_t gen;   /* futex: bumped by the caller for every task */
    _Alignas(CACHE_LINE) _Atomic uint32_t done;  /* futex: set to gen by the last worker */
    _Alignas(CACHE_LINE) _Atomic int remaining;
    _Alignas(CACHE_LINE) _Atomic int sleepers;   /* workers inside futex_wait(gen) */
    _Alignas(CACHE_LINE) _Atomic int bar_cnt;
    _Alignas(CACHE_LINE) _Atomic uint32_t bar_gen;
    _Alignas(CACHE_LINE) int n;
    int stop;
    int64_t spin_ns;
    pthread_t *th;
    int *cpus;
    _Atomic int pinned;                          /* how many workers were pinned successfully */
    task_t task;
    void *xs, *act;
    size_t xs_cap, act_cap;
} pool_t;

typedef struct {
    pool_t *p;
    int tid;
} worker_arg_t;

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)addr; (void)val;
    sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *addr) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* Spin until *addr != val; spin for spin_ns first (a call that follows soon finds the threads awake), then sleep. */
static uint32_t wait_change(_Atomic uint32_t *addr, uint32_t val, int64_t spin_ns, _Atomic int *sleepers) {
    uint32_t v;
    int64_t t0 = 0;
    for (unsigned i = 0;; i++) {
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != val) return v;
        if ((i & 63) == 63) {
            int64_t t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > spin_ns) break;
        }
        cpu_relax();
    }
    for (;;) {
        if (sleepers) atomic_fetch_add(sleepers, 1);
        futex_wait(addr, val);
        if (sleepers) atomic_fetch_sub(sleepers, 1);
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != val) return v;
    }
}

/* Barrier among the pool's workers. They are pinned to distinct cores and all busy on the same task, so spinning
 * is right; yield after a while in case the pool was made larger than the cores it runs on. */
static void barrier(pool_t *p) {
    uint32_t g = atomic_load(&p->bar_gen);
    if (atomic_fetch_add(&p->bar_cnt, 1) == p->n - 1) {
        atomic_store(&p->bar_cnt, 0);
        atomic_fetch_add(&p->bar_gen, 1);
        return;
    }
    for (unsigned i = 0; atomic_load_explicit(&p->bar_gen, memory_order_acquire) == g; i++) {
        if (i > 20000) sched_yield();
        else cpu_relax();
    }
}

/* ------------------------------------------------------------------------------------------------------------- */
/* work partitioning: rows of all jobs, cut into nth chunks of equal cost                                         */

typedef void (*seg_fn)(const task_t *t, int64_t job, int64_t r0, int64_t r1);

/* Each of the `rows` rows (of length K) of a job with n tokens costs K * (64 + tokw * n): reading the weights
 * dominates, the per-token dot products add a little. Row r of job j belongs to the thread whose cost interval
 * contains the row's start, so the chunks are disjoint and cover every row exactly once. */
static void for_my_rows(const task_t *t, int tid, int nth, int64_t rows, int64_t K, seg_fn f) {
    int64_t total = 0;
    for (int64_t j = 0; j < t->J; j++) {
        int64_t n = t->off[j + 1] - t->off[j];
        if (n > 0) total += rows * K * (64 + t->tokw * n);
    }
    if (total == 0) return;
    int64_t lo = (int64_t)((__int128)total * tid / nth), hi = (int64_t)((__int128)total * (tid + 1) / nth);
    int64_t base = 0;
    for (int64_t j = 0; j < t->J && base < hi; j++) {
        int64_t n = t->off[j + 1] - t->off[j];
        if (n <= 0) continue;
        int64_t rc = K * (64 + t->tokw * n), jc = rows * rc;
        if (base + jc > lo) {
            int64_t r0 = lo > base ? ceil_div(lo - base, rc) : 0;
            int64_t r1 = min64(rows, ceil_div(hi - base, rc));
            if (r1 > r0) f(t, j, r0, r1);
        }
        base += jc;
    }
}

/* ------------------------------------------------------------------------------------------------------------- */
/* portable path: plain C, fp32 accumulation; the compiler vectorises the dot products (-fopenmp-simd)            */

static float dot_f32(const float *w, const float *x, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += w[k] * x[k];
    return s;
}

static float dot_bf16(const uint16_t *w, const float *x, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += bf16_to_f32(w[k]) * x[k];
    return s;
}

static inline float wdot(const task_t *t, const void *w, int64_t row, int64_t K, const float *x) {
    return t->w_bf16 ? dot_bf16((const uint16_t *)w + row * K, x, K) : dot_f32((const float *)w + row * K, x, K);
}

static void gather_portable(const task_t *t, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
        float *dst = (float *)t->xs + p * t->xs_stride;
        int64_t r = t->tok[p];
        if (t->x_bf16) {
            const uint16_t *src = (const uint16_t *)t->x + r * t->H;
            for (int64_t k = 0; k < t->H; k++) dst[k] = bf16_to_f32(src[k]);
        } else {
            memcpy(dst, (const float *)t->x + r * t->H, (size_t)t->H * 4);
        }
    }
}

static void gu_seg_portable(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    size_t es = t->w_bf16 ? 2 : 4;
    const char *g = (const char *)(intptr_t)t->blobs[j], *u = g + (size_t)I * H * es;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < n; i++) {
            const float *x = (const float *)t->xs + (p0 + i) * t->xs_stride;
            float sg = wdot(t, g, r, H, x), su = wdot(t, u, r, H, x);
            ((float *)t->act)[(p0 + i) * t->act_stride + r] = sg / (1.f + expf(-sg)) * su;
        }
}

static void down_seg_portable(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    size_t es = t->w_bf16 ? 2 : 4;
    const char *d = (const char *)(intptr_t)t->blobs[j] + 2 * (size_t)I * H * es;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < n; i++)
            t->out[(p0 + i) * H + r] = wdot(t, d, r, I, (const float *)t->act + (p0 + i) * t->act_stride);
}

/* ------------------------------------------------------------------------------------------------------------- */
/* AVX-512 BF16 path                                                                                              */
#if OLED_FAST

/* 16 horizontal sums at once: lane i of the result = sum of the 16 lanes of v[i]. A shuffle tree does this in
 * ~45 instructions instead of 16 separate reductions (~130); it matters for the down rows, whose K=I is short. */
FAST_INLINE __m512 reduce16(const __m512 v[16]) {
    __m512 w[8], y[4], z[2];
    for (int m = 0; m < 8; m++) /* blocks: [a0+a2, a1+a3, b0+b2, b1+b3] */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int q = 0; q < 4; q++) /* block k of y[q] holds row 4q+k */
        y[q] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * q], w[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * q], w[2 * q + 1], 0xDD));
    for (int s = 0; s < 2; s++) /* block k: lanes 0,2 row 8s+k, lanes 1,3 row 8s+4+k */
        z[s] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * s], y[2 * s + 1]), _mm512_unpackhi_ps(y[2 * s], y[2 * s + 1]));
    __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
    /* lane 4k+j now holds row 4j+k */
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(perm, r);
}

/* exp for the SiLU: Cody-Waite range reduction, degree-6 polynomial, scalef for 2^n (saturates cleanly) */
FAST_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.f)), _mm512_set1_ps(-100.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

FAST_INLINE __mmask32 tail_mask(int64_t rem) { return rem >= 32 ? 0xffffffffu : (__mmask32)((1u << rem) - 1u); }

FAST_INLINE __m512bh ld_bf16(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
FAST_INLINE __m512bh ld_bf16_tail(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* Software prefetch of the next row tile (into L2): each 4 KiB row is its own page for H=2048, and the hardware
 * streamers restart at every page, so asking early keeps more DRAM requests in flight per core. */
#define PF_L2(ptr) _mm_prefetch((const char *)(ptr), _MM_HINT_T1)

/* Phase-1 tile: R consecutive gate rows and the same R up rows, times N tokens (2*R*N <= 16 accumulators).
 * Weights stream from DRAM once; the tokens stay in L1/L2. Writes act[t][r] = silu(g) * u in bf16. */
FAST_INLINE void gu_tile(const int R, const int N, const uint16_t *g, const uint16_t *u, int64_t K,
                         const uint16_t *x, int64_t xs, uint16_t *act, int64_t as, int pf) {
    __m512 ag[8][8], au[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) ag[r][i] = au[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[8];
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) xv[i] = ld_bf16(x + i * xs + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512bh wg = ld_bf16(g + r * K + k), wu = ld_bf16(u + r * K + k);
            if (pf) { PF_L2(g + (r + R) * K + k); PF_L2(u + (r + R) * K + k); }
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) {
                ag[r][i] = _mm512_dpbf16_ps(ag[r][i], wg, xv[i]);
                au[r][i] = _mm512_dpbf16_ps(au[r][i], wu, xv[i]);
            }
        }
    }
    if (k < K) { /* K not a multiple of 32: masked loads, the masked-off lanes are zero in both operands */
        __mmask32 m = tail_mask(K - k);
        __m512bh xv[8];
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) xv[i] = ld_bf16_tail(x + i * xs + k, m);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512bh wg = ld_bf16_tail(g + r * K + k, m), wu = ld_bf16_tail(u + r * K + k, m);
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) {
                ag[r][i] = _mm512_dpbf16_ps(ag[r][i], wg, xv[i]);
                au[r][i] = _mm512_dpbf16_ps(au[r][i], wu, xv[i]);
            }
        }
    }
    /* lanes 0..7: gate sums, lanes 8..15: up sums, index r*N+i */
    __m512 v[16];
#pragma GCC unroll 16
    for (int a = 0; a < 16; a++) v[a] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) { v[r * N + i] = ag[r][i]; v[8 + r * N + i] = au[r][i]; }
    __m512 s = reduce16(v);
    __m512 up = _mm512_shuffle_f32x4(s, s, 0xEE); /* up sums to lanes 0..7 */
    __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), s))));
    __m512 h = _mm512_mul_ps(_mm512_mul_ps(s, sig), up);
    uint16_t hb[16];
    _mm256_storeu_si256((__m256i *)hb, (__m256i)_mm512_cvtneps_pbh(h));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) act[i * as + r] = hb[r * N + i];
}

/* Phase-2 tile: R consecutive down rows times N tokens (R*N <= 16); writes out[t][r] (fp32). */
FAST_INLINE void down_tile(const int R, const int N, const uint16_t *d, int64_t K, const uint16_t *x, int64_t xs,
                           float *out, int64_t os, int pf) {
    __m512 acc[16][8];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) acc[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[8];
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) xv[i] = ld_bf16(x + i * xs + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            __m512bh w = ld_bf16(d + r * K + k);
            if (pf) PF_L2(d + (r + R) * K + k);
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w, xv[i]);
        }
    }
    if (k < K) {
        __mmask32 m = tail_mask(K - k);
        __m512bh xv[8];
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) xv[i] = ld_bf16_tail(x + i * xs + k, m);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            __m512bh w = ld_bf16_tail(d + r * K + k, m);
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w, xv[i]);
        }
    }
    __m512 v[16];
#pragma GCC unroll 16
    for (int a = 0; a < 16; a++) v[a] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) v[r * N + i] = acc[r][i];
    float s[16];
    _mm512_storeu_ps(s, reduce16(v));
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) out[i * os + r] = s[r * N + i];
}

/* Instantiate the tiles with compile-time R, N so the accumulators live in registers. */
#define GU_CASE(R, N) \
    case (R) * 16 + (N): gu_tile(R, N, g, u, K, x, xs, act, as, pf); return;
FAST static void gu_tile_dispatch(int R, int N, const uint16_t *g, const uint16_t *u, int64_t K, const uint16_t *x,
                                  int64_t xs, uint16_t *act, int64_t as, int pf) {
    switch (R * 16 + N) {
        GU_CASE(1, 1) GU_CASE(1, 2) GU_CASE(1, 3) GU_CASE(1, 4) GU_CASE(1, 5) GU_CASE(1, 6) GU_CASE(1, 7)
        GU_CASE(1, 8) GU_CASE(2, 1) GU_CASE(2, 2) GU_CASE(2, 3) GU_CASE(2, 4) GU_CASE(4, 1) GU_CASE(4, 2)
        GU_CASE(8, 1)
    }
}
#define DOWN_CASE(R, N) \
    case (R) * 16 + (N): down_tile(R, N, d, K, x, xs, out, os, pf); return;
FAST static void down_tile_dispatch(int R, int N, const uint16_t *d, int64_t K, const uint16_t *x, int64_t xs,
                                    float *out, int64_t os, int pf) {
    switch (R * 16 + N) {
        DOWN_CASE(1, 1) DOWN_CASE(1, 2) DOWN_CASE(1, 3) DOWN_CASE(1, 4) DOWN_CASE(1, 5) DOWN_CASE(1, 6)
        DOWN_CASE(1, 7) DOWN_CASE(1, 8) DOWN_CASE(2, 1) DOWN_CASE(2, 2) DOWN_CASE(2, 3) DOWN_CASE(2, 4)
        DOWN_CASE(2, 5) DOWN_CASE(2, 6) DOWN_CASE(2, 7) DOWN_CASE(2, 8) DOWN_CASE(4, 1) DOWN_CASE(4, 2)
        DOWN_CASE(4, 3) DOWN_CASE(4, 4) DOWN_CASE(8, 1) DOWN_CASE(8, 2) DOWN_CASE(16, 1)
    }
}

static int g_prefetch = 1;

static inline int pow2_ceil(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }

/* Walk rows [r0, r1) of one matrix in tiles of R rows; tokens go in balanced tiles of at most 8 (so 9 tokens are
 * 5+4, not 8+1). The weight rows of a tile are read from DRAM by the first token tile and from L1 by the others. */
typedef struct {
    int ntile, tsz; /* number of token tiles, size of the largest */
} ttiles_t;

static inline ttiles_t token_tiles(int64_t n) {
    ttiles_t tt;
    tt.ntile = (int)ceil_div(n, 8);
    tt.tsz = (int)ceil_div(n, tt.ntile);
    return tt;
}

FAST static void gu_seg_fast(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    const uint16_t *g = (const uint16_t *)(intptr_t)t->blobs[j], *u = g + I * H;
    const uint16_t *x = (const uint16_t *)t->xs + p0 * t->xs_stride;
    uint16_t *act = (uint16_t *)t->act + p0 * t->act_stride;
    ttiles_t tt = token_tiles(n);
    int R = 8 / pow2_ceil(tt.tsz);
    for (int64_t r = r0; r < r1;) {
        int rr = r + R <= r1 ? R : 1;
        int pf = g_prefetch && r + 2 * rr <= r1;
        for (int ti = 0, i0 = 0; ti < tt.ntile; ti++) {
            int nb = (int)(n / tt.ntile) + (ti < n % tt.ntile); /* balanced tiles */
            gu_tile_dispatch(rr, nb, g + r * H, u + r * H, H, x + i0 * t->xs_stride, t->xs_stride,
                             act + i0 * t->act_stride + r, t->act_stride, pf && i0 == 0);
            i0 += nb;
        }
        r += rr;
    }
}

FAST static void down_seg_fast(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    const uint16_t *d = (const uint16_t *)(intptr_t)t->blobs[j] + 2 * I * H;
    const uint16_t *x = (const uint16_t *)t->act + p0 * t->act_stride;
    float *out = t->out + p0 * H;
    ttiles_t tt = token_tiles(n);
    int R = 16 / pow2_ceil(tt.tsz);
    for (int64_t r = r0; r < r1;) {
        int rr = r + R <= r1 ? R : 1;
        int pf = g_prefetch && r + 2 * rr <= r1;
        for (int ti = 0, i0 = 0; ti < tt.ntile; ti++) {
            int nb = (int)(n / tt.ntile) + (ti < n % tt.ntile);
            down_tile_dispatch(rr, nb, d + r * I, I, x + i0 * t->act_stride, t->act_stride, out + i0 * H + r, H,
                               pf && i0 == 0);
            i0 += nb;
        }
        r += rr;
    }
}

FAST static void gather_fast(const task_t *t, int64_t p0, int64_t p1) {
    int64_t H = t->H;
    for (int64_t p = p0; p < p1; p++) {
        uint16_t *dst = (uint16_t *)t->xs + p * t->xs_stride;
        int64_t r = t->tok[p];
        if (t->x_bf16) {
            memcpy(dst, (const uint16_t *)t->x + r * H, (size_t)H * 2);
        } else { /* fp32 input: round to bf16 (nearest even) once here, not in the inner loops */
            const float *src = (const float *)t->x + r * H;
            int64_t k = 0;
            for (; k + 16 <= H; k += 16)
                _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
            for (; k < H; k++) dst[k] = f32_to_bf16(src[k]);
        }
    }
}
#endif /* OLED_FAST */

/* ------------------------------------------------------------------------------------------------------------- */
/* worker                                                                                                         */

static void run_task(pool_t *p, int tid) {
    const task_t *t = &p->task;
    int nth = p->n;
    int64_t g0 = t->P * tid / nth, g1 = t->P * (tid + 1) / nth;
#if OLED_FAST
    if (t->mode == MODE_AVX512BF16) {
        gather_fast(t, g0, g1);
        barrier(p);
        for_my_rows(t, tid, nth, t->I, 2 * t->H, gu_seg_fast);
        barrier(p);
        for_my_rows(t, tid, nth, t->H, t->I, down_seg_fast);
        return;
    }
#endif
    gather_portable(t, g0, g1);
    barrier(p);
    for_my_rows(t, tid, nth, t->I, 2 * t->H, gu_seg_portable);
    barrier(p);
    for_my_rows(t, tid, nth, t->H, t->I, down_seg_portable);
}

static void *worker_main(void *arg) {
    worker_arg_t *wa = (worker_arg_t *)arg;
    pool_t *p = wa->p;
    int tid = wa->tid;
    free(wa);
#ifdef __linux__
    if (p->cpus && p->cpus[tid] >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(p->cpus[tid], &set);
        if (sched_setaffinity(0, sizeof(set), &set) == 0) atomic_fetch_add(&p->pinned, 1);
    }
    char name[16];
    snprintf(name, sizeof name, "oled-cpu-%d", tid);
    pthread_setname_np(pthread_self(), name);
#endif
    uint32_t seen = 0;
    for (;;) {
        seen = wait_change(&p->gen, seen, p->spin_ns, &p->sleepers);
        if (p->stop) break;
        run_task(p, tid);
        if (atomic_fetch_sub(&p->remaining, 1) == 1) {
            atomic_store(&p->done, seen);
            futex_wake_all(&p->done);
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------------- */
/* public API (ctypes)                                                                                            */

void oled_pool_destroy(void *handle);

/* cpus: n entries, the core each worker pins itself to (-1: not pinned), or NULL. */
void *oled_pool_create(int n, const int *cpus, int64_t spin_ns) {
    if (n < 1) n = 1;
    pool_t *p = (pool_t *)aligned_alloc(CACHE_LINE, round_up(sizeof(pool_t), CACHE_LINE));
    if (!p) return NULL;
    memset(p, 0, sizeof *p);
    p->n = n;
    p->spin_ns = spin_ns;
    p->th = (pthread_t *)calloc((size_t)n, sizeof(pthread_t));
    p->cpus = (int *)malloc((size_t)n * sizeof(int));
    if (!p->th || !p->cpus) { free(p->th); free(p->cpus); free(p); return NULL; }
    for (int i = 0; i < n; i++) p->cpus[i] = cpus ? cpus[i] : -1;
    for (int i = 0; i < n; i++) {
        worker_arg_t *wa = (worker_arg_t *)malloc(sizeof *wa);
        if (!wa) { p->n = i; oled_pool_destroy(p); return NULL; }
        wa->p = p;
        wa->tid = i;
        if (pthread_create(&p->th[i], NULL, worker_main, wa) != 0) {
            free(wa);
            p->n = i;
            oled_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

void oled_pool_destroy(void *handle) {
    pool_t *p = (pool_t *)handle;
    if (!p) return;
    p->stop = 1;
    atomic_fetch_add(&p->gen, 1);
    futex_wake_all(&p->gen);
    for (int i = 0; i < p->n; i++) pthread_join(p->th[i], NULL);
    free(p->th);
    free(p->cpus);
    free(p->xs);
    free(p->act);
    free(p);
}

/* Number of workers that pinned themselves (valid once they have run a task). */
int oled_pool_pinned(void *handle) { return atomic_load(&((pool_t *)handle)->pinned); }

void oled_set_prefetch(int on) {
#if OLED_FAST
    g_prefetch = on;
#else
    (void)on;
#endif
}

static int ensure(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    need = (size_t)round_up((int64_t)(need + need / 4), 4096); /* grow with slack: shapes vary call to call */
    void *nb = aligned_alloc(4096, need);
    if (!nb) return -1;
    free(*buf);
    *buf = nb;
    *cap = need;
    return 0;
}

/* Returns 0 on success, <0 on bad arguments (-1), token index out of range (-2), allocation failure (-3),
 * unsupported mode (-4). Must not be called concurrently on one pool. */
int oled_run(void *handle, int mode, const void *x, int x_bf16, int64_t T, int64_t H, int64_t I, const int64_t *tok,
             int64_t P, const int64_t *off, int64_t J, const int64_t *blobs, int w_bf16, float *out, int64_t tokw) {
    pool_t *p = (pool_t *)handle;
    if (!p || H <= 0 || I <= 0 || P < 0 || J < 0 || T < 0) return -1;
    if (J == 0 || P == 0) return (J == 0 && P != 0) ? -1 : 0;
    if (off[0] != 0 || off[J] != P) return -1;
    for (int64_t j = 0; j < J; j++) {
        if (off[j + 1] < off[j]) return -1;
        if (off[j + 1] > off[j] && !blobs[j]) return -1;
    }
    for (int64_t i = 0; i < P; i++)
        if (tok[i] < 0 || tok[i] >= T) return -2;
    if (mode == MODE_AVX512BF16 && (!OLED_FAST || !w_bf16)) return -4;

    task_t *t = &p->task;
    t->mode = mode;
    t->x = x;
    t->x_bf16 = x_bf16;
    t->w_bf16 = w_bf16;
    t->T = T; t->H = H; t->I = I; t->P = P; t->J = J;
    t->tok = tok; t->off = off; t->blobs = blobs; t->out = out;
    t->tokw = tokw < 0 ? 0 : tokw;
    size_t es = mode == MODE_AVX512BF16 ? 2 : 4;
    t->xs_stride = round_up(H, 32); /* 64-byte aligned rows */
    t->act_stride = round_up(I, 32);
    if (ensure(&p->xs, &p->xs_cap, (size_t)P * t->xs_stride * es) ||
        ensure(&p->act, &p->act_cap, (size_t)P * t->act_stride * es))
        return -3;
    t->xs = p->xs;
    t->act = p->act;

    atomic_store(&p->remaining, p->n);
    uint32_t g = atomic_fetch_add(&p->gen, 1) + 1;
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
    /* the caller sleeps on its own futex after a short spin: it is a Python thread, not one of the pinned cores */
    for (uint32_t d; (d = atomic_load_explicit(&p->done, memory_order_acquire)) != g;)
        wait_change(&p->done, d, 20000, NULL);
    return 0;
}
