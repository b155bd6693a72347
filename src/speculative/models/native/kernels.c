/* One Llama-family decoder forward in C (AVX2 + FMA + OpenMP), for the native runtime.
 *
 * Built on first use by speculative/models/native/ckernels.py and called through ctypes;
 * the Python side owns every buffer. The forward appends k tokens to a static KV cache
 * and writes [k, vocab] logits.
 *
 * k-invariance by construction: every row (token) is computed by the same instruction
 * sequence whatever the number of rows in the call. Linear layers stream each weight row
 * once and dot it with every activation row, each row with its own four accumulators in a
 * fixed order; attention visits exactly the slots a token may see, in slot order. So a
 * block of k tokens yields bitwise the logits of k single decode steps (speculative
 * verification relies on this), and verifying k tokens reads the weights once.
 *
 * Weight formats: fp32; bf16 (upper half of an fp32); q8 (int8 with one fp32 scale per
 * output row); q4 (4-bit q in 0..15 with an fp16 scale and minimum per 32 inputs,
 * value = scale * q + minimum: GGUF Q4_1 blocks as stored). Activations are fp32, except
 * that a q4 layer reads its input quantized to int8 per 32 values, as llama.cpp runs Q4_1
 * (integer dot products; see quantize_rows).
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
#define GROUP 32
#define ROW_BLOCK 6      /* activation rows per pass over a weight tile (k <= 6: one pass) */
#define OUT_BLOCK 2      /* weight rows per tile */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far (at least one tile) the weight stream runs ahead */
#endif
#ifndef ROW_PANEL
#define ROW_PANEL 48     /* rows per sweep over the weights: a panel of x stays in cache */
#endif
#define Q4_ROW_BLOCK 4   /* the q4 tiles: fewer accumulators fit beside its decoding */
#define Q4_OUT_BLOCK 2

typedef struct {
    int32_t format, in_features, out_features, pad_;
    /* f32 | u16 (bf16) | i8: [out, in]; q4: u8 [out, in / 2], per group of 32 inputs 16
     * bytes whose byte j holds q[j] (low nibble) and q[j + 16] (high nibble), as in GGUF
     * Q4_1; weight = d * q + m */
    const void *weight;
    const void *scale;    /* q8: f32 [out]; q4: fp16 d [out, in / 32] */
    const void *minimum;  /* q4: fp16 m [out, in / 32] */
    const float *bias;    /* [out] or NULL */
} Linear;

typedef struct {
    const float *input_norm;  /* [hidden] */
    const float *post_norm;   /* [hidden] */
    Linear qkv, o, gate_up, down;
} Layer;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_length;
    float eps;
    int32_t pad_;
    const Layer *layers;
    const float *final_norm;  /* [hidden] */
    Linear lm_head;
    const float *cos;  /* [max_length, head_dim / 2] */
    const float *sin;  /* [max_length, head_dim / 2] */
} Model;

int spec_abi_version(void) { return 3; }

int spec_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* ---- small vector helpers ------------------------------------------------------- */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* exp(x) for 8 lanes (Cephes-style range reduction, degree-6 polynomial, ~1 ulp). */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    __m256 x2 = _mm256_mul_ps(x, x);
    p = _mm256_fmadd_ps(p, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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

/* Bytes of one stored weight row. */
static size_t row_bytes(const Linear *L) {
    const size_t in = (size_t)L->in_features;
    switch (L->format) {
    case FMT_F32: return in * 4;
    case FMT_BF16: return in * 2;
    case FMT_Q8: return in;
    default: return in / 2;
    }
}

/* Weights o, i .. i + 31 of an fp32, bf16 or q8 W as four fp32 vectors (i a multiple of
 * 32). The format is a compile-time constant at every call site: the branch folds away. */
static inline __attribute__((always_inline)) void load_group(const Linear *L, int FORMAT, int o,
                                                              int i, __m256 *w) {
    const size_t in = (size_t)L->in_features;
    if (FORMAT == FMT_F32) {
        const float *src = (const float *)L->weight + o * in + i;
        for (int j = 0; j < 4; j++) w[j] = _mm256_loadu_ps(src + 8 * j);
    } else if (FORMAT == FMT_BF16) {
        const uint16_t *src = (const uint16_t *)L->weight + o * in + i;
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * j)));
            w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        }
    } else {  /* FMT_Q8; the row scale is applied to the finished dot */
        const int8_t *src = (const int8_t *)L->weight + o * in + i;
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * j))));
    }
}

/* dots[o * ROW_BLOCK + r] = W[o0 + o] . x[r] for OW weight rows and RB activation rows (x
 * stride ldx). Each (o, r) pair has one 8-lane accumulator filled in input order, so its
 * value does not depend on OW, RB or the pair's place in the tile. `ahead` (or NULL):
 * weight bytes to prefetch, `stride` of them per 32 inputs. */
static inline __attribute__((always_inline)) void dot_tile(
    const Linear *L, int FORMAT, int o0, const float *x, size_t ldx, int OW, int RB,
    float *dots, const char *ahead, size_t stride) {
    __m256 acc[OUT_BLOCK][ROW_BLOCK];
    for (int o = 0; o < OW; o++)
        for (int r = 0; r < RB; r++) acc[o][r] = _mm256_setzero_ps();
    for (int i = 0; i < L->in_features; i += 32) {
        if (ahead)
            for (size_t b = 0; b < stride; b += 64)
                _mm_prefetch(ahead + (size_t)(i / 32) * stride + b, _MM_HINT_T0);
        for (int o = 0; o < OW; o++) {
            __m256 w[4];
            load_group(L, FORMAT, o0 + o, i, w);
            for (int r = 0; r < RB; r++)
                for (int j = 0; j < 4; j++)
                    acc[o][r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + r * ldx + i + 8 * j), acc[o][r]);
        }
    }
    for (int o = 0; o < OW; o++)
        for (int r = 0; r < RB; r++) dots[o * ROW_BLOCK + r] = hsum8(acc[o][r]);
}

/* Activation rows for the q4 dot product, quantized per group of 32 inputs the way
 * llama.cpp does for Q4_1 (its Q8_1): x ~= scale * q with q int8 in -127..127, and
 * part = scale * sum(q). Per-row arrays of groups are padded to a multiple of 8 with
 * zeros (`stride` entries), so the minimum's term is an 8-lane dot. */
typedef struct {
    int8_t *q;     /* [rows, in] */
    float *scale;  /* [rows, stride] */
    float *part;   /* [rows, stride] */
    int stride;
} QuantRows;

static int padded_groups(int in) { return (in / GROUP + 7) / 8 * 8; }

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
            qx->part[(size_t)r * stride + g] = scale * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* fp16 row o of a [out, groups] table as fp32, zero-padded to `stride` entries. */
static inline void half_row(const uint16_t *table, int o, int groups, int stride, float *out) {
    const uint16_t *src = table + (size_t)o * groups;
    int g = 0;
    for (; g + 8 <= groups; g += 8)
        _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + g))));
    for (; g < groups; g++) out[g] = _cvtsh_ss(src[g]);
    for (; g < stride; g++) out[g] = 0.0f;
}

/* dots[o * Q4_ROW_BLOCK + r] = W[o0 + o] . x[r0 + r] for a q4 W: per group, the integer
 * dot of the 4-bit weights with the int8 activations (maddubs) times d_w * d_x, one
 * accumulator per pair in group order; then the minimum's term sum_g m_w * part as an
 * 8-lane dot. d and m: this tile's rows as fp32 [OW][stride]. Same per-pair determinism
 * as dot_tile. */
static inline __attribute__((always_inline)) void dot_tile_q4(
    const Linear *L, int o0, const QuantRows *qx, int r0, int OW, int RB, const float *d,
    const float *m, float *dots, const char *ahead, size_t stride_bytes) {
    const int in = L->in_features, groups = in / GROUP, stride = qx->stride;
    const uint8_t *nibbles = (const uint8_t *)L->weight;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[Q4_OUT_BLOCK][Q4_ROW_BLOCK];
    for (int o = 0; o < OW; o++)
        for (int r = 0; r < RB; r++) acc[o][r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        if (ahead)
            for (size_t b = 0; b < stride_bytes; b += 64)
                _mm_prefetch(ahead + (size_t)g * stride_bytes + b, _MM_HINT_T0);
        for (int o = 0; o < OW; o++) {
            const __m128i bytes = _mm_loadu_si128(
                (const __m128i *)(nibbles + ((size_t)(o0 + o) * groups + g) * 16));
            const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble),
                                               _mm_and_si128(bytes, nibble));
            const __m256 dw = _mm256_broadcast_ss(d + o * stride + g);
            for (int r = 0; r < RB; r++) {
                const size_t row = (size_t)(r0 + r);
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx->q + row * in + g * GROUP));
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), ones);
                const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(qx->scale + row * stride + g));
                acc[o][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[o][r]);
            }
        }
    }
    for (int o = 0; o < OW; o++)
        for (int r = 0; r < RB; r++) {
            const float *part = qx->part + (size_t)(r0 + r) * stride;
            __m256 mins = _mm256_setzero_ps();
            for (int g = 0; g < stride; g += 8)
                mins = _mm256_fmadd_ps(_mm256_loadu_ps(m + o * stride + g), _mm256_loadu_ps(part + g), mins);
            dots[o * Q4_ROW_BLOCK + r] = hsum8(acc[o][r]) + hsum8(mins);
        }
}

#define Q4_CASES(OW, o0, dd, mm, target)                                                 \
    switch (rb) {                                                                        \
    case 1: dot_tile_q4(L, o0, qx, r0, OW, 1, dd, mm, target, ahead, stride_bytes); break; \
    case 2: dot_tile_q4(L, o0, qx, r0, OW, 2, dd, mm, target, ahead, stride_bytes); break; \
    case 3: dot_tile_q4(L, o0, qx, r0, OW, 3, dd, mm, target, ahead, stride_bytes); break; \
    default: dot_tile_q4(L, o0, qx, r0, OW, Q4_ROW_BLOCK, dd, mm, target, ahead, stride_bytes); break; \
    }

/* linear_format for q4 weights (nibbles [out, in / 2], fp16 scale and minimum tables
 * [out, in / 32]); quantizes x into qx first. */
static void linear_q4(const Linear *L, const float *x, int rows, float *y, int ldy, int accumulate,
                      QuantRows *qx) {
    quantize_rows(x, rows, L->in_features, qx);  /* ends in a barrier */
    const int out = L->out_features, groups = L->in_features / GROUP, stride = qx->stride;
    const int tiles = (out + Q4_OUT_BLOCK - 1) / Q4_OUT_BLOCK;
    const size_t tile_bytes = (size_t)Q4_OUT_BLOCK * L->in_features / 2;
    const size_t stride_bytes = tile_bytes / (size_t)groups;
    const int ahead_tiles = tile_bytes < PREFETCH_BYTES ? (int)(PREFETCH_BYTES / tile_bytes) : 1;
    float d[Q4_OUT_BLOCK * stride], m[Q4_OUT_BLOCK * stride];
    for (int panel = 0; panel < rows; panel += ROW_PANEL) {
    const int panel_end = rows - panel < ROW_PANEL ? rows : panel + ROW_PANEL;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int o0 = t * Q4_OUT_BLOCK, ow = out - o0 < Q4_OUT_BLOCK ? out - o0 : Q4_OUT_BLOCK;
        for (int o = 0; o < ow; o++) {
            half_row((const uint16_t *)L->scale, o0 + o, groups, stride, d + o * stride);
            half_row((const uint16_t *)L->minimum, o0 + o, groups, stride, m + o * stride);
        }
        for (int r0 = panel; r0 < panel_end; r0 += Q4_ROW_BLOCK) {
            const int rb = panel_end - r0 < Q4_ROW_BLOCK ? panel_end - r0 : Q4_ROW_BLOCK;
            float dots[Q4_OUT_BLOCK * Q4_ROW_BLOCK];
            const int next = t + ahead_tiles + (r0 - panel) / Q4_ROW_BLOCK;
            const char *ahead = next < tiles
                ? (const char *)L->weight + (size_t)next * tile_bytes : NULL;
            if (ow == Q4_OUT_BLOCK) {
                Q4_CASES(Q4_OUT_BLOCK, o0, d, m, dots)
            } else {
                for (int o = 0; o < ow; o++)
                    Q4_CASES(1, o0 + o, d + o * stride, m + o * stride, dots + o * Q4_ROW_BLOCK)
            }
            for (int o = 0; o < ow; o++) {
                const float bias = L->bias ? L->bias[o0 + o] : 0.0f;
                for (int r = 0; r < rb; r++) {
                    float v = dots[o * Q4_ROW_BLOCK + r] + bias;
                    float *dst = y + (size_t)(r0 + r) * ldy + o0 + o;
                    *dst = accumulate ? *dst + v : v;
                }
            }
        }
    }
    }
}

/* dot_tile with constant shapes: unrolled, accumulators in registers */
#define DOT_TILE(OW, RB, o0, xb, target) \
    dot_tile(L, FORMAT, o0, xb, ldx, OW, RB, target, ahead, stride)
#define DOT_CASES(OW, o0, xb, target)                                \
    switch (rb) {                                                    \
    case 1: DOT_TILE(OW, 1, o0, xb, target); break;                  \
    case 2: DOT_TILE(OW, 2, o0, xb, target); break;                  \
    case 3: DOT_TILE(OW, 3, o0, xb, target); break;                  \
    case 4: DOT_TILE(OW, 4, o0, xb, target); break;                  \
    case 5: DOT_TILE(OW, 5, o0, xb, target); break;                  \
    default: DOT_TILE(OW, ROW_BLOCK, o0, xb, target); break;         \
    }

/* y[r, o] (+)= x[r] . W[o] * scale + bias: x [rows, in], y [rows, ldy]. Call inside a
 * parallel region: tiles of OUT_BLOCK output rows are shared out among the threads. */
static inline __attribute__((always_inline)) void linear_format(
    const Linear *L, int FORMAT, const float *x, int rows, float *y, int ldy, int accumulate) {
    const int out = L->out_features;
    const int tiles = (out + OUT_BLOCK - 1) / OUT_BLOCK;
    const size_t ldx = (size_t)L->in_features, tile_bytes = OUT_BLOCK * row_bytes(L);
    const size_t stride = tile_bytes * GROUP / ldx;  /* one tile per pass over the inputs */
    const int ahead_tiles = tile_bytes < PREFETCH_BYTES ? (int)(PREFETCH_BYTES / tile_bytes) : 1;
    for (int panel = 0; panel < rows; panel += ROW_PANEL) {
    const int panel_end = rows - panel < ROW_PANEL ? rows : panel + ROW_PANEL;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int o0 = t * OUT_BLOCK, ow = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
        for (int r0 = panel; r0 < panel_end; r0 += ROW_BLOCK) {
            const int rb = panel_end - r0 < ROW_BLOCK ? panel_end - r0 : ROW_BLOCK;
            float dots[OUT_BLOCK * ROW_BLOCK];
            /* pass p prefetches tile t + 1 + p: with several passes per tile the stream
             * still advances during each, so computing overlaps reading */
            const int next = t + ahead_tiles + (r0 - panel) / ROW_BLOCK;
            const char *ahead = next < tiles
                ? (const char *)L->weight + (size_t)next * tile_bytes : NULL;
            const float *xb = x + (size_t)r0 * ldx;
            if (ow == OUT_BLOCK) {
                DOT_CASES(OUT_BLOCK, o0, xb, dots)
            } else {  /* ragged last tile: one weight row at a time */
                for (int o = 0; o < ow; o++) DOT_CASES(1, o0 + o, xb, dots + o * ROW_BLOCK)
            }
            for (int o = 0; o < ow; o++) {
                const float scale = FORMAT == FMT_Q8 ? ((const float *)L->scale)[o0 + o] : 1.0f;
                const float bias = L->bias ? L->bias[o0 + o] : 0.0f;
                for (int r = 0; r < rb; r++) {
                    float v = dots[o * ROW_BLOCK + r] * scale + bias;
                    float *dst = y + (size_t)(r0 + r) * ldy + o0 + o;
                    *dst = accumulate ? *dst + v : v;
                }
            }
        }
    }
    }
}

static void linear(const Linear *L, const float *x, int rows, float *y, int ldy, int accumulate,
                   QuantRows *qx) {
    switch (L->format) {
    case FMT_F32: linear_format(L, FMT_F32, x, rows, y, ldy, accumulate); break;
    case FMT_BF16: linear_format(L, FMT_BF16, x, rows, y, ldy, accumulate); break;
    case FMT_Q8: linear_format(L, FMT_Q8, x, rows, y, ldy, accumulate); break;
    default: linear_q4(L, x, rows, y, ldy, accumulate, qx); break;
    }
}

/* ---- elementwise ------------------------------------------------------------------ */

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, rows shared among threads. */
static void rms_norm(const float *x, const float *weight, int rows, int n, float eps, float *out) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = out + (size_t)r * n;
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

/* Rotate interleaved pairs of q and k heads at each row's position; store k, v in cache. */
static void rope_and_store(const Model *m, float *qkv, int rows, const int64_t *positions,
                           int start, float *k_cache, float *v_cache) {
    const int d = m->head_dim, half = d / 2, heads = m->heads, kv = m->kv_heads;
    const int width = (heads + 2 * kv) * d;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *row = qkv + (size_t)r * width;
        const float *c = m->cos + (size_t)positions[r] * half;
        const float *s = m->sin + (size_t)positions[r] * half;
        for (int h = 0; h < heads + kv; h++) {
            float *x = row + h * d;
            for (int i = 0; i < half; i++) {
                float a = x[2 * i], b = x[2 * i + 1];
                x[2 * i] = a * c[i] - b * s[i];
                x[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
        const size_t slot = (size_t)(start + r);
        for (int g = 0; g < kv; g++) {
            memcpy(k_cache + ((size_t)g * m->max_length + slot) * d, row + (heads + g) * d,
                   (size_t)d * sizeof(float));
            memcpy(v_cache + ((size_t)g * m->max_length + slot) * d, row + (heads + kv + g) * d,
                   (size_t)d * sizeof(float));
        }
    }
}

/* Attention of every (row, head): softmax over the visible slots, in slot order.
 * Row r sees cache slots [0, start) and new slot start + j iff mask[r, j] (causal when
 * mask is NULL). scratch: per thread 2 * max_length floats. */
static void attention(const Model *m, const float *qkv, int rows, int start, const uint8_t *mask,
                      const float *k_cache, const float *v_cache, float *out, float *scratch) {
    const int d = m->head_dim, heads = m->heads, group = m->heads / m->kv_heads;
    const int width = (heads + 2 * m->kv_heads) * d;
    float *scores = scratch + (size_t)omp_get_thread_num() * 2 * m->max_length;
    int32_t *slots = (int32_t *)(scores + m->max_length);
#pragma omp for schedule(static)
    for (int t = 0; t < rows * heads; t++) {
        const int r = t / heads, h = t % heads, g = h / group;
        const float *q = qkv + (size_t)r * width + h * d;
        const float *keys = k_cache + (size_t)g * m->max_length * d;
        const float *values = v_cache + (size_t)g * m->max_length * d;
        int n = 0;
        for (int s = 0; s < start + rows; s++) {
            int visible = s < start ? 1 : (mask ? mask[r * rows + (s - start)] : s - start <= r);
            if (visible) slots[n++] = s;
        }
        float top = -INFINITY;
        for (int i = 0; i < n; i++) {
            const float *key = keys + (size_t)slots[i] * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int j = 0; j < d; j += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(key + j), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(key + j + 8), a1);
            }
            scores[i] = hsum8(_mm256_add_ps(a0, a1));
            top = scores[i] > top ? scores[i] : top;
        }
        for (int i = 0; i < n; i++) scores[i] -= top;
        exp_inplace(scores, n);
        float total = 0.0f;
        float *o = out + (size_t)r * heads * d + h * d;
        for (int j = 0; j < d; j++) o[j] = 0.0f;
        for (int i = 0; i < n; i++) {
            total += scores[i];
            const float *value = values + (size_t)slots[i] * d;
            const __m256 p = _mm256_set1_ps(scores[i]);
            for (int j = 0; j < d; j += 8)
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(p, _mm256_loadu_ps(value + j),
                                                        _mm256_loadu_ps(o + j)));
        }
        const __m256 inv = _mm256_set1_ps(1.0f / total);
        for (int j = 0; j < d; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), inv));
    }
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
    per_row += widest_input(m) / 4 + 2 * padded_groups(widest_input(m));  /* QuantRows */
    return rows * per_row + (int64_t)threads * 2 * m->max_length;
}

/* Append `rows` tokens at cache slots start..start+rows-1.
 * hidden: [rows, hidden] input embeddings, updated in place into the residual stream;
 * positions: [rows] RoPE positions; mask: [rows, rows] uint8 (1 = may attend) or NULL;
 * k_cache, v_cache: [layers, kv_heads, max_length, head_dim]; logits: [rows, vocab]. */
void spec_forward(const Model *m, float *hidden, int rows, int start, const int64_t *positions,
                  const uint8_t *mask, float *k_cache, float *v_cache, float *logits, float *work,
                  int threads) {
    const int H = m->hidden, d = m->head_dim, inter = m->intermediate;
    const int width = (m->heads + 2 * m->kv_heads) * d;
    const size_t layer_cache = (size_t)m->kv_heads * m->max_length * d;
    float *normed = work;
    float *qkv = normed + (size_t)rows * H;
    float *attn = qkv + (size_t)rows * width;
    float *gate_up = attn + (size_t)rows * m->heads * d;
    float *act = gate_up + (size_t)rows * 2 * inter;
    float *scratch = act + (size_t)rows * inter;
    const int64_t widest = widest_input(m);
    float *quant = scratch + (size_t)threads * 2 * m->max_length;
    const int64_t groups = padded_groups(widest);
    QuantRows qx = {(int8_t *)quant, quant + rows * widest / 4,
                    quant + rows * widest / 4 + rows * groups, 0};
#pragma omp parallel num_threads(threads)
    {
        for (int l = 0; l < m->num_layers; l++) {
            const Layer *L = &m->layers[l];
            float *kc = k_cache + l * layer_cache, *vc = v_cache + l * layer_cache;
            rms_norm(hidden, L->input_norm, rows, H, m->eps, normed);
            linear(&L->qkv, normed, rows, qkv, width, 0, &qx);
            rope_and_store(m, qkv, rows, positions, start, kc, vc);
            attention(m, qkv, rows, start, mask, kc, vc, attn, scratch);
            linear(&L->o, attn, rows, hidden, H, 1, &qx);
            rms_norm(hidden, L->post_norm, rows, H, m->eps, normed);
            linear(&L->gate_up, normed, rows, gate_up, 2 * inter, 0, &qx);
            silu_mul(gate_up, rows, inter, act);
            linear(&L->down, act, rows, hidden, H, 1, &qx);
        }
        rms_norm(hidden, m->final_norm, rows, H, m->eps, normed);
        linear(&m->lm_head, normed, rows, logits, m->vocab, 0, &qx);
    }
}
