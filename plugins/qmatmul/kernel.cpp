// y[M, N] = x[M, K] @ W[K, N] for block-quantized W (4 or 8 bits, blocks of 32 along K), on the CPU.
//
// What llama.cpp's CPU kernels do, in a layout of our own (plugins/qmatmul/layout.py writes it):
// - x is quantized to int8 per row and block of 32 (scale max|x| / 127), so a block's product is
//   an exact integer dot product, scaled once;
// - the columns are interleaved 16 at a time: one SIMD lane per column, 4 consecutive k per
//   32-bit lane, so one vpdpbusd (AVX-512 VNNI) or maddubs + madd (AVX2) does 4 k of 16 (or 8)
//   columns, and a tile's weights are unpacked once for every row of the call;
// - a tile's weights stay in L1/L2 while every row group of the call passes over them, so the
//   weights come from memory once per call, whatever the rows.
//
// Each output value is computed by one lane in one fixed sequence (its blocks in order, each an
// exact integer sum, then one fma of the scales and one of the offset): nothing depends on the
// other rows of the call or on their number, so a row's result is the same alone and in any batch.
//
// Per block b of 32 k, for row m and column n, with x's block quantized as dx * qx:
//   y += (dw[n] * dx[m]) * sum_k(q[k, n] * qx[m, k])  +  off[n] * sum_k(x[m, k])
// q is the signed weight (int4 -8..7 or int8 -127..127); `off` (GGUF Q4_1's offset) is optional
// and multiplies the block's float sum of x. A K-quant's dw and off are made per block from its
// integers (kernel.h), the same float32 values as a table of them.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#include "kernel.h"

namespace {

constexpr int BLOCK = 32;
constexpr int HALF = 16;       // a Q6_K sub-block: half a block, with a scale of its own
constexpr int TILE = 16;       // columns per interleaved tile
// Blocks ahead whose weights are asked for while a block is computed (the next tile's once past
// this one's: tiles lie one after the other), so that memory streams them in while the rows are
// computed rather than after: a call's extra rows then cost their compute alone, not compute plus
// the wait (docs/measurements.md, "Verify rows").
constexpr int AHEAD = 16;


inline void prefetch(const void* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

void quantize_row(const float* x, int K, int8_t* q, float* scale, int32_t* qsum, int32_t* halves, float* sum) {
    for (int b = 0; b < K / BLOCK; ++b) {
        const float* xb = x + b * BLOCK;
        float amax = 0.f, s = 0.f;
        for (int i = 0; i < BLOCK; ++i) {
            amax = std::fmax(amax, std::fabs(xb[i]));
            s += xb[i];
        }
        const float d = amax / 127.f;
        const float inv = d != 0.f ? 1.f / d : 0.f;
        int32_t half[2] = {0, 0};
        for (int i = 0; i < BLOCK; ++i) {
            const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
            q[b * BLOCK + i] = static_cast<int8_t>(v);
            half[i / HALF] += v;
        }
        scale[b] = d;
        qsum[b] = half[0] + half[1];
        halves[2 * b] = half[0];
        halves[2 * b + 1] = half[1];
        sum[b] = s;
    }
}

// The integer dot products of one block: 16 columns (lanes) for `rows` rows.
// w: the block's tile bytes; x4: each row's block as 8 groups of 4 bytes.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
using Ints = __m512i;
using Floats = __m512;

// A block's weights as the integer units take them, loaded (and unpacked) once for a row group.
struct Block4 { __m512i v[8]; };   // group g (k 4g..4g+3) and g + 4 (k 16+4g..): q + 8, unsigned
struct Block8 { __m512i v[8]; __m512i wsum128; };   // signed q; 128 * each column's sum of q

inline Block4 load4(const uint8_t* w, const int32_t*) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    Block4 b;
    for (int g = 0; g < 4; ++g) {
        const __m512i packed = _mm512_loadu_si512(w + 64 * g);
        b.v[g] = _mm512_and_si512(packed, mask);
        b.v[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
    }
    return b;
}

inline Block8 load8(const uint8_t* w, const int32_t* wsum) {
    Block8 b;
    for (int g = 0; g < 8; ++g) b.v[g] = _mm512_loadu_si512(w + 64 * g);
    b.wsum128 = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
    return b;
}

// 6 bits (Q6_K): Block4's nibbles, each given its fifth and sixth bits from groups 4 and 5
// (layout.py): q + 32, unsigned.
struct Block6 { __m512i v[8]; };
inline Block6 load6(const uint8_t* w, const int32_t*) {
    const Block4 low = load4(w, nullptr);
    const __m512i fifth_sixth = _mm512_set1_epi8(0x30);
    Block6 b;
    for (int h = 0; h < 2; ++h) {
        const __m512i high = _mm512_loadu_si512(w + 256 + 64 * h);
        const __m512i bits[4] = {_mm512_slli_epi16(high, 4), _mm512_slli_epi16(high, 2), high,
                                 _mm512_srli_epi16(high, 2)};
        for (int c = 0; c < 4; ++c)
            b.v[4 * h + c] = _mm512_or_si512(low.v[4 * h + c], _mm512_and_si512(bits[c], fifth_sixth));
    }
    return b;
}

// Four partial sums, so that the vpdpbusd of a block do not wait on each other (integer sums:
// their order changes nothing).
inline Ints sum4(const __m512i acc[4]) {
    return _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
}

inline Ints dot(const Block4& b, const int8_t* xb, int32_t qsum) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int g = 0; g < 8; ++g) {
        int32_t a;
        std::memcpy(&a, xb + 4 * g, 4);
        acc[g % 4] = _mm512_dpbusd_epi32(acc[g % 4], b.v[g], _mm512_set1_epi32(a));
    }
    // sum((q + 8) * x) - 8 * sum(x) = sum(q * x)
    return _mm512_sub_epi32(sum4(acc), _mm512_set1_epi32(8 * qsum));
}

// Q6_K: each half's sum((q + 32) * x) - 32 * sum(x) = sum(q * x), times the half's scale.
inline Ints dot(const Block6& b, const int8_t* xb, const int32_t halves[2], Ints first, Ints second) {
    __m512i acc[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                         {_mm512_setzero_si512(), _mm512_setzero_si512()}};
    for (int g = 0; g < 8; ++g) {
        int32_t a;
        std::memcpy(&a, xb + 4 * g, 4);
        acc[g / 4][g % 2] = _mm512_dpbusd_epi32(acc[g / 4][g % 2], b.v[g], _mm512_set1_epi32(a));
    }
    const auto product = [&](int h) {   // half h's sum(q * x)
        return _mm512_sub_epi32(_mm512_add_epi32(acc[h][0], acc[h][1]), _mm512_set1_epi32(32 * halves[h]));
    };
    return _mm512_add_epi32(_mm512_mullo_epi32(product(0), first), _mm512_mullo_epi32(product(1), second));
}

inline Ints load_ints(const int8_t* p) {   // 16 signed bytes
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline Ints dot(const Block8& b, const int8_t* xb, int32_t) {
    // x + 128 as the unsigned operand: sum((x + 128) * q) - 128 * sum(q) = sum(x * q)
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int g = 0; g < 8; ++g) {
        int32_t a;
        std::memcpy(&a, xb + 4 * g, 4);
        const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(a), _mm512_set1_epi8(int8_t(0x80)));
        acc[g % 4] = _mm512_dpbusd_epi32(acc[g % 4], xu, b.v[g]);
    }
    return _mm512_sub_epi32(sum4(acc), b.wsum128);
}

inline Floats load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Floats to_floats(Ints v) { return _mm512_cvtepi32_ps(v); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats broadcast(float v) { return _mm512_set1_ps(v); }
inline void store_floats(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats load_floats(const uint16_t* p) {   // 16 fp16 values
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Floats sub(Floats a, Floats b) { return _mm512_sub_ps(a, b); }
inline Floats load_floats(const uint8_t* p) {    // 16 unsigned bytes
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}


#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Two 8-lane halves per 16-column tile; maddubs (u8 x s8 -> pairs of int16) + madd (-> int32).
struct Ints { __m256i lo, hi; };
struct Floats { __m256 lo, hi; };

inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// 16 registers hold no unpacked block beside a row group's accumulators: a 4-bit block is
// unpacked once per row group into L1 (16 x 32 bytes: group g's low and high nibbles, each half h),
// and each row loads it from there; an 8-bit block is read as it is.
struct Block4 { alignas(32) uint8_t nibbles[4][2][2][32]; };   // [g][h][low, high]
struct Block8 { const uint8_t* w; };
inline Block4 load4(const uint8_t* w, const int32_t*) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    Block4 b;
    for (int g = 0; g < 4; ++g)
        for (int h = 0; h < 2; ++h) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * g + 32 * h));
            _mm256_store_si256(reinterpret_cast<__m256i*>(b.nibbles[g][h][0]), _mm256_and_si256(packed, mask));
            _mm256_store_si256(reinterpret_cast<__m256i*>(b.nibbles[g][h][1]),
                               _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask));
        }
    return b;
}
inline Block8 load8(const uint8_t* w, const int32_t*) { return {w}; }

// 6 bits (Q6_K): Block4's nibbles in L1, each given its fifth and sixth bits from groups 4 and 5
// (layout.py): q + 32, unsigned.
struct Block6 : Block4 {};
inline Block6 load6(const uint8_t* w, const int32_t*) {
    Block6 b;
    static_cast<Block4&>(b) = load4(w, nullptr);
    const __m256i fifth_sixth = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h)          // the block's first or second 16 k: low or high nibbles
        for (int half = 0; half < 2; ++half) {   // the tile's columns 0-7 or 8-15
            const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256 + 64 * h + 32 * half));
            const __m256i bits[4] = {_mm256_slli_epi16(high, 4), _mm256_slli_epi16(high, 2), high,
                                     _mm256_srli_epi16(high, 2)};
            for (int c = 0; c < 4; ++c) {
                auto* v = reinterpret_cast<__m256i*>(b.nibbles[c][half][h]);
                _mm256_store_si256(v, _mm256_or_si256(_mm256_load_si256(v), _mm256_and_si256(bits[c], fifth_sixth)));
            }
        }
    return b;
}

inline Ints dot(const Block4& block, const int8_t* xb, int32_t qsum) {
    // (q + 8) <= 15 and |x| <= 127: a pair's sum is at most 3810, and the block's 8 pairs a lane
    // at most 30480, so they are summed in int16 and widened once (what llama.cpp's Q4 dot does)
    __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int g = 0; g < 4; ++g) {
        int32_t a, c;
        std::memcpy(&a, xb + 4 * g, 4);
        std::memcpy(&c, xb + 16 + 4 * g, 4);
        const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
        for (int h = 0; h < 2; ++h) {
            const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(block.nibbles[g][h][0]));
            const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(block.nibbles[g][h][1]));
            pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(lo, xa));
            pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(hi, xc));
        }
    }
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi32(8 * qsum);
    return {_mm256_sub_epi32(_mm256_madd_epi16(pairs[0], ones), bias),
            _mm256_sub_epi32(_mm256_madd_epi16(pairs[1], ones), bias)};
}

// Q6_K: each half's sum((q + 32) * x) - 32 * sum(x) = sum(q * x), times the half's scale. A
// pair's sum is at most 2 * 63 * 127 = 16002, so each maddubs is widened at once.
inline Ints dot(const Block6& block, const int8_t* xb, const int32_t halves[2], Ints first, Ints second) {
    __m256i acc[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                         {_mm256_setzero_si256(), _mm256_setzero_si256()}};   // [k half][columns]
    for (int g = 0; g < 4; ++g) {
        int32_t a, c;
        std::memcpy(&a, xb + 4 * g, 4);
        std::memcpy(&c, xb + 16 + 4 * g, 4);
        const __m256i x[2] = {_mm256_set1_epi32(a), _mm256_set1_epi32(c)};
        for (int h = 0; h < 2; ++h)
            for (int half = 0; half < 2; ++half) {
                const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(block.nibbles[g][half][h]));
                acc[h][half] = _mm256_add_epi32(acc[h][half], dot_u8s8(q, x[h]));
            }
    }
    const __m256i bias[2] = {_mm256_set1_epi32(32 * halves[0]), _mm256_set1_epi32(32 * halves[1])};
    const auto scaled = [&](int half, __m256i s0, __m256i s1) {
        return _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(acc[0][half], bias[0]), s0),
                                _mm256_mullo_epi32(_mm256_sub_epi32(acc[1][half], bias[1]), s1));
    };
    return {scaled(0, first.lo, second.lo), scaled(1, first.hi, second.hi)};
}

inline Ints load_ints(const int8_t* p) {   // 16 signed bytes
    return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}

inline Ints dot(const Block8& block, const int8_t* xb, int32_t) {
    const uint8_t* w = block.w;
    // |x| as the unsigned operand, q carrying x's sign: |x|, |q| <= 127, so a pair fits int16
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int g = 0; g < 8; ++g) {
        int32_t a;
        std::memcpy(&a, xb + 4 * g, 4);
        const __m256i x = _mm256_set1_epi32(a);
        const __m256i ax = _mm256_sign_epi8(x, x);
        for (int h = 0; h < 2; ++h) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * g + 32 * h));
            acc[h] = _mm256_add_epi32(acc[h], dot_u8s8(ax, _mm256_sign_epi8(q, x)));
        }
    }
    return {acc[0], acc[1]};
}

inline Floats load_floats(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Floats zero_floats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats to_floats(Ints v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline Floats fma(Floats a, Floats b, Floats c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats broadcast(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline void store_floats(float* p, Floats v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline Floats load_floats(const uint16_t* p) {   // 16 fp16 values (F16C)
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Floats sub(Floats a, Floats b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Floats load_floats(const uint8_t* p) {    // 16 unsigned bytes
    const auto eight = [](const uint8_t* b) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    };
    return {eight(p), eight(p + 8)};
}


#else
#error "plugins/qmatmul needs AVX2, FMA and F16C (the build falls back to ONNX Runtime's own kernels)"
#endif

// x's rows quantized, in the scratch: int8 values, and per block the scale, the sum of the int8
// values (and of each half's) and the sum of the float ones.
struct XRows {
    int8_t* q;         // [M, K]
    float* scale;      // [M, K / 32]
    int32_t* qsum;     // [M, K / 32]
    float* sum;        // [M, K / 32]
    int32_t* halves;   // [M, K / 16]
};

XRows x_rows(void* scratch, int64_t M, int64_t K) {
    auto* base = static_cast<uint8_t*>(scratch);
    const int64_t blocks = K / BLOCK;
    return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + M * K),
            reinterpret_cast<int32_t*>(base + M * K + 4 * M * blocks),
            reinterpret_cast<float*>(base + M * K + 8 * M * blocks),
            reinterpret_cast<int32_t*>(base + M * K + 12 * M * blocks)};
}

// Rows sharing one unpacked tile block in registers: as many as the registers hold beside the
// block (AVX-512: 32 registers, the block 8 of them; AVX2: 16, the block all of them), so that a
// verify call of k + 1 = 5 rows unpacks each block once, not once for 4 rows and again for the
// fifth (which cost that call's fifth row twice what each of the others did).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int ROW_GROUP = 8;
#else
constexpr int ROW_GROUP = 4;
#endif

// How a weight's blocks are scaled: a float32 scale each, plus a float32 offset each, a K-quant's
// integers (kernel.h), or Q6_K's int8 scale per half block under an fp16 one per super-block.
enum class Scales { PLAIN, OFFSETS, KQUANT, HALVES };
constexpr int SUPER = 8;   // a K-quant's blocks per super-block

// ROWS rows (a template argument, so that their accumulators stay in registers) of one tile.
template <int ROWS, typename Block, Block (*load)(const uint8_t*, const int32_t*), Scales S>
void row_group(const DsparkQWeight& w, const XRows& x, int64_t m0, float* y, int64_t t) {
    constexpr bool KQUANT = S == Scales::KQUANT, HALVES = S == Scales::HALVES,
                   OFFSETS = S == Scales::OFFSETS || KQUANT;
    const int64_t K = w.K, N = w.N, blocks = K / BLOCK, block_bytes = w.bits * 64;
    const uint8_t* wq = w.q + t * blocks * block_bytes;
    const float* ws = KQUANT || HALVES ? nullptr : w.scales + t * blocks * TILE;
    const float* wo = S == Scales::OFFSETS ? w.offsets + t * blocks * TILE : nullptr;
    const uint8_t* sub_ints = KQUANT || HALVES ? w.sub + t * blocks * 2 * TILE : nullptr;
    // per super-block: a K-quant's d and dmin, Q6_K's d
    const int64_t per_super = KQUANT ? 2 * TILE : TILE;
    const uint16_t* super_scales = KQUANT || HALVES ? w.super + t * (blocks / SUPER) * per_super : nullptr;
    const int32_t* wsum = w.wsums ? w.wsums + t * blocks * TILE : nullptr;
    Floats acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = zero_floats();
    Floats d = zero_floats(), dmin = zero_floats();
    Ints first{}, second{};   // Q6_K: the block's halves' scales
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch(wq + (b + AHEAD) * block_bytes, block_bytes);
        Floats dw, off = zero_floats();
        if constexpr (HALVES) {
            const int8_t* halves = reinterpret_cast<const int8_t*>(sub_ints) + b * 2 * TILE;
            prefetch(halves + AHEAD * 2 * TILE, 2 * TILE);
            if (b % SUPER == 0) {
                const uint16_t* s = super_scales + (b / SUPER) * TILE;
                prefetch(s + (AHEAD / SUPER) * TILE, TILE * sizeof(uint16_t));
                d = load_floats(s);
            }
            dw = d;
            first = load_ints(halves);
            second = load_ints(halves + TILE);
        } else if constexpr (KQUANT) {
            prefetch(sub_ints + (b + AHEAD) * 2 * TILE, 2 * TILE);
            if (b % SUPER == 0) {
                const uint16_t* s = super_scales + (b / SUPER) * 2 * TILE;
                prefetch(s + (AHEAD / SUPER) * 2 * TILE, 2 * TILE * sizeof(uint16_t));
                d = load_floats(s);
                dmin = load_floats(s + TILE);
            }
            dw = mul(load_floats(sub_ints + b * 2 * TILE), d);
            off = sub(mul(broadcast(w.middle), dw), mul(dmin, load_floats(sub_ints + b * 2 * TILE + TILE)));
        } else {
            prefetch(ws + (b + AHEAD) * TILE, TILE * sizeof(float));
            dw = load_floats(ws + b * TILE);
            if constexpr (OFFSETS) {
                prefetch(wo + (b + AHEAD) * TILE, TILE * sizeof(float));
                off = load_floats(wo + b * TILE);
            }
        }
        const Block block = load(wq + b * block_bytes, wsum ? wsum + b * TILE : nullptr);
        for (int r = 0; r < ROWS; ++r) {
            const int64_t m = m0 + r, mb = m * blocks + b;
            Ints dots;
            if constexpr (HALVES) dots = dot(block, x.q + m * K + b * BLOCK, x.halves + 2 * mb, first, second);
            else dots = dot(block, x.q + m * K + b * BLOCK, x.qsum[mb]);
            acc[r] = fma(to_floats(dots), mul(dw, broadcast(x.scale[mb])), acc[r]);
            if constexpr (OFFSETS) acc[r] = fma(off, broadcast(x.sum[mb]), acc[r]);
        }
    }
    const int64_t n0 = t * TILE, width = N - n0 < TILE ? N - n0 : TILE;
    for (int r = 0; r < ROWS; ++r) {
        float* out = y + (m0 + r) * N + n0;
        if (width == TILE) {
            store_floats(out, acc[r]);
        } else {
            alignas(64) float tmp[TILE];
            store_floats(tmp, acc[r]);
            std::memcpy(out, tmp, width * sizeof(float));
        }
    }
}

// All M rows of a tile, GROUP at a time, then the rest: `rows(std::integral_constant<int, R>{},
// m0)` runs R rows from m0, R a template argument so that their accumulators stay in registers.
template <int GROUP, typename Rows>
void in_groups(int64_t M, Rows rows) {
    int64_t m0 = 0;
    for (; m0 + GROUP <= M; m0 += GROUP) rows(std::integral_constant<int, GROUP>{}, m0);
    if constexpr (GROUP > 1) {
        if (M > m0) in_groups<GROUP - 1>(M - m0, [&](auto count, int64_t m) { rows(count, m0 + m); });
    }
}

// One tile of 16 columns for all M rows: each block is loaded once per group of 4 rows, and the
// tile's weights (K / 32 blocks) stay in cache while the row groups pass over them.
template <typename Block, Block (*load)(const uint8_t*, const int32_t*), Scales S>
void tile(const DsparkQWeight& w, const XRows& x, int64_t M, float* y, int64_t t) {
    in_groups<ROW_GROUP>(M, [&](auto count, int64_t m0) {
        row_group<decltype(count)::value, Block, load, S>(w, x, m0, y, t);
    });
}

template <typename Block, Block (*load)(const uint8_t*, const int32_t*)>
void tile(const DsparkQWeight& w, const XRows& x, int64_t M, float* y, int64_t t) {
    if (w.sub) tile<Block, load, Scales::KQUANT>(w, x, M, y, t);
    else if (w.offsets) tile<Block, load, Scales::OFFSETS>(w, x, M, y, t);
    else tile<Block, load, Scales::PLAIN>(w, x, M, y, t);
}

// ROWS rows of one tile of float weights ([tiles, K, 32], float32 or fp16 values W): each of x's
// values broadcast once against the tile's 32 columns (two vectors), k in order; a row's order is
// the same at any row count. Two vectors per row keep two fma chains going at one row too. fp16
// weights are widened as they are loaded (what llama.cpp's F16 path does on x86), so they stay
// their own size in memory; the output Y (float32, or fp16 rounded to nearest even) is written
// once per row.
constexpr int FLOAT_TILE = 2 * TILE;
constexpr int FLOAT_AHEAD = 16;   // k steps whose weights are asked for ahead, as AHEAD's blocks
// rows per pass over a tile: a tile's weights (K x 32 values) come from L2 once per pass, so as
// many rows as the registers hold (two accumulators a row)
#if defined(__AVX512F__)
constexpr int FLOAT_ROWS = 8;
#else
constexpr int FLOAT_ROWS = 4;
#endif

inline void store_row(float* y, const float* values, int64_t width) {
    std::memcpy(y, values, width * sizeof(float));
}

inline void store_row(uint16_t* y, const float* values, int64_t width) {
    for (int64_t i = 0; i < width; ++i) y[i] = _cvtss_sh(values[i], _MM_FROUND_TO_NEAREST_INT);
}

template <int ROWS, typename W, typename Y>
void float_rows(const W* w, int64_t K, int64_t N, const float* x, int64_t m0, Y* y, int64_t t) {
    Floats left[ROWS], right[ROWS];
    for (int r = 0; r < ROWS; ++r) left[r] = right[r] = zero_floats();
    for (int64_t k = 0; k < K; ++k) {
        const W* column = w + (t * K + k) * FLOAT_TILE;
        prefetch(column + FLOAT_AHEAD * FLOAT_TILE, FLOAT_TILE * sizeof(W));
        const Floats a = load_floats(column), b = load_floats(column + TILE);
        for (int r = 0; r < ROWS; ++r) {
            const Floats value = broadcast(x[(m0 + r) * K + k]);
            left[r] = fma(a, value, left[r]);
            right[r] = fma(b, value, right[r]);
        }
    }
    const int64_t n0 = t * FLOAT_TILE, width = N - n0 < FLOAT_TILE ? N - n0 : FLOAT_TILE;
    for (int r = 0; r < ROWS; ++r) {
        alignas(64) float tmp[FLOAT_TILE];
        store_floats(tmp, left[r]);
        store_floats(tmp + TILE, right[r]);
        store_row(y + (m0 + r) * N + n0, tmp, width);
    }
}

template <typename W, typename Y>
void float_tiles(const W* w, int64_t K, int64_t N, const float* x, int64_t M, Y* y, int64_t first,
                 int64_t last) {
    for (int64_t t = first; t < last; ++t)
        in_groups<FLOAT_ROWS>(M, [&](auto count, int64_t m0) {
            float_rows<decltype(count)::value>(w, K, N, x, m0, y, t);
        });
}

}  // namespace

extern "C" {

void dspark_fmatmul_tiles(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* y,
                          int64_t first, int64_t last) {
    float_tiles(w, K, N, x, M, y, first, last);
}

void dspark_hmatmul_tiles(const uint16_t* w, int64_t K, int64_t N, const float* x, int64_t M, uint16_t* y,
                          int64_t first, int64_t last) {
    float_tiles(w, K, N, x, M, y, first, last);
}

void dspark_hmatmul_float_tiles(const uint16_t* w, int64_t K, int64_t N, const float* x, int64_t M, float* y,
                                int64_t first, int64_t last) {
    float_tiles(w, K, N, x, M, y, first, last);
}

void dspark_half_to_float(const uint16_t* h, int64_t n, float* f) {
    for (int64_t i = 0; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
}

void dspark_float_to_half(const float* f, int64_t n, uint16_t* h) {
    for (int64_t i = 0; i < n; ++i) h[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT);
}


int64_t dspark_qmatmul_scratch(int64_t M, int64_t K) {
    return M * K + 5 * M * (K / BLOCK) * 4;
}

void dspark_qmatmul_quantize(const float* x, int64_t M, int64_t K, void* scratch) {
    const XRows q = x_rows(scratch, M, K);
    const int64_t blocks = K / BLOCK;
    for (int64_t m = 0; m < M; ++m)
        quantize_row(x + m * K, int(K), q.q + m * K, q.scale + m * blocks, q.qsum + m * blocks,
                     q.halves + 2 * m * blocks, q.sum + m * blocks);
}

void dspark_qmatmul_tiles(const DsparkQWeight* w, const void* scratch, int64_t M, float* y,
                          int64_t first, int64_t last) {
    const XRows x = x_rows(const_cast<void*>(scratch), M, w->K);
    for (int64_t t = first; t < last; ++t) {
        if (w->bits == 6) tile<Block6, load6, Scales::HALVES>(*w, x, M, y, t);
        else if (w->bits == 4) tile<Block4, load4>(*w, x, M, y, t);
        else tile<Block8, load8>(*w, x, M, y, t);
    }
}

}  // extern "C"
