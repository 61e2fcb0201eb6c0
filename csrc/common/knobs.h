// baro_jax kernel library: the one reader of its BARO_* environment knobs.
//
// Every knob the C++ code reads is a row of kKnobs below (custom_calls/knobs.py holds the same
// table with a line on what each does; tests/test_knobs.py checks the two agree and that no
// getenv in csrc reads anything else). Knobs are speed or test switches: none changes the bits,
// except BARO_DELTA_BLOCKED_MMA, which picks the blocked delta rule's arithmetic (opt-in, its own
// bits; prefill and decode agree under either setting, so a run keeps one from its first token).
// They are read on every call, not once, because the kernel tests switch them between calls.
// BARO_DELTA_BLOCKED_MMA also changes how many kernels a call launches (two against one): a
// graph XLA captured into a CUDA command buffer under one setting cannot be updated to the other
// (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE), so a process that switches it clears jax's caches.
//
// Parsing is strict: an on/off knob takes 1/0, true/false, on/off, yes/no (any case), a choice
// knob one of its listed words, an integer knob a decimal integer in its range; empty counts as
// unset. A value outside the allowed set gives the default for this call and is recorded; the
// FFI handlers (KnobChecked in ffi_util.h) then fail the call with InvalidArgument naming the
// variable and what it allows. The launchers below the handlers cannot return an FFI error,
// which is why the error waits in a per-thread slot instead of being returned by the reader.
//
// Framework-free (std only) so that the GPU launchers (launch.h) can include it.
#pragma once

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

namespace baro {
namespace knobs {

enum class Kind { kOnOff, kChoice, kInt };

struct Knob {
  const char* name;
  Kind kind;
  const char* choices;  // kChoice: the allowed words, '|'-separated, the default first
  int lo, hi;           // kInt: the allowed range
  int dflt;             // kOnOff: 0/1; kChoice: 0 (the first word); kInt: the default (kCpuThreads: 0 = the hardware's)
};

enum Id : int {
  kCpuThreads,
  kAttnDup,
  kAttnWgmma,
  kAttnPipe,
  kMoeFold,
  kMoeTail,
  kMoeHost,
  kNormGeneric,
  kNormRowBlock,
  kDeltaCols,
  kDeltaOne,
  kDeltaKv,
  kDeltaStage,
  kDeltaBlockedMma,
  kGemmTile,
  kGemmSmall,
  kGemmRow1,
  kGemmWgmma,
  kGemmWgmmaGrouped,
  kGemmWgmmaRing,
  kGemmWgmmaBn,
  kGemmWgmmaPersist,
  kRows16Ring,
  kRows16Warps,
  kRows16Tall,
  kRows16Persist,
  kPipeRing,
  kPipeOrder,
  kPdl,
  kRow1Bps,
  kRow1Kchunk,
  kRow1Stages,
  kRow1Nt,
  kRow1Copy,
  kRow1Ashared,
  kRow1Tma,
  kRow1Swap,
  kMoeRouteGroup,
  kMoePairs16,
  kMoeCombineWide,
  kCount
};

// The largest BARO_CPU_THREADS accepted; ffi_util.h's cpu_threads() also caps the count it
// uses at kCpuThreadsPerCore x the hardware threads.
constexpr int kCpuThreadsMax = 4096;
constexpr int kCpuThreadsPerCore = 4;

// name, kind, choices, lo, hi, default. Keep in step with custom_calls/knobs.py (tested).
inline constexpr Knob kKnobs[kCount] = {
    {"BARO_CPU_THREADS", Kind::kInt, nullptr, 1, kCpuThreadsMax, 0},
    {"BARO_ATTN_DUP", Kind::kOnOff, nullptr, 0, 0, 0},
    {"BARO_ATTN_WGMMA", Kind::kChoice, "1|0|require", 0, 0, 0},
    {"BARO_ATTN_PIPE", Kind::kChoice, "1|0|2", 0, 0, 0},
    {"BARO_MOE_FOLD", Kind::kOnOff, nullptr, 0, 0, 1},
    {"BARO_MOE_TAIL", Kind::kChoice, "1|0|combine", 0, 0, 0},
    {"BARO_MOE_HOST", Kind::kChoice, "staged|direct", 0, 0, 0},
    {"BARO_NORM_GENERIC", Kind::kOnOff, nullptr, 0, 0, 0},
    {"BARO_NORM_ROW_BLOCK", Kind::kOnOff, nullptr, 0, 0, 1},
    {"BARO_DELTA_COLS", Kind::kChoice, "32|16", 0, 0, 0},
    {"BARO_DELTA_ONE", Kind::kChoice, "auto|cols|heads|pipe|off", 0, 0, 0},
    {"BARO_DELTA_KV", Kind::kChoice, "butterfly|gather|two", 0, 0, 0},
    {"BARO_DELTA_STAGE", Kind::kChoice, "fixed|index", 0, 0, 0},
    {"BARO_DELTA_BLOCKED_MMA", Kind::kOnOff, nullptr, 0, 0, 0},
    {"BARO_GEMM_TILE", Kind::kChoice, "auto|16|simple|64|128", 0, 0, 0},
    {"BARO_GEMM_SMALL", Kind::kChoice, "auto|stream|rows16|simple", 0, 0, 0},
    {"BARO_GEMM_ROW1", Kind::kOnOff, nullptr, 0, 0, 1},
    {"BARO_GEMM_WGMMA", Kind::kChoice, "1|0|require", 0, 0, 0},
    {"BARO_GEMM_WGMMA_GROUPED", Kind::kChoice, "auto|0|down|sorted", 0, 0, 0},
    {"BARO_GEMM_WGMMA_RING", Kind::kChoice, "4|3", 0, 0, 0},
    {"BARO_GEMM_WGMMA_BN", Kind::kChoice, "auto|128|256|grouped|plain", 0, 0, 0},
    {"BARO_GEMM_WGMMA_PERSIST", Kind::kChoice, "0|1|3", 0, 0, 0},
    {"BARO_ROWS16_RING", Kind::kChoice, "auto|deep|light", 0, 0, 0},
    {"BARO_ROWS16_WARPS", Kind::kChoice, "auto|4|2|1", 0, 0, 0},
    {"BARO_ROWS16_TALL", Kind::kChoice, "off|on", 0, 0, 0},
    {"BARO_ROWS16_PERSIST", Kind::kChoice, "0|1|require", 0, 0, 0},
    {"BARO_PIPE_RING", Kind::kChoice, "auto|deep|shallow", 0, 0, 0},
    {"BARO_PIPE_ORDER", Kind::kChoice, "auto|rows|cols", 0, 0, 0},
    {"BARO_PDL", Kind::kOnOff, nullptr, 0, 0, 0},
    {"BARO_ROW1_BPS", Kind::kInt, nullptr, 1, 8, 3},
    {"BARO_ROW1_KCHUNK", Kind::kInt, nullptr, 128, 4096, 2048},
    {"BARO_ROW1_STAGES", Kind::kInt, nullptr, 2, 16, 2},
    {"BARO_ROW1_NT", Kind::kInt, nullptr, 0, 4, 0},
    {"BARO_ROW1_COPY", Kind::kChoice, "bulk|lsu", 0, 0, 0},
    {"BARO_ROW1_ASHARED", Kind::kChoice, "0|1|require", 0, 0, 0},
    {"BARO_ROW1_TMA", Kind::kChoice, "0|1|require", 0, 0, 0},
    {"BARO_ROW1_SWAP", Kind::kChoice, "0|1|require", 0, 0, 0},
    {"BARO_MOE_ROUTE_GROUP", Kind::kChoice, "0|1|require", 0, 0, 0},
    {"BARO_MOE_PAIRS16", Kind::kOnOff, nullptr, 0, 0, 1},
    {"BARO_MOE_COMBINE_WIDE", Kind::kOnOff, nullptr, 0, 0, 1},
};

inline bool same_word(const char* s, const char* w, size_t n) {
  if (std::strlen(s) != n) return false;
  for (size_t i = 0; i < n; ++i)
    if (std::tolower(static_cast<unsigned char>(s[i])) != std::tolower(static_cast<unsigned char>(w[i]))) return false;
  return true;
}

// The index of word s among a '|'-separated list (exact spelling), or -1.
inline int choice_index(const char* list, const char* s) {
  int i = 0;
  for (const char* p = list;; ++i) {
    const char* bar = std::strchr(p, '|');
    const size_t n = bar ? static_cast<size_t>(bar - p) : std::strlen(p);
    if (std::strlen(s) == n && std::strncmp(p, s, n) == 0) return i;
    if (!bar) return -1;
    p = bar + 1;
  }
}

// s parsed as knob k: true and *out set when s is allowed.
inline bool parse(const Knob& k, const char* s, int* out) {
  switch (k.kind) {
    case Kind::kOnOff:
      for (const char* w : {"1", "true", "on", "yes"})
        if (same_word(s, w, std::strlen(w))) return *out = 1, true;
      for (const char* w : {"0", "false", "off", "no"})
        if (same_word(s, w, std::strlen(w))) return *out = 0, true;
      return false;
    case Kind::kChoice: {
      const int i = choice_index(k.choices, s);
      if (i < 0) return false;
      return *out = i, true;
    }
    case Kind::kInt: {
      const char* p = s;
      if (*p == '+' || *p == '-') ++p;
      if (*p == '\0') return false;
      for (const char* q = p; *q; ++q)
        if (!std::isdigit(static_cast<unsigned char>(*q))) return false;
      errno = 0;
      const long long v = std::strtoll(s, nullptr, 10);
      if (errno == ERANGE || v < k.lo || v > k.hi) return false;
      return *out = static_cast<int>(v), true;
    }
  }
  return false;
}

// What knob k allows, for messages.
inline std::string allowed(const Knob& k) {
  switch (k.kind) {
    case Kind::kOnOff: return "on or off (one of 1/true/on/yes or 0/false/off/no)";
    case Kind::kChoice: {
      std::string s = "one of ";
      for (const char* p = k.choices; *p; ++p) s += *p == '|' ? std::string(", ") : std::string(1, *p);
      return s;
    }
    case Kind::kInt: return "an integer in [" + std::to_string(k.lo) + ", " + std::to_string(k.hi) + "]";
  }
  return "";
}

inline std::string bad_value_message(const Knob& k, const char* got) {
  return std::string(k.name) + " must be " + allowed(k) + ", got '" + got + "'";
}

// The first knob a reader found outside its allowed set since the slot was last taken.
inline thread_local std::string t_bad;

inline void clear_error() { t_bad.clear(); }

// Moves the recorded error into *msg (true) or says there was none (false).
inline bool take_error(std::string* msg) {
  if (t_bad.empty()) return false;
  *msg = t_bad;
  t_bad.clear();
  return true;
}

// Knob `id`'s value for this call: its parse, or the default when unset, empty or not allowed
// (and then the error is recorded for the handler).
inline int get(Id id) {
  const Knob& k = kKnobs[id];
  const char* s = std::getenv(k.name);
  if (s == nullptr || *s == '\0') return k.dflt;
  int v = 0;
  if (parse(k, s, &v)) return v;
  if (t_bad.empty()) t_bad = bad_value_message(k, s);
  return k.dflt;
}

inline bool on(Id id) { return get(id) != 0; }

// The value get() gives for choice knob `id` set to `word` (-1: not one of its words).
inline int word(Id id, const char* w) { return choice_index(kKnobs[id].choices, w); }

// Choice knob `id` is set to `word` (one of its choices; the default counts when unset).
inline bool is(Id id, const char* word) {
  const int want = choice_index(kKnobs[id].choices, word);
  return want >= 0 && get(id) == want;
}

}  // namespace knobs
}  // namespace baro
