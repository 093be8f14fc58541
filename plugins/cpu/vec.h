// 16-lane float vectors (GCC / Clang vector extensions, one AVX-512 register or two AVX2 ones) and
// the exponential the CPU kernels share: the attention's softmax (block_attention/cpu_kernel.cpp)
// and the draft's Markov sampler (d2t_gather/cpu_kernel.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dspark_vec {

constexpr int LANES = 16;
typedef float Vec __attribute__((vector_size(LANES * sizeof(float))));

inline Vec load(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(Vec));
    return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

inline Vec splat(float x) { return Vec{} + x; }

inline float hsum(Vec v) {   // a fixed tree: lanes i and i + 8, then + 4, + 2, + 1
    float s[LANES];
    std::memcpy(s, &v, sizeof(Vec));
    for (int width = LANES / 2; width; width /= 2)
        for (int i = 0; i < width; ++i) s[i] += s[i + width];
    return s[0];
}

// exp(x) for x <= 0 (scores minus their maximum), to about 2 ulp: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-6 Taylor polynomial, 2^n through the exponent bits.
inline Vec exp_nonpositive(Vec x) {
    const Vec lowest = splat(-87.f);
    const Vec clamped = x < lowest ? lowest : x;
    const Vec shift = splat(12582912.f);   // 1.5 * 2^23: adding and subtracting it rounds to an integer
    const Vec n = (clamped * 1.44269504f + shift) - shift;
    const Vec r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
    Vec p = splat(1.f / 720);
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    typedef int32_t Ints __attribute__((vector_size(LANES * sizeof(int32_t))));
    const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
    Vec scale;
    std::memcpy(&scale, &bits, sizeof(Vec));
    const Vec result = p * scale;
    return x < lowest ? splat(0.f) : result;
}

// The maximum of x[0, n), n a multiple of 16 (exact in any order).
inline float highest(const float* x, int64_t n) {
    Vec top = splat(-INFINITY);
    for (int64_t j = 0; j < n; j += LANES) {
        const Vec v = load(x + j);
        top = v > top ? v : top;
    }
    float best = -INFINITY;
    for (int l = 0; l < LANES; ++l) best = top[l] > best ? top[l] : best;
    return best;
}

// A softmax's numerators in place, x[j] = exp(x[j] - max x) for j < n (n a multiple of 16, any
// padding -inf), summed by lanes and then by hsum's tree; returns 1 / their sum.
inline float exponentials(float* x, int64_t n) {
    const float top = highest(x, n);
    Vec total{};
    for (int64_t j = 0; j < n; j += LANES) {
        const Vec e = exp_nonpositive(load(x + j) - top);
        store(x + j, e);
        total += e;
    }
    return 1.f / hsum(total);
}

}  // namespace dspark_vec
