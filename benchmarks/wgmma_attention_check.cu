// The opt-in wgmma prefill attention (csrc/gpu/attention_wgmma.cu) against attn_fa_kernel
// (attention_fa.cuh) and against the decode path (one fa_launch per row, m = 1), bytes, on fresh
// random inputs, without the Python library: two translation units built with the library's own
// flags, so a call on the GPU machine builds in about a minute and answers in seconds.
//   - this file, for sm_90 like attention.cu: attn_fa_kernel (fa_launch) and the checks;
//   - csrc/gpu/attention_wgmma.cu, for sm_90a with BARO_WGMMA=1 like gpu.cmake builds it:
//     launch_attention_wgmma, linked in.
// Each case prints a JSON line: every output element's bits compared (wgmma vs default, wgmma vs
// decode, default vs decode: the last is this harness's own control), outputs poisoned first; on
// a difference the first (token, head, dim), the rows and dims that differ and the largest gap
// in bf16 units. Then timings of both kernels at the model's shape (median of device events).
// The wgmma kernel runs three times per case and per timing: its K/V by TMA (the default, hd 128
// and 256; the other head dims take the rings either way), by TMA in clusters of two CTAs that
// multicast the blocks both tiles read ("pairs", experimental), and by the cp.async rings; each
// case line names its path ("loads") and the one the launch took ("took"). WGMMA_LOADS picks
// and orders them (default "1,0,2": TMA, rings, pairs; a hang in one leaves the lines before it).
//
// Build and run (the GPU machine, ~1 min). Whole-program objects (-c), as gpu.cmake builds the
// library: with -dc the fp32 division slow paths become external calls and ptxas then waits for
// every wgmma before the next (40 WARPGROUP.DEPBAR per kernel instead of 4), so the kernel timed
// would not be the library's (the 2026-12-02 times in attn_wgmma_h200.json were built that way).
//   nvcc -O3 -std=c++17 --fmad=false -Xcompiler=-fno-fast-math -DBARO_WGMMA=1 \
//     --generate-code=arch=compute_90a,code=sm_90a -Icsrc/gpu -Icsrc/common \
//     -c csrc/gpu/attention_wgmma.cu -o /tmp/wg.o
//   nvcc -O3 -std=c++17 --fmad=false -Xcompiler=-fno-fast-math \
//     "--generate-code=arch=compute_90,code=[compute_90,sm_90]" -Icsrc/gpu -Icsrc/common \
//     -c benchmarks/wgmma_attention_check.cu -o /tmp/chk.o
//   nvcc -arch=sm_90a /tmp/wg.o /tmp/chk.o -o /tmp/wgmma_attention_check
//   /tmp/wgmma_attention_check [commit] [all|quick|time|profile] > results.jsonl
// (quick: the checks alone; time: the full-size times alone; profile: one launch of each kernel at
// the 32k chunk, for ncu: the default, then wgmma by TMA, by TMA pairs, by the rings)
// Exit status 0 only when every comparison is equal and every output element was written.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "../csrc/gpu/attention_fa.cuh"
#include "probe_host.h"

namespace baro_gpu {
bool pdl_enabled() { return false; }  // matmul.cu's, not linked here: plain launches
void attention_wgmma_set_loads(int tma);  // attention_wgmma.cu: 1 TMA, 2 TMA pairs, 0 the cp.async rings
int attention_wgmma_last_loads();         // the path the last launch took (same numbers)
}  // namespace baro_gpu

using namespace baro_gpu;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

static std::vector<float> rand_f32(std::mt19937& g, size_t n, float scale) {
  std::normal_distribution<float> N(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = N(g);
  return v;
}
// bf16 bits as an ordered integer (sign-magnitude -> two's complement), for the gap in bf16 units.
static int ord_bf16(uint16_t b) { return (b & 0x8000) ? -static_cast<int>(b & 0x7FFF) : static_cast<int>(b); }

struct Shape {
  const char* name;
  int H, Hkv, hd, R2;
};

// Device inputs of one (shape, S) pair; rows up to m_max.
struct Inputs {
  Shape sh;
  int64_t S, m_max, W;
  float *qkv, *qn, *kn, *cos, *sin;
  uint16_t *kc, *vc, *out_fa, *out_wg, *out_dec;
  int32_t *pos_rows, *scalars;  // pos0 + i per row; [pos0, n_valid, 1]
  void* scratch;
};

static Inputs make_inputs(std::mt19937& g, const Shape& sh, int64_t S, int64_t m_max) {
  Inputs in{};
  in.sh = sh;
  in.S = S;
  in.m_max = m_max;
  in.W = static_cast<int64_t>(2 * sh.H + 2 * sh.Hkv) * sh.hd;
  in.qkv = dev(rand_f32(g, m_max * in.W, 1.5f));
  in.qn = dev(rand_f32(g, sh.hd, 0.2f));
  in.kn = dev(rand_f32(g, sh.hd, 0.2f));
  in.cos = dev(rand_f32(g, m_max * sh.R2 + 1, 1.0f));
  in.sin = dev(rand_f32(g, m_max * sh.R2 + 1, 1.0f));
  in.kc = dev(rand_bf16(g, S * sh.Hkv * sh.hd, 2.0f));
  in.vc = dev(rand_bf16(g, S * sh.Hkv * sh.hd, 1.0f));
  const size_t ob = sizeof(uint16_t) * m_max * sh.H * sh.hd;
  CK(cudaMalloc(&in.out_fa, ob));
  CK(cudaMalloc(&in.out_wg, ob));
  CK(cudaMalloc(&in.out_dec, ob));
  CK(cudaMalloc(&in.pos_rows, sizeof(int32_t) * m_max));
  CK(cudaMalloc(&in.scalars, sizeof(int32_t) * 3));
  AttentionArgs one{};
  one.m = 1;
  one.S = S;
  one.H = sh.H;
  one.Hkv = sh.Hkv;
  one.hd = sh.hd;
  CK(cudaMalloc(&in.scratch, fa_scratch_bytes(one) + 256));
  return in;
}
static void free_inputs(Inputs& in) {
  for (void* p : {(void*)in.qkv, (void*)in.qn, (void*)in.kn, (void*)in.cos, (void*)in.sin, (void*)in.kc,
                  (void*)in.vc, (void*)in.out_fa, (void*)in.out_wg, (void*)in.out_dec, (void*)in.pos_rows,
                  (void*)in.scalars, in.scratch})
    CK(cudaFree(p));
}

static AttentionArgs args_for(const Inputs& in, int64_t m) {
  AttentionArgs a{};
  a.qkv = in.qkv;
  a.q_norm = in.qn;
  a.k_norm = in.kn;
  a.cos = in.cos;
  a.sin = in.sin;
  a.k_cache = in.kc;
  a.v_cache = in.vc;
  a.pos = in.scalars;
  a.n_valid = in.scalars + 1;
  a.m = m;
  a.S = in.S;
  a.H = in.sh.H;
  a.Hkv = in.sh.Hkv;
  a.hd = in.sh.hd;
  a.R2 = in.sh.R2;
  a.eps = 1e-6f;
  a.scale = 1.0f / std::sqrt(static_cast<float>(in.sh.hd));
  return a;
}

static void poison(uint16_t* p, size_t n) { CK(cudaMemset(p, 0xFF, n * sizeof(uint16_t))); }  // bf16 NaN

// The three kernels' outputs of one call: default prefill, wgmma prefill, and (rows in `dec_rows`)
// the decode path, one m = 1 call per row at its own position.
static void run_fa(const Inputs& in, int64_t m) {
  const AttentionArgs a = args_for(in, m);
  AttentionArgs b = a;
  b.out = in.out_fa;
  unsetenv("BARO_ATTN_WGMMA");
  CK(fa_launch(b, nullptr, 0));
}
static bool run_wg(const Inputs& in, int64_t m, int tma = 1) {
  attention_wgmma_set_loads(tma);
  AttentionArgs b = args_for(in, m);
  b.out = in.out_wg;
  bool ran = false;
  CK(launch_attention_wgmma(b, nullptr, 0, &ran));
  return ran;
}
static void run_decode(const Inputs& in, const std::vector<int64_t>& rows) {
  for (int64_t i : rows) {
    AttentionArgs b = args_for(in, 1);
    b.qkv = in.qkv + i * in.W;
    b.cos = in.cos + i * in.sh.R2;
    b.sin = in.sin + i * in.sh.R2;
    b.out = in.out_dec + i * in.sh.H * in.sh.hd;
    b.pos = in.pos_rows + i;
    b.n_valid = in.scalars + 2;  // 1
    CK(fa_launch(b, in.scratch, 0));
  }
}

struct Cmp {
  size_t compared = 0, differ = 0, unwritten = 0;
  long first_i = -1, first_h = -1, first_d = -1;
  int max_gap = 0;
  std::vector<long> rows, dims;  // distinct, first few
  std::string json(const char* name) const {
    char b[1024];
    auto list = [](const std::vector<long>& v) {
      std::string s = "[";
      for (size_t k = 0; k < v.size(); ++k) s += (k ? "," : "") + std::to_string(v[k]);
      return s + "]";
    };
    std::snprintf(b, sizeof b,
                  "\"%s\": {\"compared\": %zu, \"differ\": %zu, \"unwritten\": %zu, \"first\": [%ld, %ld, %ld], "
                  "\"max_gap_bf16_units\": %d, \"rows\": %s, \"dims\": %s}",
                  name, compared, differ, unwritten, first_i, first_h, first_d, max_gap, list(rows).c_str(),
                  list(dims).c_str());
    return b;
  }
};
static void note(std::vector<long>& v, long x) {
  if (v.size() < 16 && std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}
// Rows `rows` of x against y ([m][H][hd] bf16), bits; 0xFFFF (the poison) counts as unwritten.
static Cmp compare(const std::vector<uint16_t>& x, const std::vector<uint16_t>& y, const std::vector<int64_t>& rows,
                   int H, int hd) {
  Cmp c;
  for (int64_t i : rows)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < hd; ++d) {
        const size_t k = (static_cast<size_t>(i) * H + h) * hd + d;
        ++c.compared;
        if (x[k] == 0xFFFF || y[k] == 0xFFFF) ++c.unwritten;
        if (x[k] != y[k]) {
          if (c.differ++ == 0) {
            c.first_i = i;
            c.first_h = h;
            c.first_d = d;
          }
          note(c.rows, static_cast<long>(i));
          note(c.dims, d);
          c.max_gap = std::max(c.max_gap, std::abs(ord_bf16(x[k]) - ord_bf16(y[k])));
        }
      }
  return c;
}
static std::vector<uint16_t> fetch(const uint16_t* p, size_t n) {
  std::vector<uint16_t> h(n);
  CK(cudaMemcpy(h.data(), p, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return h;
}

static std::string g_commit = "unknown", g_device, g_date;
static const char* loads_name(int l) { return l == 1 ? "tma" : l == 2 ? "pairs" : l == 0 ? "rings" : "none"; }
// The wgmma K/V paths to run, in order (WGMMA_LOADS, e.g. "1,0"); unknown entries are skipped.
static std::vector<int> g_loads = {1, 0, 2};
static void read_loads() {
  const char* e = std::getenv("WGMMA_LOADS");
  if (e == nullptr || *e == 0) return;
  g_loads.clear();
  for (const char* c = e; *c; ++c)
    if (*c >= '0' && *c <= '2') g_loads.push_back(*c - '0');
  if (g_loads.empty()) g_loads = {1, 0, 2};  // nothing recognised: not a vacuous pass
}
static bool runs(int l) { return std::find(g_loads.begin(), g_loads.end(), l) != g_loads.end(); }

// One (m, pos0, n_valid) case: bits of all three, the wgmma kernel by each K/V path (one line
// each); returns true when all equal and written.
static bool check_case(const Inputs& in, int64_t m, int64_t pos0, int64_t nv, int64_t dec_max, std::mt19937& g) {
  const int H = in.sh.H, hd = in.sh.hd;
  const size_t n = static_cast<size_t>(m) * H * hd;
  std::vector<int32_t> pr(m);
  for (int64_t i = 0; i < m; ++i) pr[i] = static_cast<int32_t>(pos0 + i);
  CK(cudaMemcpy(in.pos_rows, pr.data(), sizeof(int32_t) * m, cudaMemcpyHostToDevice));
  const int32_t sc[3] = {static_cast<int32_t>(pos0), static_cast<int32_t>(nv), 1};
  CK(cudaMemcpy(in.scalars, sc, sizeof sc, cudaMemcpyHostToDevice));
  poison(in.out_fa, n);
  poison(in.out_dec, n);
  run_fa(in, m);
  // the decode rows: every valid row, or dec_max of them drawn at random (always the first and last)
  std::vector<int64_t> valid, dec;
  for (int64_t i = 0; i < nv; ++i) valid.push_back(i);
  if (nv <= dec_max) {
    dec = valid;
  } else {
    std::vector<int64_t> v = valid;
    std::shuffle(v.begin() + 1, v.end() - 1, g);
    dec.assign(v.begin(), v.begin() + dec_max - 1);
    dec.push_back(nv - 1);
    std::sort(dec.begin(), dec.end());
  }
  run_decode(in, dec);
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  const auto fa = fetch(in.out_fa, n), de = fetch(in.out_dec, n);
  std::vector<int64_t> all;
  for (int64_t i = 0; i < m; ++i) all.push_back(i);
  const Cmp fd = compare(fa, de, dec, H, hd);
  // rows past n_valid come back as zeros from both prefill kernels
  std::vector<uint16_t> zeros(n, 0);
  std::vector<int64_t> pad;
  for (int64_t i = nv; i < m; ++i) pad.push_back(i);
  bool ok_all = true;
  for (int tma : g_loads) {
    poison(in.out_wg, n);
    const bool ran = run_wg(in, m, tma);
    const int took = attention_wgmma_last_loads();
    // TMA where the head dim has it (128, 256), else the rings: a fallback fails the case
    const bool path_ok = took == (hd == 128 || hd == 256 ? tma : 0);
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    const auto wg = fetch(in.out_wg, n);
    const Cmp wf = compare(wg, fa, all, H, hd), wd = compare(wg, de, dec, H, hd);
    const Cmp pz = compare(wg, zeros, pad, H, hd);
    const bool ok = ran && path_ok && wf.differ == 0 && wf.unwritten == 0 && wd.differ == 0 && wd.unwritten == 0 &&
                    fd.differ == 0 && pz.differ == 0;
    std::printf("{\"case\": \"%s\", \"loads\": \"%s\", \"took\": \"%s\", \"m\": %lld, \"pos0\": %lld, "
                "\"n_valid\": %lld, \"S\": %lld, \"ran_wgmma\": %s, \"decode_rows\": %zu, %s, %s, %s, %s, "
                "\"equal\": %s}\n",
                in.sh.name, loads_name(tma), loads_name(took), (long long)m, (long long)pos0, (long long)nv,
                (long long)in.S, ran ? "true" : "false", dec.size(), wf.json("wgmma_vs_default").c_str(),
                wd.json("wgmma_vs_decode").c_str(), fd.json("default_vs_decode").c_str(),
                pz.json("wgmma_padding_vs_zero").c_str(), ok ? "true" : "false");
    std::fflush(stdout);
    ok_all &= ok;
  }
  attention_wgmma_set_loads(1);
  return ok_all;
}

// Median of `reps` launches of one kernel (device events), after two warm-ups.
template <typename F>
static float time_ms(F f, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  f();
  f();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  if (argc > 1) g_commit = argv[1];
  read_loads();
  const char* mode = argc > 2 ? argv[2] : "all";
  const bool checks = std::strcmp(mode, "time") && std::strcmp(mode, "profile");
  const bool timing = std::strcmp(mode, "quick") && std::strcmp(mode, "profile");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int drv = 0;
  CK(cudaDriverGetVersion(&drv));
  {
    char b[64];
    const std::time_t now = std::time(nullptr);
    std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    g_date = b;
  }
  std::printf("{\"harness\": \"wgmma_attention_check\", \"device\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, "
              "\"driver\": %d, \"commit\": \"%s\", \"date\": \"%s\"}\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, drv, g_commit.c_str(), g_date.c_str());
  std::mt19937 g(static_cast<uint32_t>(std::time(nullptr)));  // fresh inputs every run
  bool ok = true;
  // the model's G = 8 at hd 256, and G = 4 at 128 / 64 / 32 (the head dims the kernel takes)
  const Shape shapes[] = {{"g8_hd256", 16, 2, 256, 32}, {"g4_hd128", 8, 2, 128, 32}, {"g4_hd64", 8, 2, 64, 16},
                          {"g4_hd32", 8, 2, 32, 8}};
  const int64_t S = 2900;
  if (!std::strcmp(mode, "profile")) {
    const int64_t m = 8192, pos0 = 32768 - m;
    Inputs in = make_inputs(g, shapes[0], 32768, m);
    const int32_t sc[3] = {static_cast<int32_t>(pos0), static_cast<int32_t>(m), 1};
    CK(cudaMemcpy(in.scalars, sc, sizeof sc, cudaMemcpyHostToDevice));
    run_fa(in, m);
    for (int l : g_loads) run_wg(in, m, l);
    CK(cudaDeviceSynchronize());
    free_inputs(in);
    return 0;
  }
  for (const Shape& sh : shapes) {
    if (!checks) break;
    Inputs in = make_inputs(g, sh, S, 400);
    // m > 16 (the serial prefill tile): several tiles, tiles with padding rows, several splits
    for (int64_t m : {17, 64, 300, 400})
      for (int64_t pos0 : {0, 37, 1000, 2500}) {
        if (pos0 + m > S) continue;
        ok &= check_case(in, m, pos0, m, 400, g);
        ok &= check_case(in, m, pos0, m - 5, 400, g);  // a padded call
      }
    free_inputs(in);
  }
  // Full size: a 32k prompt's last 8k chunk and an 8k prompt, the model's shape; bits on every
  // row of both prefill kernels and 48 decode rows, then the two kernels' times.
  {
    const Shape sh = shapes[0];
    for (int64_t S_big : {8192, 32768}) {
      const int64_t m = 8192, pos0 = S_big - m;
      Inputs in = make_inputs(g, sh, S_big, m);
      if (checks) ok &= check_case(in, m, pos0, m, 48, g);
      if (timing) {
        const int32_t sc[3] = {static_cast<int32_t>(pos0), static_cast<int32_t>(m), 1};
        CK(cudaMemcpy(in.scalars, sc, sizeof sc, cudaMemcpyHostToDevice));
        const float t_fa = time_ms([&] { run_fa(in, m); }, 10);
        // -1: a path WGMMA_LOADS left out
        const float t_wg = runs(1) ? time_ms([&] { run_wg(in, m, 1); }, 10) : -1.0f;
        const int took = runs(1) ? attention_wgmma_last_loads() : -1;
        const float t_wr = runs(0) ? time_ms([&] { run_wg(in, m, 0); }, 10) : -1.0f;
        const float t_wp = runs(2) ? time_ms([&] { run_wg(in, m, 2); }, 10) : -1.0f;
        const int took_p = runs(2) ? attention_wgmma_last_loads() : -1;
        attention_wgmma_set_loads(1);
        // causal pairs of the chunk: row i sees pos0 + i + 1 keys; 4 flops per (pair, head dim, q head)
        const double pairs = static_cast<double>(m) * pos0 + static_cast<double>(m) * (m + 1) / 2;
        const double flop = 4.0 * pairs * sh.hd * sh.H;
        std::printf("{\"timing\": \"%s\", \"m\": %lld, \"pos0\": %lld, \"S\": %lld, \"default_ms\": %.3f, "
                    "\"wgmma_ms\": %.3f, \"wgmma_took\": \"%s\", \"wgmma_pairs_ms\": %.3f, \"pairs_took\": \"%s\", "
                    "\"wgmma_rings_ms\": %.3f, \"default_tflops\": %.1f, "
                    "\"wgmma_tflops\": %.1f, \"wgmma_pairs_tflops\": %.1f, \"wgmma_rings_tflops\": %.1f, \"reps\": 10, "
                    "\"stat\": \"median\"}\n",
                    sh.name, (long long)m, (long long)pos0, (long long)S_big, t_fa, t_wg, loads_name(took), t_wp,
                    loads_name(took_p), t_wr, flop / t_fa / 1e9, flop / t_wg / 1e9, flop / t_wp / 1e9,
                    flop / t_wr / 1e9);
        std::fflush(stdout);
      }
      free_inputs(in);
    }
  }
  std::printf("{\"all_equal\": %s, \"commit\": \"%s\", \"device\": \"%s\", \"date\": \"%s\"}\n", ok ? "true" : "false",
              g_commit.c_str(), prop.name, g_date.c_str());
  return ok ? 0 : 1;
}
