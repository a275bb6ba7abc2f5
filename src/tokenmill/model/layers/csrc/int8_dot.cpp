#include "common.h"

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
// one after another, so this runs on into its next panel. With it a large 4-bit step runs near the VNNI
// peak, well above what the hardware prefetcher alone keeps up (docs/benchmarks.md).
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
  // The calling thread's, kept between calls: a fresh one would be allocated and zero-filled on this thread
  // alone (the step's other threads waiting) before every projection. The work items below reach it through
  // the reference (by name, a thread_local would be each worker thread's own).
  thread_local QuantizedRows calling_thread_rows;
  QuantizedRows& xq = calling_thread_rows;
  quantize_rows(x, rows, in_features, mins != nullptr, xq);
  const int a_zero = Bits == 8 ? kQ8DotZero : zero;
  // Work item = (row chunk, panel), panels innermost so a thread's consecutive items share x.
  parallel_split_steal(chunks * panels, [&](int64_t begin, int64_t end) {
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
