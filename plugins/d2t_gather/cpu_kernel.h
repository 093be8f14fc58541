// The draft's Markov sampler on the CPU (cpu_kernel.cpp), for the ONNX Runtime op and tests.
#pragma once
#include <cstdint>

#ifndef DSPARK_API
#define DSPARK_API __attribute__((visibility("default")))
#endif

extern "C" {

// One call: B sequences, each drawing k drafts from its block's base logits, one after the other.
struct DsparkMarkov {
    int64_t B, k, R, first, Vd, V, rank;
    int64_t top_k;             // 0: every draft id; K: each draft over its base row's K largest
    const float* base;         // [B, R, Vd]: the block's rows; draft i reads row first + i
    const int64_t* anchor;     // [B] target ids: the first draft's predecessor
    const float* temperature;  // [B], > 0
    const float* noise;        // [B, k, V]: Gumbel noise by target id, or zeros (greedy)
    const int64_t* d2t;        // [Vd]: draft id j is target id j + d2t[j]
    const float* w1;           // [V, rank]: markov_w1, by target id
    const float* w2t;          // [rank, Vd]: markov_w2 transposed (top_k 0), else null
    const float* w2;           // [Vd, rank]: markov_w2 itself (top_k > 0), else null
    int64_t* tokens;           // [B, k] target ids
    float* q;                  // [B, k, V]: each draft's distribution, zero off the draft vocabulary
};

// Null, or what is wrong with the call (in words).
DSPARK_API const char* dspark_markov_check(const DsparkMarkov* m);
// Bytes of scratch one sequence's task needs.
DSPARK_API int64_t dspark_markov_scratch(const DsparkMarkov* m);
// Task b: sequence b's k drafts and their distributions.
DSPARK_API void dspark_markov_row(const DsparkMarkov* m, int64_t b, float* scratch);
}
