// baro_jax: the host ring that drives baro_fetch_experts (tier decode's miss copies by the copy
// engines). The Python side (custom_calls/fetch.py) owns the ring, a host int64 array:
//   header  [0] consumed  runs of the op so far (the handler's own counter, bumped after a run)
//           [1] R         entries
//           [2] n_max     (expert, slot) pairs per entry
//           [3] magic     kFetchRingMagic
//   entry j at kFetchHeader + j * (kFetchEntryHead + 2 * n_max):
//           [0] seq       the run this entry is for (Python's count of calls made)
//           [1] n         pairs in it
//           [2] E         experts in the store
//           [3] gate_up   address of the store's gate_up [E, 2I, D] (pinned host memory)
//           [4] down      address of the store's down [E, D, I]
//           [5 + 2p], [6 + 2p]  expert, slot of pair p
// The k-th run of the op reads entry k mod R and checks its seq is k, so an entry Python has not
// written (or one it skipped) fails the call instead of copying the wrong expert. Python never
// writes entry k + R before `consumed` passes k: runs may trail the calls (async dispatch).
// Host code only: the ids must be on the host for a copy-engine copy to be issued at all.
#pragma once

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace baro {

constexpr int64_t kFetchRingMagic = 0x62617266657463LL;  // "barfetc"
constexpr int64_t kFetchHeader = 4, kFetchEntryHead = 5;

struct FetchPlan {
  int64_t n = 0, E = 0, S = 0;
  const uint8_t* gate_up = nullptr;  // the store (host addresses)
  const uint8_t* down = nullptr;
  const int64_t* pairs = nullptr;    // 2 n: expert, slot
  int64_t gu_bytes = 0, dn_bytes = 0;  // one expert's
  std::atomic<int64_t>* consumed = nullptr;
};

// Reads and checks this run's entry against the pools (bf16 [S, 2I, D] and [S, D, I]).
template <class Buf>
inline ::xla::ffi::Error read_fetch_ring(int64_t ring, const Buf& pool_gu, const Buf& pool_dn, FetchPlan& p) {
  const char* op = "baro_fetch_experts";
  auto fail = [&](const std::string& why) {
    return ::xla::ffi::Error::InvalidArgument(std::string(op) + ": " + why);
  };
  if (ring == 0) return fail("ring must be the address of a FetchRing (custom_calls.fetch)");
  int64_t* h = reinterpret_cast<int64_t*>(ring);
  if (h[3] != kFetchRingMagic) return fail("ring does not point at a FetchRing (bad magic)");
  const int64_t R = h[1], n_max = h[2];
  auto gd = pool_gu.dimensions(), dd = pool_dn.dimensions();
  if (gd.size() != 3 || dd.size() != 3 || gd[0] != dd[0] || gd[0] < 1)
    return fail("the pools must be [S, 2I, D] and [S, D, I] with the same S >= 1");
  auto* consumed = reinterpret_cast<std::atomic<int64_t>*>(&h[0]);
  const int64_t k = consumed->load(std::memory_order_acquire);
  const int64_t* e = h + kFetchHeader + (k % R) * (kFetchEntryHead + 2 * n_max);
  if (e[0] != k) {
    std::ostringstream s;
    s << "ring entry for run " << k << " holds run " << e[0]
      << " (the calls and the ring are out of step: a call whose entry was not written?)";
    return fail(s.str());
  }
  p.n = e[1];
  p.E = e[2];
  p.S = gd[0];
  if (p.n < 0 || p.n > n_max) return fail("an entry's pair count is outside [0, n_max]");
  if (e[3] == 0 || e[4] == 0) return fail("an entry's store addresses must be set");
  p.gate_up = reinterpret_cast<const uint8_t*>(e[3]);
  p.down = reinterpret_cast<const uint8_t*>(e[4]);
  p.pairs = e + kFetchEntryHead;
  for (int64_t i = 0; i < p.n; ++i) {
    if (p.pairs[2 * i] < 0 || p.pairs[2 * i] >= p.E || p.pairs[2 * i + 1] < 0 || p.pairs[2 * i + 1] >= p.S) {
      std::ostringstream s;
      s << "pair " << i << ": expert " << p.pairs[2 * i] << " (E=" << p.E << ") into slot " << p.pairs[2 * i + 1]
        << " (S=" << p.S << ") is out of range";
      return fail(s.str());
    }
  }
  p.gu_bytes = 2 * gd[1] * gd[2];
  p.dn_bytes = 2 * dd[1] * dd[2];
  p.consumed = consumed;
  return ::xla::ffi::Error::Success();
}

}  // namespace baro
