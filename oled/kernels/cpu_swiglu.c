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
 *            (and, for AMX jobs, pack them into VNNI tiles)
 *   phase 1  all jobs' gate/up rows are cut into equal-cost chunks that the threads claim one by one; a chunk
 *            streams its gate and up rows once, dotting every row with all of the job's tokens (fp32 accumulate),
 *            and writes act[p, i] = silu(g) * u (bf16)
 *   phase 2  the same for the down rows: out[p, h] = down[h, :] . act[p, :]
 * Chunks cross expert boundaries, so every core stays busy even when one expert has 32 tokens and the others 1.
 *
 * Threads: a persistent pool (created once, pinned to distinct physical cores chosen by the Python side); a call
 * wakes the workers through a futex word after they have spun briefly, and the caller sleeps until the last worker
 * is done. ctypes releases the calling thread's GIL around the call.
 *
 * Code paths: "avx512_bf16" (vdpbf16ps with the tokens as the second operand), "amx" (the same plus AMX tiles for
 * jobs with many tokens, where AVX-512 becomes compute-bound), both compiled with target attributes so the rest of
 * the file stays baseline x86-64; and "portable" (plain C, fp32 accumulate, bf16, fp32 or FP8 weights).
 *
 * FP8 blobs (oled/fp8.py): gate | up | down in e4m3 bytes, then one fp32 scale per output row (gate's I, up's I,
 * down's H). A row's dot product sums the e4m3 values (exact in fp32) times the tokens, and its sum is multiplied by
 * the row's scale: a power of two, so the result is the bits of the same sum over the dequantised weights. The
 * avx512_bf16 path widens the e4m3 bytes to bf16 in registers (exact) and runs its bf16 tiles: the bits of that path
 * over the weights dequantised to bf16; the AMX path takes no FP8 (its jobs run on the avx512_bf16 tiles).
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

/* AMX (Sapphire Rapids and later): tile dot products take the compute out of the way at 8-32+ tokens. The
 * weights stay in the standard layout (they are the A operand, 16 rows x 32 k straight from the blob); only the
 * tokens and activations, which are tiny, are packed into the VNNI layout the B operand needs. */
#if OLED_FAST && !defined(OLED_NO_AMX)
#define OLED_AMX 1
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")))
#else
#define OLED_AMX 0
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

/* e4m3 (float8_e4m3fn: bias 7, no infinities, 0x7f/0xff NaN) -> fp32, through a table built once at load */
static float fp8_table[256];

static float e4m3_to_f32(uint8_t v) {
    int e = (v >> 3) & 0xf, m = v & 7;
    float f = (e == 0xf && m == 7) ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return (v & 0x80) ? -f : f;
}

__attribute__((constructor)) static void fp8_table_init(void) {
    for (int v = 0; v < 256; v++) fp8_table[v] = e4m3_to_f32((uint8_t)v);
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
int oled_compiled_amx(void) { return OLED_AMX; }

/* AMX needs the CPU (AMX-TILE, AMX-BF16), the OS enabling the tile state in XCR0, and (Linux >= 5.16) permission
 * for this process to use it. Returns 1 when all three hold; asking for the permission is idempotent. */
int oled_has_amx(void) {
#if OLED_AMX && defined(__linux__)
    unsigned a, b, c, d;
    if (!oled_has_avx512bf16()) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    unsigned lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG, XTILEDATA */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------------------------- */
/* task description and thread pool                                                                               */

enum { MODE_PORTABLE = 0, MODE_AVX512BF16 = 1, MODE_AMX = 2 };
enum { W_F32 = 0, W_BF16 = 1, W_FP8 = 2 };   /* a blob's weights */

typedef struct {
    int mode;
    int x_bf16, w_fmt; /* w_fmt: W_F32, W_BF16 or W_FP8 */
    const void *x;
    int64_t T, H, I, P, J;
    const int64_t *tok, *off, *blobs;
    float *out;
    void *xs;           /* gathered tokens [P, xs_stride], bf16 (fast) or fp32 (portable) */
    int64_t xs_stride;
    void *act;          /* activations [P, act_stride], bf16 (fast) or fp32 (portable) */
    int64_t act_stride;
    int64_t tokw;       /* cost of one token per weight element, in 1/256 of the cost of reading that element */
    /* AMX jobs (those with >= amx_min tokens): job j owns token groups gbase[j] .. gbase[j+1]-1 of 16 tokens */
    const int64_t *gbase;
    int64_t NG;
    uint16_t *xp;       /* packed tokens: group G, k-block kb -> 16x32 bf16 VNNI tile at (G*H/32 + kb)*512 */
    uint16_t *ap;       /* packed activations, same layout over I */
    int nchunks;        /* phases 1 and 2 are cut into this many equal-cost chunks, claimed dynamically */
} task_t;

typedef struct {
    _Alignas(CACHE_LINE) _Atomic uint32_t gen;   /* futex: bumped by the caller for every task */
    _Alignas(CACHE_LINE) _Atomic uint32_t done;  /* futex: set to gen by the last worker */
    _Alignas(CACHE_LINE) _Atomic int remaining;
    _Alignas(CACHE_LINE) _Atomic int sleepers;   /* workers inside futex_wait(gen) */
    _Alignas(CACHE_LINE) int64_t last_ns;        /* duration of the last task, inside the library */
    _Alignas(CACHE_LINE) int64_t start_ns;       /* when the task in flight was submitted */
    _Atomic int64_t done_ns;                     /* when its last worker finished */
    uint32_t inflight_gen;                       /* gen of the task submitted and not yet waited for */
    int inflight;                                /* a task was submitted and not yet waited for */
    _Alignas(CACHE_LINE) _Atomic int64_t hold_until; /* now_ns() until which idle workers poll instead of sleeping */
    _Alignas(CACHE_LINE) _Atomic int bar_cnt;
    _Alignas(CACHE_LINE) _Atomic uint32_t bar_gen;
    _Alignas(CACHE_LINE) _Atomic int next1;      /* next chunk of phase 1 */
    _Alignas(CACHE_LINE) _Atomic int next2;      /* next chunk of phase 2 */
    _Alignas(CACHE_LINE) int n;
    int stop;
    int64_t spin_ns;
    pthread_t *th;
    int *cpus;
    _Atomic int pinned;                          /* how many workers were pinned successfully */
    task_t task;
    void *xs, *act, *xp, *ap, *gb;
    size_t xs_cap, act_cap, xp_cap, ap_cap, gb_cap;
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

/* Wait until *addr != val: poll for spin_ns first (a call that follows soon finds the threads awake), and at least
 * until *hold_until, then sleep. The polling yields the core every few checks, so a thread that shares it (the Python
 * caller, the GPU-launching main thread, a CUDA driver thread) is not starved by a spinner; sched_yield returns at
 * once on an idle core. A sleeper woken without a change (oled_pool_hold) polls again. */
static uint32_t wait_change(_Atomic uint32_t *addr, uint32_t val, int64_t spin_ns, _Atomic int *sleepers,
                            _Atomic int64_t *hold_until) {
    uint32_t v;
    for (;;) {
        int64_t t0 = now_ns();
        for (unsigned i = 1;; i++) {
            v = atomic_load_explicit(addr, memory_order_acquire);
            if (v != val) return v;
            if ((i & 15) == 0) {
                int64_t now = now_ns();
                if (now - t0 > spin_ns && !(hold_until && now < atomic_load_explicit(hold_until, memory_order_relaxed)))
                    break;
                sched_yield();
            } else {
                cpu_relax();
            }
        }
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

static inline int is_amx_job(const task_t *t, int64_t j) { return t->gbase && t->gbase[j + 1] > t->gbase[j]; }

/* Each row (length K) of a job with n tokens costs K * (256 + w * n): reading the weights dominates, the per-token
 * dot products add a little (w = tokw on AVX-512, an eighth of it on AMX). AMX jobs are cut in blocks of 16 rows.
 * The total is cut into nchunks equal-cost chunks that the workers claim from an atomic counter: a worker that
 * the OS preempts (the GPU-launching thread or the CUDA driver wants a core) then delays only its current chunk.
 * A unit of rows belongs to the chunk whose cost interval contains the unit's start, so the chunks are disjoint
 * and cover every row exactly once; a chunk may span several experts, so skewed token counts balance out. */
static void phase_rows(const task_t *t, _Atomic int *next, int64_t rows, int64_t K, seg_fn f) {
    int64_t total = 0;
    for (int64_t j = 0; j < t->J; j++) {
        int64_t n = t->off[j + 1] - t->off[j];
        if (n > 0) total += rows * K * (256 + (is_amx_job(t, j) ? t->tokw / 8 : t->tokw) * n);
    }
    if (total == 0) return;
    for (int c; (c = atomic_fetch_add_explicit(next, 1, memory_order_relaxed)) < t->nchunks;) {
        int64_t lo = (int64_t)((__int128)total * c / t->nchunks);
        int64_t hi = (int64_t)((__int128)total * (c + 1) / t->nchunks);
        int64_t base = 0;
        for (int64_t j = 0; j < t->J && base < hi; j++) {
            int64_t n = t->off[j + 1] - t->off[j];
            if (n <= 0) continue;
            int amx = is_amx_job(t, j);
            int64_t gran = amx ? 16 : 1, units = rows / gran;
            int64_t uc = gran * K * (256 + (amx ? t->tokw / 8 : t->tokw) * n), jc = units * uc;
            if (base + jc > lo) {
                int64_t u0 = lo > base ? ceil_div(lo - base, uc) : 0;
                int64_t u1 = min64(units, ceil_div(hi - base, uc));
                if (u1 > u0) f(t, j, u0 * gran, u1 * gran);
            }
            base += jc;
        }
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
    return t->w_fmt == W_BF16 ? dot_bf16((const uint16_t *)w + row * K, x, K) : dot_f32((const float *)w + row * K, x, K);
}

/* An FP8 row's e4m3 values as fp32 (unscaled), once for all the job's tokens: its dot products are then dot_f32's,
 * the same sums in the same order as over the dequantised fp32 weights, scaled after. */
static void fp8_row(const uint8_t *w, int64_t row, int64_t K, float *dst) {
    const uint8_t *src = w + row * K;
    for (int64_t k = 0; k < K; k++) dst[k] = fp8_table[src[k]];
}

static inline size_t weight_size(int w_fmt) { return w_fmt == W_FP8 ? 1 : w_fmt == W_BF16 ? 2 : 4; }

/* an FP8 blob's scales: gate's I, up's I, down's H, after the three matrices */
static inline const float *blob_scales(const task_t *t, const char *blob) {
    return (const float *)(blob + 3 * (size_t)t->I * t->H);
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
    size_t es = weight_size(t->w_fmt);
    const char *g = (const char *)(intptr_t)t->blobs[j], *u = g + (size_t)I * H * es;
    const float *sc = blob_scales(t, g); /* FP8 only */
    int fp8 = t->w_fmt == W_FP8;
    float grow[fp8 ? H : 1], urow[fp8 ? H : 1];
    for (int64_t r = r0; r < r1; r++) {
        if (fp8) {
            fp8_row((const uint8_t *)g, r, H, grow);
            fp8_row((const uint8_t *)u, r, H, urow);
        }
        for (int64_t i = 0; i < n; i++) {
            const float *x = (const float *)t->xs + (p0 + i) * t->xs_stride;
            float sg = fp8 ? dot_f32(grow, x, H) * sc[r] : wdot(t, g, r, H, x);
            float su = fp8 ? dot_f32(urow, x, H) * sc[I + r] : wdot(t, u, r, H, x);
            ((float *)t->act)[(p0 + i) * t->act_stride + r] = sg / (1.f + expf(-sg)) * su;
        }
    }
}

static void down_seg_portable(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    size_t es = weight_size(t->w_fmt);
    const char *blob = (const char *)(intptr_t)t->blobs[j], *d = blob + 2 * (size_t)I * H * es;
    const float *sc = blob_scales(t, blob) + 2 * I; /* FP8 only */
    int fp8 = t->w_fmt == W_FP8;
    float drow[fp8 ? I : 1];
    for (int64_t r = r0; r < r1; r++) {
        if (fp8) fp8_row((const uint8_t *)d, r, I, drow);
        for (int64_t i = 0; i < n; i++) {
            const float *a = (const float *)t->act + (p0 + i) * t->act_stride;
            t->out[(p0 + i) * H + r] = fp8 ? dot_f32(drow, a, I) * sc[r] : wdot(t, d, r, I, a);
        }
    }
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

/* 32 e4m3 bytes -> 32 bf16, exactly: a normal (exponent e > 0) is sign | (e + 120) << 7 | mantissa << 4, a
 * subnormal (e = 0) mantissa * 2^-9 from a table of eight, 0x7f / 0xff (NaN) a quiet NaN. */
static const uint16_t fp8_subnormal_bf16[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
FAST_INLINE __m512bh fp8_to_bf16(__m256i bytes) {
    __m512i v = _mm512_cvtepu8_epi16(bytes);
    __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7f));
    __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512((const void *)fp8_subnormal_bf16));
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
    return (__m512bh)_mm512_or_si512(r, sign);
}

/* Weights of a tile: bf16, or e4m3 bytes widened to bf16 (FP8: a compile-time constant of the instantiation). */
FAST_INLINE const char *w_at(const int FP8, const void *w, int64_t i) { return (const char *)w + i * (FP8 ? 1 : 2); }
FAST_INLINE __m512bh ld_w(const int FP8, const void *w, int64_t i) {
    return FP8 ? fp8_to_bf16(_mm256_loadu_si256((const __m256i *)w_at(1, w, i))) : ld_bf16((const uint16_t *)w + i);
}
FAST_INLINE __m512bh ld_w_tail(const int FP8, const void *w, int64_t i, __mmask32 m) {
    return FP8 ? fp8_to_bf16(_mm256_maskz_loadu_epi8(m, w_at(1, w, i))) : ld_bf16_tail((const uint16_t *)w + i, m);
}

/* Software prefetch of the next row tile (into L2): each 4 KiB row is its own page for H=2048, and the hardware
 * streamers restart at every page, so asking early keeps more DRAM requests in flight per core. */
#define PF_L2(ptr) _mm_prefetch((const char *)(ptr), _MM_HINT_T1)

/* Phase-1 tile: R consecutive gate rows and the same R up rows, times N tokens (2*R*N <= 16 accumulators).
 * Weights stream from DRAM once; the tokens stay in L1/L2. Writes act[t][r] = silu(g) * u in bf16. FP8: the
 * weights are e4m3 bytes and each row's sums are multiplied by its scale (gs, us: the tile's rows' scales). */
FAST_INLINE void gu_tile(const int R, const int N, const int FP8, const void *g, const void *u, int64_t K,
                         const uint16_t *x, int64_t xs, uint16_t *act, int64_t as, int pf, const float *gs,
                         const float *us) {
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
            __m512bh wg = ld_w(FP8, g, r * K + k), wu = ld_w(FP8, u, r * K + k);
            if (pf) { PF_L2(w_at(FP8, g, (r + R) * K + k)); PF_L2(w_at(FP8, u, (r + R) * K + k)); }
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
            __m512bh wg = ld_w_tail(FP8, g, r * K + k, m), wu = ld_w_tail(FP8, u, r * K + k, m);
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
    if (FP8) {
        float sc[16];
#pragma GCC unroll 16
        for (int a = 0; a < 16; a++) sc[a] = 1.f;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) { sc[r * N + i] = gs[r]; sc[8 + r * N + i] = us[r]; }
        s = _mm512_mul_ps(s, _mm512_loadu_ps(sc));
    }
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

/* Phase-2 tile: R consecutive down rows times N tokens (R*N <= 16); writes out[t][r] (fp32). FP8: e4m3 rows,
 * their sums times their scales (ds). */
FAST_INLINE void down_tile(const int R, const int N, const int FP8, const void *d, int64_t K, const uint16_t *x,
                           int64_t xs, float *out, int64_t os, int pf, const float *ds) {
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
            __m512bh w = ld_w(FP8, d, r * K + k);
            if (pf) PF_L2(w_at(FP8, d, (r + R) * K + k));
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
            __m512bh w = ld_w_tail(FP8, d, r * K + k, m);
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
        for (int i = 0; i < N; i++) out[i * os + r] = FP8 ? s[r * N + i] * ds[r] : s[r * N + i];
}

/* Instantiate the tiles with compile-time R, N so the accumulators live in registers. */
#define GU_CASE(R, N) \
    case (R) * 16 + (N): \
        if (fp8) gu_tile(R, N, 1, g, u, K, x, xs, act, as, pf, gs, us); \
        else gu_tile(R, N, 0, g, u, K, x, xs, act, as, pf, gs, us); \
        return;
FAST static void gu_tile_dispatch(int R, int N, int fp8, const void *g, const void *u, int64_t K, const uint16_t *x,
                                  int64_t xs, uint16_t *act, int64_t as, int pf, const float *gs, const float *us) {
    switch (R * 16 + N) {
        GU_CASE(1, 1) GU_CASE(1, 2) GU_CASE(1, 3) GU_CASE(1, 4) GU_CASE(1, 5) GU_CASE(1, 6) GU_CASE(1, 7)
        GU_CASE(1, 8) GU_CASE(2, 1) GU_CASE(2, 2) GU_CASE(2, 3) GU_CASE(2, 4) GU_CASE(4, 1) GU_CASE(4, 2)
        GU_CASE(8, 1)
    }
}
#define DOWN_CASE(R, N) \
    case (R) * 16 + (N): \
        if (fp8) down_tile(R, N, 1, d, K, x, xs, out, os, pf, ds); \
        else down_tile(R, N, 0, d, K, x, xs, out, os, pf, ds); \
        return;
FAST static void down_tile_dispatch(int R, int N, int fp8, const void *d, int64_t K, const uint16_t *x, int64_t xs,
                                    float *out, int64_t os, int pf, const float *ds) {
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
    const int fp8 = t->w_fmt == W_FP8;
    const int64_t es = (int64_t)weight_size(t->w_fmt);
    const char *g = (const char *)(intptr_t)t->blobs[j], *u = g + I * H * es;
    const float *sc = fp8 ? blob_scales(t, g) : NULL; /* gate's I, then up's I */
    const uint16_t *x = (const uint16_t *)t->xs + p0 * t->xs_stride;
    uint16_t *act = (uint16_t *)t->act + p0 * t->act_stride;
    ttiles_t tt = token_tiles(n);
    int R = 8 / pow2_ceil(tt.tsz);
    for (int64_t r = r0; r < r1;) {
        int rr = r + R <= r1 ? R : 1;
        int pf = g_prefetch && r + 2 * rr <= r1;
        for (int ti = 0, i0 = 0; ti < tt.ntile; ti++) {
            int nb = (int)(n / tt.ntile) + (ti < n % tt.ntile); /* balanced tiles */
            gu_tile_dispatch(rr, nb, fp8, g + r * H * es, u + r * H * es, H, x + i0 * t->xs_stride, t->xs_stride,
                             act + i0 * t->act_stride + r, t->act_stride, pf && i0 == 0, fp8 ? sc + r : NULL,
                             fp8 ? sc + I + r : NULL);
            i0 += nb;
        }
        r += rr;
    }
}

FAST static void down_seg_fast(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, p0 = t->off[j], n = t->off[j + 1] - p0;
    const int fp8 = t->w_fmt == W_FP8;
    const int64_t es = (int64_t)weight_size(t->w_fmt);
    const char *blob = (const char *)(intptr_t)t->blobs[j], *d = blob + 2 * I * H * es;
    const float *sc = fp8 ? blob_scales(t, blob) + 2 * I : NULL; /* down's H */
    const uint16_t *x = (const uint16_t *)t->act + p0 * t->act_stride;
    float *out = t->out + p0 * H;
    ttiles_t tt = token_tiles(n);
    int R = 16 / pow2_ceil(tt.tsz);
    for (int64_t r = r0; r < r1;) {
        int rr = r + R <= r1 ? R : 1;
        int pf = g_prefetch && r + 2 * rr <= r1;
        for (int ti = 0, i0 = 0; ti < tt.ntile; ti++) {
            int nb = (int)(n / tt.ntile) + (ti < n % tt.ntile);
            down_tile_dispatch(rr, nb, fp8, d + r * I * es, I, x + i0 * t->act_stride, t->act_stride,
                               out + i0 * H + r, H, pf && i0 == 0, fp8 ? sc + r : NULL);
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

/* ------------------------------------------------------------------------------------------------------------- */
/* AMX path: C[16 rows, 16 tokens] += A[16 rows, 32 k] (weights, straight from the blob) x B[32 k, 16 tokens]     */
#if OLED_AMX

static int g_pf_dist = 4; /* AMX: prefetch this many 64-byte columns ahead in each of the 16 rows */

typedef struct {
    uint8_t palette, start_row;
    uint8_t rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* One configuration for everything: 8 tiles of 16 rows x 64 bytes (tokens are padded to groups of 16; a tile
 * product costs the same whatever the number of valid columns). Tiles 0-3: C, 4-5: A (weights), 6-7: B. */
AMX static void amx_config(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

/* Prefetch column kb + dist of the 16 rows of a block (rows of length K), or of the next block's rows once past
 * the end of this one, so the DRAM requests run ahead of the tile loads in the order the tile loads use them. */
AMX static inline void amx_prefetch(const uint16_t *blk, int64_t K, int64_t kb, int next_ok) {
    int64_t col = kb + g_pf_dist, KB = K / 32;
    const uint16_t *base = blk;
    if (col >= KB) {
        if (!next_ok) return;
        col -= KB;
        base += 16 * K;
    }
    for (int rr = 0; rr < 16; rr++) PF_L2(base + rr * K + col * 32);
}

/* silu(g) * u for 16 rows x 16 tokens, written as bf16 into the packed activation tile rows (row pairs
 * interleaved: VNNI layout), so phase 2 can use it as its B operand directly. */
AMX static void amx_store_act(const float *cg, const float *cu, uint16_t *dst) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i inter = _mm512_loadu_si512((const void *)idx);
    for (int rr = 0; rr < 16; rr += 2) {
        __m512 h[2];
        for (int e = 0; e < 2; e++) {
            __m512 g = _mm512_load_ps(cg + (rr + e) * 16), u = _mm512_load_ps(cu + (rr + e) * 16);
            __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f),
                                       _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            h[e] = _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
        }
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(h[1], h[0]); /* [row rr: 16 tokens | row rr+1: 16 tokens] */
        _mm512_store_si512((void *)(dst + (rr / 2) * 32), _mm512_permutexvar_epi16(inter, both));
    }
}

/* gate/up rows r0..r1 (multiples of 16) of AMX job j, all its token groups, two groups per pass */
AMX static void gu_seg_amx(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    int64_t H = t->H, I = t->I, KB = H / 32, KBI = I / 32;
    int64_t G0 = t->gbase[j], ntg = t->gbase[j + 1] - G0;
    const uint16_t *blob = (const uint16_t *)(intptr_t)t->blobs[j];
    const uint16_t *xp = t->xp + G0 * KB * 512;
    float cg[2][256] __attribute__((aligned(64))), cu[2][256] __attribute__((aligned(64)));
    amx_config();
    for (int64_t r = r0; r < r1; r += 16) {
        const uint16_t *g = blob + r * H, *u = blob + I * H + r * H;
        int next_ok = g_pf_dist > 0 && r + 16 < r1;
        for (int64_t tg = 0; tg < ntg; tg += 2) {
            int two = tg + 1 < ntg, pf = g_pf_dist > 0 && tg == 0;
            const uint16_t *b0 = xp + tg * KB * 512, *b1 = b0 + KB * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < KB; kb++) {
                if (pf) {
                    amx_prefetch(g, H, kb, next_ok);
                    amx_prefetch(u, H, kb, next_ok);
                }
                _tile_loadd(4, g + kb * 32, H * 2);
                _tile_loadd(5, u + kb * 32, H * 2);
                _tile_loadd(6, b0 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                if (two) {
                    _tile_loadd(7, b1 + kb * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, cg[0], 64);
            _tile_stored(1, cu[0], 64);
            if (two) {
                _tile_stored(2, cg[1], 64);
                _tile_stored(3, cu[1], 64);
            }
            for (int s2 = 0; s2 <= two; s2++) /* rows r..r+15 are half of k-block r/32 of the activations */
                amx_store_act(cg[s2], cu[s2], t->ap + ((G0 + tg + s2) * KBI + r / 32) * 512 + ((r % 32) / 2) * 32);
        }
    }
}

/* down rows h0..h1 (multiples of 16) of AMX job j */
AMX static void down_seg_amx(const task_t *t, int64_t j, int64_t h0, int64_t h1) {
    int64_t H = t->H, I = t->I, KBI = I / 32, p0 = t->off[j], n = t->off[j + 1] - p0;
    int64_t G0 = t->gbase[j], ntg = t->gbase[j + 1] - G0;
    const uint16_t *d0 = (const uint16_t *)(intptr_t)t->blobs[j] + 2 * I * H;
    const uint16_t *ap = t->ap + G0 * KBI * 512;
    float c[2][256] __attribute__((aligned(64)));
    const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    amx_config();
    for (int64_t h = h0; h < h1; h += 16) {
        const uint16_t *d = d0 + h * I;
        int next_ok = g_pf_dist > 0 && h + 16 < h1;
        for (int64_t tg = 0; tg < ntg; tg += 2) {
            int two = tg + 1 < ntg, pf = g_pf_dist > 0 && tg == 0;
            const uint16_t *b0 = ap + tg * KBI * 512, *b1 = b0 + KBI * 512;
            _tile_zero(0);
            _tile_zero(2);
            for (int64_t kb = 0; kb < KBI; kb++) {
                if (pf) amx_prefetch(d, I, kb, next_ok);
                _tile_loadd(4, d + kb * 32, I * 2);
                _tile_loadd(6, b0 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + kb * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (two) _tile_stored(2, c[1], 64);
            for (int s2 = 0; s2 <= two; s2++) { /* C is [16 rows, 16 tokens]; out wants [token, rows]: gather columns */
                int64_t tok0 = (tg + s2) * 16, nv = min64(16, n - tok0);
                for (int64_t tt = 0; tt < nv; tt++)
                    _mm512_storeu_ps(t->out + (p0 + tok0 + tt) * H + h, _mm512_i32gather_ps(col, c[s2] + tt, 4));
            }
        }
    }
}

/* Pack the tokens of AMX jobs: virtual rows v0..v1 of all groups (16 per group, padding tokens are zeros). */
AMX static void pack_amx(const task_t *t, int64_t v0, int64_t v1) {
    int64_t H = t->H, KB = H / 32, j = 0;
    for (int64_t v = v0; v < v1; v++) {
        int64_t G = v / 16, tt = v % 16;
        while (t->gbase[j + 1] <= G) j++;
        int64_t ti = (G - t->gbase[j]) * 16 + tt, n = t->off[j + 1] - t->off[j];
        uint32_t *dst = (uint32_t *)(t->xp + G * KB * 512) + tt; /* one bf16 pair (k, k+1) per token per tile row */
        if (ti >= n) {
            for (int64_t q = 0; q < H / 2; q++) dst[(q / 16) * 256 + (q % 16) * 16] = 0;
        } else if (t->x_bf16) {
            const uint32_t *src = (const uint32_t *)((const uint16_t *)t->x + t->tok[t->off[j] + ti] * H);
            for (int64_t q = 0; q < H / 2; q++) dst[(q / 16) * 256 + (q % 16) * 16] = src[q];
        } else {
            const float *src = (const float *)t->x + t->tok[t->off[j] + ti] * H;
            for (int64_t q = 0; q < H / 2; q++)
                dst[(q / 16) * 256 + (q % 16) * 16] = f32_to_bf16(src[2 * q]) | (uint32_t)f32_to_bf16(src[2 * q + 1]) << 16;
        }
    }
}

void oled_set_pf_dist(int d) { g_pf_dist = d; }

/* mode AMX: jobs with enough tokens go to the tiles, the others to the AVX-512 tiles */
AMX static void gu_seg_mixed(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    if (is_amx_job(t, j)) gu_seg_amx(t, j, r0, r1);
    else gu_seg_fast(t, j, r0, r1);
}
AMX static void down_seg_mixed(const task_t *t, int64_t j, int64_t r0, int64_t r1) {
    if (is_amx_job(t, j)) down_seg_amx(t, j, r0, r1);
    else down_seg_fast(t, j, r0, r1);
}
AMX static void amx_release(void) { _tile_release(); }
#endif /* OLED_AMX */
#endif /* OLED_FAST */
#if !OLED_AMX
void oled_set_pf_dist(int d) { (void)d; }
#endif

/* ------------------------------------------------------------------------------------------------------------- */
/* worker                                                                                                         */

static void run_task(pool_t *p, int tid) {
    const task_t *t = &p->task;
    int nth = p->n;
    int64_t g0 = t->P * tid / nth, g1 = t->P * (tid + 1) / nth;
#if OLED_AMX
    if (t->mode == MODE_AMX) {
        int64_t V = t->NG * 16; /* phase 0 also packs the AMX jobs' tokens, split like the gather */
        gather_fast(t, g0, g1);
        pack_amx(t, V * tid / nth, V * (tid + 1) / nth);
        barrier(p);
        phase_rows(t, &p->next1, t->I, 2 * t->H, gu_seg_mixed);
        barrier(p);
        phase_rows(t, &p->next2, t->H, t->I, down_seg_mixed);
        if (t->NG) amx_release(); /* tile state back to init: cheaper context switches */
        return;
    }
#endif
#if OLED_FAST
    if (t->mode == MODE_AVX512BF16) {
        gather_fast(t, g0, g1);
        barrier(p);
        phase_rows(t, &p->next1, t->I, 2 * t->H, gu_seg_fast);
        barrier(p);
        phase_rows(t, &p->next2, t->H, t->I, down_seg_fast);
        return;
    }
#endif
    gather_portable(t, g0, g1);
    barrier(p);
    phase_rows(t, &p->next1, t->I, 2 * t->H, gu_seg_portable);
    barrier(p);
    phase_rows(t, &p->next2, t->H, t->I, down_seg_portable);
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
        seen = wait_change(&p->gen, seen, p->spin_ns, &p->sleepers, &p->hold_until);
        if (p->stop) break;
        run_task(p, tid);
        if (atomic_fetch_sub(&p->remaining, 1) == 1) {
            atomic_store(&p->done_ns, now_ns());
            atomic_store(&p->done, seen);
            futex_wake_all(&p->done);
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------------- */
/* public API (ctypes)                                                                                            */

void oled_pool_destroy(void *handle);
void oled_wait(void *handle);

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
    oled_wait(p);           /* a task in flight reads the caller's buffers: let it end first */
    p->stop = 1;
    atomic_fetch_add(&p->gen, 1);
    futex_wake_all(&p->gen);
    for (int i = 0; i < p->n; i++) pthread_join(p->th[i], NULL);
    free(p->th);
    free(p->cpus);
    free(p->xs);
    free(p->act);
    free(p->xp);
    free(p->ap);
    free(p->gb);
    free(p);
}

/* Idle workers keep polling for the next hold_ns (no sleep, so no wake-up cost on the next call); 0 ends a hold.
 * A hold wakes sleeping workers now, so that their wake-up overlaps the caller's own work instead of delaying the
 * next call. The engine wakes the pool this way ahead of a layer's CPU job (or holds it through a forward, see
 * EngineConfig.cpu_wake, runtime/manager.py); the deadline bounds the polling if the caller never ends a hold. */
void oled_pool_hold(void *handle, int64_t hold_ns) {
    pool_t *p = (pool_t *)handle;
    atomic_store(&p->hold_until, hold_ns > 0 ? now_ns() + hold_ns : 0);
    if (hold_ns > 0 && atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
}

/* Nanoseconds the last oled_run on this pool took, from its entry to the last worker's finish (0 if it failed or
 * had nothing to do): the kernel's own time, without the caller's dispatch or its wait to run again afterwards. */
int64_t oled_pool_last_ns(void *handle) { return ((pool_t *)handle)->last_ns; }

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

/* Waits for the task oled_submit started (none: returns at once) and sets oled_pool_last_ns to its time from
 * submission to its last worker's finish. The caller sleeps on its own futex after a short spin: it is a Python
 * thread, not one of the pinned cores. */
void oled_wait(void *handle) {
    pool_t *p = (pool_t *)handle;
    if (!p->inflight) return;
    uint32_t g = p->inflight_gen;
    for (uint32_t d; (d = atomic_load_explicit(&p->done, memory_order_acquire)) != g;)
        wait_change(&p->done, d, 20000, NULL, NULL);
    p->last_ns = atomic_load(&p->done_ns) - p->start_ns;
    p->inflight = 0;
}

/* Starts one task on the pool's workers and returns without waiting for it (oled_wait does): the caller keeps
 * launching GPU work meanwhile, and no thread of the caller's has to run for the task to proceed. Every buffer it
 * names must stay valid until oled_wait returns. A task still in flight is waited for first.
 * Returns 0 on success, <0 on bad arguments (-1), token index out of range (-2), allocation failure (-3),
 * unsupported mode (-4). Must not be called concurrently on one pool.
 * mode: 0 portable, 1 AVX-512 BF16, 2 AVX-512 BF16 + AMX for jobs with >= amx_min tokens (needs H, I multiples
 * of 32; oled_has_amx() must have returned 1). tokw: per-token cost of a weight element in 1/256 of its read. */
int oled_submit(void *handle, int mode, const void *x, int x_bf16, int64_t T, int64_t H, int64_t I, const int64_t *tok,
                int64_t P, const int64_t *off, int64_t J, const int64_t *blobs, int w_fmt, float *out, int64_t tokw,
                int64_t amx_min, int chunks_per_thread) {
    pool_t *p = (pool_t *)handle;
    if (p) oled_wait(p);    /* the workers own the task struct and the scratch buffers until then */
    int64_t t_start = now_ns();
    if (!p || H <= 0 || I <= 0 || P < 0 || J < 0 || T < 0) return -1;
    p->last_ns = 0;
    if (J == 0 || P == 0) return (J == 0 && P != 0) ? -1 : 0;
    if (off[0] != 0 || off[J] != P) return -1;
    for (int64_t j = 0; j < J; j++) {
        if (off[j + 1] < off[j]) return -1;
        if (off[j + 1] > off[j] && !blobs[j]) return -1;
    }
    for (int64_t i = 0; i < P; i++)
        if (tok[i] < 0 || tok[i] >= T) return -2;
    if (w_fmt < W_F32 || w_fmt > W_FP8) return -1;
    if (mode == MODE_AVX512BF16 && (!OLED_FAST || (w_fmt != W_BF16 && w_fmt != W_FP8))) return -4;
    if (mode == MODE_AMX && (!OLED_AMX || w_fmt != W_BF16)) return -4;
    if (mode == MODE_AMX && (H % 32 || I % 32 || amx_min < 1)) mode = MODE_AVX512BF16;

    task_t *t = &p->task;
    t->mode = mode;
    t->x = x;
    t->x_bf16 = x_bf16;
    t->w_fmt = w_fmt;
    t->T = T; t->H = H; t->I = I; t->P = P; t->J = J;
    t->tok = tok; t->off = off; t->blobs = blobs; t->out = out;
    t->tokw = tokw < 0 ? 0 : tokw;
    t->nchunks = p->n * (chunks_per_thread > 0 ? chunks_per_thread : 1);
    size_t es = mode == MODE_PORTABLE ? 4 : 2;
    t->xs_stride = round_up(H, 32); /* 64-byte aligned rows */
    t->act_stride = round_up(I, 32);
    if (ensure(&p->xs, &p->xs_cap, (size_t)P * t->xs_stride * es) ||
        ensure(&p->act, &p->act_cap, (size_t)P * t->act_stride * es))
        return -3;
    t->xs = p->xs;
    t->act = p->act;
    t->gbase = NULL;
    t->NG = 0;
    if (mode == MODE_AMX) { /* token groups of 16 for the jobs with enough tokens */
        if (ensure(&p->gb, &p->gb_cap, (size_t)(J + 1) * sizeof(int64_t))) return -3;
        int64_t *gb = (int64_t *)p->gb;
        gb[0] = 0;
        for (int64_t j = 0; j < J; j++) {
            int64_t n = off[j + 1] - off[j];
            gb[j + 1] = gb[j] + (n >= amx_min ? ceil_div(n, 16) : 0);
        }
        t->NG = gb[J];
        if (ensure(&p->xp, &p->xp_cap, (size_t)t->NG * 16 * H * 2 + 64) ||
            ensure(&p->ap, &p->ap_cap, (size_t)t->NG * 16 * I * 2 + 64))
            return -3;
        t->gbase = gb;
        t->xp = (uint16_t *)p->xp;
        t->ap = (uint16_t *)p->ap;
    }
    atomic_store(&p->next1, 0);
    atomic_store(&p->next2, 0);

    atomic_store(&p->remaining, p->n);
    p->start_ns = t_start;
    uint32_t g = atomic_fetch_add(&p->gen, 1) + 1;
    p->inflight_gen = g;
    p->inflight = 1;
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
    return 0;
}

/* oled_submit, then oled_wait: one task, returned when done. */
int oled_run(void *handle, int mode, const void *x, int x_bf16, int64_t T, int64_t H, int64_t I, const int64_t *tok,
             int64_t P, const int64_t *off, int64_t J, const int64_t *blobs, int w_fmt, float *out, int64_t tokw,
             int64_t amx_min, int chunks_per_thread) {
    int rc = oled_submit(handle, mode, x, x_bf16, T, H, I, tok, P, off, J, blobs, w_fmt, out, tokw, amx_min,
                         chunks_per_thread);
    if (rc == 0) oled_wait(handle);
    return rc;
}
