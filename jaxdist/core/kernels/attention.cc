// jaxdist CPU kernels: attention of a few queries over a slot KV cache.
//
// `jaxdist_cache_attention_v2` (and v1, which is v2 with no window) computes what
// exporters/layers.py `cache_attention` computes after it has written the step's keys and
// values into the cache, but it reads only the cache positions a query can see. The portable
// form gathers each row's whole slot (`max_seq` positions) and masks it, so a decode step reads
// and copies the full cache of every layer however short the sequence is; this kernel reads
// `pos + length` positions (at most `window` with one), as llama.cpp reads only its used
// cells. ops.py calls it for steps of up to ATTENTION_MAX_QUERIES tokens per row; it computes
// steps of any length.
//
// Operands (all row-major):
//   q        f32 (B, S, H, D)       queries, RoPE applied
//   k, v     f32 (NS, KV, T, D)     the slot caches, this step's entries already written
//   slot     s32 (B,)               each row's cache slot (clamped into [0, NS), like a gather)
//   pos      s32 (B,)               position of each row's first query
//   length   s32 (B,)               each row's true token count
//   y        f32 (B, S, H, D)       result
// Query i of row b sits at position p = pos[b] + i and sees the keys j <= p with
// j < pos[b] + length[b] and j < T; head h reads key/value head h / (H / KV). A query that sees
// no key (a row of length 0) gets zeros; the portable form gives garbage there, and callers
// ignore such rows.
// Attribute `scale` (f32) multiplies the scores. v2 adds attribute `window` (s32): when it is
// above 0, query p also needs j > p - window (sliding-window attention: the last `window`
// positions, itself included), and only those keys are read. v1 (no window attribute) stays
// registered for artifacts exported with it; a new attribute is a new target, never a change.
//
// Work. A call is cut into units: (row b, query i, key/value head), each the H / KV query
// heads that share that key/value head against the keys query i sees. A unit is computed whole
// by one thread (scores, softmax, weighted values; its scratch is that thread's), so its result
// depends on nothing but its own inputs: the bits of a query are the same whatever the thread
// count, the number of queries in the step (a query at position p alone or inside a prefill
// chunk) and the other rows of the batch. Callers rely on that: a token's activations must not
// depend on how the engine batched it. A call with enough work hands its units, in chunks of
// a few microseconds, to the library's helper threads (the matmul's pool and thread count,
// pool.h): from kMinSplitMacs multiply-adds when a helper is awake (it just helped a matmul),
// from kMinSplitMacsAsleep otherwise, as waking one costs more than a small call takes. A
// decode step of a small model runs on the calling thread.
//
// Vector code, chosen per call: AVX-512F where the CPU has it, else AVX2+FMA (the library
// only registers on CPUs with those), portable C++ off x86. JAXDIST_KERNELS_ISA=ggml (or avx2)
// and kernels.set_isa(False) keep the AVX2 path, as they keep ggml's dot products for the
// matmul. The two paths sum in different orders, so they agree to float32 rounding, not bits;
// each is deterministic.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// `target` names the custom call in errors (v1 or v2).
ffi::Error FailAt(const char* target, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + msg);
}

// One unit of work: the `g` query heads q[r * d] that share one key/value head, each against
// the first `n` keys and values (rows of `d` floats at k and v); results to out[r * d].
// `scratch` holds ScratchFloats(g, n) floats. Every ISA's version computes a unit the same way
// wherever it runs (any thread, any other units in the call), so its bits depend only on its
// inputs and n.
using AttendFn = void (*)(const float* q, int64_t g, const float* k, const float* v, int64_t n,
                          int64_t d, float scale, float* scratch, float* out);

int64_t ScratchFloats(int64_t g, int64_t n) { return g * ((n + 15) / 16 * 16 + 17); }

// ---- portable C++ (off x86) -----------------------------------------------------------------

[[maybe_unused]] void AttendPortable(const float* q, int64_t g, const float* k, const float* v,
                                     int64_t n, int64_t d, float scale, float* scratch,
                                     float* out) {
  std::fill(out, out + g * d, 0.0f);
  if (n <= 0) return;
  for (int64_t r = 0; r < g; ++r) {
    float* sr = scratch + r * n;
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) dot += q[r * d + c] * k[j * d + c];
      sr[j] = scale * dot;
    }
    const float mx = *std::max_element(sr, sr + n);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sr[j] = std::exp(sr[j] - mx);
      sum += sr[j];
    }
    const float inv = 1.0f / sum;
    float* o = out + r * d;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < d; ++c) o[c] += sr[j] * v[j * d + c];
    }
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
  }
}

#if defined(__x86_64__)

// The two x86 paths share one plan, in vectors of 8 (AVX2) or 16 floats (AVX-512):
// - scores, a block of 8 (16) keys at a time: one accumulator vector per key takes the
//   products over the head dim in order, then a transposing tree of shuffles and adds reduces
//   the 8 (16) accumulators at once into one vector of the block's scores (a horizontal sum
//   per key cost more than the products at head dim 64). A last partial block reads its last
//   key again in place of the missing ones and keeps only its own scores.
// - softmax per head: the maximum (kept by lanes while the scores are made), exp(s - max) in
//   place and their sum, by lanes.
// - values: the output rows stay in registers (up to 4 heads of up to 16 (64) floats per pass
//   over the keys), each key's value row is loaded once for those heads, and the sums are
//   scaled by 1 / sum at the end.
// Head dims 64 and 128 have their own instances (the loops over the head dim unroll).

// Loops over a few registers' worth of data: unrolled before GCC decides where the arrays of
// vectors live, or it stores every accumulator to the stack on every iteration.
#define JAXDIST_UNROLL _Pragma("GCC unroll 16")

// ---- AVX2 + FMA (every CPU the library registers on: jaxdist_kernels_init checks) ----------
#define JAXDIST_AVX2 __attribute__((target("avx2,fma")))

namespace avx2 {

// Lanes [0, n) set (n in 1..8): for the masked loads and stores of a row's last vector.
JAXDIST_AVX2 inline __m256i Mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

JAXDIST_AVX2 inline float Sum(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane j: the sum of v[j]'s 8 lanes.
JAXDIST_AVX2 inline __m256 Sum8(const __m256* v) {
  __m256 w[4];  // w[i]: key 2i's four partial sums in the low half, key 2i+1's in the high
  JAXDIST_UNROLL
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  __m256 x[2];  // x[i]: low half keys 4i, 4i+2 (two sums each), high half 4i+1, 4i+3
  JAXDIST_UNROLL
  for (int i = 0; i < 2; ++i) {
    x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // z: keys 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// q . k_j for the 8 keys from k (rows of d); with kFull false only the first `valid` exist and
// the last of them stands in for the rest. D > 0: d is D, known here (SmolLM2's and Llama's
// 64, 128), so the loop over the head dim unrolls and the rows are constant offsets.
template <int D, bool kFull>
JAXDIST_AVX2 inline __m256 Scores8(const float* q, const float* k, int64_t d, int64_t valid) {
  if constexpr (D > 0) d = D;
  const float* row[8];
  JAXDIST_UNROLL
  for (int j = 0; j < 8; ++j) row[j] = k + (kFull ? j : std::min<int64_t>(j, valid - 1)) * d;
  __m256 acc[8];
  JAXDIST_UNROLL
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  int64_t c = 0;
  if constexpr (D > 0) {
    JAXDIST_UNROLL
    for (int cc = 0; cc + 8 <= D; cc += 8) {
      const __m256 qc = _mm256_loadu_ps(q + cc);
      JAXDIST_UNROLL
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(row[j] + cc), acc[j]);
      }
    }
    c = D / 8 * 8;
  } else {
    for (; c + 8 <= d; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      JAXDIST_UNROLL
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(row[j] + c), acc[j]);
    }
  }
  if (c < d) {
    const __m256i m = Mask(d - c);
    const __m256 qc = _mm256_maskload_ps(q + c, m);
    JAXDIST_UNROLL
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm256_fmadd_ps(qc, _mm256_maskload_ps(row[j] + c, m), acc[j]);
    }
  }
  return Sum8(acc);
}

// exp(x) for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a
// degree-6 Taylor polynomial (relative error about 2e-7 there), times 2^n built in the
// exponent bits; x below -87 gives 0.
JAXDIST_AVX2 inline __m256 Exp(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// x[i] = exp(x[i] - mx) for the n entries of a row padded to whole vectors (the padding is
// overwritten too); returns the sum of the n.
JAXDIST_AVX2 inline float ExpSum(float* x, int64_t n, float mx) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(Mask(n - i))));
  }
  return Sum(acc);
}

// out[h * d + c0 + c] = inv[h] * sum_j p[h * ps + j] v[j * d + c0 + c] for G heads and the NV
// vectors from column c0 (`rem` columns left there; the last vector may be partial); n >= 1.
template <int G, int NV>
JAXDIST_AVX2 void Values(const float* p, int64_t ps, int64_t n, const float* v, int64_t d,
                         int64_t c0, int64_t rem, const float* inv, float* out) {
  const bool full = rem >= 8 * NV;
  const __m256i m = Mask(full ? 8 : rem - 8 * (NV - 1));
  __m256 acc[G][NV];
  JAXDIST_UNROLL
  for (int h = 0; h < G; ++h) {
    JAXDIST_UNROLL
    for (int c = 0; c < NV; ++c) acc[h][c] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * d + c0;
    __m256 x[NV];
    JAXDIST_UNROLL
    for (int c = 0; c + 1 < NV; ++c) x[c] = _mm256_loadu_ps(vj + 8 * c);
    x[NV - 1] = full ? _mm256_loadu_ps(vj + 8 * (NV - 1))
                     : _mm256_maskload_ps(vj + 8 * (NV - 1), m);
    JAXDIST_UNROLL
    for (int h = 0; h < G; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * ps + j);
      JAXDIST_UNROLL
      for (int c = 0; c < NV; ++c) acc[h][c] = _mm256_fmadd_ps(ph, x[c], acc[h][c]);
    }
  }
  JAXDIST_UNROLL
  for (int h = 0; h < G; ++h) {
    const __m256 s = _mm256_set1_ps(inv[h]);
    float* o = out + h * d + c0;
    JAXDIST_UNROLL
    for (int c = 0; c + 1 < NV; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[h][c], s));
    const __m256 last = _mm256_mul_ps(acc[h][NV - 1], s);
    if (full) {
      _mm256_storeu_ps(o + 8 * (NV - 1), last);
    } else {
      _mm256_maskstore_ps(o + 8 * (NV - 1), m, last);
    }
  }
}

template <int G>
JAXDIST_AVX2 void ValuesG(int64_t nv, const float* p, int64_t ps, int64_t n, const float* v,
                          int64_t d, int64_t c0, int64_t rem, const float* inv, float* out) {
  if (nv == 1) return Values<G, 1>(p, ps, n, v, d, c0, rem, inv, out);
  return Values<G, 2>(p, ps, n, v, d, c0, rem, inv, out);
}

// The weighted values of every head, up to 4 heads and 16 columns per pass over the keys
// (accumulators in registers, each value row loaded once for those heads).
JAXDIST_AVX2 void AllValues(const float* p, int64_t ps, int64_t g, int64_t n, const float* v,
                            int64_t d, const float* inv, float* out) {
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    const int64_t rem = d - c0;
    const int64_t nv = std::min<int64_t>(2, (rem + 7) / 8);
    int64_t h = 0;
    for (; h + 4 <= g; h += 4) {
      ValuesG<4>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d);
    }
    switch (g - h) {
      case 3: ValuesG<3>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      case 2: ValuesG<2>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      case 1: ValuesG<1>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      default: break;
    }
  }
}

// Scratch: the scores, g rows of n rounded up to whole blocks of 16 (so that blocks store and
// load whole vectors: a masked store read back at once stalls the load), then g running
// maxima of 16 lanes, then g sums' inverses.
template <int D>
JAXDIST_AVX2 void AttendD(const float* q, int64_t g, const float* k, const float* v, int64_t n,
                          int64_t d, float scale, float* scratch, float* out) {
  if (n <= 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  const int64_t ps = (n + 15) / 16 * 16;
  float* scores = scratch;
  float* mxv = scratch + g * ps;
  float* inv = mxv + 16 * g;
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t r = 0; r < g; ++r) _mm256_storeu_ps(mxv + 16 * r, ninf);
  int64_t j0 = 0;
  for (; j0 + 8 <= n; j0 += 8) {
    for (int64_t r = 0; r < g; ++r) {
      const __m256 sv = _mm256_mul_ps(vs, Scores8<D, true>(q + r * d, k + j0 * d, d, 8));
      _mm256_storeu_ps(scores + r * ps + j0, sv);
      _mm256_storeu_ps(mxv + 16 * r, _mm256_max_ps(_mm256_loadu_ps(mxv + 16 * r), sv));
    }
  }
  if (j0 < n) {
    const __m256 m = _mm256_castsi256_ps(Mask(n - j0));
    for (int64_t r = 0; r < g; ++r) {
      const __m256 sv = _mm256_mul_ps(vs, Scores8<D, false>(q + r * d, k + j0 * d, d, n - j0));
      _mm256_storeu_ps(scores + r * ps + j0, sv);
      _mm256_storeu_ps(mxv + 16 * r, _mm256_max_ps(_mm256_loadu_ps(mxv + 16 * r),
                                                   _mm256_blendv_ps(ninf, sv, m)));
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    const __m256 vm = _mm256_loadu_ps(mxv + 16 * r);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    inv[r] = 1.0f / ExpSum(scores + r * ps, n, _mm_cvtss_f32(m4));
  }
  AllValues(scores, ps, g, n, v, d, inv, out);
}

void Attend(const float* q, int64_t g, const float* k, const float* v, int64_t n, int64_t d,
            float scale, float* scratch, float* out) {
  switch (d) {
    case 64: return AttendD<64>(q, g, k, v, n, d, scale, scratch, out);
    case 128: return AttendD<128>(q, g, k, v, n, d, scale, scratch, out);
    default: return AttendD<0>(q, g, k, v, n, d, scale, scratch, out);
  }
}

}  // namespace avx2

// ---- AVX-512F (where the CPU has it, unless the ISA is forced to AVX2) ----------------------
#define JAXDIST_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace avx512 {

JAXDIST_AVX512 inline __mmask16 Mask(int64_t n) {  // lanes [0, n), n in 1..16
  return static_cast<__mmask16>((1u << n) - 1);
}

// Lane j: the sum of v[j]'s 16 lanes.
JAXDIST_AVX512 inline __m512 Sum16(const __m512* v) {
  __m512 w[8];  // w[i]: key 2i's 8 partial sums in 128-bit lanes 0-1, key 2i+1's in 2-3
  JAXDIST_UNROLL
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 x[4];  // x[i]: keys 4i .. 4i+3, four partial sums each, in 128-bit lanes 0-3
  JAXDIST_UNROLL
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  __m512 y[2];  // y[i], 128-bit lane L: keys 8i+L and 8i+4+L, two partial sums each
  JAXDIST_UNROLL
  for (int i = 0; i < 2; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // z, 128-bit lane L: keys L, 4+L, 8+L, 12+L
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// As avx2::Scores8, for 16 keys.
template <int D, bool kFull>
JAXDIST_AVX512 inline __m512 Scores16(const float* q, const float* k, int64_t d,
                                      int64_t valid) {
  if constexpr (D > 0) d = D;
  const float* row[16];
  JAXDIST_UNROLL
  for (int j = 0; j < 16; ++j) row[j] = k + (kFull ? j : std::min<int64_t>(j, valid - 1)) * d;
  __m512 acc[16];
  JAXDIST_UNROLL
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int64_t c = 0;
  if constexpr (D > 0) {
    JAXDIST_UNROLL
    for (int cc = 0; cc + 16 <= D; cc += 16) {
      const __m512 qc = _mm512_loadu_ps(q + cc);
      JAXDIST_UNROLL
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row[j] + cc), acc[j]);
      }
    }
    c = D / 16 * 16;
  } else {
    for (; c + 16 <= d; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
      JAXDIST_UNROLL
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row[j] + c), acc[j]);
      }
    }
  }
  if (c < d) {
    const __mmask16 m = Mask(d - c);
    const __m512 qc = _mm512_maskz_loadu_ps(m, q + c);
    JAXDIST_UNROLL
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, row[j] + c), acc[j]);
    }
  }
  return Sum16(acc);
}

// exp(x) for x <= 0, as avx2::Exp (the same polynomial), 2^n by vscalefps.
JAXDIST_AVX512 inline __m512 Exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 in = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(in, p, n);
}

// As avx2::ExpSum.
JAXDIST_AVX512 inline float ExpSum(float* x, int64_t n, float mx) {
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_mask_add_ps(acc, Mask(n - i), acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// As avx2::Values: G heads, NV vectors of 16 from column c0.
template <int G, int NV>
JAXDIST_AVX512 void Values(const float* p, int64_t ps, int64_t n, const float* v, int64_t d,
                           int64_t c0, int64_t rem, const float* inv, float* out) {
  const __mmask16 m = Mask(std::min<int64_t>(16, rem - 16 * (NV - 1)));
  __m512 acc[G][NV];
  JAXDIST_UNROLL
  for (int h = 0; h < G; ++h) {
    JAXDIST_UNROLL
    for (int c = 0; c < NV; ++c) acc[h][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * d + c0;
    __m512 x[NV];
    JAXDIST_UNROLL
    for (int c = 0; c + 1 < NV; ++c) x[c] = _mm512_loadu_ps(vj + 16 * c);
    x[NV - 1] = _mm512_maskz_loadu_ps(m, vj + 16 * (NV - 1));
    JAXDIST_UNROLL
    for (int h = 0; h < G; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * ps + j]);
      JAXDIST_UNROLL
      for (int c = 0; c < NV; ++c) acc[h][c] = _mm512_fmadd_ps(ph, x[c], acc[h][c]);
    }
  }
  JAXDIST_UNROLL
  for (int h = 0; h < G; ++h) {
    const __m512 s = _mm512_set1_ps(inv[h]);
    float* o = out + h * d + c0;
    JAXDIST_UNROLL
    for (int c = 0; c + 1 < NV; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[h][c], s));
    _mm512_mask_storeu_ps(o + 16 * (NV - 1), m, _mm512_mul_ps(acc[h][NV - 1], s));
  }
}

template <int G>
JAXDIST_AVX512 void ValuesG(int64_t nv, const float* p, int64_t ps, int64_t n, const float* v,
                            int64_t d, int64_t c0, int64_t rem, const float* inv, float* out) {
  switch (nv) {
    case 1: return Values<G, 1>(p, ps, n, v, d, c0, rem, inv, out);
    case 2: return Values<G, 2>(p, ps, n, v, d, c0, rem, inv, out);
    case 3: return Values<G, 3>(p, ps, n, v, d, c0, rem, inv, out);
    default: return Values<G, 4>(p, ps, n, v, d, c0, rem, inv, out);
  }
}

// As avx2::AllValues, up to 4 heads and 64 columns per pass.
JAXDIST_AVX512 void AllValues(const float* p, int64_t ps, int64_t g, int64_t n, const float* v,
                              int64_t d, const float* inv, float* out) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int64_t rem = d - c0;
    const int64_t nv = std::min<int64_t>(4, (rem + 15) / 16);
    int64_t h = 0;
    for (; h + 4 <= g; h += 4) {
      ValuesG<4>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d);
    }
    switch (g - h) {
      case 3: ValuesG<3>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      case 2: ValuesG<2>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      case 1: ValuesG<1>(nv, p + h * ps, ps, n, v, d, c0, rem, inv + h, out + h * d); break;
      default: break;
    }
  }
}

// As avx2::AttendD, in blocks of 16 keys; a last block of at most 8 keys takes AVX2's blocks
// of 8 (half the products of a block of 16).
template <int D>
JAXDIST_AVX512 void AttendD(const float* q, int64_t g, const float* k, const float* v, int64_t n,
                            int64_t d, float scale, float* scratch, float* out) {
  if (n <= 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  const int64_t ps = (n + 15) / 16 * 16;
  float* scores = scratch;
  float* mxv = scratch + g * ps;
  float* inv = mxv + 16 * g;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < g; ++r) _mm512_storeu_ps(mxv + 16 * r, _mm512_set1_ps(-INFINITY));
  int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {
    for (int64_t r = 0; r < g; ++r) {
      const __m512 sv = _mm512_mul_ps(vs, Scores16<D, true>(q + r * d, k + j0 * d, d, 16));
      _mm512_storeu_ps(scores + r * ps + j0, sv);
      _mm512_storeu_ps(mxv + 16 * r, _mm512_max_ps(_mm512_loadu_ps(mxv + 16 * r), sv));
    }
  }
  if (j0 + 8 < n) {
    const __mmask16 m = Mask(n - j0);
    for (int64_t r = 0; r < g; ++r) {
      const __m512 sv = _mm512_mul_ps(vs, Scores16<D, false>(q + r * d, k + j0 * d, d, n - j0));
      _mm512_storeu_ps(scores + r * ps + j0, sv);
      const __m512 mx = _mm512_loadu_ps(mxv + 16 * r);
      _mm512_storeu_ps(mxv + 16 * r, _mm512_mask_max_ps(mx, m, mx, sv));
    }
  } else if (j0 < n) {
    const __m256 m = _mm256_castsi256_ps(avx2::Mask(n - j0));
    const __m256 vs8 = _mm256_set1_ps(scale);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t r = 0; r < g; ++r) {
      const __m256 sv = _mm256_mul_ps(vs8, avx2::Scores8<D, false>(q + r * d, k + j0 * d, d,
                                                                   n - j0));
      _mm256_storeu_ps(scores + r * ps + j0, sv);
      _mm256_storeu_ps(mxv + 16 * r, _mm256_max_ps(_mm256_loadu_ps(mxv + 16 * r),
                                                   _mm256_blendv_ps(ninf, sv, m)));
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    const float mx = _mm512_reduce_max_ps(_mm512_loadu_ps(mxv + 16 * r));
    inv[r] = 1.0f / ExpSum(scores + r * ps, n, mx);
  }
  AllValues(scores, ps, g, n, v, d, inv, out);
}

void Attend(const float* q, int64_t g, const float* k, const float* v, int64_t n, int64_t d,
            float scale, float* scratch, float* out) {
  switch (d) {
    case 64: return AttendD<64>(q, g, k, v, n, d, scale, scratch, out);
    case 128: return AttendD<128>(q, g, k, v, n, d, scale, scratch, out);
    default: return AttendD<0>(q, g, k, v, n, d, scale, scratch, out);
  }
}

}  // namespace avx512
#endif  // __x86_64__

std::atomic<bool> g_wide{false};  // the AVX-512F path (jaxdist_attention::SetWide)

AttendFn PickAttend() {
#if defined(__x86_64__)
  return g_wide.load(std::memory_order_relaxed) ? avx512::Attend : avx2::Attend;
#else
  return AttendPortable;
#endif
}

// When a call is split over the helper threads, from its multiply-adds (2 * visible keys *
// query heads * head dim, over all the step's queries). Measured on the 2-core Zen 4 VMs with
// bench/attention_threads.cc (the units through the pool, 1 against 2 threads): with a helper
// awake (spinning after a matmul it helped with, as in a ~1B model's decode step, whose
// projections split), 2 threads lost below about 200K (115K: 3.3 -> 3.6 us) and gained from
// 230K (SmolLM2's decode at 200 keys: 8.0 -> 5.4 us; 32 heads at 100 keys: 11.8 -> 7.0 us).
// With the helpers asleep (SmolLM2's step: its projections before attention run on one
// thread) waking one took 20-60 us: 2 threads lost 7 us at 230K (7.5 -> 14.8 us), gained 1.1x
// at 1.6M and 1.3x at 1.8M.
constexpr int64_t kMinSplitMacs = int64_t{1} << 18;         // a helper awake
constexpr int64_t kMinSplitMacsAsleep = int64_t{1} << 21;   // the helpers asleep
// Units per claimed chunk: about this much work (~3 us of one thread), so that a helper that
// joins late holds the caller back by at most that much.
constexpr int64_t kChunkMacs = int64_t{1} << 17;

ffi::Error CacheAttention(const char* target, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                          ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pos,
                          ffi::Buffer<ffi::S32> length, ffi::ResultBuffer<ffi::F32> y,
                          float scale, int64_t window) {
  auto Fail = [target](const std::string& msg) { return FailAt(target, msg); };
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto vd = v_cache.dimensions();
  auto yd = y->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || yd.size() != 4) {
    return Fail("expected q (B, S, H, D), caches (slots, KV, T, D) and y (B, S, H, D)");
  }
  const int64_t nb = qd[0], ns = qd[1], nh = qd[2], d = qd[3];
  const int64_t slots = kd[0], nkv = kd[1], t = kd[2];
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return Fail("the key and value caches differ in shape");
    if (yd[i] != qd[i]) return Fail("y's shape differs from q's");
  }
  if (kd[3] != d) {
    return Fail("head dim " + std::to_string(d) + " of q, " + std::to_string(kd[3]) +
                " of the cache");
  }
  if (nkv <= 0 || nh % nkv != 0) {
    return Fail(std::to_string(nh) + " query heads is not a multiple of " +
                std::to_string(nkv) + " key/value heads");
  }
  if (slot.element_count() != static_cast<size_t>(nb) ||
      pos.element_count() != static_cast<size_t>(nb) ||
      length.element_count() != static_cast<size_t>(nb)) {
    return Fail("slot, pos and length must hold one entry per row (" + std::to_string(nb) + ")");
  }
  if (window < 0) return Fail("window " + std::to_string(window) + " is negative (0: full)");
  if (nb == 0 || ns == 0 || nh == 0 || d == 0) return ffi::Error::Success();
  if (slots <= 0 || t <= 0) return Fail("the cache holds no slot or no position");

  const int64_t group = nh / nkv;
  const float* qp = q.typed_data();
  const float* kc = k_cache.typed_data();
  const float* vc = v_cache.typed_data();
  const int32_t* sl = slot.typed_data();
  const int32_t* ps = pos.typed_data();
  const int32_t* ln = length.typed_data();
  float* out = y->typed_data();
  const AttendFn attend = PickAttend();  // one path for the whole call

  // The keys query i of row b sees, [first(b, i), seen(b, i)): j <= pos + i, j < pos + length,
  // j < T, and with a window j > pos + i - window. An idle row (length 0) sees nothing; its
  // queries get zeros.
  auto seen = [&](int64_t b, int64_t i) -> int64_t {
    const int64_t p0 = ps[b], len = ln[b];
    const int64_t end = len > 0 ? std::min<int64_t>(p0 + len, t) : 0;
    return std::max<int64_t>(0, std::min<int64_t>(p0 + i + 1, end));
  };
  auto first = [&](int64_t b, int64_t i) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, ps[b] + i + 1 - window) : 0;
  };
  // Units (row b, query i, key/value head), in that order; each is computed whole by one
  // thread, exactly as it would be alone (so B, S and the thread count change no bits).
  const std::function<void(int64_t, int64_t)> run = [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scratch;  // this thread's scores
    const size_t need = static_cast<size_t>(ScratchFloats(group, t));
    if (scratch.size() < need) scratch.resize(need);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t kvh = u % nkv, i = (u / nkv) % ns, b = u / (nkv * ns);
      const int64_t s = std::clamp<int64_t>(sl[b], 0, slots - 1);
      const int64_t base = (s * nkv + kvh) * t * d;
      const int64_t row = ((b * ns + i) * nh + kvh * group) * d;
      const int64_t hi = seen(b, i), lo = std::min(first(b, i), hi);
      attend(qp + row, group, kc + base + lo * d, vc + base + lo * d, hi - lo, d, scale,
             scratch.data(), out + row);
    }
  };
  const int64_t units = nb * ns * nkv;
  const int64_t threads = jaxdist_pool::Threads();
  int64_t keys = 0;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < ns; ++i) keys += std::max<int64_t>(0, seen(b, i) - first(b, i));
  }
  const int64_t macs = 2 * keys * nh * d;
  if (threads > 1 && units > 1 &&
      (macs >= kMinSplitMacsAsleep || (macs >= kMinSplitMacs && jaxdist_pool::HelpersAwake()))) {
    const int64_t most = std::max<int64_t>(1, units / (2 * threads));
    jaxdist_pool::ParallelFor(units, std::clamp<int64_t>(units * kChunkMacs / macs, 1, most),
                              run);
  } else {
    run(0, units);
  }
  return ffi::Error::Success();
}

ffi::Error CacheAttentionV1(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                            ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slot,
                            ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> length,
                            ffi::ResultBuffer<ffi::F32> y, float scale) {
  return CacheAttention("jaxdist_cache_attention_v1", q, k_cache, v_cache, slot, pos, length, y,
                        scale, 0);
}

ffi::Error CacheAttentionV2(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                            ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slot,
                            ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> length,
                            ffi::ResultBuffer<ffi::F32> y, float scale, int32_t window) {
  return CacheAttention("jaxdist_cache_attention_v2", q, k_cache, v_cache, slot, pos, length, y,
                        scale, window);
}

}  // namespace

namespace jaxdist_attention {

bool SetWide(bool wide) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool on = wide && __builtin_cpu_supports("avx512f");
#else
  const bool on = wide && false;
#endif
  g_wide.store(on);
  return on;
}

}  // namespace jaxdist_attention

#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistCacheAttentionV1, CacheAttentionV1,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistCacheAttentionV2, CacheAttentionV2,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window"));
#pragma GCC visibility pop
