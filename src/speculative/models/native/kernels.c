/* One Llama-family decoder forward in C (AVX2 + FMA + F16C + OpenMP; optionally AVX-512
 * VNNI), for the native runtime.
 *
 * Built on first use by speculative/models/native/ckernels.py (once per instruction set:
 * an "avx2" library, and an "avx512" one where the CPU has AVX-512 F/BW/VL/DQ + VNNI) and
 * called through ctypes; the Python side owns every buffer. The forward appends k tokens
 * to a static KV cache and writes [k, vocab] logits.
 *
 * k-invariance by construction: every row (token) is computed by the same arithmetic
 * whatever the number of rows in the call. A linear layer keeps one fp32 lane per
 * (output, token row) pair, summed in input order (fp32 / bf16 / q8) or group order
 * (q4, exact integer dots inside a group); tiles only choose which pairs run side by
 * side. Attention visits exactly the slots a token may see, in slot order. So a block of
 * k tokens yields bitwise the logits of k single decode steps (speculative verification
 * relies on this), and verifying k tokens reads (and decodes) the weights once. The
 * AVX-512 build runs the same per-lane operations (q4: VNNI integer dots, equal to the
 * AVX2 sums; attention: the same lanes in 16-lane vectors), so both libraries give the
 * same bits.
 *
 * Weight formats: fp32; bf16 (upper half of an fp32); q8 (int8 with one fp32 scale per
 * output row); q4 (4-bit q in 0..15 with an fp16 scale d and minimum m per 32 inputs,
 * value = d * q + m: GGUF Q4_1 blocks as stored). All are repacked at load time into
 * output panels (see "linear layers"). Activations are fp32, except that a q4 layer reads
 * its input quantized to int8 per 32 values, as llama.cpp runs Q4_1 (see quantize_rows).
 *
 * The library also holds the fused soft cross-entropy that training a drafting head uses
 * (see "the distillation loss", at the end).
 *
 * Compile with -ffp-contract=off: every fused multiply-add here is explicit, so inlined
 * copies of the same code cannot round differently.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_Q8 2
#define FMT_Q4 3
#define FMT_Q8D 4  /* q8 weights with int8 activations: integer dots (the int4 model's head) */
#define GROUP 32

/* Linear.flags */
#define LINEAR_CACHED 1  /* a small matrix run many times in a row (a drafting head's): its
                          * weights are mostly in cache (see linear_q4) */

typedef struct {
    int32_t format, in_features, out_features, flags;
    const void *weight;   /* packed panels, see "linear layers" */
    const float *scale;   /* q8: f32 [out] row scales; otherwise NULL */
    const float *bias;    /* [out] or NULL */
} Linear;

typedef struct {
    const float *input_norm;  /* [hidden] */
    const float *post_norm;   /* [hidden] */
    const float *qk_norm;     /* [2, head_dim]: every query head's RMSNorm weights (with the
                               * 1/sqrt(head_dim) softmax scale folded in), then every key
                               * head's, in RoPE-interleaved order (Qwen3); or NULL */
    Linear qkv, o, gate_up, down;
} Layer;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_length;
    float eps;
    int32_t kv_f16;  /* the KV cache holds IEEE half floats (else float32): see "the KV cache" */
    const Layer *layers;
    const float *final_norm;  /* [hidden], or NULL: the head reads the residual stream */
    Linear lm_head;
    const float *cos;  /* [max_length, head_dim / 2] */
    const float *sin;  /* [max_length, head_dim / 2] */
    double *op_seconds;  /* [OP_COUNT] or NULL: where a forward adds its ops' wall clock */
    float *layer_out;    /* NULL, or [count of layer_mask's bits, rows, hidden]: where a
                            forward copies the residual stream after each layer l whose bit
                            is set in layer_mask, in layer order (middle-layer features) */
    uint64_t layer_mask;
} Model;

/* The ops a forward clocks into Model.op_seconds (speculative.models.base.KERNEL_OPS
 * names them in this order), summed over the layers. Each op ends in a barrier, so thread
 * 0's clock after it marks its end on every thread: an op's time includes the threads'
 * imbalance. */
enum { OP_NORM, OP_QKV, OP_ROPE, OP_ATTENTION, OP_O, OP_GATE_UP, OP_ACT, OP_DOWN, OP_HEAD, OP_COUNT };

/* Add the time since *last to op `op` (thread 0 only, when the model is clocked). */
static inline void op_clock(const Model *m, int op, double *last) {
    if (!m->op_seconds || omp_get_thread_num() != 0)
        return;
    const double now = omp_get_wtime();
    m->op_seconds[op] += now - *last;
    *last = now;
}

int spec_abi_version(void) { return 19; }

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
const char *spec_isa(void) { return "avx512"; }
#else
const char *spec_isa(void) { return "avx2"; }
#endif

/* The CPU's features as bits (see ckernels.CPU_FEATURES for the names). */
int spec_cpu_features(void) {
    __builtin_cpu_init();
    return (__builtin_cpu_supports("avx2") ? 1 : 0) | (__builtin_cpu_supports("fma") ? 2 : 0) |
           (__builtin_cpu_supports("f16c") ? 4 : 0) | (__builtin_cpu_supports("avx512f") ? 8 : 0) |
           (__builtin_cpu_supports("avx512bw") ? 16 : 0) |
           (__builtin_cpu_supports("avx512vl") ? 32 : 0) |
           (__builtin_cpu_supports("avx512dq") ? 64 : 0) |
           (__builtin_cpu_supports("avx512vnni") ? 128 : 0);
}

/* ---- small vector helpers ------------------------------------------------------- */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* (hsum8(v0), hsum8(v1), hsum8(v2), hsum8(v3)), each lane the same three-step sum as hsum8
 * ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), so the same bits, with the four
 * folds sharing their shuffles and adds. */
static inline __m128 hsum8x4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    /* halves: [v0 lo + v0 hi | v1 lo + v1 hi] and the same for v2, v3 */
    const __m256 h01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20),
                                     _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 h23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20),
                                     _mm256_permute2f128_ps(v2, v3, 0x31));
    /* s + movehl(s): per 128-bit lane (s0[0] + s0[2], s0[1] + s0[3], s2[..], s2[..]) */
    const __m256 q = _mm256_add_ps(_mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(3, 2, 3, 2)));
    /* the last add: low lane (v0's, v2's), high lane (v1's, v3's) */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q, q, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(q, q, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

/* exp(x) for NV (<= 8) vectors of 8 lanes already in [-87.3, 88.4] (exp8's range), in
 * place: the range reduction and degree-6 polynomial of exp8, each step across all NV
 * vectors before the next. The same operations per lane (so the same bits) as NV
 * independent chains side by side, where one chain alone leaves the FMA pipes waiting on
 * its latency (the top-p partition pass: 0.83x the time with 8 on Zen 2). */
static inline __attribute__((always_inline)) void exp8_in_range_n(__m256 *x, const int NV) {
    static const float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_high = _mm256_set1_ps(0.693359375f), ln2_low = _mm256_set1_ps(-2.12194440e-4f);
    __m256 n[8], p[8];
    for (int v = 0; v < NV; v++)
        n[v] = _mm256_round_ps(_mm256_mul_ps(x[v], log2e),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    for (int v = 0; v < NV; v++) x[v] = _mm256_fnmadd_ps(n[v], ln2_high, x[v]);
    for (int v = 0; v < NV; v++) x[v] = _mm256_fnmadd_ps(n[v], ln2_low, x[v]);
    for (int v = 0; v < NV; v++) p[v] = _mm256_set1_ps(poly[0]);
    for (int c = 1; c < 6; c++)
        for (int v = 0; v < NV; v++) p[v] = _mm256_fmadd_ps(p[v], x[v], _mm256_set1_ps(poly[c]));
    for (int v = 0; v < NV; v++)
        p[v] = _mm256_fmadd_ps(p[v], _mm256_mul_ps(x[v], x[v]),
                               _mm256_add_ps(x[v], _mm256_set1_ps(1.0f)));
    for (int v = 0; v < NV; v++) {
        const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n[v]), _mm256_set1_epi32(127));
        x[v] = _mm256_mul_ps(p[v], _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    }
}

static inline __m256 exp8_in_range(__m256 x) {
    exp8_in_range_n(&x, 1);
    return x;
}

/* exp(x) for 8 lanes (Cephes-style range reduction, degree-6 polynomial, ~1 ulp). */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    return exp8_in_range(_mm256_max_ps(_mm256_min_ps(x, hi), lo));
}

/* exp of n floats in place; the tail goes through the same 8-lane code. */
static void exp_inplace(float *v, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, v + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        memcpy(v + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

/* ---- linear layers ---------------------------------------------------------------- */

/* Layouts (packed at load time by ckernels.py; values are exactly the model's):
 *
 * fp32 / bf16 / q8: panels of PANEL = 16 output rows, each panel [in][16] (the 16 weights
 * of input i side by side), so one 8-lane load holds 8 outputs of one input. Rows past
 * out_features are zero. A tile keeps one 8-lane accumulator per (8 outputs, token row)
 * and adds w[i] * x[r, i] for i = 0, 1, ..., in - 1 in order: every (output, row) pair is
 * a single lane summed in input order, whatever the tile shape, the number of rows in the
 * call or the vector width. One decoded weight vector serves all the tile's rows.
 *
 * q4: panels of Q4_PANEL = 8 output rows; per group of 32 inputs one 160-byte block:
 *   bytes 0..127   nibbles, four chunks of 32 bytes; chunk c byte 4 * o + t holds
 *                  q[o][4c + t] (low nibble) and q[o][16 + 4c + t] (high nibble)
 *   bytes 128..143 d[o] fp16, bytes 144..159 m[o] fp16 (weight = d * q + m, GGUF Q4_1)
 * The nibbles unpack into eight registers u[j] (j = 0..7), u[j] byte 4 * o + t =
 * q[o][4j + t], once per block; each token row then takes the exact integer dot of
 * every output with its int8 activations (4 at a time, broadcast) for all 8 outputs. */

#define PANEL 16
#define Q4_PANEL 8
#define Q4_BLOCK_BYTES 160
#define ROW_BLOCK 6      /* token rows per register tile (at most; row blocks are balanced) */
#define PANEL_GROUP 4    /* panels whose weights stay in cache while all row blocks sweep them */
/* Panels per group when the rows take several blocks (more than ROW_BLOCK rows), so that
 * every block after the first sweeps weights still in L2. AVX2 tiles of 3 or more rows
 * are one panel wide anyway, and four panels of a 1,536-input fp32 layer (393 KB) with the
 * next tile's prefetch overflow a 512 KB L2 (Zen 2): fp32 passes of 7, 8 and 12 tokens of
 * the default model took 0.87-0.88x the time with one panel there, the same bits (bf16
 * unchanged). The AVX-512 build's tiles span the whole group, so it keeps PANEL_GROUP. */
#if defined(__AVX512F__)
#define SWEEP_GROUP PANEL_GROUP
#else
#define SWEEP_GROUP 1
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far the software prefetch runs ahead in a weight stream
                               * (into L2, _MM_HINT_T1: an L1 prefetch holds one of the few L1
                               * miss buffers for a DRAM round trip; measured 0.82-0.91x at k = 1) */
#endif
#ifndef ROW_PANEL
#define ROW_PANEL 48     /* rows per sweep over the weights: a panel of x stays in cache */
#endif
/* Passes of at most this many token rows prefetch the int4 and int8-dot weight streams
 * with _MM_HINT_NTA, NTA_PREFETCH_BYTES ahead, instead of T1 (AVX2 build): weights read
 * once then stay out of L2 and of the L3 behind it, which keep the KV cache, the
 * activations, and the Python and torch code and data that run between passes.
 * Zen 2 (family 23 model 49), the same bits, against T1 8 KiB ahead:
 * - passes of one model repeated: k = 1 0.86-0.87x the time, k = 2 0.90-0.91x; NTA 8 KiB
 *   ahead made k = 4-8 1.00-1.03x slower, 4 KiB ahead 0.97-1.00x (2 KiB ahead: k = 1
 *   1.03x slower than 8 KiB); a torch op right after a pass 15 us instead of 63 us;
 * - generation alternated with the T1 build (12-24 bench prompts, 128 tokens, greedy,
 *   outputs identical), NTA up to 3 rows: plain 1.10-1.13x the tokens/s, n-gram
 *   1.08-1.11x, auto 1.08-1.09x, EAGLE 1.10x; then up to 8 rows, 4 KiB ahead: EAGLE
 *   gamma = 3 a further 1.02-1.03x, n-gram gamma = 4 and auto 1.01-1.02x, plain 0.99-1.00x.
 * Larger passes (prefill, wide batches) keep T1 (not measured with NTA). The float path
 * (fp32 / bf16 / int8 panels) keeps T1: NTA made bf16 1.03-1.07x slower. */
#ifndef STREAM_NTA_ROWS
#if defined(__AVX512F__)
/* T1 throughout. Measured on Zen 4 (family 25 model 17), the same bits, against T1: NTA
 * for the two-panel tile's streams made passes of 2-16 rows 1.04-1.27x slower (4 or 12
 * KiB ahead); for one row (the one-panel tile) 0.95-0.99x, within the machine's noise. */
#define STREAM_NTA_ROWS 0
#else
#define STREAM_NTA_ROWS 8
#endif
#endif
#ifndef NTA_PREFETCH_BYTES
#define NTA_PREFETCH_BYTES 4096  /* lines held in L1 alone: not too far ahead */
#endif

/* Prefetch a weight block's lines ahead of [block, block + bytes): non-temporally
 * NTA_PREFETCH_BYTES ahead, or into L2 PREFETCH_BYTES ahead. */
static inline __attribute__((always_inline)) void prefetch_weights(const void *block, int bytes,
                                                                   int nta) {
    const char *ahead = (const char *)block + (nta ? NTA_PREFETCH_BYTES : PREFETCH_BYTES);
    for (int b = 0; b < bytes; b += 64) {
        if (nta)
            _mm_prefetch(ahead + b, _MM_HINT_NTA);
        else
            _mm_prefetch(ahead + b, _MM_HINT_T1);
    }
}

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* This thread's share [begin, end) of n work items (contiguous, sizes differ by <= 1).
 * Call inside the parallel region; the caller ends its work with a barrier. */
static inline void thread_range(int n, int *begin, int *end) {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    *begin = (int)(n * t / threads);
    *end = (int)(n * (t + 1) / threads);
}

static inline size_t element_bytes(int FORMAT) {
    return FORMAT == FMT_F32 ? 4 : FORMAT == FMT_BF16 ? 2 : 1;
}

/* Eight consecutive packed weights as fp32 (bf16 is the upper half of an fp32; q8 is the
 * integer, its row scale applied to the finished sum). FORMAT folds at compile time. */
static inline __attribute__((always_inline)) __m256 load_weights8(int FORMAT, const char *p) {
    if (FORMAT == FMT_F32) return _mm256_loadu_ps((const float *)p);
    if (FORMAT == FMT_BF16) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The weights of the next tile (the panels right after this tile's, contiguous) stream
 * into cache while this tile computes: input i prefetches bytes [from, from + count) of
 * it, so one pass over the inputs covers the whole next tile once. */
static inline __attribute__((always_inline)) void prefetch_next_tile(const char *next, size_t from,
                                                                     size_t count) {
    if (!next) return;
    for (size_t b = (from + 63) & ~(size_t)63; b < from + count; b += 64)
        _mm_prefetch(next + b, _MM_HINT_T1);
}

/* One register tile: NV vectors of 8 outputs (NV / 2 consecutive panels starting at w0)
 * times RB token rows (x stride ldx). out[r * 64 + v * 8 + lane] = sum over i in order of
 * w[i] * x[r, i]. With NV * RB <= 12 the accumulators stay in registers. */
static inline __attribute__((always_inline)) void float_tile(
    int FORMAT, const char *w0, size_t panel_bytes, int in, const float *x, size_t ldx, int NV,
    int RB, float *out, const char *next) {
    const size_t step = PANEL * element_bytes(FORMAT);  /* bytes of one input in a panel */
    __m256 acc[8][ROW_BLOCK];
    for (int v = 0; v < NV; v++)
        for (int r = 0; r < RB; r++) acc[v][r] = _mm256_setzero_ps();
    for (int i = 0; i < in; i++) {
        const char *wi = w0 + (size_t)i * step;
        prefetch_next_tile(next, (size_t)i * (NV / 2) * step, (NV / 2) * step);
        __m256 w[8];
        for (int v = 0; v < NV; v++)
            w[v] = load_weights8(FORMAT, wi + (v / 2) * panel_bytes + (v % 2) * 8 * element_bytes(FORMAT));
        for (int r = 0; r < RB; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
            for (int v = 0; v < NV; v++) acc[v][r] = _mm256_fmadd_ps(w[v], xb, acc[v][r]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + r * 64 + v * 8, acc[v][r]);
}

#define FLOAT_TILE(NV, RB) float_tile(FORMAT, w0, panel_bytes, in, xb, ldx, NV, RB, tile, next)

#if defined(__AVX512F__)
/* Sixteen consecutive packed weights (one panel's input i) as fp32: load_weights8 widened. */
static inline __attribute__((always_inline)) __m512 load_weights16(int FORMAT, const char *p) {
    if (FORMAT == FMT_F32) return _mm512_loadu_ps((const float *)p);
    if (FORMAT == FMT_BF16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* float_tile with one zmm per panel: NP panels x RB rows (NP * RB <= 24 accumulators of
 * the 32 registers). Each lane runs the same FMA sequence as in float_tile: same bits. */
static inline __attribute__((always_inline)) void float_tile16(
    int FORMAT, const char *w0, size_t panel_bytes, int in, const float *x, size_t ldx, int NP,
    int RB, float *out, const char *next) {
    const size_t step = PANEL * element_bytes(FORMAT);
    __m512 acc[4][ROW_BLOCK];
    for (int p = 0; p < NP; p++)
        for (int r = 0; r < RB; r++) acc[p][r] = _mm512_setzero_ps();
    for (int i = 0; i < in; i++) {
        const char *wi = w0 + (size_t)i * step;
        prefetch_next_tile(next, (size_t)i * NP * step, NP * step);
        __m512 w[4];
        for (int p = 0; p < NP; p++) w[p] = load_weights16(FORMAT, wi + p * panel_bytes);
        for (int r = 0; r < RB; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
            for (int p = 0; p < NP; p++) acc[p][r] = _mm512_fmadd_ps(w[p], xb, acc[p][r]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int p = 0; p < NP; p++) _mm512_storeu_ps(out + r * 64 + p * 16, acc[p][r]);
}
#define FLOAT_TILE16(NP, RB) float_tile16(FORMAT, w0, panel_bytes, in, xb, ldx, NP, RB, tile, next)
#endif

/* y[r, o] (+)= (x[r] . W[o]) * scale[o] + bias[o] for fp32 / bf16 / q8 W. x [rows, in],
 * y [rows, ldy]. Call inside the parallel region: each thread takes a contiguous range of
 * panels. For each group of PANEL_GROUP panels the token rows go in balanced blocks of at
 * most ROW_BLOCK; few rows take wide tiles (more outputs at once, enough independent
 * accumulators), many rows narrow ones. The tile shape never changes a pair's sum. */
static inline __attribute__((always_inline)) void linear_float(
    const Linear *L, int FORMAT, const float *x, int rows, float *y, int ldy, int accumulate) {
    const int in = L->in_features, out = L->out_features;
    const int panels = (out + PANEL - 1) / PANEL;
    const size_t ldx = (size_t)in, panel_bytes = (size_t)in * PANEL * element_bytes(FORMAT);
    float tile[ROW_BLOCK * 64];
    int p0, p1;
    thread_range(panels, &p0, &p1);
    for (int c0 = 0; c0 < rows; c0 += ROW_PANEL) {
        const int cn = min_int(ROW_PANEL, rows - c0);
        const int blocks = (cn + ROW_BLOCK - 1) / ROW_BLOCK;
        const int group = blocks > 1 ? SWEEP_GROUP : PANEL_GROUP;
        for (int pg = p0; pg < p1; pg += group) {
            const int pn = min_int(group, p1 - pg);
            int r0 = c0;
            for (int b = 0; b < blocks; b++) {
                const int left = cn - (r0 - c0), rb = (left + blocks - b - 1) / (blocks - b);
                const int widest = rb <= 2 ? 4 : 2;  /* AVX2 has 16 registers: NV * RB <= 12 */
                const float *xb = x + (size_t)r0 * ldx;
                for (int q = 0; q < pn;) {
#if defined(__AVX512F__)
                    const int nv = 2 * (pn - q);  /* all the group's panels: <= 24 zmm */
                    const char *w0 = (const char *)L->weight + (size_t)(pg + q) * panel_bytes;
                    const char *next = pg + q + nv / 2 < p1 ? w0 + (size_t)(nv / 2) * panel_bytes : NULL;
                    (void)widest;
                    switch (rb * 16 + nv / 2) {
#define TILE16_ROW(RB) \
                    case RB * 16 + 1: FLOAT_TILE16(1, RB); break; \
                    case RB * 16 + 2: FLOAT_TILE16(2, RB); break; \
                    case RB * 16 + 3: FLOAT_TILE16(3, RB); break; \
                    case RB * 16 + 4: FLOAT_TILE16(4, RB); break;
                    TILE16_ROW(1) TILE16_ROW(2) TILE16_ROW(3) TILE16_ROW(4) TILE16_ROW(5)
                    TILE16_ROW(6)
#undef TILE16_ROW
                    }
#else
                    const int nv = min_int(widest, 2 * (pn - q));
                    const char *w0 = (const char *)L->weight + (size_t)(pg + q) * panel_bytes;
                    const char *next = pg + q + nv / 2 < p1 ? w0 + (size_t)(nv / 2) * panel_bytes : NULL;
                    switch (rb * 16 + nv) {
                    case 16 + 8: FLOAT_TILE(8, 1); break;
                    case 16 + 6: FLOAT_TILE(6, 1); break;
                    case 16 + 4: FLOAT_TILE(4, 1); break;
                    case 16 + 2: FLOAT_TILE(2, 1); break;
                    case 32 + 4: FLOAT_TILE(4, 2); break;
                    case 32 + 2: FLOAT_TILE(2, 2); break;
                    case 48 + 4: FLOAT_TILE(4, 3); break;
                    case 48 + 2: FLOAT_TILE(2, 3); break;
                    case 64 + 2: FLOAT_TILE(2, 4); break;
                    case 80 + 2: FLOAT_TILE(2, 5); break;
                    default: FLOAT_TILE(2, 6); break;
                    }
#endif
                    const int o0 = (pg + q) * PANEL, on = min_int(nv * 8, out - o0);
                    for (int r = 0; r < rb; r++) {
                        float *dst = y + (size_t)(r0 + r) * ldy + o0;
                        for (int o = 0; o < on; o++) {
                            const float scale = FORMAT == FMT_Q8 ? L->scale[o0 + o] : 1.0f;
                            const float bias = L->bias ? L->bias[o0 + o] : 0.0f;
                            const float v = tile[r * 64 + o] * scale + bias;
                            dst[o] = accumulate ? dst[o] + v : v;
                        }
                    }
                    q += nv / 2;
                }
                r0 += rb;
            }
        }
    }
#pragma omp barrier
}

/* Activation rows for the q4 dot product, quantized per group of 32 inputs the way
 * llama.cpp does for Q4_1 (its Q8_1): x ~= scale * q with q int8 in -127..127,
 * sum = sum(q) and part = scale * sum. Per-row arrays of groups are padded to a multiple
 * of 8. */
typedef struct {
    int8_t *q;     /* [rows, in] */
    float *scale;  /* [rows, stride] */
    float *part;   /* [rows, stride] */
    int32_t *sum;  /* [rows, stride] */
    int stride;
} QuantRows;

static int padded_groups(int in) { return (in / GROUP + 7) / 8 * 8; }

#define QUANT_ARRAYS 3  /* scale, part, sum: per (row, group) */

/* QuantRows for `rows` rows of up to `in` inputs laid out at `at`: q, then scale, part and
 * sum; it takes rows * (in / 4 + QUANT_ARRAYS * padded_groups(in)) floats. */
static QuantRows quant_rows_at(float *at, int64_t rows, int64_t in) {
    const int64_t groups = rows * padded_groups((int)in);
    float *scale = at + rows * in / 4;
    QuantRows qx = {(int8_t *)at, scale, scale + groups, (int32_t *)(scale + 2 * groups), 0};
    return qx;
}

static void quantize_rows(const float *x, int rows, int in, QuantRows *qx) {
    const int groups = in / GROUP, stride = padded_groups(in);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    qx->stride = stride;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < stride; g++) {
            if (g >= groups) {
                qx->scale[(size_t)r * stride + g] = 0.0f;
                qx->part[(size_t)r * stride + g] = 0.0f;
                qx->sum[(size_t)r * stride + g] = 0;
                continue;
            }
            const float *src = x + (size_t)r * in + g * GROUP;
            __m256 v[4], top = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(src + 8 * j);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
            const float amax = _mm_cvtss_f32(t);
            const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 inv = _mm256_set1_ps(inverse);
            __m256i q[4];
            for (int j = 0; j < 4; j++)  /* round to nearest even, as lrintf */
                q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            const __m256i packed = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                order);
            _mm256_storeu_si256((__m256i *)(qx->q + (size_t)r * in + g * GROUP), packed);
            qx->scale[(size_t)r * stride + g] = scale;
            qx->sum[(size_t)r * stride + g] = _mm_cvtsi128_si32(s4);
            qx->part[(size_t)r * stride + g] = scale * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* Four int8 activations as one broadcast 32-bit lane pattern. */
static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Exact integer dots of 8 outputs (u: the unpacked group) with one row's 32 int8
 * activations xr: lane o = sum_i q[o][i] * x[i]. Integer sums have no rounding, so the
 * AVX2 and VNNI variants give the same result. */
static inline __attribute__((always_inline)) __m256i q4_dot8(const __m256i u[8], const int8_t *xr) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) s = _mm256_dpbusd_epi32(s, u[j], broadcast4(xr + 4 * j));
    return s;
#else
    /* maddubs: int16 lane = two products, |.| <= 2 * 15 * 127 = 3810; eight of them sum
     * to at most 30480, so the int16 sums cannot overflow */
    __m256i s = _mm256_maddubs_epi16(u[0], broadcast4(xr));
    for (int j = 1; j < 8; j++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[j], broadcast4(xr + 4 * j)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* y[r, o] (+)= x[r] . W[o] + bias[o] for q4 W (blocks as described above): quantizes x
 * into qx, then each thread takes a contiguous range of 8-output panels. Per block (8
 * outputs x 32 inputs) the nibbles unpack once; every token row then adds
 *   d * dx * dot + m * part   (one fp32 lane per (output, row), groups in order)
 * to its accumulator, so a pair's value never depends on the other rows. */
/* One panel (8 outputs) of a q4 layer for token rows r0 .. r0 + rows - 1 (rows <= ROW_PANEL):
 * acc[r * 16 + o] = the pair's sum over all groups. */
static inline void q4_panel8(const uint8_t *blocks, int groups, int in, const QuantRows *qx,
                             int r0, int rows, float *acc, int nta) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < rows; r++) _mm256_store_ps(acc + r * 16, _mm256_setzero_ps());
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = blocks + (size_t)g * Q4_BLOCK_BYTES;
        prefetch_weights(block, Q4_BLOCK_BYTES, nta);
        __m256i u[8];
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
            u[c] = _mm256_and_si256(bytes, low);
            u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 128)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 144)));
        for (int r = 0; r < rows; r++) {
            const size_t row = (size_t)(r0 + r), s = row * qx->stride + g;
            const __m256i dot = q4_dot8(u, qx->q + row * in + g * GROUP);
            __m256 t = _mm256_mul_ps(m, _mm256_set1_ps(qx->part[s]));
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(qx->scale[s])), t);
            _mm256_store_ps(acc + r * 16, _mm256_add_ps(_mm256_load_ps(acc + r * 16), t));
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* 32 bytes of a block of each of two adjacent panels side by side in one zmm (the first
 * panel's in the low half), and the prefetch of both blocks' streams. */
static inline __attribute__((always_inline)) __m512i two_panels(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* init + the exact integer dots of 16 outputs (u: a group's unsigned weight bytes in the
 * VNNI layout) with one row's 32 int8 activations xr, four at a time (broadcast). GCC
 * does not fold the broadcast into vpdpbusd's memory operand ({1to16}), so the assembly
 * says it: one instruction per four activations instead of a vpbroadcastd beside each.
 * The same sums. Measured on Zen 4 (family 25 model 17; scripts/kernels_side_by_side.py,
 * int4, logits bitwise equal): 8 one-token sequences in one pass 0.95x the time, 5 and 8
 * tokens of one sequence 0.96-0.98x, one token the same. */
static inline __attribute__((always_inline)) __m512i vnni_dot16(const __m512i u[8],
                                                                const int8_t *xr, __m512i init) {
    __m512i dot = init;
    for (int j = 0; j < 8; j++) {
#if defined(__GNUC__)
        __asm__("vpdpbusd %1%{1to16%}, %2, %0"
                : "+v"(dot)
                : "m"(*(const int32_t *)(xr + 4 * j)), "v"(u[j]));
#else
        int32_t four;
        memcpy(&four, xr + 4 * j, 4);
        dot = _mm512_dpbusd_epi32(dot, u[j], _mm512_set1_epi32(four));
#endif
    }
    return dot;
}

/* Two adjacent panels stream side by side, so the bytes PREFETCH_BYTES past one panel's
 * block belong to the other panel, in flight already, or to the next pair at another
 * group. The lines to ask for are the same blocks of a later pair: `lead` bytes on, whole
 * pairs (two panels of panel_bytes each), at least PREFETCH_BYTES. */
static inline size_t pair_lead(size_t panel_bytes) {
    const size_t pair = 2 * panel_bytes;
    return pair * ((PREFETCH_BYTES + pair - 1) / pair);
}

static inline __attribute__((always_inline)) void prefetch_two(const void *a, const void *b,
                                                               int bytes, size_t lead) {
    for (int i = 0; i < bytes; i += 64) {
        _mm_prefetch((const char *)a + lead + i, _MM_HINT_T1);
        _mm_prefetch((const char *)b + lead + i, _MM_HINT_T1);
    }
}

/* q4_panel8 for two adjacent panels at once (16 outputs, one zmm lane each): the same
 * per-lane operations, so the same bits. */
static inline void q4_panel16(const uint8_t *blocks, size_t panel_bytes, int groups, int in,
                              const QuantRows *qx, int r0, int rows, float *acc) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t *blocks2 = blocks + panel_bytes;  /* the next panel's */
    const size_t lead = pair_lead(panel_bytes);
    for (int r = 0; r < rows; r++) _mm512_store_ps(acc + r * 16, _mm512_setzero_ps());
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = blocks + (size_t)g * Q4_BLOCK_BYTES;
        const uint8_t *block2 = blocks2 + (size_t)g * Q4_BLOCK_BYTES;
        prefetch_two(block, block2, Q4_BLOCK_BYTES, lead);
        __m512i u[8];
        for (int c = 0; c < 4; c++) {
            const __m512i bytes = two_panels(block + 32 * c, block2 + 32 * c);
            u[c] = _mm512_and_si512(bytes, low);
            u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(block + 128))),
            _mm_loadu_si128((const __m128i *)(block2 + 128)), 1));
        const __m512 m = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(block + 144))),
            _mm_loadu_si128((const __m128i *)(block2 + 144)), 1));
        for (int r = 0; r < rows; r++) {
            const size_t row = (size_t)(r0 + r), s = row * qx->stride + g;
            const int8_t *xr = qx->q + row * in + g * GROUP;
            const __m512i dot = vnni_dot16(u, xr, _mm512_setzero_si512());
            __m512 t = _mm512_mul_ps(m, _mm512_set1_ps(qx->part[s]));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(qx->scale[s])), t);
            _mm512_store_ps(acc + r * 16, _mm512_add_ps(_mm512_load_ps(acc + r * 16), t));
        }
    }
}
#endif

/* Rows from which the AVX-512 build takes two panels at once (q4_panel16, the same bits as
 * q4_panel8). One row is streamed faster one panel at a time: a decode step of the default
 * model took 0.86-0.93x the time that way on Zen 5 (scripts/kernels_side_by_side.py, logits
 * bitwise equal), and 3-token passes the same time. On Zen 4 (family 25 model 17) one row
 * took the same time either way (0.99x).
 * A LINEAR_CACHED matrix (a drafting head's) takes two panels from one row: its weights
 * come from cache, where the tile's instructions bind rather than the stream. Measured on
 * Zen 4, the default model's EAGLE head at one row, the two choices alternated in one
 * process: each matrix run again at once 0.82-0.92x the time, after a 64 MB read between
 * runs 0.96-1.00x. */
#ifndef Q4_PANEL16_ROWS
#define Q4_PANEL16_ROWS 2
#endif

/* Whether a pass of `rows` token rows over L prefetches its weights non-temporally (see
 * STREAM_NTA_ROWS): never for a LINEAR_CACHED matrix, whose weights should stay in cache
 * for its next step. */
static inline int stream_nta(const Linear *L, int rows) {
    return rows <= STREAM_NTA_ROWS && !(L->flags & LINEAR_CACHED);
}

/* The keys and values of one layer that this thread's sequences will attend to, walked a
 * few cache lines at a time from inside the int4 weight loops of the layer before (its
 * gate/up and down projections), so that they are in L2 when attention reads them. In a
 * batch every decoding row reads its own cache: after 96 tokens, 8 rows read 18 MB of
 * half-float keys and values per pass, which the weight stream has evicted since the
 * last pass; attention then ran about twice as long as on warm caches. Measured on Zen 4
 * (family 25 model 17), the same bits: attention 0.67-0.68x the time at 8 and 16 rows,
 * the pass 0.93-0.96x, batched greedy decoding 1.03-1.04x the tokens/s at B = 8 (64
 * tokens after the bench's prompts; B = 2 within noise). A thread walks the sequences of
 * its thread_range, as the decode rows' attention shares them out (sequence by
 * sequence); the prefetch is a hint, so any other split only costs L2 misses. Single
 * sequences are not walked: their attention is split by heads, and their keys and values
 * are an eighth of B = 8's. */
typedef struct {
    const char *keys, *values;  /* the layer's caches at cache slot 0 */
    const int32_t *seq_start, *seq_slot;
    size_t slot_bytes, group_bytes, row_bytes;  /* a cache slot; a kv group; one position */
    int seq, seq_end, group, kv_heads;
    size_t offset, bytes;  /* within the current group of the current sequence */
    int lines_per_step;
} KvAhead;

static inline void kv_ahead_step(KvAhead *a) {
    if (!a) return;
    for (int n = a->lines_per_step; n > 0 && a->seq < a->seq_end; n--) {
        const size_t at = (size_t)a->seq_slot[a->seq] * a->slot_bytes + a->group * a->group_bytes + a->offset;
        _mm_prefetch(a->keys + at, _MM_HINT_T1);
        _mm_prefetch(a->values + at, _MM_HINT_T1);
        a->offset += 64;
        if (a->offset < a->bytes) continue;
        a->offset = 0;
        if (++a->group < a->kv_heads) continue;
        a->group = 0;
        if (++a->seq < a->seq_end) a->bytes = (size_t)a->seq_start[a->seq] * a->row_bytes;
    }
}

/* This thread's walk over layer `l`'s keys and values, spread over `steps` calls of
 * kv_ahead_step; NULL-equivalent (nothing to walk) when seq == seq_end. */
static KvAhead kv_ahead_plan(const Model *m, int l, int nseq, const int32_t *seq_start,
                             const int32_t *seq_slot, const void *k_cache, const void *v_cache,
                             int64_t slot_floats, int steps) {
    KvAhead a;
    memset(&a, 0, sizeof a);
    if (nseq < 2 || l >= m->num_layers) return a;
    const size_t element = m->kv_f16 ? sizeof(uint16_t) : sizeof(float);
    const size_t layer = (size_t)l * m->kv_heads * m->max_length * m->head_dim * element;
    a.keys = (const char *)k_cache + layer, a.values = (const char *)v_cache + layer;
    a.seq_start = seq_start, a.seq_slot = seq_slot;
    a.slot_bytes = (size_t)slot_floats * element;
    a.group_bytes = (size_t)m->max_length * m->head_dim * element;
    a.row_bytes = (size_t)m->head_dim * element;
    a.kv_heads = m->kv_heads;
    thread_range(nseq, &a.seq, &a.seq_end);
    size_t lines = 0;
    for (int s = a.seq; s < a.seq_end; s++) lines += seq_start[s] * a.row_bytes / 64 * a.kv_heads;
    if (a.seq < a.seq_end) a.bytes = (size_t)seq_start[a.seq] * a.row_bytes;
    a.lines_per_step = (int)((lines + steps - 1) / (steps > 0 ? steps : 1)) + 1;
    return a;
}

/* y[r, o] (+)= x[r] . W[o] + bias[o] for q4 W (blocks as described above): quantizes x
 * into qx, then each thread takes a contiguous range of 8-output panels. Per block (8
 * outputs x 32 inputs) the nibbles unpack once; every token row then adds
 *   d * dx * dot + m * part   (one fp32 lane per (output, row), groups in order)
 * to its accumulator, so a pair's value never depends on the other rows. */
static void linear_q4(const Linear *L, const float *x, int rows, float *y, int ldy, int accumulate,
                      QuantRows *qx, KvAhead *ahead) {
    quantize_rows(x, rows, L->in_features, qx);  /* ends in a barrier */
    const int in = L->in_features, out = L->out_features, groups = in / GROUP;
    const int panels = (out + Q4_PANEL - 1) / Q4_PANEL;
    const size_t panel_bytes = (size_t)groups * Q4_BLOCK_BYTES;
    float acc[ROW_PANEL * 16] __attribute__((aligned(64)));
    int p0, p1;
    thread_range(panels, &p0, &p1);
    for (int c0 = 0; c0 < rows; c0 += ROW_PANEL) {
        const int cn = min_int(ROW_PANEL, rows - c0);
        for (int p = p0; p < p1;) {
            const uint8_t *blocks = (const uint8_t *)L->weight + (size_t)p * panel_bytes;
            int done = 1;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
            if ((cn >= Q4_PANEL16_ROWS || (L->flags & LINEAR_CACHED)) && p + 1 < p1) {
                q4_panel16(blocks, panel_bytes, groups, in, qx, c0, cn, acc);
                done = 2;
            } else
#endif
                q4_panel8(blocks, groups, in, qx, c0, cn, acc, stream_nta(L, cn));
            kv_ahead_step(ahead);
            const int o0 = p * Q4_PANEL, on = min_int(done * Q4_PANEL, out - o0);
            for (int r = 0; r < cn; r++) {
                float *dst = y + (size_t)(c0 + r) * ldy + o0;
                for (int o = 0; o < on; o++) {
                    const float v = acc[r * 16 + o] + (L->bias ? L->bias[o0 + o] : 0.0f);
                    dst[o] = accumulate ? dst[o] + v : v;
                }
            }
            p += done;
        }
    }
#pragma omp barrier
}

/* q8d: int8 weights (one fp32 scale per output row) against int8 activations quantized
 * per 32 inputs (quantize_rows), as llama.cpp runs a Q8_0 output layer: the int4 model's
 * head. Layout: panels of 8 outputs; per group of 32 inputs one 256-byte block of eight
 * 32-byte chunks, chunk j byte 4 * o + t = w[o][4j + t]. Per block, |w| is taken once;
 * each row adds dx * dot (exact integer dot, one fp32 lane per pair, groups in order) and
 * the row scale is applied to the finished sum. */
#define Q8D_BLOCK_BYTES 256

static inline void q8d_panel8(const int8_t *blocks, int groups, int in, const QuantRows *qx,
                              int r0, int rows, float *acc, int nta) {
    for (int r = 0; r < rows; r++) _mm256_store_ps(acc + r * 8, _mm256_setzero_ps());
    for (int g = 0; g < groups; g++) {
        const int8_t *block = blocks + (size_t)g * Q8D_BLOCK_BYTES;
        prefetch_weights(block, Q8D_BLOCK_BYTES, nta);
        __m256i a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(block + 32 * j)));
        for (int r = 0; r < rows; r++) {
            const size_t row = (size_t)(r0 + r);
            const int8_t *xr = qx->q + row * in + g * GROUP;
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                /* |w| * (x with w's sign): each int16 pair <= 2 * 127 * 127, no saturation */
                const __m256i sx = _mm256_sign_epi8(broadcast4(xr + 4 * j),
                                                    _mm256_loadu_si256((const __m256i *)(block + 32 * j)));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                dot = _mm256_dpbusd_epi32(dot, a[j], sx);
#else
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], sx), _mm256_set1_epi16(1)));
#endif
            }
            const __m256 dx = _mm256_set1_ps(qx->scale[row * qx->stride + g]);
            _mm256_store_ps(acc + r * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, _mm256_load_ps(acc + r * 8)));
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* q8d_panel8 for two adjacent panels (16 outputs, one zmm lane each; acc [rows][16]). The
 * VNNI dot takes unsigned bytes on one side: per block the weights become w + 128 (w ^
 * 0x80, in 1..255) once, and each row's dot of them with its activations x, which is
 * sum(w x) + 128 sum(x), drops 128 * sum(x) (QuantRows.sum, exact): the same integer as
 * q8d_panel8's, so the same bits, without a sign step per row. */
#ifndef Q8D_PANEL16_ROWS
/* Measured on Zen 4 (family 25 model 17): with the pair-ahead prefetch (prefetch_two) the
 * head over 3-7 rows takes 0.56-0.96x the time of q8d_panel8's (which had been as fast
 * below 8 rows while the prefetch asked for the other panel's lines), over 2 rows
 * 1.08-1.13x. */
#define Q8D_PANEL16_ROWS 3
#endif
static inline void q8d_panel16(const int8_t *blocks, size_t panel_bytes, int groups, int in,
                               const QuantRows *qx, int r0, int rows, float *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *blocks2 = blocks + panel_bytes;  /* the next panel's */
    const size_t lead = pair_lead(panel_bytes);
    for (int r = 0; r < rows; r++) _mm512_store_ps(acc + r * 16, _mm512_setzero_ps());
    for (int g = 0; g < groups; g++) {
        const int8_t *block = blocks + (size_t)g * Q8D_BLOCK_BYTES;
        const int8_t *block2 = blocks2 + (size_t)g * Q8D_BLOCK_BYTES;
        prefetch_two(block, block2, Q8D_BLOCK_BYTES, lead);
        __m512i u[8];
        for (int j = 0; j < 8; j++) u[j] = _mm512_xor_si512(two_panels(block + 32 * j, block2 + 32 * j), flip);
        for (int r = 0; r < rows; r++) {
            const size_t row = (size_t)(r0 + r), s = row * qx->stride + g;
            const int8_t *xr = qx->q + row * in + g * GROUP;
            const __m512i dot = vnni_dot16(u, xr, _mm512_set1_epi32(-128 * qx->sum[s]));
            const __m512 dx = _mm512_set1_ps(qx->scale[s]);
            _mm512_store_ps(acc + r * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, _mm512_load_ps(acc + r * 16)));
        }
    }
}
#endif

static void linear_q8d(const Linear *L, const float *x, int rows, float *y, int ldy, int accumulate,
                       QuantRows *qx) {
    quantize_rows(x, rows, L->in_features, qx);  /* ends in a barrier */
    const int in = L->in_features, out = L->out_features, groups = in / GROUP;
    const int panels = (out + 7) / 8;
    const size_t panel_bytes = (size_t)groups * Q8D_BLOCK_BYTES;
    float acc[ROW_PANEL * 16] __attribute__((aligned(64)));
    int p0, p1;
    thread_range(panels, &p0, &p1);
    for (int c0 = 0; c0 < rows; c0 += ROW_PANEL) {
        const int cn = min_int(ROW_PANEL, rows - c0);
        for (int p = p0; p < p1;) {
            const int8_t *blocks = (const int8_t *)L->weight + (size_t)p * panel_bytes;
            int done = 1, width = 8;  /* panels done; floats per row of acc */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
            if (cn >= Q8D_PANEL16_ROWS && p + 1 < p1) {
                q8d_panel16(blocks, panel_bytes, groups, in, qx, c0, cn, acc);
                done = 2, width = 16;
            } else
#endif
                q8d_panel8(blocks, groups, in, qx, c0, cn, acc, stream_nta(L, cn));
            const int o0 = p * 8, on = min_int(done * 8, out - o0);
            for (int r = 0; r < cn; r++) {
                float *dst = y + (size_t)(c0 + r) * ldy + o0;
                for (int o = 0; o < on; o++) {
                    const float v = acc[r * width + o] * L->scale[o0 + o] + (L->bias ? L->bias[o0 + o] : 0.0f);
                    dst[o] = accumulate ? dst[o] + v : v;
                }
            }
            p += done;
        }
    }
#pragma omp barrier
}

/* y = x W^T (+ y) in the layer's format; `ahead` (NULL: none) is walked by the int4 loops
 * (KvAhead), the other formats leave it. */
static void linear_ahead(const Linear *L, const float *x, int rows, float *y, int ldy,
                         int accumulate, QuantRows *qx, KvAhead *ahead) {
    switch (L->format) {
    case FMT_F32: linear_float(L, FMT_F32, x, rows, y, ldy, accumulate); break;
    case FMT_BF16: linear_float(L, FMT_BF16, x, rows, y, ldy, accumulate); break;
    case FMT_Q8: linear_float(L, FMT_Q8, x, rows, y, ldy, accumulate); break;
    case FMT_Q8D: linear_q8d(L, x, rows, y, ldy, accumulate, qx); break;
    default: linear_q4(L, x, rows, y, ldy, accumulate, qx, ahead); break;
    }
}

static void linear(const Linear *L, const float *x, int rows, float *y, int ldy, int accumulate,
                   QuantRows *qx) {
    linear_ahead(L, x, rows, y, ldy, accumulate, qx, NULL);
}

/* ---- elementwise ------------------------------------------------------------------ */

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight for rows of n floats, rows shared
 * among threads; row r of x starts at x + r * ldx, of out at out + r * ldo. */
static void rms_norm_strided(const float *x, int64_t ldx, const float *weight, int rows, int n,
                             float eps, float *out, int ldo) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * ldx;
        float *yr = out + (size_t)r * ldo;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(hsum8(acc) / (float)n + eps);
        const __m256 s = _mm256_set1_ps(inv);
        for (int i = 0; i < n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), s);
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
        }
    }
}

static void rms_norm_rows(const float *x, const float *weight, int rows, int n, float eps,
                          float *out, int ldo) {
    rms_norm_strided(x, n, weight, rows, n, eps, out, ldo);
}

static void rms_norm(const float *x, const float *weight, int rows, int n, float eps, float *out) {
    rms_norm_rows(x, weight, rows, n, eps, out, n);
}

/* act[r] = silu(gate[r]) * up[r]; gate_up rows are [gate | up], each `inter` wide. */
static void silu_mul(const float *gate_up, int rows, int inter, float *act) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter;
        const float *u = g + inter;
        float *a = act + (size_t)r * inter;
        for (int i = 0; i < inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

/* ---- the KV cache ---------------------------------------------------------------- */
/* A cache holds float32 values, or IEEE half floats (Model.kv_f16): a key or value is
 * rounded to half once, to nearest even (F16C's vcvtps2ph, torch's float -> half), when it
 * is stored, and widened exactly when attention reads it, so every reader sees the same
 * value. Half the bytes: attention streams a sequence's whole cache every step, which at
 * a 1,000-token context costs as much as the int4 weights. Pointers to a cache are void;
 * offsets count elements. The functions that read a cache take `f16` as a constant
 * (always inlined from a dispatch on m->kv_f16), so each element type gets its own loops. */
/* fn(args..., f16) with f16 the cache's element type as a constant (1: half floats), so
 * that each type gets its own inlined loops; the same branch on every thread. */
#define KV_TYPED(m, fn, ...) ((m)->kv_f16 ? fn(__VA_ARGS__, 1) : fn(__VA_ARGS__, 0))

static inline __attribute__((always_inline)) void *kv_at(void *cache, size_t elements, int f16) {
    return (char *)cache + elements * (f16 ? sizeof(uint16_t) : sizeof(float));
}

static inline __attribute__((always_inline)) const void *kv_at_c(const void *cache, size_t elements,
                                                                 int f16) {
    return (const char *)cache + elements * (f16 ? sizeof(uint16_t) : sizeof(float));
}

/* 8 cache elements from element i, as floats */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *cache, size_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)))
               : _mm256_loadu_ps((const float *)cache + i);
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 kv_load16(const void *cache, size_t i, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i)))
               : _mm512_loadu_ps((const float *)cache + i);
}
#define KV_LOADV kv_load16
#else
#define KV_LOADV kv_load8
#endif

/* n floats (a multiple of 8) into a cache at element i */
static inline void kv_store(void *cache, size_t i, const float *x, int n, int f16) {
    if (!f16) {
        memcpy((float *)cache + i, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *to = (uint16_t *)cache + i;
    for (int j = 0; j < n; j += 8)
        _mm_storeu_si128((__m128i *)(to + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
}

/* x[0..n) = x * rsqrt(mean(x^2) + eps) * weight in place: one row of rms_norm_strided's
 * arithmetic (the same lanes, sums and rounding). */
static inline void rms_norm_in_place(float *x, const float *weight, int n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 s = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)n + eps));
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
        _mm256_storeu_ps(x + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
    }
}

/* Rotate interleaved pairs of q and k heads at each row's position; store k, v in cache. */
/* The per-head query and key norms where the layer has them (qk_norm: see Layer), RoPE on
 * one row's queries and keys (at `position`), then its keys and values into cache slot
 * `slot` of k_cache / v_cache ([kv_heads, max_length, head_dim]). */
static void rope_and_store_row(const Model *m, const float *qk_norm, float *row,
                               int64_t position, size_t slot, void *k_cache, void *v_cache) {
    const int d = m->head_dim, half = d / 2, heads = m->heads, kv = m->kv_heads;
    const float *c = m->cos + (size_t)position * half;
    const float *s = m->sin + (size_t)position * half;
    for (int h = 0; h < heads + kv; h++) {
        float *x = row + h * d;
        if (qk_norm)
            rms_norm_in_place(x, qk_norm + (h < heads ? 0 : d), d, m->eps);
        for (int i = 0; i < half; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c[i] - b * s[i];
            x[2 * i + 1] = a * s[i] + b * c[i];
        }
    }
    for (int g = 0; g < kv; g++) {
        const size_t at = ((size_t)g * m->max_length + slot) * d;
        kv_store(k_cache, at, row + (heads + g) * d, d, m->kv_f16);
        kv_store(v_cache, at, row + (heads + kv + g) * d, d, m->kv_f16);
    }
}

/* Attention in three passes over a tile of up to ATT_ROWS rows of one sequence; each pass
 * splits its work among the threads and ends in a barrier:
 *   scores   for every (kv group, chunk of ATT_SLOTS slots): the chunk's keys are read from
 *            memory once and dotted with the queries of all the group's heads for all the
 *            tile's rows (then from L1), four slots side by side (eight in the AVX-512
 *            build);
 *   softmax  for every (head, row) pair: max over the visible slots, exp;
 *   values   for every (kv group, 32 dimensions (64 in the AVX-512 build), block of
 *            VALUE_PAIRS pairs): each value row is read once for all the block's pairs,
 *            their sums held in registers, and each pair's total of weights summed on the
 *            way.
 * A single causal row (a decode step) takes one head per work item instead, the three steps
 * in a row, with no barrier between them (attention_row).
 * A (head, row) pair computes exactly what it would alone: its score for a slot is the same
 * two-chain dot folded by hsum8, its softmax covers its visible slots in slot order (exp is
 * lane-wise), and each output lane is one FMA chain over the visible slots in slot order. So
 * the tile, the thread count and the other rows never change a pair's bits, while keys and
 * values are read once per group and tile instead of once per (head, row). The AVX-512
 * build runs the same lanes 16 to a vector: a score's two 8-lane chains are the two halves
 * of one 16-lane chain, and two value vectors one; the same bits for half the instructions
 * (a 5-token pass of the default model at a 1,024-token context: 0.84x the time). Row r sees
 * cache slots [0, start) and new slot start + j iff mask[r, j] (causal when mask is NULL). */
#define ATT_ROWS 16   /* rows of a sequence that share one sweep over its keys and values */
#define ATT_SLOTS 64  /* slots per work item of the score pass */

static inline int att_rows(int rows) { return rows < ATT_ROWS ? rows : ATT_ROWS; }

/* Floats of attention scratch for up to `rows` rows: a [heads * tile rows, max_length] row of
 * scores (then weights) per pair. */
static int64_t attention_floats(const Model *m, int rows) {
    return (int64_t)m->heads * att_rows(rows) * m->max_length;
}

/* The cache slots a new row r of a sequence sees: every slot before `base`; then, without
 * a mask, those up to its own (base is then the sequence's start: causal), else slot s iff
 * mask[r * cols + (s - base)]. A sequence's mask covers its new rows (base = start, cols =
 * rows) or, for a head drafting a tree over its own cache, also cached slots from `base`
 * on (cols = start + rows - base): nodes of earlier expansions that only their
 * descendants see. */
typedef struct {
    int base, cols;
    const uint8_t *mask;
} Visible;

static inline Visible causal(int start) {
    const Visible v = {start, 0, NULL};
    return v;
}

static inline int slot_visible(int s, int r, Visible v) {
    return s < v.base ? 1 : (v.mask ? v.mask[r * v.cols + (s - v.base)] : s - v.base <= r);
}

/* The slots [0, end) row r sees, every one of them: those before `base`, and for a causal
 * row (no mask) the new slots up to its own too. A prefill (base 0) sees its whole prefix,
 * so the vector loops below, which test nothing, cover it instead of the per-slot tests. */
static inline int visible_prefix(int r, Visible v) {
    return v.mask ? v.base : v.base + r + 1;
}

/* The value pass's vectors: 16 lanes in the AVX-512 build, 8 in the AVX2 one. Each lane
 * runs the same operations either way, so both builds give the same bits. */
#if defined(__AVX512F__)
#define VLANES 16
#define VV(op) _mm512_##op
typedef __m512 vvec;
#else
#define VLANES 8
#define VV(op) _mm256_##op
typedef __m256 vvec;
#endif

/* Pairs per block of a tile's value pass: each block's NP * NV sums, its NV value vectors
 * and NP totals should fit the vector registers. The AVX-512 build's 32 hold 3 pairs of 4
 * vectors; AVX2's 16 hold 2 pairs of 4 (3 spilled two sums and the totals to the stack,
 * each slot then waiting on a store and a reload: 0.94-0.98x the time of k = 3-16 passes
 * after 1,024 tokens with 2, the same bits). */
#define VALUE_PAIRS (VLANES == 16 ? 3 : 2)

/* The value pass for NP <= 3 pairs p0 .. p0 + NP - 1 of the tile (all of one kv group) and
 * output dimensions j .. j + VLANES * NV - 1: out lane = (sum over the pair's visible slots
 * in order of w[s] * v[s, lane]) / total, total = the sum of those w[s] in slot order (the
 * scalar chains run beside the FMAs). The NP * NV sums are independent FMA chains, enough
 * to hide the FMA latency. */
static inline __attribute__((always_inline)) void attention_values(
    int NP, int NV, const Model *m, int p0, int tile_rows, int r0, int n, Visible vis,
    const void *values, int j, const float *weights, int wp0, float *out, int f16) {
    const int d = m->head_dim, heads = m->heads;
    const float *w = weights + (size_t)(p0 - wp0) * m->max_length;  /* pair p0 + v: w + v * stride */
    const size_t stride = (size_t)m->max_length;
    int row[3];
    float total[3];
    vvec acc[3][8];
    for (int v = 0; v < NP; v++) {
        row[v] = r0 + (p0 + v) % tile_rows;
        total[v] = 0.0f;
        for (int c = 0; c < NV; c++) acc[v][c] = VV(set1_ps)(0.0f);
    }
    /* the slots every pair sees (no visibility test in this loop) */
    int cached = n;
    for (int v = 0; v < NP; v++) {
        const int seen = visible_prefix(row[v], vis);
        cached = seen < cached ? seen : cached;
    }
    size_t value = (size_t)j;  /* element of slot s's values, dimension j */
    for (int s = 0; s < cached; s++, value += d) {
        vvec vals[8];
        for (int c = 0; c < NV; c++) vals[c] = KV_LOADV(values, value + VLANES * c, f16);
        for (int v = 0; v < NP; v++) {
            const float x = w[v * stride + s];
            total[v] += x;
            const vvec weight = VV(set1_ps)(x);
            for (int c = 0; c < NV; c++) acc[v][c] = VV(fmadd_ps)(weight, vals[c], acc[v][c]);
        }
    }
    /* the others: each pair sees those its row may attend to */
    for (int s = cached; s < n; s++, value += d) {
        vvec vals[8];
        for (int c = 0; c < NV; c++) vals[c] = KV_LOADV(values, value + VLANES * c, f16);
        for (int v = 0; v < NP; v++) {
            if (!slot_visible(s, row[v], vis)) continue;
            const float x = w[v * stride + s];
            total[v] += x;
            const vvec weight = VV(set1_ps)(x);
            for (int c = 0; c < NV; c++) acc[v][c] = VV(fmadd_ps)(weight, vals[c], acc[v][c]);
        }
    }
    for (int v = 0; v < NP; v++) {
        const int h = (p0 + v) / tile_rows;
        const vvec inv = VV(set1_ps)(1.0f / total[v]);
        float *o = out + (size_t)row[v] * heads * d + h * d + j;
        for (int c = 0; c < NV; c++) VV(storeu_ps)(o + VLANES * c, VV(mul_ps)(acc[v][c], inv));
    }
}

/* One pair's scores for slots s0 .. s1 - 1 (keys: slot s's key at keys + s * d), written to
 * w[s]: each the same two-chain dot as the pair alone would take (a0 over dimensions j, a1
 * over j + 8, j = 0, 16, ...), folded by hsum8. Four slots run side by side, sharing each
 * query load, so that eight independent FMA chains hide the FMA latency, over the slots
 * the row sees without a test (visible_prefix); the rest one by one. Slots the pair
 * cannot see get 0, never read. */
static inline __attribute__((always_inline)) void attention_scores(
    const float *q, const void *keys, int d, int s0, int s1, int r, Visible vis, float *w,
    int f16) {
    int s = s0;
    const int seen = visible_prefix(r, vis);  /* slots before it need no visibility test */
#if defined(__AVX512F__)
    /* eight slots side by side, one zmm chain each: lanes 0-7 of a chain are a0's, lanes
     * 8-15 a1's (the same FMAs in the same order), so the same bits */
    for (; s + 8 <= s1 && s + 8 <= seen; s += 8) {
        __m512 a[8];
        for (int t = 0; t < 8; t++) a[t] = _mm512_setzero_ps();
        for (int j = 0; j < d; j += 16) {
            const __m512 qz = _mm512_loadu_ps(q + j);
            for (int t = 0; t < 8; t++)
                a[t] = _mm512_fmadd_ps(qz, kv_load16(keys, (size_t)(s + t) * d + j, f16), a[t]);
        }
        __m256 h[8];
        for (int t = 0; t < 8; t++)  /* a0 + a1: the low and high halves (AVX-512 F alone) */
            h[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[t]), 1)));
        _mm_storeu_ps(w + s, hsum8x4(h[0], h[1], h[2], h[3]));
        _mm_storeu_ps(w + s + 4, hsum8x4(h[4], h[5], h[6], h[7]));
    }
#endif
    for (; s + 4 <= s1 && s + 4 <= seen; s += 4) {
        __m256 a0[4], a1[4];
        for (int t = 0; t < 4; t++) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int j = 0; j < d; j += 16) {
            const __m256 q0 = _mm256_loadu_ps(q + j), q1 = _mm256_loadu_ps(q + j + 8);
            for (int t = 0; t < 4; t++) {
                const size_t key = (size_t)(s + t) * d + j;
                a0[t] = _mm256_fmadd_ps(q0, kv_load8(keys, key, f16), a0[t]);
                a1[t] = _mm256_fmadd_ps(q1, kv_load8(keys, key + 8, f16), a1[t]);
            }
        }
        _mm_storeu_ps(w + s, hsum8x4(_mm256_add_ps(a0[0], a1[0]), _mm256_add_ps(a0[1], a1[1]),
                                     _mm256_add_ps(a0[2], a1[2]), _mm256_add_ps(a0[3], a1[3])));
    }
    for (; s < s1; s++) {
        if (!slot_visible(s, r, vis)) {
            w[s] = 0.0f;
            continue;
        }
        const size_t key = (size_t)s * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int j = 0; j < d; j += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), kv_load8(keys, key + j, f16), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), kv_load8(keys, key + j + 8, f16), a1);
        }
        w[s] = hsum8(_mm256_add_ps(a0, a1));
    }
}

/* One pair's scores w[0 .. n) (row r) into unnormalized softmax weights, in place: the max
 * over the visible slots (8 lanes at a time over the cache, where every slot is visible;
 * max is exact, so the order does not matter), w - max and exp (lane-wise) on them. The
 * value pass sums the weights, in slot order, as it goes. */
static inline void attention_weights(float *w, int n, int r, Visible vis) {
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    int s = 0;
    const int seen = visible_prefix(r, vis) < n ? visible_prefix(r, vis) : n;
    for (; s + 8 <= seen; s += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(w + s), lanes);
    float spread[8], top = -INFINITY;
    _mm256_storeu_ps(spread, lanes);
    for (int i = 0; i < 8; i++) top = spread[i] > top ? spread[i] : top;
    for (; s < n; s++)
        if (slot_visible(s, r, vis)) top = w[s] > top ? w[s] : top;
    const __m256 shift = _mm256_set1_ps(top);
    for (s = 0; s + 8 <= seen; s += 8) _mm256_storeu_ps(w + s, _mm256_sub_ps(_mm256_loadu_ps(w + s), shift));
    for (; s < n; s++)
        if (slot_visible(s, r, vis)) w[s] -= top;
    exp_inplace(w, n);  /* lane-wise: the invisible slots' values are never read */
}

/* Single-row attention (a decode step): one head per work item, no barrier inside (the
 * tile passes would add two per layer); the same per-pair arithmetic as the tile passes. */
/* Vectors (VLANES floats) of output dimensions per value block of a tile: 64 dimensions
 * in the AVX-512 build where the head allows, else 32 or 16. */
static inline int value_vectors(int d) {
    const int dims = VLANES == 16 && d % 64 == 0 ? 64 : d % 32 ? 16 : 32;
    return dims / VLANES;
}

/* attention_values for np (1..3) pairs and nv (value_vectors) vectors of a tile, each
 * shape compiled with its own constants (the value pass of attention() and of
 * attention_tile_group; inlined into both, so each keeps the code it had). */
static inline __attribute__((always_inline)) void tile_values(int np, int nv, const Model *m, int p0, int tile_rows, int r0, int n,
                        Visible vis, const void *values, int j, const float *weights, int wp0,
                        float *out, int f16) {
    switch (np * 8 + nv) {
#define VALUES(NP, NV) attention_values(NP, NV, m, p0, tile_rows, r0, n, vis, values, j, \
                                        weights, wp0, out, f16)
    case 3 * 8 + 4: VALUES(3, 4); break;
    case 2 * 8 + 4: VALUES(2, 4); break;
    case 1 * 8 + 4: VALUES(1, 4); break;
    case 3 * 8 + 2: VALUES(3, 2); break;
    case 2 * 8 + 2: VALUES(2, 2); break;
    case 1 * 8 + 2: VALUES(1, 2); break;
    case 3 * 8 + 1: VALUES(3, 1); break;
    case 2 * 8 + 1: VALUES(2, 1); break;
    default: VALUES(1, 1); break;
#undef VALUES
    }
}

/* Head h of a single causal row (queries qkv, cache slots 0 .. start, the row's own
 * included): w, a row of max_length floats, holds its weights. */
static inline __attribute__((always_inline)) void attention_head_kv(
    const Model *m, const float *qkv, int start, const void *k_cache, const void *v_cache,
    float *out, int h, float *w, int f16) {
    const int d = m->head_dim, group = m->heads / m->kv_heads, n = start + 1;
    const size_t kv_offset = (size_t)(h / group) * m->max_length * d;
    attention_scores(qkv + h * d, kv_at_c(k_cache, kv_offset, f16), d, 0, n, 0, causal(start), w,
                     f16);
    attention_weights(w, n, 0, causal(start));
    for (int j = 0; j < d; j += 64) {  /* head_dim is a multiple of 16 */
        const void *values = kv_at_c(v_cache, kv_offset, f16);
        /* as pair 0 of a one-row tile: weights at w, output at out + h * d */
        switch (min_int(64, d - j) / VLANES) {
#define VALUES(NV) attention_values(1, NV, m, 0, 1, 0, n, causal(start), values, j, w, 0, out + h * d, f16)
        case 8: VALUES(8); break;
        case 6: VALUES(6); break;
        case 4: VALUES(4); break;
        case 3: VALUES(3); break;
        case 2: VALUES(2); break;
        default: VALUES(1); break;
#undef VALUES
        }
    }
}

static void attention_head(const Model *m, const float *qkv, int start, const void *k_cache,
                           const void *v_cache, float *out, int h, float *w) {
    KV_TYPED(m, attention_head_kv, m, qkv, start, k_cache, v_cache, out, h, w);
}

#if defined(__AVX512F__)
/* Scores of G heads of one kv group (queries q, head after head) for slots 0 .. n - 1 of
 * its keys, four slots at a time: each key is widened once for the G heads. Each
 * (head, slot) is the same zmm chain over the dimensions, from zero, and the same fold
 * as attention_scores' eight-slot loop, so the same bits. Returns the slots done (the
 * rest, fewer than 4, are the caller's). */
static inline __attribute__((always_inline)) int group_scores(int G, const float *q,
                                                              const void *keys, int d, int n,
                                                              float *w, size_t stride, int f16) {
    int s = 0;
    for (; s + 4 <= n; s += 4) {
        __m512 acc[4][4];  /* [head][slot] */
        for (int h = 0; h < G; h++)
            for (int t = 0; t < 4; t++) acc[h][t] = _mm512_setzero_ps();
        for (int j = 0; j < d; j += 16) {
            __m512 key[4];
            for (int t = 0; t < 4; t++) key[t] = kv_load16(keys, (size_t)(s + t) * d + j, f16);
            for (int h = 0; h < G; h++) {
                const __m512 qh = _mm512_loadu_ps(q + (size_t)h * d + j);
                for (int t = 0; t < 4; t++) acc[h][t] = _mm512_fmadd_ps(qh, key[t], acc[h][t]);
            }
        }
        for (int h = 0; h < G; h++) {
            __m256 half[4];
            for (int t = 0; t < 4; t++)  /* a0 + a1: the low and high halves */
                half[t] = _mm256_add_ps(_mm512_castps512_ps256(acc[h][t]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][t]), 1)));
            _mm_storeu_ps(w + h * stride + s, hsum8x4(half[0], half[1], half[2], half[3]));
        }
    }
    return s;
}

/* Kv group g of a single causal row (a decode step of a batch row: queries qkv, cache
 * slots 0 .. start) in one work item: its heads' scores (each key widened once for up
 * to 4 heads, group_scores), each head's softmax, then one value pass for VALUE_PAIRS
 * heads at a time (each value widened once for them). w holds one row of max_length
 * floats per head of the group. Each (head, row) pair computes what attention_head
 * computes, bit for bit. Measured on Zen 4 (family 25 model 17) against one item per
 * head: attention 0.70-0.82x the time for 8 rows after 96 tokens; the pass 0.95-0.98x at
 * B = 2-16 after 96 tokens and 0.90-0.95x at B = 4-8 after 300 (logits torch.equal).
 * AVX-512 only: the AVX2 build keeps one item per head (DECODE_BY_GROUP), since the same
 * grouping there (values two heads at a time, scores per head) made B = 2 and 8 passes
 * after 300 tokens 1.07-1.11x slower on that machine. */
static inline __attribute__((always_inline)) void attention_group_kv(
    const Model *m, const float *qkv, int start, const void *k_cache, const void *v_cache,
    float *out, int g, float *w, int f16) {
    const int d = m->head_dim, group = m->heads / m->kv_heads, n = start + 1;
    const size_t kv_offset = (size_t)g * m->max_length * d, stride = (size_t)m->max_length;
    const void *keys = kv_at_c(k_cache, kv_offset, f16);
    const float *q = qkv + (size_t)g * group * d;
    int fused = 0;  /* slots whose scores are done for every head of the group */
    switch (d % 16 ? 0 : group) {
    case 1: fused = group_scores(1, q, keys, d, n, w, stride, f16); break;
    case 2: fused = group_scores(2, q, keys, d, n, w, stride, f16); break;
    case 3: fused = group_scores(3, q, keys, d, n, w, stride, f16); break;
    case 4: fused = group_scores(4, q, keys, d, n, w, stride, f16); break;
    default: break;
    }
    for (int h = 0; h < group; h++) {
        float *wh = w + h * stride;
        if (fused < n)
            attention_scores(q + (size_t)h * d, keys, d, fused, n, 0, causal(start), wh, f16);
        attention_weights(wh, n, 0, causal(start));
    }
    const void *values = kv_at_c(v_cache, kv_offset, f16);
    const int nv = value_vectors(d);
    for (int j = 0; j < d; j += VLANES * nv)
        for (int p = 0; p < group; p += VALUE_PAIRS) {
            const int p0 = g * group + p;  /* as pairs p0.. of a one-row tile: heads p0.. */
            tile_values(min_int(VALUE_PAIRS, group - p), nv, m, p0, 1, 0, n, causal(start),
                        values, j, w + p * stride, p0, out, f16);
        }
}

static void attention_group(const Model *m, const float *qkv, int start, const void *k_cache,
                            const void *v_cache, float *out, int g, float *w) {
    KV_TYPED(m, attention_group_kv, m, qkv, start, k_cache, v_cache, out, g, w);
}
#endif

static void attention_row(const Model *m, const float *qkv, int start, const void *k_cache,
                          const void *v_cache, float *out, float *scratch) {
#pragma omp for schedule(static)
    for (int h = 0; h < m->heads; h++)
        attention_head(m, qkv, start, k_cache, v_cache, out, h, scratch + (size_t)h * m->max_length);
}

/* The visibility of slots s0.. renumbered from 0 (the same slots seen). */
static inline Visible visible_from(Visible v, int s0) {
    v.base -= s0;
    return v;
}

/* Keys of slots [s0, s1) of one kv group (keys: the group's first slot), as float32
 * scores read them: a float32 cache's own (at `keys` + s0 * d), or a half-float cache's
 * widened into `buffer` (ATT_SLOTS slots: a chunk's keys are read by every pair of the
 * tile, up to 3 * ATT_ROWS of them, so they are converted once, not once per pair). */
static inline const float *chunk_keys(const void *keys, int d, int s0, int s1, int f16,
                                      float *buffer) {
    if (!f16) return (const float *)keys + (size_t)s0 * d;
    const size_t first = (size_t)s0 * d;
    for (int i = 0; i < (s1 - s0) * d; i += 8)  /* head_dim is a multiple of 16 */
        _mm256_storeu_ps(buffer + i, kv_load8(keys, first + i, 1));
    return buffer;
}

/* One pair's scores over the chunk of slots [s0, s1) (see attention_scores), its keys
 * from chunk_keys. */
static inline void chunk_scores(const float *q, const float *chunk, int d, int s0, int s1, int r,
                                Visible vis, float *w) {
    attention_scores(q, chunk, d, 0, s1 - s0, r, visible_from(vis, s0), w + s0, 0);
}

/* Floats of the per-thread chunk buffers of a half-float cache (none for float32). */
static int64_t chunk_buffer_floats(const Model *m, int threads) {
    return m->kv_f16 ? (int64_t)threads * ATT_SLOTS * m->head_dim : 0;
}

/* The three passes of attention() for one kv group g of a sequence of rows <= ATT_ROWS
 * rows, one after another in one work item: the same attention_scores calls (chunk by
 * chunk of ATT_SLOTS slots), attention_weights and attention_values blocks as the passes
 * make for this group, so every pair gets the same bits. w holds the group's group * rows
 * weight rows (max_length floats each). */
static inline __attribute__((always_inline)) void attention_tile_group_kv(
    const Model *m, const float *qkv, int rows, int start, Visible vis, const void *k_cache,
    const void *v_cache, float *out, int g, float *w, float *buffer, int f16) {
    const int d = m->head_dim, heads = m->heads, kv = m->kv_heads, group = heads / kv;
    const int width = (heads + 2 * kv) * d, R = rows, group_pairs = group * R;
    const size_t stride = (size_t)m->max_length;
    const int n = start + R, first = g * group_pairs;
    const void *keys = kv_at_c(k_cache, (size_t)g * stride * d, f16);
    const void *values = kv_at_c(v_cache, (size_t)g * stride * d, f16);
    for (int s0 = 0; s0 < n; s0 += ATT_SLOTS) {
        const int s1 = min_int(n, s0 + ATT_SLOTS);
        const float *chunk = chunk_keys(keys, d, s0, s1, f16, buffer);
        for (int p = first; p < first + group_pairs; p++)
            chunk_scores(qkv + (size_t)(p % R) * width + p / R * d, chunk, d, s0, s1, p % R, vis,
                         w + (size_t)(p - first) * stride);
    }
    for (int p = first; p < first + group_pairs; p++)
        attention_weights(w + (size_t)(p - first) * stride, n, p % R, vis);
    const int nv = value_vectors(d);
    for (int j = 0; j < d; j += VLANES * nv)
        for (int p0 = first; p0 < first + group_pairs; p0 += VALUE_PAIRS) {
            tile_values(min_int(VALUE_PAIRS, first + group_pairs - p0), nv, m, p0, R, 0, n, vis,
                        values, j, w, first, out, f16);
        }
}

/* buffer: this thread's chunk buffer (chunk_buffer_floats) */
static void attention_tile_group(const Model *m, const float *qkv, int rows, int start,
                                 Visible vis, const void *k_cache, const void *v_cache,
                                 float *out, int g, float *w, float *buffer) {
    KV_TYPED(m, attention_tile_group_kv, m, qkv, rows, start, vis, k_cache, v_cache, out, g, w,
             buffer);
}

/* attention() for one cache element type (below). */
static inline __attribute__((always_inline)) void attention_kv(
    const Model *m, const float *qkv, int rows, int start, Visible vis, const void *k_cache,
    const void *v_cache, float *out, float *scratch, float *buffer, int f16) {
    const int d = m->head_dim, heads = m->heads, kv = m->kv_heads, group = heads / kv;
    const int width = (heads + 2 * kv) * d;
    const size_t stride = (size_t)m->max_length;
    for (int r0 = 0; r0 < rows; r0 += ATT_ROWS) {
        const int R = min_int(ATT_ROWS, rows - r0), pairs = heads * R, group_pairs = group * R;
        /* slots any row of the tile may see: causal rows stop at their own */
        const int n = vis.mask ? start + rows : start + r0 + R;
        float *weights = scratch;
        const int chunks = (n + ATT_SLOTS - 1) / ATT_SLOTS;
#pragma omp for schedule(static)
        for (int item = 0; item < kv * chunks; item++) {
            const int g = item / chunks, s0 = item % chunks * ATT_SLOTS;
            const int s1 = min_int(n, s0 + ATT_SLOTS);
            const float *chunk =
                chunk_keys(kv_at_c(k_cache, (size_t)g * stride * d, f16), d, s0, s1, f16, buffer);
            for (int p = g * group_pairs; p < (g + 1) * group_pairs; p++) {
                const int r = r0 + p % R;
                chunk_scores(qkv + (size_t)r * width + p / R * d, chunk, d, s0, s1, r, vis,
                             weights + p * stride);
            }
        }
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++)
            attention_weights(weights + p * stride, n, r0 + p % R, vis);
        /* items: (kv group, value_vectors(d) vectors of dimensions, block of VALUE_PAIRS pairs) */
        const int nv = value_vectors(d), blocks = (group_pairs + VALUE_PAIRS - 1) / VALUE_PAIRS;
        const int dims = d / (VLANES * nv);
#pragma omp for schedule(static)
        for (int item = 0; item < kv * dims * blocks; item++) {
            const int g = item / (dims * blocks), j = (item / blocks) % dims * VLANES * nv;
            const int p0 = g * group_pairs + item % blocks * VALUE_PAIRS;
            const void *values = kv_at_c(v_cache, (size_t)g * stride * d, f16);
            tile_values(min_int(VALUE_PAIRS, (g + 1) * group_pairs - p0), nv, m, p0, R, r0, n,
                        vis, values, j, weights, 0, out, f16);
        }
    }
}

/* Attention of every (row, head) of one sequence (see above); scratch: attention_floats;
 * buffer: this thread's chunk buffer (chunk_buffer_floats). */
static void attention(const Model *m, const float *qkv, int rows, int start, Visible vis,
                      const void *k_cache, const void *v_cache, float *out, float *scratch,
                      float *buffer) {
    if (rows == 1 && !vis.mask)
        attention_row(m, qkv, start, k_cache, v_cache, out, scratch);
    else  /* the loops inside share work among the threads */
        KV_TYPED(m, attention_kv, m, qkv, rows, start, vis, k_cache, v_cache, out, scratch, buffer);
}

/* ---- the forward ------------------------------------------------------------------ */

/* Floats of work memory spec_forward needs for `rows` tokens and `threads` threads. */
static int64_t widest_input(const Model *m) {
    int64_t widest = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    return widest > m->heads * m->head_dim ? widest : m->heads * m->head_dim;
}

int64_t spec_work_floats(const Model *m, int rows, int threads) {
    const int64_t d = m->head_dim, width = (m->heads + 2 * m->kv_heads) * d;
    int64_t per_row = m->hidden + width + m->heads * d + 3 * (int64_t)m->intermediate;
    per_row += widest_input(m) / 4 + QUANT_ARRAYS * padded_groups(widest_input(m));  /* QuantRows */
    per_row += 2 * (int64_t)threads;  /* row_argmax's per-thread candidates */
    return rows * per_row + attention_floats(m, rows) + chunk_buffer_floats(m, threads);
}

/* argmax[r] = the first index of row r's largest logit, as numpy's and torch's argmax
 * give it, or -1 when the row holds a NaN (the caller then takes its own). Inside the
 * parallel region, after the logits are complete: each thread scans its share of every
 * row (8 lanes, a lane keeps its first maximum), `found` [rows, threads] collects the
 * shares' (value, index) and one thread takes the largest value, the lowest index among
 * equals. Ends in a barrier. */
static void row_argmax(const float *logits, int rows, int vocab, int32_t *argmax, float *found) {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int begin = (int)((int64_t)vocab * t / threads);
    const int end = (int)((int64_t)vocab * (t + 1) / threads);
    for (int r = 0; r < rows; r++) {
        const float *row = logits + (size_t)r * vocab;
        __m256 best = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        __m256i at = _mm256_set1_epi32(begin), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        index = _mm256_add_epi32(index, _mm256_set1_epi32(begin));
        int i = begin;
        for (; i + 8 <= end; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, v, greater);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at),
                                                      _mm256_castsi256_ps(index), greater));
            index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
        }
        float lane_best[8], value = -INFINITY;
        int32_t lane_at[8], position = begin < end ? begin : -1;
        _mm256_storeu_ps(lane_best, best);
        _mm256_storeu_si256((__m256i *)lane_at, at);
        int nan = _mm256_movemask_ps(unordered) != 0;
        for (int lane = 0; lane < 8 && i > begin; lane++)  /* lanes that saw a value */
            if (lane_best[lane] > value || (lane_best[lane] == value && lane_at[lane] < position)) {
                value = lane_best[lane];
                position = lane_at[lane];
            }
        for (; i < end; i++) {
            if (row[i] > value) {
                value = row[i];
                position = i;
            }
            nan |= row[i] != row[i];
        }
        found[(size_t)r * 2 * threads + 2 * t] = nan ? NAN : value;
        memcpy(found + (size_t)r * 2 * threads + 2 * t + 1, &position, sizeof(position));
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float value = -INFINITY;
        int32_t position = -1;
        for (int u = 0; u < threads; u++) {
            const float v = found[(size_t)r * 2 * threads + 2 * u];
            int32_t p;
            memcpy(&p, found + (size_t)r * 2 * threads + 2 * u + 1, sizeof(p));
            if (v != v) {  /* a NaN in this share */
                position = -1;
                break;
            }
            if (p >= 0 && (position < 0 || v > value)) {
                value = v;
                position = p;
            }
        }
        argmax[r] = position;
    }
}

/* The query and key norms (qk_norm: the layer's, or NULL), RoPE and the cache store for
 * every row of the batch in one work-sharing loop (row r
 * belongs to the sequence whose rows cover it; k_cache / v_cache: this layer's part of cache
 * slot 0, slot s at + seq_slot[s] * slot_floats). Ends in a barrier. */
static void rope_and_store_batch(const Model *m, const float *qk_norm, float *qkv, int nseq,
                                 const int32_t *seq_rows, const int32_t *seq_start,
                                 const int32_t *seq_slot, const int64_t *positions,
                                 void *k_cache, void *v_cache, int64_t slot_floats, int rows) {
    const int width = (m->heads + 2 * m->kv_heads) * m->head_dim;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        int s = 0, r0 = 0;
        while (r >= r0 + seq_rows[s]) r0 += seq_rows[s++];
        const size_t cache = (size_t)seq_slot[s] * slot_floats;
        rope_and_store_row(m, qk_norm, qkv + (size_t)r * width, positions[r],
                           (size_t)(seq_start[s] + r - r0), kv_at(k_cache, cache, m->kv_f16),
                           kv_at(v_cache, cache, m->kv_f16));
    }
}

/* Attention of every sequence of the batch (cache as for rope_and_store_batch). Where
 * several sequences decode one causal row, or several bring a tile of up to ATT_ROWS rows
 * (verification), they share one work-sharing loop: one item per (sequence, kv group)
 * of a decode row (attention_group; per (sequence, head) in the AVX2 build,
 * attention_head) and of a tile (attention_tile_group), each on weight rows of its
 * thread's. B sequences then cost one barrier instead of B (decode rows) or 3 B (tiles).
 * The other sequences run attention() one after another. A pair's arithmetic is the same
 * either way. */
/* Decode rows' work items: one per kv group (attention_group) in the AVX-512 build, one
 * per head (attention_head) in the AVX2 one. */
#if defined(__AVX512F__)
#define DECODE_BY_GROUP 1
#else
#define DECODE_BY_GROUP 0
#endif

static int shares_head_loop(const int32_t *seq_rows, const int64_t *mask_offset, int s) {
    return seq_rows[s] == 1 && mask_offset[s] < 0;
}

/* What sequence s's new rows see: causal after its start, or its mask (over its new rows,
 * or from seq_mask_base[s] on when that is given). */
static Visible seq_visible(const int32_t *seq_rows, const int32_t *seq_start,
                           const uint8_t *masks, const int64_t *mask_offset,
                           const int32_t *seq_mask_base, int s) {
    if (mask_offset[s] < 0) return causal(seq_start[s]);
    const int base = seq_mask_base ? seq_mask_base[s] : seq_start[s];
    const Visible v = {base, seq_start[s] + seq_rows[s] - base, masks + mask_offset[s]};
    return v;
}

static void attention_batch(const Model *m, const float *qkv, int nseq, const int32_t *seq_rows,
                            const int32_t *seq_start, const int32_t *seq_slot,
                            const uint8_t *masks, const int64_t *mask_offset,
                            const int32_t *seq_mask_base, const void *k_cache,
                            const void *v_cache, int64_t slot_floats, float *attn,
                            float *scratch, float *chunk_buffers, int rows) {
    const int d = m->head_dim, heads = m->heads, kv = m->kv_heads, group = heads / kv;
    const int width = (heads + 2 * kv) * d;
    /* this thread's chunk buffer (a half-float cache's keys, widened; see chunk_keys) */
    float *buffer = chunk_buffers + (size_t)omp_get_thread_num() * ATT_SLOTS * d;
    int single = 0, tiles = 0, widest = 1;
    for (int s = 0; s < nseq; s++) {
        if (shares_head_loop(seq_rows, mask_offset, s))
            single++;
        else if (seq_rows[s] <= ATT_ROWS) {
            tiles++;
            widest = seq_rows[s] > widest ? seq_rows[s] : widest;
        }
    }
    /* scratch holds heads * att_rows(rows) weight rows; each thread needs `own` of them */
    const int decode_items = DECODE_BY_GROUP ? kv : heads;  /* per decode row */
    const int decode_rows = DECODE_BY_GROUP ? group : 1;   /* weight rows an item uses */
    const int own = tiles > 1 ? group * widest : decode_rows,
              fits = omp_get_num_threads() * own <= heads * att_rows(rows);
    const int share_single = fits && single > 1, share_tiles = fits && tiles > 1;
    if (share_single || share_tiles) {
        const int items = (share_single ? single * decode_items : 0) + (share_tiles ? tiles * kv : 0);
        float *w = scratch + (size_t)omp_get_thread_num() * own * m->max_length;
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            int s = 0, r0 = 0, left = item;
            for (;; r0 += seq_rows[s++]) {  /* the item's sequence */
                const int one = shares_head_loop(seq_rows, mask_offset, s);
                const int here = one ? (share_single ? decode_items : 0)
                                     : (share_tiles && seq_rows[s] <= ATT_ROWS ? kv : 0);
                if (left < here) break;
                left -= here;
            }
            const size_t cache = (size_t)seq_slot[s] * slot_floats;
            const float *q = qkv + (size_t)r0 * width;
            float *out = attn + (size_t)r0 * heads * d;
            const void *keys = kv_at_c(k_cache, cache, m->kv_f16);
            const void *values = kv_at_c(v_cache, cache, m->kv_f16);
            if (shares_head_loop(seq_rows, mask_offset, s))
#if DECODE_BY_GROUP
                attention_group(m, q, seq_start[s], keys, values, out, left, w);
#else
                attention_head(m, q, seq_start[s], keys, values, out, left, w);
#endif
            else
                attention_tile_group(m, q, seq_rows[s], seq_start[s],
                                     seq_visible(seq_rows, seq_start, masks, mask_offset,
                                                 seq_mask_base, s),
                                     keys, values, out, left, w, buffer);
        }
    }
    for (int s = 0, r0 = 0; s < nseq; r0 += seq_rows[s], s++) {
        const int one = shares_head_loop(seq_rows, mask_offset, s);
        if (one ? share_single : share_tiles && seq_rows[s] <= ATT_ROWS) continue;
        const size_t cache = (size_t)seq_slot[s] * slot_floats;
        const Visible vis = seq_visible(seq_rows, seq_start, masks, mask_offset, seq_mask_base, s);
        attention(m, qkv + (size_t)r0 * width, seq_rows[s], seq_start[s], vis,
                  kv_at_c(k_cache, cache, m->kv_f16), kv_at_c(v_cache, cache, m->kv_f16),
                  attn + (size_t)r0 * heads * d, scratch, buffer);
    }
}

/* The rows whose logits are wanted (sequence s: its rows from seq_logits_from[s] on),
 * copied in order to the front of `to`. One thread copies (a few rows of `width` floats)
 * and the rest wait. */
static void gather_wanted(const float *x, int width, int nseq, const int32_t *seq_rows,
                          const int32_t *seq_logits_from, float *to) {
#pragma omp single
    {
        int out = 0;
        for (int s = 0, r0 = 0; s < nseq; r0 += seq_rows[s], s++)
            for (int r = seq_logits_from[s]; r < seq_rows[s]; r++, out++)
                memcpy(to + (size_t)out * width, x + (size_t)(r0 + r) * width,
                       (size_t)width * sizeof(float));
    }  /* implicit barrier */
}

/* The residual stream after layer l ([rows, H]) into its place in m->layer_out: the
 * layers below l whose bits are set come first. Rows are split over the threads; the
 * barrier after the loop orders the copy before the next layer's writes. */
static void copy_layer_out(const Model *m, int l, const float *hidden, int rows) {
    const int H = m->hidden;
    const int before = __builtin_popcountll(m->layer_mask & ((1ULL << l) - 1));
    float *to = m->layer_out + (size_t)before * rows * H;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        memcpy(to + (size_t)r * H, hidden + (size_t)r * H, (size_t)H * sizeof(float));
}

/* Append the new tokens of `nseq` sequences in one pass: every linear layer runs once
 * over all rows of all sequences (one weight stream for the whole batch); RoPE, the cache
 * store and attention run per sequence with its own start, positions, mask and cache slot
 * (RoPE for all rows in one loop, the attention of all one-row decode steps in another).
 * A row's arithmetic does not depend on the other rows (see the header), so each
 * sequence's logits are bitwise those of a call with that sequence alone.
 * hidden: [rows, hidden] input embeddings of all sequences (sequence s owns seq_rows[s]
 * consecutive rows), updated in place: it ends holding the features (the final residual
 * stream after the final norm; without one, the residual stream); positions: [rows];
 * sequence s appends at cache slots seq_start[s].. of cache slot seq_slot[s], whose
 * layers start at k_cache + seq_slot[s] * slot_floats ([layers, kv_heads, max_length,
 * head_dim] each); mask_offset[s] < 0: causal, else masks + mask_offset[s] holds its
 * [seq_rows[s], seq_rows[s]] uint8 mask (1 = may attend); seq_logits_from: NULL (every
 * row's logits) or, per sequence, its first row whose logits are wanted (a prompt's
 * prefill wants none or its last: the output head, a fifth of a row's work at the default
 * model's shapes, runs only over the rows asked for); logits: [rows asked for, vocab], in
 * row order, and argmax likewise. */
static void forward_batch(const Model *m, float *hidden, int nseq, const int32_t *seq_rows,
                          const int32_t *seq_start, const int32_t *seq_slot,
                          const int64_t *positions, const uint8_t *masks,
                          const int64_t *mask_offset, const int32_t *seq_mask_base,
                          const int32_t *seq_logits_from, void *k_cache, void *v_cache,
                          int64_t slot_floats, float *logits, int32_t *argmax, float *work,
                          int threads) {
    const int H = m->hidden, d = m->head_dim, inter = m->intermediate;
    const int width = (m->heads + 2 * m->kv_heads) * d;
    const size_t layer_cache = (size_t)m->kv_heads * m->max_length * d;
    int rows = 0;
    for (int s = 0; s < nseq; s++) rows += seq_rows[s];
    float *normed = work;
    float *qkv = normed + (size_t)rows * H;
    float *attn = qkv + (size_t)rows * width;
    float *gate_up = attn + (size_t)rows * m->heads * d;
    float *act = gate_up + (size_t)rows * 2 * inter;
    float *scratch = act + (size_t)rows * inter;
    const int64_t widest = widest_input(m);
    float *quant = scratch + attention_floats(m, rows);
    const int64_t groups = padded_groups(widest);
    QuantRows qx = quant_rows_at(quant, rows, widest);
    float *found = (float *)qx.sum + rows * groups;  /* row_argmax */
    /* a half-float cache's per-thread chunk buffers: the last chunk_buffer_floats of work */
    float *chunk_buffers = work + spec_work_floats(m, rows, threads) - chunk_buffer_floats(m, threads);
#pragma omp parallel num_threads(threads)
    {
        double clock = m->op_seconds ? omp_get_wtime() : 0.0;  /* op_clock's, thread 0's */
        for (int l = 0; l < m->num_layers; l++) {
            const Layer *L = &m->layers[l];
            rms_norm(hidden, L->input_norm, rows, H, m->eps, normed);
            op_clock(m, OP_NORM, &clock);
            linear(&L->qkv, normed, rows, qkv, width, 0, &qx);
            op_clock(m, OP_QKV, &clock);
            void *keys = kv_at(k_cache, l * layer_cache, m->kv_f16);
            void *values = kv_at(v_cache, l * layer_cache, m->kv_f16);
            rope_and_store_batch(m, L->qk_norm, qkv, nseq, seq_rows, seq_start, seq_slot,
                                 positions, keys, values, slot_floats, rows);
            op_clock(m, OP_ROPE, &clock);
            attention_batch(m, qkv, nseq, seq_rows, seq_start, seq_slot, masks, mask_offset,
                            seq_mask_base, keys, values, slot_floats, attn, scratch, chunk_buffers,
                            rows);
            op_clock(m, OP_ATTENTION, &clock);
            linear(&L->o, attn, rows, hidden, H, 1, &qx);
            op_clock(m, OP_O, &clock);
            rms_norm(hidden, L->post_norm, rows, H, m->eps, normed);
            op_clock(m, OP_NORM, &clock);
            /* the next layer's keys and values, fetched during this one's MLP (KvAhead):
             * a step per int4 panel pair of gate/up and down, this thread's share */
            const int threads_now = omp_get_num_threads();
            const int steps = ((2 * inter + H) / (2 * Q4_PANEL) + threads_now - 1) / threads_now *
                              ((rows + ROW_PANEL - 1) / ROW_PANEL);
            KvAhead next = kv_ahead_plan(m, l + 1, nseq, seq_start, seq_slot, k_cache, v_cache,
                                         slot_floats, steps);
            KvAhead *ahead = next.seq < next.seq_end ? &next : NULL;
            linear_ahead(&L->gate_up, normed, rows, gate_up, 2 * inter, 0, &qx, ahead);
            op_clock(m, OP_GATE_UP, &clock);
            silu_mul(gate_up, rows, inter, act);
            op_clock(m, OP_ACT, &clock);
            linear_ahead(&L->down, act, rows, hidden, H, 1, &qx, ahead);
            op_clock(m, OP_DOWN, &clock);
            if (m->layer_out && (m->layer_mask >> l & 1)) copy_layer_out(m, l, hidden, rows);
        }
        /* The features: the final norm in place, so the caller's buffer ends holding them
         * and no norm runs after the pass (its first torch op would run on caches this
         * pass left cold: ~80 us). final_norm NULL: the head reads the residual stream
         * itself (a drafting head's layer, whose output feature goes to its output rows). */
        if (m->final_norm) rms_norm_rows(hidden, m->final_norm, rows, H, m->eps, hidden, H);
        op_clock(m, OP_NORM, &clock);
        const float *head_input = hidden;
        int out = rows;
        if (seq_logits_from) {
            out = 0;
            for (int s = 0; s < nseq; s++) out += seq_rows[s] - seq_logits_from[s];
        }
        if (out < rows) {
            gather_wanted(hidden, H, nseq, seq_rows, seq_logits_from, normed);
            head_input = normed;
        }
        if (out > 0) {
            linear(&m->lm_head, head_input, out, logits, m->vocab, 0, &qx);
            if (argmax) row_argmax(logits, out, m->vocab, argmax, found);
        }
        op_clock(m, OP_HEAD, &clock);
    }
}

void spec_forward_batch(const Model *m, float *hidden, int nseq, const int32_t *seq_rows,
                        const int32_t *seq_start, const int32_t *seq_slot,
                        const int64_t *positions, const uint8_t *masks,
                        const int64_t *mask_offset, const int32_t *seq_logits_from,
                        void *k_cache, void *v_cache, int64_t slot_floats, float *logits,
                        int32_t *argmax, float *work, int threads) {
    forward_batch(m, hidden, nseq, seq_rows, seq_start, seq_slot, positions, masks, mask_offset,
                  NULL, seq_logits_from, k_cache, v_cache, slot_floats, logits, argmax, work,
                  threads);
}

/* Append `rows` tokens of one sequence at cache slots start..start+rows-1: a batch of one.
 * hidden: [rows, hidden] input embeddings, updated in place into the features (as above);
 * positions: [rows] RoPE positions; mask: NULL (causal) or [rows, start + rows - mask_base]
 * uint8 (1 = may attend) over cache slots mask_base .. start + rows - 1, the slots before
 * mask_base seen by every row (mask_base = start: a mask among the new rows alone; less: a
 * drafting head's tree, whose earlier nodes only their descendants see);
 * k_cache, v_cache: [layers, kv_heads, max_length, head_dim]; logits: [rows, vocab]. */
void spec_forward(const Model *m, float *hidden, int rows, int start, const int64_t *positions,
                  const uint8_t *mask, int mask_base, void *k_cache, void *v_cache,
                  float *logits, float *work, int threads) {
    const int32_t seq_rows = rows, seq_start = start, seq_slot = 0, base = mask_base;
    const int64_t mask_offset = mask ? 0 : -1;
    forward_batch(m, hidden, 1, &seq_rows, &seq_start, &seq_slot, positions, mask,
                  &mask_offset, &base, NULL, k_cache, v_cache, 0, logits, NULL, work, threads);
}

/* ---- one linear layer on its own (tests and microbenchmarks) -------------------- */

/* Floats of work memory spec_linear needs for `rows` rows of `in` inputs. */
int64_t spec_linear_work_floats(int rows, int in) {
    return (int64_t)rows * (in / 4 + QUANT_ARRAYS * padded_groups(in));
}

/* y [rows, out] = x [rows, in] . W^T (* scale) + bias, on `threads` threads: exactly the
 * computation a layer of the forward does. */
void spec_linear(const Linear *L, const float *x, int rows, float *y, float *work, int threads) {
    const int in = L->in_features;
    QuantRows qx = quant_rows_at(work, rows, in);
#pragma omp parallel num_threads(threads)
    linear(L, x, rows, y, L->out_features, 0, &qx);
}

/* Floats of work memory spec_fused_linear needs for `rows` rows of `in` inputs. */
int64_t spec_fused_linear_work_floats(int rows, int in) {
    return (int64_t)rows * in + spec_linear_work_floats(rows, in);
}

/* y [rows, out] = W . [rms_norm(a[r]) * a_weight | rms_norm(b[r]) * b_weight] for each row
 * r, a and b [rows, in / 2] (an EAGLE head's fusion of a token embedding and a feature):
 * both norms and the layer in one parallel region on `threads` threads. */
void spec_fused_linear(const Linear *L, const float *a, const float *a_weight, const float *b,
                       const float *b_weight, float eps, int rows, float *y, float *work,
                       int threads) {
    const int in = L->in_features, half = in / 2;
    float *fused = work;
    float *rest = work + (size_t)rows * in;
    QuantRows qx = quant_rows_at(rest, rows, in);
#pragma omp parallel num_threads(threads)
    {
        rms_norm_rows(a, a_weight, rows, half, eps, fused, in);
        rms_norm_rows(b, b_weight, rows, half, eps, fused + half, in); /* ends in a barrier */
        linear(L, fused, rows, y, L->out_features, 0, &qx);
    }
}

/* y [rows, out] = W . [rms_norm(x[r], part 0) * weights[0] | ... | part n - 1's] for each
 * row r: x's rows, `ldx` floats apart, hold the n = `parts` parts of in / n floats side by
 * side (an EAGLE-3 head's fusion of the target's layer states; weights [n, in / n]): the
 * norms and the layer in one parallel region on `threads` threads. Work: as
 * spec_fused_linear_work_floats(rows, in). */
void spec_parts_linear(const Linear *L, const float *x, int64_t ldx, const float *weights,
                       int parts, float eps, int rows, float *y, float *work, int threads) {
    const int in = L->in_features, width = in / parts;
    float *fused = work;
    QuantRows qx = quant_rows_at(work + (size_t)rows * in, rows, in);
#pragma omp parallel num_threads(threads)
    {
        for (int p = 0; p < parts; p++)  /* each ends in a barrier */
            rms_norm_strided(x + (size_t)p * width, ldx, weights + (size_t)p * width, rows, width,
                             eps, fused + (size_t)p * width, in);
        linear(L, fused, rows, y, L->out_features, 0, &qx);
    }
}

/* ---- roofline microbenchmarks (speculative profile) ------------------------------ */

/* Peak fp32 multiply-adds per second on `threads` threads: 12 independent FMA chains per
 * thread (8 lanes; 16 in the AVX-512 build, as its float tiles), `iterations` rounds. */
double spec_peak_fma(int threads, int64_t iterations) {
    double started = 0.0, elapsed = 0.0;
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
#if defined(__AVX512F__)
#define PEAK_VEC __m512  /* the float tiles of this build are zmm */
#define PEAK_LANES 16
#define PEAK_SET1 _mm512_set1_ps
#define PEAK_FMA _mm512_fmadd_ps
#define PEAK_ADD _mm512_add_ps
#define PEAK_SUM(v) _mm512_reduce_add_ps(v)
#else
#define PEAK_VEC __m256
#define PEAK_LANES 8
#define PEAK_SET1 _mm256_set1_ps
#define PEAK_FMA _mm256_fmadd_ps
#define PEAK_ADD _mm256_add_ps
#define PEAK_SUM(v) hsum8(v)
#endif
        PEAK_VEC acc[12];
        const PEAK_VEC a = PEAK_SET1(0.999999f), b = PEAK_SET1(1e-7f);
        for (int j = 0; j < 12; j++) acc[j] = PEAK_SET1((float)j);
#pragma omp barrier
#pragma omp master
        started = omp_get_wtime();
        for (int64_t n = 0; n < iterations; n++)
            for (int j = 0; j < 12; j++) acc[j] = PEAK_FMA(acc[j], a, b);
#pragma omp barrier
#pragma omp master
        elapsed = omp_get_wtime() - started;
        PEAK_VEC s = acc[0];
        for (int j = 1; j < 12; j++) s = PEAK_ADD(s, acc[j]);
        sink += PEAK_SUM(s);
    }
    if (sink == 12345.0f) elapsed += 1e-12;  /* keep the loop alive */
    return (double)threads * (double)iterations * 12.0 * PEAK_LANES / elapsed;
}

/* Peak int8 multiply-adds per second of the q4 kernel's integer dot (q4_dot8: maddubs +
 * int16 adds on AVX2; the AVX-512 build: zmm vpdpbusd as in q4_panel16), 8 independent
 * 256-MAC dots per round. */
double spec_peak_int8(int threads, int64_t iterations) {
    double started = 0.0, elapsed = 0.0;
    int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m256i u[8], acc[8];
        int8_t x[8 * 32];  /* dot j reads its own 32 activations: no common subexpressions */
        for (int j = 0; j < 8 * 32; j++) x[j] = (int8_t)(j % 61 - 30);
        for (int j = 0; j < 8; j++) {
            u[j] = _mm256_set1_epi8((char)(j + 1));
            acc[j] = _mm256_setzero_si256();
        }
#pragma omp barrier
#pragma omp master
        started = omp_get_wtime();
        for (int64_t n = 0; n < iterations; n++) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
            /* this build's q4 tiles: 16 outputs per zmm VNNI dot (q4_panel16) */
            for (int j = 0; j < 8; j += 2) {
                __m512i dot = _mm512_setzero_si512();
                const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(u[j]), u[j + 1], 1);
                for (int i = 0; i < 8; i++) {
                    int32_t four;
                    memcpy(&four, x + 32 * j + 4 * i, 4);
                    dot = _mm512_dpbusd_epi32(dot, w, _mm512_set1_epi32(four));
                }
                acc[j] = _mm256_add_epi32(acc[j], _mm512_castsi512_si256(dot));
                acc[j + 1] = _mm256_add_epi32(acc[j + 1], _mm512_extracti64x4_epi64(dot, 1));
            }
#else
            for (int j = 0; j < 8; j++) acc[j] = _mm256_add_epi32(acc[j], q4_dot8(u, x + 32 * j));
#endif
            x[n & 255] ^= 1;  /* a different dot each round */
        }
#pragma omp barrier
#pragma omp master
        elapsed = omp_get_wtime() - started;
        __m256i s = acc[0];
        for (int j = 1; j < 8; j++) s = _mm256_add_epi32(s, acc[j]);
        sink += _mm256_extract_epi32(s, 0);
    }
    if (sink == 12345) elapsed += 1e-12;
    return (double)threads * (double)iterations * 8.0 * 256.0 / elapsed;
}

/* Bytes per second read from `n` floats at `buffer` by `threads` threads (contiguous
 * shares, summed so the reads happen). */
double spec_read_bandwidth(const float *buffer, int64_t n, int threads) {
    double started = 0.0, elapsed = 0.0;
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t begin = n * t / T / 32 * 32, end = n * (t + 1) / T / 32 * 32;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma omp barrier
#pragma omp master
        started = omp_get_wtime();
        for (int64_t i = begin; i < end; i += 32)
            for (int j = 0; j < 4; j++) acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(buffer + i + 8 * j));
#pragma omp barrier
#pragma omp master
        elapsed = omp_get_wtime() - started;
        sink += hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    }
    if (sink == 12345.0f) elapsed += 1e-12;
    return (double)(n / 32 * 32) * 4.0 / elapsed;
}

/* ---------------------------------------------------------------- the top-p nucleus */

#define NUCLEUS_MAX 4096                   /* members beyond this: the caller's own path */
#define NUCLEUS_STEP 4.1588830833596715    /* ln 64: each widening admits 64x less likely */
#define NUCLEUS_DEPTH 33.271064666877372   /* 8 widenings: e^-33 of the top, never searched */
#define NUCLEUS_BUCKETS_PER_NAT 8.0f       /* the cut's search sorts one such bucket only */
#define NUCLEUS_BUCKETS 272                /* > NUCLEUS_DEPTH * NUCLEUS_BUCKETS_PER_NAT */
/* Tail terms below e^-80 of the top count as e^-80: 49k of them are < 1e-30 of the sum,
 * and exp8 would return denormals for them, which cost tens of cycles each (at T = 0.1 the
 * partition pass took 4x as long). */
#define NUCLEUS_UNDERFLOW -80.0f

/* A candidate: a token at most a few widening steps below the top. */
typedef struct {
    float x;     /* the tempered logit */
    int32_t id;  /* its token */
    double w;    /* exp(x - top) */
} NucleusEntry;

static int nucleus_descending(const void *a, const void *b) {
    const NucleusEntry *u = a, *v = b;
    if (u->x != v->x) return u->x > v->x ? -1 : 1;
    return u->id < v->id ? -1 : 1;
}

/* Eight logits from j on, or one, of a row of float32 or of bf16 (the upper half of a
 * float32). */
static inline __attribute__((always_inline)) __m256 logits8(const void *row, int bf16, int64_t j) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + j);
    const __m256i v =
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline __attribute__((always_inline)) float logit_at(const void *row, int bf16, int64_t j) {
    if (!bf16) return ((const float *)row)[j];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[j] << 16;
    float x;
    memcpy(&x, &bits, sizeof(x));
    return x;
}

/* The largest of a row's n logits (NaN when any is NaN). */
static inline __attribute__((always_inline)) float row_largest(const void *row, int bf16,
                                                               int64_t n) {
    __m256 high = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = logits8(row, bf16, i);
        high = _mm256_max_ps(high, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float highs[8], hi = -INFINITY;
    _mm256_storeu_ps(highs, high);
    for (int lane = 0; lane < 8; lane++) hi = highs[lane] > hi ? highs[lane] : hi;
    int bad = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        const float x = logit_at(row, bf16, i);
        bad |= x != x;
        hi = x > hi ? x : hi;
    }
    return bad ? NAN : hi;
}

/* The largest of n logits (NaN when any is NaN). Dividing by a temperature > 0 is
 * monotone under rounding (a <= b gives a / t <= b / t), so the largest tempered logit is
 * the largest logit's quotient: no pass writes the tempered row, each divides as it
 * reads. */
static float nucleus_largest(const float *logits, int64_t n) { return row_largest(logits, 0, n); }

/* A tempered logit's bucket: how many eighths of a nat it lies below the top m. A larger
 * logit never lands in a later bucket (each step is monotone), and equal ones share one. */
static inline int nucleus_bucket(float x, float m) {
    const int b = (int)((m - x) * NUCLEUS_BUCKETS_PER_NAT);
    return b < NUCLEUS_BUCKETS - 1 ? b : NUCLEUS_BUCKETS - 1;
}

#define NUCLEUS_BLOCK 8  /* vectors summed in float32 before a float64 add */

/* Append (x, id, w) to `out` while it holds fewer than `cap` entries; count it either way. */
static inline void nucleus_keep(NucleusEntry *out, int64_t cap, int64_t *count, float x,
                                int64_t id, double w) {
    if (*count < cap) {
        out[*count].x = x;
        out[*count].id = (int32_t)id;
        out[*count].w = w;
    }
    (*count)++;
}

/* NV (1 or NUCLEUS_BLOCK) vectors of the partition from entry i on, their exps side by
 * side: adds each vector's tail terms to *block in order, ors the non-finite test into
 * *bad and keeps the candidates in id order. */
static inline __attribute__((always_inline)) void nucleus_vectors(
    const float *logits, int64_t i, int64_t base, const int NV, float t, float m, float floor,
    __m256 *block, __m256 *bad, NucleusEntry *out, int64_t cap, int64_t *count) {
    const __m256 top = _mm256_set1_ps(m), bound = _mm256_set1_ps(floor);
    const __m256 temperature = _mm256_set1_ps(t);
    const __m256 limit = _mm256_set1_ps(3.0e38f), sign = _mm256_set1_ps(-0.0f);
    __m256 value[NUCLEUS_BLOCK], above[NUCLEUS_BLOCK], e[NUCLEUS_BLOCK];
    int any = 0;
    for (int v = 0; v < NV; v++) {
        value[v] = _mm256_div_ps(_mm256_loadu_ps(logits + i + 8 * v), temperature);
        /* NaN fails the ordered compare; an infinity exceeds the limit; so does a value
         * above m, where the caller's largest was not the largest */
        *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, value[v]), limit,
                                                _CMP_NLE_UQ));
        *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(value[v], top, _CMP_GT_OQ));
        above[v] = _mm256_cmp_ps(value[v], bound, _CMP_GE_OQ);
        any |= _mm256_movemask_ps(above[v]);
        /* value <= m: the difference is in range once raised to the underflow bound */
        e[v] = _mm256_max_ps(_mm256_sub_ps(value[v], top), _mm256_set1_ps(NUCLEUS_UNDERFLOW));
    }
    exp8_in_range_n(e, NV);
    for (int v = 0; v < NV; v++) *block = _mm256_add_ps(*block, _mm256_andnot_ps(above[v], e[v]));
    if (!any) return;
    for (int v = 0; v < NV; v++) {
        float x[8];
        _mm256_storeu_ps(x, value[v]);
        for (int bits = _mm256_movemask_ps(above[v]); bits; bits &= bits - 1) {
            const int lane = __builtin_ctz(bits);
            nucleus_keep(out, cap, count, x[lane], base + i + 8 * v + lane, 0.0);
        }
    }
}

/* With x[i] = logits[i] / t (float32 division, as torch divides): the sum over the
 * entries with x < floor of exp(x - m), by exp8 (float32 within blocks of NUCLEUS_BLOCK
 * vectors, float64 across), and the others, in id order, into `out` (at most cap; their
 * number in *gathered, cap + 1 for more) with w unset: the caller adds their terms
 * exactly. Entry i of the row is token base + i. */
static double nucleus_partition(const float *logits, int64_t n, int64_t base, float t, float m,
                                float floor, NucleusEntry *out, int64_t cap,
                                int64_t *gathered) {
    __m256 bad = _mm256_setzero_ps();
    double rest = 0.0;
    int64_t count = 0, i = 0;
    while (i + 8 <= n) {
        __m256 block = _mm256_setzero_ps();
        if (i + 8 * NUCLEUS_BLOCK <= n) {
            nucleus_vectors(logits, i, base, NUCLEUS_BLOCK, t, m, floor, &block, &bad, out, cap,
                            &count);
            i += 8 * NUCLEUS_BLOCK;
        } else
            for (; i + 8 <= n; i += 8)
                nucleus_vectors(logits, i, base, 1, t, m, floor, &block, &bad, out, cap, &count);
        float lanes[8];
        _mm256_storeu_ps(lanes, block);
        for (int lane = 0; lane < 8; lane++) rest += lanes[lane];
    }
    int nonfinite = _mm256_movemask_ps(bad) != 0;
    for (; i < n; i++) {
        const float x = logits[i] / t;
        nonfinite |= !(fabsf(x) <= 3.0e38f) || x > m;
        if (x < floor) rest += exp((double)x - (double)m);
        else nucleus_keep(out, cap, &count, x, base + i, 0.0);
    }
    *gathered = count > cap ? cap + 1 : count;
    return nonfinite ? NAN : rest;
}

/* nucleus_partition of the whole row as two halves, split at a multiple of 64 entries near
 * the middle: where a forward on two threads splits the LM head's outputs, so that each
 * half is read by the core that wrote it, on `threads` (1 or 2) threads. The sum is the
 * first half's plus the second's, the candidates the first's then the second's: the same
 * whatever the thread count. (Two threads read a row the forward has just written in
 * 0.6x the time of one on Zen 2.) Needs cap >= n. */
static double nucleus_partition_halves(const float *logits, int64_t n, float t, float m,
                                       float floor, NucleusEntry *out, int threads,
                                       int64_t *gathered) {
    const int64_t split = n / 2 / 64 * 64;
    double rest[2];
    int64_t count[2];
#pragma omp parallel for num_threads(2) schedule(static) if (threads > 1)
    for (int h = 0; h < 2; h++) {
        const int64_t from = h ? split : 0, to = h ? n : split;
        rest[h] = nucleus_partition(logits + from, to - from, from, t, m, floor, out + from,
                                    to - from, &count[h]);
    }
    memmove(out + count[0], out + split, (size_t)count[1] * sizeof(NucleusEntry));
    *gathered = count[0] + count[1];
    return rest[0] + rest[1];
}

/* Appends the entries with lower <= x < upper (x[i] = logits[i] / t) to `out` (already
 * holding `count`, at most cap in all), with w the same float32 polynomial term the
 * partition's tail summed them by, each added to its bucket's mass; returns the new count
 * (cap + 1 for more). */
static int64_t nucleus_band(const float *logits, int64_t n, float t, float m, float lower,
                            float upper, NucleusEntry *out, int64_t count, int64_t cap,
                            double *mass) {
    const __m256 top = _mm256_set1_ps(m), low = _mm256_set1_ps(lower);
    const __m256 high = _mm256_set1_ps(upper), temperature = _mm256_set1_ps(t);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 value = _mm256_div_ps(_mm256_loadu_ps(logits + i), temperature);
        const int mask = _mm256_movemask_ps(_mm256_and_ps(
            _mm256_cmp_ps(value, low, _CMP_GE_OQ), _mm256_cmp_ps(value, high, _CMP_LT_OQ)));
        if (!mask) continue;
        float e[8], x[8];
        _mm256_storeu_ps(e, exp8(_mm256_sub_ps(value, top)));
        _mm256_storeu_ps(x, value);
        for (int bits = mask; bits; bits &= bits - 1) {
            const int lane = __builtin_ctz(bits);
            nucleus_keep(out, cap, &count, x[lane], i + lane, e[lane]);
            mass[nucleus_bucket(x[lane], m)] += e[lane];
        }
    }
    for (; i < n; i++) {
        const float x = logits[i] / t;
        if (x >= lower && x < upper) {
            const double w = exp((double)x - (double)m);
            nucleus_keep(out, cap, &count, x, i, w);
            mass[nucleus_bucket(x, m)] += w;
        }
    }
    return count > cap ? cap + 1 : count;
}

static int nucleus_by_id(const void *a, const void *b) {
    const NucleusEntry *u = a, *v = b;
    return u->id < v->id ? -1 : u->id > v->id;
}

/* The members (the `count` entries with x >= bound: every token that high is an entry) to
 * the front of `entries`, in increasing id order; returns how many there are. */
static int64_t nucleus_members(NucleusEntry *entries, int64_t count, float bound) {
    int64_t members = 0;
    for (int64_t j = 0; j < count; j++)
        if (entries[j].x >= bound) {
            const NucleusEntry e = entries[members];
            entries[members++] = entries[j];
            entries[j] = e;
        }
    qsort(entries, (size_t)members, sizeof(NucleusEntry), nucleus_by_id);
    return members;
}

/* The top-p nucleus of softmax(logits / temperature) for one row of n logits, as the
 * sampling layer cuts it (sampling/probs.py, _row_nucleus, on float64 probabilities): in
 * descending order, member j is kept while the mass before it is below top_p, and every
 * token as probable as the last member is kept too. Writes the members' ids to `kept` in
 * increasing order and their probabilities to `probs` (the nucleus renormalized as the
 * sampling layer does it, _renormalized: exp(x - max) by libm, summed in id order in
 * float64, divided and rounded to float32) and returns their number; `entries` [cap] is
 * scratch (cap = n never runs out; then the partition runs on `threads`, at most 2).
 *
 * One pass over the row (the partition, dividing by the temperature as it reads) where
 * `largest` gives the index of its largest logit (the forward's fused argmax: a row with
 * no NaN, its first largest entry), two where it is -1; one more where the candidates
 * must widen. No full sort: the candidates (the tokens down to a floor, widened 64x at a time until
 * they hold top_p) have their masses summed in buckets an eighth of a nat wide, whose
 * order is the descending order's; only the bucket where the running mass reaches top_p is
 * sorted. The masses sum float64 terms, exact (libm) within two widening steps of the top,
 * over a partition function whose tail (the tokens further down) comes from a float32
 * polynomial, as do the terms of the candidates a widening adds: within about 1e-7 of the
 * sampling layer's masses, relatively. So the cut is certain, and the same as the sampling
 * layer's, unless the mass before or through the cut lies within `margin` of top_p, or a
 * token's tempered logit lies less than `gap` below the last member's: then, and for a row
 * with a NaN or infinity or a nucleus of more than max_kept (<= NUCLEUS_MAX) members, it
 * returns -1 and the caller takes its own path. */
int32_t spec_nucleus(const float *logits, int64_t n, int64_t largest, float temperature,
                     double top_p, double margin, float gap, int32_t *kept, float *probs,
                     int32_t max_kept, NucleusEntry *entries, int64_t cap, int threads) {
    if (n <= 0 || largest >= n || !(temperature > 0.0f) || max_kept < 1 ||
        max_kept > NUCLEUS_MAX || cap < 1)
        return -1;
    /* the largest logit: where the forward's fused argmax found it, else one pass */
    const float m = (largest >= 0 ? logits[largest] : nucleus_largest(logits, n)) / temperature;
    if (!(fabsf(m) <= 3.0e38f)) return -1;  /* NaN or inf (the partition checks the rest) */
    /* the first candidates come with the partition pass, two widening steps deep (the
     * median nucleus of SmolLM2's rows at T = 0.8, top_p = 0.95 is 5 tokens, the 90th
     * percentile 67, of a median 28 and a 90th percentile 239 within two steps) */
    double depth = 2 * NUCLEUS_STEP, mass[NUCLEUS_BUCKETS] = {0.0}, held = 0.0;
    float floor = (float)((double)m - depth);
    int64_t count;
    double z = cap >= n ? nucleus_partition_halves(logits, n, temperature, m, floor, entries,
                                                   threads, &count)
                        : nucleus_partition(logits, n, 0, temperature, m, floor, entries, cap,
                                            &count);
    if (count > cap || z != z) return -1;
    for (int64_t j = 0; j < count; j++) {
        entries[j].w = exp((double)entries[j].x - (double)m);
        z += entries[j].w;
        mass[nucleus_bucket(entries[j].x, m)] += entries[j].w;
    }
    for (int b = 0; b < NUCLEUS_BUCKETS; b++) held += mass[b];
    while (held / z < top_p) {  /* the candidates hold less than top_p: widen */
        depth += NUCLEUS_STEP;
        if (depth > NUCLEUS_DEPTH) return -1;
        const float lower = (float)((double)m - depth);
        count = nucleus_band(logits, n, temperature, m, lower, floor, entries, count, cap,
                             mass);
        if (count > cap) return -1;
        floor = lower;
        held = 0.0;
        for (int b = 0; b < NUCLEUS_BUCKETS; b++) held += mass[b];
    }
    /* the bucket where the running mass reaches top_p, and the mass of those above it */
    int cut_bucket = 0;
    double above = 0.0;
    while (cut_bucket < NUCLEUS_BUCKETS - 1 && (above + mass[cut_bucket]) / z < top_p)
        above += mass[cut_bucket++];
    /* its entries to the front, sorted descending, and the walk through them */
    int64_t in_bucket = 0;
    for (int64_t j = 0; j < count; j++)
        if (nucleus_bucket(entries[j].x, m) == cut_bucket) {
            const NucleusEntry e = entries[in_bucket];
            entries[in_bucket++] = entries[j];
            entries[j] = e;
        }
    qsort(entries, (size_t)in_bucket, sizeof(NucleusEntry), nucleus_descending);
    double run = above, before = above;
    int64_t cut = -1;
    for (int64_t j = 0; j < in_bucket; j++) {
        before = run;
        run += entries[j].w;
        if (run / z >= top_p) {
            cut = j;
            break;
        }
    }
    if (cut < 0) return -1;  /* the bucket's sum and its walk disagree at the last bit */
    if (run / z < top_p + margin || (before > 0.0 && before / z > top_p - margin)) return -1;
    const float last = entries[cut].x;
    while (cut + 1 < in_bucket && entries[cut + 1].x == last) cut++;  /* ties join */
    float next = floor;  /* the largest logit below the members' (every other is < floor) */
    if (cut + 1 < in_bucket)
        next = entries[cut + 1].x;
    else
        for (int64_t j = in_bucket; j < count; j++)
            if (entries[j].x < last && entries[j].x > next) next = entries[j].x;
    if (!(last - next >= gap)) return -1;
    const int64_t members = nucleus_members(entries, count, last);
    if (members > max_kept) return -1;
    double weight[NUCLEUS_MAX], total = 0.0;  /* m is the members' largest: the top is one */
    for (int64_t j = 0; j < members; j++) {
        kept[j] = entries[j].id;
        total += weight[j] = exp((double)entries[j].x - (double)m);
    }
    for (int64_t j = 0; j < members; j++) probs[j] = (float)(weight[j] / total);
    return (int32_t)members;
}

/* ---- the distillation loss (training a drafting head) ------------------------------
 *
 * Soft cross-entropy of the head's distribution q = softmax(z) against the target's
 * p = softmax(l), row by row: loss = -sum_j p_j (z_j - lse(z)); its gradient in z is
 * q_j * sum(p) - p_j (what log_softmax's backward gives for the upstream -p). A training
 * step scores about 2,000 rows of 8,192 logits; through torch every stage of this is a
 * pass that writes a fresh [rows, 8192] float32 tensor (the cast, log_softmax, the label
 * softmax and the gather, the product, and their backwards), where here a row pair stays
 * in cache from its first read to its last. z is bf16 (the head's products under
 * autocast; the upper half of an fp32) or float32; l is float32 (the target's logits,
 * row index[i] of `labels` for row i). Sums run in 8 float lanes; exp is exp8, whose
 * inputs below its range (terms under e^-87 of the row's largest) count as zero. */

#define SOFT_CE_UNDERFLOW -87.3365478515625f

/* exp(x - m) for 8 lanes with x <= m; lanes below exp8's range are zero. */
static inline __m256 exp_below(__m256 x, __m256 m) {
    const __m256 d = _mm256_sub_ps(x, m);
    const __m256 low = _mm256_cmp_ps(d, _mm256_set1_ps(SOFT_CE_UNDERFLOW), _CMP_LT_OQ);
    const __m256 e = exp8_in_range(_mm256_max_ps(d, _mm256_set1_ps(SOFT_CE_UNDERFLOW)));
    return _mm256_andnot_ps(low, e);
}

static inline float exp_below1(float x, float m) {
    const float d = x - m;
    return d < SOFT_CE_UNDERFLOW ? 0.0f : expf(d);
}

/* The row's largest value and its first index; NaN (and index -1) when a value is NaN. */
static float soft_ce_max(const void *row, int bf16, int64_t n, int32_t *first) {
    const float m = row_largest(row, bf16, n);
    *first = -1;
    if (m != m) return NAN;
    for (int64_t j = 0; j < n; j++)
        if (logit_at(row, bf16, j) == m) {
            *first = (int32_t)j;
            break;
        }
    return m;
}

/* sum_j exp(x_j - m) */
static float soft_ce_sum_exp(const void *row, int bf16, int64_t n, float m) {
    const __m256 top = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 = _mm256_add_ps(s0, exp_below(logits8(row, bf16, j), top));
        s1 = _mm256_add_ps(s1, exp_below(logits8(row, bf16, j + 8), top));
    }
    for (; j + 8 <= n; j += 8) s0 = _mm256_add_ps(s0, exp_below(logits8(row, bf16, j), top));
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; j < n; j++) s += exp_below1(logit_at(row, bf16, j), m);
    return s;
}

/* Loss row i: the loss, and what its gradient reads (lse of z and of l, and sum(p));
 * the first argmax of z and of l (-1 for a row with a NaN; its loss is NaN). stats:
 * [4, rows] (loss, lse z, lse l, sum p), argmax: [2, rows]. */
static void soft_ce_forward_row(const void *zr, int z_bf16, const float *lr, int64_t n, int64_t i,
                                int64_t rows, float *stats, int32_t *argmax) {
    float *loss = stats, *lse_z = stats + rows, *lse_l = stats + 2 * rows, *mass = stats + 3 * rows;
    const float mz = soft_ce_max(zr, z_bf16, n, &argmax[i]);
    const float ml = soft_ce_max(lr, 0, n, &argmax[rows + i]);
    if (mz != mz || ml != ml) {
        loss[i] = lse_z[i] = lse_l[i] = mass[i] = NAN;
        return;
    }
    const float az = mz + logf(soft_ce_sum_exp(zr, z_bf16, n, mz));
    const float al = ml + logf(soft_ce_sum_exp(lr, 0, n, ml));
    const __m256 lse_zv = _mm256_set1_ps(az), lse_lv = _mm256_set1_ps(al);
    __m256 dot = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp_below(_mm256_loadu_ps(lr + j), lse_lv);
        dot = _mm256_add_ps(dot, _mm256_mul_ps(p, _mm256_sub_ps(logits8(zr, z_bf16, j), lse_zv)));
        sum = _mm256_add_ps(sum, p);
    }
    float d = hsum8(dot), total = hsum8(sum);
    for (; j < n; j++) {
        const float p = exp_below1(lr[j], al);
        d += p * (logit_at(zr, z_bf16, j) - az);
        total += p;
    }
    loss[i] = -d;
    lse_z[i] = az;
    lse_l[i] = al;
    mass[i] = total;
}

/* fp32 -> bf16, round to nearest even (NaN stays a quiet NaN), as torch rounds. */
static inline __m128i to_bf16_8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* 8 x 32-bit lanes holding 16-bit values -> 8 x 16-bit */
    const __m256i packed = _mm256_packus_epi32(r, r);  /* per 128-bit half: lanes 0-3, 0-3 */
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
}

static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    if (x != x) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* The gradient of row i: scale[i] * (exp(z_j - lse_z) * sum(p) - p_j), written as bf16
 * (rounded to nearest even) when z is bf16, else float32, into gr. */
static void soft_ce_backward_row(const void *zr, int z_bf16, const float *lr, int64_t n, int64_t i,
                                 int64_t rows, const float *stats, const float *scale, char *gr) {
    const float az = stats[rows + i], al = stats[2 * rows + i], s = stats[3 * rows + i];
    const float g = scale[i];
    const __m256 lse_zv = _mm256_set1_ps(az), lse_lv = _mm256_set1_ps(al);
    const __m256 sv = _mm256_set1_ps(s), gv = _mm256_set1_ps(g);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 q = exp_below(logits8(zr, z_bf16, j), lse_zv);
        const __m256 p = exp_below(_mm256_loadu_ps(lr + j), lse_lv);
        const __m256 v = _mm256_mul_ps(gv, _mm256_sub_ps(_mm256_mul_ps(q, sv), p));
        if (z_bf16)
            _mm_storeu_si128((__m128i *)((uint16_t *)gr + j), to_bf16_8(v));
        else
            _mm256_storeu_ps((float *)gr + j, v);
    }
    for (; j < n; j++) {
        const float q = exp_below1(logit_at(zr, z_bf16, j), az);
        const float p = exp_below1(lr[j], al);
        const float v = g * (q * s - p);
        if (z_bf16)
            ((uint16_t *)gr)[j] = to_bf16(v);
        else
            ((float *)gr)[j] = v;
    }
}

/* The loss's forward (grad NULL: writes stats [4, rows] and argmax [2, rows], see
 * soft_ce_forward_row) or its backward (reads stats and scale [rows], the upstream
 * gradient of each row's loss; writes grad [rows, n] in z's type), rows in parallel. Row
 * i of z is scored against row index[i] of labels [*, n]. */
void spec_soft_ce(const void *z, int32_t z_bf16, const float *labels, const int64_t *index,
                  int64_t rows, int64_t n, float *stats, int32_t *argmax, const float *scale,
                  void *grad, int32_t threads) {
    const size_t z_bytes = z_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const void *zr = (const char *)z + (size_t)i * (size_t)n * z_bytes;
        const float *lr = labels + (size_t)index[i] * (size_t)n;
        if (grad)
            soft_ce_backward_row(zr, z_bf16, lr, n, i, rows, stats, scale,
                                 (char *)grad + (size_t)i * (size_t)n * z_bytes);
        else
            soft_ce_forward_row(zr, z_bf16, lr, n, i, rows, stats, argmax);
    }
}
