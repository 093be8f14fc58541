// The CPU kernels as ONNX Runtime custom ops of the domain `dspark.cpu`
// (SessionOptions.register_custom_ops_library): `QMatMul`, `FMatMul` and `HMatMul` (plugins/qmatmul),
// `QMoeExperts`, `FMoeExperts` and `HMoeExperts` (plugins/moe/ort_cpu.py), `CausalAttention` and
// `DraftAttention` (plugins/block_attention/cpu_kernel.cpp), and `MarkovSampler`
// (plugins/d2t_gather/cpu_kernel.cpp). The C API they call is declared in ort_api.h.
//
// The work is spread over ONNX Runtime's own intra-op threads (KernelContext_ParallelFor).
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../block_attention/cpu_kernel.h"
#include "../d2t_gather/cpu_kernel.h"
#include "../qmatmul/kernel.h"
#include "ort_api.h"

namespace {

using namespace dspark_ort;

// ---- QMatMul: x float [..., K]; the weight in the kernel's layout (qmatmul/layout.py): q uint8
// [tiles, K / 32, bits * 64], scales float [tiles, K / 32, 16] (empty for a K-quant), offsets
// float (same, or empty), sums int32 (same for 8 bits, or empty), a K-quant's sub uint8
// [tiles, K / 32, 32] and super fp16 [tiles, K / 256, 32] (Q6_K, 6 bits: [tiles, K / 256, 16]),
// else empty. Attributes `columns`: N;
// `middle`: a K-quant's shift of its values. Output: float [..., N].

struct Product {   // QMatMul, FMatMul and HMatMul: the output's columns (and QMatMul's middle)
    int64_t columns, middle;
};

// y [rows, N] = x @ w on QMatMul's kernel: x's rows quantized once, the tiles over ONNX Runtime's
// threads (the dense op's and each MoE expert's products).
OrtStatus* quantized_product(OrtKernelContext* context, const DsparkQWeight& w, int64_t tiles, const float* x,
                             int64_t rows, float* y) {
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(static_cast<size_t>(dspark_qmatmul_scratch(rows, w.K)));
    dspark_qmatmul_quantize(x, rows, w.K, scratch.data());
    struct Call {   // one product's work, for the ParallelFor callbacks
        const DsparkQWeight* w;
        const void* scratch;
        int64_t rows;
        float* y;
    } call{&w, scratch.data(), rows, y};
    auto tile = [](void* data, size_t t) {
        auto* c = static_cast<Call*>(data);
        dspark_qmatmul_tiles(c->w, c->scratch, c->rows, c->y, int64_t(t), int64_t(t) + 1);
    };
    return parallel_for(context, tile, size_t(tiles), &call);
}

OrtStatus* qmatmul(void* state, OrtKernelContext* context) {
    const int64_t columns = static_cast<Product*>(state)->columns;
    const Tensor x = input(context, 0), q = input(context, 1), scales = input(context, 2),
                 offsets = input(context, 3), sums = input(context, 4), sub = input(context, 5),
                 super = input(context, 6);
    if (x.dims.empty() || q.dims.size() != 3 || (scales.size() ? scales : sub).dims.size() != 3)
        return error("QMatMul", "expected x [..., K], q [tiles, K / 32, bytes] and scales [tiles, K / 32, 16] "
                                "(or a K-quant's sub [tiles, K / 32, 32])");
    const int64_t K = x.dims.back(), bits = q.dims[2] / 64;
    if (q.dims[1] * 32 != K || (bits != 4 && bits != 6 && bits != 8) || (bits == 6 && !sub.size()) ||
        q.dims[0] * 16 < columns)
        return error("QMatMul", "x's K = " + std::to_string(K) + " does not match the weight's blocks (" +
                     std::to_string(q.dims[1]) + " of 32, " + std::to_string(q.dims[2]) + " bytes)");
    if (sub.size() && (K % 256 || sub.size() != q.dims[0] * q.dims[1] * 32 ||
                       super.size() != q.dims[0] * (K / 256) * (bits == 6 ? 16 : 32)))
        return error("QMatMul", "a K-quant's sub and super do not match its " + std::to_string(q.dims[0]) +
                     " tiles of " + std::to_string(K) + " k");
    std::vector<int64_t> out_dims = x.dims;
    out_dims.back() = columns;
    void* y = output(context, 0, out_dims);
    const int64_t rows = x.size() / K;
    if (rows == 0) return nullptr;
    const DsparkQWeight weight{int32_t(bits), int32_t(K), int32_t(columns), static_cast<const uint8_t*>(q.data),
                               scales.size() ? static_cast<const float*>(scales.data) : nullptr,
                               offsets.size() ? static_cast<const float*>(offsets.data) : nullptr,
                               sums.size() ? static_cast<const int32_t*>(sums.data) : nullptr,
                               sub.size() ? static_cast<const uint8_t*>(sub.data) : nullptr,
                               super.size() ? static_cast<const uint16_t*>(super.data) : nullptr,
                               float(static_cast<Product*>(state)->middle)};
    return quantized_product(context, weight, q.dims[0], static_cast<const float*>(x.data), rows,
                             static_cast<float*>(y));
}

OrtStatus* create_product(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    auto* state = new Product{0, 0};
    return created(state, slot<GetAttributeInt64>(g_api, KERNEL_INFO_GET_ATTRIBUTE_INT64)(info, "columns", &state->columns),
                   kernel);
}

OrtStatus* create_quantized_product(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    auto* state = new Product{0, 0};
    const auto attribute = slot<GetAttributeInt64>(g_api, KERNEL_INFO_GET_ATTRIBUTE_INT64);
    OrtStatus* status = attribute(info, "columns", &state->columns);
    return created(state, status ? status : attribute(info, "middle", &state->middle), kernel);
}

// ---- FMatMul: x float [..., K]; w float [tiles, K, 32] (qmatmul/layout.py's pack_float).
// Attribute `columns`: N. Output: float [..., N]. HMatMul: the same with fp16 x, w and output
// (an fp16 graph's products, its weights kept in fp16).

// y [rows, N] = x @ w on FMatMul's kernel, the tiles over ONNX Runtime's threads: W and Y float, or
// uint16_t for fp16 (the dense ops' products, and each MoE expert's with a float32 Y).
template <typename W, typename Y>
OrtStatus* float_tiles_product(OrtKernelContext* context, const W* w, int64_t tiles, int64_t K, int64_t N,
                               const float* x, int64_t rows, Y* y) {
    struct Call {
        const W* w;
        const float* x;
        int64_t K, N, rows;
        Y* y;
    } call{w, x, K, N, rows, y};
    auto tile = [](void* data, size_t t) {
        auto* c = static_cast<Call*>(data);
        if constexpr (std::is_same_v<W, float>)
            dspark_fmatmul_tiles(c->w, c->K, c->N, c->x, c->rows, c->y, int64_t(t), int64_t(t) + 1);
        else if constexpr (std::is_same_v<Y, float>)
            dspark_hmatmul_float_tiles(c->w, c->K, c->N, c->x, c->rows, c->y, int64_t(t), int64_t(t) + 1);
        else
            dspark_hmatmul_tiles(c->w, c->K, c->N, c->x, c->rows, c->y, int64_t(t), int64_t(t) + 1);
    };
    return parallel_for(context, tile, size_t(tiles), &call);
}

template <typename T>   // float, or uint16_t for fp16
OrtStatus* float_product(void* state, OrtKernelContext* context) {
    constexpr bool half = std::is_same_v<T, uint16_t>;
    const char* op = half ? "HMatMul" : "FMatMul";
    const int64_t columns = static_cast<Product*>(state)->columns;
    const Tensor x = input(context, 0), w = input(context, 1);
    if (x.dims.empty() || w.dims.size() != 3 || w.dims[2] != 32 || w.dims[1] != x.dims.back()
            || w.dims[0] * 32 < columns)
        return error(op, "expected x [..., K] and w [tiles, K, 32]");
    std::vector<int64_t> out_dims = x.dims;
    out_dims.back() = columns;
    auto* y = static_cast<T*>(output(context, 0, out_dims));
    const int64_t K = x.dims.back(), rows = x.size() / K;
    if (rows == 0) return nullptr;
    const float* xf = static_cast<const float*>(x.data);
    thread_local std::vector<float> wide;   // fp16 x, widened once per call
    if constexpr (half) {
        wide.resize(size_t(x.size()));
        dspark_half_to_float(static_cast<const uint16_t*>(x.data), x.size(), wide.data());
        xf = wide.data();
    }
    return float_tiles_product(context, static_cast<const T*>(w.data), w.dims[0], K, columns, xf, rows, y);
}

// ---- QMoeExperts, FMoeExperts, HMoeExperts: a MoE layer's routed experts on the products'
// kernels (plugins/moe/ort_cpu.py). x [T, H]; experts int64 and weights [T, k]; each expert's
// gate_up ([2I, H], gate then up) and down ([H, I]) in its product's layout, stacked on a leading
// expert axis: QMatMul's q, scales and sums (QMoeExperts), FMatMul's float32 (FMoeExperts) or
// fp16 (HMoeExperts) tiles. Attributes `intermediate`: I; `activation`: the gate's, 0 SiLU, 1 the
// tanh-approximated GELU. Output [T, H], x's type:
// out_t = sum over t's experts e, ascending, of weight * down_e(act(gate) * up). Each row goes
// through its kernel as a dense layer's does, in float32 (an fp16 x widened, the output rounded
// once), so a token's result does not depend on the other tokens of the call.

struct Experts {
    int64_t intermediate, activation;
};

// act(gate) as gate * sigmoid(z): SiLU z = gate; the tanh GELU z = 2 sqrt(2 / pi) (gate + 0.044715 gate^3)
inline float gated(float gate, int64_t activation) {
    const float z = activation == 0 ? gate : 1.5957691216057308f * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.f + std::exp(-z));
}

// Each stack's `product`: y [rows, N] = x @ expert e's matrix, on its dense op's kernel.
struct QuantizedStack {   // q [E, tiles, K / 32, bytes], scales and sums [E, tiles, K / 32, 16]
    Tensor q, scales, sums;
    static constexpr int INPUTS = 3;
    int64_t experts() const { return q.dims[0]; }
    bool takes(int64_t K, int64_t N) const {
        return q.dims.size() == 4 && q.dims[2] * 32 == K && q.dims[1] * 16 >= N;
    }
    OrtStatus* product(OrtKernelContext* context, int64_t e, int64_t K, int64_t N, const float* x,
                       int64_t rows, float* y) const {
        const int64_t per = q.dims[1] * q.dims[2];   // the expert's blocks
        const bool eight = q.dims[3] == 512;
        const DsparkQWeight w{eight ? 8 : 4, int32_t(K), int32_t(N),
                              static_cast<const uint8_t*>(q.data) + e * per * q.dims[3],
                              static_cast<const float*>(scales.data) + e * per * 16, nullptr,
                              eight ? static_cast<const int32_t*>(sums.data) + e * per * 16 : nullptr};
        return quantized_product(context, w, q.dims[1], x, rows, y);
    }
};

template <typename W>   // float, or uint16_t for fp16
struct FloatStack {   // [E, tiles, K, 32]
    Tensor w;
    static constexpr int INPUTS = 1;
    int64_t experts() const { return w.dims[0]; }
    bool takes(int64_t K, int64_t N) const {
        return w.dims.size() == 4 && w.dims[2] == K && w.dims[3] == 32 && w.dims[1] * 32 >= N;
    }
    OrtStatus* product(OrtKernelContext* context, int64_t e, int64_t K, int64_t N, const float* x,
                       int64_t rows, float* y) const {
        return float_tiles_product(context, static_cast<const W*>(w.data) + e * w.dims[1] * K * 32, w.dims[1],
                                   K, N, x, rows, y);
    }
};

template <typename Stack>
Stack stack_at(OrtKernelContext* context, size_t first) {
    if constexpr (Stack::INPUTS == 3) return {input(context, first), input(context, first + 1), input(context, first + 2)};
    else return {input(context, first)};
}

template <typename X, typename Stack>   // X: x's and the output's type (float or uint16_t for fp16)
OrtStatus* moe_experts(void* state, OrtKernelContext* context) {
    const char* op = std::is_same_v<Stack, QuantizedStack> ? "QMoeExperts"
                     : std::is_same_v<X, float> ? "FMoeExperts" : "HMoeExperts";
    const int64_t I = static_cast<Experts*>(state)->intermediate, act = static_cast<Experts*>(state)->activation;
    const Tensor x = input(context, 0), experts = input(context, 1), weights = input(context, 2);
    const Stack gate_up = stack_at<Stack>(context, 3), down = stack_at<Stack>(context, 3 + Stack::INPUTS);
    if (x.dims.size() != 2 || experts.dims.size() != 2 || experts.dims != weights.dims
            || experts.dims[0] != x.dims[0] || !gate_up.takes(x.dims[1], 2 * I) || !down.takes(I, x.dims[1])
            || gate_up.experts() != down.experts())
        return error(op, "expected x [T, H], experts and weights [T, k], and each expert's gate_up [2I, H] "
                     "and down [H, I] stacked in the kernel's layout");
    const int64_t T = x.dims[0], H = x.dims[1], k = experts.dims[1], E = gate_up.experts();
    thread_local std::vector<float> wide, wide_weights, xs, h, a, y, acc;
    const float* xf = static_cast<const float*>(x.data);
    const float* weight = static_cast<const float*>(weights.data);
    if constexpr (!std::is_same_v<X, float>) {   // fp16: widened once
        wide.resize(size_t(T * H));
        dspark_half_to_float(static_cast<const uint16_t*>(x.data), T * H, wide.data());
        xf = wide.data();
        wide_weights.resize(size_t(T * k));
        dspark_half_to_float(static_cast<const uint16_t*>(weights.data), T * k, wide_weights.data());
        weight = wide_weights.data();
    }
    const auto* chosen = static_cast<const int64_t*>(experts.data);
    std::vector<std::vector<std::pair<int64_t, float>>> routed(static_cast<size_t>(E));   // expert -> (token, weight)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = chosen[t * k + j];
            if (e < 0 || e >= E) return error(op, "an expert id outside 0 .. " + std::to_string(E - 1));
            routed[size_t(e)].push_back({t, weight[t * k + j]});
        }
    acc.assign(size_t(T * H), 0.f);
    for (int64_t e = 0; e < E; ++e) {   // ascending: each token adds its experts in one order
        const auto& tokens = routed[size_t(e)];
        const int64_t n = int64_t(tokens.size());
        if (n == 0) continue;
        xs.resize(size_t(n * H));
        h.resize(size_t(n * 2 * I));
        a.resize(size_t(n * I));
        y.resize(size_t(n * H));
        for (int64_t r = 0; r < n; ++r)
            std::memcpy(xs.data() + r * H, xf + tokens[size_t(r)].first * H, size_t(H) * sizeof(float));
        if (OrtStatus* status = gate_up.product(context, e, H, 2 * I, xs.data(), n, h.data())) return status;
        for (int64_t r = 0; r < n; ++r)
            for (int64_t i = 0; i < I; ++i) {
                const float gate = h[size_t(r * 2 * I + i)], up = h[size_t(r * 2 * I + I + i)];
                a[size_t(r * I + i)] = gated(gate, act) * up;
            }
        if (OrtStatus* status = down.product(context, e, I, H, a.data(), n, y.data())) return status;
        for (int64_t r = 0; r < n; ++r) {
            float* row = acc.data() + tokens[size_t(r)].first * H;
            const float w = tokens[size_t(r)].second;
            for (int64_t c = 0; c < H; ++c) row[c] += w * y[size_t(r * H + c)];
        }
    }
    void* out = output(context, 0, x.dims);
    if constexpr (std::is_same_v<X, float>) std::memcpy(out, acc.data(), acc.size() * sizeof(float));
    else dspark_float_to_half(acc.data(), T * H, static_cast<uint16_t*>(out));
    return nullptr;
}

OrtStatus* create_experts(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    auto* state = new Experts{0, 0};
    const auto attribute = slot<GetAttributeInt64>(g_api, KERNEL_INFO_GET_ATTRIBUTE_INT64);
    OrtStatus* status = attribute(info, "intermediate", &state->intermediate);
    if (status == nullptr) status = attribute(info, "activation", &state->activation);
    return created(state, status, kernel);
}

// Tasks 0 .. tasks - 1 over ONNX Runtime's threads: RUN(kernel, t, task t's own `bytes` of scratch)
// (the attention's heads, the sampler's sequences). The scratch is kept between calls: it only
// grows, never cleared.
template <typename Kernel, void (*RUN)(const Kernel*, int64_t, float*)>
OrtStatus* tasks_with_scratch(OrtKernelContext* context, const Kernel& kernel, int64_t tasks, int64_t bytes) {
    struct Call {
        const Kernel* kernel;
        float* scratch;
        int64_t stride;   // floats per task
    } call{&kernel, nullptr, bytes / int64_t(sizeof(float))};
    thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(tasks * call.stride)) scratch.resize(size_t(tasks * call.stride));
    call.scratch = scratch.data();
    auto task = [](void* data, size_t t) {
        auto* c = static_cast<Call*>(data);
        RUN(c->kernel, int64_t(t), c->scratch + int64_t(t) * c->stride);
    };
    return parallel_for(context, task, size_t(tasks), &call);
}

// ---- CausalAttention: q [B, H, R, D], k_new / v_new [B, Hkv, R, D], k_cache / v_cache
// [P, Hkv, C, D] (a pool of slots), start [B], slots [B] int64. Attribute `scale`. Outputs: out
// [B, H, R, D] and the two caches, which the runtime binds to the input caches' buffers (written
// in place; an output of its own gets a copy of the input first).
// ---- DraftAttention: the same inputs, then ctx_k / ctx_v [B, Hkv, Rc, D] and ctx_start [B]: the
// draft's context rows written at ctx_start (its CacheWrite), then its block written at start and
// attending non-causally (every row sees the positions before start + R).

struct Attention {
    float scale;
};

template <bool DRAFT>
OrtStatus* pool_attention(void* state, OrtKernelContext* context) {
    const char* op = DRAFT ? "DraftAttention" : "CausalAttention";
    const Tensor q = input(context, 0), k_new = input(context, 1), v_new = input(context, 2),
                 k_cache = input(context, 3), v_cache = input(context, 4), start = input(context, 5),
                 slots = input(context, 6);
    if (q.dims.size() != 4 || k_new.dims.size() != 4 || k_cache.dims.size() != 4 || k_new.dims != v_new.dims
            || k_cache.dims != v_cache.dims || start.size() != q.dims[0] || slots.size() != q.dims[0])
        return error(op, "expected q [B, H, R, D], k_new / v_new [B, Hkv, R, D], caches "
                     "[P, Hkv, C, D], start [B] and slots [B]");
    auto* k_out = static_cast<float*>(output(context, 1, k_cache.dims));
    auto* v_out = static_cast<float*>(output(context, 2, v_cache.dims));
    if (k_out != k_cache.data) std::memcpy(k_out, k_cache.data, k_cache.size() * sizeof(float));
    if (v_out != v_cache.data) std::memcpy(v_out, v_cache.data, v_cache.size() * sizeof(float));
    const DsparkAttention a{q.dims[0], q.dims[2], q.dims[1], k_new.dims[1], q.dims[3], k_cache.dims[0],
                            k_cache.dims[2], static_cast<Attention*>(state)->scale,
                            static_cast<const float*>(q.data), static_cast<const float*>(k_new.data),
                            static_cast<const float*>(v_new.data), k_out, v_out,
                            static_cast<const int64_t*>(start.data), static_cast<const int64_t*>(slots.data),
                            static_cast<float*>(output(context, 0, q.dims)), DRAFT ? 0 : 1};
    if (const char* wrong = dspark_attention_check(&a)) return error(op, wrong);
    if constexpr (DRAFT) {   // the context rows: a write of their own, before the block's
        const Tensor ctx_k = input(context, 7), ctx_v = input(context, 8), ctx_start = input(context, 9);
        if (ctx_k.dims.size() != 4 || ctx_k.dims != ctx_v.dims || ctx_k.dims[0] != q.dims[0]
                || ctx_k.dims[1] != k_new.dims[1] || ctx_k.dims[3] != q.dims[3] || ctx_start.size() != q.dims[0])
            return error(op, "expected ctx_k / ctx_v [B, Hkv, Rc, D] and ctx_start [B]");
        DsparkAttention rows = a;
        rows.R = ctx_k.dims[2];
        rows.k_new = static_cast<const float*>(ctx_k.data);
        rows.v_new = static_cast<const float*>(ctx_v.data);
        rows.start = static_cast<const int64_t*>(ctx_start.data);
        if (const char* wrong = dspark_attention_check(&rows)) return error(op, wrong);
        dspark_attention_write(&rows);
    }
    dspark_attention_write(&a);
    return tasks_with_scratch<DsparkAttention, dspark_attention_head>(context, a, a.B * a.heads,
                                                                      dspark_attention_scratch(&a));
}

OrtStatus* create_attention(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    auto* state = new Attention{0.f};
    return created(state, slot<GetAttributeFloat>(g_api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT)(info, "scale", &state->scale),
                   kernel);
}

// ---- MarkovSampler: base [B, R, Vd], anchor [B] int64, temperature [B], noise [B, k, V], d2t [Vd]
// int64, markov_w1 [V, r], and markov_w2 transposed [r, Vd] (top_k 0) or as it is [Vd, r] (top_k K).
// Attributes `first`: the block row of the first draft; `top_k`: each draft over its K largest base
// logits, or 0. Outputs: tokens [B, k] int64 and q [B, k, V] (plugins/d2t_gather/ort_cpu.py).

struct Sampler {
    int64_t first, top_k;
};

OrtStatus* markov_sampler(void* state, OrtKernelContext* context) {
    const Tensor base = input(context, 0), anchor = input(context, 1), temperature = input(context, 2),
                 noise = input(context, 3), d2t = input(context, 4), w1 = input(context, 5), w2 = input(context, 6);
    const Sampler& s = *static_cast<Sampler*>(state);
    const size_t rank_axis = s.top_k ? 1 : 0;   // markov_w2 [Vd, r] with top_k, transposed [r, Vd] without
    if (base.dims.size() != 3 || noise.dims.size() != 3 || w1.dims.size() != 2 || w2.dims.size() != 2
            || noise.dims[0] != base.dims[0] || noise.dims[2] != w1.dims[0] || anchor.size() != base.dims[0]
            || temperature.size() != base.dims[0] || d2t.size() != base.dims[2]
            || w2.dims[1 - rank_axis] != base.dims[2] || w2.dims[rank_axis] != w1.dims[1])
        return error("MarkovSampler", "expected base [B, R, Vd], anchor and temperature [B], noise [B, k, V], "
                     "d2t [Vd], markov_w1 [V, r] and markov_w2 [Vd, r] (top_k) or transposed [r, Vd]");
    const int64_t B = base.dims[0], k = noise.dims[1], V = w1.dims[0];
    const auto* weight = static_cast<const float*>(w2.data);
    const DsparkMarkov m{B, k, base.dims[1], s.first, base.dims[2], V, w1.dims[1], s.top_k,
                         static_cast<const float*>(base.data), static_cast<const int64_t*>(anchor.data),
                         static_cast<const float*>(temperature.data), static_cast<const float*>(noise.data),
                         static_cast<const int64_t*>(d2t.data), static_cast<const float*>(w1.data),
                         s.top_k ? nullptr : weight, s.top_k ? weight : nullptr,
                         static_cast<int64_t*>(output(context, 0, {B, k})),
                         static_cast<float*>(output(context, 1, {B, k, V}))};
    if (const char* wrong = dspark_markov_check(&m)) return error("MarkovSampler", wrong);
    return tasks_with_scratch<DsparkMarkov, dspark_markov_row>(context, m, B, dspark_markov_scratch(&m));
}

OrtStatus* create_sampler(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    auto* state = new Sampler{0, 0};
    const auto attribute = slot<GetAttributeInt64>(g_api, KERNEL_INFO_GET_ATTRIBUTE_INT64);
    OrtStatus* status = attribute(info, "first", &state->first);
    return created(state, status ? status : attribute(info, "top_k", &state->top_k), kernel);
}

// ---- registration

const OrtCustomOp g_ops[] = {
    make_op<Product>(
        [](const OrtCustomOp*) { return "QMatMul"; }, [](const OrtCustomOp*) -> size_t { return 7; },
        [](const OrtCustomOp*, size_t i) { return (const int[]){FLOAT, UINT8, FLOAT, FLOAT, INT32, UINT8, FLOAT16}[i]; },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_quantized_product, qmatmul),
    make_op<Product>(
        [](const OrtCustomOp*) { return "FMatMul"; }, [](const OrtCustomOp*) -> size_t { return 2; },
        [](const OrtCustomOp*, size_t) { return FLOAT; },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_product, float_product<float>),
    make_op<Product>(
        [](const OrtCustomOp*) { return "HMatMul"; }, [](const OrtCustomOp*) -> size_t { return 2; },
        [](const OrtCustomOp*, size_t) { return FLOAT16; },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_product, float_product<uint16_t>,
        [](const OrtCustomOp*, size_t) { return FLOAT16; }),
    make_op<Experts>(
        [](const OrtCustomOp*) { return "QMoeExperts"; }, [](const OrtCustomOp*) -> size_t { return 9; },
        [](const OrtCustomOp*, size_t i) {
            return (const int[]){FLOAT, INT64, FLOAT, UINT8, FLOAT, INT32, UINT8, FLOAT, INT32}[i];
        },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_experts, moe_experts<float, QuantizedStack>),
    make_op<Experts>(
        [](const OrtCustomOp*) { return "FMoeExperts"; }, [](const OrtCustomOp*) -> size_t { return 5; },
        [](const OrtCustomOp*, size_t i) { return i == 1 ? INT64 : FLOAT; },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_experts, moe_experts<float, FloatStack<float>>),
    make_op<Experts>(
        [](const OrtCustomOp*) { return "HMoeExperts"; }, [](const OrtCustomOp*) -> size_t { return 5; },
        [](const OrtCustomOp*, size_t i) { return i == 1 ? INT64 : FLOAT16; },
        [](const OrtCustomOp*) -> size_t { return 1; }, create_experts,
        moe_experts<uint16_t, FloatStack<uint16_t>>, [](const OrtCustomOp*, size_t) { return FLOAT16; }),
    make_op<Attention>(
        [](const OrtCustomOp*) { return "CausalAttention"; }, [](const OrtCustomOp*) -> size_t { return 7; },
        [](const OrtCustomOp*, size_t i) { return i < 5 ? FLOAT : INT64; },
        [](const OrtCustomOp*) -> size_t { return 3; }, create_attention, pool_attention<false>),
    make_op<Attention>(
        [](const OrtCustomOp*) { return "DraftAttention"; }, [](const OrtCustomOp*) -> size_t { return 10; },
        [](const OrtCustomOp*, size_t i) { return i < 5 || i == 7 || i == 8 ? FLOAT : INT64; },
        [](const OrtCustomOp*) -> size_t { return 3; }, create_attention, pool_attention<true>),
    make_op<Sampler>(
        [](const OrtCustomOp*) { return "MarkovSampler"; }, [](const OrtCustomOp*) -> size_t { return 7; },
        [](const OrtCustomOp*, size_t i) { return i == 1 || i == 4 ? INT64 : FLOAT; },
        [](const OrtCustomOp*) -> size_t { return 2; }, create_sampler, markov_sampler,
        [](const OrtCustomOp*, size_t i) { return i == 0 ? INT64 : FLOAT; }),
};

}  // namespace

extern "C" __attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    g_api = base->GetApi(API_VERSION);
    // ONNX Runtime before 1.17 has no API 17: nothing is registered (the lowering checks the
    // version before it loads this library)
    if (g_api == nullptr) return nullptr;
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* status = slot<CreateCustomOpDomain>(g_api, CREATE_CUSTOM_OP_DOMAIN)("dspark.cpu", &domain))
        return status;
    for (const OrtCustomOp& op : g_ops)
        if (OrtStatus* status = slot<CustomOpDomainAdd>(g_api, CUSTOM_OP_DOMAIN_ADD)(domain, &op))
            return status;
    return slot<AddCustomOpDomain>(g_api, ADD_CUSTOM_OP_DOMAIN)(options, domain);
}
