// The draft's Markov sampler, unrolled, on the CPU: what DraftStep.sample computes after the block's
// base logits (modeling/draft.py), as one op rather than ~60 small ONNX ones (ort_cpu.py).
//
// Draft i of a sequence: z = (base[first + i] + w1[prev] @ w2^T) / temperature over the draft
// vocabulary, prev the anchor for i = 0 and the previous draft's target id after; q_i =
// softmax(z) written at the target ids j + d2t[j] (zero elsewhere), and the draft is
// argmax(z + noise_i) (the first of equal maxima, as ONNX's ArgMax), mapped to its target id,
// whose w1 row conditions the next draft. Each sequence is one task, in one fixed order, so its
// drafts do not depend on the others in the call.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel.h"
#include "../cpu/vec.h"

using namespace dspark_vec;

const char* dspark_markov_check(const DsparkMarkov* m) {
    if (m->first < 0 || m->first + m->k > m->R) return "the drafts' rows run past the block";
    for (int64_t j = 0; j < m->Vd; ++j)
        if (j + m->d2t[j] < 0 || j + m->d2t[j] >= m->V) return "d2t maps a draft id outside the target vocabulary";
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

}  // namespace

int64_t dspark_markov_scratch(const DsparkMarkov* m) { return 2 * padded(m->Vd) * int64_t(sizeof(float)); }

void dspark_markov_row(const DsparkMarkov* m, int64_t b, float* scratch) {
    const int64_t Vd = m->Vd, width = padded(Vd);
    float* z = scratch;            // the draft's logits, then their exponentials
    float* scores = scratch + width;
    const float* row = m->w1 + m->anchor[b] * m->rank;
    for (int64_t i = 0; i < m->k; ++i) {
        logits(m, m->base + (b * m->R + m->first + i) * Vd, m->noise + (b * m->k + i) * Vd, row,
               m->temperature[b], z, scores);
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
