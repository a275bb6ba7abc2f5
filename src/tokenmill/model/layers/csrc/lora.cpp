#include "common.h"

// ---- LoRA deltas of a step's rows, each row through its own adapter ---------------------------------
// y[t, :] += B_s · (A_s · x[t, :]) for each row t whose slot s is not -1 (the base model's rows are left as
// they are). Only each row's own adapter is multiplied: the work is the rows' useful products, whatever the
// number of adapters in the step, where batched matmuls over every slot would multiply the others too.
//
//   a:  [slots * parts * rank, in]      slot-major; part p of slot s at rows (s * parts + p) * rank
//   bt: [slots * rank, out]             B transposed: slot s's rank r at row s * rank + r, every part's
//                                       columns (part p at columns offsets[p] .. offsets[p + 1])
// Each row's delta is summed apart (rank by rank, in order) and then added to y once, as y + (x·Aᵀ)·Bᵀ is.
// Rows are taken in groups of up to four of the same slot, so each element of A and B is loaded once per group,
// and each row's delta of a tile of columns is summed over the ranks in registers. With AVX2 (and AVX-512) the
// products are fused multiply-adds on 8-lane vectors blocked over several ranks of A and several vectors of B's
// columns; the portable build keeps plain loops.

namespace {

constexpr int64_t kGroupRows = 4;  // rows of one slot multiplied together: each A and B element loaded once for them

#ifndef TOKENMILL_AVX2
constexpr int64_t kLanes = 16;

// acc_i[o] += c_i * brow[o] for the group's four rows, o < size (kFull: size is kLanes, a count the compiler
// knows, so the loop becomes one vector operation per row).
template <bool kFull, typename w_t>
inline void add_rank(const w_t* brow, int64_t size, float c0, float c1, float c2, float c3, float* acc0,
                     float* acc1, float* acc2, float* acc3) {
  const int64_t count = kFull ? kLanes : size;
#pragma omp simd
  for (int64_t o = 0; o < count; ++o) {
    const float b = static_cast<float>(brow[o]);
    acc0[o] += c0 * b;
    acc1[o] += c1 * b;
    acc2[o] += c2 * b;
    acc3[o] += c3 * b;
  }
}
#endif

#ifdef TOKENMILL_AVX2
// Register blocking of the vector path: each x load feeds kBlockA ranks of A and each A load the group's rows
// (the A side); each B load feeds the group's rows over kBlockB vectors of 8 columns (the B side). AVX-512
// builds have 32 vector registers, so their blocks are twice as wide (16 accumulators instead of 8).
#ifdef TOKENMILL_AVX512
constexpr int64_t kBlockA = 4, kBlockB = 4;
#else
constexpr int64_t kBlockA = 2, kBlockB = 2;
#endif

// xa[i * width + j] = x_i · A_j for j in [j0, j0 + J): 8 lanes at a time with fused multiply-adds, the tail of
// `in` scalar.
template <int64_t J, typename w_t>
inline void a_ranks(const float* const* x, int64_t in, const w_t* ap, int64_t j0, int64_t width, float* xa) {
  const int64_t vec_end = in - in % 8;
  __m256 acc[kGroupRows][J];
  for (int64_t i = 0; i < kGroupRows; ++i)
    for (int64_t b = 0; b < J; ++b) acc[i][b] = _mm256_setzero_ps();
  for (int64_t k = 0; k < vec_end; k += 8) {
    __m256 xv[kGroupRows];
    for (int64_t i = 0; i < kGroupRows; ++i) xv[i] = _mm256_loadu_ps(x[i] + k);
    for (int64_t b = 0; b < J; ++b) {
      const __m256 av = load8(ap + (j0 + b) * in + k);
      for (int64_t i = 0; i < kGroupRows; ++i) acc[i][b] = _mm256_fmadd_ps(xv[i], av, acc[i][b]);
    }
  }
  for (int64_t i = 0; i < kGroupRows; ++i) {
    for (int64_t b = 0; b < J; ++b) {
      float sum = hsum256(acc[i][b]);
      for (int64_t k = vec_end; k < in; ++k) sum += x[i][k] * to_float(ap[(j0 + b) * in + k]);
      xa[i * width + j0 + b] = sum;
    }
  }
}

// The group's deltas of columns [first, first + 8 * T) of B's rows bp[r * out + ...], summed rank by rank in
// order from the rows' xa (c[i * width + r]), then added to y once.
template <int64_t T, typename w_t>
inline void b_columns(const w_t* bp, int64_t out, int64_t rank, const float* c, int64_t width, float* const* y,
                      int64_t n, int64_t first) {
  __m256 acc[kGroupRows][T];
  for (int64_t i = 0; i < kGroupRows; ++i)
    for (int64_t t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    __m256 cv[kGroupRows];
    for (int64_t i = 0; i < kGroupRows; ++i) cv[i] = _mm256_set1_ps(c[i * width + r]);
    for (int64_t t = 0; t < T; ++t) {
      const __m256 bv = load8(bp + r * out + first + 8 * t);
      for (int64_t i = 0; i < kGroupRows; ++i) acc[i][t] = _mm256_fmadd_ps(cv[i], bv, acc[i][t]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      float* yt = y[i] + first + 8 * t;
      _mm256_storeu_ps(yt, _mm256_add_ps(_mm256_loadu_ps(yt), acc[i][t]));
    }
  }
}
#endif

// The deltas of up to kGroupRows rows of slot s (rows[i] for i < n; missing ones repeat row 0, unused).
template <typename w_t>
void lora_group(const int64_t* rows, int64_t n, int64_t s, const float* xp, int64_t in, const w_t* ap,
                const w_t* bp, const std::vector<int64_t>& offsets, int64_t rank, float* yp, int64_t y_stride,
                int64_t out, float* xa) {
  const int64_t parts = offsets.size() - 1, width = parts * rank;
  const float* x[kGroupRows];
  for (int64_t i = 0; i < kGroupRows; ++i) x[i] = xp + rows[i < n ? i : 0] * in;
  const w_t* a_slot = ap + s * width * in;
  const w_t* b_slot = bp + s * rank * out;
#ifdef TOKENMILL_AVX2
  int64_t j = 0;
  for (; j + kBlockA <= width; j += kBlockA) a_ranks<kBlockA>(x, in, a_slot, j, width, xa);
  for (; j < width; ++j) a_ranks<1>(x, in, a_slot, j, width, xa);
  float* y[kGroupRows];
  for (int64_t i = 0; i < kGroupRows; ++i) y[i] = yp + rows[i < n ? i : 0] * y_stride;
  for (int64_t p = 0; p < parts; ++p) {
    const float* c = xa + p * rank;
    int64_t first = offsets[p];
    for (; first + 8 * kBlockB <= offsets[p + 1]; first += 8 * kBlockB)
      b_columns<kBlockB>(b_slot, out, rank, c, width, y, n, first);
    for (; first + 8 <= offsets[p + 1]; first += 8) b_columns<1>(b_slot, out, rank, c, width, y, n, first);
    for (; first < offsets[p + 1]; ++first) {  // the last columns of a part whose size is not a multiple of 8
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int64_t r = 0; r < rank; ++r) sum += c[i * width + r] * to_float(b_slot[r * out + first]);
        y[i][first] += sum;
      }
    }
  }
#else
  for (int64_t j = 0; j < width; ++j) {
    const w_t* arow = a_slot + j * in;
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
#pragma omp simd reduction(+ : acc0, acc1, acc2, acc3)
    for (int64_t k = 0; k < in; ++k) {
      const float av = static_cast<float>(arow[k]);
      acc0 += x[0][k] * av;
      acc1 += x[1][k] * av;
      acc2 += x[2][k] * av;
      acc3 += x[3][k] * av;
    }
    xa[j] = acc0;
    xa[width + j] = acc1;
    xa[2 * width + j] = acc2;
    xa[3 * width + j] = acc3;
  }
  // 16 columns at a time, every rank summed in registers for the group's rows, then added to y once.
  for (int64_t p = 0; p < parts; ++p) {
    const float* c = xa + p * rank;
    for (int64_t first = offsets[p]; first < offsets[p + 1]; first += kLanes) {
      const int64_t size = std::min(kLanes, offsets[p + 1] - first);
      float acc0[kLanes] = {}, acc1[kLanes] = {}, acc2[kLanes] = {}, acc3[kLanes] = {};
      for (int64_t r = 0; r < rank; ++r) {
        const w_t* brow = b_slot + r * out + first;
        const float c0 = c[r], c1 = c[width + r], c2 = c[2 * width + r], c3 = c[3 * width + r];
        if (size == kLanes) {
          add_rank<true>(brow, size, c0, c1, c2, c3, acc0, acc1, acc2, acc3);
        } else {
          add_rank<false>(brow, size, c0, c1, c2, c3, acc0, acc1, acc2, acc3);
        }
      }
      const float* accs[kGroupRows] = {acc0, acc1, acc2, acc3};
      for (int64_t i = 0; i < n; ++i) {
        float* yt = yp + rows[i] * y_stride + first;
        for (int64_t o = 0; o < size; ++o) yt[o] += accs[i][o];
      }
    }
  }
#endif
}

}  // namespace

void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a, torch::Tensor bt,
              std::vector<int64_t> offsets, int64_t rank) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && y.scalar_type() == torch::kFloat &&
              (a.scalar_type() == torch::kFloat || a.scalar_type() == torch::kBFloat16) &&
              bt.scalar_type() == a.scalar_type(),
              "lora_add: float32 rows, float32 or bfloat16 adapter weights");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 && a.is_contiguous() &&
              bt.is_contiguous(), "x, a and bt contiguous, y rows contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == x.size(0) &&
              y.size(0) == x.size(0), "one int64 slot per row");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), parts = offsets.size() - 1;
  const int64_t width = parts * rank;
  TORCH_CHECK(parts >= 1 && offsets.back() == out && a.size(1) == in && a.size(0) % width == 0 &&
              bt.size(1) == out && bt.size(0) == a.size(0) / parts, "shape mismatch");
  const int64_t num_slots = a.size(0) / width;
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Rows by slot (in order), then cut into groups of kGroupRows: (slot, first index into `order`, count).
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(sp[t] < num_slots, "slot out of range");
    if (sp[t] >= 0) by_slot[sp[t]].push_back(t);
  }
  std::vector<int64_t> order;
  std::vector<std::array<int64_t, 3>> groups;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (size_t i = 0; i < by_slot[s].size(); i += kGroupRows) {
      groups.push_back({s, static_cast<int64_t>(order.size()),
                        std::min<int64_t>(kGroupRows, by_slot[s].size() - i)});
      order.insert(order.end(), by_slot[s].begin() + i,
                   by_slot[s].begin() + std::min(by_slot[s].size(), i + kGroupRows));
    }
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t y_stride = y.stride(0);
  auto run = [&](auto* ap, auto* bp) {
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xa(kGroupRows * width);
      for (int64_t g = begin; g < end; ++g) {
        const auto& group = groups[g];
        lora_group(order.data() + group[1], group[2], group[0], xp, in, ap, bp, offsets, rank, yp, y_stride, out,
                   xa.data());
      }
    });
  };
  // bfloat16 weights: half the bytes a decode step streams (the deltas are summed in float32 either way).
  if (a.scalar_type() == torch::kBFloat16) {
    run(a.data_ptr<at::BFloat16>(), bt.data_ptr<at::BFloat16>());
  } else {
    run(a.data_ptr<float>(), bt.data_ptr<float>());
  }
}
