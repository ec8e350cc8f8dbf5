// Wide dot products for the K-quants Q4_K and Q6_K (activations in Q8_K). See wide.h for where
// they are called from.
//
// Both types take one 256-weight superblock per step, as four 64-byte vectors of unsigned
// quants. `vpdpbusd` sums four u8 x s8 products of a vector with its 64 activation quants into
// each int32 lane (|sum| < 2^15), two such vectors are packed into int16 words, and `vpdpwssd`
// multiplies the words with their sub-block's scale and accumulates int32. So the sub-block
// scales are applied in the integer domain, and a superblock costs one int32 -> float
// conversion and one FMA with d * dx.
//
// Q4_K (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles):
// each 64-byte half of the nibbles holds sub-blocks 4v, 4v+2 in its low nibbles and 4v+1,
// 4v+3 in its high ones, so the activation layout stores the quants in that order. The scales
// and mins are unpacked with a few in-lane dword operations on the block's first 16 bytes;
// the minimum term dmin * sum(m * x) comes from per-sub-block activation sums.
// Q6_K (210 bytes: ql[128] low nibbles, qh[64] high bit pairs, int8 scales[16], f16 d): each
// half of ql (64 bytes) with its 32 bytes of qh gives 128 consecutive weights, so the
// activations keep ggml's order. `vpmultishiftqb` moves each weight's two high bits from qh
// into place. The constant -32 is folded in as -32 * sum(scale * x) from the activation sums.
//
// Activation layout: one 320-byte record per superblock (one stream of loads runs faster than
// separate arrays), 64-byte aligned: qs[256] int8, at 256 the sums of the sub-blocks as int16
// (Q4_K: 8, per 32 weights; Q6_K: 16, per 16, negated; recomputed from the quants, not taken
// from Q8_K's bsums), at 288 the float dx.
//
// One loop serves both types and M = 1..kMaxMulti activation rows (`DotRows`): a superblock of
// W is loaded and unpacked once (`Unpack`: quants, scale vectors, d), then multiplied with each
// row's record (`Add`, one accumulator per row, held in registers). M = 1 is `dot_rows`, the
// decode product; every row takes the same steps in the same order for any M, so
// `dot_rows_multi` gives the same floats as `dot_rows`.
// The weight loads stay inside each superblock, so a row ending at the buffer end is safe.

#include <immintrin.h>

#include <cstring>

#include "ggml.h"
#include "wide.h"

namespace jaxdist_wide {
namespace {

constexpr int64_t kQK = 256;        // weights per superblock
constexpr size_t kQ8KBytes = 292;   // ggml's block_q8_K: float d, int8 qs[256], int16 bsums[16]
constexpr size_t kQ4KBytes = 144;   // block_q4_K
constexpr size_t kQ6KBytes = 210;   // block_q6_K
constexpr int kQ4KSums = 8;         // activation sums per superblock: Q4_K's sub-blocks of 32
constexpr int kQ6KSums = 16;        // Q6_K's sub-blocks of 16
constexpr size_t kRecord = 320;     // activation bytes per superblock (layout above)
constexpr size_t kSumsAt = 256;     // where a record's int16 sums start
constexpr size_t kDxAt = 288;       // where its float dx is

int64_t Blocks(int64_t k) { return k / kQK; }

size_t RowBytes(int64_t k) { return static_cast<size_t>(Blocks(k)) * kRecord; }

// Copies a Q8_K row into the layout above: run i (32 quants) of a record is run order[i] of
// the superblock, then the sums of its `kSums` equal sub-blocks times `sign`, and its scale.
template <int kSums>
void Relayout(const uint8_t* q, uint8_t* out, int64_t k, const int (&order)[8], int sign) {
  constexpr int kLen = kQK / kSums;
  for (int64_t b = 0; b < Blocks(k); ++b) {
    const uint8_t* blk = q + b * kQ8KBytes;
    const int8_t* x = reinterpret_cast<const int8_t*>(blk + 4);
    uint8_t* rec = out + b * kRecord;
    for (int run = 0; run < 8; ++run) std::memcpy(rec + 32 * run, x + 32 * order[run], 32);
    int16_t sums[kSums];
    for (int s = 0; s < kSums; ++s) {
      int sum = 0;
      for (int i = 0; i < kLen; ++i) sum += x[s * kLen + i];
      sums[s] = static_cast<int16_t>(sign * sum);
    }
    std::memcpy(rec + kSumsAt, sums, sizeof(sums));
    std::memcpy(rec + kDxAt, blk, sizeof(float));
  }
}

void RelayoutQ4K(const uint8_t* q, uint8_t* out, int64_t k) {
  static constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  Relayout<kQ4KSums>(q, out, k, kOrder, 1);
}

void RelayoutQ6K(const uint8_t* q, uint8_t* out, int64_t k) {
  static constexpr int kOrder[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  Relayout<kQ6KSums>(q, out, k, kOrder, -1);
}

// Constant byte vectors, built once per call from byte(j) for j in 0..63.
template <typename F>
WIDE_TARGET __m512i Bytes(F byte) {
  alignas(64) uint8_t b[64];
  for (int j = 0; j < 64; ++j) b[j] = static_cast<uint8_t>(byte(j));
  return _mm512_load_si512(b);
}

// 64 bytes as two 32-byte loads: a block's vectors mostly straddle cache lines, and streaming
// from DRAM runs faster with the narrower loads.
WIDE_TARGET inline __m512i Load64(const uint8_t* p) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
}

// The sums of four u8 x s8 products of `w` and `x` (|sum| < 2^15) for two vectors, as int16:
// per 128-bit lane, four words from `w0` then four from `w1`.
WIDE_TARGET inline __m512i Dot2(__m512i w0, const int8_t* x0, __m512i w1, const int8_t* x1) {
  const __m512i zero = _mm512_setzero_si512();
  return _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, w0, _mm512_load_si512(x0)),
                            _mm512_dpbusd_epi32(zero, w1, _mm512_load_si512(x1)));
}

// The float16 scale(s) at `h` (`n` of them: d, or d and dmin) as floats in the low lanes.
WIDE_TARGET inline __m128 HalfScales(const uint8_t* h, int n) {
  uint32_t bits = 0;
  std::memcpy(&bits, h, 2 * n);
  return _mm_maskz_cvtph_ps(0x3, _mm_cvtsi32_si128(static_cast<int>(bits)));
}

// Those times the dx of activation record `rec`.
WIDE_TARGET inline __m128 TimesDx(__m128 d, const uint8_t* rec) {
  float dx;
  std::memcpy(&dx, rec + kDxAt, sizeof(float));
  return _mm_mul_ps(d, _mm_set1_ps(dx));
}

// Q4_K for DotRows: constants, one unpacked superblock, one activation row's accumulator.
struct Q4K {
  static constexpr size_t kBytes = kQ4KBytes;
  struct Block {
    __m512i q[4];   // low and high nibbles of qs[0..63], then of qs[64..127]
    __m512i sc[2];  // int16 scales for Dot2 of q[2v], q[2v + 1]
    __m128i mins;   // int16 mins of the 8 sub-blocks
    __m128 dm;      // d, dmin
  };
  struct Acc {
    __m512 sum;   // d * dx * scale * q . x, per lane
    __m128 mins;  // dmin * dx * min * (sub-block sums of x), per lane
  };
  __m512i nib, sc_at[2];
  __m128i shift_m47, low_bits, top_bits, m_at;

  WIDE_TARGET Q4K() {
    nib = _mm512_set1_epi8(0x0F);
    // Scale unpacking on the block's first 16 bytes as dwords [d dmin, s0-3, s4-7, s8-11]:
    // sc0-3 = s0-3 & 63, m0-3 = s4-7 & 63, sc4-7 = s8-11 & 15 | (s0-3 >> 6) << 4 and
    // m4-7 = s8-11 >> 4 | (s4-7 >> 6) << 4, giving bytes [sc4-7, sc0-3, m0-3, m4-7].
    shift_m47 = _mm_set_epi32(4, 0, 0, 0);
    low_bits = _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x3F3F3F3F, 0x0F0F0F0F);
    top_bits = _mm_set_epi32(0x30303030, 0, 0, 0x30303030);
    // int16 scales for Dot2 of the low and high nibbles of qs[64v..64v+63]: 128-bit lanes 0-1
    // hold sub-block 4v (words 0..3) and 4v + 1 (4..7), lanes 2-3 sub-blocks 4v + 2 and 4v + 3.
    for (int v = 0; v < 2; ++v) {
      sc_at[v] = Bytes([v](int j) {
        const int sub = 4 * v + (j % 16 < 8 ? 0 : 1) + (j < 32 ? 0 : 2);
        return j % 2 ? 0x80 : (sub + 4) % 8;
      });
    }
    m_at = _mm_set_epi8(-1, 15, -1, 14, -1, 13, -1, 12, -1, 11, -1, 10, -1, 9, -1, 8);
  }

  WIDE_TARGET Block Unpack(const uint8_t* blk) const {
    Block u;
    const __m128i head = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(head, 0xE7), shift_m47);
    const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(head, 0x81), 2);
    const __m128i sm = _mm_ternarylogic_epi32(_mm_and_si128(low, low_bits), top, top_bits,
                                              0xF8);  // low | top & top_bits
    const __m512i sm4 = _mm512_broadcast_i32x4(sm);
    for (int v = 0; v < 2; ++v) {
      const __m512i q = Load64(blk + 16 + 64 * v);
      u.q[2 * v] = _mm512_and_si512(q, nib);
      u.q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nib);
      u.sc[v] = _mm512_shuffle_epi8(sm4, sc_at[v]);
    }
    u.mins = _mm_shuffle_epi8(sm, m_at);
    u.dm = HalfScales(blk, 2);
    return u;
  }

  static WIDE_TARGET Acc Zero() { return {_mm512_setzero_ps(), _mm_setzero_ps()}; }

  static WIDE_TARGET void Add(const Block& u, const uint8_t* rec, Acc* acc) {
    const int8_t* xq = reinterpret_cast<const int8_t*>(rec);
    __m512i isum = _mm512_setzero_si512();
    for (int v = 0; v < 2; ++v) {
      isum = _mm512_dpwssd_epi32(
          isum, Dot2(u.q[2 * v], xq + 128 * v, u.q[2 * v + 1], xq + 128 * v + 64), u.sc[v]);
    }
    const __m128i msum =
        _mm_madd_epi16(u.mins, _mm_load_si128(reinterpret_cast<const __m128i*>(rec + kSumsAt)));
    const __m128 d = TimesDx(u.dm, rec);
    acc->sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_broadcastss_ps(d), acc->sum);
    acc->mins = _mm_add_ps(acc->mins, _mm_mul_ps(_mm_cvtepi32_ps(msum), _mm_permute_ps(d, 0x55)));
  }

  static WIDE_TARGET float Sum(const Acc& acc) {
    return _mm512_reduce_add_ps(_mm512_sub_ps(acc.sum, _mm512_zextps128_ps512(acc.mins)));
  }
};

// Q6_K for DotRows, the same way.
struct Q6K {
  static constexpr size_t kBytes = kQ6KBytes;
  struct Block {
    __m512i q[4];   // 6-bit quants of weights 0..63, 64..127, 128..191, 192..255
    __m512i sc[2];  // int16 scales for Dot2 of q[2h], q[2h + 1]
    __m256i sc32;   // the 16 scales times 32, int16
    __m128 d;       // d in lane 0
  };
  using Acc = __m512;  // d * dx * scale * (q - 32) . x, per lane
  __m512i nib, bits45, lo_shift, hi_shift, sc_at[2];

  WIDE_TARGET Q6K() {
    nib = _mm512_set1_epi8(0x0F);
    bits45 = _mm512_set1_epi8(0x30);
    // Weight j of a 128-weight half: ql byte j % 64 (low nibble for j < 64, else high) and bit
    // pair j / 32 of qh byte j % 32; qh is loaded into both 32-byte halves of a vector. The
    // multishift picks, for each byte, the 8 bits from the pair's position minus 4.
    lo_shift = Bytes([](int j) { return (8 * (j % 8) + (j < 32 ? 0 : 2) - 4) & 63; });
    hi_shift = Bytes([](int j) { return 8 * (j % 8) + (j < 32 ? 4 : 6) - 4; });
    // int16 scales for Dot2 of half h: 128-bit lane l holds sub-blocks 8h + l (words 0..3) and
    // 8h + 4 + l (words 4..7); the bytes are picked from the sign-extended scales.
    for (int h = 0; h < 2; ++h) {
      sc_at[h] = Bytes([h](int j) { return 2 * (8 * h + j / 16 + (j % 16 < 8 ? 0 : 4)) + j % 2; });
    }
  }

  WIDE_TARGET Block Unpack(const uint8_t* blk) const {
    Block u;
    const __m256i sc =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    u.sc32 = _mm256_slli_epi16(sc, 5);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = Load64(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      u.q[2 * h] = _mm512_ternarylogic_epi32(  // ql & nib | bits
          ql, _mm512_and_si512(_mm512_multishift_epi64_epi8(lo_shift, qh), bits45), nib, 0xEC);
      u.q[2 * h + 1] = _mm512_ternarylogic_epi32(
          _mm512_srli_epi16(ql, 4),
          _mm512_and_si512(_mm512_multishift_epi64_epi8(hi_shift, qh), bits45), nib, 0xEC);
      u.sc[h] = _mm512_permutexvar_epi8(sc_at[h], _mm512_castsi256_si512(sc));
    }
    u.d = HalfScales(blk + 208, 1);
    return u;
  }

  static WIDE_TARGET Acc Zero() { return _mm512_setzero_ps(); }

  static WIDE_TARGET void Add(const Block& u, const uint8_t* rec, Acc* acc) {
    const int8_t* xq = reinterpret_cast<const int8_t*>(rec);
    // -32 * sum(scale * x), as 32 * scale times the negated sums
    __m512i isum = _mm512_zextsi256_si512(_mm256_madd_epi16(
        u.sc32, _mm256_load_si256(reinterpret_cast<const __m256i*>(rec + kSumsAt))));
    for (int h = 0; h < 2; ++h) {
      isum = _mm512_dpwssd_epi32(
          isum, Dot2(u.q[2 * h], xq + 128 * h, u.q[2 * h + 1], xq + 128 * h + 64), u.sc[h]);
    }
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_broadcastss_ps(TimesDx(u.d, rec)),
                           *acc);
  }

  static WIDE_TARGET float Sum(const Acc& acc) { return _mm512_reduce_add_ps(acc); }
};

// y[i][r] = W[r] . x_i for r < nrows and M activation rows x_i = x + i * x_row (x_row a
// multiple of 64). With M > 1 a row's superblocks take M times as long, and the hardware
// prefetchers no longer keep W streaming from memory (measured: 15-30% of the time at M = 8);
// so each superblock prefetches the same superblock of the next row, a row's time ahead.
template <class T, int M>
WIDE_TARGET void DotRows(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows,
                         const uint8_t* x, size_t x_row, float* const* y) {
  const T t;
  const int64_t nb = Blocks(k);
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* row = w + r * w_row;
    typename T::Acc acc[M];
    for (int i = 0; i < M; ++i) acc[i] = T::Zero();
    for (int64_t b = 0; b < nb; ++b) {
      if (M > 1 && r + 1 < nrows) {
        const char* next = reinterpret_cast<const char*>(row + w_row + b * T::kBytes);
        for (size_t o = 0; o < T::kBytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
      }
      const typename T::Block u = t.Unpack(row + b * T::kBytes);
      for (int i = 0; i < M; ++i) T::Add(u, x + i * x_row + b * kRecord, &acc[i]);
    }
    for (int i = 0; i < M; ++i) y[i][r] = T::Sum(acc[i]);
  }
}

// Each type's loop for wide.h's Entry (dot_rows and dot_rows_multi).
template <int M>
struct Q4KLoop {
  static constexpr LoopFn Run = DotRows<Q4K, M>;
};
template <int M>
struct Q6KLoop {
  static constexpr LoopFn Run = DotRows<Q6K, M>;
};

const WideKernel kQ4K = {RowBytes, RelayoutQ4K, Entry<Q4KLoop>::One, Entry<Q4KLoop>::Multi};
const WideKernel kQ6K = {RowBytes, RelayoutQ6K, Entry<Q6KLoop>::One, Entry<Q6KLoop>::Multi};

}  // namespace

// ggml's quantize_row_q8_K_ref, vectorized, to the same bytes: per superblock the element of
// largest magnitude (the first one, on ties) sets iscale = -127 / max; each quant is
// iscale * x rounded to nearest even (ggml's nearest_int: the default MXCSR rounding of
// vcvtps2dq), at most 127; bsums are the sums of 16 quants; d = 1 / iscale. A superblock of
// zeros gets d = 0 and zero quants (and, unlike ggml, which leaves them, zero bsums). The
// reference is scalar in the libggml wheel, and a prefill of 128 tokens spent 2.7% of its time
// there on a ~1B Q4_K_M model.
WIDE_TARGET void QuantizeRowQ8K(const float* x, uint8_t* out, int64_t k) {
  for (int64_t b = 0; b < Blocks(k); ++b, x += kQK, out += kQ8KBytes) {
    __m512 amax = _mm512_setzero_ps();
    for (int v = 0; v < 16; ++v) {  // a NaN is skipped, as by ggml's `fabsf(x) > amax`
      amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * v)), amax);
    }
    const float top = _mm512_reduce_max_ps(amax);
    int8_t* qs = reinterpret_cast<int8_t*>(out + 4);
    int16_t sums[16] = {};
    float d = 0.0f;
    if (top > 0.0f) {
      const __m512 topv = _mm512_set1_ps(top);
      float mx = 0.0f;
      for (int v = 0; v < 16; ++v) {
        const __m512 xv = _mm512_loadu_ps(x + 16 * v);
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(xv), topv, _CMP_EQ_OQ);
        if (hit != 0) {
          mx = x[16 * v + __builtin_ctz(hit)];
          break;
        }
      }
      const float iscale = -127.0f / mx;
      const __m512 is = _mm512_set1_ps(iscale);
      const __m512i most = _mm512_set1_epi32(127);
      for (int v = 0; v < 16; ++v) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(is, _mm512_loadu_ps(x + 16 * v)));
        q = _mm512_min_epi32(q, most);
        sums[v] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * v), _mm512_cvtsepi32_epi8(q));
      }
      d = 1.0f / iscale;
    } else {
      std::memset(qs, 0, kQK);
    }
    std::memcpy(out, &d, sizeof(float));
    std::memcpy(out + 4 + kQK, sums, sizeof(sums));
  }
}

const WideKernel* KquantKernel(int ggml_type) {
  switch (ggml_type) {
    case GGML_TYPE_Q4_K:
      return &kQ4K;
    case GGML_TYPE_Q6_K:
      return &kQ6K;
    default:
      return nullptr;
  }
}

}  // namespace jaxdist_wide
