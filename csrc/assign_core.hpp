// Shared arithmetic of the sequence-assignment kernels: cost model, stage-1 estimate,
// SplitMix64, orderings and the binary search every local search uses.
//
// Why it exists: the C++ kernels must return bit-identical results to the Python
// reference (dcp_ext/assign/model.py, rng.py, ref_*.py). Every float expression here
// is written in the same operation order as there, and FP contraction (FMA) must be off
// so the compiler cannot fuse a*b+c differently than Python evaluates it.
#pragma once

// Targets with fast FMA (aarch64, x86 with -mfma) would let GCC fuse a*b+c; there the
// pragma turns that off (at some cost in inlining; -ffp-contract=off in setup.py would be
// cleaner). Plain x86-64 has no FMA instruction to fuse with, and the pragma is left out.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__) && (defined(__FP_FAST_FMA) || defined(__aarch64__))
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace dcp {

constexpr double kPerturb = 0.3;   // restarts order by length * (1 + kPerturb * u)
constexpr double kRelTol = 1e-12;  // a local-search step must gain this much (relative)
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Params {  // ReplicaCost.as_tuple()
  double a, b, c, o;
  int64_t pp, max_seq_len, max_mb_tokens;
  int64_t cap() const { return std::min(max_seq_len, max_mb_tokens); }
  bool operator==(const Params& x) const {
    return a == x.a && b == x.b && c == x.c && o == x.o && pp == x.pp && max_seq_len == x.max_seq_len &&
           max_mb_tokens == x.max_mb_tokens;
  }
};

inline double seq_cost(const Params& p, int64_t s) {
  double x = static_cast<double>(s);
  return p.a * x * x + p.b * x + p.c;
}

// Lower bound of replica_time over all packings (see model.py); 0 for an empty replica.
inline double estimate(const Params& p, double W, int64_t T, double m, int64_t n) {
  if (n == 0) return 0.0;
  const double o = p.o;
  const int64_t q = p.pp - 1;
  const int64_t cap = p.max_mb_tokens;
  const int64_t v0 = (T + cap - 1) / cap;
  if (q == 0) return W + o * static_cast<double>(v0);
  const double dq = static_cast<double>(q);
  const double vk = m > 0.0 ? W / m : 0.0;
  const double vc = o > 0.0 ? std::min(std::sqrt(dq * W / o), vk) : vk;
  const int64_t f = vc < static_cast<double>(n) ? static_cast<int64_t>(std::floor(vc)) : n;
  double best = kInf;
  for (int64_t v : {f, f + 1}) {
    v = std::min(std::max(v, v0), n);
    const double dv = static_cast<double>(v);
    const double val = dv * o + dq * std::max(W / dv, m);
    if (val < best) best = val;
  }
  return W + dq * o + best;
}

struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next_u64() {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double next_double() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  uint64_t next_below(uint64_t n) { return next_u64() % n; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i-- > 1;) {
      size_t j = static_cast<size_t>(next_below(i + 1));
      std::swap(v[i], v[j]);
    }
  }
};

inline uint64_t derive_seed(uint64_t seed, uint64_t k) { return seed + k + 1; }

// A sequence in a replica or micro-batch; members are kept sorted by (len desc, idx asc).
struct Item {
  int64_t len;
  int64_t idx;
};
inline bool item_before(const Item& x, const Item& y) {
  return x.len > y.len || (x.len == y.len && x.idx < y.idx);
}
inline void insert_sorted(std::vector<Item>& v, Item it) {
  v.insert(std::lower_bound(v.begin(), v.end(), it, item_before), it);
}
// First position whose length is <= x.
inline int64_t first_at_most(const std::vector<Item>& v, int64_t x) {
  return std::partition_point(v.begin(), v.end(), [x](const Item& it) { return it.len > x; }) - v.begin();
}

// Smallest p in [lo, hi) with A(p) >= B(p) (A non-decreasing, B non-increasing), else hi.
// Both are always evaluated, in the order A then B, as the Python reference does.
template <class FA, class FB>
inline int64_t crossing(FA&& A, FB&& B, int64_t lo, int64_t hi) {
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    double a = A(mid);
    double b = B(mid);
    if (a >= b)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// Sequences as (length, index) by (length desc, index asc): a counting sort when lengths
// are small. Contiguous items keep the greedy's reads sequential (len[i] in sorted order
// would miss the cache on every sequence of a million).
inline std::vector<Item> sorted_items(const int64_t* len, int64_t n) {
  std::vector<Item> out(n);
  if (n == 0) return out;
  int64_t mx = *std::max_element(len, len + n);
  if (mx <= 2 * n + 1024) {
    std::vector<int64_t> start(mx + 2, 0);
    for (int64_t i = 0; i < n; ++i) ++start[mx - len[i] + 1];  // bucket mx-len: longest first
    for (int64_t k = 1; k <= mx + 1; ++k) start[k] += start[k - 1];
    for (int64_t i = 0; i < n; ++i) out[start[mx - len[i]]++] = Item{len[i], i};
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = Item{len[i], i};
    std::sort(out.begin(), out.end(), item_before);
  }
  return out;
}

inline std::vector<int64_t> sorted_order(const int64_t* len, int64_t n) {
  std::vector<Item> items = sorted_items(len, n);
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) order[k] = items[k].idx;
  return order;
}

inline std::vector<int64_t> perturbed_order(const int64_t* len, int64_t n, SplitMix64& rng) {
  std::vector<double> key(n);
  for (int64_t i = 0; i < n; ++i) key[i] = static_cast<double>(len[i]) * (1.0 + kPerturb * rng.next_double());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&key](int64_t x, int64_t y) {
    return key[x] > key[y] || (key[x] == key[y] && x < y);
  });
  return order;
}

// replica_time of micro-batches (indices into len): sum of (o + costs) + (pp-1) * largest.
inline double replica_time(const Params& p, const int64_t* len, const std::vector<std::vector<int64_t>>& mbs) {
  double total = 0.0, largest = 0.0;
  for (const auto& mb : mbs) {
    if (mb.empty()) continue;
    double acc = p.o;
    for (int64_t i : mb) acc += seq_cost(p, len[i]);
    total += acc;
    if (acc > largest) largest = acc;
  }
  return total + static_cast<double>(p.pp - 1) * largest;
}

}  // namespace dcp
