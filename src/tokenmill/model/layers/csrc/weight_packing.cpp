// Load-time weight work: a GGUF's blocks decoded and put in the layouts the block kernels read, a pass over
// memory each instead of numpy's and torch's several (seconds per GB of weights). Every function computes
// the values its Python reference in tokenmill/model/gguf_loader.py or layers/linear.py computes, bit for bit
// (tests/model/test_weight_packing.py).
#include "common.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel (linear.QUANT_PANEL)
constexpr int64_t kBlock = 32;  // inputs per block (linear.QUANT_BLOCK)
constexpr int64_t kSuper = 256;  // values per k-quant super-block

float half_at(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace

// linear._pack_panel_integers: int8 [N, K] as the kernels' panels of 16 features (the last zero-padded,
// its nibbles holding `offset`). rows layout: 8-bit int8 [P][B][32][16], 4-bit uint8 [P][B][32][8] (byte j:
// feature j low, j + 8 high). dot layout: 8-bit int8 [P][B][8][64] (byte 4f + j of group g: input 4g + j of
// feature f), 4-bit uint8 [P][B][4][64] (group u: inputs 8u..8u+3 low, 8u+4..8u+7 high).
// The rows are those of `parts` stacked (fused q/k/v, gate/up), read where they lie.
torch::Tensor pack_block_integers(std::vector<torch::Tensor> parts, int64_t bits, bool dot, int64_t offset) {
  TORCH_CHECK(!parts.empty(), "at least one part");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  const int64_t k = parts[0].size(-1);
  std::vector<const int8_t*> rows;  // every row's integers, in stacked order
  for (const torch::Tensor& q : parts) {
    TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.size(1) == k,
                "parts: contiguous int8 [rows, K], the same K");
    for (int64_t r = 0; r < q.size(0); ++r) rows.push_back(q.data_ptr<int8_t>() + r * k);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(k % kBlock == 0, "K must be whole blocks of 32");
  const int64_t panels = (n + kPanel - 1) / kPanel, blocks = k / kBlock;
  const int64_t block_bytes = bits == 8 ? kPanel * kBlock : kPanel * kBlock / 2;
  torch::Tensor out = dot ? torch::empty({panels, blocks, bits == 8 ? 8 : 4, 64},
                                         bits == 8 ? torch::kChar : torch::kByte)
                          : torch::empty({panels, blocks, kBlock, bits == 8 ? 16 : 8},
                                         bits == 8 ? torch::kChar : torch::kByte);
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int8_t tile[kPanel][kBlock];  // one block of one panel: [feature][input]
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t f = 0; f < kPanel; ++f) {
          const int64_t row = p * kPanel + f;
          if (row < n) {
            std::memcpy(tile[f], rows[row] + b * kBlock, kBlock);
          } else {
            std::memset(tile[f], 0, kBlock);
          }
        }
        uint8_t* o = dst + (p * blocks + b) * block_bytes;
        auto nib = [&](int64_t f, int64_t i) { return static_cast<int>(tile[f][i]) + static_cast<int>(offset); };
        if (!dot && bits == 8) {
          for (int64_t i = 0; i < kBlock; ++i)
            for (int64_t f = 0; f < kPanel; ++f) o[i * kPanel + f] = static_cast<uint8_t>(tile[f][i]);
        } else if (!dot) {
          for (int64_t i = 0; i < kBlock; ++i)
            for (int64_t j = 0; j < 8; ++j) o[i * 8 + j] = static_cast<uint8_t>(nib(j, i) | (nib(j + 8, i) << 4));
        } else if (bits == 8) {
          for (int64_t g = 0; g < 8; ++g)
            for (int64_t f = 0; f < kPanel; ++f)
              for (int64_t j = 0; j < 4; ++j) o[g * 64 + 4 * f + j] = static_cast<uint8_t>(tile[f][4 * g + j]);
        } else {
          for (int64_t u = 0; u < 4; ++u)
            for (int64_t f = 0; f < kPanel; ++f)
              for (int64_t j = 0; j < 4; ++j)
                o[u * 64 + 4 * f + j] = static_cast<uint8_t>(nib(f, 8 * u + j) | (nib(f, 8 * u + 4 + j) << 4));
        }
      }
    }
  });
  return out;
}

// gguf_loader._unpack_q4_k over a matrix's super-blocks (raw uint8 [S, 144]): the integers 0..15 as int8
// [S, 256] (each 32 bytes of nibbles hold two sub-blocks, low nibbles first), and per sub-block of 32 the
// scale d * sc and the min -(dmin * m), float32 [S, 8].
std::vector<torch::Tensor> unpack_q4_k(torch::Tensor raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.size(1) == 144 && raw.scalar_type() == torch::kByte && raw.is_contiguous(),
              "raw: contiguous uint8 [super-blocks, 144]");
  const int64_t supers = raw.size(0);
  torch::Tensor q = torch::empty({supers, kSuper}, torch::kChar);
  torch::Tensor scales = torch::empty({supers, 8}, torch::kFloat), mins = torch::empty({supers, 8}, torch::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* q_out = q.data_ptr<int8_t>();
  float *s_out = scales.data_ptr<float>(), *m_out = mins.data_ptr<float>();
  at::parallel_for(0, supers, 256, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const uint8_t* block = src + s * 144;
      const float d = half_at(block), dmin = half_at(block + 2);
      const uint8_t *low = block + 4, *high = block + 8, *mixed = block + 12;
      for (int j = 0; j < 4; ++j) {
        s_out[s * 8 + j] = d * static_cast<float>(low[j] & 0x3F);
        s_out[s * 8 + 4 + j] = d * static_cast<float>((mixed[j] & 0x0F) | ((low[j] >> 2) & 0x30));
        m_out[s * 8 + j] = -(dmin * static_cast<float>(high[j] & 0x3F));
        m_out[s * 8 + 4 + j] = -(dmin * static_cast<float>((mixed[j] >> 4) | ((high[j] >> 2) & 0x30)));
      }
      const uint8_t* qs = block + 16;
      int8_t* o = q_out + s * kSuper;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
          o[c * 64 + i] = static_cast<int8_t>(qs[c * 32 + i] & 0x0F);
          o[c * 64 + 32 + i] = static_cast<int8_t>(qs[c * 32 + i] >> 4);
        }
    }
  });
  return {q, scales, mins};
}

// A matrix's Q6_K super-blocks (raw uint8 [S, 210]) rounded to Q8_0: each value d * sc * (q - 32) in
// float32 as gguf_loader._dequantize_q6_k computes it, then per 32 values linear.quantize_q8_0's
// d8 = max|w| / 127, round-half-even(w / d8), and d8 rounded to float16. Returns int8 [S, 256] and
// float32 [S, 8] (the float16 scales' values).
std::vector<torch::Tensor> q6_k_to_q8_0(torch::Tensor raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.size(1) == 210 && raw.scalar_type() == torch::kByte && raw.is_contiguous(),
              "raw: contiguous uint8 [super-blocks, 210]");
  const int64_t supers = raw.size(0);
  torch::Tensor q = torch::empty({supers, kSuper}, torch::kChar);
  torch::Tensor scales = torch::empty({supers, 8}, torch::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* q_out = q.data_ptr<int8_t>();
  float* s_out = scales.data_ptr<float>();
  at::parallel_for(0, supers, 256, [&](int64_t begin, int64_t end) {
    float w[kSuper];
    for (int64_t s = begin; s < end; ++s) {
      const uint8_t* block = src + s * 210;
      const uint8_t *ql = block, *qh = block + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
      const float d = half_at(block + 208);
      for (int i = 0; i < kSuper; ++i) {
        const int half = i / 128, group = (i % 128) / 32, l = i % 32;
        const uint8_t low_byte = ql[half * 64 + (group & 1) * 32 + l];
        const int low = group < 2 ? (low_byte & 0x0F) : (low_byte >> 4);
        const int high = (qh[half * 32 + l] >> (2 * group)) & 3;
        const float value = static_cast<float>(static_cast<int8_t>(low | (high << 4)) - 32);
        w[i] = (static_cast<float>(sc[i / 16]) * d) * value;
      }
      for (int b = 0; b < kSuper / kBlock; ++b) {
        const float* x = w + b * kBlock;
        float amax = 0.0f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float d8 = amax / 127.0f;
        const float safe = d8 == 0.0f ? 1.0f : d8;
        int8_t* o = q_out + s * kSuper + b * kBlock;
        for (int i = 0; i < kBlock; ++i) o[i] = static_cast<int8_t>(std::nearbyint(x[i] / safe));
        s_out[s * 8 + b] = static_cast<float>(c10::Half(d8));
      }
    }
  });
  return {q, scales};
}
