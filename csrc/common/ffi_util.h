// baro_jax: small helpers for the FFI handlers (validation, threading, knob errors).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "knobs.h"
#include "xla/ffi/api/ffi.h"

namespace baro {

namespace ffi = xla::ffi;

template <class Dims>
inline std::string dims_str(const Dims& d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

inline std::string shape_str(std::initializer_list<int64_t> d) {
  std::vector<int64_t> v(d);
  return dims_str(v);
}

// Checks that `buf` has exactly the expected shape; returns an error message
// "op: name must have shape [..], got [..]" or "" when fine.
template <class Buf>
inline std::string expect_shape(const char* op, const char* name, const Buf& buf,
                                std::initializer_list<int64_t> expected) {
  auto d = buf.dimensions();
  bool ok = d.size() == expected.size();
  if (ok) {
    size_t i = 0;
    for (int64_t e : expected) ok = ok && d[i++] == e;
  }
  if (ok) return "";
  std::ostringstream s;
  s << op << ": " << name << " must have shape " << shape_str(expected)
    << ", got " << dims_str(d);
  return s.str();
}

template <class Buf>
inline std::string expect_rank(const char* op, const char* name, const Buf& buf,
                               size_t rank) {
  auto d = buf.dimensions();
  if (d.size() == rank) return "";
  std::ostringstream s;
  s << op << ": " << name << " must have rank " << rank << ", got shape "
    << dims_str(d);
  return s.str();
}

// A norm's eps attribute: finite and >= 0 (a NaN or negative one gives NaN rows, or a
// negative mean square's root, without a word). "" when fine.
inline std::string expect_eps(const char* op, float eps) {
  if (std::isfinite(eps) && eps >= 0.0f) return "";
  std::ostringstream s;
  s << op << ": eps must be a finite number >= 0, got " << eps;
  return s.str();
}

#define BARO_RETURN_IF(msg_expr)                                   \
  do {                                                             \
    std::string _baro_msg = (msg_expr);                            \
    if (!_baro_msg.empty())                                        \
      return ::xla::ffi::Error::InvalidArgument(_baro_msg);        \
  } while (0)

#define BARO_CHECK(cond, op, what)                                      \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::ostringstream _baro_s;                                       \
      _baro_s << op << ": " << what;                                    \
      return ::xla::ffi::Error::InvalidArgument(_baro_s.str());         \
    }                                                                   \
  } while (0)

// Copies operand -> aliased result when XLA did not alias them (it does when
// input_output_aliases is set; this keeps the handler correct regardless).
template <class Arg, class Ret>
inline void copy_if_not_aliased(const Arg& arg, Ret& ret) {
  if (arg.untyped_data() != ret->untyped_data()) {
    std::memcpy(ret->untyped_data(), arg.untyped_data(), arg.size_bytes());
  }
}

// Number of worker threads for CPU kernels: BARO_CPU_THREADS (knobs.h, read per call) or the
// hardware's, at most kCpuThreadsPerCore x the hardware threads: more only adds thread starts.
inline int cpu_threads() {
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int v = knobs::get(knobs::kCpuThreads);
  return v <= 0 ? hw : std::min(v, knobs::kCpuThreadsPerCore * hw);
}

// Runs fn(begin, end) over [0, n) split into contiguous chunks on a few
// threads. Each index is handled by exactly one call and the arithmetic per
// index never depends on the split, so results are identical for any thread
// count. `cost` is a rough amount of work per index (in fma), used to avoid
// spawning threads for tiny calls. A thread that cannot be started (the process's thread
// limit, memory) is not an error: its chunks run on the calling thread, with the same bits.
template <class Fn>
inline void parallel_for(int64_t n, double cost, Fn fn) {
  if (n <= 0) return;
  int64_t t = cpu_threads();
  const double min_work = 2.0e5;  // fma per thread worth the spawn
  t = std::min<int64_t>(t, static_cast<int64_t>(n * cost / min_work));
  t = std::min<int64_t>(t, n);
  if (t <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + t - 1) / t;
  std::vector<std::thread> workers;
  int64_t w = 1;  // the first chunk no worker runs
  try {
    workers.reserve(t - 1);
    for (; w < t && w * chunk < n; ++w) {
      const int64_t b = w * chunk, e = std::min(n, b + chunk);
      workers.emplace_back([=] { fn(b, e); });
    }
  } catch (const std::exception&) {  // std::system_error (no thread), std::bad_alloc
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (; w < t && w * chunk < n; ++w) fn(w * chunk, std::min(n, (w + 1) * chunk));
  for (auto& th : workers) th.join();
}

// A handler Impl that fails with InvalidArgument when a knob it read (knobs.h) held a value
// outside its allowed set: XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, baro::KnobChecked<Impl>::Call, ...).
// The launchers read knobs where they decide, so the check follows the Impl instead of
// preceding it; the call's results are then not used.
template <auto Impl>
struct KnobChecked;
template <class... A, ffi::Error (*Impl)(A...)>
struct KnobChecked<Impl> {
  static ffi::Error Call(A... args) {
    knobs::clear_error();
    ffi::Error e = Impl(std::forward<A>(args)...);
    std::string bad;
    if (knobs::take_error(&bad) && !e.failure()) return ffi::Error::InvalidArgument(bad);
    return e;
  }
};

}  // namespace baro
