// jaxdist CPU kernels, ABI version 1: attention of a few queries over a slot KV cache.
//
// `jaxdist_cache_attention_v1` computes what exporters/layers.py `cache_attention` computes
// after it has written the step's keys and values into the cache, but it reads only the cache
// positions a query can see. The portable form gathers each row's whole slot (`max_seq`
// positions) and masks it, so a decode step reads and copies the full cache of every layer
// however short the sequence is; this kernel reads `pos + length` positions, as llama.cpp reads
// only its used cells. It is called for steps of a few tokens (decode); prefill keeps XLA's
// dots (jaxdist/core/kernels/ops.py).
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
// Attribute `scale` (f32) multiplies the scores.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Fail(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxdist_cache_attention_v1: " + msg);
}

#if defined(__x86_64__)
// The library is only registered on CPUs with AVX2 and FMA (jaxdist_kernels_init).
#define JAXDIST_SIMD __attribute__((target("avx2,fma")))

JAXDIST_SIMD inline float Dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y += a * x
JAXDIST_SIMD inline void Axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a
// degree-6 Taylor polynomial (relative error about 2e-7 there), times 2^n built in the
// exponent bits; x below -87 gives 0.
JAXDIST_SIMD inline __m256 Exp(__m256 x) {
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

// x[i] = exp(x[i] - mx); returns the sum.
JAXDIST_SIMD inline float ExpSum(float* x, int64_t n, float mx) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}
#else
#define JAXDIST_SIMD

inline float Dot(const float* a, const float* b, int64_t n) {
  float r = 0.0f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

inline void Axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline float ExpSum(float* x, int64_t n, float mx) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}
#endif

// The `g` query heads q[r * d] that share one key/value head, each against its first `n` keys
// and values (of `d` elements); results to out[r * d]. scores holds g * n floats.
JAXDIST_SIMD void AttendGroup(const float* q, int64_t g, const float* k, const float* v,
                              int64_t n, int64_t d, float scale, float* scores, float* out) {
  std::fill(out, out + g * d, 0.0f);
  if (n <= 0) return;
  for (int64_t j = 0; j < n; ++j) {  // one pass over the keys serves every head of the group
    for (int64_t r = 0; r < g; ++r) scores[r * n + j] = scale * Dot(q + r * d, k + j * d, d);
  }
  for (int64_t r = 0; r < g; ++r) {
    float* sr = scores + r * n;
    const float mx = *std::max_element(sr, sr + n);
    const float inv = 1.0f / ExpSum(sr, n, mx);
    for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < g; ++r) Axpy(scores[r * n + j], v + j * d, out + r * d, d);
  }
}

ffi::Error CacheAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                          ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slot,
                          ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> length,
                          ffi::ResultBuffer<ffi::F32> y, float scale) {
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
  if (nb == 0 || ns == 0 || nh == 0 || d == 0) return ffi::Error::Success();
  if (slots <= 0 || t <= 0) return Fail("the cache holds no slot or no position");

  const int64_t group = nh / nkv;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(group * t));
  const float* qp = q.typed_data();
  const float* kc = k_cache.typed_data();
  const float* vc = v_cache.typed_data();
  float* out = y->typed_data();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t s = std::clamp<int64_t>(slot.typed_data()[b], 0, slots - 1);
    const int64_t p0 = pos.typed_data()[b];
    const int64_t len = length.typed_data()[b];
    // An idle row (length 0) sees nothing; its queries get zeros.
    const int64_t end = len > 0 ? std::min<int64_t>(p0 + len, t) : 0;
    for (int64_t i = 0; i < ns; ++i) {
      const int64_t seen = std::max<int64_t>(0, std::min<int64_t>(p0 + i + 1, end));
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const int64_t base = (s * nkv + kvh) * t * d;
        const int64_t row = ((b * ns + i) * nh + kvh * group) * d;
        AttendGroup(qp + row, group, kc + base, vc + base, seen, d, scale, scores.data(),
                    out + row);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistCacheAttentionV1, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
#pragma GCC visibility pop
