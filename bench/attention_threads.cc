// The attention kernel's units on 1 and 2 threads through the kernels' helper pool, with the
// helpers awake or asleep when a call comes: the measurements behind kMinSplitMacs and
// kMinSplitMacsAsleep in jaxdist/core/kernels/attention.cc. Not part of the library.
//
// Each call is `units` units of `g` query heads over `n` keys (head dim 64, AVX-512F path, or
// AVX2 where the CPU lacks it), run by jaxdist_pool::ParallelFor (2 threads) or on the calling
// thread (1), after the caller spun `gap` microseconds: a gap under the helpers' 20 us spin
// finds them awake, a longer one asleep. Prints medians of 3000 calls.
//
// Build and run from the repository root (the venv's jaxlib and libggml-python headers):
//
//   V=.venv/lib/python3.11/site-packages
//   c++ -O3 -std=c++17 -fvisibility=hidden -isystem $V/jaxlib/include -I$V/libggml/include \
//     -Ijaxdist/core/kernels bench/attention_threads.cc jaxdist/core/kernels/ggml_matmul.cc \
//     jaxdist/core/kernels/wide_simple.cc jaxdist/core/kernels/wide_kquants.cc \
//     -L$V/libggml/lib64 -lggml-cpu -lggml-base -Wl,-rpath,$V/libggml/lib64 -o /tmp/attn_threads
//   /tmp/attn_threads 4 200 8 10     # g n units gap_us: a ~1B model's decode step, 200 keys
#include "attention.cc"  // NOLINT: the kernel's own units, in this translation unit

#include <chrono>
#include <cstdio>
#include <cstdlib>

extern "C" void jaxdist_kernels_set_threads(int n);

namespace {

using Clock = std::chrono::steady_clock;

void Spin(double us) {
  const auto until = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(us * 1000));
  while (Clock::now() < until) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s g n units gap_us\n", argv[0]);
    return 2;
  }
  const int64_t g = std::atoi(argv[1]), n = std::atoi(argv[2]), units = std::atoi(argv[3]);
  const int64_t d = 64;
  const double gap = std::atof(argv[4]);
  std::vector<float> q(units * g * d), k(units * n * d), v(units * n * d), out(units * g * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 13);
  for (size_t i = 0; i < k.size(); ++i) k[i] = 0.01f * static_cast<float>(i % 17);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>(i % 19);
  jaxdist_attention::SetWide(true);
  const AttendFn attend = PickAttend();
  const std::function<void(int64_t, int64_t)> run = [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scratch(ScratchFloats(g, n));
    for (int64_t u = u0; u < u1; ++u) {
      attend(q.data() + u * g * d, g, k.data() + u * n * d, v.data() + u * n * d, n, d, 0.125f,
             scratch.data(), out.data() + u * g * d);
    }
  };
  for (int threads : {1, 2}) {
    jaxdist_kernels_set_threads(threads);
    std::vector<double> us;
    for (int r = 0; r < 3000; ++r) {
      Spin(gap);
      const auto t0 = Clock::now();
      if (threads > 1) {
        jaxdist_pool::ParallelFor(units, 1, run);
      } else {
        run(0, units);
      }
      us.push_back(std::chrono::duration<double>(Clock::now() - t0).count() * 1e6);
    }
    std::sort(us.begin(), us.end());
    std::printf("g=%ld n=%ld units=%ld gap=%.0f us threads=%d: median %.2f us (p10 %.2f, p90 "
                "%.2f), %ld multiply-adds\n", static_cast<long>(g), static_cast<long>(n),
                static_cast<long>(units), gap, threads, us[us.size() / 2], us[us.size() / 10],
                us[us.size() * 9 / 10], static_cast<long>(2 * units * g * n * d));
  }
  return 0;
}
