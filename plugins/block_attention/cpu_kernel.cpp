// Block attention on the CPU for a batch of sequences, each on its own cache slot: the
// `dspark::BlockAttention` of reference.py (causal or not, no window) in the form a batched step
// needs.
//
// Each query row attends over exactly its own sequence's visible positions (causal: 0 .. start + i;
// not: 0 .. start + R - 1), in
// one fixed order (scores, then the maximum, the exponentials and their sum, then the weighted
// values, each position after the one before), so a row's output is the same alone and in any
// batch: nothing is padded to the batch's longest sequence, as ONNX Runtime's portable attention
// does. The caches are a pool of slots [P, Hkv, C, D]; batch row b reads and writes slot slots[b].
//
// A head's rows go up to five at a time (a verify block, a prompt chunk, the draft's block): each
// key and value is loaded once for them, which at a long context is most of the work (a head's
// keys and values no longer fit the caches nearest the core), and each row's every sum is still
// the one it has alone, in the same order.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel.h"
#include "../cpu/vec.h"

namespace {

using namespace dspark_vec;

// Sixteen vectors -> one whose lane j is the sum of vector j's lanes, by a fixed tree of halves
// (lanes 0-7 + 8-15, then quarters, pairs, single lanes): a key's score never mixes with another's.
inline Vec sums16(Vec v[16]) {
#define HALVES(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                      __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define QUARTERS(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
                        __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define PAIRS(a, b) (__builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
                     __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define SINGLES(a, b) (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
                       __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
    Vec halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; ++i) halves[i] = HALVES(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; ++i) quarters[i] = QUARTERS(halves[2 * i], halves[2 * i + 1]);
    for (int i = 0; i < 2; ++i) pairs[i] = PAIRS(quarters[2 * i], quarters[2 * i + 1]);
    return SINGLES(pairs[0], pairs[1]);
#undef HALVES
#undef QUARTERS
#undef PAIRS
#undef SINGLES
}

// out[0, 16 NV) += sum_j p[j] * values[j][0, 16 NV), the accumulators in registers.
template <int NV>
void weighted_values(const float* p, const float* values, int64_t count, int64_t D, float inverse, float* out) {
    Vec acc[NV] = {};
    for (int64_t j = 0; j < count; ++j) {
        const Vec weight = splat(p[j]);
        for (int i = 0; i < NV; ++i) acc[i] += weight * load(values + j * D + LANES * i);
    }
    for (int i = 0; i < NV; ++i) store(out + LANES * i, acc[i] * inverse);
}

// The scores of keys [j0, j0 + 16), all below `count`, by d-chunks in order; each key's partial
// vector in a register of its own (the keys unrolled), and each chunk of q loaded once.
inline void scores16(const float* q, const float* keys, int64_t j0, int64_t D, float scale, float* scores) {
    Vec partial[LANES] = {};
    for (int64_t d = 0; d < D; d += LANES) {
        const Vec qd = load(q + d);
#pragma GCC unroll 16
        for (int j = 0; j < LANES; ++j) partial[j] += qd * load(keys + (j0 + j) * D + d);
    }
    store(scores + j0, sums16(partial) * scale);
}

// ROWS query rows of a head attend together, KEYS = 16 / ROWS keys at a step: ROWS x KEYS
// (row, key) vectors are sums16's sixteen (the rest zero), and a step loads ROWS + KEYS vectors
// for its ROWS x KEYS products, fewest at 4 x 4 or 5 x 3.
template <int ROWS>
constexpr int KEYS = 16 / ROWS;

// The scores of keys [j0, j0 + KEYS) below `count` for the ROWS rows q[r], into scores[r] + j0:
// each (row, key) vector summed over the d-chunks in order and reduced by sums16, which reduces
// each vector by itself, so a row's scores are the bits scores16 gives it.
template <int ROWS>
inline void scores_step(const float* const q[], const float* keys, int64_t j0, int64_t count, int64_t D,
                        float scale, float* const scores[]) {
    constexpr int K = KEYS<ROWS>;
    Vec partial[16] = {};
    const int64_t here = count - j0 < K ? count - j0 : K;
    for (int64_t d = 0; d < D; d += LANES) {
        Vec kd[K] = {};
        for (int k = 0; k < here; ++k) kd[k] = load(keys + (j0 + k) * D + d);
        for (int r = 0; r < ROWS; ++r) {
            const Vec qd = load(q[r] + d);
            for (int k = 0; k < K; ++k) partial[K * r + k] += qd * kd[k];
        }
    }
    const Vec s = sums16(partial) * scale;
    for (int r = 0; r < ROWS; ++r)   // the keys below `count` only: a row's scores end at its padding
        for (int k = 0; k < here; ++k) scores[r][j0 + k] = s[K * r + k];
}

// out[r][0, 16 NV) = inverse[r] * sum_j p[r][j] * values[j][0, 16 NV) over each row's count[r]
// values (`most` the largest), every value loaded once for the rows that see it; each row's sum
// in j order, as weighted_values makes it alone.
template <int ROWS, int NV>
void weighted_values_rows(const float* const p[], const float* values, const int64_t count[], int64_t most,
                          int64_t D, const float inverse[], float* const out[]) {
    Vec acc[ROWS][NV] = {};
    for (int64_t j = 0; j < most; ++j) {
        Vec v[NV];
        for (int i = 0; i < NV; ++i) v[i] = load(values + j * D + LANES * i);
        for (int r = 0; r < ROWS; ++r) {
            if (j >= count[r]) continue;
            const Vec weight = splat(p[r][j]);
            for (int i = 0; i < NV; ++i) acc[r][i] += weight * v[i];
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int i = 0; i < NV; ++i) store(out[r] + LANES * i, acc[r][i] * inverse[r]);
}

// ROWS query rows of one head, row r over count[r] cache rows: what attend_row gives each alone.
// `scores` holds ROWS rows of the largest count rounded up to 16 floats.
template <int ROWS>
void attend_rows(const float* const q[], const float* keys, const float* values, const int64_t count[],
                 int64_t D, float scale, float* scores, float* const out[]) {
    int64_t most = 0;
    for (int r = 0; r < ROWS; ++r) most = count[r] > most ? count[r] : most;
    const int64_t width = (most + LANES - 1) / LANES * LANES;
    float* rows[ROWS];
    for (int r = 0; r < ROWS; ++r) rows[r] = scores + r * width;
    for (int64_t j0 = 0; j0 < most; j0 += KEYS<ROWS>) scores_step<ROWS>(q, keys, j0, most, D, scale, rows);
    float inverse[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        const int64_t padded = (count[r] + LANES - 1) / LANES * LANES;
        for (int64_t j = count[r]; j < padded; ++j) rows[r][j] = -INFINITY;
        inverse[r] = exponentials(rows[r], padded);
    }
    for (int64_t d = 0; d < D; d += 4 * LANES) {
        float* at[ROWS];
        for (int r = 0; r < ROWS; ++r) at[r] = out[r] + d;
        switch ((D - d) / LANES < 4 ? (D - d) / LANES : 4) {
            case 4: weighted_values_rows<ROWS, 4>(rows, values + d, count, most, D, inverse, at); break;
            case 3: weighted_values_rows<ROWS, 3>(rows, values + d, count, most, D, inverse, at); break;
            case 2: weighted_values_rows<ROWS, 2>(rows, values + d, count, most, D, inverse, at); break;
            default: weighted_values_rows<ROWS, 1>(rows, values + d, count, most, D, inverse, at); break;
        }
    }
}

// The most rows attend_rows takes together (a verify block of k + 1 = 5 rows in one pass).
constexpr int MOST_ROWS = 5;

// One query row of one head over `count` cache rows: out [D] = softmax(scale * q.K^T) V.
// `scores` holds count rounded up to 16 floats.
void attend_row(const float* q, const float* keys, const float* values, int64_t count, int64_t D,
                float scale, float* scores, float* out) {
    const int64_t full = count / LANES * LANES, padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t j0 = 0; j0 < full; j0 += LANES) scores16(q, keys, j0, D, scale, scores);
    if (full < count) {   // the last keys, fewer than 16: the same sums, the missing keys' zero
        Vec partial[LANES] = {};
        for (int64_t j = full; j < count; ++j)
            for (int64_t d = 0; d < D; d += LANES) partial[j - full] += load(q + d) * load(keys + j * D + d);
        store(scores + full, sums16(partial) * scale);
    }
    for (int64_t j = count; j < padded; ++j) scores[j] = -INFINITY;
    const float inverse = exponentials(scores, padded);
    for (int64_t d = 0; d < D; d += 4 * LANES) {
        switch ((D - d) / LANES < 4 ? (D - d) / LANES : 4) {
            case 4: weighted_values<4>(scores, values + d, count, D, inverse, out + d); break;
            case 3: weighted_values<3>(scores, values + d, count, D, inverse, out + d); break;
            case 2: weighted_values<2>(scores, values + d, count, D, inverse, out + d); break;
            default: weighted_values<1>(scores, values + d, count, D, inverse, out + d); break;
        }
    }
}

}  // namespace

extern "C" {

const char* dspark_attention_check(const DsparkAttention* a) {
    if (a->D % LANES) return "the head size is not a multiple of 16";
    if (a->heads % a->kv_heads) return "the query heads are not a multiple of the key/value heads";
    for (int64_t b = 0; b < a->B; ++b) {
        if (a->slots[b] < 0 || a->slots[b] >= a->P) return "a slot outside the cache pool";
        if (a->start[b] < 0 || a->start[b] + a->R > a->C) return "a sequence's rows past the cache's capacity";
    }
    return nullptr;
}

void dspark_attention_write(const DsparkAttention* a) {
    for (int64_t b = 0; b < a->B; ++b)
        for (int64_t g = 0; g < a->kv_heads; ++g) {
            const int64_t cache_row = ((a->slots[b] * a->kv_heads + g) * a->C + a->start[b]) * a->D;
            const int64_t new_row = (b * a->kv_heads + g) * a->R * a->D;
            std::memcpy(a->k_cache + cache_row, a->k_new + new_row, a->R * a->D * sizeof(float));
            std::memcpy(a->v_cache + cache_row, a->v_new + new_row, a->R * a->D * sizeof(float));
        }
}

int64_t dspark_attention_scratch(const DsparkAttention* a) {
    return MOST_ROWS * (a->C + LANES) * int64_t(sizeof(float));
}

void dspark_attention_head(const DsparkAttention* a, int64_t task, float* scratch) {
    const int64_t b = task / a->heads, h = task % a->heads, g = h / (a->heads / a->kv_heads);
    const int64_t cache = (a->slots[b] * a->kv_heads + g) * a->C * a->D;
    const float* keys = a->k_cache + cache;
    const float* values = a->v_cache + cache;
    auto row = [&](int64_t i) { return ((b * a->heads + h) * a->R + i) * a->D; };
    auto seen = [&](int64_t i) { return a->start[b] + (a->causal ? i + 1 : a->R); };
    // rows in groups of 5 or 4 (a 5-row verify block in one pass, a prompt chunk by fours), then
    // 3 or 2 together, a last one alone
    int64_t i = 0;
    while (i < a->R - 1) {
        const int64_t left = a->R - i;
        const int rows = left == 5 ? 5 : left >= 4 ? 4 : int(left);
        const float* q[MOST_ROWS];
        float* out[MOST_ROWS];
        int64_t count[MOST_ROWS];
        for (int r = 0; r < rows; ++r) {
            q[r] = a->q + row(i + r);
            out[r] = a->out + row(i + r);
            count[r] = seen(i + r);
        }
        switch (rows) {
            case 5: attend_rows<5>(q, keys, values, count, a->D, a->scale, scratch, out); break;
            case 4: attend_rows<4>(q, keys, values, count, a->D, a->scale, scratch, out); break;
            case 3: attend_rows<3>(q, keys, values, count, a->D, a->scale, scratch, out); break;
            default: attend_rows<2>(q, keys, values, count, a->D, a->scale, scratch, out); break;
        }
        i += rows;
    }
    if (i < a->R)
        attend_row(a->q + row(i), keys, values, seen(i), a->D, a->scale, scratch, a->out + row(i));
}

}  // extern "C"
