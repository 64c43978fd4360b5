/* headrace: a decode step of a Llama-family decoder over 4-bit (GGUF Q4_0 / Q4_1)
 * weights, every layer in one call, and the LM head (see native.py, which compiles and
 * drives this).
 *
 * Why: a decode step of a small model on a CPU is a few dozen megabytes of weights
 * and ~250 tiny tensor operations. torch's int4 kernel moves about half the memory
 * bandwidth, and each small op costs microseconds of dispatch; here the weights are
 * streamed once per step at close to the bandwidth, and the rest (norms, RoPE, the
 * KV-cache write, paged attention, SwiGLU, residuals) is a few loops over registers.
 *
 * Weights: GGUF 4-bit blocks of 32, w = d * q + m (Q4_0 is d * (q - 8): m = -8 d), in
 * two layouts. For the few-row kernel, tiles of 4 output rows, so that a thread streams
 * one sequential run of memory: per tile and block column, 80 bytes: the 4 rows'
 * float16 d, their 4 float16 m, then each row's 16 bytes of codes (element j in the
 * low nibble of byte j, element j + 16 in the high one); padding rows are zeros. For
 * the AMX kernel, see amx_tile.
 *
 * Matmul kernels (q4_matmul), each giving every row a result that depends on nothing
 * but the row (not the other rows, the row count, the tiling or the thread count), so a
 * token is computed the same way decoded alone or batched, within one kernel:
 * - few rows, VNNI (AVX512-VNNI / AVX-VNNI): the input split per block of 32 into two
 *   int8 layers (x ~ dx (qx1 + qx2 / 256), about 16 bits, finer than bfloat16); q . x
 *   by two vpdpbusd per 32 weights; y = sum_b d_b dx_b (q . qx)_b + m_b sum(x_b);
 * - many rows, AMX: each tile of weights dequantised once to bfloat16, all rows (in
 *   bfloat16) multiplied by TDPBF16PS, float32 accumulation in the tile registers;
 *   without AMX, the same with AVX512-BF16 dot products;
 * - elsewhere: w dequantised to float32, fused multiply-adds with the float32 input.
 * Activations are float32 between the matmuls, the residual stream included; the KV
 * cache is bfloat16 (the engine's cache, shared with the torch path that prefills).
 * Built with -ffp-contract=off: the only fused multiply-adds are the explicit ones.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

#define BLOCK 32
#define NT 4 /* output rows per tile */
#define TILE_BYTES (NT * 20) /* one block of each of a tile's rows */
#define MT 4 /* activation rows per tile */

/* a * b + c, rounded once where the CPU has FMA (the same everywhere on one machine) */
static inline v16f vfma(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 a0, a1, b0, b1, c0, c1;
    memcpy(&a0, &a, 32); memcpy(&a1, (char *)&a + 32, 32);
    memcpy(&b0, &b, 32); memcpy(&b1, (char *)&b + 32, 32);
    memcpy(&c0, &c, 32); memcpy(&c1, (char *)&c + 32, 32);
    __m256 r0 = _mm256_fmadd_ps(a0, b0, c0), r1 = _mm256_fmadd_ps(a1, b1, c1);
    v16f r;
    memcpy(&r, &r0, 32); memcpy((char *)&r + 32, &r1, 32);
    return r;
#else
    return a * b + c;
#endif
}

static inline float hsum(v16f v) {
    /* a fixed tree: the same order for every element */
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* 16 codes (0..15) as floats: widen to int32 first (one vpmovzxbd), then convert */
static inline v16f codes(v16u8 q) {
    return __builtin_convertvector(__builtin_convertvector(q, v16i32), v16f);
}

static inline v16f splat(float f) { return (v16f){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, 64); }

static inline v16f load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#endif
    v16u16 h;
    memcpy(&h, p, 32);
    v16u32 u = __builtin_convertvector(h, v16u32) << 16;
    v16f f;
    memcpy(&f, &u, 64);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__FLT16_MAX__)
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { float f = ldexpf((float)man, -24); memcpy(&u, &f, 4); u |= sign; }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* For each tile of up to MT activation rows from 0 to rows: TILE(mt) with r0 the tile's
 * first row and mt its row count as a constant (so the kernels keep their accumulators
 * in registers). */
#define FOR_ROW_TILES(rows, TILE)                                                      \
    for (int r0 = 0; r0 < (rows); r0 += MT) {                                          \
        switch ((rows) - r0 < MT ? (rows) - r0 : MT) {                                 \
        case 4: TILE(4); break;                                                        \
        case 3: TILE(3); break;                                                        \
        case 2: TILE(2); break;                                                        \
        default: TILE(1); break;                                                       \
        }                                                                              \
    }

/* A tile's sums into y[r0 .., n0 ..] (added to what is there with ``accumulate``),
 * outputs past n_out (padding) dropped. */
static inline __attribute__((always_inline)) void tile_out(
    v16f acc[NT][MT], int n0, int n_out, int r0, const int mt, float *y, int ldy,
    int accumulate) {
#pragma GCC unroll 4
    for (int j = 0; j < NT; j++) {
        if (n0 + j >= n_out) break;
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) {
            float *out = y + (size_t)(r0 + r) * ldy + n0 + j;
            const float s = hsum(acc[j][r]);
            *out = accumulate ? *out + s : s;
        }
    }
}

/* One tile: outputs n0 .. n0 + NT - 1 (those below n_out are written) for activation
 * rows r0 .. r0 + mt - 1. Inlined with a constant mt, so the accumulators live in
 * registers. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *tile, int nb, int n0, int n_out, const float *x, int ldx, int r0, float *y,
    int ldy, int accumulate, const int mt) {
    v16f acc[NT][MT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) acc[j][r] = splat(0.0f);
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = tile + (size_t)b * TILE_BYTES;
        __builtin_prefetch(blk + 128 * TILE_BYTES);
        __builtin_prefetch(blk + 128 * TILE_BYTES + 64);
        __builtin_prefetch(blk + 96 * TILE_BYTES, 0, 2);
        __builtin_prefetch(blk + 96 * TILE_BYTES + 64, 0, 2);
#if defined(__FLT16_MAX__)
        typedef _Float16 v8h __attribute__((vector_size(16)));
        v8h halves;
        memcpy(&halves, blk, 16);
        const v8f dm = __builtin_convertvector(halves, v8f); /* d0..d3, m0..m3 */
#else
        float dm[2 * NT];
        for (int j = 0; j < 2 * NT; j++) dm[j] = f16(blk + 2 * j);
#endif
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            v16f d = splat(dm[j]), m = splat(dm[NT + j]);
            v16u8 q;
            memcpy(&q, blk + 4 * NT + 16 * j, 16);
            v16f lo = vfma(codes(q & low), d, m);
            v16f hi = vfma(codes(q >> 4), d, m);
#pragma GCC unroll 4
            for (int r = 0; r < mt; r++) {
                const float *xr = x + (size_t)(r0 + r) * ldx + (size_t)b * BLOCK;
                acc[j][r] = vfma(lo, load16(xr), acc[j][r]);
                acc[j][r] = vfma(hi, load16(xr + 16), acc[j][r]);
            }
        }
    }
    tile_out(acc, n0, n_out, r0, mt, y, ldy, accumulate);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HR_INT8 1
static inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_dpbusd_epi32(acc, u8, s8);
}
#elif defined(__AVXVNNI__)
#define HR_INT8 1
static inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
}
#endif

#if defined(HR_INT8)
/* Activations in two int8 layers per block of 32, so that q . x takes two vpdpbusd per
 * 32 weights and keeps ~16 bits: x ~ dx * (qx1 + qx2 / 256) with dx = max |x| / 127, qx1
 * = round(x / dx) and qx2 the rounded remainder (|error| <= dx / 256, against dx / 2 for
 * llama.cpp's one-layer Q8, ~1e-5 of the block's largest value: finer than bfloat16);
 * plus each block's exact float sum S for the m term. */
typedef struct {
    int8_t *q1, *q2; /* [rows, k] each */
    float *scale;    /* [rows, nb] */
    float *sum;      /* [rows, nb] */
} q8_rows;

/* 32 rounded floats (each within int8) as 32 int8, in order (llama.cpp's AVX2 packing) */
static inline __m256i pack32(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_rows(const float *x, int ldx, int rows, int k, q8_rows out) {
    const int nb = k / BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f), limit = _mm256_set1_ps(127.0f);
    const __m256 step = _mm256_set1_ps(256.0f);
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * ldx + (size_t)b * BLOCK;
            __m256 v[4], hi[4], lo[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
            __m256 top8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                                      _mm256_andnot_ps(sign, v[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                                      _mm256_andnot_ps(sign, v[3])));
            __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
            top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
            const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
            const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            for (int i = 0; i < 4; i++) {
                const __m256 scaled = _mm256_mul_ps(v[i], inv);
                hi[i] = _mm256_round_ps(scaled, nearest);
                lo[i] = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, hi[i]), step), nearest);
                lo[i] = _mm256_max_ps(_mm256_min_ps(lo[i], limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
            }
            const size_t at = (size_t)r * k + (size_t)b * BLOCK;
            _mm256_storeu_si256((__m256i *)(out.q1 + at), pack32(hi[0], hi[1], hi[2], hi[3]));
            _mm256_storeu_si256((__m256i *)(out.q2 + at), pack32(lo[0], lo[1], lo[2], lo[3]));
            out.scale[(size_t)r * nb + b] = top / (127.0f * 256.0f);
            out.sum[(size_t)r * nb + b] = hsum(load16(xb) + load16(xb + 16));
        }
}

/* A tile as in q4_tile, from the two-layer int8 activations:
 * y = sum_b d_b dx_b (256 q_b . qx1_b + q_b . qx2_b) + m_b S_b. */
static inline __attribute__((always_inline)) void q4_tile_int8(
    const uint8_t *tile, int nb, int n0, int n_out, q8_rows x, int k, int r0, float *y,
    int ldy, int accumulate, const int mt) {
    __m256 acc[NT][MT];
    __m128 offsets[MT]; /* the m terms of the tile's NT outputs */
#pragma GCC unroll 4
    for (int r = 0; r < mt; r++) {
        offsets[r] = _mm_setzero_ps();
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) acc[j][r] = _mm256_setzero_ps();
    }
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i shifts = _mm256_set_epi64x(4, 4, 0, 0); /* high lane: the high nibbles */
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = tile + (size_t)b * TILE_BYTES;
        __builtin_prefetch(blk + 128 * TILE_BYTES);
        __builtin_prefetch(blk + 128 * TILE_BYTES + 64);
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m128 d4 = _mm256_castps256_ps128(dm), m4 = _mm256_extractf128_ps(dm, 1);
        __m256 dx[MT];
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) {
            const size_t row = (size_t)(r0 + r);
            dx[r] = _mm256_set1_ps(x.scale[row * nb + b]);
            offsets[r] = _mm_fmadd_ps(m4, _mm_set1_ps(x.sum[row * nb + b]), offsets[r]);
        }
        float ds[4];
        _mm_storeu_ps(ds, d4);
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            /* codes 0..15 of the block as 32 bytes: the 16 bytes in both lanes, the high
             * lane shifted by 4, both masked */
            const __m256i both = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(blk + 4 * NT + 16 * j)));
            const __m256i codes32 = _mm256_and_si256(_mm256_srlv_epi64(both, shifts), low);
            const __m256 d = _mm256_set1_ps(ds[j]);
#pragma GCC unroll 4
            for (int r = 0; r < mt; r++) {
                const size_t at = (size_t)(r0 + r) * k + (size_t)b * BLOCK;
                const __m256i hi = dpbusd(_mm256_setzero_si256(), codes32,
                                          _mm256_loadu_si256((const __m256i *)(x.q1 + at)));
                /* 256 q.qx1 + q.qx2: below 2^24 in magnitude, so exact as a float */
                const __m256i dot = dpbusd(_mm256_slli_epi32(hi, 8), codes32,
                                           _mm256_loadu_si256((const __m256i *)(x.q2 + at)));
                acc[j][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dx[r]), d,
                                            acc[j][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mt; r++) {
        float off[4];
        _mm_storeu_ps(off, offsets[r]);
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            if (n0 + j >= n_out) break;
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[j][r]),
                                        _mm256_extractf128_ps(acc[j][r], 1));
            const float s = ((h[0] + h[2]) + (h[1] + h[3])) + off[j];
            float *out = y + (size_t)(r0 + r) * ldy + n0 + j;
            *out = accumulate ? *out + s : s;
        }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HR_BF16 1
/* The batched matmul (many rows): each tile of 4 outputs is dequantised once, to
 * bfloat16 in an L1 buffer, then every row takes one vdpbf16ps per 32 weights (the
 * inputs rounded to bfloat16, as torch's bfloat16 path rounds them). */
static inline __attribute__((always_inline)) void bf16_rows(
    const uint16_t *w, int k, int n0, int n_out, const uint16_t *x, int r0, float *y, int ldy,
    int accumulate, const int mt) {
    __m512 acc[NT][MT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; j++)
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) acc[j][r] = _mm512_setzero_ps();
    for (int e = 0; e < k; e += BLOCK) {
        __m512bh xs[MT];
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++)
            xs[r] = (__m512bh)_mm512_loadu_si512(x + (size_t)(r0 + r) * k + e);
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            const __m512bh wj = (__m512bh)_mm512_loadu_si512(w + (size_t)j * k + e);
#pragma GCC unroll 4
            for (int r = 0; r < mt; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wj, xs[r]);
        }
    }
    tile_out((v16f(*)[MT])acc, n0, n_out, r0, mt, y, ldy, accumulate);
}

static void q4_tile_bf16(const uint8_t *tile, int nb, int n0, int n_out, const uint16_t *x,
                         int k, int rows, float *y, int ldy, int accumulate, uint16_t *w) {
    const __m512i low = _mm512_set1_epi32(15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = tile + (size_t)b * TILE_BYTES;
        __builtin_prefetch(blk + 128 * TILE_BYTES);
        __builtin_prefetch(blk + 128 * TILE_BYTES + 64);
        float dm[2 * NT];
        _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
        for (int j = 0; j < NT; j++) {
            const __m512i q = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 4 * NT + 16 * j)));
            const __m512 d = _mm512_set1_ps(dm[j]), m = _mm512_set1_ps(dm[NT + j]);
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d, m);
            const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
            _mm512_storeu_si512(w + (size_t)j * k + (size_t)b * BLOCK,
                                (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
#define TILE(mt) bf16_rows(w, k, n0, n_out, x, r0, y, ldy, accumulate, mt)
    FOR_ROW_TILES(rows, TILE)
#undef TILE
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* The batched matmul on CPUs with AMX: per tile of 16 outputs and block of 32 inputs,
 * the 512 weights are dequantised to bfloat16 in AMX's pair layout and multiplied into
 * up to 32 rows by two TDPBF16PS, accumulating in the tile registers over the whole
 * row: the per-block work does not grow with the rows.
 * Weights: codes [tiles][nb][256] (element e of the block's 16 x 32 pair layout, e =
 * 32 kp + 2 n + j for input 2 kp + j of output n, in the low nibble of byte e, e + 256
 * in the high one of byte e - 256) and float16 scales [tiles][nb][32] (d of the 16
 * outputs, then their m). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    /* tmm0, tmm1: C of rows 0-15 and 16-31; tmm2, tmm3: their A; tmm4: B */
    for (int i = 0; i < 5; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

static void amx_tile(const uint8_t *codes, const uint16_t *scales, int nb, int n0, int n_out,
                     const uint16_t *x, int k, int g0, int groups, int rows, float *y, int ldy,
                     int accumulate, uint16_t *b_tile, float *c_tile) {
    const __m512i low = _mm512_set1_epi8(15);
    /* lane l of a 16-lane run of the pair layout is output (l / 2) of its half */
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _tile_zero(0);
    _tile_zero(1);
    for (int b = 0; b < nb; b++) {
        const uint8_t *src = codes + (size_t)b * 256;
        const uint16_t *sc = scales + (size_t)b * 32;
        __builtin_prefetch(src + 8 * 256);
        __builtin_prefetch(src + 8 * 256 + 64);
        __builtin_prefetch(src + 8 * 256 + 128);
        __builtin_prefetch(src + 8 * 256 + 192);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
        const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
        const __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512(src + 64 * i);
            const __m512i half[2] = {_mm512_and_si512(v, low),
                                     _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
            for (int h = 0; h < 2; h++) {
                uint16_t *out = b_tile + 256 * h + 64 * i; /* elements e .. e + 63 */
                for (int q = 0; q < 4; q += 2) {
                    /* 32 elements: one row of 32 (a whole kp row), outputs 0-7 then 8-15 */
                    const __m512 a = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(half[h], q))), d0, m0);
                    const __m512 c = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(half[h], q + 1))), d1, m1);
                    _mm512_storeu_si512(out + 16 * q, (__m512i)_mm512_cvtne2ps_pbh(c, a));
                }
            }
        }
        _tile_loadd(4, b_tile, 64);
        _tile_loadd(2, x + (size_t)g0 * 16 * k + (size_t)b * BLOCK, 2 * k);
        _tile_dpbf16ps(0, 2, 4);
        if (groups > 1) {
            _tile_loadd(3, x + (size_t)(g0 + 1) * 16 * k + (size_t)b * BLOCK, 2 * k);
            _tile_dpbf16ps(1, 3, 4);
        }
    }
    for (int g = 0; g < groups; g++) {
        if (g == 0) _tile_stored(0, c_tile, 64);
        else _tile_stored(1, c_tile, 64);
        for (int r = 0; r < 16; r++) {
            const int row = (g0 + g) * 16 + r;
            if (row >= rows) break;
            for (int j = 0; j < 16 && n0 + j < n_out; j++) {
                float *o = y + (size_t)row * ldy + n0 + j;
                *o = accumulate ? *o + c_tile[r * 16 + j] : c_tile[r * 16 + j];
            }
        }
    }
}

/* All output tiles this thread gets, for every row (x: bfloat16 rows padded with zero
 * rows to a multiple of 16). */
static void amx_matmul(const uint8_t *codes, const uint16_t *scales, int n_out, int k,
                       const uint16_t *x, int rows, float *y, int ldy, int accumulate,
                       uint16_t *b_tile, float *c_tile) {
    const int nb = k / BLOCK, tiles = (n_out + 15) / 16, groups = (rows + 15) / 16;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++)
        for (int g0 = 0; g0 < groups; g0 += 2)
            amx_tile(codes + (size_t)t * nb * 256, scales + (size_t)t * nb * 32, nb, t * 16,
                     n_out, x, k, g0, groups - g0 < 2 ? groups - g0 : 2, rows, y, ldy,
                     accumulate, b_tile, c_tile);
}
#endif

/* 1 where the AMX kernels can run here (asks Linux for the tile state once). */
int hr_amx(void) {
#if defined(HR_AMX)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* Floats of per-thread scratch q4_matmul needs for rows of k inputs. */
static size_t matmul_scratch(int rows, int k) {
    const size_t padded = (size_t)(rows + 15) / 16 * 16;
    const size_t few = (size_t)rows * ((size_t)k / 2 + 2 * (size_t)k / BLOCK) + 2 * (size_t)k;
    const size_t amx = padded * (size_t)k / 2 + 256 + 256; /* x in bfloat16, B, C */
    return (few > amx ? few : amx) + 64;
}

/* y[r, n] (+)= sum_k w[n, k] x[r, k] for the output tiles this thread gets; scratch:
 * this thread's own matmul_scratch(rows, k) floats. ``batched``: the kernel for many
 * rows (dequantise once, bfloat16 dot products) instead of the one for a few (integer
 * dot products); each gives every row a result independent of the other rows. */
static void q4_matmul(const uint8_t *w, const uint8_t *amx_codes, const uint16_t *amx_scales,
                      int n_out, int k, const float *x, int ldx, int rows, float *y, int ldy,
                      int accumulate, float *scratch, int batched) {
    const int nb = k / BLOCK, tiles = (n_out + NT - 1) / NT;
#if defined(HR_AMX)
    if (batched && amx_codes != NULL) {
        const int padded = (rows + 15) / 16 * 16;
        uint16_t *xb = (uint16_t *)scratch;
        float *c_tile = scratch + (size_t)padded * k / 2;
        uint16_t *b_tile = (uint16_t *)(c_tile + 256);
        for (int r = 0; r < padded; r++)
            for (int e = 0; e < k; e += BLOCK) {
                __m512i v = _mm512_setzero_si512();
                if (r < rows) {
                    const float *xr = x + (size_t)r * ldx + e;
                    v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr));
                }
                _mm512_storeu_si512(xb + (size_t)r * k + e, v);
            }
        amx_matmul(amx_codes, amx_scales, n_out, k, xb, rows, y, ldy, accumulate, b_tile, c_tile);
        return;
    }
#else
    (void)amx_codes;
    (void)amx_scales;
#endif
#if defined(HR_BF16)
    if (batched) {
        uint16_t *xb = (uint16_t *)scratch, *wbuf = xb + (size_t)rows * k + 32;
        for (int r = 0; r < rows; r++)
            for (int e = 0; e < k; e += BLOCK) {
                const float *xr = x + (size_t)r * ldx + e;
                _mm512_storeu_si512(xb + (size_t)r * k + e,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16),
                                                                 _mm512_loadu_ps(xr)));
            }
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++)
            q4_tile_bf16(w + (size_t)t * nb * TILE_BYTES, nb, t * NT, n_out, xb, k, rows, y, ldy,
                         accumulate, wbuf);
        return;
    }
#endif
#if defined(HR_INT8)
    if (!batched) {
        /* every thread quantises the rows itself: the same codes, no barrier */
        q8_rows q8 = {(int8_t *)scratch, (int8_t *)scratch + (size_t)rows * k,
                      scratch + (size_t)rows * k / 2,
                      scratch + (size_t)rows * k / 2 + (size_t)rows * nb};
        quantize_rows(x, ldx, rows, k, q8);
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const uint8_t *tile = w + (size_t)t * nb * TILE_BYTES;
#define TILE(mt) q4_tile_int8(tile, nb, t * NT, n_out, q8, k, r0, y, ldy, accumulate, mt)
            FOR_ROW_TILES(rows, TILE)
#undef TILE
        }
        return;
    }
#endif
    (void)scratch;
    (void)batched;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *tile = w + (size_t)t * nb * TILE_BYTES;
#define TILE(mt) q4_tile(tile, nb, t * NT, n_out, x, ldx, r0, y, ldy, accumulate, mt)
        FOR_ROW_TILES(rows, TILE)
#undef TILE
    }
}

static void rms_norm(const float *x, const float *weight, float eps, int dim, float *out) {
    v16f acc = splat(0.0f);
    for (int i = 0; i < dim; i += 16) {
        v16f v = load16(x + i);
        acc = vfma(v, v, acc);
    }
    float inv = 1.0f / sqrtf(hsum(acc) / (float)dim + eps);
    v16f s = splat(inv);
    for (int i = 0; i < dim; i += 16) store16(out + i, load16(x + i) * s * load16(weight + i));
}

/* out = sum_i p_i v_i, with nv (= head_dim / 16) a constant once inlined. */
static inline __attribute__((always_inline)) void weigh_values(
    const uint16_t *vc, const int64_t *table, int n, int bs, int stride, int offset,
    const float *p, float *out, const int nv) {
    v16f acc[16];
    for (int c = 0; c < nv; c++) acc[c] = splat(0.0f);
    for (int i0 = 0, blk = 0; i0 < n; i0 += bs, blk++) {
        const uint16_t *base = vc + (size_t)table[blk] * bs * stride + offset;
        const int count = n - i0 < bs ? n - i0 : bs;
        for (int i = 0; i < count; i++) {
            const v16f w = splat(p[i0 + i]);
            for (int c = 0; c < nv; c++)
                acc[c] = vfma(w, load_bf16(base + (size_t)i * stride + 16 * c), acc[c]);
        }
    }
    for (int c = 0; c < nv; c++) store16(out + 16 * c, acc[c]);
}

/* One query head over n cached keys: softmax(q k / sqrt(d)) v, in float32.
 * stride: elements between consecutive slots; offset: this KV head's first element. */
/* exp(x) for x <= 0 (a softmax's shifted scores), 16 at a time: 2^n * p(r) with
 * x = n ln 2 + r, |r| <= ln 2 / 2, p a degree-6 polynomial (~2 ulp); 0 below -87. */
static inline v16f vexp(v16f x) {
    const v16f big = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16i32 under = x < splat(-87.0f); /* all ones where exp(x) is taken as 0 */
    v16i32 bits;
    memcpy(&bits, &x, 64);
    const v16f floor_ = splat(-87.0f);
    v16i32 floor_bits;
    memcpy(&floor_bits, &floor_, 64);
    bits = (bits & ~under) | (floor_bits & under);
    memcpy(&x, &bits, 64);
    v16f n = (x * splat(1.44269504f) + big) - big;
    v16f r = vfma(n, splat(-0.693359375f), x);
    r = vfma(n, splat(2.12194440e-4f), r);
    v16f p = splat(1.0f / 720.0f);
    p = vfma(p, r, splat(1.0f / 120.0f));
    p = vfma(p, r, splat(1.0f / 24.0f));
    p = vfma(p, r, splat(1.0f / 6.0f));
    p = vfma(p, r, splat(0.5f));
    p = vfma(p, r, splat(1.0f));
    p = vfma(p, r, splat(1.0f));
    const v16i32 e = (__builtin_convertvector(n, v16i32) + 127) << 23;
    v16f scale;
    memcpy(&scale, &e, 64);
    v16f y = p * scale;
    memcpy(&bits, &y, 64);
    bits &= ~under;
    memcpy(&y, &bits, 64);
    return y;
}

static void attend(const float *q, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                   int n, int bs, int stride, int offset, int d, float scale, float *scores,
                   float *out) {
    float top = -INFINITY;
#if defined(__AVX512BF16__)
    /* q . k by bfloat16 dot products: q rounded to bfloat16 once (as the torch path
     * keeps it), the keys read as stored; float32 sums */
    __m512bh qb[8];
    const int pairs = d % 32 == 0 && d <= 256 ? d / 32 : 0;
    for (int c = 0; c < pairs; c++)
        qb[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c));
#else
    const int pairs = 0;
#endif
    for (int i0 = 0, blk = 0; i0 < n; i0 += bs, blk++) {
        const uint16_t *base = kc + (size_t)table[blk] * bs * stride + offset;
        const int count = n - i0 < bs ? n - i0 : bs;
        for (int i = 0; i < count; i++) {
            const uint16_t *key = base + (size_t)i * stride;
            v16f acc = splat(0.0f);
#if defined(__AVX512BF16__)
            for (int c = 0; c < pairs; c++)
                acc = (v16f)_mm512_dpbf16_ps((__m512)acc, qb[c],
                                             (__m512bh)_mm512_loadu_si512(key + 32 * c));
#endif
            if (!pairs)
                for (int e = 0; e < d; e += 16) acc = vfma(load16(q + e), load_bf16(key + e), acc);
            const float sc = hsum(acc) * scale;
            scores[i0 + i] = sc;
            top = sc > top ? sc : top;
        }
    }
    /* softmax, 16 scores at a time (the last ones padded with -inf: exp gives 0) */
    v16f sum = splat(0.0f);
    for (int i = 0; i < n; i += 16) {
        v16f v = splat(-INFINITY);
        const int left = n - i < 16 ? n - i : 16;
        memcpy(&v, scores + i, (size_t)left * 4);
        const v16f e = vexp(v - splat(top));
        memcpy(scores + i, &e, (size_t)left * 4);
        sum += e;
    }
    const v16f inv = splat(1.0f / hsum(sum));
    for (int i = 0; i < n; i += 16) {
        const int left = n - i < 16 ? n - i : 16;
        v16f v;
        memcpy(&v, scores + i, (size_t)left * 4);
        v *= inv;
        memcpy(scores + i, &v, (size_t)left * 4);
    }
    switch (d) {
    case 64: weigh_values(vc, table, n, bs, stride, offset, scores, out, 4); break;
    case 128: weigh_values(vc, table, n, bs, stride, offset, scores, out, 8); break;
    default: weigh_values(vc, table, n, bs, stride, offset, scores, out, d / 16); break;
    }
}

typedef struct {
    const uint8_t *qkv, *out, *gate_up, *down; /* 4-bit blocks, see the top */
    const float *attn_norm, *ffn_norm;         /* float32 [dim] */
    uint16_t *k_cache, *v_cache;               /* bfloat16 [slots, n_kv, head_dim] */
    /* the same four matrices for the AMX kernels (NULL: none), codes and scales */
    const uint8_t *amx_codes[4];
    const uint16_t *amx_scales[4];
} hr_layer;

typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, block_size;
    float eps;
    const hr_layer *layers;
} hr_model;

/* Floats of work space hr_decode needs. */
long hr_work_floats(const hr_model *m, int rows, int max_context, int threads) {
    long qkv = (long)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    int widest = m->hidden > m->dim ? m->hidden : m->dim;
    widest = m->n_heads * m->head_dim > widest ? m->n_heads * m->head_dim : widest;
    return (long)rows * (m->dim + qkv + (long)m->n_heads * m->head_dim + 3L * m->hidden) +
           (long)threads * (max_context + (long)matmul_scratch(rows, widest));
}

/* One decode step through every layer.
 * x: float32 [rows, dim], the embeddings in and the last layer's output out;
 * rope_cos / rope_sin: float32 [rows, head_dim] as (c, c) and (-s, s) pairs;
 * slots: [rows] cache slot of each row's new token; tables: [rows, width] block ids;
 * context: [rows] tokens each row attends to (its own included), at most max_context. */
int hr_decode(const hr_model *m, int rows, float *x, const float *rope_cos,
              const float *rope_sin, const int64_t *slots, const int64_t *tables, int width,
              const int64_t *context, int max_context, float *work, int threads, int batched) {
    const int dim = m->dim, h = m->n_heads, hkv = m->n_kv_heads, d = m->head_dim;
    const int hidden = m->hidden, group = h / hkv, qkv_n = (h + 2 * hkv) * d;
    if (dim % BLOCK || hidden % BLOCK || (h * d) % BLOCK || d % 16 || d > 256 || h % hkv)
        return -1;
    float *xn = work;
    float *qkv = xn + (size_t)rows * dim;
    float *att = qkv + (size_t)rows * qkv_n;
    float *gu = att + (size_t)rows * h * d;
    float *act = gu + (size_t)rows * 2 * hidden;
    float *scores = act + (size_t)rows * hidden;
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
        extern int omp_get_thread_num(void);
        const int me = omp_get_thread_num();
#else
        const int me = 0;
#endif
        int widest = hidden > dim ? hidden : dim;
        widest = h * d > widest ? h * d : widest;
        const size_t per_thread = (size_t)max_context + matmul_scratch(rows, widest);
        float *my_scores = scores + (size_t)me * per_thread;
        float *my_scratch = my_scores + max_context;
#if defined(HR_AMX)
        const int amx = batched && m->layers[0].amx_codes[0] != NULL;
        if (amx) amx_configure();
#endif
        for (int l = 0; l < m->n_layers; l++) {
            const hr_layer *L = &m->layers[l];
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++)
                rms_norm(x + (size_t)r * dim, L->attn_norm, m->eps, dim, xn + (size_t)r * dim);
            q4_matmul(L->qkv, L->amx_codes[0], L->amx_scales[0], qkv_n, dim, xn, dim, rows, qkv, qkv_n, 0, my_scratch, batched);
            /* RoPE on q and k (adjacent pairs), then k and v into the cache */
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) {
                float *row = qkv + (size_t)r * qkv_n;
                const float *c = rope_cos + (size_t)r * d, *s = rope_sin + (size_t)r * d;
                for (int head = 0; head < h + hkv; head++) {
                    float *p = row + (size_t)head * d;
                    for (int i = 0; i < d; i += 2) {
                        float x0 = p[i], x1 = p[i + 1];
                        /* x * (c, c) + (x1, x0) * (-s, s), as the torch path */
                        p[i] = x0 * c[i] + x1 * s[i];
                        p[i + 1] = x1 * c[i + 1] + x0 * s[i + 1];
                    }
                }
                uint16_t *kc = L->k_cache + (size_t)slots[r] * hkv * d;
                uint16_t *vc = L->v_cache + (size_t)slots[r] * hkv * d;
                const float *k = row + (size_t)h * d, *v = k + (size_t)hkv * d;
                for (int i = 0; i < hkv * d; i++) {
                    kc[i] = to_bf16(k[i]);
                    vc[i] = to_bf16(v[i]);
                }
            }
            /* attention: one (row, query head) per iteration, over the row's context */
#pragma omp for schedule(static)
            for (int item = 0; item < rows * h; item++) {
                const int r = item / h, head = item % h;
                attend(qkv + (size_t)r * qkv_n + (size_t)head * d, L->k_cache, L->v_cache,
                       tables + (size_t)r * width, (int)context[r], m->block_size, hkv * d,
                       (head / group) * d, d, scale, my_scores,
                       att + (size_t)r * h * d + (size_t)head * d);
            }
            q4_matmul(L->out, L->amx_codes[1], L->amx_scales[1], dim, h * d, att, h * d, rows, x, dim, 1, my_scratch, batched);
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++)
                rms_norm(x + (size_t)r * dim, L->ffn_norm, m->eps, dim, xn + (size_t)r * dim);
            q4_matmul(L->gate_up, L->amx_codes[2], L->amx_scales[2], 2 * hidden, dim, xn, dim, rows, gu, 2 * hidden, 0, my_scratch, batched);
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) {
                const float *gate = gu + (size_t)r * 2 * hidden, *up = gate + hidden;
                float *a = act + (size_t)r * hidden;
                for (int i = 0; i < hidden; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            }
            q4_matmul(L->down, L->amx_codes[3], L->amx_scales[3], dim, hidden, act, hidden, rows, x, dim, 1, my_scratch, batched);
        }
#if defined(HR_AMX)
        if (amx) _tile_release();
#endif
    }
    return 0;
}

/* The LM head for a few rows: logits[r, v] = sum_k w[v, k] x[r, k] in float32, with w and
 * x in bfloat16 (the model's head and final hidden states), w [vocab, dim] streamed
 * once for all rows. Unlike a bfloat16 matmul its outputs are not rounded to bfloat16,
 * so near-ties keep their order. Each row's result is independent of the others. */
static inline __attribute__((always_inline)) void head_tile(
    const uint16_t *w, int dim, int v0, int vocab, const uint16_t *x, int r0, float *out,
    const int nt, const int mt) {
    v16f acc[NT][MT];
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) acc[j][r] = splat(0.0f);
    for (int e = 0; e < dim; e += BLOCK) {
#pragma GCC unroll 4
        for (int j = 0; j < nt; j++) {
            const uint16_t *wj = w + (size_t)(v0 + j) * dim + e;
            __builtin_prefetch(wj + 8 * (size_t)dim);
#if defined(__AVX512BF16__)
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wj);
#pragma GCC unroll 4
            for (int r = 0; r < mt; r++)
                acc[j][r] = (v16f)_mm512_dpbf16_ps(
                    (__m512)acc[j][r], wv,
                    (__m512bh)_mm512_loadu_si512(x + (size_t)(r0 + r) * dim + e));
#else
            const v16f lo = load_bf16(wj), hi = load_bf16(wj + 16);
#pragma GCC unroll 4
            for (int r = 0; r < mt; r++) {
                const uint16_t *xr = x + (size_t)(r0 + r) * dim + e;
                acc[j][r] = vfma(lo, load_bf16(xr), acc[j][r]);
                acc[j][r] = vfma(hi, load_bf16(xr + 16), acc[j][r]);
            }
#endif
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int r = 0; r < mt; r++) out[(size_t)(r0 + r) * vocab + v0 + j] = hsum(acc[j][r]);
}

int hr_head(const uint16_t *w, int vocab, int dim, const uint16_t *x, int rows, float *out,
            int threads) {
    if (dim % BLOCK) return -1;
    const int tiles = (vocab + NT - 1) / NT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tiles; t++) {
        if ((t + 1) * NT <= vocab) {
            const int v0 = t * NT;
#define TILE(mt) head_tile(w, dim, v0, vocab, x, r0, out, NT, mt)
            FOR_ROW_TILES(rows, TILE)
#undef TILE
        } else {
            for (int v0 = t * NT; v0 < vocab; v0++) {
#define TILE(mt) head_tile(w, dim, v0, vocab, x, r0, out, 1, mt)
                FOR_ROW_TILES(rows, TILE)
#undef TILE
            }
        }
    }
    return 0;
}
