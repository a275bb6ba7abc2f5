// tokenmill's CPU kernels, built on first use with torch.utils.cpp_extension (see cpu_kernels.py), one file
// per operation family. Shared by every kernel file: includes, the instruction-set switches, small vector
// helpers, the thread pool's work loop, the block layout constants, and the declarations of the operations
// the files call across (ops.h lists what the bindings export).
#pragma once

// ATen alone (torch/extension.h, which bindings.cpp includes, costs ~4x its parse time per file); the kernel
// files spell ATen's tensor API with torch::'s names, which are the same types and functions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
namespace torch {
using namespace at;  // as torch/types.h does
}

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

// TOKENMILL_PORTABLE / TOKENMILL_NO_AVX512 build the narrower paths on a wider CPU (their tests).
#if defined(__AVX2__) && defined(__FMA__) && !defined(TOKENMILL_PORTABLE)
#include <immintrin.h>
#define TOKENMILL_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(TOKENMILL_NO_AVX512)
#define TOKENMILL_AVX512 1
#if defined(__AVX512BF16__)
#define TOKENMILL_AVX512_BF16 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif

// Integer dot products: AVX-512 VNNI (with VBMI for the 4-bit unpacking), else the AVX2 route.
#if defined(TOKENMILL_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TOKENMILL_VNNI 1
#elif defined(TOKENMILL_AVX2)
#define TOKENMILL_DOT_AVX2 1
#endif

namespace {

#ifdef TOKENMILL_AVX2
// exp(x) for 8 floats: x = n*ln2 + r with |r| <= ln2/2, e^r from a degree-5 minimax polynomial
// (relative error ~1e-7, the accuracy of expf), 2^n assembled in the exponent bits.
constexpr float kExpClamp = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 in two parts: n*ln2 stays exact
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpClamp)), _mm256_set1_ps(-kExpClamp));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The largest of n floats (max is exact in any order, so lanes are free to split the work).
inline float max_of(const float* s, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  __m256 vbest = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) vbest = _mm256_max_ps(vbest, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vbest);
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < n; ++i) best = std::max(best, s[i]);
  return best;
}

// In place: s[i] = exp(s[i] - max); returns the sum.
inline float exp_shift_sum(float* s, int64_t n, float max_score) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef TOKENMILL_AVX2
  __m256 vmax = _mm256_set1_ps(max_score), vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum256(vsum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max_score);
    sum += s[i];
  }
  return sum;
}

#ifdef TOKENMILL_AVX2
// 8 cache values widened to fp32: float as is, bfloat16 by moving its bits to the top half, float16
// through F16C. The same conversions as torch's .float(), so a 16-bit cache reads as the same values.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#ifdef __F16C__
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
// 8 int8 values widened (an int8 cache's, before their scale: dequantize_kv_row).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
constexpr bool kVectorCache = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>
#ifdef __F16C__
                              || std::is_same_v<T, at::Half>
#endif
    ;
#endif

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// ---- the int8 KV cache (model/layers/kv_int8.py) -------------------------------------------------------------
// A (token, head) row of an int8 cache is head_dim int8 values followed by one float16 scale (two bytes) per group
// of 32 values: value[d] = q[d] * scale[d / 32]. A float cache's row is head_dim values.
constexpr int64_t kKvInt8Group = 32;
constexpr int64_t kKvInt8ScaleBytes = 2;

template <typename cache_t>
constexpr bool kInt8Cache = std::is_same_v<cache_t, int8_t>;

// Elements of a row of an int8 cache holding head_dim values.
inline int64_t kv_int8_row_width(int64_t head_dim) {
  return head_dim + kKvInt8ScaleBytes * ((head_dim + kKvInt8Group - 1) / kKvInt8Group);
}

// Whether a cache's rows (its last dimension) hold heads of head_dim values in its dtype's layout.
inline bool kv_rows_hold(const torch::Tensor& kv_cache, int64_t head_dim) {
  return kv_cache.size(4) == (kv_cache.scalar_type() == torch::kChar ? kv_int8_row_width(head_dim) : head_dim);
}

inline float kv_int8_scale(const int8_t* row, int64_t head_dim, int64_t group) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim + kKvInt8ScaleBytes * group, sizeof(bits));
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction where c10's conversion takes a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// out[d] = the row's value d, for d < head_dim.
inline void dequantize_kv_row(const int8_t* row, int64_t head_dim, float* out) {
  for (int64_t g0 = 0; g0 < head_dim; g0 += kKvInt8Group) {
    const float scale = kv_int8_scale(row, head_dim, g0 / kKvInt8Group);
    const int64_t g1 = std::min(head_dim, g0 + kKvInt8Group);
    int64_t d = g0;
#ifdef TOKENMILL_AVX512
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (; d + 16 <= g1; d += 16)
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)))),
                                              scale16));
#endif
#ifdef TOKENMILL_AVX2
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (; d + 8 <= g1; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(load8(row + d), scale8));
#endif
    for (; d < g1; ++d) out[d] = static_cast<float>(row[d]) * scale;
  }
}

#if defined(TOKENMILL_AVX512_BF16)
// out[d] = the row's value d rounded to bfloat16 (nearest even), for d < head_dim, a multiple of 32.
inline void dequantize_kv_row_bf16(const int8_t* row, int64_t head_dim, at::BFloat16* out) {
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 scale = _mm512_set1_ps(kv_int8_scale(row, head_dim, d / kKvInt8Group));
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(values, scale)));
  }
}
#endif

// A row's values as an int8 cache stores them: per group of 32, scale = absmax / 127 rounded to float16, each value
// divided by it and rounded to nearest even (as torch's round), then the scales' bytes (kv_int8.quantize_kv_rows).
inline void quantize_kv_row(const float* x, int64_t head_dim, int8_t* row) {
  for (int64_t g0 = 0; g0 < head_dim; g0 += kKvInt8Group) {
    const int64_t g1 = std::min(head_dim, g0 + kKvInt8Group);
    float absmax = 0.0f;
    for (int64_t d = g0; d < g1; ++d) absmax = std::max(absmax, std::fabs(x[d]));
    const at::Half scale(std::min(absmax / 127.0f, 65504.0f));
    const float wide = static_cast<float>(scale);
    for (int64_t d = g0; d < g1; ++d) {
      const float q = wide > 0.0f ? std::nearbyint(x[d] / wide) : 0.0f;
      row[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
    }
    std::memcpy(row + head_dim + kKvInt8ScaleBytes * (g0 / kKvInt8Group), &scale, sizeof(scale));
  }
}

#ifdef TOKENMILL_AVX512
// exp256 on 16 lanes (its constants, its steps).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpClamp)), _mm512_set1_ps(-kExpClamp));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// Output features per panel and inputs per block of the kept block-quantized weights (pack_blocks).
constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Panel = 16;

// Asks for `bytes` starting `distance` past p into L1, a line at a time: a weight stream read ahead of its use
// (prefetcht0, as _mm_prefetch(..., _MM_HINT_T0)).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes, int64_t distance) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + distance + line, 0, 3);
}

// The integers of one input's 16 features (one panel row) at a storage width.
template <int Bits>
struct PanelRow;

template <>
struct PanelRow<8> {
  static constexpr int64_t kBytes = kQ8Panel;
  static inline int value(const uint8_t* row, int64_t j, int /*zero*/) { return static_cast<int8_t>(row[j]); }
};

template <>
struct PanelRow<4> {
  static constexpr int64_t kBytes = kQ8Panel / 2;
  static inline int value(const uint8_t* row, int64_t j, int zero) {
    return (j < 8 ? row[j] & 0x0F : row[j - 8] >> 4) - zero;
  }
};

// out[i] = the sum of x's block i of 32 inputs for i in [first, end) (x's rows are contiguous blocks):
// the min term's factor. Each block's inputs are added in order; eight blocks' chains interleave.
inline void block_sums(const float* x, int64_t first, int64_t end, float* out) {
  int64_t i = first;
  for (; i + 8 <= end; i += 8) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t k = 0; k < kQ8Block; ++k)
      for (int j = 0; j < 8; ++j) acc[j] += x[(i + j) * kQ8Block + k];
    for (int j = 0; j < 8; ++j) out[i + j] = acc[j];
  }
  for (; i < end; ++i) {
    float acc = 0.0f;
    for (int64_t k = 0; k < kQ8Block; ++k) acc += x[i * kQ8Block + k];
    out[i] = acc;
  }
}


#if defined(TOKENMILL_AVX512)
// 16 floats rounded to bfloat16, nearest-even (c10::BFloat16's rounding, for finite values).
inline __m256i round_to_bf16_16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

// 16 floats rounded to bfloat16, nearest-even (c10::BFloat16's rounding, for finite values).
inline void round_to_bf16_16(const float* in, at::BFloat16* out) {
#if defined(TOKENMILL_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), round_to_bf16_16(_mm512_loadu_ps(in)));
#else
  for (int j = 0; j < 16; ++j) out[j] = c10::BFloat16(in[j]);
#endif
}

#if defined(TOKENMILL_AMX) || defined(TOKENMILL_AVX512_BF16)
// exp(x) for x <= 0 to about 2^-14 relative, for probabilities that are rounded to bfloat16 (2^-9) next: 2^n by
// VSCALEFPS times a degree-4 polynomial on the remainder, 9 instructions where exp512's float32 accuracy takes
// 17. Anything below -200, -inf (a masked score) included, comes out exactly 0.
inline __m512 exp512_to_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);  // |r| <= ln 2 / 2
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 32 floats to bfloat16, nearest-even: a's 16 in the low half, b's in the high one.
inline __m512i round_to_bf16_32(__m512 a, __m512 b) {
#if defined(TOKENMILL_AVX512_BF16)
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bf16_16(a)), round_to_bf16_16(b), 1);
#endif
}
#endif

#if defined(TOKENMILL_AVX512_BF16)
// acc + the products of a's and b's bfloat16 pairs (VDPBF16PS).
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  // A value cast (same-size vector types), not a reference one: through a reference GCC stores the operand and
  // loads it again before every use, which doubled the loads of the value loop.
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline __m512i broadcast_pair(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}
#endif

// Runs work(begin, end) over items 0..n-1 on the intra-op threads: each thread owns an even share of
// consecutive items and works through it from the front, and a thread that finishes its own takes items from
// the back of the largest share left. Items of equal cost still finish unevenly when one thread starts late or
// runs slower (the step's serial work just done on its core, an interrupt); with a plain split the others wait
// for it at the region's end. Each thread still walks consecutive items (shared inputs, prefetches running on
// into its next item) until it steals.
template <typename Work>
void parallel_split_steal(int64_t n, Work work) {
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  if (threads <= 1 || n >= (int64_t{1} << 31)) {
    if (n > 0) work(0, n);
    return;
  }
  // Per share: [front, back) packed as front << 32 | back, changed by compare-and-swap; a cache line each, so
  // an owner's updates do not evict the other shares' lines from their owners' caches.
  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) {
    const uint64_t front = n * t / threads, back = n * (t + 1) / threads;
    shares[t].range.store(front << 32 | back, std::memory_order_relaxed);
  }
  // Takes one item from the front (own share) or the back (another's); -1 when that share is empty.
  const auto take = [&](int64_t t, bool from_front) -> int64_t {
    uint64_t packed = shares[t].range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = packed >> 32, back = packed & 0xFFFFFFFFu;
      if (front >= back) return -1;
      const uint64_t next = from_front ? (front + 1) << 32 | back : front << 32 | (back - 1);
      if (shares[t].range.compare_exchange_weak(packed, next, std::memory_order_relaxed)) {
        return static_cast<int64_t>(from_front ? front : back - 1);
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t self = first; self < last; ++self) {
      for (int64_t item = take(self, true); item >= 0; item = take(self, true)) work(item, item + 1);
    }
    while (true) {  // steal from the share with the most left
      int64_t victim = -1;
      uint64_t most = 0;
      for (int64_t t = 0; t < threads; ++t) {
        const uint64_t packed = shares[t].range.load(std::memory_order_relaxed);
        const uint64_t left = (packed >> 32) < (packed & 0xFFFFFFFFu) ? (packed & 0xFFFFFFFFu) - (packed >> 32) : 0;
        if (left > most) most = left, victim = t;
      }
      if (victim < 0) return;
      const int64_t item = take(victim, false);
      if (item >= 0) work(item, item + 1);
    }
  });
}

// Runs work(item, scratch) for items 0..n-1 on the intra-op threads. Items' costs differ widely, so an
// even split would leave one thread idle while another finishes its long ones: threads instead take the
// next item from a shared counter, in order of decreasing cost(item) (an item's result does not depend
// on who computes it). Each thread has its own Scratch.
template <typename Scratch, typename Cost, typename Work>
void parallel_longest_first(int64_t n, Cost cost, Work work) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next_item.fetch_add(1); i < n; i = next_item.fetch_add(1)) work(order[i], scratch);
  });
}

// Calls fn(q_t*, cache_t*) (null pointers, as type tags) for the dtype mixes the attention kernels read:
// query and cache of one dtype (float32, bfloat16, float16), a float32 query over a float16 or
// bfloat16 cache, or a float32, bfloat16 or float16 query over an int8 cache.
template <typename Fn>
void dispatch_attention_dtypes(const torch::Tensor& query, const torch::Tensor& kv_cache, const char* name, Fn&& fn) {
  const auto cache_type = kv_cache.scalar_type();
  if (cache_type == torch::kChar) {  // an int8 cache under a float32, bfloat16 or float16 query
    switch (query.scalar_type()) {
      case torch::kFloat: return fn(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
      case torch::kBFloat16: return fn(static_cast<at::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
      case torch::kHalf: return fn(static_cast<at::Half*>(nullptr), static_cast<int8_t*>(nullptr));
      default: TORCH_CHECK(false, '"', name, "\" reads an int8 cache under a float32, bfloat16 or float16 query");
    }
  }
  const bool mixed = query.scalar_type() == torch::kFloat && (cache_type == torch::kHalf ||
                                                              cache_type == torch::kBFloat16);
  TORCH_CHECK(cache_type == query.scalar_type() || mixed,
              "kv_cache must have the query's dtype, or be float16/bfloat16 under a float32 query");
  if (cache_type == torch::kHalf && mixed) {
    fn(static_cast<float*>(nullptr), static_cast<at::Half*>(nullptr));
  } else if (mixed) {
    fn(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  } else {
    // AT_DISPATCH's own refusal, naming the caller (its name argument must be a literal).
    const auto type = query.scalar_type();
    TORCH_CHECK(type == torch::kFloat || type == torch::kDouble || type == torch::kHalf || type == torch::kBFloat16,
                '"', name, "\" not implemented for '", c10::toString(type), "'");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "attention", [&] {
      fn(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  }
}

#if defined(TOKENMILL_AMX)
// Linux gives a process AMX's tile state only after it asks (once per process, for all its threads).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: a 32 x 32 float32 block of y (2 x 2 tiles of 16 x 16); 4-5: 16 rows x 32 inputs of x each;
// 6-7: one (panel, block) of the weights each. Every tile is 16 rows of 64 bytes.
void load_amx_tile_config() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

#endif

}  // namespace

// BLAS's sgemm, where torch was built with one (MKL on x86 wheels); weak, so the kernels still load
// where it is missing and tiles go through at::mm instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));
// MKL's bfloat16 GEMM with float32 accumulation and output (AMX-BF16 or AVX512-BF16 where the CPU has them).
extern "C" void gemm_bf16bf16f32_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                  const float* alpha, const uint16_t* a, const int* lda, const uint16_t* b,
                                  const int* ldb, const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {
// A block-quantized matmul's arguments, checked: the storage width, the nibble offset and raw pointers.
struct BlockLinearArgs {
  int bits;
  int zero;  // 4-bit blocks without mins (Q4_0) store q + 8 in each nibble
  const uint8_t* q;
  const float* scales;  // float32 scales and mins (null where float16)
  const float* mins;    // null without
  const float* bias;    // null without
  bool dot_layout;      // q in the integer dot products' layout (block_linear_q8 only), else pack_blocks's rows
  const at::Half* half_scales = nullptr;  // the dot layout's float16 scales and mins, where pack_blocks kept them so
  const at::Half* half_mins = nullptr;
};

BlockLinearArgs check_block_linear_args(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                                        const c10::optional<torch::Tensor>& mins,
                                        const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous float32 [rows, K]");
  TORCH_CHECK(x.size(1) % kQ8Block == 0, "K must be a multiple of 32");
  TORCH_CHECK(q.scalar_type() == torch::kChar || q.scalar_type() == torch::kByte,
              "q: int8 (8-bit blocks) or uint8 (4-bit blocks, two per byte)");
  const int bits = q.scalar_type() == torch::kChar ? 8 : 4;
  const int64_t panels = (out_features + kQ8Panel - 1) / kQ8Panel, blocks = x.size(1) / kQ8Block;
  TORCH_CHECK(out_features > 0 && q.is_contiguous() && q.dim() == 4 && q.size(0) == panels && q.size(1) == blocks &&
              q.numel() == panels * blocks * kQ8Block * kQ8Panel * bits / 8,
              "q: contiguous, in pack_blocks's layout ([panels, K / 32, 32, 16 * bits / 8], or the dot layout "
              "[panels, K / 32, bits / 2, 64]) matching x and out_features");
  const bool dot_layout = q.size(3) == 64;
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(scales.is_contiguous() && (scales.scalar_type() == torch::kFloat || (half && dot_layout)) &&
              scales.numel() == panels * blocks * kQ8Panel,
              "scales: contiguous float32 [panels, K / 32, 16] (float16 in the dot layout)");
  const bool with_mins = mins.has_value() && mins->defined() && mins->numel() > 0;
  if (with_mins) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == scales.scalar_type() && mins->numel() == scales.numel(),
                "mins: contiguous, shaped like scales and of their dtype");
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "bias: float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  const int zero = bits == 4 && !with_mins ? 8 : 0;
  BlockLinearArgs args{bits, zero, static_cast<const uint8_t*>(q.data_ptr()), nullptr, nullptr, bias_ptr, dot_layout};
  if (half) {
    args.half_scales = scales.data_ptr<at::Half>();
    args.half_mins = with_mins ? mins->data_ptr<at::Half>() : nullptr;
  } else {
    args.scales = scales.data_ptr<float>();
    args.mins = with_mins ? mins->data_ptr<float>() : nullptr;
  }
  return args;
}
}  // namespace

#include "ops.h"
