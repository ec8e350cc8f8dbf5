// jaxdist CPU kernels: y[M, N] = x[M, K] . W[N, K]^T with W in GGML blocks.
//
// XLA FFI handlers, called from exported stages through lax.platform_dependent
// (jaxdist/core/kernels/ops.py). W is bound exactly as the GGUF file stores it: N rows of
// K/block_elems blocks.
//
// - `jaxdist_ggml_matmul_v2`: the product for few rows (decode). x is quantized once per call
//   to the type's `vec_dot_type` (Q8_0, Q8_1 or Q8_K) by ggml's own `from_float`, reached
//   through the public `ggml_get_type_traits_cpu` of the libggml-python wheel, as llama.cpp
//   does. Then every (row of x, row of W) pair is one dot product: jaxdist's AVX-512 VNNI ones
//   (wide.h) where the CPU has them and the type has one, else ggml's `vec_dot`.
//   A third operand, rows (M,) int32, skips the rows of x that are padding (zeros out).
// - `jaxdist_ggml_moe_matmul_v1`: the same products for a mixture of experts (like ggml's
//   mul_mat_id): w (E, N, row_bytes) holds E experts, ids (T, S) int32 the experts each token
//   chose; y[t, s] = x_row . W_e^T (MoeMatmul). The pairs are grouped by expert, so a chosen
//   expert's W is read once per call for all its rows, and unchosen experts are not read.
// - `jaxdist_ggml_dequantize_v2`: W to float32 with ggml's `to_float`, for products of many
//   rows (prefill), which XLA's f32 dot then computes faster than row-pair dot products. It
//   takes x too, for ordering only.
//
// Rows of W are split into chunks that the calling thread and up to `threads - 1` helper
// threads claim from an atomic counter (class Helpers); threads default to the CPUs this
// process may use (CpuBudget). attention.cc runs on the same helpers (pool.h's ParallelFor).
//
// Every buffer is checked against the declared type and shapes before anything is read.
// Built at first use by jaxdist/core/kernels/build.py; nothing here is copied from ggml.

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sched.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "pool.h"
#include "wide.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The library is built with -fvisibility=hidden; only these names are its interface.
#define JAXDIST_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kAbiVersion = 2;
// GGML type ids (GGUF's file format numbers) this handler accepts.
constexpr int kTypes[] = {GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
                          GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q2_K,
                          GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
constexpr int64_t kRowsPerChunk = 16;  // rows of W per claimed unit of work (the least)
constexpr int64_t kChunkBytes = int64_t{128} << 10;  // W per chunk of a several-row product
constexpr int64_t kActBlock = 64;      // rows of x kept hot per pass over a chunk
// Below these sizes one thread runs. A one-row product (decode) is bound by how fast one core
// takes in W's blocks (about 15-20 GB/s here, half the memory's rate), so a second thread
// nearly doubles it once W is large enough that handing half of it to a helper spinning
// between calls (about a microsecond) is small beside it: from 512 KB (SmolLM2's FFN matrices,
// every matrix of a 1B model). A product of several rows (batch, prefill) is compute-bound
// and splits by multiply-adds.
constexpr int64_t kMinSplitBytes = int64_t{1} << 19;
constexpr int64_t kMinSplitWorkRows = int64_t{1} << 19;
constexpr int64_t kMinSplitWork = int64_t{1} << 24;  // dequantization, in MAC equivalents

std::atomic<int> g_threads{0};  // 0: one per CPU of CpuBudget() (the caller included)
std::atomic<bool> g_wide{false};  // the matmul runs wide.h's kernels where a type has one

const jaxdist_wide::WideKernel* WideFor(int type) {
  if (!g_wide.load(std::memory_order_relaxed)) return nullptr;
  if (const auto* simple = jaxdist_wide::SimpleKernel(type)) return simple;
  return jaxdist_wide::KquantKernel(type);
}

bool Supported(int type) {
  for (int t : kTypes) {
    if (t == type) return true;
  }
  return false;
}

// moe: one work item, rows [n0, n1) of one chosen expert's matrix against the (t, s) pairs
// [p0, p1) of the expert-sorted order, which all chose that expert.
struct MoePart {
  const uint8_t* w;  // the expert's matrix (N rows)
  int64_t n0, n1;
  int64_t p0, p1;
};

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> helpers{0};  // helpers that joined
  int64_t max_helpers = 0;
  int64_t chunks = 0;
  int64_t chunk_rows = kRowsPerChunk;  // rows of W per chunk
  int64_t n = 0, k = 0;
  const uint8_t* w = nullptr;
  size_t w_row = 0;
  const uint8_t* xq = nullptr;
  size_t xq_row = 0;
  float* y = nullptr;
  ggml_vec_dot_t dot = nullptr;       // matmul: one (row of x, row of W) product
  ggml_to_float_t to_float = nullptr;  // dequantize: one row of W
  const jaxdist_wide::WideKernel* wide = nullptr;  // matmul on this CPU's wide vectors (wide.h)
  const uint8_t* wx = nullptr;  // x's live rows, one after another, as wide->relayout wrote them
  size_t wx_row = 0;
  const int64_t* live_rows = nullptr;  // their rows of y (matmul: and of x)
  int64_t n_live = 0;
  // moe: chunk c is parts[c]; live_rows are the pairs' rows of y in expert order (wx holds
  // their activations in that order), x_rows their rows of x (xq)
  const MoePart* parts = nullptr;
  const int64_t* x_rows = nullptr;
  // ParallelFor: range(n0, n1) for each chunk of [0, n) (nothing above is used)
  const std::function<void(int64_t, int64_t)>* range = nullptr;

  void Work() {
    for (;;) {
      int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      if (parts != nullptr) {
        const MoePart& p = parts[c];
        Products(p.w, p.n0, p.n1, wx != nullptr ? wx + p.p0 * wx_row : nullptr, x_rows + p.p0,
                 live_rows + p.p0, p.p1 - p.p0);
        done.fetch_add(1, std::memory_order_release);
        continue;
      }
      int64_t n0 = c * chunk_rows;
      int64_t n1 = n0 + chunk_rows < n ? n0 + chunk_rows : n;
      if (range != nullptr) {
        (*range)(n0, n1);
      } else if (to_float != nullptr) {
        for (int64_t r = n0; r < n1; ++r) to_float(w + r * w_row, y + r * k, k);
      } else {
        Products(w, n0, n1, wx, live_rows, live_rows, n_live);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // Rows [n0, n1) of the matrix `wm` times m activation rows; row j's results go to y's row
  // out[j]. The wide kernels read row j at xw + j * wx_row, ggml's vec_dot at xq + in[j] * xq_row.
  void Products(const uint8_t* wm, int64_t n0, int64_t n1, const uint8_t* xw, const int64_t* in,
                const int64_t* out, int64_t m) const {
    if (wide != nullptr) {
      // the rows kMaxMulti at a time: each pass reads the chunk's rows of W once (from cache
      // after the first), and a multi-row pass unpacks each block once for all of them
      for (int64_t j0 = 0; j0 < m; j0 += jaxdist_wide::kMaxMulti) {
        const int64_t mm = std::min(jaxdist_wide::kMaxMulti, m - j0);
        float* ys[jaxdist_wide::kMaxMulti];
        for (int64_t t = 0; t < mm; ++t) ys[t] = y + out[j0 + t] * n + n0;
        const uint8_t* xs = xw + j0 * wx_row;
        if (mm > 1 && wide->dot_rows_multi != nullptr) {
          wide->dot_rows_multi(k, wm + n0 * w_row, w_row, n1 - n0, xs, wx_row, mm, ys);
        } else {
          for (int64_t t = 0; t < mm; ++t) {
            wide->dot_rows(k, wm + n0 * w_row, w_row, n1 - n0, xs + t * wx_row, ys[t]);
          }
        }
      }
      return;
    }
    for (int64_t j0 = 0; j0 < m; j0 += kActBlock) {
      const int64_t j1 = j0 + kActBlock < m ? j0 + kActBlock : m;
      for (int64_t r = n0; r < n1; ++r) {
        const uint8_t* wr = wm + r * w_row;
        for (int64_t j = j0; j < j1; ++j) {
          dot(static_cast<int>(k), y + out[j] * n + r, 0, wr, 0, xq + in[j] * xq_row, 0, 1);
        }
      }
    }
  }
};

ffi::Error Fail(const char* target, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + msg);
}

// Helper threads of the kernels. A product is split into chunks that the caller and up to
// `threads - 1` helpers claim from the job's atomic counter. A helper that finds no work spins
// for kSpinMicros before it sleeps, so within a decode step (a kernel call every few tens of
// microseconds) handing work over costs nanoseconds, not the tens of microseconds of waking a
// sleeping thread; between steps the helpers sleep. The caller waits only for chunks that were
// claimed and does the rest itself, so a helper that is late (or descheduled on a busy machine)
// delays nothing but its own chunk, and concurrent calls cannot deadlock.
class Helpers {
 public:
  // Some helper is working or spinning: a job posted now starts on it within a microsecond or
  // so, where waking a sleeping one took 20 to 60 us on these VMs (attention.cc splits less
  // work in the first case).
  bool Awake() const { return awake_.load(std::memory_order_relaxed) > 0; }

  void Run(const std::shared_ptr<Job>& job, int64_t threads) {
    if (threads > 1) {
      job->max_helpers = threads - 1;
      Start(threads - 1);
      {
        std::lock_guard<std::mutex> lock(mu_);
        jobs_.push_back(job);
      }
      posted_.fetch_add(1, std::memory_order_release);
      if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    }
    job->Work();
    int spins = 0;
    while (job->done.load(std::memory_order_acquire) < job->chunks) {
      if (++spins > 256) std::this_thread::yield();
    }
    if (threads > 1) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
        if (*it == job) {
          jobs_.erase(it);
          break;
        }
      }
    }
  }

 private:
  static constexpr int64_t kSpinMicros = 20;

  void Start(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int64_t>(started_) < n) {
      std::thread(&Helpers::Loop, this).detach();  // they live as long as the process
      ++started_;
      awake_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::shared_ptr<Job> Next() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& job : jobs_) {
      if (job->next.load(std::memory_order_relaxed) < job->chunks &&
          job->helpers.fetch_add(1, std::memory_order_relaxed) < job->max_helpers) {
        return job;
      }
    }
    return nullptr;
  }

  void Loop() {
    for (;;) {
      int seen = posted_.load(std::memory_order_acquire);
      if (std::shared_ptr<Job> job = Next()) {
        job->Work();
        continue;
      }
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      while (posted_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      if (posted_.load(std::memory_order_acquire) != seen) continue;
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1, std::memory_order_acq_rel);
      awake_.fetch_sub(1, std::memory_order_relaxed);
      cv_.wait(lock, [&] { return posted_.load(std::memory_order_acquire) != seen; });
      awake_.fetch_add(1, std::memory_order_relaxed);
      sleeping_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  std::atomic<int> posted_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int> awake_{0};  // helpers started and not asleep (working or spinning)
  size_t started_ = 0;
};

Helpers& TheHelpers() {
  static Helpers* helpers = new Helpers();  // never destroyed: detached threads use it
  return *helpers;
}

// The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (v2's cpu.max
// or v1's cfs quota, rounded down, at least 1), so a worker pinned to one core or a pod limited
// to 2 CPUs starts no helper that could only spin against the caller. Read once: glibc answers
// hardware_concurrency() by reading /sys, which cost a decode step about a hundred system calls
// when it was asked on every product.
int64_t QuotaCpus() {
  double quota = 0, period = 0;
  std::string q;
  if (std::ifstream v2("/sys/fs/cgroup/cpu.max"); v2 >> q >> period) {
    if (q == "max") return 0;
    quota = std::atof(q.c_str());
  } else if (std::ifstream v1q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
             v1p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
             v1q >> quota && v1p >> period) {
    if (quota <= 0) return 0;
  }
  if (quota <= 0 || period <= 0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(quota / period));
}

int64_t CpuBudget() {
  static const int64_t n = [] {
    int64_t cpus = std::max<int64_t>(1, std::thread::hardware_concurrency());
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
    const int64_t quota = QuotaCpus();
    return quota > 0 ? std::min(cpus, quota) : cpus;
  }();
  return n;
}

int64_t Threads() {
  const int64_t threads = g_threads.load(std::memory_order_relaxed);
  return threads > 0 ? threads : CpuBudget();
}

void Run(const std::shared_ptr<Job>& job, bool split) {
  int64_t threads = split ? Threads() : 1;
  if (threads > job->chunks) threads = job->chunks;
  TheHelpers().Run(job, threads);
}

// Checks w (N, row_bytes) against the type and K; fills the row size.
ffi::Error CheckWeights(const char* target, int32_t type, int64_t k, int64_t n_rows,
                        int64_t row_bytes, size_t* w_row) {
  if (!Supported(type)) return Fail(target, "unsupported ggml_type " + std::to_string(type));
  const ggml_type gt = static_cast<ggml_type>(type);
  const ggml_type_traits* tt = ggml_get_type_traits(gt);
  if (k <= 0 || k % tt->blck_size != 0) {
    return Fail(target, "K = " + std::to_string(k) + " is not a multiple of the " +
                            ggml_type_name(gt) + " block (" + std::to_string(tt->blck_size) +
                            ")");
  }
  *w_row = static_cast<size_t>(k / tt->blck_size) * tt->type_size;
  if (row_bytes != static_cast<int64_t>(*w_row) || n_rows < 0) {
    return Fail(target, std::string("w rows hold ") + std::to_string(row_bytes) +
                            " bytes, expected " + std::to_string(*w_row) + " for K = " +
                            std::to_string(k) + " of " + ggml_type_name(gt));
  }
  return ffi::Error::Success();
}

// How a call's activations meet W: ggml's dot product for the weight type, the activation type
// (vec_dot_type) it reads and how x's rows are converted to it, and the wide kernel if any.
struct Activations {
  ggml_vec_dot_t dot = nullptr;
  ggml_type vt = GGML_TYPE_F32;
  ggml_from_float_t from_float = nullptr;  // null: x is used as is (vt is F32)
  size_t row = 0;                          // bytes of a row in vt
  const jaxdist_wide::WideKernel* wide = nullptr;
  bool own_q8k = false;  // Q8_K (the K-quants' activations) by QuantizeRowQ8K, ggml's bytes

  void Quantize(const float* x, uint8_t* out, int64_t k) const {
    if (own_q8k) {
      jaxdist_wide::QuantizeRowQ8K(x, out, k);
    } else {
      from_float(x, out, k);
    }
  }
};

ffi::Error GetActivations(const char* target, int32_t type, int64_t k, Activations* a) {
  const ggml_type gt = static_cast<ggml_type>(type);
  const ggml_type_traits_cpu* ct = ggml_get_type_traits_cpu(gt);
  if (ct == nullptr || ct->vec_dot == nullptr) {
    return Fail(target, std::string("ggml has no CPU dot product for ") + ggml_type_name(gt));
  }
  a->dot = ct->vec_dot;
  a->vt = ct->vec_dot_type;
  const ggml_type_traits* vtt = ggml_get_type_traits(a->vt);
  if (k % vtt->blck_size != 0) {
    return Fail(target, "K = " + std::to_string(k) + " is not a multiple of the " +
                            ggml_type_name(a->vt) + " block (" +
                            std::to_string(vtt->blck_size) + ")");
  }
  a->row = static_cast<size_t>(k) * sizeof(float);
  if (a->vt == GGML_TYPE_F32) return ffi::Error::Success();
  // The wide kernels read x once more rearranged (a few KB per row; wide.h).
  a->wide = WideFor(type);
  const ggml_type_traits_cpu* vct = ggml_get_type_traits_cpu(a->vt);
  if (vct == nullptr || vct->from_float == nullptr) {
    return Fail(target, std::string("ggml cannot convert activations to ") +
                            ggml_type_name(a->vt));
  }
  a->from_float = vct->from_float;
  a->row = static_cast<size_t>(k / vtt->blck_size) * vtt->type_size;
  // ggml's from_float for Q8_K is its scalar reference in the wheel; ours writes the same bytes.
  a->own_q8k = a->wide != nullptr && a->vt == GGML_TYPE_Q8_K;
  return ffi::Error::Success();
}

// `bytes` of `buf`, from a 64-byte boundary (the wide kernels' rearranged rows).
uint8_t* Aligned64(std::vector<uint8_t>& buf, size_t bytes) {
  buf.resize(bytes + 64);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - at % 64) % 64);
}

// Rows of W per chunk when `live` rows of x meet an (n, w_row) matrix.
int64_t ChunkRows(int64_t n, size_t w_row, int64_t live, bool wide) {
  if (live == 1) {
    // One row streams W from memory: each thread's chunks should be long runs of W, so the
    // hardware prefetchers keep streaming: 16-row chunks taken in turn by two threads cost a
    // 1B model's decode 25% (bench/NOTES.md, "Decode on a ~1B model"). Two chunks per thread
    // still let the caller take over the chunks of a helper that starts late.
    const int64_t per = (n + 2 * Threads() - 1) / (2 * Threads());
    return std::max(kRowsPerChunk, (per + kRowsPerChunk - 1) / kRowsPerChunk * kRowsPerChunk);
  }
  if (wide) {
    // Several rows: each chunk of W is read once and stays in cache while every group of x's
    // rows passes over it, so x (MBs for a long prefill chunk) is re-read once per chunk; a
    // chunk of about kChunkBytes keeps that traffic small and W within a core's L2.
    const int64_t rows_fit = kChunkBytes / static_cast<int64_t>(w_row);
    const int64_t most = std::max<int64_t>(1, n / (2 * Threads()));  // two chunks per thread
    return std::max(kRowsPerChunk, std::min(rows_fit, most) / kRowsPerChunk * kRowsPerChunk);
  }
  return kRowsPerChunk;
}

// `rows` (M,): a zero entry skips that row of x, whose row of y is zeros (a padded
// token of a prefill chunk, an idle slot of a batch).
ffi::Error MatmulRows(const char* kTarget, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      const int32_t* rows, ffi::ResultBuffer<ffi::F32> y, int32_t type) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return Fail(kTarget, "expected x (M, K), w (N, row_bytes) and y (M, N), found ranks " +
                             std::to_string(xd.size()) + ", " + std::to_string(wd.size()) +
                             ", " + std::to_string(yd.size()));
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  size_t w_row = 0;
  if (ffi::Error e = CheckWeights(kTarget, type, k, n, wd[1], &w_row); e.failure()) return e;
  if (yd[0] != m || yd[1] != n) {
    return Fail(kTarget, "y is (" + std::to_string(yd[0]) + ", " + std::to_string(yd[1]) +
                             "), expected (" + std::to_string(m) + ", " + std::to_string(n) +
                             ")");
  }
  Activations act;
  if (ffi::Error e = GetActivations(kTarget, type, k, &act); e.failure()) return e;
  if (m == 0 || n == 0) return ffi::Error::Success();

  // x's live rows; the others' rows of y are zeros.
  thread_local std::vector<int64_t> live_rows;  // reused across calls on this thread
  live_rows.clear();
  for (int64_t i = 0; i < m; ++i) {
    if (rows[i] != 0) {
      live_rows.push_back(i);
    } else {
      std::fill(y->typed_data() + i * n, y->typed_data() + (i + 1) * n, 0.0f);
    }
  }
  const int64_t live = static_cast<int64_t>(live_rows.size());
  if (live == 0) return ffi::Error::Success();

  // x in the dot product's activation type (or as is, when that is F32).
  thread_local std::vector<uint8_t> xq_buf;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(x.typed_data());
  if (act.from_float != nullptr) {
    xq_buf.resize(act.row * static_cast<size_t>(m));
    for (int64_t i : live_rows) {
      act.Quantize(x.typed_data() + i * k, xq_buf.data() + i * act.row, k);
    }
    xq = xq_buf.data();
  }

  thread_local std::vector<uint8_t> wx_buf;
  const jaxdist_wide::WideKernel* wide = act.wide;
  uint8_t* wx = nullptr;
  size_t wx_row = 0;
  if (wide != nullptr) {
    wx_row = wide->row_bytes(k);
    wx = Aligned64(wx_buf, wx_row * static_cast<size_t>(live));
    for (int64_t j = 0; j < live; ++j) {
      wide->relayout(xq + live_rows[j] * act.row, wx + j * wx_row, k);
    }
  }

  auto job = std::make_shared<Job>();
  job->chunk_rows = ChunkRows(n, w_row, live, wide != nullptr);
  job->chunks = (n + job->chunk_rows - 1) / job->chunk_rows;
  job->wide = wide;
  job->wx = wx;
  job->wx_row = wx_row;
  job->live_rows = live_rows.data();
  job->n_live = live;
  job->n = n;
  job->k = k;
  job->w = w.typed_data();
  job->w_row = w_row;
  job->xq = xq;
  job->xq_row = act.row;
  job->y = y->typed_data();
  job->dot = act.dot;
  const int64_t bytes = n * static_cast<int64_t>(w_row);
  Run(job, live > 1 ? live * n * k >= kMinSplitWorkRows : bytes >= kMinSplitBytes);
  return ffi::Error::Success();
}

// Mixture of experts: y[t, s] = x_row . W_e^T for e = ids[t, s], W (E, N, row_bytes) the
// experts' matrices as the GGUF stores them. x_row is x[t] when x has T rows (gate/up: a token
// meets each of its experts) or x[t * S + s] when it has T * S (down: one row per chosen
// expert). A negative id gives a row of zeros. The pairs are sorted by expert (counting sort),
// so each chosen expert's rows of W are read once for all the rows that chose it, S at a time
// through the wide multi-row products; one job's work items are (chosen expert, chunk of its N
// rows), so a decode step's few experts split across threads, and unchosen experts are never
// read. Each x row is quantized at most once, as MatmulRows does: the same results per row.
ffi::Error MoeMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids,
                     ffi::ResultBuffer<ffi::F32> y, int32_t type) {
  constexpr const char* kTarget = "jaxdist_ggml_moe_matmul_v1";
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto id = ids.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || id.size() != 2 || yd.size() != 3) {
    return Fail(kTarget, "expected x (R, K), w (E, N, row_bytes), ids (T, S) and y (T, S, N), "
                         "found ranks " + std::to_string(xd.size()) + ", " +
                             std::to_string(wd.size()) + ", " + std::to_string(id.size()) +
                             ", " + std::to_string(yd.size()));
  }
  const int64_t r_x = xd[0], k = xd[1], n_e = wd[0], n = wd[1], t_n = id[0], s_n = id[1];
  size_t w_row = 0;
  if (ffi::Error e = CheckWeights(kTarget, type, k, n, wd[2], &w_row); e.failure()) return e;
  if (yd[0] != t_n || yd[1] != s_n || yd[2] != n) {
    return Fail(kTarget, "y is (" + std::to_string(yd[0]) + ", " + std::to_string(yd[1]) +
                             ", " + std::to_string(yd[2]) + "), expected (" +
                             std::to_string(t_n) + ", " + std::to_string(s_n) + ", " +
                             std::to_string(n) + ")");
  }
  const int64_t pairs = t_n * s_n;
  if (r_x != t_n && r_x != pairs) {
    return Fail(kTarget, "x has " + std::to_string(r_x) + " rows, expected T = " +
                             std::to_string(t_n) + " (one per token) or T * S = " +
                             std::to_string(pairs) + " (one per chosen expert)");
  }
  Activations act;
  if (ffi::Error e = GetActivations(kTarget, type, k, &act); e.failure()) return e;

  // Counting sort of the (t, s) pairs by expert: start[e] .. start[e + 1] in the sorted order.
  const int32_t* idv = ids.typed_data();
  thread_local std::vector<int64_t> start;  // reused across calls on this thread
  start.assign(static_cast<size_t>(n_e) + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (idv[p] >= n_e) {
      return Fail(kTarget, "ids[" + std::to_string(p / s_n) + ", " + std::to_string(p % s_n) +
                               "] = " + std::to_string(idv[p]) + " is not an expert: w holds " +
                               std::to_string(n_e) + " (E)");
    }
    if (idv[p] >= 0) ++start[idv[p] + 1];
  }
  for (int64_t e = 0; e < n_e; ++e) start[e + 1] += start[e];
  const int64_t live = start[n_e];
  thread_local std::vector<int64_t> y_rows, x_rows, fill;
  y_rows.resize(live);
  x_rows.resize(live);
  fill.assign(start.begin(), start.end() - 1);
  float* yv = y->typed_data();
  for (int64_t p = 0; p < pairs; ++p) {
    if (idv[p] < 0) {
      std::fill(yv + p * n, yv + (p + 1) * n, 0.0f);
      continue;
    }
    const int64_t at = fill[idv[p]]++;
    y_rows[at] = p;
    x_rows[at] = r_x == pairs ? p : p / s_n;
  }
  if (live == 0 || n == 0) return ffi::Error::Success();

  // The x rows some pair uses, each quantized once.
  thread_local std::vector<uint8_t> xq_buf, used;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(x.typed_data());
  if (act.from_float != nullptr) {
    xq_buf.resize(act.row * static_cast<size_t>(r_x));
    used.assign(static_cast<size_t>(r_x), 0);
    for (int64_t i : x_rows) {
      if (used[i]) continue;
      used[i] = 1;
      act.Quantize(x.typed_data() + i * k, xq_buf.data() + i * act.row, k);
    }
    xq = xq_buf.data();
  }
  // The wide kernels take each expert's rows one after another: rearranged in sorted order (a
  // token's row once per expert it chose).
  thread_local std::vector<uint8_t> wx_buf;
  uint8_t* wx = nullptr;
  size_t wx_row = 0;
  if (act.wide != nullptr) {
    wx_row = act.wide->row_bytes(k);
    wx = Aligned64(wx_buf, wx_row * static_cast<size_t>(live));
    for (int64_t j = 0; j < live; ++j) {
      act.wide->relayout(xq + x_rows[j] * act.row, wx + j * wx_row, k);
    }
  }

  // Work items: each chosen expert's N rows in chunks sized as MatmulRows sizes them for its
  // number of rows.
  thread_local std::vector<MoePart> parts;
  parts.clear();
  int64_t bytes = 0;
  bool one_each = true;  // every chosen expert has one row: bound by reading W (decode)
  for (int64_t e = 0; e < n_e; ++e) {
    const int64_t rows_e = start[e + 1] - start[e];
    if (rows_e == 0) continue;
    const uint8_t* we = w.typed_data() + e * n * static_cast<int64_t>(w_row);
    const int64_t cr = ChunkRows(n, w_row, rows_e, act.wide != nullptr);
    for (int64_t n0 = 0; n0 < n; n0 += cr) {
      parts.push_back({we, n0, std::min(n, n0 + cr), start[e], start[e + 1]});
    }
    bytes += n * static_cast<int64_t>(w_row);
    one_each = one_each && rows_e == 1;
  }

  auto job = std::make_shared<Job>();
  job->parts = parts.data();
  job->chunks = static_cast<int64_t>(parts.size());
  job->wide = act.wide;
  job->wx = wx;
  job->wx_row = wx_row;
  job->live_rows = y_rows.data();
  job->x_rows = x_rows.data();
  job->n = n;
  job->k = k;
  job->w_row = w_row;
  job->xq = xq;
  job->xq_row = act.row;
  job->y = yv;
  job->dot = act.dot;
  Run(job, one_each ? bytes >= kMinSplitBytes : live * n * k >= kMinSplitWorkRows);
  return ffi::Error::Success();
}

ffi::Error MatmulMasked(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t type) {
  constexpr const char* kTarget = "jaxdist_ggml_matmul_v2";
  if (x.dimensions().size() != 2 ||
      rows.element_count() != static_cast<size_t>(x.dimensions()[0])) {
    return Fail(kTarget, "rows must hold one entry per row of x");
  }
  return MatmulRows(kTarget, x, w, rows.typed_data(), y, type);
}

// y[N, K] = W in float32: for products of many rows, XLA's f32 dot after this beats
// quantizing activations (ops.KERNEL_MAX_ROWS). The activations x (M, K) are a first operand
// that is only checked, never read: it makes each dequantization wait for its layer's input, so
// XLA cannot schedule every layer's at the start of a stage and hold them all in float32 at once.
ffi::Error Dequantize(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> y, int32_t type) {
  constexpr const char* kTarget = "jaxdist_ggml_dequantize_v2";
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[1] != yd[1]) {
    return Fail(kTarget, "expected x (M, K) and y (N, K) with the same K");
  }
  if (wd.size() != 2 || yd[0] != wd[0]) {
    return Fail(kTarget, "expected w (N, row_bytes) and y (N, K) with the same N");
  }
  const int64_t n = wd[0], k = yd[1];
  size_t w_row = 0;
  if (ffi::Error e = CheckWeights(kTarget, type, k, n, wd[1], &w_row); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();
  const ggml_type_traits* tt = ggml_get_type_traits(static_cast<ggml_type>(type));
  if (tt->to_float == nullptr) {
    return Fail(kTarget, std::string("ggml cannot dequantize ") + tt->type_name);
  }
  auto job = std::make_shared<Job>();
  job->chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  job->n = n;
  job->k = k;
  job->w = w.typed_data();
  job->w_row = w_row;
  job->y = y->typed_data();
  job->to_float = tt->to_float;
  Run(job, n * k * 8 >= kMinSplitWork);  // an element costs about as much as 8 MACs
  return ffi::Error::Success();
}

// The wide kernels run where the CPU has their ISA and ggml's activation blocks are the ones
// wide_simple.cc and wide_kquants.cc read (a libggml that changed them keeps ggml's vec_dot).
bool WideUsable() {
  if (!jaxdist_wide::WideIsaSupported()) return false;
  const struct { ggml_type w, x; size_t x_bytes; } expect[] = {
      {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, 34}, {GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 34},
      {GGML_TYPE_Q4_1, GGML_TYPE_Q8_1, 36}, {GGML_TYPE_Q4_K, GGML_TYPE_Q8_K, 292},
      {GGML_TYPE_Q6_K, GGML_TYPE_Q8_K, 292}};
  for (const auto& e : expect) {
    const ggml_type_traits_cpu* ct = ggml_get_type_traits_cpu(e.w);
    if (ct == nullptr || ct->vec_dot_type != e.x ||
        ggml_get_type_traits(e.x)->type_size != e.x_bytes) {
      return false;
    }
  }
  return true;
}

// JAXDIST_KERNELS_ISA=ggml (or avx2) keeps ggml's dot products on a CPU that has the wide ones.
bool ForcedGgml() {
  const char* isa = std::getenv("JAXDIST_KERNELS_ISA");
  return isa != nullptr && (std::strcmp(isa, "ggml") == 0 || std::strcmp(isa, "avx2") == 0);
}

}  // namespace

namespace jaxdist_pool {

int64_t Threads() { return ::Threads(); }

bool HelpersAwake() { return TheHelpers().Awake(); }

void ParallelFor(int64_t n, int64_t per_chunk, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  auto job = std::make_shared<Job>();
  job->n = n;
  job->chunk_rows = std::max<int64_t>(1, per_chunk);
  job->chunks = (n + job->chunk_rows - 1) / job->chunk_rows;
  job->range = &fn;
  Run(job, true);
}

}  // namespace jaxdist_pool

#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistGgmlMatmulV2, MatmulMasked,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("ggml_type"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistGgmlMoeMatmulV1, MoeMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("ggml_type"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistGgmlDequantizeV2, Dequantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("ggml_type"));
#pragma GCC visibility pop

JAXDIST_EXPORT int jaxdist_kernels_abi_version() { return kAbiVersion; }

JAXDIST_EXPORT void jaxdist_kernels_set_threads(int n) { g_threads.store(n < 0 ? 0 : n); }

// 0 when the kernels can run here; otherwise 1, with the reason in `err`.
JAXDIST_EXPORT int jaxdist_kernels_init(char* err, int err_len) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::snprintf(err, err_len,
                  "this CPU lacks AVX2/FMA, which the libggml-python wheel's CPU kernels use");
    return 1;
  }
#endif
  ggml_cpu_init();
  g_wide.store(WideUsable() && !ForcedGgml());
  jaxdist_attention::SetWide(!ForcedGgml());
  return 0;
}

// The dot products in use: "avx512vnni" (wide.h) or "ggml" (the wheel's vec_dot). Attention
// (attention.cc) has its own wide path, AVX-512F only, that the same switches turn on and off.
JAXDIST_EXPORT const char* jaxdist_kernels_isa() { return g_wide.load() ? "avx512vnni" : "ggml"; }

// Switches between them (1: wide, where this CPU has it; 0: ggml); returns the ISA in use. The
// tests check both against the same reference in one process.
JAXDIST_EXPORT const char* jaxdist_kernels_set_isa(int wide) {
  g_wide.store(wide != 0 && WideUsable());
  jaxdist_attention::SetWide(wide != 0);
  return jaxdist_kernels_isa();
}

// Threads per call when set_threads was given 0: the CPUs of this process (CpuBudget).
// For the tests: `x` (k floats, k a multiple of 256) quantized to Q8_K by ggml's own
// from_float into `ref`, and by the wide kernels' QuantizeRowQ8K into `own` (292 bytes per 256
// floats each). Returns 1, or 0 where this CPU lacks the wide kernels (`own` not written).
JAXDIST_EXPORT int jaxdist_kernels_quantize_q8_k(const float* x, uint8_t* own, uint8_t* ref,
                                                 int64_t k) {
  ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x, ref, k);
  if (!WideUsable()) return 0;
  jaxdist_wide::QuantizeRowQ8K(x, own, k);
  return 1;
}

JAXDIST_EXPORT int jaxdist_kernels_default_threads() { return static_cast<int>(CpuBudget()); }

// Comma-separated GGML type names the handler accepts, for Info.
JAXDIST_EXPORT const char* jaxdist_kernels_types() {
  static std::string names = [] {
    std::string s;
    for (int t : kTypes) {
      if (!s.empty()) s += ",";
      s += ggml_type_name(static_cast<ggml_type>(t));
    }
    return s;
  }();
  return names.c_str();
}
