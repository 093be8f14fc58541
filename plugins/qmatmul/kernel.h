// The kernel's C interface (kernel.cpp), for the ONNX Runtime op (ort_op.cpp) and for tests (ctypes).
#pragma once
#include <cstdint>

#ifndef DSPARK_API
#define DSPARK_API __attribute__((visibility("default")))
#endif

extern "C" {

// A weight in the kernel's layout (layout.py): for each tile of 16 columns and each block of 32 k,
// `bits` * 64 bytes of integers; per tile and block, 16 scales, 16 offsets (or none) and, for
// 8 bits, 16 integer column sums (6 bits: Q6_K, below). A K-quant weight (GGUF Q4_K / Q5_K) has no float scales or
// offsets: its blocks' are made as the file holds them, from 6-bit integers per block and two
// fp16 per super-block of 8 blocks: scale d * sc, offset middle * (d * sc) - dmin * m (each product
// exact in float32, so the same bits as the float32 tables they replace, in under a third of
// their bytes).
struct DsparkQWeight {
    int32_t bits;           // 4, 8, or 6 (Q6_K: `sub` holds each half block's int8 scale, `super` d)
    int32_t K, N;           // N: the real columns (the last tile is padded with zero weights)
    const uint8_t* q;       // [tiles, K / 32, bits * 64]
    const float* scales;    // [tiles, K / 32, 16], or null for a K-quant
    const float* offsets;   // [tiles, K / 32, 16] or null
    const int32_t* wsums;   // [tiles, K / 32, 16] for 8 bits, else null
    const uint8_t* sub;     // K-quant: [tiles, K / 32, 32], each block's 16 sc then 16 m (Q6_K: int8
                            // sc of its first 16 k, then of its second); else null
    const uint16_t* super;  // K-quant: fp16 [tiles, K / 256, 32], each super-block's 16 d then 16 dmin
                            // (Q6_K: [tiles, K / 256, 16], d)
    float middle;           // K-quant: the integer the stored values were shifted by (8, Q5_K 16)
};

// Bytes of scratch for M rows of K.
DSPARK_API int64_t dspark_qmatmul_scratch(int64_t M, int64_t K);
// Quantize x's rows into the scratch, once per call, before the tiles.
DSPARK_API void dspark_qmatmul_quantize(const float* x, int64_t M, int64_t K, void* scratch);
// Tiles [first, last) of y [M, N] = x @ W for every row; any split of the tiles gives the same y.
DSPARK_API void dspark_qmatmul_tiles(const DsparkQWeight* w, const void* scratch, int64_t M, float* y,
                                     int64_t first, int64_t last);
// Float weights as [tiles, K, 32]: tiles [first, last) of y [M, N] = x [M, K] @ W, each output
// value a sum over k in order.
DSPARK_API void dspark_fmatmul_tiles(const float* w, int64_t K, int64_t N, const float* x, int64_t M,
                                     float* y, int64_t first, int64_t last);
// fp16 weights in the same layout, x widened to float32 beforehand (dspark_half_to_float), y fp16
// (each value rounded once, to nearest even): an fp16 graph's MatMul with float32 sums.
DSPARK_API void dspark_hmatmul_tiles(const uint16_t* w, int64_t K, int64_t N, const float* x, int64_t M,
                                     uint16_t* y, int64_t first, int64_t last);
// The same with a float32 y (a MoE expert's products, summed before they are rounded).
DSPARK_API void dspark_hmatmul_float_tiles(const uint16_t* w, int64_t K, int64_t N, const float* x, int64_t M,
                                           float* y, int64_t first, int64_t last);
DSPARK_API void dspark_half_to_float(const uint16_t* h, int64_t n, float* f);
DSPARK_API void dspark_float_to_half(const float* f, int64_t n, uint16_t* h);
}
