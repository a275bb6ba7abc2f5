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
// Over a bfloat16 cache, where the CPU has AVX-512 BF16, the products are bfloat16 ones (decode_one_dpbf16).

#include "common.h"

namespace {


// Asks for the rows of a block kKvPrefetchBlocks ahead early: a request's blocks are scattered over the
// cache, so the hardware prefetcher loses the stream at every block boundary. Into L2, not L1: a block's
// rows are ~100 lines, more than L1 has miss buffers for, and a prefetch into L1 waits for a free one.
// Two blocks ahead into L2 read a float16 cache from DRAM faster than one block ahead into L1
// (docs/benchmarks.md, "Prefetching the KV cache and the int8 panels").
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


// ---- decode attention over an int8 cache (model/layers/kv_int8.py) ------------------------------------------------
// decode_one's passes over each block's rows dequantized into a float32 scratch first ([rows][heads of the item x
// head_dim], L1-sized at 16 tokens): the int8 values and their scales stream from memory (a quarter of float32's
// bytes, about half a 16-bit cache's), the products run as over a float32 cache.
struct DecodeScratchInt8 {
  std::vector<float> scores, acc, qf, rows;
};

template <typename q_t>
void decode_one_int8(const q_t* __restrict__ q, const int8_t* __restrict__ k_cache, const int8_t* __restrict__ v_cache,
                     const int32_t* __restrict__ blocks, int64_t ctx_len, int64_t block_size, int64_t token_stride,
                     int64_t h0, int64_t h1, int64_t group, int64_t head_dim, int64_t head_stride, float scale,
                     float softcap, q_t* __restrict__ out, DecodeScratchInt8& w) {
  const int64_t num_q = (h1 - h0) * group, width = (h1 - h0) * head_dim;
  w.scores.resize(static_cast<size_t>(num_q * ctx_len));
  w.acc.assign(static_cast<size_t>(num_q * head_dim), 0.0f);
  w.qf.resize(static_cast<size_t>(num_q * head_dim));
  w.rows.resize(static_cast<size_t>(block_size * width));
  for (int64_t i = 0; i < num_q * head_dim; ++i) w.qf[i] = to_float(q[i]) * scale;
  float* rows = w.rows.data();
  // The block of tokens [t0, t0 + n) of a plane, dequantized: rows[i * width + (h - h0) * head_dim + d]; the block
  // kKvPrefetchBlocks ahead is asked for meanwhile.
  const auto load_block = [&](const int8_t* plane, int64_t t0, int64_t n) {
    const int64_t ahead = t0 + kKvPrefetchBlocks * block_size;
    if (ahead < ctx_len)
      prefetch_block_rows(plane + blocks[ahead / block_size] * block_size * token_stride + h0 * head_stride,
                          std::min(block_size, ctx_len - ahead), token_stride, (h1 - h0) * head_stride);
    const int8_t* block = plane + blocks[t0 / block_size] * block_size * token_stride;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = h0; h < h1; ++h)
        dequantize_kv_row(block + i * token_stride + h * head_stride, head_dim, rows + i * width + (h - h0) * head_dim);
  };
  for (int64_t b = 1; b < kKvPrefetchBlocks && b * block_size < ctx_len; ++b)
    prefetch_block_rows(k_cache + blocks[b] * block_size * token_stride + h0 * head_stride,
                        std::min(block_size, ctx_len - b * block_size), token_stride, (h1 - h0) * head_stride);
  // Pass 1: scores[j][t] = q_j . k_t
  for (int64_t t0 = 0; t0 < ctx_len; t0 += block_size) {
    const int64_t n = std::min(block_size, ctx_len - t0);
    load_block(k_cache, t0, n);
    for (int64_t h = 0; h < h1 - h0; ++h) {
      const int64_t j = h * group;
      bool scored = false;
#ifdef TOKENMILL_AVX2
      if (head_dim % 8 == 0) {
        for (int64_t c0 = 0; c0 < group; c0 += 3) {
          const float* qj = w.qf.data() + (j + c0) * head_dim;
          float* s = w.scores.data() + (j + c0) * ctx_len + t0;
          const float* k = rows + h * head_dim;
          switch (std::min<int64_t>(3, group - c0)) {
            case 1: score_block_keys<1, float>(qj, k, n, width, head_dim, s, ctx_len, k, 0); break;
            case 2: score_block_keys<2, float>(qj, k, n, width, head_dim, s, ctx_len, k, 0); break;
            default: score_block_keys<3, float>(qj, k, n, width, head_dim, s, ctx_len, k, 0); break;
          }
        }
        scored = true;
      }
#endif
      for (int64_t i = 0; i < n && !scored; ++i)
        score_row<float>(w.qf.data() + j * head_dim, rows + i * width + h * head_dim, group, head_dim,
                         w.scores.data() + j * ctx_len + t0 + i, ctx_len);
    }
  }
  if (softcap > 0.0f)
    for (int64_t i = 0; i < num_q * ctx_len; ++i) w.scores[i] = std::tanh(w.scores[i] / softcap) * softcap;
  // Pass 2: softmax per query head (while the first blocks of V are on their way).
  for (int64_t b = 0; b < kKvPrefetchBlocks && b * block_size < ctx_len; ++b)
    prefetch_block_rows(v_cache + blocks[b] * block_size * token_stride + h0 * head_stride,
                        std::min(block_size, ctx_len - b * block_size), token_stride, (h1 - h0) * head_stride);
  std::vector<float> inv_sum(num_q);
  for (int64_t j = 0; j < num_q; ++j) {
    float* s = w.scores.data() + j * ctx_len;
    inv_sum[j] = 1.0f / exp_shift_sum(s, ctx_len, max_of(s, ctx_len));
  }
  // Pass 3: out_j = sum_t p[j][t] * v_t, a dequantized block at a time.
  for (int64_t t0 = 0; t0 < ctx_len; t0 += block_size) {
    const int64_t n = std::min(block_size, ctx_len - t0);
    load_block(v_cache, t0, n);
    for (int64_t j = 0; j < num_q; ++j)
      accumulate_weighted_rows<float>(w.scores.data() + j * ctx_len + t0, rows + (j / group) * head_dim, n, width,
                                      head_dim, w.acc.data() + j * head_dim);
  }
  for (int64_t j = 0; j < num_q; ++j)
    for (int64_t d = 0; d < head_dim; ++d)
      out[j * head_dim + d] = static_cast<q_t>(w.acc[j * head_dim + d] * inv_sum[j]);
}

#if defined(TOKENMILL_AVX512_BF16)
// ---- decode attention over a bfloat16 cache on VDPBF16PS (CPUs with AVX-512 BF16) ------------------------------
// The prefill kernels' precision over a bfloat16 cache (prefill_item_bf16), so a prompt's tokens and the tokens
// decoded after it meet the same arithmetic: q * scale rounded to bfloat16 once (the keys were rounded when they
// were stored), scores as sums of bfloat16 pair products in float32, a float32 softmax whose probabilities are
// rounded to bfloat16 for P V, float32 accumulation. Each VDPBF16PS multiplies 32 cached values as they lie in
// the cache, where decode_one widens every value to float32 first and multiplies 8 per FMA: a fraction of the
// instructions, and a step's decode attention a quarter shorter where the cache streams from memory
// (docs/benchmarks.md, "Decode attention in bfloat16 products").
//
// Keys go 16 at a time: per query and key one accumulator of 16 pair sums (head_dim / 32 products), the 16
// accumulators summed across lanes at once by sum_lanes_16. Values go two tokens at a time: VPUNPCK{L,H}WD
// interleave rows t and t + 1 into (v_t[d], v_t+1[d]) pairs, which a broadcast (p_t, p_t+1) pair multiplies;
// the interleave permutes the dimensions within each 128-bit lane, which the output undoes once.

struct DecodeScratchBf16 {
  std::vector<int64_t> rows;     // token t's row offset in a plane of the cache
  std::vector<at::BFloat16> qb;  // q * scale rounded, [num_q][head_dim]
  std::vector<at::BFloat16> pb;  // probabilities rounded, [num_q][padded]
  std::vector<float> scores;     // [num_q][padded]
  std::vector<float> acc;        // [num_q][head_dim], each 32 dimensions in the interleave's order
  std::vector<float> inv_sum;    // [num_q]
};

// Lane j of the result = the sum of a[j]'s 16 lanes (pairs within 128-bit lanes first, then across).
inline __m512 sum_lanes_16(const __m512 (&a)[16]) {
  __m512 b[8];  // 128-bit lane L of b[i]: partial sums of a[2i] (elements 0, 2) and a[2i + 1] (1, 3)
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[4];  // 128-bit lane L of c[i]: lane L's sums of a[4i .. 4i + 3]
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 d[2];  // d[i]: a[8i .. 8i + 3] over lanes 0-1 and 2-3, then a[8i + 4 .. 8i + 7] likewise
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

// prefetch_block_rows for the rows of tokens [t, t + n), `width` values of each, wherever their blocks lie.
inline void prefetch_token_rows(const at::BFloat16* plane, const int64_t* rows, int64_t t, int64_t n, int64_t width) {
  for (int64_t i = 0; i < n; ++i) prefetch_block_rows(plane + rows[t + i], 1, 0, width);
}

template <typename q_t>
void decode_one_dpbf16(const q_t* __restrict__ q, const at::BFloat16* __restrict__ k_cache,
                       const at::BFloat16* __restrict__ v_cache, const int32_t* __restrict__ blocks, int64_t ctx_len,
                       int64_t block_size, int64_t token_stride, int64_t h0, int64_t h1, int64_t group, int64_t D,
                       float scale, float softcap, q_t* __restrict__ out, DecodeScratchBf16& w) {
  constexpr int64_t kKeys = 16;
  constexpr int64_t kAhead = kKvPrefetchBlocks * kKeys;  // how many tokens ahead the prefetches ask for
  const int64_t num_q = (h1 - h0) * group;
  const int64_t padded = (ctx_len + kKeys - 1) / kKeys * kKeys;
  const int64_t heads_width = (h1 - h0) * D;  // the item's heads of one token's row, side by side
  // Row offsets of the context's tokens (heads h0.. included); past the context, token 0's row: finite values
  // whose scores are never read and whose probabilities are 0.
  w.rows.resize(padded);
  for (int64_t t = 0; t < ctx_len; ++t)
    w.rows[t] = (blocks[t / block_size] * block_size + t % block_size) * token_stride + h0 * D;
  for (int64_t t = ctx_len; t < padded; ++t) w.rows[t] = w.rows[0];
  const int64_t* rows = w.rows.data();
  w.qb.resize(num_q * D);
  for (int64_t i = 0; i < num_q * D; ++i) w.qb[i] = at::BFloat16(to_float(q[i]) * scale);
  w.scores.resize(num_q * padded);

  // Pass 1: scores, 16 keys at a time; the rows kAhead tokens on are asked for, a share per query.
  prefetch_token_rows(k_cache, rows, 0, std::min<int64_t>(kAhead, ctx_len), heads_width);
  for (int64_t t0 = 0; t0 < ctx_len; t0 += kKeys) {
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kKeys, ctx_len - t0 - kAhead));
    for (int64_t j = 0; j < num_q; ++j) {
      const int64_t first = ahead * j / num_q, last = ahead * (j + 1) / num_q;
      prefetch_token_rows(k_cache, rows, t0 + kAhead + first, last - first, heads_width);
      const at::BFloat16* k = k_cache + (j / group) * D;
      const at::BFloat16* qj = w.qb.data() + j * D;
      __m512 acc[kKeys];
      for (int i = 0; i < kKeys; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i qv = _mm512_loadu_si512(qj + c);
#pragma GCC unroll 16
        for (int i = 0; i < kKeys; ++i) acc[i] = dot_bf16(acc[i], qv, _mm512_loadu_si512(k + rows[t0 + i] + c));
      }
      _mm512_storeu_ps(w.scores.data() + j * padded + t0, sum_lanes_16(acc));
    }
  }
  if (softcap > 0.0f)
    for (int64_t j = 0; j < num_q; ++j)
      for (int64_t t = 0; t < ctx_len; ++t) {
        float& s = w.scores[j * padded + t];
        s = std::tanh(s / softcap) * softcap;
      }

  // Pass 2: probabilities, rounded to bfloat16 (zero past the context), while the first V rows are on their way.
  prefetch_token_rows(v_cache, rows, 0, std::min<int64_t>(kAhead, ctx_len), heads_width);
  w.pb.resize(num_q * padded);
  w.inv_sum.resize(num_q);
  for (int64_t j = 0; j < num_q; ++j) {
    const float* s = w.scores.data() + j * padded;
    const __m512 base = _mm512_set1_ps(max_of(s, ctx_len));
    __m512 sum = _mm512_setzero_ps();
    at::BFloat16* pj = w.pb.data() + j * padded;
    for (int64_t t = 0; t < padded; t += kKeys) {
      const __mmask16 valid = ctx_len - t >= kKeys ? __mmask16(0xFFFF) : __mmask16((1u << (ctx_len - t)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(valid, exp512_to_bf16(_mm512_sub_ps(_mm512_loadu_ps(s + t), base)));
      sum = _mm512_add_ps(sum, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pj + t), (__m256i)_mm512_cvtneps_pbh(p));
    }
    w.inv_sum[j] = 1.0f / _mm512_reduce_add_ps(sum);
  }

  // Pass 3: acc_j += sum_t p[j][t] v_t, two tokens per product, 16 tokens per step.
  w.acc.assign(num_q * D, 0.0f);
  for (int64_t t0 = 0; t0 < ctx_len; t0 += kKeys) {
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kKeys, ctx_len - t0 - kAhead));
    prefetch_token_rows(v_cache, rows, t0 + kAhead, ahead, heads_width);
    for (int64_t h = 0; h < h1 - h0; ++h)
      for (int64_t c = 0; c < D; c += 32) {
        __m512i lo[kKeys / 2], hi[kKeys / 2];
        for (int i = 0; i < kKeys / 2; ++i) {
          const __m512i a = _mm512_loadu_si512(v_cache + rows[t0 + 2 * i] + h * D + c);
          const __m512i b = _mm512_loadu_si512(v_cache + rows[t0 + 2 * i + 1] + h * D + c);
          lo[i] = _mm512_unpacklo_epi16(a, b);
          hi[i] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = h * group + g;
          float* a = w.acc.data() + j * D + c;
          __m512 a_lo = _mm512_loadu_ps(a), a_hi = _mm512_loadu_ps(a + 16);
          const at::BFloat16* pj = w.pb.data() + j * padded + t0;
          for (int i = 0; i < kKeys / 2; ++i) {
            const __m512i p = broadcast_pair(pj + 2 * i);
            a_lo = dot_bf16(a_lo, lo[i], p);
            a_hi = dot_bf16(a_hi, hi[i], p);
          }
          _mm512_storeu_ps(a, a_lo);
          _mm512_storeu_ps(a + 16, a_hi);
        }
      }
  }
  // Dimension 8L + i of a 32-dimension chunk is lane 4L + i of its low half (i < 4), else of its high half.
  alignas(64) int32_t first_index[16], second_index[16];
  for (int d = 0; d < 32; ++d) {
    const int lane = 4 * (d / 8) + d % 4 + (d % 8 < 4 ? 0 : 16);
    (d < 16 ? first_index[d] : second_index[d - 16]) = lane;
  }
  const __m512i first_lanes = _mm512_load_si512(first_index), second_lanes = _mm512_load_si512(second_index);
  for (int64_t j = 0; j < num_q; ++j) {
    const __m512 inv = _mm512_set1_ps(w.inv_sum[j]);
    for (int64_t c = 0; c < D; c += 32) {
      const float* a = w.acc.data() + j * D + c;
      const __m512 a_lo = _mm512_loadu_ps(a), a_hi = _mm512_loadu_ps(a + 16);
      alignas(64) float o[32];
      _mm512_store_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(a_lo, first_lanes, a_hi), inv));
      _mm512_store_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a_lo, second_lanes, a_hi), inv));
      for (int d = 0; d < 32; ++d) out[j * D + c + d] = static_cast<q_t>(o[d]);
    }
  }
}

// An int8 cache's rows on the same products: one KV head's context dequantized into bfloat16 planes (each value
// rounded once more, as a bfloat16 cache stores it), then decode_one_dpbf16 over them as one block. The int8 rows
// stream from memory (about half a bfloat16 cache's bytes); the planes, a head's context at 2 bytes a value, stay
// in the caches for the two passes that read them.
struct DecodeScratchInt8Bf16 {
  std::vector<at::BFloat16> k, v;
  DecodeScratchBf16 bf16;
};

template <typename q_t>
void decode_one_int8_dpbf16(const q_t* __restrict__ q, const int8_t* __restrict__ k_cache,
                            const int8_t* __restrict__ v_cache, const int32_t* __restrict__ blocks, int64_t ctx_len,
                            int64_t block_size, int64_t token_stride, int64_t h, int64_t group, int64_t D,
                            int64_t head_stride, float scale, float softcap, q_t* __restrict__ out,
                            DecodeScratchInt8Bf16& w) {
  w.k.resize(ctx_len * D);
  w.v.resize(ctx_len * D);
  for (int64_t t0 = 0; t0 < ctx_len; t0 += block_size) {
    const int64_t n = std::min(block_size, ctx_len - t0);
    const int64_t ahead = t0 + kKvPrefetchBlocks * block_size;
    for (const int8_t* plane : {k_cache, v_cache}) {
      if (ahead < ctx_len)
        prefetch_block_rows(plane + blocks[ahead / block_size] * block_size * token_stride + h * head_stride,
                            std::min(block_size, ctx_len - ahead), token_stride, head_stride);
      at::BFloat16* dst = (plane == k_cache ? w.k.data() : w.v.data()) + t0 * D;
      const int8_t* block = plane + blocks[t0 / block_size] * block_size * token_stride + h * head_stride;
      for (int64_t i = 0; i < n; ++i) dequantize_kv_row_bf16(block + i * token_stride, D, dst + i * D);
    }
  }
  const int32_t single_block = 0;
  decode_one_dpbf16<q_t>(q, w.k.data(), w.v.data(), &single_block, ctx_len, ctx_len, D, 0, 1, group, D, scale,
                         softcap, out, w.bf16);
}
#endif  // TOKENMILL_AVX512_BF16

}  // namespace

namespace {

struct DecodeScratch {
  std::vector<float> scores, acc, qf;
  DecodeScratchInt8 int8;
#if defined(TOKENMILL_AVX512_BF16)
  DecodeScratchBf16 bf16;
  DecodeScratchInt8Bf16 int8_bf16;
#endif
};

template <typename q_t, typename cache_t>
void run_paged_decode(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, double scale, double softcap, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t head_stride = kv_cache.size(4);  // head_dim, or an int8 cache's head_dim + its scales
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t token_stride = num_kv_heads * head_stride;
  const int64_t plane = num_blocks * block_size * token_stride;
  const q_t* q_base = query.data_ptr<q_t>();
  const cache_t* k_base = kv_cache.data_ptr<cache_t>();
  const cache_t* v_base = k_base + plane;
  q_t* out_base = out.data_ptr<q_t>();
  // A work item is one request (all its kv heads: contiguous reads); with fewer requests than
  // threads to keep busy, one (request, kv head) pair, so a single long request still spreads.
  // Over an int8 cache on bfloat16 products an item is always one head (its dequantized planes stay small).
  bool int8_bf16 = false;
#if defined(TOKENMILL_AVX512_BF16)
  int8_bf16 = kInt8Cache<cache_t> && head_dim % 32 == 0;
#endif
  const int64_t heads_per_item = batch >= 4 * at::get_num_threads() && !int8_bf16 ? num_kv_heads : 1;
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
        if constexpr (kInt8Cache<cache_t>) {
#if defined(TOKENMILL_AVX512_BF16)
          if (int8_bf16) {
            decode_one_int8_dpbf16<q_t>(q_base + q_offset, k_base, v_base, tables + b * max_blocks, lens[b],
                                        block_size, token_stride, h0, group, head_dim, head_stride,
                                        static_cast<float>(scale), static_cast<float>(softcap), out_base + q_offset,
                                        w.int8_bf16);
            return;
          }
#endif
          decode_one_int8<q_t>(q_base + q_offset, k_base, v_base, tables + b * max_blocks, lens[b], block_size,
                               token_stride, h0, h1, group, head_dim, head_stride, static_cast<float>(scale),
                               static_cast<float>(softcap), out_base + q_offset, w.int8);
        } else {
#if defined(TOKENMILL_AVX512_BF16)
          if constexpr (std::is_same_v<cache_t, at::BFloat16>) {
            if (head_dim % 32 == 0) {
              decode_one_dpbf16<q_t>(q_base + q_offset, k_base, v_base, tables + b * max_blocks, lens[b], block_size,
                                     token_stride, h0, h1, group, head_dim, static_cast<float>(scale),
                                     static_cast<float>(softcap), out_base + q_offset, w.bf16);
              return;
            }
          }
#endif
          decode_one<q_t, cache_t>(q_base + q_offset, k_base, v_base, tables + b * max_blocks, lens[b], block_size,
                                   token_stride, h0, h1, group, head_dim, static_cast<float>(scale),
                                   static_cast<float>(softcap), out_base + q_offset, w.scores, w.acc, w.qf);
        }
      });
}
}  // namespace

// query and kv_cache of one dtype (float32, bfloat16, float16), a float32 query over a bfloat16 or
// float16 cache, or any of those queries over an int8 cache (kv_int8.py's rows). The output has the query's dtype.
// Over an int8 cache with head_dim a multiple of 32, on CPUs with AVX-512 BF16, in bfloat16 products too (the rows
// dequantized to bfloat16 first: decode_one_int8_dpbf16). Over a bfloat16 cache with head_dim a multiple of 32, on CPUs
// with AVX-512 BF16, in bfloat16 products (decode_one_dpbf16); otherwise in float32 products.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [batch, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous(), "block_tables int32");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt, "context_lens int32");
  TORCH_CHECK(kv_rows_hold(kv_cache, query.size(2)) && query.size(1) % kv_cache.size(3) == 0,
              "head shapes do not match");
  auto out = torch::empty_like(query);
  dispatch_attention_dtypes(query, kv_cache, "paged_decode_attention", [&](auto* q_tag, auto* cache_tag) {
    using q_t = std::remove_pointer_t<decltype(q_tag)>;
    using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
    run_paged_decode<q_t, cache_t>(query, kv_cache, block_tables, context_lens, scale, softcap, out);
  });
  return out;
}

bool bf16_decode_attention_available() {
#if defined(TOKENMILL_AVX512_BF16)
  return true;
#else
  return false;
#endif
}
