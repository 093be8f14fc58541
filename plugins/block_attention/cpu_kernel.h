// The CPU attention kernel's C interface (cpu_kernel.cpp), for the ONNX Runtime op and tests.
#pragma once
#include <cstdint>

#ifndef DSPARK_API
#define DSPARK_API __attribute__((visibility("default")))
#endif

extern "C" {

// One call: B sequences of R new rows, heads-first as BlockAttention has them; the caches a
// pool of P slots of C rows, batch row b on slot slots[b], its new rows at start[b] on. Causal
// (the target's), row i sees positions 0 .. start + i; not (the draft's block), every row sees
// 0 .. start + R - 1.
struct DsparkAttention {
    int64_t B, R, heads, kv_heads, D, P, C;
    float scale;
    const float* q;       // [B, heads, R, D]
    const float* k_new;   // [B, kv_heads, R, D]
    const float* v_new;
    float* k_cache;       // [P, kv_heads, C, D], written in place
    float* v_cache;
    const int64_t* start; // [B]
    const int64_t* slots; // [B]
    float* out;           // [B, heads, R, D]
    int64_t causal;       // 1 or 0
};

// Null, or what is wrong with the call (in words).
DSPARK_API const char* dspark_attention_check(const DsparkAttention* a);
// Write every sequence's new K/V rows into its slot (before any head attends).
DSPARK_API void dspark_attention_write(const DsparkAttention* a);
// Bytes of scratch one head task needs.
DSPARK_API int64_t dspark_attention_scratch(const DsparkAttention* a);
// Task b * heads + h: every query row of sequence b, head h.
DSPARK_API void dspark_attention_head(const DsparkAttention* a, int64_t task, float* scratch);
}
