// CPU kernels for tokenmill, built on first use with torch.utils.cpp_extension (see cpu_kernels.py).
//
// paged_decode_attention: one query token per request attends to its context straight from the
// paged KV cache, without gathering the blocks into a contiguous copy first. The torch backend
// copies every decode request's whole history once per layer per step; reading it in place
// halves the memory traffic and removes the padding and mask of its buckets.
//
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]   (K = [0], V = [1])
//   query        [batch, num_heads, head_dim]
//   block_tables [batch, max_blocks] int32: request b's token t lives in block
//                block_tables[b][t / block_size] at offset t % block_size
//   context_lens [batch] int32 (including the token being decoded, already written)
//
// Work item = a request (or, with few requests, a (request, kv head) pair), taken longest first by
// whichever thread is free: the `group` query heads that share a KV head are scored together, so
// each K/V row is loaded once per group. Softmax is exact (two passes over the scores in fp32).
// softcap > 0 caps every score as softcap * tanh(score / softcap) before the softmax (Gemma 2).
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
template <typename T>
constexpr bool kVectorCache = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>
#ifdef __F16C__
                              || std::is_same_v<T, at::Half>
#endif
    ;
#endif

// Asks for the rows of a block kKvPrefetchBlocks ahead early: a request's blocks are scattered over the
// cache, so the hardware prefetcher loses the stream at every block boundary. Into L2, not L1: a block's
// rows are ~100 lines, more than L1 has miss buffers for, and a prefetch into L1 waits for a free one.
// Two blocks ahead into L2 read a float16 cache from DRAM at ~1.35x the rate of one block ahead into L1
// (2-core EPYC, 16 requests x 300 tokens over 30 layers' caches: 6.2-6.5 vs 8.6-9.2 ms, best of 25).
constexpr int64_t kKvPrefetchBlocks = 2;

template <typename T>
inline void prefetch_block_rows(const T* rows, int64_t n, int64_t stride, int64_t width) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(rows + i * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
  }
}

// Scores of `group` queries (pre-scaled fp32 [group][head_dim]) against one key row (the portable
// path; score_keys is the vectorized one).
template <typename scalar_t>
inline void score_row(const float* qf, const scalar_t* k, int64_t group, int64_t head_dim, float* out,
                      int64_t out_stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * head_dim;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
    out[g * out_stride] = dot;
  }
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

#ifdef TOKENMILL_AVX2

// acc[d] += sum_i p[i] * rows[i * stride + d] for i < n: 64 output lanes in registers at a time (8
// independent FMA chains keep both FMA units busy), every row of the block accumulated before
// storing; then 32 at a time.
template <typename T>
inline void accumulate_weighted_rows_avx2(const float* p, const T* rows, int64_t n, int64_t stride, int64_t head_dim,
                                          float* acc) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + d + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = rows + i * stride + d;
      const __m256 w = _mm256_set1_ps(p[i]);
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d + 8 * c, a[c]);
  }
  for (; d + 32 <= head_dim; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = rows + i * stride + d;
      const __m256 w = _mm256_set1_ps(p[i]);
      a0 = _mm256_fmadd_ps(w, load8(v), a0);
      a1 = _mm256_fmadd_ps(w, load8(v + 8), a1);
      a2 = _mm256_fmadd_ps(w, load8(v + 16), a2);
      a3 = _mm256_fmadd_ps(w, load8(v + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d < head_dim; ++d)
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * to_float(rows[i * stride + d]);
}
#endif

// acc[d] += sum_i p[i] * rows[i * stride + d] for i < n.
template <typename scalar_t>
inline void accumulate_weighted_rows(const float* p, const scalar_t* rows, int64_t n, int64_t stride,
                                     int64_t head_dim, float* acc) {
#ifdef TOKENMILL_AVX2
  if constexpr (kVectorCache<scalar_t>) {
    accumulate_weighted_rows_avx2(p, rows, n, stride, head_dim, acc);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* v = rows + i * stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[i] * to_float(v[d]);
  }
}

#ifdef TOKENMILL_AVX2
// Pass 1 scores a block of key rows at a time. Four tokens per step against up to three queries that
// share a KV head: 12 accumulators in registers, each query chunk loaded once per four keys. The lane
// sums reduce with horizontal adds, four tokens' at once, in the order hsum256_pairwise uses for a
// lone token, so a score is the same bits however its token was grouped.
inline float hsum256_pairwise(__m256 v) {  // ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

inline __m128 hsum4_pairwise(__m256 a, __m256 b, __m256 c, __m256 d) {  // hsum256_pairwise of each
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// QC queries (pre-scaled fp32, [QC][head_dim]) against 4 key rows `stride` apart: out[c * out_stride + i].
template <int QC, typename T>
inline void score_four_keys(const float* q, const T* k, int64_t stride, int64_t head_dim, float* out,
                            int64_t out_stride) {
  __m256 acc[QC][4];
  for (int c = 0; c < QC; ++c)
    for (int i = 0; i < 4; ++i) acc[c][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    __m256 qv[QC];
    for (int c = 0; c < QC; ++c) qv[c] = _mm256_loadu_ps(q + c * head_dim + d);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = load8(k + i * stride + d);
      for (int c = 0; c < QC; ++c) acc[c][i] = _mm256_fmadd_ps(qv[c], kv, acc[c][i]);
    }
  }
  for (int c = 0; c < QC; ++c)
    _mm_storeu_ps(out + c * out_stride, hsum4_pairwise(acc[c][0], acc[c][1], acc[c][2], acc[c][3]));
}

template <int QC, typename T>
inline void score_one_key(const float* q, const T* k, int64_t head_dim, float* out, int64_t out_stride) {
  __m256 acc[QC];
  for (int c = 0; c < QC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 kv = load8(k + d);
    for (int c = 0; c < QC; ++c) acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * head_dim + d), kv, acc[c]);
  }
  for (int c = 0; c < QC; ++c) out[c * out_stride] = hsum256_pairwise(acc[c]);
}

// n key rows of one block; meanwhile the first next_n rows at `next` (the same head in the block
// kKvPrefetchBlocks ahead) are prefetched, four rows per four scored, so the requests to memory stay
// spread out.
template <int QC, typename T>
inline void score_block_keys(const float* q, const T* k, int64_t n, int64_t stride, int64_t head_dim, float* out,
                             int64_t out_stride, const T* next, int64_t next_n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (i < next_n) prefetch_block_rows(next + i * stride, std::min<int64_t>(4, next_n - i), stride, head_dim);
    score_four_keys<QC, T>(q, k + i * stride, stride, head_dim, out + i, out_stride);
  }
  if (i < next_n) prefetch_block_rows(next + i * stride, next_n - i, stride, head_dim);
  for (; i < n; ++i) score_one_key<QC, T>(q, k + i * stride, head_dim, out + i, out_stride);
}

// scores[j][t] = q_j . k_t for the item's heads [h0, h1) (query j reads kv head h0 + j / group).
template <typename T>
void score_keys(const float* qf, const T* k_cache, const int32_t* blocks, int64_t ctx_len, int64_t block_size,
                int64_t token_stride, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, float* scores) {
  const int64_t dist = kKvPrefetchBlocks;
  for (int64_t b = 1; b < dist && b * block_size < ctx_len; ++b)  // block 0: its own first loads ask
    prefetch_block_rows(k_cache + blocks[b] * block_size * token_stride + h0 * head_dim,
                        std::min(block_size, ctx_len - b * block_size), token_stride, (h1 - h0) * head_dim);
  for (int64_t t0 = 0; t0 < ctx_len; t0 += block_size) {
    const int64_t n = std::min(block_size, ctx_len - t0);
    const T* rows = k_cache + blocks[t0 / block_size] * block_size * token_stride;
    const int64_t next_n = std::max<int64_t>(0, std::min(block_size, ctx_len - t0 - dist * block_size));
    const T* next_rows = next_n ? k_cache + blocks[t0 / block_size + dist] * block_size * token_stride : rows;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t c0 = 0; c0 < group; c0 += 3) {
        const int64_t j = (h - h0) * group + c0;
        const float* q = qf + j * head_dim;
        const T* k = rows + h * head_dim;
        const T* next = next_rows + h * head_dim;
        const int64_t prefetch_n = c0 == 0 ? next_n : 0;
        float* out = scores + j * ctx_len + t0;
        switch (std::min<int64_t>(3, group - c0)) {
          case 1: score_block_keys<1, T>(q, k, n, token_stride, head_dim, out, ctx_len, next, prefetch_n); break;
          case 2: score_block_keys<2, T>(q, k, n, token_stride, head_dim, out, ctx_len, next, prefetch_n); break;
          default: score_block_keys<3, T>(q, k, n, token_stride, head_dim, out, ctx_len, next, prefetch_n); break;
        }
      }
  }
}
#endif

// One request, kv heads [h0, h1): its (h1 - h0) * group query heads against its context. Each
// token's K (then V) row holds every kv head side by side, so walking the tokens of a block reads
// one contiguous run of memory, which the hardware prefetcher follows.
// The query and output have the activations' dtype (q_t), the cache its own (cache_t): a float32
// model may keep a 16-bit cache, which halves the bytes each decode step reads.
template <typename q_t, typename scalar_t>
void decode_one(const q_t* __restrict__ q,               // [(h1 - h0) * group, head_dim]
                const scalar_t* __restrict__ k_cache,    // K plane base
                const scalar_t* __restrict__ v_cache,    // V plane base
                const int32_t* __restrict__ blocks, int64_t ctx_len, int64_t block_size,
                int64_t token_stride, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, float scale,
                float softcap, q_t* __restrict__ out, std::vector<float>& scores, std::vector<float>& acc,
                std::vector<float>& qf) {
  const int64_t num_q = (h1 - h0) * group;
  scores.resize(static_cast<size_t>(num_q * ctx_len));
  acc.assign(static_cast<size_t>(num_q * head_dim), 0.0f);
  qf.resize(static_cast<size_t>(num_q * head_dim));
  for (int64_t i = 0; i < num_q * head_dim; ++i) qf[i] = to_float(q[i]) * scale;

  // Pass 1: scores[j][t] = q_j . k_t (query j reads kv head h0 + j / group)
  bool scored = false;
#ifdef TOKENMILL_AVX2
  if constexpr (kVectorCache<scalar_t>) {
    if (head_dim % 8 == 0) {
      score_keys<scalar_t>(qf.data(), k_cache, blocks, ctx_len, block_size, token_stride, h0, h1, group, head_dim,
                           scores.data());
      scored = true;
    }
  }
#endif
  for (int64_t t = 0; t < ctx_len && !scored; ++t) {
    const scalar_t* row = k_cache + (blocks[t / block_size] * block_size + t % block_size) * token_stride;
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t j = (h - h0) * group;
      score_row<scalar_t>(qf.data() + j * head_dim, row + h * head_dim, group, head_dim,
                          scores.data() + j * ctx_len + t, ctx_len);
    }
  }
  if (softcap > 0.0f)
    for (int64_t i = 0; i < num_q * ctx_len; ++i) scores[i] = std::tanh(scores[i] / softcap) * softcap;
  // Pass 2: softmax per query head (while the first blocks of V are on their way).
  for (int64_t b = 0; b < kKvPrefetchBlocks && b * block_size < ctx_len; ++b)
    prefetch_block_rows(v_cache + blocks[b] * block_size * token_stride + h0 * head_dim,
                        std::min(block_size, ctx_len - b * block_size), token_stride, (h1 - h0) * head_dim);
  std::vector<float> inv_sum(num_q);
  for (int64_t j = 0; j < num_q; ++j) {
    float* s = scores.data() + j * ctx_len;
    float max_score = max_of(s, ctx_len);
    inv_sum[j] = 1.0f / exp_shift_sum(s, ctx_len, max_score);
  }
  // Pass 3: out_j = sum_t p[j][t] * v_t, a block of tokens at a time (its V rows stay in L1 while
  // each query sweeps them).
  for (int64_t t0 = 0; t0 < ctx_len; t0 += block_size) {
    const int64_t t1 = std::min(ctx_len, t0 + block_size);
    const scalar_t* block_rows = v_cache + blocks[t0 / block_size] * block_size * token_stride;
    const int64_t ahead = t0 + kKvPrefetchBlocks * block_size;
    if (ahead < ctx_len)
      prefetch_block_rows(v_cache + blocks[ahead / block_size] * block_size * token_stride + h0 * head_dim,
                          std::min(block_size, ctx_len - ahead), token_stride, (h1 - h0) * head_dim);
    for (int64_t j = 0; j < num_q; ++j) {
      const scalar_t* v0 = block_rows + (h0 + j / group) * head_dim;
      accumulate_weighted_rows<scalar_t>(scores.data() + j * ctx_len + t0, v0, t1 - t0, token_stride, head_dim,
                                         acc.data() + j * head_dim);
    }
  }
  for (int64_t j = 0; j < num_q; ++j)
    for (int64_t d = 0; d < head_dim; ++d)
      out[j * head_dim + d] = static_cast<q_t>(acc[j * head_dim + d] * inv_sum[j]);
}

}  // namespace

namespace {
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
// query and cache of one dtype (float32, bfloat16, float16), or a float32 query over a float16 or
// bfloat16 cache.
template <typename Fn>
void dispatch_attention_dtypes(const torch::Tensor& query, const torch::Tensor& kv_cache, const char* name, Fn&& fn) {
  const auto cache_type = kv_cache.scalar_type();
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

struct DecodeScratch {
  std::vector<float> scores, acc, qf;
};

template <typename q_t, typename cache_t>
void run_paged_decode(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, double scale, double softcap, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t plane = num_blocks * block_size * token_stride;
  const q_t* q_base = query.data_ptr<q_t>();
  const cache_t* k_base = kv_cache.data_ptr<cache_t>();
  const cache_t* v_base = k_base + plane;
  q_t* out_base = out.data_ptr<q_t>();
  // A work item is one request (all its kv heads: contiguous reads); with fewer requests than
  // threads to keep busy, one (request, kv head) pair, so a single long request still spreads.
  const int64_t heads_per_item = batch >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_request = num_kv_heads / heads_per_item;
  const int64_t num_items = batch * items_per_request;
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * block_size, "context length out of range");
  // Items cost in proportion to their context.
  parallel_longest_first<DecodeScratch>(
      num_items, [&](int64_t item) { return lens[item / items_per_request]; },
      [&](int64_t item, DecodeScratch& w) {
        const int64_t b = item / items_per_request;
        const int64_t h0 = (item % items_per_request) * heads_per_item, h1 = h0 + heads_per_item;
        const int64_t q_offset = (b * num_heads + h0 * group) * head_dim;
        decode_one<q_t, cache_t>(q_base + q_offset, k_base, v_base, tables + b * max_blocks, lens[b], block_size,
                                 token_stride, h0, h1, group, head_dim, static_cast<float>(scale),
                                 static_cast<float>(softcap), out_base + q_offset, w.scores, w.acc, w.qf);
      });
}
}  // namespace

// query and kv_cache of one dtype (float32, bfloat16, float16), or a float32 query over a bfloat16 or
// float16 cache. The output has the query's dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [batch, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(), "block_tables int32");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt32, "context_lens int32");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0, "head shapes do not match");
  auto out = torch::empty_like(query);
  dispatch_attention_dtypes(query, kv_cache, "paged_decode_attention", [&](auto* q_tag, auto* cache_tag) {
    using q_t = std::remove_pointer_t<decltype(q_tag)>;
    using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
    run_paged_decode<q_t, cache_t>(query, kv_cache, block_tables, context_lens, scale, softcap, out);
  });
  return out;
}

// ---- paged prefill attention ----------------------------------------------------------------
// paged_prefill_attention: the queries of a step's prefill chunks attend causally to their requests'
// context straight from the paged KV cache (the chunk's own K/V already written). Each chunk's
// queries sit at the last n positions of its context of ctx_len tokens; query i sees keys
// max(0, p - window + 1) <= k <= p (no window: 0 <= k <= p).
//
//   query          [T, num_heads, head_dim] (rows `q_row_stride` elements apart; heads contiguous)
//   block_tables   [chunks, max_blocks] int32
//   query_ranges   [chunks, 2] int32: chunk c's queries are rows [query_ranges[c][0], query_ranges[c][1])
//   context_lens   [chunks] int32 (including the chunk)
//
// SDPA on the gathered context multiplies every (query, key) pair and masks half of them away; this
// visits, per tile of queries, only the key tiles some query of it can see, so a causal prompt costs
// half a square. Flash-style: per work item (chunk, KV head, a tile of positions x the `group` query
// heads of that KV head) the scores of 8 keys at a time, an online softmax, the weighted V rows
// accumulated in fp32. K/V rows are read in place through the block table (no gather copy).
namespace {

constexpr int64_t kPrefillTileRows = 48;  // query rows (positions x group) per work item

// out[i][d] = rows[i * stride + d] for i < n; rows n..KT-1 are zero (past the context: their
// probabilities are 0, and 0 * garbage could be NaN).
template <int64_t KT, typename T>
inline void load_rows_float(const T* rows, int64_t n, int64_t stride, int64_t head_dim, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = rows + i * stride;
    int64_t d = 0;
#ifdef TOKENMILL_AVX2
    if constexpr (kVectorCache<T>)
      for (; d + 8 <= head_dim; d += 8) _mm256_storeu_ps(out + i * head_dim + d, load8(row + d));
#endif
    for (; d < head_dim; ++d) out[i * head_dim + d] = to_float(row[d]);
  }
  std::fill(out + n * head_dim, out + KT * head_dim, 0.0f);
}

// kt[d][j] = k[j][d] for the KT rows of a key tile (k as [KT][head_dim] floats), 8x8 at a time.
template <int64_t KT>
inline void transpose_key_tile(const float* k, int64_t head_dim, float* kt) {
  int64_t d = 0;
#ifdef TOKENMILL_AVX2
  for (; d + 8 <= head_dim; d += 8)
    for (int64_t j0 = 0; j0 < KT; j0 += 8) {
      __m256 r[8], t[8], u[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(k + (j0 + j) * head_dim + d);
      for (int j = 0; j < 8; j += 2) {  // unpack pairs, then 64-bit pairs, then 128-bit halves
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(kt + (d + j) * KT + j0, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
        _mm256_storeu_ps(kt + (d + j + 4) * KT + j0, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
      }
    }
#endif
  for (; d < head_dim; ++d)
    for (int64_t j = 0; j < KT; ++j) kt[d * KT + j] = k[j * head_dim + d];
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

// s[m][j] = qf[m] . k_j for R rows from m: each load of a transposed key row serves R rows.
template <int64_t KT, int R>
inline void score_key_tile_rows(const float* qf, int64_t m, int64_t head_dim, const float* kt, float* s) {
#ifdef TOKENMILL_AVX512
  if constexpr (KT == 16) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m512 kv = _mm512_loadu_ps(kt + d * 16);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(m + r) * head_dim + d]), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + (m + r) * 16, acc[r]);
    return;
  }
#endif
#ifdef TOKENMILL_AVX2
  if constexpr (KT == 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m256 kv = _mm256_loadu_ps(kt + d * 8);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + (m + r) * head_dim + d), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + (m + r) * 8, acc[r]);
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < KT; ++j) {
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qf[(m + r) * head_dim + d] * kt[d * KT + j];
      s[(m + r) * KT + j] = dot;
    }
}

template <int64_t KT>
inline void score_key_tile(const float* qf, int64_t m0, int64_t m1, int64_t head_dim, const float* kt, float* s) {
  int64_t m = m0;
  for (; m + 8 <= m1; m += 8) score_key_tile_rows<KT, 8>(qf, m, head_dim, kt, s);
  for (; m + 4 <= m1; m += 4) score_key_tile_rows<KT, 4>(qf, m, head_dim, kt, s);
  for (; m < m1; ++m) score_key_tile_rows<KT, 1>(qf, m, head_dim, kt, s);
}

template <int64_t KT>
inline float tile_max_of(const float* s) {
#ifdef TOKENMILL_AVX512
  if constexpr (KT == 16) return _mm512_reduce_max_ps(_mm512_loadu_ps(s));
#endif
  return max_of(s, KT);
}

// p[j] = exp(s[j] - max) (0 where s[j] is -inf, a masked key); returns their sum.
template <int64_t KT>
inline float exp_tile(const float* s, float max_score, float* p) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  // exp256/exp512 clamp their argument, so a masked score would come out tiny, not 0: it is zeroed.
#ifdef TOKENMILL_AVX512
  if constexpr (KT == 16) {
    const __m512 sv = _mm512_loadu_ps(s);
    const __mmask16 live = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(max_score))));
    _mm512_storeu_ps(p, e);
    return _mm512_reduce_add_ps(e);
  }
#endif
#ifdef TOKENMILL_AVX2
  if constexpr (KT == 8) {
    const __m256 sv = _mm256_loadu_ps(s);
    const __m256 live = _mm256_cmp_ps(sv, _mm256_set1_ps(neg_inf), _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(sv, _mm256_set1_ps(max_score))), live);
    _mm256_storeu_ps(p, e);
    return hsum256(e);
  }
#endif
  float sum = 0.0f;
  for (int64_t j = 0; j < KT; ++j) {
    p[j] = s[j] == neg_inf ? 0.0f : std::exp(s[j] - max_score);
    sum += p[j];
  }
  return sum;
}

// For each of `rows` rows r: acc[r][d] = acc[r][d] * corr[r] + sum_j p[r][j] * v[j][d] over the tile's KT
// V rows ([KT][head_dim] floats). Two rows at a time share every load of V.
template <int64_t KT>
inline void accumulate_value_tile(const float* p, const float* corr, int64_t rows, const float* v, int64_t head_dim,
                                  float* acc) {
  int64_t r = 0;
#ifdef TOKENMILL_AVX512
  if constexpr (KT == 16) {
    if (head_dim % 64 == 0) {
      for (; r + 2 <= rows; r += 2)
        for (int64_t d = 0; d < head_dim; d += 64) {
          float* a0p = acc + r * head_dim + d;
          float* a1p = a0p + head_dim;
          __m512 a0[4], a1[4];
          const __m512 c0 = _mm512_set1_ps(corr[r]), c1 = _mm512_set1_ps(corr[r + 1]);
          for (int k = 0; k < 4; ++k) {
            a0[k] = _mm512_mul_ps(_mm512_loadu_ps(a0p + 16 * k), c0);
            a1[k] = _mm512_mul_ps(_mm512_loadu_ps(a1p + 16 * k), c1);
          }
          for (int64_t j = 0; j < KT; ++j) {
            const __m512 w0 = _mm512_set1_ps(p[r * KT + j]), w1 = _mm512_set1_ps(p[(r + 1) * KT + j]);
            for (int k = 0; k < 4; ++k) {
              const __m512 vv = _mm512_loadu_ps(v + j * head_dim + d + 16 * k);
              a0[k] = _mm512_fmadd_ps(w0, vv, a0[k]);
              a1[k] = _mm512_fmadd_ps(w1, vv, a1[k]);
            }
          }
          for (int k = 0; k < 4; ++k) {
            _mm512_storeu_ps(a0p + 16 * k, a0[k]);
            _mm512_storeu_ps(a1p + 16 * k, a1[k]);
          }
        }
    }
  }
#endif
  for (; r < rows; ++r) {
    const float* pr = p + r * KT;
    float* ar = acc + r * head_dim;
    int64_t d = 0;
#ifdef TOKENMILL_AVX2
    const __m256 c8 = _mm256_set1_ps(corr[r]);
    for (; d + 32 <= head_dim; d += 32) {
      __m256 a[4];
      for (int k = 0; k < 4; ++k) a[k] = _mm256_mul_ps(_mm256_loadu_ps(ar + d + 8 * k), c8);
      for (int64_t j = 0; j < KT; ++j) {
        const __m256 w = _mm256_set1_ps(pr[j]);
        for (int k = 0; k < 4; ++k) a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * head_dim + d + 8 * k), a[k]);
      }
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(ar + d + 8 * k, a[k]);
    }
#endif
    for (; d < head_dim; ++d) {
      float a = ar[d] * corr[r];
      for (int64_t j = 0; j < KT; ++j) a += pr[j] * v[j * head_dim + d];
      ar[d] = a;
    }
  }
}

struct PrefillItem {
  int64_t chunk, kv_head, first, count;  // positions [first, first + count) of the chunk's queries
  int64_t cost;                          // keys seen x positions, to take the longest first
};

struct PrefillScratch {
  std::vector<float> qf, acc, row_max, row_sum, s, k, kt, v, p, corr;
};

template <int64_t KT, typename q_t, typename cache_t>
void prefill_item(const PrefillItem& item, const q_t* q_base, int64_t q_row_stride, const cache_t* k_cache,
                  const cache_t* v_cache, const int32_t* blocks, int64_t query_start, int64_t ctx_len,
                  int64_t num_q, int64_t block_size, int64_t token_stride, int64_t group, int64_t head_dim,
                  float scale, float softcap, int64_t window, q_t* out_base, int64_t out_row_stride,
                  PrefillScratch& w) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = item.count * group;
  const int64_t pos0 = ctx_len - num_q + item.first;  // position of the item's first query
  const int64_t h = item.kv_head;
  w.qf.resize(rows * head_dim);
  w.acc.assign(rows * head_dim, 0.0f);
  w.row_max.assign(rows, neg_inf);
  w.row_sum.assign(rows, 0.0f);
  w.s.resize(rows * KT);
  w.k.resize(KT * head_dim);
  w.kt.resize(KT * head_dim);
  w.v.resize(KT * head_dim);
  w.p.resize(rows * KT);
  w.corr.resize(rows);
  // Row m = (position i, head g): query head h * group + g at position pos0 + i.
  for (int64_t i = 0; i < item.count; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const q_t* src = q_base + (query_start + item.first + i) * q_row_stride + (h * group + g) * head_dim;
      float* dst = w.qf.data() + (i * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
    }
  const int64_t last_pos = pos0 + item.count - 1;
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  for (int64_t t0 = key_lo / KT * KT; t0 <= last_pos; t0 += KT) {
    const int64_t n = std::min(KT, ctx_len - t0);
    const int64_t offset = (blocks[t0 / block_size] * block_size + t0 % block_size) * token_stride + h * head_dim;
    // The rows that see a key of this tile: position >= t0 and (windowed) position - window < t0 + KT - 1.
    const int64_t first_pos = std::max(pos0, t0);
    const int64_t end_pos = window > 0 ? std::min(last_pos + 1, t0 + KT - 1 + window) : last_pos + 1;
    if (first_pos >= end_pos) continue;
    const int64_t m0 = (first_pos - pos0) * group, m1 = (end_pos - pos0) * group;
    load_rows_float<KT>(k_cache + offset, n, token_stride, head_dim, w.k.data());
    transpose_key_tile<KT>(w.k.data(), head_dim, w.kt.data());
    score_key_tile<KT>(w.qf.data(), m0, m1, head_dim, w.kt.data(), w.s.data());
    load_rows_float<KT>(v_cache + offset, n, token_stride, head_dim, w.v.data());
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t pos = pos0 + m / group;
      float* s = w.s.data() + m * KT;
      // Most tiles are wholly visible to a row; only the diagonal one and a window's edge mask keys.
      const bool all_visible = t0 + KT - 1 <= pos && (window <= 0 || t0 > pos - window);
      if (softcap > 0.0f || !all_visible)
        for (int64_t j = 0; j < KT; ++j) {
          const int64_t key = t0 + j;
          const bool visible = key <= pos && (window <= 0 || key > pos - window);
          s[j] = !visible ? neg_inf : softcap > 0.0f ? std::tanh(s[j] / softcap) * softcap : s[j];
        }
      const float tile_max = tile_max_of<KT>(s);
      float* p = w.p.data() + (m - m0) * KT;
      if (tile_max == neg_inf) {  // no key of this tile is visible to the row: it adds nothing
        std::fill(p, p + KT, 0.0f);
        w.corr[m - m0] = 1.0f;
        continue;
      }
      const float old_max = w.row_max[m];
      const float new_max = std::max(old_max, tile_max);
      const float corr = old_max == new_max ? 1.0f : old_max == neg_inf ? 0.0f : std::exp(old_max - new_max);
      const float tile_sum = exp_tile<KT>(s, new_max, p);
      w.row_max[m] = new_max;
      w.row_sum[m] = w.row_sum[m] * corr + tile_sum;
      w.corr[m - m0] = corr;
    }
    accumulate_value_tile<KT>(w.p.data(), w.corr.data(), m1 - m0, w.v.data(), head_dim, w.acc.data() + m0 * head_dim);
  }
  for (int64_t i = 0; i < item.count; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t m = i * group + g;
      const float inv = 1.0f / w.row_sum[m];
      q_t* dst = out_base + (query_start + item.first + i) * out_row_stride + (h * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<q_t>(w.acc[m * head_dim + d] * inv);
    }
}

// The work items of a step's prefill chunks: per chunk and KV head, tiles of about tile_rows query rows
// (positions x group).
std::vector<PrefillItem> prefill_work_items(const torch::Tensor& query_ranges, const torch::Tensor& context_lens,
                                            const torch::Tensor& block_tables, int64_t block_size,
                                            int64_t num_kv_heads, int64_t group, int64_t window, int64_t tile_rows) {
  const int32_t* ranges = query_ranges.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_keys = block_tables.size(1) * block_size;
  const int64_t tile_positions = std::max<int64_t>(1, tile_rows / group);
  std::vector<PrefillItem> items;
  for (int64_t c = 0; c < context_lens.size(0); ++c) {
    const int64_t num_q = ranges[2 * c + 1] - ranges[2 * c], ctx_len = lens[c];
    TORCH_CHECK(num_q > 0 && num_q <= ctx_len && ctx_len <= max_keys, "prefill chunk lengths out of range");
    for (int64_t first = 0; first < num_q; first += tile_positions) {
      const int64_t count = std::min(tile_positions, num_q - first);
      const int64_t last = ctx_len - num_q + first + count;  // keys the tile's last query sees
      const int64_t seen = window > 0 ? std::min(last, window + count) : last;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({c, h, first, count, seen * count});
    }
  }
  return items;
}

// A step's prefill chunks as the kernels read them: shapes, the cache's K and V halves, the work items.
template <typename cache_t>
struct PrefillStep {
  int64_t head_dim, block_size, group, token_stride, max_blocks;
  const int32_t* tables;
  const int32_t* ranges;
  const int32_t* lens;
  const cache_t* k_base;
  const cache_t* v_base;
  std::vector<PrefillItem> items;

  PrefillStep(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
              const torch::Tensor& query_ranges, const torch::Tensor& context_lens, int64_t window, int64_t tile_rows)
      : head_dim(query.size(2)), block_size(kv_cache.size(2)), group(query.size(1) / kv_cache.size(3)),
        token_stride(kv_cache.size(3) * query.size(2)), max_blocks(block_tables.size(1)),
        tables(block_tables.data_ptr<int32_t>()), ranges(query_ranges.data_ptr<int32_t>()),
        lens(context_lens.data_ptr<int32_t>()), k_base(kv_cache.data_ptr<cache_t>()),
        v_base(k_base + kv_cache.size(1) * block_size * token_stride),
        items(prefill_work_items(query_ranges, context_lens, block_tables, block_size, kv_cache.size(3), group,
                                 window, tile_rows)) {}

  const int32_t* table(int64_t c) const { return tables + c * max_blocks; }
  int64_t query_start(int64_t c) const { return ranges[2 * c]; }
  int64_t num_queries(int64_t c) const { return ranges[2 * c + 1] - ranges[2 * c]; }
};

template <typename q_t, typename cache_t>
void run_paged_prefill(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& query_ranges, const torch::Tensor& context_lens, double scale,
                       double softcap, int64_t window, torch::Tensor& out) {
  const PrefillStep<cache_t> step(query, kv_cache, block_tables, query_ranges, context_lens, window, kPrefillTileRows);
  // 16 keys per tile where the vectors hold 16 floats and a block holds whole tiles, else 8.
  bool wide = false;
#ifdef TOKENMILL_AVX512
  wide = step.block_size % 16 == 0;
#endif
  const auto run_item = wide ? prefill_item<16, q_t, cache_t> : prefill_item<8, q_t, cache_t>;
  // Costs differ by the causal triangle.
  parallel_longest_first<PrefillScratch>(
      static_cast<int64_t>(step.items.size()), [&](int64_t i) { return step.items[i].cost; },
      [&](int64_t i, PrefillScratch& scratch) {
        const PrefillItem& item = step.items[i];
        const int64_t c = item.chunk;
        run_item(item, query.data_ptr<q_t>(), query.stride(0), step.k_base, step.v_base, step.table(c),
                 step.query_start(c), step.lens[c], step.num_queries(c), step.block_size, step.token_stride,
                 step.group, step.head_dim, static_cast<float>(scale), static_cast<float>(softcap), window,
                 out.data_ptr<q_t>(), out.stride(0), scratch);
      });
}
}  // namespace

// Writes the attention of every prefill query into `out` (same shape and row layout rules as query);
// other rows of `out` are left as they are. dtypes as paged_decode_attention.
namespace {
void check_prefill_arguments(const torch::Tensor& query, const torch::Tensor& kv_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& query_ranges,
                             const torch::Tensor& context_lens, const torch::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(2) == 1 &&
              out.stride(1) == out.size(2), "out must match query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(kv_cache.size(2) % 8 == 0, "block_size must be a multiple of 8");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(), "block_tables int32");
  TORCH_CHECK(query_ranges.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
              query_ranges.is_contiguous() && query_ranges.dim() == 2 && query_ranges.size(1) == 2 &&
              query_ranges.size(0) == context_lens.numel() && block_tables.size(0) == context_lens.numel(),
              "query_ranges [chunks, 2] / context_lens [chunks]: int32");
  for (int64_t c = 0; c < query_ranges.size(0); ++c) {
    const int32_t* r = query_ranges.data_ptr<int32_t>() + 2 * c;
    TORCH_CHECK(0 <= r[0] && r[0] < r[1] && r[1] <= query.size(0), "query_ranges outside the query rows");
  }
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0, "head shapes do not match");
}
}  // namespace

void paged_prefill_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                             torch::Tensor query_ranges, torch::Tensor context_lens, double scale, double softcap,
                             int64_t window, torch::Tensor out) {
  check_prefill_arguments(query, kv_cache, block_tables, query_ranges, context_lens, out);
  dispatch_attention_dtypes(query, kv_cache, "paged_prefill_attention", [&](auto* q_tag, auto* cache_tag) {
    using q_t = std::remove_pointer_t<decltype(q_tag)>;
    using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
    run_paged_prefill<q_t, cache_t>(query, kv_cache, block_tables, query_ranges, context_lens, scale, softcap, window,
                                    out);
  });
}

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

// ---- Block-quantized weight-only linear -------------------------------------------------------
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with w[n, k] = q[n, k] * scale[n, k / 32] (+ min[n, k / 32])
// for small integers q kept at the width a GGUF stores them: 8 bits for Q8_0, Q5_0/Q5_1 and the
// sub-blocks of Q5_K; 4 bits, two per byte, for Q4_0 (no min), Q4_1 and the sub-blocks of Q4_K (with a
// min). A decode step with few rows is bound by reading the weights: 4-bit blocks read an eighth of
// fp32's bytes (plus 4 or 8 bytes of scales per 32 weights). With more rows the widened weights are
// reused across rows and the row kernel reaches ~105-150 GFLOP/s (60-80% of the FMA peak) at 8-64 rows.
// Above kRowKernelMaxRows (prefill chunks, large decode batches) the weights are dequantized a tile
// of output features at a time (up to 4 MiB of float32, reused), which BLAS's sgemm multiplies: no
// dense copy of the layer is kept, and dequantizing costs ~1/rows of the GEMM's work.
//
// Layout (tokenmill.model.layers.linear.pack_blocks): output features in panels of 16; panel p holds
// features 16p..16p+15. For each block of 32 inputs and each input k of it, the 16 features' integers
// are one contiguous row: 16 int8 bytes (8-bit), or 8 bytes whose low nibbles are features 0-7 and high
// nibbles features 8-15 (4-bit; without mins the nibble is q + 8, Q4_0's own encoding). Scales (and
// mins) are fp32 [panel][block][16]. The last panel is zero-padded to 16 features. Per row and panel
// the row kernel keeps two 8-wide accumulators per block (x[m, k] broadcast times the widened integer
// row), and folds them into the running sums with the block's scales once per 32 inputs: the scale
// costs 1/32 of an FMA per weight instead of a multiply per weight. Mins add min * sum(x over the
// block) to the same sums in a second pass over the blocks, with the block sums of x computed once.
//
// Every row goes through the same operations in the same order whatever the tile it lands in and
// however many rows (up to kRowKernelMaxRows) the call has, so a decoding row's result does not depend
// on the batch it was computed in; 4-bit and 8-bit storage of the same integers give the same bits.
namespace {

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Panel = 16;
// Rows per tile: 8 block accumulators, 2 widened weight vectors and the broadcast x stay in registers;
// the 8 running sums are touched once per 32 inputs, so the compiler may keep them on the stack.
constexpr int64_t kQ8TileRows = 4;
constexpr int64_t kQ8PrefetchBytes = 1024;
// Asks for `bytes` starting `distance` past p into L1, a line at a time: a weight stream read ahead of its use
// (prefetcht0, as _mm_prefetch(..., _MM_HINT_T0)).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes, int64_t distance) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + distance + line, 0, 3);
}
// Rows of x per work item for larger steps: the panel stays in L1/L2 while a chunk of x streams past.
constexpr int64_t kQ8RowChunk = 64;
// Up to this many rows the row kernel runs; above it, dequantized tiles through sgemm.
constexpr int64_t kRowKernelMaxRows = 64;
// Float32 elements of one dequantized tile (4 MiB, reused by every call of the calling thread): most
// projections of a small model are one tile, so BLAS multiplies them at its dense speed; the tile is
// written once per call, ~1/rows of the GEMM's work. (Per-thread L2-sized tiles with single-threaded
// sgemm measured the same within noise, 2-core Xeon with AVX-512, 512-1024 rows.)
constexpr int64_t kTileElements = 1024 * 1024;

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
void block_sums(const float* x, int64_t first, int64_t end, float* out) {
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

#ifdef TOKENMILL_AVX2
inline __m256 widen_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One panel row widened to float: features 0-7 in lo, 8-15 in hi.
template <int Bits>
inline void widen_row(const uint8_t* row, __m256i zero, __m256& lo, __m256& hi) {
  if constexpr (Bits == 8) {
    lo = widen_int8x8(reinterpret_cast<const int8_t*>(row));
    hi = widen_int8x8(reinterpret_cast<const int8_t*>(row) + 8);
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)), zero));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), zero));
  }
}

// out[r] += (v0, v1) * v[r * stride] for R rows: one input (or block sum) of each row against 16 features.
template <int R>
inline void fma_broadcast_rows(__m256 (&out)[R][2], __m256 v0, __m256 v1, const float* v, int64_t stride) {
  for (int r = 0; r < R; ++r) {
    const __m256 b = _mm256_broadcast_ss(v + r * stride);
    out[r][0] = _mm256_fmadd_ps(v0, b, out[r][0]);
    out[r][1] = _mm256_fmadd_ps(v1, b, out[r][1]);
  }
}

// R rows of x (row stride in_features) against one panel; y gets the panel's `width` valid columns.
// mp/xs: the panel's mins and the rows' block sums of x (both null without mins).
template <int R, int Bits>
inline void panel_tile(const float* x, int64_t in_features, const uint8_t* qp, int zero, const float* sp,
                       const float* mp, const float* xs, int64_t width, const float* bias, bool prefetch, float* y,
                       int64_t y_stride) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  const int64_t blocks = in_features / kQ8Block;
  const __m256i zero_v = _mm256_set1_epi32(zero);
  __m256 sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qp + b * kQ8Block * row_bytes;
    // The first tile streams the panel from DRAM; later tiles find it in cache.
    if (prefetch) prefetch_ahead(qb, kQ8Block * row_bytes, kQ8PrefetchBytes);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* xb = x + b * kQ8Block;
#pragma GCC unroll 4
    for (int k = 0; k < kQ8Block; ++k) {
      __m256 lo, hi;
      widen_row<Bits>(qb + k * row_bytes, zero_v, lo, hi);
      fma_broadcast_rows<R>(acc, lo, hi, xb + k, in_features);
    }
    const __m256 s0 = _mm256_loadu_ps(sp + b * kQ8Panel), s1 = _mm256_loadu_ps(sp + b * kQ8Panel + 8);
    for (int r = 0; r < R; ++r) {
      sum[r][0] = _mm256_fmadd_ps(acc[r][0], s0, sum[r][0]);
      sum[r][1] = _mm256_fmadd_ps(acc[r][1], s1, sum[r][1]);
    }
  }
  // The offsets in a second pass: inside the block loop their updates would touch the running sums
  // (spilled to the stack there) twice per block; here the sums stay in registers (~10% at 64 rows).
  if (mp != nullptr)
    for (int64_t b = 0; b < blocks; ++b)
      fma_broadcast_rows<R>(sum, _mm256_loadu_ps(mp + b * kQ8Panel), _mm256_loadu_ps(mp + b * kQ8Panel + 8), xs + b,
                            blocks);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kQ8Panel];
    _mm256_store_ps(out, sum[r][0]);
    _mm256_store_ps(out + 8, sum[r][1]);
    for (int64_t j = 0; j < width; ++j) y[r * y_stride + j] = out[j] + (bias == nullptr ? 0.0f : bias[j]);
  }
}

#ifdef TOKENMILL_AVX512
// The same arithmetic on 16-wide registers: one panel row is one vector, so each input costs half
// the FMAs, and 8 rows of accumulators fit. Every lane runs the AVX2 tile's operations in the same
// order, so the two give the same bits. Zero: the nibble offset (8 for Q4_0), a template argument so
// the common Q4_1 / Q4_K path has no subtraction.

// Two consecutive panel rows (inputs k and k + 1) widened to float.
template <int Bits, int Zero>
inline void widen_rows16(const uint8_t* rows, __m512& w0, __m512& w1) {
  if constexpr (Bits == 8) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16))));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows));  // 8 bytes per row
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m512i v0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high));  // features 0-7 low, 8-15 high
    __m512i v1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(low, high));
    if constexpr (Zero != 0) {
      v0 = _mm512_sub_epi32(v0, _mm512_set1_epi32(Zero));
      v1 = _mm512_sub_epi32(v1, _mm512_set1_epi32(Zero));
    }
    w0 = _mm512_cvtepi32_ps(v0);
    w1 = _mm512_cvtepi32_ps(v1);
  }
}

template <int R>
inline void store_rows16(const __m512 (&sum)[R], int64_t width, const float* bias, float* y, int64_t y_stride) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[kQ8Panel];
    _mm512_store_ps(out, sum[r]);
    for (int64_t j = 0; j < width; ++j) y[r * y_stride + j] = out[j] + (bias == nullptr ? 0.0f : bias[j]);
  }
}

// Up to 8 rows against one panel, widening each panel row as it is used (few rows: the panel is read once).
template <int R, int Bits, int Zero>
void panel_tile16(const float* x, int64_t in_features, const uint8_t* qp, const float* sp, const float* mp,
                  const float* xs, int64_t width, const float* bias, bool prefetch, float* y, int64_t y_stride) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  const int64_t blocks = in_features / kQ8Block;
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qp + b * kQ8Block * row_bytes;
    if (prefetch) prefetch_ahead(qb, kQ8Block * row_bytes, kQ8PrefetchBytes);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const float* xb = x + b * kQ8Block;
#pragma GCC unroll 2
    for (int k = 0; k < kQ8Block; k += 2) {
      __m512 w0, w1;
      widen_rows16<Bits, Zero>(qb + k * row_bytes, w0, w1);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[r * in_features + k]), acc[r]);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[r * in_features + k + 1]), acc[r]);
    }
    const __m512 scale = _mm512_loadu_ps(sp + b * kQ8Panel);
    for (int r = 0; r < R; ++r) sum[r] = _mm512_fmadd_ps(acc[r], scale, sum[r]);
  }
  if (mp != nullptr)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 m = _mm512_loadu_ps(mp + b * kQ8Panel);
      for (int r = 0; r < R; ++r) sum[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * blocks + b]), sum[r]);
    }
  store_rows16<R>(sum, width, bias, y, y_stride);
}

// R rows against one block of P adjacent panels already widened into wf[32][P * 16]; their running sums
// live in sums[r][P * 16]. With two panels each broadcast of x feeds two FMAs and 16 accumulators keep
// both FMA ports busy, where one panel needs a load per FMA and has only 8 chains to hide the FMA
// latency with. Every output takes the same operations in the same order whatever P (so the same bits).
template <int P, int R>
inline void widened_block_tile(const float* wf, const float* xb, int64_t in_features, const __m512* scale,
                               float* sums) {
  __m512 acc[P][R];
  for (int i = 0; i < P; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int k = 0; k < kQ8Block; ++k) {
    __m512 w[P];
    for (int i = 0; i < P; ++i) w[i] = _mm512_load_ps(wf + (k * P + i) * kQ8Panel);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xb[r * in_features + k]);
      for (int i = 0; i < P; ++i) acc[i][r] = _mm512_fmadd_ps(w[i], xv, acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) {
      float* out = sums + (r * P + i) * kQ8Panel;
      _mm512_store_ps(out, _mm512_fmadd_ps(acc[i][r], scale[i], _mm512_load_ps(out)));
    }
}

using WidenedTileFn = void (*)(const float*, const float*, int64_t, const __m512*, float*);
template <int P>
constexpr WidenedTileFn kWidenedTileByRows[8] = {widened_block_tile<P, 1>, widened_block_tile<P, 2>,
                                                 widened_block_tile<P, 3>, widened_block_tile<P, 4>,
                                                 widened_block_tile<P, 5>, widened_block_tile<P, 6>,
                                                 widened_block_tile<P, 7>, widened_block_tile<P, 8>};

// More than 8 rows (up to kQ8RowChunk) against P adjacent panels (qp, sp, mp, bias and y at the first;
// last_width: the last panel's valid columns): each block is widened to float once, into L1, and every
// row tile reads it from there, so the unpacking is paid once per block, not per tile.
template <int Bits, int Zero, int P>
void panel_rows16(const float* x, int64_t rows, int64_t in_features, const uint8_t* qp, const float* sp,
                  const float* mp, const float* xs, int64_t last_width, const float* bias, float* y,
                  int64_t y_stride) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  const int64_t blocks = in_features / kQ8Block;
  const int64_t panel_bytes = blocks * kQ8Block * row_bytes;
  alignas(64) float sums[kQ8RowChunk * P * kQ8Panel];
  alignas(64) float wf[kQ8Block * P * kQ8Panel];  // [k][panel 0's 16 | panel 1's 16 | ...]
  std::fill(sums, sums + rows * P * kQ8Panel, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 scale[P];
    for (int i = 0; i < P; ++i) {
      const uint8_t* qb = qp + i * panel_bytes + b * kQ8Block * row_bytes;
      for (int k = 0; k < kQ8Block; k += 2) {
        __m512 w0, w1;
        widen_rows16<Bits, Zero>(qb + k * row_bytes, w0, w1);
        _mm512_store_ps(wf + (k * P + i) * kQ8Panel, w0);
        _mm512_store_ps(wf + ((k + 1) * P + i) * kQ8Panel, w1);
      }
      scale[i] = _mm512_loadu_ps(sp + (i * blocks + b) * kQ8Panel);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
      kWidenedTileByRows<P>[std::min<int64_t>(8, rows - r0) - 1](wf, x + r0 * in_features + b * kQ8Block, in_features,
                                                                 scale, sums + r0 * P * kQ8Panel);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < P; ++i) {
      __m512 sum = _mm512_load_ps(sums + (r * P + i) * kQ8Panel);
      if (mp != nullptr) {
        const float* m = mp + i * blocks * kQ8Panel;
        for (int64_t b = 0; b < blocks; ++b)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(m + b * kQ8Panel), _mm512_set1_ps(xs[r * blocks + b]), sum);
      }
      alignas(64) float out[kQ8Panel];
      _mm512_store_ps(out, sum);
      const float* bp = bias == nullptr ? nullptr : bias + i * kQ8Panel;
      float* yr = y + r * y_stride + i * kQ8Panel;
      const int64_t width = i + 1 < P ? kQ8Panel : last_width;
      for (int64_t j = 0; j < width; ++j) yr[j] = out[j] + (bp == nullptr ? 0.0f : bp[j]);
    }
}

// One (row chunk, panel) work item: direct tiles for a few rows, the widened-block path for more.
template <int Bits, int Zero>
void panel_chunk16(const float* x, int64_t rows, int64_t in_features, const uint8_t* qp, const float* sp,
                   const float* mp, const float* xs, int64_t width, const float* bias, float* y, int64_t y_stride) {
  constexpr void (*kDirect[8])(const float*, int64_t, const uint8_t*, const float*, const float*, const float*,
                               int64_t, const float*, bool, float*, int64_t) = {
      panel_tile16<1, Bits, Zero>, panel_tile16<2, Bits, Zero>, panel_tile16<3, Bits, Zero>,
      panel_tile16<4, Bits, Zero>, panel_tile16<5, Bits, Zero>, panel_tile16<6, Bits, Zero>,
      panel_tile16<7, Bits, Zero>, panel_tile16<8, Bits, Zero>};
  if (rows <= 8)
    kDirect[rows - 1](x, in_features, qp, sp, mp, xs, width, bias, true, y, y_stride);
  else
    panel_rows16<Bits, Zero, 1>(x, rows, in_features, qp, sp, mp, xs, width, bias, y, y_stride);
}
#endif

using PanelTileFn = void (*)(const float*, int64_t, const uint8_t*, int, const float*, const float*, const float*,
                             int64_t, const float*, bool, float*, int64_t);
template <int Bits>
constexpr PanelTileFn kPanelTileByRows[kQ8TileRows] = {panel_tile<1, Bits>, panel_tile<2, Bits>, panel_tile<3, Bits>,
                                                       panel_tile<4, Bits>};
#else
// Portable fallback: the same arithmetic (per-block partial sums, then scaled), one value at a time.
template <int Bits>
inline void panel_tile_scalar(const float* x, int64_t rows, int64_t in_features, const uint8_t* qp, int zero,
                              const float* sp, const float* mp, const float* xs, int64_t width, const float* bias,
                              float* y, int64_t y_stride) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  const int64_t blocks = in_features / kQ8Block;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        float acc = 0.0f;
        for (int64_t k = 0; k < kQ8Block; ++k)
          acc += static_cast<float>(PanelRow<Bits>::value(qp + (b * kQ8Block + k) * row_bytes, j, zero)) *
                 x[r * in_features + b * kQ8Block + k];
        sum += acc * sp[b * kQ8Panel + j];
      }
      if (mp != nullptr)
        for (int64_t b = 0; b < blocks; ++b) sum += mp[b * kQ8Panel + j] * xs[r * blocks + b];
      y[r * y_stride + j] = sum + (bias == nullptr ? 0.0f : bias[j]);
    }
}
#endif

template <int Bits>
void block_linear_rows(const float* x, int64_t rows, int64_t in_features, const uint8_t* q, int zero,
                       const float* scales, const float* mins, int64_t out_features, const float* bias, float* y) {
  if (rows == 0) return;
  const int64_t blocks = in_features / kQ8Block;
  const int64_t panel_bytes = blocks * kQ8Block * PanelRow<Bits>::kBytes;
  const int64_t panels = (out_features + kQ8Panel - 1) / kQ8Panel;
  const int64_t chunks = (rows + kQ8RowChunk - 1) / kQ8RowChunk;
  std::vector<float> x_block_sums;
  if (mins != nullptr) {
    x_block_sums.resize(rows * blocks);
    block_sums(x, 0, rows * blocks, x_block_sums.data());
  }
#if defined(TOKENMILL_AVX512)
  // More than 8 rows: work item = (row chunk, pair of panels), the pair multiplied together.
  if (rows > 8) {
    const int64_t pairs = (panels + 1) / 2;
    at::parallel_for(0, chunks * pairs, 2, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t p = 2 * (item % pairs), chunk = item / pairs;
        const int64_t n0 = p * kQ8Panel;
        const int64_t r_begin = chunk * kQ8RowChunk, r_end = std::min(rows, r_begin + kQ8RowChunk);
        const uint8_t* qp = q + p * panel_bytes;
        const float* sp = scales + p * blocks * kQ8Panel;
        const float* mp = mins == nullptr ? nullptr : mins + p * blocks * kQ8Panel;
        const float* bp = bias == nullptr ? nullptr : bias + n0;
        const float* xs = mins == nullptr ? nullptr : x_block_sums.data() + r_begin * blocks;
        const float* xc = x + r_begin * in_features;
        float* yc = y + r_begin * out_features + n0;
        if (p + 1 < panels) {
          const auto pair_fn = Bits == 8 ? panel_rows16<Bits, 0, 2>
                                         : (zero == 0 ? panel_rows16<Bits, 0, 2> : panel_rows16<Bits, 8, 2>);
          pair_fn(xc, r_end - r_begin, in_features, qp, sp, mp, xs, std::min(kQ8Panel, out_features - n0 - kQ8Panel),
                  bp, yc, out_features);
        } else {
          const auto chunk_fn = Bits == 8 ? panel_chunk16<Bits, 0>
                                          : (zero == 0 ? panel_chunk16<Bits, 0> : panel_chunk16<Bits, 8>);
          chunk_fn(xc, r_end - r_begin, in_features, qp, sp, mp, xs, std::min(kQ8Panel, out_features - n0), bp, yc,
                   out_features);
        }
      }
    });
    return;
  }
#endif
  // Work item = (row chunk, panel), panels innermost so a thread's consecutive items share x.
  at::parallel_for(0, chunks * panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % panels, chunk = item / panels;
      const int64_t n0 = p * kQ8Panel, width = std::min(kQ8Panel, out_features - n0);
      const uint8_t* qp = q + p * panel_bytes;
      const float* sp = scales + p * blocks * kQ8Panel;
      const float* mp = mins == nullptr ? nullptr : mins + p * blocks * kQ8Panel;
      const float* bp = bias == nullptr ? nullptr : bias + n0;
      const int64_t r_begin = chunk * kQ8RowChunk, r_end = std::min(rows, r_begin + kQ8RowChunk);
      const float* xs = mins == nullptr ? nullptr : x_block_sums.data() + r_begin * blocks;
#if defined(TOKENMILL_AVX512)
      const auto chunk_fn = Bits == 8 ? panel_chunk16<Bits, 0> : (zero == 0 ? panel_chunk16<Bits, 0> : panel_chunk16<Bits, 8>);
      chunk_fn(x + r_begin * in_features, r_end - r_begin, in_features, qp, sp, mp, xs, width, bp,
               y + r_begin * out_features + n0, out_features);
#else
      for (int64_t r0 = r_begin; r0 < r_end; r0 += kQ8TileRows) {
        const int64_t tile = std::min(kQ8TileRows, r_end - r0);
        const float* xs_tile = mins == nullptr ? nullptr : x_block_sums.data() + r0 * blocks;
#ifdef TOKENMILL_AVX2
        kPanelTileByRows<Bits>[tile - 1](x + r0 * in_features, in_features, qp, zero, sp, mp, xs_tile, width, bp,
                                         r0 == r_begin, y + r0 * out_features + n0, out_features);
#else
        panel_tile_scalar<Bits>(x + r0 * in_features, tile, in_features, qp, zero, sp, mp, xs_tile, width, bp,
                                y + r0 * out_features + n0, out_features);
#endif
      }
#endif
    }
  });
}

#if defined(TOKENMILL_AVX512)
// Inputs k and k + 1 of a (panel, block)'s 16 features, dequantized: q * scale (+ min), two roundings.
template <int Bits>
inline void dequantize_rows16(const uint8_t* rows, int zero, __m512 scale, const float* mins, __m512 offset,
                              __m512& w0, __m512& w1) {
  if (zero == 0)
    widen_rows16<Bits, 0>(rows, w0, w1);
  else
    widen_rows16<Bits, 8>(rows, w0, w1);
  w0 = _mm512_mul_ps(w0, scale);
  w1 = _mm512_mul_ps(w1, scale);
  if (mins != nullptr) {
    w0 = _mm512_add_ps(w0, offset);
    w1 = _mm512_add_ps(w1, offset);
  }
}
#endif

// Panels [p0, p1) dequantized into wt, transposed: wt[k * width + 16 * (p - p0) + j] = q * scale (+ min), the
// arithmetic of Int8Blocks.dequantize (two roundings, no fused multiply-add), for every input k.
template <int Bits>
void dequantize_panels_transposed(const uint8_t* q, int zero, const float* scales, const float* mins,
                                  int64_t blocks, int64_t p0, int64_t p1, float* wt, int64_t width) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qb = q + (p * blocks + b) * kQ8Block * row_bytes;
      const float* sp = scales + (p * blocks + b) * kQ8Panel;
      const float* mp = mins == nullptr ? nullptr : mins + (p * blocks + b) * kQ8Panel;
      float* out = wt + b * kQ8Block * width + (p - p0) * kQ8Panel;
#if defined(TOKENMILL_AVX512)
      const __m512 scale = _mm512_loadu_ps(sp);
      const __m512 offset = mp == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(mp);
      for (int64_t k = 0; k < kQ8Block; k += 2) {
        __m512 w0, w1;
        dequantize_rows16<Bits>(qb + k * row_bytes, zero, scale, mp, offset, w0, w1);
        _mm512_storeu_ps(out + k * width, w0);
        _mm512_storeu_ps(out + (k + 1) * width, w1);
      }
#elif defined(TOKENMILL_AVX2)
      const __m256i zero_v = _mm256_set1_epi32(zero);
      const __m256 s0 = _mm256_loadu_ps(sp), s1 = _mm256_loadu_ps(sp + 8);
      const __m256 m0 = mp == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(mp);
      const __m256 m1 = mp == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(mp + 8);
      for (int64_t k = 0; k < kQ8Block; ++k) {
        __m256 lo, hi;
        widen_row<Bits>(qb + k * row_bytes, zero_v, lo, hi);
        lo = _mm256_mul_ps(lo, s0);
        hi = _mm256_mul_ps(hi, s1);
        if (mp != nullptr) {
          lo = _mm256_add_ps(lo, m0);
          hi = _mm256_add_ps(hi, m1);
        }
        _mm256_storeu_ps(out + k * width, lo);
        _mm256_storeu_ps(out + k * width + 8, hi);
      }
#else
      for (int64_t k = 0; k < kQ8Block; ++k)
        for (int64_t j = 0; j < kQ8Panel; ++j) {
          float w = static_cast<float>(PanelRow<Bits>::value(qb + k * row_bytes, j, zero)) * sp[j];
          out[k * width + j] = mp == nullptr ? w : w + mp[j];
        }
#endif
    }
}

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

// y[:, n0:n0 + width] = x @ wt (wt [in_features][width] row-major), on BLAS's own threads.
void tile_gemm(const float* x, int64_t rows, int64_t in_features, const float* wt, int64_t width, float* y,
               int64_t y_stride) {
  // Column-major: y^T (width x rows, ld y_stride) = wt^T (width x K, ld width) * x^T (K x rows, ld K).
  const int m = static_cast<int>(width), n = static_cast<int>(rows), k = static_cast<int>(in_features);
  const int lda = m, ldb = k, ldc = static_cast<int>(y_stride);
  const float one = 1.0f, zero = 0.0f;
  if (sgemm_ != nullptr) {
    sgemm_("N", "N", &m, &n, &k, &one, wt, &lda, x, &ldb, &zero, y, &ldc);
    return;
  }
  auto options = torch::TensorOptions().dtype(torch::kFloat);
  torch::Tensor product = at::mm(torch::from_blob(const_cast<float*>(x), {rows, in_features}, options),
                                 torch::from_blob(const_cast<float*>(wt), {in_features, width}, options));
  torch::from_blob(y, {rows, width}, {y_stride, 1}, options).copy_(product);
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

// tile_gemm on bfloat16 x and wt, accumulating in float32: MKL's bfloat16 GEMM where torch's MKL has it,
// else the same rounded values multiplied in float32 through at::mm (the same products, another order).
void tile_gemm_bf16(const at::BFloat16* x, int64_t rows, int64_t in_features, const at::BFloat16* wt, int64_t width,
                    float* y, int64_t y_stride) {
  if (gemm_bf16bf16f32_ != nullptr) {
    // Column-major, as tile_gemm: y^T (width x rows) = wt^T (width x K, ld width) * x^T (K x rows, ld K).
    const int m = static_cast<int>(width), n = static_cast<int>(rows), k = static_cast<int>(in_features);
    const int lda = m, ldb = k, ldc = static_cast<int>(y_stride);
    const float one = 1.0f, zero = 0.0f;
    gemm_bf16bf16f32_("N", "N", &m, &n, &k, &one, reinterpret_cast<const uint16_t*>(wt), &lda,
                      reinterpret_cast<const uint16_t*>(x), &ldb, &zero, y, &ldc);
    return;
  }
  auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16);
  torch::Tensor product = at::mm(torch::from_blob(const_cast<at::BFloat16*>(x), {rows, in_features}, bf16).to(torch::kFloat),
                                 torch::from_blob(const_cast<at::BFloat16*>(wt), {in_features, width}, bf16).to(torch::kFloat));
  torch::from_blob(y, {rows, width}, {y_stride, 1}, torch::TensorOptions().dtype(torch::kFloat)).copy_(product);
}

#if defined(TOKENMILL_AMX)
// AMX-BF16 tiles for `--block-matmul bfloat16`, where the CPU has them: the same rounded operands as the
// MKL route below (x and each dequantized weight rounded to bfloat16, nearest-even; float32
// accumulation), multiplied by TDPBF16PS from tiles that tokenmill fills itself. One (panel, block) of
// the kept weights is one B operand: 16 features x 32 inputs, stored as 16 rows of 16 (w[2i], w[2i+1])
// bfloat16 pairs, so it is dequantized straight into that layout in L1, where the MKL route writes a
// float32 tile and a bfloat16 copy of it first (on a 2-core Xeon with AMX: 340-500 GOPS against 64-243).

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

constexpr int64_t kAmxWeightTile = kQ8Block * kQ8Panel;  // bfloat16 values per (panel, block)

// Panel p's blocks as TDPBF16PS B tiles: out + b * stride holds block b, row i = inputs 2i and 2i+1 of the
// panel's 16 features, interleaved. Dequantized as Int8Blocks.dequantize computes (q * scale, + min).
template <int Bits>
void dequantize_panel_amx(const uint8_t* q, int zero, const float* scales, const float* mins, int64_t blocks,
                          int64_t p, at::BFloat16* out, int64_t stride) {
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = q + (p * blocks + b) * kQ8Block * row_bytes;
    const float* sp = scales + (p * blocks + b) * kQ8Panel;
    const float* mp = mins == nullptr ? nullptr : mins + (p * blocks + b) * kQ8Panel;
    const __m512 scale = _mm512_loadu_ps(sp);
    const __m512 offset = mp == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(mp);
    at::BFloat16* tile = out + b * stride;
    for (int64_t k = 0; k < kQ8Block; k += 2) {
      __m512 w0, w1;
      dequantize_rows16<Bits>(qb + k * row_bytes, zero, scale, mp, offset, w0, w1);
      __m256i* row = reinterpret_cast<__m256i*>(tile + k * kQ8Panel);
      _mm256_storeu_si256(row, round_to_bf16_16(_mm512_permutex2var_ps(w0, first, w1)));
      _mm256_storeu_si256(row + 1, round_to_bf16_16(_mm512_permutex2var_ps(w0, second, w1)));
    }
  }
}

// y = x @ w^T (+ bias) for x already rounded to bfloat16, zero-padded to a multiple of 32 rows. Work item:
// two panels (32 features), dequantized once into the thread's buffer, then every 32-row block of x.
template <int Bits>
void block_linear_amx_bf16(const at::BFloat16* x, int64_t rows, int64_t padded_rows, int64_t in_features,
                           const uint8_t* q, int zero, const float* scales, const float* mins, int64_t out_features,
                           const float* bias, float* y) {
  const int64_t blocks = in_features / kQ8Block;
  const int64_t panels = (out_features + kQ8Panel - 1) / kQ8Panel;
  const int64_t x_stride = in_features * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t tile_bytes = kQ8Panel * 2 * static_cast<int64_t>(sizeof(at::BFloat16));  // 64
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t g0, int64_t g1) {
    load_amx_tile_config();
    thread_local std::vector<at::BFloat16> weights;
    if (static_cast<int64_t>(weights.size()) < blocks * 2 * kAmxWeightTile) weights.resize(blocks * 2 * kAmxWeightTile);
    alignas(64) float out[32][32];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = 2 * g, n0 = p * kQ8Panel;
      const bool two = p + 1 < panels;
      const int64_t width = std::min<int64_t>(out_features - n0, 2 * kQ8Panel);
      at::BFloat16* w = weights.data();
      dequantize_panel_amx<Bits>(q, zero, scales, mins, blocks, p, w, 2 * kAmxWeightTile);
      if (two) dequantize_panel_amx<Bits>(q, zero, scales, mins, blocks, p + 1, w + kAmxWeightTile, 2 * kAmxWeightTile);
      for (int64_t r0 = 0; r0 < padded_rows; r0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const at::BFloat16* xr = x + r0 * in_features;
        for (int64_t b = 0; b < blocks; ++b) {
          _tile_loadd(4, xr + b * kQ8Block, x_stride);
          _tile_loadd(5, xr + 16 * in_features + b * kQ8Block, x_stride);
          _tile_loadd(6, w + b * 2 * kAmxWeightTile, tile_bytes);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (two) {
            _tile_loadd(7, w + b * 2 * kAmxWeightTile + kAmxWeightTile, tile_bytes);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        const int64_t valid = std::min<int64_t>(32, rows - r0);
        if (bias == nullptr && width == 32 && valid == 32) {
          // A whole 32 x 32 block of y: the accumulators go straight to it, without the bounce buffer.
          float* yb = y + r0 * out_features + n0;
          const int64_t y_stride = out_features * static_cast<int64_t>(sizeof(float));
          _tile_stored(0, yb, y_stride);
          _tile_stored(1, yb + 16, y_stride);
          _tile_stored(2, yb + 16 * out_features, y_stride);
          _tile_stored(3, yb + 16 * out_features + 16, y_stride);
          continue;
        }
        _tile_stored(0, &out[0][0], 32 * sizeof(float));
        _tile_stored(1, &out[0][16], 32 * sizeof(float));
        _tile_stored(2, &out[16][0], 32 * sizeof(float));
        _tile_stored(3, &out[16][16], 32 * sizeof(float));
        for (int64_t r = 0; r < valid; ++r) {
          float* yr = y + (r0 + r) * out_features + n0;
          for (int64_t j = 0; j < width; j += 16) {
            const __mmask16 keep = width - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - j)) - 1);
            __m512 v = _mm512_load_ps(&out[r][j]);
            if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0 + j));
            _mm512_mask_storeu_ps(yr + j, keep, v);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // TOKENMILL_AMX

#if defined(TOKENMILL_AVX512)
// ---- prefill attention on AMX-BF16 tiles (`--block-matmul bfloat16` / `bfloat16-int8`) ----------------
// prefill_item's work items and online softmax, with both products on tiles. Per 32 keys and 16 query rows:
// S^T = K Q^T (A: the key rows as bfloat16, straight from their copy; B: the item's queries, transposed
// once into B's pair-interleaved layout), so each key's 16 scores are one vector over the 16 rows and the
// softmax runs down the columns without horizontal reductions; then O += P V (A: P, transposed back to
// rows; B: the value rows pair-interleaved). The scores take q * scale and k as high and low bfloat16 parts
// (three products: about float32's precision, which the softmax's exponent needs); v and p are rounded to
// bfloat16 (nearest-even, 2^-9 relative on the output); products accumulate in float32, the softmax is float32.
constexpr int64_t kAmxKeys = 32;  // keys per tile step: the depth of one TDPBF16PS of P V
constexpr int64_t kAmxPrefillTileRows = 96;  // query rows per work item: 6 blocks of 16 share each key tile's copy

struct AmxPrefillScratch {
  std::vector<at::BFloat16> qt, qt_low, k, k_low, v, vv;
  std::vector<float> acc, row_max, row_sum, pv;
};

// out[i][:] = the key (or value) row of position t0 + i, rounded to bfloat16, for i < n; zero rows after.
// With low (not for a bfloat16 cache, whose rows are exact): low[i][:] = what that rounding left, rounded.
template <typename T>
void load_rows_bf16(const T* cache, const int32_t* blocks, int64_t t0, int64_t n, int64_t block_size,
                    int64_t token_stride, int64_t head_offset, int64_t head_dim, at::BFloat16* out,
                    at::BFloat16* low = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    const T* row = cache + (blocks[t / block_size] * block_size + t % block_size) * token_stride + head_offset;
    at::BFloat16* o = out + i * head_dim;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      std::memcpy(o, row, head_dim * sizeof(at::BFloat16));
    } else {
      for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 v;
        if constexpr (std::is_same_v<T, float>)
          v = _mm512_loadu_ps(row + d);
        else
          v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
        const __m256i high = round_to_bf16_16(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), high);
        if (low != nullptr) {
          const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i * head_dim + d),
                              round_to_bf16_16(_mm512_sub_ps(v, widened)));
        }
      }
    }
  }
  std::memset(static_cast<void*>(out + n * head_dim), 0, (kAmxKeys - n) * head_dim * sizeof(at::BFloat16));
  if (low != nullptr)
    std::memset(static_cast<void*>(low + n * head_dim), 0, (kAmxKeys - n) * head_dim * sizeof(at::BFloat16));
}

// r[i] (16 dwords each) becomes column i of the 16 x 16 matrix the rows held.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[4g + c] holds rows 4g..4g+3 of columns c, c + 4, c + 8, c + 12 (one 128-bit lane each).
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);       // cols c, c+8 of rows 0-7
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);       // cols c+4, c+12 of rows 0-7
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);  // cols c, c+8 of rows 8-15
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

#endif  // TOKENMILL_AVX512

#if defined(TOKENMILL_AMX)
template <typename q_t, typename cache_t>
void prefill_item_amx(const PrefillItem& item, const q_t* q_base, int64_t q_row_stride, const cache_t* k_cache,
                      const cache_t* v_cache, const int32_t* blocks, int64_t query_start, int64_t ctx_len,
                      int64_t num_q, int64_t block_size, int64_t token_stride, int64_t group, int64_t head_dim,
                      float scale, int64_t window, q_t* out_base, int64_t out_row_stride, AmxPrefillScratch& w) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = item.count * group, row_blocks = (rows + 15) / 16;
  const int64_t pos0 = ctx_len - num_q + item.first;
  const int64_t h = item.kv_head, D = head_dim;
  // qt: per block of 16 rows, D/2 rows of 16 (q[m][2i], q[m][2i+1]) pairs: the B operand of S^T = K Q^T.
  // qt_low: what rounding q * scale to bfloat16 left, rounded again (the scores' second term).
  w.qt.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  w.qt_low.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const q_t* src = q_base + (query_start + item.first + i) * q_row_stride + (h * group + g) * D;
    const int64_t first = (m / 16) * 16 * D + 2 * (m % 16);
    for (int64_t d = 0; d < D; ++d) {
      const float x = to_float(src[d]) * scale;
      const at::BFloat16 high(x);
      w.qt[first + (d / 2) * 32 + d % 2] = high;
      w.qt_low[first + (d / 2) * 32 + d % 2] = at::BFloat16(x - static_cast<float>(high));
    }
  }
  w.acc.assign(row_blocks * 16 * D, 0.0f);
  w.row_max.assign(row_blocks * 16, neg_inf);
  w.row_sum.assign(row_blocks * 16, 0.0f);
  w.k.resize(kAmxKeys * D);
  w.k_low.resize(kAmxKeys * D);
  w.v.resize(kAmxKeys * D);
  w.vv.resize(kAmxKeys * D);
  w.pv.resize(16 * D);
  alignas(64) float s[kAmxKeys * 16];
  alignas(64) float corr[16];
  alignas(64) int32_t lane_pos[16];
  alignas(64) uint32_t pa[16 * 16];
  alignas(64) int16_t pair_index[32], low_index[32], high_index[32];
  for (int i = 0; i < 16; ++i) {
    pair_index[2 * i] = static_cast<int16_t>(i);  // (p_2i[m], p_2i+1[m]) from [p_2i x16 | p_2i+1 x16]
    pair_index[2 * i + 1] = static_cast<int16_t>(16 + i);
    low_index[2 * i] = static_cast<int16_t>(i);  // (v[2i][d], v[2i+1][d]) for d of the first 16 ...
    low_index[2 * i + 1] = static_cast<int16_t>(32 + i);
    high_index[2 * i] = static_cast<int16_t>(16 + i);  // ... and of the next 16
    high_index[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i pairs = _mm512_load_si512(pair_index), lows = _mm512_load_si512(low_index);
  const __m512i highs = _mm512_load_si512(high_index);
  const int64_t last_pos = pos0 + item.count - 1;
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const int64_t k_stride = D * static_cast<int64_t>(sizeof(at::BFloat16));
  constexpr bool exact_keys = std::is_same_v<cache_t, at::BFloat16>;
  load_amx_tile_config();
  for (int64_t t0 = key_lo / kAmxKeys * kAmxKeys; t0 <= last_pos; t0 += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, ctx_len - t0);
    const int64_t first_pos = std::max(pos0, t0);
    const int64_t end_pos = window > 0 ? std::min(last_pos + 1, t0 + kAmxKeys - 1 + window) : last_pos + 1;
    if (first_pos >= end_pos) continue;
    const int64_t m0 = (first_pos - pos0) * group, m1 = (end_pos - pos0) * group;
    load_rows_bf16(k_cache, blocks, t0, n, block_size, token_stride, h * D, D, w.k.data(),
                   exact_keys ? nullptr : w.k_low.data());
    load_rows_bf16(v_cache, blocks, t0, n, block_size, token_stride, h * D, D, w.v.data());
    // vv: 16 rows of (v[2i][d], v[2i+1][d]) pairs over d: P V's B operand, 16 values of d per tile.
    for (int64_t i = 0; i < kAmxKeys / 2; ++i)
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = _mm512_loadu_si512(w.v.data() + 2 * i * D + d);
        const __m512i b = _mm512_loadu_si512(w.v.data() + (2 * i + 1) * D + d);
        at::BFloat16* row = w.vv.data() + i * 2 * D + 2 * d;
        _mm512_storeu_si512(row, _mm512_permutex2var_epi16(a, lows, b));
        _mm512_storeu_si512(row + 32, _mm512_permutex2var_epi16(a, highs, b));
      }
    for (int64_t rb = m0 / 16; rb * 16 < m1; ++rb) {
      _tile_zero(0);
      _tile_zero(1);
      // Scores as k q ~ k_high q_high + k_high q_low + k_low q_high: float32-like scores (the softmax
      // would turn bfloat16's 2^-9 error on a score of 20 into a 4% change of its weight).
      const at::BFloat16* qt = w.qt.data() + rb * 16 * D;
      const at::BFloat16* qt_low = w.qt_low.data() + rb * 16 * D;
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(3, qt + c * 16 * 32, 64);
        _tile_loadd(5, qt_low + c * 16 * 32, 64);
        _tile_loadd(2, w.k.data() + 32 * c, k_stride);
        _tile_loadd(4, w.k.data() + 16 * D + 32 * c, k_stride);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 4, 3);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(1, 4, 5);
        if (!exact_keys) {
          _tile_loadd(6, w.k_low.data() + 32 * c, k_stride);
          _tile_loadd(7, w.k_low.data() + 16 * D + 32 * c, k_stride);
          _tile_dpbf16ps(0, 6, 3);
          _tile_dpbf16ps(1, 7, 3);
        }
      }
      _tile_stored(0, s, 64);
      _tile_stored(1, s + 256, 64);
      for (int m = 0; m < 16; ++m) lane_pos[m] = static_cast<int32_t>(pos0 + (rb * 16 + m) / group);
      const int64_t block_first = lane_pos[0], block_last = lane_pos[15];
      const bool all_visible = n == kAmxKeys && t0 + kAmxKeys - 1 <= block_first &&
                               (window <= 0 || t0 > block_last - window);
      const __m512i pos = _mm512_load_si512(lane_pos);
      const __m512 minus_inf = _mm512_set1_ps(neg_inf);
      __m512 tile_max = minus_inf;
      for (int64_t j = 0; j < kAmxKeys; ++j) {
        __m512 sj = _mm512_load_ps(s + 16 * j);
        if (!all_visible) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
          __mmask16 visible = _mm512_cmpge_epi32_mask(pos, key);
          if (window > 0)
            visible &= _mm512_cmplt_epi32_mask(pos, _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(window))));
          sj = _mm512_mask_mov_ps(minus_inf, visible, sj);
          _mm512_store_ps(s + 16 * j, sj);
        }
        tile_max = _mm512_max_ps(tile_max, sj);
      }
      float* row_max = w.row_max.data() + rb * 16;
      float* row_sum = w.row_sum.data() + rb * 16;
      const __m512 old_max = _mm512_loadu_ps(row_max);
      const __m512 new_max = _mm512_max_ps(old_max, tile_max);
      // A row that has seen no key yet subtracts 0 (its scores are all -inf, its p all 0).
      const __m512 base = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(new_max, minus_inf, _CMP_NEQ_OQ), new_max);
      const __m512 c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old_max, minus_inf, _CMP_NEQ_OQ),
                                           exp512(_mm512_sub_ps(old_max, base)));
      __m512 sum = _mm512_setzero_ps();
      __m512i p_pairs[16];
      for (int64_t i = 0; i < kAmxKeys / 2; ++i) {
        const __m512 s0 = _mm512_load_ps(s + 32 * i), s1 = _mm512_load_ps(s + 32 * i + 16);
        // exp512 clamps its argument, so a masked score would come out tiny, not 0: it is zeroed.
        const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, minus_inf, _CMP_NEQ_OQ),
                                              exp512(_mm512_sub_ps(s0, base)));
        const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, minus_inf, _CMP_NEQ_OQ),
                                              exp512(_mm512_sub_ps(s1, base)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bf16_16(p0)), round_to_bf16_16(p1), 1);
        p_pairs[i] = _mm512_permutexvar_epi16(pairs, both);  // dword m: (p[m][2i], p[m][2i+1])
      }
      _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), c, sum));
      _mm512_storeu_ps(row_max, new_max);
      _mm512_store_ps(corr, c);
      transpose16x16_epi32(p_pairs);  // now p_pairs[m] is row m of P: 32 bfloat16 keys
      for (int m = 0; m < 16; ++m) _mm512_store_si512(pa + 16 * m, p_pairs[m]);
      _tile_loadd(6, pa, 64);
      for (int64_t dc = 0; dc < D / 16; ++dc) {
        _tile_zero(5);
        _tile_loadd(7, w.vv.data() + 32 * dc, 4 * D);
        _tile_dpbf16ps(5, 6, 7);
        _tile_stored(5, w.pv.data() + 16 * dc, D * static_cast<int64_t>(sizeof(float)));
      }
      const int64_t valid = std::min<int64_t>(16, rows - rb * 16);
      for (int64_t m = 0; m < valid; ++m) {
        float* acc = w.acc.data() + (rb * 16 + m) * D;
        const float* pv = w.pv.data() + m * D;
        const __m512 cm = _mm512_set1_ps(corr[m]);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), cm, _mm512_loadu_ps(pv + d)));
      }
    }
  }
  _tile_release();
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const float inv = 1.0f / w.row_sum[m];
    q_t* dst = out_base + (query_start + item.first + i) * out_row_stride + (h * group + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<q_t>(w.acc[m * D + d] * inv);
  }
}

template <typename q_t, typename cache_t>
void run_paged_prefill_amx(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                           const torch::Tensor& query_ranges, const torch::Tensor& context_lens, double scale,
                           int64_t window, torch::Tensor& out) {
  const PrefillStep<cache_t> step(query, kv_cache, block_tables, query_ranges, context_lens, window,
                                  kAmxPrefillTileRows);
  parallel_longest_first<AmxPrefillScratch>(
      static_cast<int64_t>(step.items.size()), [&](int64_t i) { return step.items[i].cost; },
      [&](int64_t i, AmxPrefillScratch& scratch) {
        const PrefillItem& item = step.items[i];
        const int64_t c = item.chunk;
        prefill_item_amx<q_t, cache_t>(item, query.data_ptr<q_t>(), query.stride(0), step.k_base, step.v_base,
                                       step.table(c), step.query_start(c), step.lens[c], step.num_queries(c),
                                       step.block_size, step.token_stride, step.group, step.head_dim,
                                       static_cast<float>(scale), window, out.data_ptr<q_t>(), out.stride(0), scratch);
      });
}

#endif

#if defined(TOKENMILL_AVX512_BF16)
// ---- prefill attention on AVX-512 BF16 dot products (CPUs with bfloat16 instructions and no AMX) ------------
// prefill_item_amx's tiles, products and rounding, with VDPBF16PS on vectors instead of TDPBF16PS on tiles:
// per 16 query rows and 16 keys, lane m of key j's accumulator sums (q[m][2i], q[m][2i+1]) . (k[j][2i],
// k[j][2i+1]) over the pairs i (q from the same pair-interleaved copy; k's pair broadcast), so the scores come
// out as S^T again and the same column-wise softmax follows; then each row's P pairs, broadcast, times the
// pair-interleaved V rows. Same values as the AMX kernel up to the order of float32 additions.
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

inline __m512i broadcast_pair(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// s[16 * j + m] = sum over pairs of q[m] . k[j] for the 16 keys at k (rows D apart): q_high and q_low are the
// row block's pair-interleaved copies ([D / 2][16 pairs]); k_low (may be null) what k's rounding left.
inline void score_keys_dpbf16(const at::BFloat16* qt, const at::BFloat16* qt_low, const at::BFloat16* k,
                              const at::BFloat16* k_low, int64_t D, float* s) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    const __m512i q = _mm512_loadu_si512(qt + 32 * i), ql = _mm512_loadu_si512(qt_low + 32 * i);
    for (int j = 0; j < 16; ++j) {
      const __m512i kj = broadcast_pair(k + j * D + 2 * i);
      acc[j] = dot_bf16(dot_bf16(acc[j], q, kj), ql, kj);
      if (k_low != nullptr) acc[j] = dot_bf16(acc[j], q, broadcast_pair(k_low + j * D + 2 * i));
    }
  }
  for (int j = 0; j < 16; ++j) _mm512_store_ps(s + 16 * j, acc[j]);
}

// acc[r][d] = acc[r][d] * corr[r] + sum_j p[r][j] v[j][d] for R rows from r0, over 32 dimensions from d0:
// pa holds each row's 16 (p[2i], p[2i+1]) pairs as dwords, vv the pair-interleaved V rows (2D values each).
template <int R>
inline void accumulate_rows_dpbf16(const uint32_t* pa, const float* corr, const at::BFloat16* vv, int64_t D,
                                   int64_t d0, float* acc) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    a[r][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0), c);
    a[r][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16), c);
  }
  for (int64_t i = 0; i < kAmxKeys / 2; ++i) {
    const __m512i v0 = _mm512_loadu_si512(vv + i * 2 * D + 2 * d0);
    const __m512i v1 = _mm512_loadu_si512(vv + i * 2 * D + 2 * d0 + 32);
    for (int r = 0; r < R; ++r) {
      const __m512i p = _mm512_set1_epi32(static_cast<int32_t>(pa[16 * r + i]));
      a[r][0] = dot_bf16(a[r][0], v0, p);
      a[r][1] = dot_bf16(a[r][1], v1, p);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * D + d0, a[r][0]);
    _mm512_storeu_ps(acc + r * D + d0 + 16, a[r][1]);
  }
}

template <typename q_t, typename cache_t>
void prefill_item_dpbf16(const PrefillItem& item, const q_t* q_base, int64_t q_row_stride, const cache_t* k_cache,
                         const cache_t* v_cache, const int32_t* blocks, int64_t query_start, int64_t ctx_len,
                         int64_t num_q, int64_t block_size, int64_t token_stride, int64_t group, int64_t head_dim,
                         float scale, int64_t window, q_t* out_base, int64_t out_row_stride, AmxPrefillScratch& w) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = item.count * group, row_blocks = (rows + 15) / 16;
  const int64_t pos0 = ctx_len - num_q + item.first;
  const int64_t h = item.kv_head, D = head_dim;
  w.qt.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  w.qt_low.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const q_t* src = q_base + (query_start + item.first + i) * q_row_stride + (h * group + g) * D;
    const int64_t first = (m / 16) * 16 * D + 2 * (m % 16);
    for (int64_t d = 0; d < D; ++d) {
      const float x = to_float(src[d]) * scale;
      const at::BFloat16 high(x);
      w.qt[first + (d / 2) * 32 + d % 2] = high;
      w.qt_low[first + (d / 2) * 32 + d % 2] = at::BFloat16(x - static_cast<float>(high));
    }
  }
  w.acc.assign(row_blocks * 16 * D, 0.0f);
  w.row_max.assign(row_blocks * 16, neg_inf);
  w.row_sum.assign(row_blocks * 16, 0.0f);
  w.k.resize(kAmxKeys * D);
  w.k_low.resize(kAmxKeys * D);
  w.v.resize(kAmxKeys * D);
  w.vv.resize(kAmxKeys * D);
  alignas(64) float s[kAmxKeys * 16];
  alignas(64) float corr[16];
  alignas(64) int32_t lane_pos[16];
  alignas(64) uint32_t pa[16 * 16];
  alignas(64) int16_t pair_index[32], low_index[32], high_index[32];
  for (int i = 0; i < 16; ++i) {
    pair_index[2 * i] = static_cast<int16_t>(i);
    pair_index[2 * i + 1] = static_cast<int16_t>(16 + i);
    low_index[2 * i] = static_cast<int16_t>(i);
    low_index[2 * i + 1] = static_cast<int16_t>(32 + i);
    high_index[2 * i] = static_cast<int16_t>(16 + i);
    high_index[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i pairs = _mm512_load_si512(pair_index), lows = _mm512_load_si512(low_index);
  const __m512i highs = _mm512_load_si512(high_index);
  const int64_t last_pos = pos0 + item.count - 1;
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  constexpr bool exact_keys = std::is_same_v<cache_t, at::BFloat16>;
  for (int64_t t0 = key_lo / kAmxKeys * kAmxKeys; t0 <= last_pos; t0 += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, ctx_len - t0);
    const int64_t first_pos = std::max(pos0, t0);
    const int64_t end_pos = window > 0 ? std::min(last_pos + 1, t0 + kAmxKeys - 1 + window) : last_pos + 1;
    if (first_pos >= end_pos) continue;
    const int64_t m0 = (first_pos - pos0) * group, m1 = (end_pos - pos0) * group;
    load_rows_bf16(k_cache, blocks, t0, n, block_size, token_stride, h * D, D, w.k.data(),
                   exact_keys ? nullptr : w.k_low.data());
    load_rows_bf16(v_cache, blocks, t0, n, block_size, token_stride, h * D, D, w.v.data());
    for (int64_t i = 0; i < kAmxKeys / 2; ++i)
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = _mm512_loadu_si512(w.v.data() + 2 * i * D + d);
        const __m512i b = _mm512_loadu_si512(w.v.data() + (2 * i + 1) * D + d);
        at::BFloat16* row = w.vv.data() + i * 2 * D + 2 * d;
        _mm512_storeu_si512(row, _mm512_permutex2var_epi16(a, lows, b));
        _mm512_storeu_si512(row + 32, _mm512_permutex2var_epi16(a, highs, b));
      }
    for (int64_t rb = m0 / 16; rb * 16 < m1; ++rb) {
      const at::BFloat16* qt = w.qt.data() + rb * 16 * D;
      const at::BFloat16* qt_low = w.qt_low.data() + rb * 16 * D;
      for (int64_t half = 0; half < kAmxKeys / 16; ++half)
        score_keys_dpbf16(qt, qt_low, w.k.data() + half * 16 * D,
                          exact_keys ? nullptr : w.k_low.data() + half * 16 * D, D, s + half * 256);
      for (int m = 0; m < 16; ++m) lane_pos[m] = static_cast<int32_t>(pos0 + (rb * 16 + m) / group);
      const int64_t block_first = lane_pos[0], block_last = lane_pos[15];
      const bool all_visible = n == kAmxKeys && t0 + kAmxKeys - 1 <= block_first &&
                               (window <= 0 || t0 > block_last - window);
      const __m512i pos = _mm512_load_si512(lane_pos);
      const __m512 minus_inf = _mm512_set1_ps(neg_inf);
      __m512 tile_max = minus_inf;
      for (int64_t j = 0; j < kAmxKeys; ++j) {
        __m512 sj = _mm512_load_ps(s + 16 * j);
        if (!all_visible) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
          __mmask16 visible = _mm512_cmpge_epi32_mask(pos, key);
          if (window > 0)
            visible &= _mm512_cmplt_epi32_mask(pos, _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(window))));
          sj = _mm512_mask_mov_ps(minus_inf, visible, sj);
          _mm512_store_ps(s + 16 * j, sj);
        }
        tile_max = _mm512_max_ps(tile_max, sj);
      }
      float* row_max = w.row_max.data() + rb * 16;
      float* row_sum = w.row_sum.data() + rb * 16;
      const __m512 old_max = _mm512_loadu_ps(row_max);
      const __m512 new_max = _mm512_max_ps(old_max, tile_max);
      const __m512 base = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(new_max, minus_inf, _CMP_NEQ_OQ), new_max);
      const __m512 c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old_max, minus_inf, _CMP_NEQ_OQ),
                                           exp512(_mm512_sub_ps(old_max, base)));
      __m512 sum = _mm512_setzero_ps();
      __m512i p_pairs[16];
      for (int64_t i = 0; i < kAmxKeys / 2; ++i) {
        const __m512 s0 = _mm512_load_ps(s + 32 * i), s1 = _mm512_load_ps(s + 32 * i + 16);
        const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, minus_inf, _CMP_NEQ_OQ),
                                              exp512(_mm512_sub_ps(s0, base)));
        const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, minus_inf, _CMP_NEQ_OQ),
                                              exp512(_mm512_sub_ps(s1, base)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bf16_16(p0)), round_to_bf16_16(p1), 1);
        p_pairs[i] = _mm512_permutexvar_epi16(pairs, both);
      }
      _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), c, sum));
      _mm512_storeu_ps(row_max, new_max);
      _mm512_store_ps(corr, c);
      transpose16x16_epi32(p_pairs);
      for (int m = 0; m < 16; ++m) _mm512_store_si512(pa + 16 * m, p_pairs[m]);
      const int64_t valid = std::min<int64_t>(16, rows - rb * 16);
      float* acc = w.acc.data() + rb * 16 * D;
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        int64_t m = 0;
        for (; m + 4 <= valid; m += 4) accumulate_rows_dpbf16<4>(pa + 16 * m, corr + m, w.vv.data(), D, d0, acc + m * D);
        for (; m < valid; ++m) accumulate_rows_dpbf16<1>(pa + 16 * m, corr + m, w.vv.data(), D, d0, acc + m * D);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const float inv = 1.0f / w.row_sum[m];
    q_t* dst = out_base + (query_start + item.first + i) * out_row_stride + (h * group + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<q_t>(w.acc[m * D + d] * inv);
  }
}

template <typename q_t, typename cache_t>
void run_paged_prefill_dpbf16(const torch::Tensor& query, const torch::Tensor& kv_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& query_ranges,
                              const torch::Tensor& context_lens, double scale, int64_t window, torch::Tensor& out) {
  const PrefillStep<cache_t> step(query, kv_cache, block_tables, query_ranges, context_lens, window,
                                  kAmxPrefillTileRows);
  parallel_longest_first<AmxPrefillScratch>(
      static_cast<int64_t>(step.items.size()), [&](int64_t i) { return step.items[i].cost; },
      [&](int64_t i, AmxPrefillScratch& scratch) {
        const PrefillItem& item = step.items[i];
        const int64_t c = item.chunk;
        prefill_item_dpbf16<q_t, cache_t>(item, query.data_ptr<q_t>(), query.stride(0), step.k_base, step.v_base,
                                          step.table(c), step.query_start(c), step.lens[c], step.num_queries(c),
                                          step.block_size, step.token_stride, step.group, step.head_dim,
                                          static_cast<float>(scale), window, out.data_ptr<q_t>(), out.stride(0),
                                          scratch);
      });
}
#endif  // TOKENMILL_AVX512_BF16

// Steps above the row kernel's rows: each tile of panels dequantized, then one multithreaded GEMM over all
// rows. With x_bf16 (`--block-matmul bfloat16`: x already rounded to bfloat16), each dequantized tile is
// rounded to bfloat16 too and multiplied by tile_gemm_bf16; else by float32 sgemm.
template <int Bits>
void block_linear_tiled(const float* x, const at::BFloat16* x_bf16, int64_t rows, int64_t in_features,
                        const uint8_t* q, int zero, const float* scales, const float* mins, int64_t out_features,
                        const float* bias, float* y) {
  const int64_t blocks = in_features / kQ8Block;
  const int64_t panels = (out_features + kQ8Panel - 1) / kQ8Panel;
  const int64_t panels_per_tile = std::max<int64_t>(1, std::min(panels, kTileElements / (in_features * kQ8Panel)));
  thread_local std::vector<float> buffer;  // the calling thread's, kept between calls
  thread_local std::vector<at::BFloat16> rounded;
  const int64_t tile_width = panels_per_tile * kQ8Panel;
  if (static_cast<int64_t>(buffer.size()) < in_features * tile_width) buffer.resize(in_features * tile_width);
  if (x_bf16 != nullptr && static_cast<int64_t>(rounded.size()) < in_features * tile_width)
    rounded.resize(in_features * tile_width);
  for (int64_t p0 = 0; p0 < panels; p0 += panels_per_tile) {
    const int64_t p1 = std::min(panels, p0 + panels_per_tile);
    const int64_t n0 = p0 * kQ8Panel, padded = (p1 - p0) * kQ8Panel;
    const int64_t width = std::min(out_features, p1 * kQ8Panel) - n0;
    float* wt = buffer.data();
    at::BFloat16* wb = rounded.data();
    // Every thread dequantizes its panels (64-byte rows of the tile: no line is shared), then one
    // multithreaded GEMM over all rows.
    at::parallel_for(p0, p1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        dequantize_panels_transposed<Bits>(q, zero, scales, mins, blocks, p, p + 1, wt + (p - p0) * kQ8Panel, padded);
        if (x_bf16 != nullptr)
          for (int64_t k = 0; k < in_features; ++k) {
            const int64_t i = k * padded + (p - p0) * kQ8Panel;
            round_to_bf16_16(wt + i, wb + i);
          }
      }
    });
    const auto multiply = [&](float* out, int64_t ld) {
      if (x_bf16 != nullptr)
        tile_gemm_bf16(x_bf16, rows, in_features, wb, padded, out, ld);
      else
        tile_gemm(x, rows, in_features, wt, padded, out, ld);
    };
    if (width == padded) {
      multiply(y + n0, out_features);
    } else {  // the zero-padded last panel: multiply its padded width, keep the valid columns
      std::vector<float> part(rows * padded);
      multiply(part.data(), padded);
      for (int64_t r = 0; r < rows; ++r)
        std::copy(part.data() + r * padded, part.data() + r * padded + width, y + r * out_features + n0);
    }
    if (bias != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < width; ++j) y[r * out_features + n0 + j] += bias[n0 + j];
  }
}

}  // namespace

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

namespace {
// The row kernel up to kRowKernelMaxRows rows, dequantized tiles above (rounded to bfloat16 with bf16_tiles).
torch::Tensor run_block_linear(const torch::Tensor& x, const BlockLinearArgs& a, int64_t out_features,
                               bool bf16_tiles) {
  TORCH_CHECK(!a.dot_layout, "weights packed in the dot layout (--block-matmul int8) are read by block_linear_q8 only");
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows <= kRowKernelMaxRows) {
    (a.bits == 8 ? block_linear_rows<8> : block_linear_rows<4>)(x.data_ptr<float>(), rows, x.size(1), a.q, a.zero,
                                                                a.scales, a.mins, out_features, a.bias,
                                                                y.data_ptr<float>());
    return y;
  }
#if defined(TOKENMILL_AMX)
  if (bf16_tiles && amx_permitted()) {
    const int64_t padded_rows = (rows + 31) / 32 * 32;
    torch::Tensor x_bf16 = torch::empty({padded_rows, x.size(1)}, x.options().dtype(torch::kBFloat16));
    x_bf16.narrow(0, 0, rows).copy_(x);
    x_bf16.narrow(0, rows, padded_rows - rows).zero_();
    (a.bits == 8 ? block_linear_amx_bf16<8> : block_linear_amx_bf16<4>)(
        x_bf16.data_ptr<at::BFloat16>(), rows, padded_rows, x.size(1), a.q, a.zero, a.scales, a.mins, out_features,
        a.bias, y.data_ptr<float>());
    return y;
  }
#endif
  const torch::Tensor x_bf16 = bf16_tiles ? x.to(torch::kBFloat16) : torch::Tensor();
  (a.bits == 8 ? block_linear_tiled<8> : block_linear_tiled<4>)(
      x.data_ptr<float>(), bf16_tiles ? x_bf16.data_ptr<at::BFloat16>() : nullptr, rows, x.size(1), a.q, a.zero,
      a.scales, a.mins, out_features, a.bias, y.data_ptr<float>());
  return y;
}
}  // namespace

torch::Tensor block_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                           c10::optional<torch::Tensor> bias, int64_t out_features) {
  return run_block_linear(x, check_block_linear_args(x, q, scales, mins, bias, out_features), out_features, false);
}

// `--block-matmul bfloat16`: block_linear with steps of more than kRowKernelMaxRows rows multiplied in
// bfloat16 (x and each dequantized tile rounded to nearest-even, as torch's .bfloat16(); float32
// accumulation through MKL's bfloat16 GEMM).
torch::Tensor block_linear_bf16(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                                c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias,
                                int64_t out_features) {
  return run_block_linear(x, check_block_linear_args(x, q, scales, mins, bias, out_features), out_features, true);
}

// ---- Integer dot products on the kept blocks (`--block-matmul int8`) ---------------------------
// Each row of x is rounded per block of 32 inputs to int8 (scale = max|x| / 127, nearest-even), as
// llama.cpp rounds activations for its quantized matmuls; a (row, block) product is then an exact
// integer dot product of the weight's integers with x's, scaled once:
//   y[r][n] = sum_b  sw[n][b] * sx[r][b] * (sum_k a[n][k] * xq[r][k] - zero * sum_k xq[r][k])
//                    + mins[n][b] * xsum[r][b]  (+ bias[n])
// where a is the weight's integer as an unsigned byte: the nibble (0..15; Q4_0's carry + 8, zero = 8)
// or the int8 value + 128 (zero = 128). xsum is the float sum of the block's x (the min term is not
// rounded). VPDPBUSD multiplies 4 unsigned bytes by 4 signed ones and adds them into one int32 lane,
// so it wants the weights as 16 features x 4 consecutive inputs per 64 bytes (the dot layout below).
// `--block-matmul int8` keeps its weights in that layout from load on (pack_blocks(layout="dot"), the
// same bytes as pack_blocks's rows layout), so a step reads them as stored; weights in the rows layout
// (one input's 16 features per row, what the float kernels read) are repacked once per work item into an
// L1-sized buffer first, which at one row costs more than the dot products themselves.
// The arithmetic is the same on every path: the per-block float update is
//   acc = fma(float(idot), sw * sx, acc); acc = fma(mins, xsum, acc)
// so the portable loop and the AVX-512 VNNI kernel give the same bits.
//
// AVX2 has no VPDPBUSD; VPMADDUBSW multiplies unsigned by signed bytes and adds adjacent pairs into
// saturating int16 lanes, then VPMADDWD by ones adds those pairs into int32 (llama.cpp's AVX2 route).
// A 4-bit pair is at most 2 * 15 * 127 = 3,810, so a block's 8 groups add up in int16 without
// saturating (<= 30,480) and widen once per block. An 8-bit weight + 128 would saturate, so on this
// path the 8-bit panels stay signed (zero = 0) and each product is |w| * (x with w's sign) (VPSIGNB);
// the integer dot products, and therefore the float updates and the bits, are the same as above.
namespace {
#if defined(TOKENMILL_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TOKENMILL_VNNI 1
#elif defined(TOKENMILL_AVX2)
#define TOKENMILL_DOT_AVX2 1
#endif
// VPDPBUSD wants unsigned weights: the VNNI kernel reads an 8-bit weight as w + 128 (zero = 128); AVX2
// and the portable loop multiply the signed values (zero = 0).
#if defined(TOKENMILL_VNNI)
constexpr int kQ8DotZero = 128;
#else
constexpr int kQ8DotZero = 0;
#endif

// The dot layout: per (panel, block) of 32 inputs, 64-byte groups where byte 4f + j holds feature f's
// integer for input 4g + j (VPDPBUSD's operand; each 32-byte half, 8 features, is VPMADDUBSW's). 8-bit
// blocks: 8 groups of the signed values. 4-bit blocks: 4 groups of 64 bytes that hold two each, inputs
// 8u..8u+3 in the low nibbles and 8u+4..8u+7 in the high ones (the nibble as pack_blocks stores it: q,
// or q + 8 for Q4_0), so unpacking is a mask and a shift. Either is as large as the rows layout.
constexpr int64_t kDotGroupBytes = 64;  // 16 features x 4 inputs
template <int Bits>
constexpr int64_t kDotBlockBytes = kQ8Block * kQ8Panel * Bits / 8;  // 512 or 256 per (panel, block)
constexpr int64_t kDotRowChunk = 64;
// How far ahead of its reads a panel's first tile asks for the weights (into L1). A thread's panels lie
// one after another, so this runs on into its next panel. Without it the hardware prefetcher alone kept
// 16 rows x 100 MB of 4-bit panels at ~440 GOPS on two EPYC cores; with it ~560, near the VNNI peak.
constexpr int64_t kDotPrefetchBytes = 4096;
#if defined(TOKENMILL_DOT_AVX2)
constexpr int kDotTileRows = 6;  // 6 int16 + 6 float accumulators, the weights and x in 16 ymm registers
#else
constexpr int kDotTileRows = 8;
#endif

// x rounded per block: xq [rows][K] int8, scale and integer sum per (row, block), float sums for mins.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum;
  std::vector<float> sum;
};

// One (row, block) of 32 inputs rounded to int8 (nearest-even, clamped to +-127); returns the integer sum.
inline int32_t quantize_block(const float* xb, float inv, int8_t* qb) {
#ifdef TOKENMILL_AVX512
  // The scalar loop's operations lane by lane (one multiply, round to nearest-even, clamp), so the same bits.
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  __m512i total = _mm512_setzero_si512();
  for (int64_t k = 0; k < kQ8Block; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + k), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i iv = _mm512_cvttps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k), _mm512_cvtepi32_epi8(iv));
    total = _mm512_add_epi32(total, iv);
  }
  return _mm512_reduce_add_epi32(total);
#elif defined(TOKENMILL_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i iv[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    iv[j] = _mm256_cvttps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
  }
  // |values| <= 127: the saturating packs are exact; they interleave 128-bit lanes, the permute undoes it.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
#else
  int32_t s = 0;
  for (int64_t k = 0; k < kQ8Block; ++k) {
    const float v = std::nearbyint(xb[k] * inv);  // nearest-even, as cvtps2dq rounds
    const int32_t iv = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
    qb[k] = static_cast<int8_t>(iv);
    s += iv;
  }
  return s;
#endif
}

inline float block_amax(const float* xb) {
#ifdef TOKENMILL_AVX512
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16)));
  return _mm512_reduce_max_ps(a);  // max is exact in any order
#elif defined(TOKENMILL_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb)), _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8)));
  a = _mm256_max_ps(a, _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 16)),
                                     _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 24))));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
  float amax = 0.0f;
  for (int64_t k = 0; k < kQ8Block; ++k) amax = std::max(amax, std::fabs(xb[k]));
  return amax;
#endif
}

void quantize_rows(const float* x, int64_t rows, int64_t in_features, bool with_sums, QuantizedRows& out) {
  const int64_t blocks = in_features / kQ8Block;
  out.q.resize(rows * in_features);
  out.scale.resize(rows * blocks);
  out.qsum.resize(rows * blocks);
  if (with_sums) out.sum.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * kQ8Block;  // (row, block) i: rows are contiguous blocks of 32
      const float amax = block_amax(xb);
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      out.qsum[i] = quantize_block(xb, inv, out.q.data() + i * kQ8Block);
      out.scale[i] = d;
    }
    if (with_sums) block_sums(x, begin, end, out.sum.data());
  });
}

// One panel (all its blocks) from pack_blocks's rows layout (one input's 16 features per row) into the
// dot layout (above).
template <int Bits>
void repack_panel_for_dot(const uint8_t* qp, int64_t blocks, uint8_t* out) {
#if defined(TOKENMILL_VNNI)
  if constexpr (Bits == 4) {
    // 8 inputs' rows (64 bytes) become one 64-byte group pair: low nibbles hold features 0-7, high ones 8-15;
    // idx0 gathers inputs 0-3 of each feature, idx1 inputs 4-7, which go to the high nibbles.
    alignas(64) uint8_t idx[64];
    for (int f = 0; f < 16; ++f)
      for (int j = 0; j < 4; ++j) idx[f * 4 + j] = static_cast<uint8_t>(f < 8 ? j * 8 + f : 64 + j * 8 + f - 8);
    const __m512i idx0 = _mm512_load_si512(idx), idx1 = _mm512_add_epi8(idx0, _mm512_set1_epi8(32));
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < blocks * kQ8Block / 8; ++i) {
      const __m512i v = _mm512_loadu_si512(qp + i * 64);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512i first = _mm512_permutex2var_epi8(lo, idx0, hi), second = _mm512_permutex2var_epi8(lo, idx1, hi);
      _mm512_storeu_si512(out + i * 64, _mm512_or_si512(first, _mm512_slli_epi16(second, 4)));  // bytes <= 15
    }
  } else {
    alignas(64) uint8_t idx[64];
    for (int f = 0; f < 16; ++f)
      for (int j = 0; j < 4; ++j) idx[f * 4 + j] = static_cast<uint8_t>(j * 16 + f);
    const __m512i perm = _mm512_load_si512(idx);
    for (int64_t i = 0; i < blocks * kQ8Block / 4; ++i)
      _mm512_storeu_si512(out + i * 64, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(qp + i * 64)));
  }
#elif defined(TOKENMILL_DOT_AVX2)
  // A 4 x 16 byte transpose per group of 4 inputs: bytes interleaved pairwise, then pairs of pairs.
  if constexpr (Bits == 4) {
    // 4 inputs' rows (32 bytes): low nibbles features 0-7, high nibbles 8-15; (rows 0,1) and (rows 2,3)
    // interleaved byte by byte within their 16 bytes, as unpacklo_epi8 of the two rows would.
    const __m128i pairs = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    auto group = [&](const uint8_t* rows, __m128i (&o)[4]) {
      const __m128i r01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows));
      const __m128i r23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16));
      const __m128i a = _mm_shuffle_epi8(_mm_and_si128(r01, low4), pairs);
      const __m128i b = _mm_shuffle_epi8(_mm_and_si128(r23, low4), pairs);
      const __m128i c = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(r01, 4), low4), pairs);
      const __m128i d = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(r23, 4), low4), pairs);
      o[0] = _mm_unpacklo_epi16(a, b);
      o[1] = _mm_unpackhi_epi16(a, b);
      o[2] = _mm_unpacklo_epi16(c, d);
      o[3] = _mm_unpackhi_epi16(c, d);
    };
    for (int64_t u = 0; u < blocks * kQ8Block / 8; ++u) {
      __m128i first[4], second[4];
      group(qp + u * 64, first);
      group(qp + u * 64 + 32, second);
      __m128i* o = reinterpret_cast<__m128i*>(out + u * kDotGroupBytes);
      for (int i = 0; i < 4; ++i) _mm_storeu_si128(o + i, _mm_or_si128(first[i], _mm_slli_epi16(second[i], 4)));
    }
  } else {
    for (int64_t g = 0; g < blocks * kQ8Block / 4; ++g) {
      const __m128i* r = reinterpret_cast<const __m128i*>(qp + g * 64);
      const __m128i r0 = _mm_loadu_si128(r), r1 = _mm_loadu_si128(r + 1);
      const __m128i r2 = _mm_loadu_si128(r + 2), r3 = _mm_loadu_si128(r + 3);
      const __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpacklo_epi8(r2, r3);
      const __m128i c = _mm_unpackhi_epi8(r0, r1), d = _mm_unpackhi_epi8(r2, r3);
      __m128i* o = reinterpret_cast<__m128i*>(out + g * kDotGroupBytes);
      _mm_storeu_si128(o, _mm_unpacklo_epi16(a, b));
      _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(a, b));
      _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(c, d));
      _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(c, d));
    }
  }
#else
  constexpr int64_t row_bytes = PanelRow<Bits>::kBytes;
  if constexpr (Bits == 4) std::memset(out, 0, blocks * kDotBlockBytes<4>);
  for (int64_t k = 0; k < blocks * kQ8Block; ++k) {
    const uint8_t* row = qp + k * row_bytes;
    for (int64_t f = 0; f < kQ8Panel; ++f) {
      if constexpr (Bits == 4) {
        const int a = f < 8 ? row[f] & 0x0F : row[f - 8] >> 4;
        out[(k / 8) * kDotGroupBytes + f * 4 + k % 4] |= static_cast<uint8_t>(k % 8 < 4 ? a : a << 4);
      } else {
        out[(k / 4) * kDotGroupBytes + f * 4 + k % 4] = row[f];
      }
    }
  }
#endif
}

// The integer of (feature f, input k) of one (panel, block) in the dot layout: the signed value (8-bit) or
// the nibble (4-bit).
template <int Bits>
inline int dot_layout_value(const uint8_t* wb, int64_t f, int64_t k) {
  if constexpr (Bits == 8) return static_cast<int8_t>(wb[(k / 4) * kDotGroupBytes + f * 4 + k % 4]);
  const uint8_t byte = wb[(k / 8) * kDotGroupBytes + f * 4 + k % 4];
  return k % 8 < 4 ? byte & 0x0F : byte >> 4;
}

// A (panel, block)'s scales (or mins), float32 or the dot layout's float16, widen as the attention kernels
// widen a 16-bit cache (to_float, load8); load16 is load8 on 16 lanes.
#if defined(TOKENMILL_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

#if defined(TOKENMILL_DOT_AVX2)
// One half (8 features) of a panel for rows [r0, r0 + R): the weight groups at wa + 32 * half.
template <int Bits, int R, typename scale_t>
inline void dot_half_tile_avx2(const int8_t* xrow, int64_t in_features, int64_t blocks, const uint8_t* wa,
                               const scale_t* sp, const scale_t* mp, const float* xd, const int32_t* xs,
                               const float* xf, int zero, bool prefetch, __m256 (&acc)[R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wa + b * kDotBlockBytes<Bits>;
    const int8_t* xb = xrow + b * kQ8Block;
    if (prefetch) prefetch_ahead(wb, kDotBlockBytes<Bits>, kDotPrefetchBytes);
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int u = 0; u < kQ8Block / 8; ++u) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + u * kDotGroupBytes));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          int32_t first, second;
          std::memcpy(&first, xb + r * in_features + u * 8, 4);
          std::memcpy(&second, xb + r * in_features + u * 8 + 4, 4);
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(first)));
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(second)));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < kQ8Block / 4; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * kDotGroupBytes));
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xb + r * in_features + g * 4, 4);
          const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
        }
      }
    }
    const __m256 scale = load8(sp + b * kQ8Panel);
    const __m256 offset = mp == nullptr ? _mm256_setzero_ps() : load8(mp + b * kQ8Panel);
    for (int r = 0; r < R; ++r) {
      __m256i d = Bits == 4 ? _mm256_madd_epi16(dot[r], ones) : dot[r];
      if (zero != 0) d = _mm256_sub_epi32(d, _mm256_set1_epi32(zero * xs[r * blocks + b]));
      const __m256 factor = _mm256_mul_ps(scale, _mm256_set1_ps(xd[r * blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), factor, acc[r]);
      if (mp != nullptr) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xf[r * blocks + b]), acc[r]);
    }
  }
}
#endif

// Rows [r0, r0 + R) of the quantized x against one panel in the dot layout. zero: what each integer a
// carries over the weight's value (kQ8DotZero for 8-bit blocks, 8 for Q4_0's nibbles, else 0).
// prefetch: this tile is the first to read the panel, from memory (later tiles find it in cache).
template <int Bits, int R, typename scale_t>
void dot_panel_tile(const QuantizedRows& xq, int64_t r0, int64_t in_features, const uint8_t* wa, const scale_t* sp,
                    const scale_t* mp, int zero, int64_t width, const float* bias, bool prefetch, float* y,
                    int64_t y_stride) {
  const int64_t blocks = in_features / kQ8Block;
  const int8_t* xrow = xq.q.data() + r0 * in_features;
  const float* xd = xq.scale.data() + r0 * blocks;
  const int32_t* xs = xq.qsum.data() + r0 * blocks;
  const float* xf = mp == nullptr ? nullptr : xq.sum.data() + r0 * blocks;
#if defined(TOKENMILL_VNNI)
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wa + b * kDotBlockBytes<Bits>;
    const int8_t* xb = xrow + b * kQ8Block;
    if (prefetch) prefetch_ahead(wb, kDotBlockBytes<Bits>, kDotPrefetchBytes);
    // Two chains per row (inputs 4-7 of every 8 in the second): integer sums, exact in any order.
    __m512i first[R], second[R];
    for (int r = 0; r < R; ++r) first[r] = second[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int u = 0; u < kQ8Block / 8; ++u) {
      __m512i w0, w1;
      if constexpr (Bits == 4) {
        const __m512i v = _mm512_loadu_si512(wb + u * kDotGroupBytes);
        w0 = _mm512_and_si512(v, low4);
        w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else {  // signed bytes as w + 128
        w0 = _mm512_xor_si512(_mm512_loadu_si512(wb + 2 * u * kDotGroupBytes), flip);
        w1 = _mm512_xor_si512(_mm512_loadu_si512(wb + (2 * u + 1) * kDotGroupBytes), flip);
      }
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, xb + r * in_features + u * 8, 4);
        std::memcpy(&x1, xb + r * in_features + u * 8 + 4, 4);
        first[r] = _mm512_dpbusd_epi32(first[r], w0, _mm512_set1_epi32(x0));
        second[r] = _mm512_dpbusd_epi32(second[r], w1, _mm512_set1_epi32(x1));
      }
    }
    const __m512 scale = load16(sp + b * kQ8Panel);
    const __m512 offset = mp == nullptr ? _mm512_setzero_ps() : load16(mp + b * kQ8Panel);
    for (int r = 0; r < R; ++r) {
      __m512i d = _mm512_add_epi32(first[r], second[r]);
      if (zero != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(zero * xs[r * blocks + b]));
      const __m512 factor = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), factor, acc[r]);
      if (mp != nullptr) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xf[r * blocks + b]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  const __m512 bias_v = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, mask, _mm512_add_ps(acc[r], bias_v));
#elif defined(TOKENMILL_DOT_AVX2)
  for (int half = 0; half < 2 && half * 8 < width; ++half) {
    const int64_t lanes = std::min<int64_t>(8, width - half * 8);
    __m256 acc[R];
    dot_half_tile_avx2<Bits, R, scale_t>(xrow, in_features, blocks, wa + half * 32, sp + half * 8,
                                mp == nullptr ? nullptr : mp + half * 8, xd, xs, xf, zero, prefetch && half == 0,
                                acc);
    alignas(32) float bias_lanes[8] = {};
    if (bias != nullptr) std::memcpy(bias_lanes, bias + half * 8, lanes * sizeof(float));
    const __m256 bias_v = _mm256_load_ps(bias_lanes);
    for (int r = 0; r < R; ++r) {
      float* out = y + r * y_stride + half * 8;
      if (lanes == 8) {
        _mm256_storeu_ps(out, _mm256_add_ps(acc[r], bias_v));
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, _mm256_add_ps(acc[r], bias_v));
        std::memcpy(out, tail, lanes * sizeof(float));
      }
    }
  }
#else
  (void)prefetch;
  for (int r = 0; r < R; ++r) {
    float acc[kQ8Panel] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = wa + b * kDotBlockBytes<Bits>;
      const int8_t* xb = xrow + r * in_features + b * kQ8Block;
      for (int64_t f = 0; f < kQ8Panel; ++f) {
        int32_t dot = 0;
        for (int64_t k = 0; k < kQ8Block; ++k) dot += dot_layout_value<Bits>(wb, f, k) * xb[k];
        dot -= zero * xs[r * blocks + b];
        const float factor = to_float(sp[b * kQ8Panel + f]) * xd[r * blocks + b];
        acc[f] = std::fma(static_cast<float>(dot), factor, acc[f]);
        if (mp != nullptr) acc[f] = std::fma(to_float(mp[b * kQ8Panel + f]), xf[r * blocks + b], acc[f]);
      }
    }
    for (int64_t f = 0; f < width; ++f) y[r * y_stride + f] = acc[f] + (bias == nullptr ? 0.0f : bias[f]);
  }
#endif
}

template <int Bits, typename scale_t, int... Rs>
constexpr auto make_dot_tiles(std::integer_sequence<int, Rs...>) {
  using Fn = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const scale_t*, const scale_t*, int,
                      int64_t, const float*, bool, float*, int64_t);
  return std::array<Fn, sizeof...(Rs)>{dot_panel_tile<Bits, Rs + 1, scale_t>...};
}
template <int Bits, typename scale_t>
constexpr auto kDotTileByRows = make_dot_tiles<Bits, scale_t>(std::make_integer_sequence<int, kDotTileRows>{});

// dot_layout: q is in the dot layout (read in place); else in the rows layout (each panel repacked first).
template <int Bits, typename scale_t>
void block_linear_dot(const float* x, int64_t rows, int64_t in_features, const uint8_t* q, bool dot_layout, int zero,
                      const scale_t* scales, const scale_t* mins, int64_t out_features, const float* bias, float* y) {
  if (rows == 0) return;
  const int64_t blocks = in_features / kQ8Block;
  const int64_t panel_bytes = blocks * kDotBlockBytes<Bits>;  // either layout
  const int64_t panels = (out_features + kQ8Panel - 1) / kQ8Panel;
  const int64_t chunks = (rows + kDotRowChunk - 1) / kDotRowChunk;
  QuantizedRows xq;
  quantize_rows(x, rows, in_features, mins != nullptr, xq);
  const int a_zero = Bits == 8 ? kQ8DotZero : zero;
  // Work item = (row chunk, panel), panels innermost so a thread's consecutive items share x.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> repacked;
    if (!dot_layout && static_cast<int64_t>(repacked.size()) < panel_bytes) repacked.resize(panel_bytes);
    int64_t repacked_panel = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % panels, chunk = item / panels;
      const uint8_t* wa = q + p * panel_bytes;
      if (!dot_layout) {
        if (p != repacked_panel) {
          repack_panel_for_dot<Bits>(wa, blocks, repacked.data());
          repacked_panel = p;
        }
        wa = repacked.data();
      }
      const int64_t n0 = p * kQ8Panel, width = std::min(kQ8Panel, out_features - n0);
      const scale_t* sp = scales + p * blocks * kQ8Panel;
      const scale_t* mp = mins == nullptr ? nullptr : mins + p * blocks * kQ8Panel;
      const float* bp = bias == nullptr ? nullptr : bias + n0;
      const int64_t r_begin = chunk * kDotRowChunk, r_end = std::min(rows, r_begin + kDotRowChunk);
      for (int64_t r0 = r_begin; r0 < r_end; r0 += kDotTileRows) {
        const int64_t tile = std::min<int64_t>(kDotTileRows, r_end - r0);
        // A repacked panel is already in cache; one read in place streams from memory in its first tile.
        const bool prefetch = dot_layout && r0 == r_begin;
        kDotTileByRows<Bits, scale_t>[tile - 1](xq, r0, in_features, wa, sp, mp, a_zero, width, bp, prefetch,
                                       y + r0 * out_features + n0, out_features);
      }
    }
  });
}
}  // namespace

// y = x @ w^T (+ bias) with x rounded to int8 per block of 32 and integer dot products. q in either layout:
// pack_blocks's rows layout [panels, K / 32, 32, 16 * bits / 8] or the dot layout [panels, K / 32, bits / 2, 64].
torch::Tensor block_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                              c10::optional<torch::Tensor> bias, int64_t out_features) {
  const BlockLinearArgs a = check_block_linear_args(x, q, scales, mins, bias, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (a.half_scales != nullptr) {
    const auto run = a.bits == 8 ? block_linear_dot<8, at::Half> : block_linear_dot<4, at::Half>;
    run(x.data_ptr<float>(), x.size(0), x.size(1), a.q, a.dot_layout, a.zero, a.half_scales, a.half_mins,
        out_features, a.bias, y.data_ptr<float>());
  } else {
    const auto run = a.bits == 8 ? block_linear_dot<8, float> : block_linear_dot<4, float>;
    run(x.data_ptr<float>(), x.size(0), x.size(1), a.q, a.dot_layout, a.zero, a.scales, a.mins, out_features, a.bias,
        y.data_ptr<float>());
  }
  return y;
}

// ---- A whole decoder stack for a decode-only step with block-quantized weights --------------------
// The same kernels, in the same order, as the Python layers (so the result is bit-identical), called
// from one C++ loop: a decode step of a few rows spends most of its non-matmul time in Python and in
// per-op dispatch (~0.2 ms per layer on 2 cores), not in the kernels themselves.
//
// layer_params holds kDecoderLayerParams tensors per layer: input norm weight; qkv q, scales, mins, bias;
// o q, scales, mins, bias; post-attention norm weight; gate_up q, scales, mins, bias; down q, scales,
// mins, bias; q norm and k norm weights (per head, before the rotary: Qwen3, Gemma 3); pre- and
// post-feedforward norm weights (Gemma's sandwich: the post-attention norm then norms the attention output
// alone). An empty (or undefined) tensor means none. Per layer: its KV cache group's slot mapping, block table
// and context lengths, its rotary table (cos[l], sin[l]) and sliding window (0: none); a windowed layer whose decode table reaches past its window attends through the prefill
// kernel, each row a one-token chunk (decode_ranges), as the Python backend does. gelu: GELU-tanh instead of
// SiLU. int8_activations: every projection through block_linear_q8 (--block-matmul int8) instead of
// block_linear. Returns the final norm of the residual stream, [rows, hidden].
namespace {
constexpr size_t kDecoderLayerParams = 22;

c10::optional<torch::Tensor> optional_tensor(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// One projection of the stack: w points at its (q, scales, mins, bias).
torch::Tensor stack_linear(const torch::Tensor& x, const torch::Tensor* w, int64_t out_features, bool int8_activations) {
  const auto linear = int8_activations ? block_linear_q8 : block_linear;
  return linear(x, w[0], w[1], optional_tensor(w[2]), optional_tensor(w[3]), out_features);
}

// K and V of each new token into its cache slot (the Python backend's index_copy_).
// A 16-bit cache stores each value rounded to nearest even, as torch's .to() does.
template <typename cache_t>
void write_kv_rows(const torch::Tensor& qkv, int64_t q_size, int64_t kv_size, torch::Tensor& kv_cache,
                   const int64_t* slots) {
  cache_t* cache = kv_cache.data_ptr<cache_t>();
  const int64_t plane = kv_cache.numel() / 2;  // K slots, then V slots
  const float* rows = qkv.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const float* k = rows + t * stride + q_size;
    cache_t* k_slot = cache + slots[t] * kv_size;
    cache_t* v_slot = cache + plane + slots[t] * kv_size;
    for (int64_t i = 0; i < kv_size; ++i) {
      k_slot[i] = static_cast<cache_t>(k[i]);
      v_slot[i] = static_cast<cache_t>(k[kv_size + i]);
    }
  }
}

void write_kv(const torch::Tensor& qkv, int64_t q_size, int64_t kv_size, torch::Tensor& kv_cache,
              const int64_t* slots) {
  switch (kv_cache.scalar_type()) {
    case torch::kHalf: return write_kv_rows<at::Half>(qkv, q_size, kv_size, kv_cache, slots);
    case torch::kBFloat16: return write_kv_rows<at::BFloat16>(qkv, q_size, kv_size, kv_cache, slots);
    default: return write_kv_rows<float>(qkv, q_size, kv_size, kv_cache, slots);
  }
}
}  // namespace

namespace {
bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

// RMSNorm over each head of a [rows, heads * head_dim] slice of qkv (the Python layers' q_norm / k_norm on a
// contiguous copy of it), returned as [rows, heads * head_dim].
torch::Tensor norm_heads(const torch::Tensor& qkv, int64_t offset, int64_t heads, int64_t head_dim,
                         const torch::Tensor& weight, double eps) {
  const int64_t rows = qkv.size(0);
  torch::Tensor part = qkv.narrow(1, offset, heads * head_dim).contiguous().view({rows * heads, head_dim});
  return rms_norm(part, torch::empty({0}, qkv.options()), weight, eps).view({rows, heads * head_dim});
}

// gelu_tanh(gate) * up with ATen's own ops, as the Python layer computes it.
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& gate_up) {
  auto parts = gate_up.chunk(2, 1);
  return at::gelu(parts[0], "tanh") * parts[1];
}
}  // namespace

torch::Tensor decoder_decode_int8(torch::Tensor hidden, torch::Tensor positions, std::vector<torch::Tensor> slot_mappings,
                                  std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> context_lens,
                                  torch::Tensor decode_ranges, std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> layer_params,
                                  std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                                  std::vector<int64_t> windows, torch::Tensor final_norm, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap,
                                  bool gelu, bool int8_activations) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == torch::kFloat,
              "hidden: contiguous float32 [rows, hidden]");
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layer_params.size() == layers * kDecoderLayerParams, "22 parameters per layer");
  TORCH_CHECK(cos.size() == layers && sin.size() == layers && windows.size() == layers &&
              slot_mappings.size() == layers && block_tables.size() == layers && context_lens.size() == layers,
              "one rotary table, window, slot mapping, block table and context lengths per layer");
  const int64_t rows = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, hidden_size = hidden.size(1);
  const torch::Tensor none = torch::empty({0}, hidden.options());
  torch::Tensor x = hidden, residual;
  for (size_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = layer_params.data() + l * kDecoderLayerParams;
    torch::Tensor& cache = kv_caches[l];
    const torch::Tensor& slot_mapping = slot_mappings[l];
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() &&
                slot_mapping.numel() == rows, "slot_mapping: int64 [rows]");
    const auto cache_type = cache.scalar_type();
    TORCH_CHECK(cache.is_contiguous() &&
                (cache_type == torch::kFloat || cache_type == torch::kHalf || cache_type == torch::kBFloat16) &&
                cache.size(3) * cache.size(4) == kv_size,
                "kv cache: contiguous float32, float16 or bfloat16 with matching heads");
    torch::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, none, w[0], eps);
    } else {
      h = rms_norm(x, residual, w[0], eps);  // residual += x, in place
    }
    torch::Tensor qkv = stack_linear(h, w + 1, q_size + 2 * kv_size, int8_activations);
    if (present(w[18])) {  // q/k norms: one contiguous row of q, k, v again for the in-place rotary
      qkv = torch::cat({norm_heads(qkv, 0, num_heads, head_dim, w[18], eps),
                        norm_heads(qkv, q_size, num_kv_heads, head_dim, w[19], eps),
                        qkv.narrow(1, q_size + kv_size, kv_size)}, 1);
    }
    rotary_inplace(qkv, positions, cos[l], sin[l], num_heads + num_kv_heads, head_dim);
    write_kv(qkv, q_size, kv_size, cache, slot_mapping.data_ptr<int64_t>());
    torch::Tensor query = qkv.narrow(1, 0, q_size).contiguous().view({rows, num_heads, head_dim});
    torch::Tensor attn;
    if (windows[l] > 0 && block_tables[l].size(1) * cache.size(2) > windows[l]) {
      attn = torch::empty_like(query);
      paged_prefill_attention(query, cache, block_tables[l], decode_ranges, context_lens[l], scale, softcap,
                              windows[l], attn);
    } else {
      attn = paged_decode_attention(query, cache, block_tables[l], context_lens[l], scale, softcap);
    }
    h = stack_linear(attn.view({rows, q_size}), w + 5, hidden_size, int8_activations);
    const bool sandwich = present(w[20]);
    if (sandwich) {
      h = rms_norm(h, none, w[9], eps);
      h = rms_norm(h, residual, w[20], eps);
    } else {
      h = rms_norm(h, residual, w[9], eps);
    }
    const int64_t intermediate_size = w[14].size(1) * kQ8Block;  // down's inputs ([panels, K / 32, 32, 16 or 8])
    torch::Tensor gate_up = stack_linear(h, w + 10, 2 * intermediate_size, int8_activations);
    h = gelu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
    x = stack_linear(h, w + 14, hidden_size, int8_activations);
    if (sandwich) x = rms_norm(x, none, w[21], eps);
  }
  return rms_norm(x, residual, final_norm, eps);
}

// paged_prefill_attention with both products on AMX-BF16 tiles (scores from high and low bfloat16 parts of q and
// k; v and the probabilities rounded to bfloat16; float32 accumulation and softmax): `--block-matmul bfloat16` / `bfloat16-int8` prefill. Needs
// AMX, head_dim a multiple of 32 and no soft-cap (Gemma 2's layers take the float32 kernel).
void paged_prefill_attention_bf16(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                  torch::Tensor query_ranges, torch::Tensor context_lens, double scale, int64_t window,
                                  torch::Tensor out) {
  check_prefill_arguments(query, kv_cache, block_tables, query_ranges, context_lens, out);
  TORCH_CHECK(query.size(2) % 32 == 0, "paged_prefill_attention_bf16 needs head_dim a multiple of 32");
#if defined(TOKENMILL_AMX) || defined(TOKENMILL_AVX512_BF16)
  dispatch_attention_dtypes(query, kv_cache, "paged_prefill_attention_bf16", [&](auto* q_tag, auto* cache_tag) {
    using q_t = std::remove_pointer_t<decltype(q_tag)>;
    using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
    if constexpr (std::is_same_v<cache_t, double>) {
      TORCH_CHECK(false, "paged_prefill_attention_bf16 reads a float32, float16 or bfloat16 cache");
    } else {
#if defined(TOKENMILL_AMX)
      if (amx_permitted()) {
        run_paged_prefill_amx<q_t, cache_t>(query, kv_cache, block_tables, query_ranges, context_lens, scale, window,
                                            out);
        return;
      }
#endif
#if defined(TOKENMILL_AVX512_BF16)
      run_paged_prefill_dpbf16<q_t, cache_t>(query, kv_cache, block_tables, query_ranges, context_lens, scale, window,
                                             out);
#else
      TORCH_CHECK(false, "paged_prefill_attention_bf16: the kernel may not use AMX tiles here");
#endif
    }
  });
#else
  TORCH_CHECK(false, "paged_prefill_attention_bf16 needs a build with AMX-BF16 or AVX-512 BF16");
#endif
}

// Which bfloat16 products paged_prefill_attention_bf16 takes here: "amx" (tiles), "avx512_bf16" (VDPBF16PS on
// vectors), or "" where it cannot run.
std::string bf16_attention_path() {
#if defined(TOKENMILL_AMX)
  if (amx_permitted()) return "amx";
#endif
#if defined(TOKENMILL_AVX512_BF16)
  return "avx512_bf16";
#else
  return "";
#endif
}

bool bf16_attention_available() { return !bf16_attention_path().empty(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(TOKENMILL_AVX512)
  m.attr("simd") = "avx512";
#elif defined(TOKENMILL_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "portable";
#endif
#if defined(TOKENMILL_VNNI)
  m.attr("int8_dot") = "avx512_vnni";
#elif defined(TOKENMILL_DOT_AVX2)
  m.attr("int8_dot") = "avx2";
#else
  m.attr("int8_dot") = "portable";
#endif
  // Every kernel runs without the GIL (arguments are converted before, results after), so the
  // server's HTTP thread can stream and tokenize while the engine thread is inside one.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("block_linear", &block_linear,
        "x @ dequant(block-quantized weights)^T + bias for float32 x (weights in pack_blocks's layout)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
  m.def("block_linear_bf16", &block_linear_bf16,
        "block_linear with steps of more than 64 rows multiplied in bfloat16 (x and each dequantized tile "
        "rounded to it; float32 accumulation; --block-matmul bfloat16)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
#if defined(TOKENMILL_AMX)
  m.def("bf16_tiles", [] { return amx_permitted() ? "amx" : gemm_bf16bf16f32_ != nullptr ? "mkl" : "at::mm"; },
#else
  m.def("bf16_tiles", [] { return gemm_bf16bf16f32_ != nullptr ? "mkl" : "at::mm"; },
#endif
        "what multiplies block_linear_bf16's tiles here: tokenmill's AMX-BF16 tiles, MKL's bfloat16 GEMM or at::mm");
  m.def("bf16_gemm_available", [] { return gemm_bf16bf16f32_ != nullptr; },
        "whether torch's MKL exports its bfloat16 GEMM (block_linear_bf16 falls back to float32 at::mm without)");
  m.def("block_linear_q8", &block_linear_q8,
        "block_linear with x rounded per block of 32 to int8 and integer dot products (--block-matmul int8)",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("out_features"),
        nogil);
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (one query token per request); softcap > 0 caps the scores",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("softcap") = 0.0, nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over a paged KV cache, written into out; window > 0 limits each "
        "query to its last `window` keys, softcap > 0 caps the scores",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_ranges"),
        py::arg("context_lens"), py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("out"), nogil);
  m.def("paged_prefill_attention_bf16", &paged_prefill_attention_bf16,
        "paged_prefill_attention (no soft-cap) on AMX tiles or AVX-512 BF16 dot products: scores from high and low bfloat16 parts of q and k, "
        "v and the probabilities rounded to bfloat16", py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_ranges"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("out"), nogil);
  m.def("bf16_attention_available", &bf16_attention_available,
        "whether paged_prefill_attention_bf16 runs here (AMX-BF16 tiles the CPU grants, or AVX-512 BF16)");
  m.def("bf16_attention_path", &bf16_attention_path,
        "what paged_prefill_attention_bf16 multiplies with here: 'amx', 'avx512_bf16' or '' (it cannot run)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:]", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (residual updated in place)", nogil);
  m.def("decoder_decode_int8", &decoder_decode_int8,
        "a whole decoder stack (block-quantized weights) for a decode-only step", nogil);
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding in place on the first heads of each row",
        nogil);
}

