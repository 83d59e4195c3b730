// Stage 2 (pack): one replica's sequences into micro-batches under the token cap,
// minimising sum of micro-batch costs + (pp-1) * largest. The micro-batch count v is
// enumerated outwards from the minimiser of its lower bound; each v is packed by LPT
// under the cap (best-fit decreasing if that fails) and improved by moves and swaps.
// Mirrors dcp_ext/assign/ref_pack.py operation for operation (same results).
#include <queue>
#include <set>

#include "assign_kernels.hpp"

namespace dcp {
namespace {

struct Bins {
  std::vector<double> C;
  std::vector<int64_t> T;
  std::vector<std::vector<Item>> mem;
  explicit Bins(int64_t v) : C(v, 0.0), T(v, 0), mem(v) {}
};

bool pack_v(const int64_t* len, const std::vector<double>& costs, int64_t cap, int64_t v,
            const std::vector<int64_t>& order, Bins& b) {
  // LPT under the cap: the bin with the smallest (cost, index) among those with room.
  using Entry = std::pair<double, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64_t k = 0; k < v; ++k) heap.emplace(0.0, k);
  std::vector<Entry> skipped;
  bool ok = true;
  for (int64_t i : order) {
    const int64_t s = len[i];
    int64_t k = -1;
    while (!heap.empty()) {
      Entry e = heap.top();
      heap.pop();
      if (b.T[e.second] + s <= cap) {
        k = e.second;
        break;
      }
      skipped.push_back(e);
    }
    for (const Entry& e : skipped) heap.push(e);
    skipped.clear();
    if (k < 0) {
      ok = false;
      break;
    }
    b.C[k] += costs[i];
    b.T[k] += s;
    b.mem[k].push_back(Item{s, i});
    heap.emplace(b.C[k], k);
  }
  if (!ok) {  // best-fit decreasing by tokens
    b = Bins(v);
    for (int64_t i : order) {
      const int64_t s = len[i];
      int64_t kb = -1;
      for (int64_t k = 0; k < v; ++k)
        if (b.T[k] + s <= cap && (kb < 0 || b.T[k] > b.T[kb])) kb = k;
      if (kb < 0) return false;
      b.C[kb] += costs[i];
      b.T[kb] += s;
      b.mem[kb].push_back(Item{s, i});
    }
  }
  for (auto& m : b.mem) std::sort(m.begin(), m.end(), item_before);
  return true;
}

// Classic best-fit decreasing: the open bin with the least room that fits (ties: lower
// bin), a new bin when none does. Bins keyed by (room, index) in a multiset.
MicroBatches best_fit_decreasing(const int64_t* len, const std::vector<int64_t>& order, int64_t cap) {
  MicroBatches bins;
  std::set<std::pair<int64_t, int64_t>> open;  // (room, bin)
  for (int64_t i : order) {
    const int64_t s = len[i];
    auto it = open.lower_bound({s, -1});
    if (it == open.end()) {
      open.emplace(cap - s, static_cast<int64_t>(bins.size()));
      bins.push_back({i});
    } else {
      const auto [room, k] = *it;
      open.erase(it);
      open.emplace(room - s, k);
      bins[k].push_back(i);
    }
  }
  return bins;
}

double bins_time(const Bins& b, double o, int64_t q) {
  double t = 0.0, cm = 0.0;
  for (size_t k = 0; k < b.C.size(); ++k) {
    if (!b.mem[k].empty()) {
      t += o + b.C[k];
      if (b.C[k] > cm) cm = b.C[k];
    }
  }
  return t + static_cast<double>(q) * (o + cm);
}

void improve(Bins& b, const std::vector<double>& costs, int64_t cap, int64_t budget, double good_enough) {
  const int64_t v = static_cast<int64_t>(b.C.size());
  int64_t evals = 0;
  while (evals < budget) {
    int64_t k = 0;
    for (int64_t x = 1; x < v; ++x)
      if (b.C[x] > b.C[k]) k = x;
    const double M = b.C[k];
    if (!(M > good_enough)) return;
    double best_val = M - M * kRelTol;
    bool found = false;
    int64_t bj = -1, bp = -1, bq = -1;
    double bx = 0.0, by = 0.0;
    auto& memk = b.mem[k];
    const int64_t nk = static_cast<int64_t>(memk.size());
    for (int64_t j = 0; j < v; ++j) {  // moves
      if (j == k) continue;
      const int64_t lo = first_at_most(memk, cap - b.T[j]);
      if (lo >= nk) continue;
      auto A = [&](int64_t p) {
        ++evals;
        return b.C[k] - costs[memk[p].idx];
      };
      auto B = [&](int64_t p) {
        ++evals;
        return b.C[j] + costs[memk[p].idx];
      };
      const int64_t ps = crossing(A, B, lo, nk);
      for (int64_t p : {ps - 1, ps}) {
        if (lo <= p && p < nk) {
          const double x = A(p);
          const double y = B(p);
          const double val = x > y ? x : y;
          if (val < best_val) best_val = val, found = true, bj = j, bp = p, bq = -1, bx = x, by = y;
        }
      }
    }
    if (!found) {  // swaps
      bool stop = false;
      for (int64_t j = 0; j < v && !stop; ++j) {
        if (j == k) continue;
        const auto& memj = b.mem[j];
        for (int64_t q = 0; q < static_cast<int64_t>(memj.size()); ++q) {
          const int64_t lj = memj[q].len;
          if (q > 0 && lj == memj[q - 1].len) continue;
          if (evals >= budget) {
            stop = true;
            break;
          }
          const int64_t lo = first_at_most(memk, cap - b.T[j] + lj);
          const int64_t hi = first_at_most(memk, lj);
          if (lo >= hi) continue;
          const double cj = costs[memj[q].idx];
          auto A = [&](int64_t p) {
            ++evals;
            return b.C[k] - costs[memk[p].idx] + cj;
          };
          auto B = [&](int64_t p) {
            ++evals;
            return b.C[j] - cj + costs[memk[p].idx];
          };
          const int64_t ps = crossing(A, B, lo, hi);
          for (int64_t p : {ps - 1, ps}) {
            if (lo <= p && p < hi) {
              const double x = A(p);
              const double y = B(p);
              const double val = x > y ? x : y;
              if (val < best_val) best_val = val, found = true, bj = j, bp = p, bq = q, bx = x, by = y;
            }
          }
        }
      }
    }
    if (!found) return;
    const Item a = memk[bp];
    memk.erase(memk.begin() + bp);
    b.T[k] -= a.len;
    b.T[bj] += a.len;
    if (bq >= 0) {
      const Item bi = b.mem[bj][bq];
      b.mem[bj].erase(b.mem[bj].begin() + bq);
      insert_sorted(memk, bi);
      b.T[k] += bi.len;
      b.T[bj] -= bi.len;
    }
    insert_sorted(b.mem[bj], a);
    b.C[k] = bx;
    b.C[bj] = by;
  }
}

double lower_bound_v(double W, double m, double o, int64_t q, int64_t v) {
  const double dv = static_cast<double>(v);
  return W + dv * o + static_cast<double>(q) * (o + std::max(W / dv, m));
}

constexpr double kGoodEnough = 1e-4;  // stop improving once (pp-1)*(largest - its bound) < this * LB(v)

double good_enough(double W, double m, double o, int64_t q, int64_t v) {
  return std::max(W / static_cast<double>(v), m) + kGoodEnough * lower_bound_v(W, m, o, q, v) / static_cast<double>(q);
}

int64_t vstar(double W, double m, double o, int64_t q, int64_t v0, int64_t n) {
  if (q == 0) return v0;
  const double vk = m > 0.0 ? W / m : 0.0;
  const double vc = o > 0.0 ? std::min(std::sqrt(static_cast<double>(q) * W / o), vk) : vk;
  const int64_t f = vc < static_cast<double>(n) ? static_cast<int64_t>(std::floor(vc)) : n;
  int64_t best_v = v0;
  double best = kInf;
  for (int64_t v : {f, f + 1}) {
    v = std::min(std::max(v, v0), n);
    const double val = lower_bound_v(W, m, o, q, v);
    if (val < best) best_v = v, best = val;
  }
  return best_v;
}

}  // namespace

MicroBatches pack(const int64_t* len, int64_t n, const Params& p, uint64_t seed, int64_t restarts, int64_t budget) {
  MicroBatches out;
  if (n == 0) return out;
  const double o = p.o;
  const int64_t q = p.pp - 1, cap = p.max_mb_tokens;
  std::vector<double> costs(n);
  for (int64_t i = 0; i < n; ++i) costs[i] = seq_cost(p, len[i]);
  const std::vector<int64_t> order = sorted_order(len, n);
  double W = 0.0;
  int64_t T = 0;
  for (int64_t i : order) {
    W += costs[i];
    T += len[i];
  }
  if (q == 0) {  // time = W + v*o: only the count matters
    out = best_fit_decreasing(len, order, cap);
    for (auto& mb : out) std::sort(mb.begin(), mb.end());
    return out;
  }
  const double m = costs[order[0]];
  const int64_t v0 = (T + cap - 1) / cap;
  const int64_t vs = vstar(W, m, o, q, v0, n);

  double best_t = kInf;
  int64_t best_v = vs;
  bool have = false;
  Bins best(0);
  auto attempt = [&](int64_t v, const std::vector<int64_t>& ord, Bins& b) {
    if (!pack_v(len, costs, cap, v, ord, b)) return false;
    improve(b, costs, cap, budget, good_enough(W, m, o, q, v));
    return true;
  };
  auto consider = [&](int64_t v) {
    if (have && !(lower_bound_v(W, m, o, q, v) < best_t - best_t * kGoodEnough)) return false;
    Bins b(v);
    if (attempt(v, order, b)) {
      const double t = bins_time(b, o, q);
      if (t < best_t) best_t = t, best = std::move(b), best_v = v, have = true;
    }
    return true;
  };
  for (int64_t v = vs; v <= n && consider(v); ++v) {
  }
  for (int64_t v = vs - 1; v >= v0 && consider(v); --v) {
  }
  if (restarts > 0) {
    SplitMix64 rng(seed);
    for (int64_t k = 0; k < restarts; ++k) {
      const std::vector<int64_t> ord = perturbed_order(len, n, rng);
      Bins b(best_v);
      if (attempt(best_v, ord, b)) {
        const double t = bins_time(b, o, q);
        if (t < best_t) best_t = t, best = std::move(b);
      }
    }
  }
  for (const auto& mem : best.mem) {
    if (mem.empty()) continue;
    std::vector<int64_t> mb;
    mb.reserve(mem.size());
    for (const Item& it : mem) mb.push_back(it.idx);
    std::sort(mb.begin(), mb.end());
    out.push_back(std::move(mb));
  }
  return out;
}

}  // namespace dcp
