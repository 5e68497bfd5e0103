// CPU kernel for masked GAE (jaxagent.algos.gae, method "native"), called from
// XLA through the FFI. One pass per row, backwards in time, rows split over threads.
//
// For every row (all leading dimensions flattened; time is the last axis):
//   nextvalue = 0; lastgae = 0
//   for t = T-1 .. 0, only where mask[t]:
//     lastgae   = (r[t] + gamma*nextvalue - v[t]) + gamma*lam*lastgae
//     nextvalue = v[t]
//     adv[t] = lastgae;  ret[t] = lastgae + v[t]
//   masked steps are skipped (never read) and written as 0.
// With whiten != 0, adv is then whitened in place with the batch mean and unbiased
// variance of all valid steps (accumulated in double):
//   adv[t] = (adv[t] - mean) / sqrt(var + 1e-8)      (masked_whiten of FORMULAS.md)
// This is the same recurrence as the lax.scan path in _scan.py; tests check both.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Sums {
  double n = 0.0, s1 = 0.0, s2 = 0.0;
};

void GaeRows(const float* r, const float* v, const bool* m, float* adv, float* ret,
             int64_t row_begin, int64_t row_end, int64_t T, float gamma, float gamma_lam,
             Sums* sums) {
  double n = 0.0, s1 = 0.0, s2 = 0.0;
  for (int64_t b = row_begin; b < row_end; ++b) {
    const int64_t off = b * T;
    float nextvalue = 0.0f;
    float lastgae = 0.0f;
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t i = off + t;
      if (m[i]) {
        const float delta = r[i] + gamma * nextvalue - v[i];
        lastgae = delta + gamma_lam * lastgae;
        nextvalue = v[i];
        adv[i] = lastgae;
        ret[i] = lastgae + v[i];
        n += 1.0;
        s1 += lastgae;
        s2 += static_cast<double>(lastgae) * lastgae;
      } else {
        adv[i] = 0.0f;
        ret[i] = 0.0f;
      }
    }
  }
  sums->n = n;
  sums->s1 = s1;
  sums->s2 = s2;
}

void WhitenRows(const bool* m, float* adv, int64_t row_begin, int64_t row_end, int64_t T,
                float mean, float inv_std) {
  for (int64_t i = row_begin * T; i < row_end * T; ++i) {
    if (m[i]) adv[i] = (adv[i] - mean) * inv_std;
  }
}

// Runs fn(block, row_begin, row_end) on n_threads contiguous blocks of rows.
template <typename Fn>
void ForRowBlocks(int64_t n_threads, int64_t rows, const Fn& fn) {
  std::vector<std::thread> workers;
  workers.reserve(n_threads - 1);
  const int64_t per = (rows + n_threads - 1) / n_threads;
  for (int64_t k = 1; k < n_threads; ++k) {
    const int64_t b0 = k * per, b1 = std::min(rows, b0 + per);
    if (b0 >= b1) break;
    workers.emplace_back([&fn, k, b0, b1] { fn(k, b0, b1); });
  }
  fn(0, 0, std::min(rows, per));
  for (auto& w : workers) w.join();
}

ffi::Error GaeImpl(ffi::Buffer<ffi::F32> rewards, ffi::Buffer<ffi::F32> values,
                   ffi::Buffer<ffi::PRED> mask, float gamma, float gamma_lam, int32_t whiten,
                   ffi::ResultBuffer<ffi::F32> adv, ffi::ResultBuffer<ffi::F32> ret) {
  auto dims = rewards.dimensions();
  if (dims.size() == 0) {
    return ffi::Error::InvalidArgument("gae: rewards must have a time axis");
  }
  const int64_t T = dims.back();
  const int64_t total = static_cast<int64_t>(rewards.element_count());
  if (values.element_count() != rewards.element_count() ||
      mask.element_count() != rewards.element_count()) {
    return ffi::Error::InvalidArgument("gae: rewards, values and mask differ in size");
  }
  if (T == 0 || total == 0) return ffi::Error::Success();
  const int64_t rows = total / T;
  const float* r = rewards.typed_data();
  const float* v = values.typed_data();
  const bool* m = mask.typed_data();
  float* a = adv->typed_data();
  float* o = ret->typed_data();

  // Threads only pay off above ~256k elements; never more threads than rows.
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t n_threads = std::min<int64_t>({hw, rows, std::max<int64_t>(1, total >> 18)});
  std::vector<Sums> sums(n_threads);
  ForRowBlocks(n_threads, rows, [&](int64_t k, int64_t b0, int64_t b1) {
    GaeRows(r, v, m, a, o, b0, b1, T, gamma, gamma_lam, &sums[k]);
  });
  if (!whiten) return ffi::Error::Success();

  // Batch statistics with the conventions of masked_mean / masked_var.
  double n = 0.0, s1 = 0.0, s2 = 0.0;
  for (const Sums& p : sums) {
    n += p.n;
    s1 += p.s1;
    s2 += p.s2;
  }
  const double mean = s1 / (n + 1e-8);
  const double ss = std::max(0.0, s2 - 2.0 * mean * s1 + n * mean * mean);
  const double var = ss / (n + 1e-8) * (n > 1.0 ? n / (n - 1.0) : 1.0);
  const float mean_f = static_cast<float>(mean);
  const float inv_std = static_cast<float>(1.0 / std::sqrt(var + 1e-8));
  ForRowBlocks(n_threads, rows, [&](int64_t, int64_t b0, int64_t b1) {
    WhitenRows(m, a, b0, b1, T, mean_f, inv_std);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxagentGaeF32, GaeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("gamma")
                                  .Attr<float>("gamma_lam")
                                  .Attr<int32_t>("whiten")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
