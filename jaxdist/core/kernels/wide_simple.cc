// Wide dot products for the simple block types: Q4_0 and Q8_0 (activations in Q8_0) and Q4_1
// (activations in Q8_1). See wide.h for where they are called from.
//
// Each loop iteration takes one 64-byte vector of quants: four Q4_0 or Q4_1 blocks (128
// weights as nibbles) or two Q8_0 blocks (64 weights). The blocks' quants sit between their
// scales in the file, so one VBMI byte permutation (`vpermt2b`) gathers them from two loads,
// and another broadcasts each block's float16 scale to the four (or eight) int32 lanes its
// products land in. `vpdpbusd` multiplies unsigned weight quants with signed activation quants
// and sums groups of four; the constant part of each block's value (Q4_0's -8, Q8_0's sign
// flip to unsigned, Q4_1's minimum) is folded in from per-block activation sums that
// `relayout` precomputes, so the loop does no per-element work beyond the two masks.
//
// Activation layout, per group of four (Q4_x) or two (Q8_0) blocks, 64-byte aligned:
//   Q4_x: lo[64] (each block's elements 0..15), hi[64] (16..31), dx[16] float, aux[16]
//   Q8_0: qs[64], dx[16] float, aux[16]
// dx: the activation block's scale in every lane its products land in. aux: Q4_0 and Q8_0,
// int32 -8 (-128) * sum of the block's quants in the block's first lane, else 0, added to the
// integer dot; Q4_1, float s = d * sum (Q8_1's own field) in the first lane, times the weight
// block's minimum.
// A row's last group may be partial: masked loads read only its blocks, and the activation
// layout pads the missing blocks with zeros.

#include <immintrin.h>

#include <algorithm>

#include <cstring>

#include "ggml.h"
#include "wide.h"

namespace jaxdist_wide {
namespace {

constexpr int64_t kQK = 32;              // elements per block (all three types)
constexpr size_t kQ40Bytes = 18;         // ggml's block_q4_0: f16 d, 16 bytes of nibbles
constexpr size_t kQ41Bytes = 20;         // block_q4_1: f16 d, f16 m, 16 bytes of nibbles
constexpr size_t kQ80Bytes = 34;         // block_q8_0: f16 d, 32 int8
constexpr size_t kQ81Bytes = 36;         // block_q8_1: f16 d, f16 s (= d * sum), 32 int8
constexpr size_t kGroup4Bytes = 256;     // Q4_x activation group: lo, hi, dx, aux
constexpr size_t kGroup8Bytes = 192;     // Q8_0 activation group: qs, dx, aux

int64_t Blocks(int64_t k) { return k / kQK; }

uint16_t Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

float HalfToFloat(const uint8_t* p) { return ggml_fp16_to_fp32(Half(p)); }

int32_t Sum(const int8_t* q) {
  int32_t s = 0;
  for (int i = 0; i < kQK; ++i) s += q[i];
  return s;
}

// ---- activation layouts (scalar: one row per call, a few KB) -------------------------------

size_t Row4(int64_t k) { return static_cast<size_t>((Blocks(k) + 3) / 4) * kGroup4Bytes; }
size_t Row8(int64_t k) { return static_cast<size_t>((Blocks(k) + 1) / 2) * kGroup8Bytes; }

// Q8_0 or Q8_1 blocks (`in_bytes` each, quants at `qs_at`) into the Q4_x layout.
void Relayout4(const uint8_t* q, uint8_t* out, int64_t k, size_t in_bytes, size_t qs_at,
               bool with_min) {
  std::memset(out, 0, Row4(k));
  for (int64_t b = 0; b < Blocks(k); ++b) {
    const uint8_t* blk = q + b * in_bytes;
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + qs_at);
    uint8_t* g = out + (b / 4) * kGroup4Bytes;
    const int64_t j = b % 4;
    std::memcpy(g + j * 16, qs, 16);
    std::memcpy(g + 64 + j * 16, qs + 16, 16);
    float* dx = reinterpret_cast<float*>(g + 128);
    for (int l = 0; l < 4; ++l) dx[j * 4 + l] = HalfToFloat(blk);
    if (with_min) {
      reinterpret_cast<float*>(g + 192)[j * 4] = HalfToFloat(blk + 2);
    } else {
      reinterpret_cast<int32_t*>(g + 192)[j * 4] = -8 * Sum(qs);
    }
  }
}

void RelayoutQ40(const uint8_t* q, uint8_t* out, int64_t k) {
  Relayout4(q, out, k, kQ80Bytes, 2, false);
}

void RelayoutQ41(const uint8_t* q, uint8_t* out, int64_t k) {
  Relayout4(q, out, k, kQ81Bytes, 4, true);
}

void RelayoutQ80(const uint8_t* q, uint8_t* out, int64_t k) {
  std::memset(out, 0, Row8(k));
  for (int64_t b = 0; b < Blocks(k); ++b) {
    const uint8_t* blk = q + b * kQ80Bytes;
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    uint8_t* g = out + (b / 2) * kGroup8Bytes;
    const int64_t j = b % 2;
    std::memcpy(g + j * 32, qs, 32);
    float* dx = reinterpret_cast<float*>(g + 64);
    for (int l = 0; l < 8; ++l) dx[j * 8 + l] = HalfToFloat(blk);
    reinterpret_cast<int32_t*>(g + 128)[j * 8] = -128 * Sum(qs);
  }
}

// ---- the products ---------------------------------------------------------------------------

// Byte permutations over a group's bytes (two sources: bytes 0..63 and 64..127).
struct Perms {
  __m512i qs;     // the group's quants, block after block
  __m512i scale;  // 16 float16: block (lane / lanes_per_block)'s scale at byte `at`
  __m512i min;    // Q4_1: the same for the minimum
};

WIDE_TARGET Perms MakePerms(size_t block, size_t qs_at, int blocks_per_vec) {
  alignas(64) uint8_t qs[64], sc[64] = {}, mn[64] = {};
  const int per = 64 / blocks_per_vec;  // quant bytes of one block in the vector
  for (int j = 0; j < 64; ++j) qs[j] = static_cast<uint8_t>(block * (j / per) + qs_at + j % per);
  const int lanes = 16 / blocks_per_vec;
  for (int i = 0; i < 16; ++i) {
    const size_t b = static_cast<size_t>(i / lanes) * block;
    sc[2 * i] = static_cast<uint8_t>(b);
    sc[2 * i + 1] = static_cast<uint8_t>(b + 1);
    mn[2 * i] = static_cast<uint8_t>(b + 2);
    mn[2 * i + 1] = static_cast<uint8_t>(b + 3);
  }
  return {_mm512_load_si512(qs), _mm512_load_si512(sc), _mm512_load_si512(mn)};
}

WIDE_TARGET inline __m512 Halves(__m512i bytes, __m512i perm) {
  return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(perm, bytes)));
}

// Loads a group of `n` blocks of `block` bytes (n <= blocks per vector) as two sources.
WIDE_TARGET inline void LoadGroup(const uint8_t* p, size_t bytes, __m512i* a, __m512i* b) {
  if (bytes >= 64) {
    // two 32-byte loads: streaming from memory, they beat one 64-byte load that splits
    // across cache lines (measured 15-30% on Zen 4)
    *a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
    const __mmask64 rest = bytes - 64 >= 64 ? ~__mmask64{0} : (__mmask64{1} << (bytes - 64)) - 1;
    *b = _mm512_maskz_loadu_epi8(rest, p + 64);
  } else {
    *a = _mm512_maskz_loadu_epi8((__mmask64{1} << bytes) - 1, p);
    *b = _mm512_setzero_si512();
  }
}

// With M > 1 a row's groups take M times as long and the hardware prefetchers no longer keep W
// streaming from memory, so each group prefetches the same group of the next row (as
// wide_kquants.cc does; a prefetch never faults, so a partial last group may reach past it).
WIDE_TARGET inline void Prefetch(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
  }
}

// The loops take M activation rows at once: each weight group is loaded and unpacked once,
// then multiplied with every row's quants (one accumulator per row, in registers). M = 1 is
// the decode product (dot_rows); dot_rows_multi dispatches M = 1..kMaxMulti.
template <bool kMin, int M>
WIDE_TARGET void DotQ4(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows,
                       const uint8_t* x, size_t x_row, float* const* y) {
  const size_t block = kMin ? kQ41Bytes : kQ40Bytes;
  const Perms perm = MakePerms(block, kMin ? 4 : 2, 4);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t nb = Blocks(k);
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* row = w + r * w_row;
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 4) {
      if (M > 1 && r + 1 < nrows) Prefetch(row + w_row + b * block, 4 * block);
      __m512i raw, rest;
      LoadGroup(row + b * block, static_cast<size_t>(std::min<int64_t>(4, nb - b)) * block,
                &raw, &rest);
      const __m512i qs = _mm512_permutex2var_epi8(raw, perm.qs, rest);
      const __m512i lo = _mm512_and_si512(qs, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), nib);
      const __m512 dw = Halves(raw, perm.scale);
      const __m512 mw = kMin ? Halves(raw, perm.min) : _mm512_setzero_ps();
      for (int i = 0; i < M; ++i) {
        const uint8_t* g = x + i * x_row + (b / 4) * kGroup4Bytes;
        const __m512i a = kMin ? _mm512_setzero_si512() : _mm512_load_si512(g + 192);
        __m512i dot = _mm512_dpbusd_epi32(a, lo, _mm512_load_si512(g));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_load_si512(g + 64));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(dw, _mm512_load_ps(g + 128)), acc[i]);
        if (kMin) acc[i] = _mm512_fmadd_ps(mw, _mm512_load_ps(g + 192), acc[i]);
      }
    }
    for (int i = 0; i < M; ++i) y[i][r] = _mm512_reduce_add_ps(acc[i]);
  }
}

template <int M>
WIDE_TARGET void DotQ80(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows,
                        const uint8_t* x, size_t x_row, float* const* y) {
  const Perms perm = MakePerms(kQ80Bytes, 2, 2);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t nb = Blocks(k);
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* row = w + r * w_row;
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
      if (M > 1 && r + 1 < nrows) Prefetch(row + w_row + b * kQ80Bytes, 2 * kQ80Bytes);
      __m512i raw, rest;
      LoadGroup(row + b * kQ80Bytes,
                static_cast<size_t>(std::min<int64_t>(2, nb - b)) * kQ80Bytes, &raw, &rest);
      // w + 128 as unsigned bytes; aux holds -128 * sum(x) to take it back out
      const __m512i qs = _mm512_xor_si512(_mm512_permutex2var_epi8(raw, perm.qs, rest), flip);
      const __m512 dw = Halves(raw, perm.scale);
      for (int i = 0; i < M; ++i) {
        const uint8_t* g = x + i * x_row + (b / 2) * kGroup8Bytes;
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_load_si512(g + 128), qs, _mm512_load_si512(g));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(dw, _mm512_load_ps(g + 64)), acc[i]);
      }
    }
    for (int i = 0; i < M; ++i) y[i][r] = _mm512_reduce_add_ps(acc[i]);
  }
}

template <int M>
struct Q40Loop {
  static constexpr LoopFn Run = DotQ4<false, M>;
};
template <int M>
struct Q41Loop {
  static constexpr LoopFn Run = DotQ4<true, M>;
};
template <int M>
struct Q80Loop {
  static constexpr LoopFn Run = DotQ80<M>;
};

const WideKernel kQ40 = {Row4, RelayoutQ40, Entry<Q40Loop>::One, Entry<Q40Loop>::Multi};
const WideKernel kQ41 = {Row4, RelayoutQ41, Entry<Q41Loop>::One, Entry<Q41Loop>::Multi};
const WideKernel kQ80 = {Row8, RelayoutQ80, Entry<Q80Loop>::One, Entry<Q80Loop>::Multi};

}  // namespace

const WideKernel* SimpleKernel(int ggml_type) {
  switch (ggml_type) {
    case GGML_TYPE_Q4_0:
      return &kQ40;
    case GGML_TYPE_Q4_1:
      return &kQ41;
    case GGML_TYPE_Q8_0:
      return &kQ80;
    default:
      return nullptr;
  }
}

bool WideIsaSupported() {
#if defined(__x86_64__)
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vbmi");
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace jaxdist_wide
