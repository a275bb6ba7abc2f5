#include "common.h"

// ---- fused elementwise ops ---------------------------------------------------------------
// Each replaces several torch ops (and as many passes over memory) with one pass per row. The
// arithmetic is the reference's, operation for operation, in fp32 (built with -ffp-contract=off
// so no multiply-add is fused behind our back): fp32 results match the unfused torch graph up to
// the summation order of the RMSNorm reduction.

namespace {

// out[r, :] = silu(x[r, :I]) * x[r, I:]   (x is [rows, 2I], the fused gate/up projection)
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* x, scalar_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(inter);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = x + r * 2 * inter;
      const scalar_t* up = gate + inter;
      int64_t i = 0;
#ifdef TOKENMILL_AVX2
      if constexpr (std::is_same_v<scalar_t, float>) {
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 g = _mm256_loadu_ps(gate + i);
          // silu(g) = g / (1 + exp(-g))
          const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
          _mm256_storeu_ps(out + r * inter + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = g / (1.0f + std::exp(-g));
        out[r * inter + i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(silu)) *
                                                   static_cast<float>(up[i]));
      }
    }
  });
}

// x <- x + residual_in (when given), then out = weight * (x * rsqrt(mean(x^2) + eps)).
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out, int64_t rows,
                   int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * hidden;
      scalar_t* rr = residual == nullptr ? nullptr : residual + r * hidden;
      scalar_t* orow = out + r * hidden;
      float sum = 0.0f;
      if (rr != nullptr) {
        for (int64_t i = 0; i < hidden; ++i) {
          rr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          const float v = static_cast<float>(rr[i]);
          sum += v * v;
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = static_cast<float>(xr[i]);
          sum += v * v;
        }
      }
      const scalar_t* src = rr != nullptr ? rr : xr;
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i)
        orow[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) *
                                        static_cast<float>(static_cast<scalar_t>(static_cast<float>(src[i]) * inv)));
    }
  });
}

// Rotate-half rotary embedding in place on the first `num_heads` heads of each row of x.
template <typename scalar_t>
void rotary_rows(scalar_t* x, int64_t row_stride, const int64_t* positions, const float* cos, const float* sin,
                 int64_t rows, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + positions[r] * head_dim;
      const float* s = sin + positions[r] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* v = x + r * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          // The reference: x * cos + cat(-x2, x1) * sin, each product rounded on its own.
          const float lo = x1 * c[i] + (-x2) * s[i];
          const float hi = x2 * c[i + half] + x1 * s[i + half];
          v[i] = static_cast<scalar_t>(lo);
          v[i + half] = static_cast<scalar_t>(hi);
        }
      }
    }
  });
}


// The index of a row's first maximum, as torch.argmax picks it: the first NaN where the row holds one (NaN
// compares above every number there), else the first value equal to the row's largest. Two passes: the
// maximum (and whether any lane is NaN) on vectors, then the first position equal to it, which stops early.
// n > 0 (argmax_rows checks it).
int64_t row_argmax(const float* x, int64_t n) {
  float best = x[0];
  bool nan = false;
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      m = _mm256_max_ps(m, v);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float lane : lanes) best = std::max(best, lane);
  }
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  int64_t j = 0;
#ifdef TOKENMILL_AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // unreachable: best is one of the row's values
}


// SplitMix64's output function (Steele, Lea and Flood, 2014). As a counter-based generator, value i of a row is
// mix(seed + (i + 1) * gamma): rows fill in parallel, each from its own seed alone, and the same seed gives the
// same values whatever the rows around it.
constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ULL;
inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [rows, 2 * I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// residual may be an empty tensor (plain RMSNorm); otherwise it is updated in place to x + residual.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight mismatch");
  const bool fused = residual.numel() > 0;
  if (fused) TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                         residual.scalar_type() == x.scalar_type(), "residual mismatch");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), fused ? residual.data_ptr<scalar_t>() : nullptr,
                            weight.contiguous().data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim, "x must be [rows, >= H*D]");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(), "positions int64");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == head_dim, "cos/sin float32 [max_positions, head_dim]");
  TORCH_CHECK(head_dim % 2 == 0 && positions.numel() == x.size(0), "shape mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_inplace", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), x.size(0), num_heads, head_dim);
  });
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 [rows, n > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, torch::kLong);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * stride, n);
  });
  return out;
}

torch::Tensor uniform_rows(torch::Tensor seeds, int64_t n) {
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == torch::kLong && seeds.is_contiguous() && n >= 0,
              "seeds must be a contiguous int64 vector and n >= 0");
  const int64_t rows = seeds.size(0);
  auto out = torch::empty({rows, n}, torch::kFloat);
  const int64_t* sp = seeds.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t seed = static_cast<uint64_t>(sp[r]);
      float* row = op + r * n;
      // (2k + 1) / 2^24 for the top 23 bits k: 2^23 evenly spaced values strictly inside (0, 1), each exact in
      // float32, so -log(u) is always finite.
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t k = splitmix64(seed + static_cast<uint64_t>(i + 1) * kSplitMixGamma) >> 41;
        row[i] = static_cast<float>(2 * k + 1) * 0x1p-24f;
      }
    }
  });
  return out;
}
