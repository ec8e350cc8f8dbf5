// The kernel library's helper threads, for the handlers of its other files (attention.cc).
//
// One pool serves every handler: the helpers and the thread count of ggml_matmul.cc (class
// Helpers, `jaxdist_kernels_set_threads`, CpuBudget()), defined there. Nothing here is exported
// from the shared object (the library is built with -fvisibility=hidden, and these say so too).
#pragma once

#include <cstdint>
#include <functional>

#define JAXDIST_INTERNAL __attribute__((visibility("hidden")))

namespace jaxdist_pool {

// Threads a split call uses: `jaxdist_kernels_set_threads`, or when that is 0 the CPUs this
// process may use (the caller included).
JAXDIST_INTERNAL int64_t Threads();

// Whether a helper is awake now (working, or spinning for the next job after its last one):
// then a split starts at once; a sleeping helper joins tens of microseconds late. A hint for
// how much work is worth splitting, never for what is computed.
JAXDIST_INTERNAL bool HelpersAwake();

// Runs fn(begin, end) over [0, n) in chunks of `per_chunk` (the last may be shorter), claimed
// by the calling thread and up to Threads() - 1 helpers; returns when every chunk is done. The
// caller runs every chunk no helper claimed, so this never waits on a busy helper. Which thread
// runs a chunk varies from call to call: fn must compute each index the same way on any thread.
JAXDIST_INTERNAL void ParallelFor(int64_t n, int64_t per_chunk,
                                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace jaxdist_pool

namespace jaxdist_attention {

// attention.cc's vector code: its AVX-512F path when `wide` is true and the CPU has AVX-512F,
// else its AVX2+FMA path (portable C++ off x86). Returns whether the AVX-512F path is in use.
// Called by jaxdist_kernels_init (wide unless JAXDIST_KERNELS_ISA=ggml or avx2) and
// jaxdist_kernels_set_isa, so the matmul's ISA switch covers attention too.
JAXDIST_INTERNAL bool SetWide(bool wide);

}  // namespace jaxdist_attention
