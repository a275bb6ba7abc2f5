#include "common.h"

// ---- Block-quantized weight-only linear -------------------------------------------------------
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with w[n, k] = q[n, k] * scale[n, k / 32] (+ min[n, k / 32])
// for small integers q kept at the width a GGUF stores them: 8 bits for Q8_0, Q5_0/Q5_1 and the
// sub-blocks of Q5_K; 4 bits, two per byte, for Q4_0 (no min), Q4_1 and the sub-blocks of Q4_K (with a
// min). A decode step with few rows is bound by reading the weights: 4-bit blocks read an eighth of
// fp32's bytes (plus 4 or 8 bytes of scales per 32 weights). With more rows the widened weights are
// reused across rows and the row kernel runs near the FMA peak at 8-64 rows (docs/performance.md).
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

// Rows per tile: 8 block accumulators, 2 widened weight vectors and the broadcast x stay in registers;
// the 8 running sums are touched once per 32 inputs, so the compiler may keep them on the stack.
constexpr int64_t kQ8TileRows = 4;
constexpr int64_t kQ8PrefetchBytes = 1024;
// Rows of x per work item for larger steps: the panel stays in L1/L2 while a chunk of x streams past.
constexpr int64_t kQ8RowChunk = 64;
// Up to this many rows the row kernel runs; above it, dequantized tiles through sgemm.
constexpr int64_t kRowKernelMaxRows = 64;
// Float32 elements of one dequantized tile (4 MiB, reused by every call of the calling thread): most
// projections of a small model are one tile, so BLAS multiplies them at its dense speed; the tile is
// written once per call, ~1/rows of the GEMM's work. (Per-thread L2-sized tiles with single-threaded
// sgemm measured the same within noise.)
constexpr int64_t kTileElements = 1024 * 1024;



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
    parallel_split_steal(chunks * pairs, [&](int64_t begin, int64_t end) {
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
  parallel_split_steal(chunks * panels, [&](int64_t begin, int64_t end) {
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
// float32 tile and a bfloat16 copy of it first (several times faster; docs/benchmarks.md).

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
