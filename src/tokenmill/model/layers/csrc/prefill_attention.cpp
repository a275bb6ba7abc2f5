#include "common.h"

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

// out[i][d] = rows[i * stride + d] for i < n (an int8 cache's dequantized); rows n..KT-1 are zero
// (past the context: their probabilities are 0, and 0 * garbage could be NaN).
template <int64_t KT, typename T>
inline void load_rows_float(const T* rows, int64_t n, int64_t stride, int64_t head_dim, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = rows + i * stride;
    int64_t d = 0;
    if constexpr (kInt8Cache<T>) {
      dequantize_kv_row(row, head_dim, out + i * head_dim);
      continue;
    }
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
                  int64_t head_stride, float scale, float softcap, int64_t window, q_t* out_base,
                  int64_t out_row_stride, PrefillScratch& w) {
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
    const int64_t offset = (blocks[t0 / block_size] * block_size + t0 % block_size) * token_stride + h * head_stride;
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
// head_stride: a (token, head) row's width in the cache (head_dim, or an int8 cache's head_dim + its scales).
template <typename cache_t>
struct PrefillStep {
  int64_t head_dim, head_stride, block_size, group, token_stride, max_blocks;
  const int32_t* tables;
  const int32_t* ranges;
  const int32_t* lens;
  const cache_t* k_base;
  const cache_t* v_base;
  std::vector<PrefillItem> items;

  PrefillStep(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
              const torch::Tensor& query_ranges, const torch::Tensor& context_lens, int64_t window, int64_t tile_rows)
      : head_dim(query.size(2)), head_stride(kv_cache.size(4)), block_size(kv_cache.size(2)),
        group(query.size(1) / kv_cache.size(3)), token_stride(kv_cache.size(3) * kv_cache.size(4)),
        max_blocks(block_tables.size(1)),
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
                 step.group, step.head_dim, step.head_stride, static_cast<float>(scale), static_cast<float>(softcap), window,
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
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous(), "block_tables int32");
  TORCH_CHECK(query_ranges.scalar_type() == torch::kInt && context_lens.scalar_type() == torch::kInt &&
              query_ranges.is_contiguous() && query_ranges.dim() == 2 && query_ranges.size(1) == 2 &&
              query_ranges.size(0) == context_lens.numel() && block_tables.size(0) == context_lens.numel(),
              "query_ranges [chunks, 2] / context_lens [chunks]: int32");
  for (int64_t c = 0; c < query_ranges.size(0); ++c) {
    const int32_t* r = query_ranges.data_ptr<int32_t>() + 2 * c;
    TORCH_CHECK(0 <= r[0] && r[0] < r[1] && r[1] <= query.size(0), "query_ranges outside the query rows");
  }
  TORCH_CHECK(kv_rows_hold(kv_cache, query.size(2)) && query.size(1) % kv_cache.size(3) == 0,
              "head shapes do not match");
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

namespace {
#if defined(TOKENMILL_AVX512)
// ---- prefill attention on AMX-BF16 tiles (`--block-matmul bfloat16` / `bfloat16-int8`) ----------------
// prefill_item's work items and online softmax, with both products on tiles. Per 32 keys and 16 query rows:
// S^T = K Q^T (A: the key rows as bfloat16, straight from their copy; B: the item's queries, transposed
// once into B's pair-interleaved layout), so each key's 16 scores are one vector over the 16 rows and the
// softmax runs down the columns without horizontal reductions; then O += P V (A: P, transposed back to
// rows; B: the value rows pair-interleaved). Over a float32 or float16 cache the scores take q * scale and k as
// high and low bfloat16 parts (three products: about float32's precision, which the softmax's exponent needs);
// over a bfloat16 cache, whose keys were rounded to bfloat16 when they were stored, q * scale is rounded once
// too (one product: vLLM's precision; the scores' error stays of the order the cache's rounding already gives
// them, and perplexity moved within its noise, docs/benchmarks.md). v and p are rounded to bfloat16
// (nearest-even, 2^-9 relative on the output); products accumulate in float32, the softmax is float32.
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

#if defined(TOKENMILL_AMX) || defined(TOKENMILL_AVX512_BF16)
// prefill_item's work items and online softmax with bfloat16 products, for both product engines: Products
// (AmxProducts: TDPBF16PS on tiles; DotProducts: VDPBF16PS on vectors) computes one row block's scores
// S^T = K Q^T for a tile of kAmxKeys keys (s[16 * j + m]: key j, row m) and adds P V into the block's rows
// of acc (rescaled by corr); everything else, the rounding included, is shared.
template <typename Products, typename q_t, typename cache_t>
void prefill_item_bf16(const PrefillItem& item, const q_t* q_base, int64_t q_row_stride, const cache_t* k_cache,
                       const cache_t* v_cache, const int32_t* blocks, int64_t query_start, int64_t ctx_len,
                       int64_t num_q, int64_t block_size, int64_t token_stride, int64_t group, int64_t head_dim,
                       float scale, int64_t window, q_t* out_base, int64_t out_row_stride, AmxPrefillScratch& w) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = item.count * group, row_blocks = (rows + 15) / 16;
  const int64_t pos0 = ctx_len - num_q + item.first;
  const int64_t h = item.kv_head, D = head_dim;
  // qt: per block of 16 rows, D/2 rows of 16 (q[m][2i], q[m][2i+1]) pairs: the B operand of S^T = K Q^T.
  // qt_low (unless the keys are bfloat16 already): what rounding q * scale to bfloat16 left, rounded again (the
  // scores' second term).
  constexpr bool exact_keys = std::is_same_v<cache_t, at::BFloat16>;
  w.qt.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  if (!exact_keys) w.qt_low.assign(row_blocks * 16 * D, at::BFloat16(0.0f));
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const q_t* src = q_base + (query_start + item.first + i) * q_row_stride + (h * group + g) * D;
    const int64_t first = (m / 16) * 16 * D + 2 * (m % 16);
    for (int64_t d = 0; d < D; ++d) {
      const float x = to_float(src[d]) * scale;
      const at::BFloat16 high(x);
      w.qt[first + (d / 2) * 32 + d % 2] = high;
      if (!exact_keys) w.qt_low[first + (d / 2) * 32 + d % 2] = at::BFloat16(x - static_cast<float>(high));
    }
  }
  w.acc.assign(row_blocks * 16 * D, 0.0f);
  w.row_max.assign(row_blocks * 16, neg_inf);
  w.row_sum.assign(row_blocks * 16, 0.0f);
  w.k.resize(kAmxKeys * D);
  w.k_low.resize(kAmxKeys * D);
  w.v.resize(kAmxKeys * D);
  w.vv.resize(kAmxKeys * D);
  w.pv.resize(16 * D);  // AMX: one row block's P V before it joins acc
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
  Products::begin();
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
      Products::scores(w.qt.data() + rb * 16 * D, exact_keys ? nullptr : w.qt_low.data() + rb * 16 * D, w.k.data(),
                       exact_keys ? nullptr : w.k_low.data(), D, s);
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
        // A masked score (-inf) comes out exactly 0.
        const __m512 p0 = exp512_to_bf16(_mm512_sub_ps(s0, base));
        const __m512 p1 = exp512_to_bf16(_mm512_sub_ps(s1, base));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        p_pairs[i] = _mm512_permutexvar_epi16(pairs, round_to_bf16_32(p0, p1));  // dword m: (p[m][2i], p[m][2i+1])
      }
      _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), c, sum));
      _mm512_storeu_ps(row_max, new_max);
      _mm512_store_ps(corr, c);
      transpose16x16_epi32(p_pairs);  // now p_pairs[m] is row m of P: 32 bfloat16 keys
      for (int m = 0; m < 16; ++m) _mm512_store_si512(pa + 16 * m, p_pairs[m]);
      Products::accumulate(pa, corr, w.vv.data(), D, std::min<int64_t>(16, rows - rb * 16),
                           w.acc.data() + rb * 16 * D, w.pv.data());
    }
  }
  Products::end();
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t i = m / group, g = m % group;
    const float inv = 1.0f / w.row_sum[m];
    q_t* dst = out_base + (query_start + item.first + i) * out_row_stride + (h * group + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<q_t>(w.acc[m * D + d] * inv);
  }
}
#endif

#if defined(TOKENMILL_AMX)
// TDPBF16PS: the scores as k q ~ k_high q_high + k_high q_low + k_low q_high (float32-like scores: the softmax
// would turn bfloat16's 2^-9 error on a score of 20 into a 4% change of its weight), or k q_high alone over a
// bfloat16 cache (qt_low and k_low null); P V through pv.
struct AmxProducts {
  static void begin() { load_amx_tile_config(); }
  static void end() { _tile_release(); }
  static void scores(const at::BFloat16* qt, const at::BFloat16* qt_low, const at::BFloat16* k,
                     const at::BFloat16* k_low, int64_t D, float* s) {
    const int64_t k_stride = D * static_cast<int64_t>(sizeof(at::BFloat16));
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(3, qt + c * 16 * 32, 64);
      _tile_loadd(2, k + 32 * c, k_stride);
      _tile_loadd(4, k + 16 * D + 32 * c, k_stride);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 4, 3);
      if (qt_low != nullptr) {
        _tile_loadd(5, qt_low + c * 16 * 32, 64);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (k_low != nullptr) {
        _tile_loadd(6, k_low + 32 * c, k_stride);
        _tile_loadd(7, k_low + 16 * D + 32 * c, k_stride);
        _tile_dpbf16ps(0, 6, 3);
        _tile_dpbf16ps(1, 7, 3);
      }
    }
    _tile_stored(0, s, 64);
    _tile_stored(1, s + 256, 64);
  }
  static void accumulate(const uint32_t* pa, const float* corr, const at::BFloat16* vv, int64_t D, int64_t valid,
                         float* acc, float* pv) {
    _tile_loadd(6, pa, 64);
    for (int64_t dc = 0; dc < D / 16; ++dc) {
      _tile_zero(5);
      _tile_loadd(7, vv + 32 * dc, 4 * D);
      _tile_dpbf16ps(5, 6, 7);
      _tile_stored(5, pv + 16 * dc, D * static_cast<int64_t>(sizeof(float)));
    }
    for (int64_t m = 0; m < valid; ++m) {
      float* row = acc + m * D;
      const float* pv_row = pv + m * D;
      const __m512 cm = _mm512_set1_ps(corr[m]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(row + d, _mm512_fmadd_ps(_mm512_loadu_ps(row + d), cm, _mm512_loadu_ps(pv_row + d)));
    }
  }
};

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
        prefill_item_bf16<AmxProducts, q_t, cache_t>(item, query.data_ptr<q_t>(), query.stride(0), step.k_base, step.v_base,
                                       step.table(c), step.query_start(c), step.lens[c], step.num_queries(c),
                                       step.block_size, step.token_stride, step.group, step.head_dim,
                                       static_cast<float>(scale), window, out.data_ptr<q_t>(), out.stride(0), scratch);
      });
}

#endif

#if defined(TOKENMILL_AVX512_BF16)
// ---- prefill attention on AVX-512 BF16 dot products (CPUs with bfloat16 instructions and no AMX) ------------
// prefill_item_bf16's products with VDPBF16PS on vectors instead of TDPBF16PS on tiles (DotProducts below):
// per 16 query rows and 16 keys, lane m of key j's accumulator sums (q[m][2i], q[m][2i+1]) . (k[j][2i],
// k[j][2i+1]) over the pairs i (q from the same pair-interleaved copy; k's pair broadcast), so the scores come
// out as S^T again and the same column-wise softmax follows; then each row's P pairs, broadcast, times the
// pair-interleaved V rows. Same values as the AMX kernel up to the order of float32 additions.

// s[16 * j + m] = sum over pairs of q[m] . k[j] for the 16 keys at k (rows D apart): qt and qt_low are the row
// block's pair-interleaved copies of q's high and low parts ([D / 2][16 pairs]), k_low what k's rounding left;
// kLowParts: both low parts are there (float32 / float16 cache), else neither (bfloat16 cache).
template <bool kLowParts>
inline void score_keys_dpbf16(const at::BFloat16* qt, const at::BFloat16* qt_low, const at::BFloat16* k,
                              const at::BFloat16* k_low, int64_t D, float* s) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    const __m512i q = _mm512_loadu_si512(qt + 32 * i);
    if constexpr (kLowParts) {
      const __m512i ql = _mm512_loadu_si512(qt_low + 32 * i);
      for (int j = 0; j < 16; ++j) {
        const __m512i kj = broadcast_pair(k + j * D + 2 * i);
        acc[j] = dot_bf16(dot_bf16(dot_bf16(acc[j], q, kj), ql, kj), q, broadcast_pair(k_low + j * D + 2 * i));
      }
    } else {
      for (int j = 0; j < 16; ++j) acc[j] = dot_bf16(acc[j], q, broadcast_pair(k + j * D + 2 * i));
    }
  }
  for (int j = 0; j < 16; ++j) _mm512_store_ps(s + 16 * j, acc[j]);
}

// acc[r][d] = acc[r][d] * corr[r] + sum_j p[r][j] v[j][d] for R rows, over 32 dimensions from d0: pa holds each
// row's 16 (p[2i], p[2i+1]) pairs as dwords, vv the pair-interleaved V rows (2D values each). Each load of V
// serves R rows; the 2R accumulators stay in registers.
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
    __m512i v0 = _mm512_loadu_si512(vv + i * 2 * D + 2 * d0);
    __m512i v1 = _mm512_loadu_si512(vv + i * 2 * D + 2 * d0 + 32);
    // Held in registers: left alone, GCC loads them again before each row's product (twice the loads, and the
    // whole kernel 1.15x slower).
    asm("" : "+v"(v0), "+v"(v1));
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

// VDPBF16PS: score_keys_dpbf16 per half of the key tile, accumulate_rows_dpbf16 per 32 dimensions and 8 rows.
struct DotProducts {
  static void begin() {}
  static void end() {}
  static void scores(const at::BFloat16* qt, const at::BFloat16* qt_low, const at::BFloat16* k,
                     const at::BFloat16* k_low, int64_t D, float* s) {
    for (int64_t half = 0; half < kAmxKeys / 16; ++half) {
      if (qt_low != nullptr)
        score_keys_dpbf16<true>(qt, qt_low, k + half * 16 * D, k_low + half * 16 * D, D, s + half * 256);
      else
        score_keys_dpbf16<false>(qt, nullptr, k + half * 16 * D, nullptr, D, s + half * 256);
    }
  }
  static void accumulate(const uint32_t* pa, const float* corr, const at::BFloat16* vv, int64_t D, int64_t valid,
                         float* acc, float* /*pv*/) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      int64_t m = 0;
      for (; m + 8 <= valid; m += 8) accumulate_rows_dpbf16<8>(pa + 16 * m, corr + m, vv, D, d0, acc + m * D);
      for (; m + 4 <= valid; m += 4) accumulate_rows_dpbf16<4>(pa + 16 * m, corr + m, vv, D, d0, acc + m * D);
      for (; m < valid; ++m) accumulate_rows_dpbf16<1>(pa + 16 * m, corr + m, vv, D, d0, acc + m * D);
    }
  }
};

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
        prefill_item_bf16<DotProducts, q_t, cache_t>(item, query.data_ptr<q_t>(), query.stride(0), step.k_base, step.v_base,
                                          step.table(c), step.query_start(c), step.lens[c], step.num_queries(c),
                                          step.block_size, step.token_stride, step.group, step.head_dim,
                                          static_cast<float>(scale), window, out.data_ptr<q_t>(), out.stride(0),
                                          scratch);
      });
}
#endif  // TOKENMILL_AVX512_BF16
}  // namespace

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
    if constexpr (std::is_same_v<cache_t, double> || kInt8Cache<cache_t>) {
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
