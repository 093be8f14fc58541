// The draft's Markov sampler, unrolled, on the CPU: what DraftStep.sample computes after the block's
// base logits (modeling/draft.py), as one op rather than ~60 small ONNX ones (ort_cpu.py).
//
// Draft i of a sequence: z = (base[first + i] + w1[prev] @ w2^T) / temperature over the draft
// vocabulary, prev the anchor for i = 0 and the previous draft's target id after; q_i =
// softmax(z) written at the target ids j + d2t[j] (zero elsewhere), and the draft is
// argmax(z + noise_i) (the first of equal maxima, as ONNX's ArgMax; noise_i is over the target's
// ids, draft id j taking that of j + d2t[j]), mapped to its target id,
// whose w1 row conditions the next draft. Each sequence is one task, in one fixed order, so its
// drafts do not depend on the others in the call.
//
// With top_k K > 0 (vLLM's dspark_draft_topk, DraftStep.sample), draft i's candidates are the K
// largest of its base row (ties to the lower id, as ONNX's TopK), and only they get the bias, each a
// dot product with its own markov_w2 row: K x rank weights read rather than Vd x rank (39M at
// 151936 ids and rank 256, seven times a step). z is -inf off them, so q is zero there and the
// draft is one of them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel.h"
#include "../cpu/vec.h"

using namespace dspark_vec;

const char* dspark_markov_check(const DsparkMarkov* m) {
    if (m->first < 0 || m->first + m->k > m->R) return "the drafts' rows run past the block";
    if (m->top_k < 0 || m->top_k > m->Vd) return "top_k outside 0 .. the draft vocabulary";
    for (int64_t j = 0; j < m->Vd; ++j) {
        if (j + m->d2t[j] < 0 || j + m->d2t[j] >= m->V) return "d2t maps a draft id outside the target vocabulary";
        if (m->Vd == m->V && m->d2t[j]) return "d2t moves an id of a draft over the whole target vocabulary";
    }
    for (int64_t b = 0; b < m->B; ++b)
        if (m->anchor[b] < 0 || m->anchor[b] >= m->V) return "an anchor outside the target vocabulary";
    return nullptr;
}

namespace {

inline int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

// z = (base + row @ w2t) / temperature and scores = z + noise over the draft vocabulary, each
// column's bias summed over the rank in order; the columns past Vd (up to a whole vector) -inf.
void logits(const DsparkMarkov* m, const float* base, const float* noise, const float* row, float temperature,
            float* z, float* scores) {
    const int64_t Vd = m->Vd, full = Vd / LANES * LANES;
    for (int64_t j = 0; j < full; j += LANES) {
        Vec bias{};
        for (int64_t r = 0; r < m->rank; ++r) bias += splat(row[r]) * load(m->w2t + r * Vd + j);
        const Vec x = (load(base + j) + bias) / splat(temperature);
        store(z + j, x);
        store(scores + j, x + load(noise + j));
    }
    for (int64_t j = full; j < Vd; ++j) {
        float bias = 0.f;
        for (int64_t r = 0; r < m->rank; ++r) bias += row[r] * m->w2t[r * Vd + j];
        z[j] = (base[j] + bias) / temperature;
        scores[j] = z[j] + noise[j];
    }
    for (int64_t j = Vd; j < padded(Vd); ++j) z[j] = scores[j] = -INFINITY;
}

struct Candidate {
    float value;
    int64_t id;
};

// Heap order whose top is the candidate to drop first: the lowest value, of equal values the higher id.
inline bool keeps_before(const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// The K largest of x[0, n) into top (in no order), ties to the lower id: a heap of K, and a span of
// x is looked at value by value only where its maximum beats the heap's lowest (after the first few
// spans, almost none does).
void largest(const float* x, int64_t n, int64_t K, Candidate* top) {
    constexpr int64_t SPAN = 16 * LANES;
    for (int64_t j = 0; j < K; ++j) top[j] = {x[j], j};
    std::make_heap(top, top + K, keeps_before);
    const auto offer = [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j)
            if (x[j] > top[0].value) {   // an equal value has a higher id than any kept: it loses
                std::pop_heap(top, top + K, keeps_before);
                top[K - 1] = {x[j], j};
                std::push_heap(top, top + K, keeps_before);
            }
    };
    const int64_t aligned = std::min(n, (K + SPAN - 1) / SPAN * SPAN);
    offer(K, aligned);
    int64_t j = aligned;
    for (; j + SPAN <= n; j += SPAN)
        if (highest(x + j, SPAN) > top[0].value) offer(j, j + SPAN);
    offer(j, n);
}

// Draft i over its candidates: their logits z (then exponentials) in z[0, K), -inf padded to a
// vector; the choice, the first maximum of z + noise by draft id; q written at their target ids.
int64_t draw_candidates(const DsparkMarkov* m, const float* base, const float* noise, const float* row,
                        float temperature, Candidate* top, float* z, float* q) {
    const int64_t K = m->top_k;
    largest(base, m->Vd, K, top);
    int64_t choice = -1;
    float best = -INFINITY;
    for (int64_t c = 0; c < K; ++c) {
        const float* w2 = m->w2 + top[c].id * m->rank;
        float bias = 0.f;
        for (int64_t r = 0; r < m->rank; ++r) bias += row[r] * w2[r];
        z[c] = (top[c].value + bias) / temperature;
        const float score = z[c] + noise[top[c].id + m->d2t[top[c].id]];
        if (choice < 0 || score > best || (score == best && top[c].id < choice)) best = score, choice = top[c].id;
    }
    for (int64_t c = K; c < padded(K); ++c) z[c] = -INFINITY;
    const float share = exponentials(z, padded(K));
    std::memset(q, 0, size_t(m->V) * sizeof(float));
    for (int64_t c = 0; c < K; ++c) q[top[c].id + m->d2t[top[c].id]] = z[c] * share;
    return choice;
}

}  // namespace

int64_t dspark_markov_scratch(const DsparkMarkov* m) {
    if (m->top_k) return m->top_k * int64_t(sizeof(Candidate)) + padded(m->top_k) * int64_t(sizeof(float));
    return 3 * padded(m->Vd) * int64_t(sizeof(float));
}

void dspark_markov_row(const DsparkMarkov* m, int64_t b, float* scratch) {
    if (m->top_k) {
        auto* top = reinterpret_cast<Candidate*>(scratch);
        float* z = reinterpret_cast<float*>(top + m->top_k);
        const float* row = m->w1 + m->anchor[b] * m->rank;
        for (int64_t i = 0; i < m->k; ++i) {
            const int64_t choice = draw_candidates(
                m, m->base + (b * m->R + m->first + i) * m->Vd, m->noise + (b * m->k + i) * m->V, row,
                m->temperature[b], top, z, m->q + (b * m->k + i) * m->V);
            const int64_t token = choice + m->d2t[choice];
            m->tokens[b * m->k + i] = token;
            row = m->w1 + token * m->rank;
        }
        return;
    }
    const int64_t Vd = m->Vd, width = padded(Vd);
    float* z = scratch;            // the draft's logits, then their exponentials
    float* scores = scratch + width;
    float* picked = scratch + 2 * width;   // a reduced vocabulary's noise, by draft id
    const float* row = m->w1 + m->anchor[b] * m->rank;
    for (int64_t i = 0; i < m->k; ++i) {
        const float* noise = m->noise + (b * m->k + i) * m->V;
        if (Vd != m->V) {
            for (int64_t j = 0; j < Vd; ++j) picked[j] = noise[j + m->d2t[j]];
            noise = picked;
        }
        logits(m, m->base + (b * m->R + m->first + i) * Vd, noise, row, m->temperature[b], z, scores);
        const float best = highest(scores, width);
        int64_t choice = 0;
        while (choice < Vd - 1 && !(scores[choice] == best)) ++choice;   // the first maximum
        const float share = exponentials(z, width);
        float* q = m->q + (b * m->k + i) * m->V;
        std::memset(q, 0, size_t(m->V) * sizeof(float));
        for (int64_t j = 0; j < Vd; ++j) q[j + m->d2t[j]] = z[j] * share;
        const int64_t token = choice + m->d2t[choice];
        m->tokens[b * m->k + i] = token;
        row = m->w1 + token * m->rank;
    }
}
