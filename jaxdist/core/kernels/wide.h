// jaxdist's own wide-vector dot products for GGML blocks (AVX-512 with VNNI), chosen at run time.
//
// ggml_matmul.cc quantizes a call's activations with ggml's own `from_float` of the weight
// type's `vec_dot_type` (Q8_0, Q8_1 or Q8_K), so the activations' numerics are llama.cpp's.
// Where this CPU has AVX-512 F/BW/VL/VNNI/VBMI and a `WideKernel` exists for the weight type,
// each quantized activation row is then rearranged once (`relayout`) into the order the
// kernel's vector loads want, and `dot_rows` multiplies it with rows of W as the file stores
// them. Elsewhere, or with JAXDIST_KERNELS_ISA=avx2, ggml's `vec_dot` (the wheel's AVX2 build)
// runs instead. The results agree with ggml's to float32 rounding of the sums' order.
//
// The functions are compiled with per-function target attributes, so the library builds and
// loads on any x86-64 CPU; they are only called after `WideIsaSupported()` said yes.
#pragma once

#include <cstddef>
#include <cstdint>

// The instruction sets every wide function is compiled for (the library itself is not).
#define WIDE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

namespace jaxdist_wide {

struct WideKernel {
  // Bytes of one rearranged activation row of K elements (a multiple of 64).
  size_t (*row_bytes)(int64_t k);
  // One activation row: `q` is the row as ggml's from_float wrote it in the vec_dot_type,
  // `out` receives row_bytes(k) bytes (64-byte aligned).
  void (*relayout)(const uint8_t* q, uint8_t* out, int64_t k);
  // y[r] = W[r] . x for r in [0, nrows): W rows of `w_row` bytes, in the file's block layout;
  // x as `relayout` wrote it.
  void (*dot_rows)(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows, const uint8_t* x,
                   float* y);
  // The same for m <= kMaxMulti activation rows at once (a batch, a prefill chunk): row i at
  // x + i * x_row, its results at y[i][0 .. nrows). Each weight block is read and unpacked
  // once for all m rows, which is what makes a batch cheaper than m single rows.
  void (*dot_rows_multi)(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows,
                         const uint8_t* x, size_t x_row, int64_t m, float* const* y);
};

constexpr int64_t kMaxMulti = 8;

// A product loop for M activation rows at once, M a template argument so the accumulators stay
// in registers: Loop<M>::Run(k, w, w_row, nrows, x, x_row, y).
using LoopFn = void (*)(int64_t, const uint8_t*, size_t, int64_t, const uint8_t*, size_t,
                        float* const*);

// dot_rows and dot_rows_multi of such a loop: M = 1, and M = 1..kMaxMulti picked from a table.
template <template <int> class Loop>
struct Entry {
  static void One(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows, const uint8_t* x,
                  float* y) {
    Loop<1>::Run(k, w, w_row, nrows, x, 0, &y);
  }
  static void Multi(int64_t k, const uint8_t* w, size_t w_row, int64_t nrows, const uint8_t* x,
                    size_t x_row, int64_t m, float* const* y) {
    static constexpr LoopFn kByM[kMaxMulti] = {Loop<1>::Run, Loop<2>::Run, Loop<3>::Run,
                                               Loop<4>::Run, Loop<5>::Run, Loop<6>::Run,
                                               Loop<7>::Run, Loop<8>::Run};
    kByM[m - 1](k, w, w_row, nrows, x, x_row, y);
  }
};

// ggml's quantize_row_q8_K_ref to the same bytes, with AVX-512 (wide_kquants.cc): the K-quants'
// activations, written as ggml's block_q8_K (float d, int8 qs[256], int16 bsums[16]).
void QuantizeRowQ8K(const float* x, uint8_t* out, int64_t k);

// True when this CPU has everything the wide kernels use (checked once).
bool WideIsaSupported();

// The wide kernel for a GGML type id, or null. Does not check the CPU.
const WideKernel* SimpleKernel(int ggml_type);  // Q4_0, Q4_1, Q8_0 (wide_simple.cc)
const WideKernel* KquantKernel(int ggml_type);  // Q4_K, Q6_K (wide_kquants.cc)

}  // namespace jaxdist_wide
