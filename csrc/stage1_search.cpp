// Stage 1 by search in C++: the iterated local search of
// dcp_ext/planning/planners/stage1_search.py (its module docstring holds the model and the
// algorithm, with every tie rule), operation for operation, so both return the same
// assignment. The side plan (planners/side_plan.py) runs it on the leading candidate.
//
// Why it exists: restarts of a local search over a batch's documents are too slow in
// Python to run every iteration. FP contraction is off (setup.py), so a*b+c is never fused
// differently from Python's evaluation.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kRelTol = 1e-12;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kKickMin = 2, kKickSpread = 3;

struct Params {  // stage1_search.ReplicaCost
  double a, b, c, o;
  int64_t pp, longest, cap_mb;
  int64_t cap() const { return std::min(longest, cap_mb); }
  bool operator==(const Params& x) const {
    return a == x.a && b == x.b && c == x.c && o == x.o && pp == x.pp && longest == x.longest && cap_mb == x.cap_mb;
  }
};

double seq_cost(const Params& p, int64_t s) {
  const double x = static_cast<double>(s);
  return p.a * x * x + p.b * x + p.c;
}

double estimate(const Params& p, double W, int64_t T, double m, int64_t n) {
  if (n == 0) return 0.0;
  const double o = p.o;
  const int64_t q = p.pp - 1;
  const int64_t v0 = (T + p.cap_mb - 1) / p.cap_mb;
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
  uint64_t next_below(uint64_t n) {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (z ^ (z >> 31)) % n;
  }
};

// A document in a replica: members are kept sorted by (length desc, index asc).
struct Item {
  int64_t len, idx;
};
bool item_before(const Item& x, const Item& y) { return x.len > y.len || (x.len == y.len && x.idx < y.idx); }
void insert_sorted(std::vector<Item>& v, Item it) { v.insert(std::lower_bound(v.begin(), v.end(), it, item_before), it); }
int64_t first_at_most(const std::vector<Item>& v, int64_t x) {
  return std::partition_point(v.begin(), v.end(), [x](const Item& it) { return it.len > x; }) - v.begin();
}

// Smallest p in [lo, hi) with A(p) >= B(p), else hi; A then B evaluated, as in Python.
template <class FA, class FB>
int64_t crossing(FA&& A, FB&& B, int64_t lo, int64_t hi) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const double a = A(mid);
    const double b = B(mid);
    if (a >= b)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

struct State {
  std::vector<double> W, mx, est;
  std::vector<int64_t> T;
  std::vector<std::vector<Item>> mem;
  explicit State(size_t R) : W(R, 0.0), mx(R, 0.0), est(R, 0.0), T(R, 0), mem(R) {}

  void recompute(const std::vector<Params>& P) {
    for (size_t r = 0; r < P.size(); ++r) {
      double w = 0.0;
      int64_t t = 0;
      for (const Item& it : mem[r]) {
        w += seq_cost(P[r], it.len);
        t += it.len;
      }
      W[r] = w;
      T[r] = t;
      mx[r] = mem[r].empty() ? 0.0 : seq_cost(P[r], mem[r][0].len);
      est[r] = estimate(P[r], w, t, mx[r], static_cast<int64_t>(mem[r].size()));
    }
  }
  double largest() const { return est.empty() ? 0.0 : *std::max_element(est.begin(), est.end()); }
};

// The greedy: a min-heap of (estimate, replica) per group of equal replicas.
State greedy(const std::vector<Params>& P, const std::vector<Item>& order) {
  std::vector<Params> types;
  std::vector<std::vector<std::pair<double, int>>> heaps;
  for (int r = 0; r < static_cast<int>(P.size()); ++r) {
    const size_t t = std::find(types.begin(), types.end(), P[r]) - types.begin();
    if (t == types.size()) types.push_back(P[r]), heaps.emplace_back();
    heaps[t].emplace_back(0.0, r);
  }
  const auto heap_after = [](const std::pair<double, int>& x, const std::pair<double, int>& y) { return y < x; };
  State st(P.size());
  for (const Item& it : order) {
    const int64_t s = it.len;
    double best_val = kInf, best_c = 0.0, best_m = 0.0;
    int best_r = -1;
    size_t best_t = 0;
    for (size_t t = 0; t < types.size(); ++t) {
      if (s > types[t].cap()) continue;
      const int r = heaps[t].front().second;
      const double c = seq_cost(types[t], s);
      const double m2 = c > st.mx[r] ? c : st.mx[r];
      const double val = estimate(types[t], st.W[r] + c, st.T[r] + s, m2, static_cast<int64_t>(st.mem[r].size()) + 1);
      if (val < best_val || (val == best_val && r < best_r)) best_val = val, best_r = r, best_t = t, best_c = c, best_m = m2;
    }
    const int r = best_r;
    st.W[r] += best_c;
    st.T[r] += s;
    st.mx[r] = best_m;
    st.est[r] = best_val;
    st.mem[r].push_back(it);  // items arrive in member order
    auto& h = heaps[best_t];  // heapq.heapreplace
    std::pop_heap(h.begin(), h.end(), heap_after);
    h.back() = {best_val, r};
    std::push_heap(h.begin(), h.end(), heap_after);
  }
  return st;
}

struct Step {
  bool found = false, swap = false;
  int r = -1;
  int64_t p = -1, q = -1;
  double a = 0.0, b = 0.0;
};

class Improve {
 public:
  Improve(State& st, const std::vector<Params>& P, int64_t budget) : st_(st), P_(P), budget_(budget) {
    for (const auto& p : P) caps_.push_back(p.cap());
  }

  void run() {
    const int R = static_cast<int>(P_.size());
    while (evals_ < budget_) {
      int c = 0;
      for (int r = 1; r < R; ++r)
        if (st_.est[r] > st_.est[c]) c = r;
      const double Mk = st_.est[c];
      if (!(Mk > 0.0)) return;
      const double thr = Mk - Mk * kRelTol;
      Step best = best_move(c, thr, -1);
      if (!best.found) best = best_swap(c, thr, -1);
      if (best.found)
        apply(c, best);
      else if (!chain(c, thr))
        return;
    }
  }

 private:
  double est(const Params& p, double W, int64_t T, double m, int64_t n) {
    ++evals_;
    return estimate(p, W, T, m, n);
  }
  // The two positions on either side of where c's side A crosses r's side B in [lo, hi):
  // `step` at the one whose larger side is below best_val (and the lower of the two).
  template <class FA, class FB>
  void around_crossing(FA&& A, FB&& B, int64_t lo, int64_t hi, Step step, double& best_val, Step& best) {
    const int64_t ps = crossing(A, B, lo, hi);
    for (int64_t p : {ps - 1, ps}) {
      if (lo <= p && p < hi) {
        const double a = A(p);
        const double b = B(p);
        const double val = a > b ? a : b;
        if (val < best_val) best_val = val, step.p = p, step.a = a, step.b = b, best = step;
      }
    }
  }
  double max_after_removal(int r, int64_t pos) const {
    if (pos != 0) return st_.mx[r];
    return st_.mem[r].size() > 1 ? seq_cost(P_[r], st_.mem[r][1].len) : 0.0;
  }

  bool chain(int c, double thr) {
    const Params& pc = P_[c];
    auto& memc = st_.mem[c];
    const int64_t nc = static_cast<int64_t>(memc.size());
    for (int r = 0; r < static_cast<int>(P_.size()); ++r) {
      if (r == c) continue;
      const Params& pr = P_[r];
      const int64_t lo = first_at_most(memc, caps_[r]);
      for (int64_t p = lo; p < nc; ++p) {
        const int64_t l = memc[p].len;
        if (p > lo && l == memc[p - 1].len) continue;
        if (evals_ >= budget_) return false;
        const double a = est(pc, st_.W[c] - seq_cost(pc, l), st_.T[c] - l, max_after_removal(c, p), nc - 1);
        if (!(a < thr)) break;
        const double cr = seq_cost(pr, l);
        const double m2 = cr > st_.mx[r] ? cr : st_.mx[r];
        const double b = est(pr, st_.W[r] + cr, st_.T[r] + l, m2, static_cast<int64_t>(st_.mem[r].size()) + 1);
        const double saved[6] = {st_.W[c], st_.mx[c], st_.est[c], st_.W[r], st_.mx[r], st_.est[r]};
        const int64_t savedT[2] = {st_.T[c], st_.T[r]};
        const Item item = memc[p];
        apply(c, Step{true, false, r, p, -1, a, b});
        if (b < thr) return true;
        Step second = best_move(r, thr, c);
        if (!second.found) second = best_swap(r, thr, c);
        if (second.found) {
          apply(r, second);
          return true;
        }
        auto& memr = st_.mem[r];
        memr.erase(std::lower_bound(memr.begin(), memr.end(), item, item_before));
        memc.insert(memc.begin() + p, item);
        st_.W[c] = saved[0], st_.mx[c] = saved[1], st_.est[c] = saved[2];
        st_.W[r] = saved[3], st_.mx[r] = saved[4], st_.est[r] = saved[5];
        st_.T[c] = savedT[0], st_.T[r] = savedT[1];
      }
    }
    return false;
  }

  Step best_move(int c, double thr, int skip) {
    const Params& pc = P_[c];
    const auto& memc = st_.mem[c];
    const int64_t nc = static_cast<int64_t>(memc.size());
    double best_val = thr;
    Step best;
    for (int r = 0; r < static_cast<int>(P_.size()); ++r) {
      if (r == c || r == skip) continue;
      const Params& pr = P_[r];
      const int64_t lo = first_at_most(memc, caps_[r]);
      if (lo >= nc) continue;
      const int64_t nr = static_cast<int64_t>(st_.mem[r].size());
      auto A = [&](int64_t p) {
        const int64_t l = memc[p].len;
        return est(pc, st_.W[c] - seq_cost(pc, l), st_.T[c] - l, max_after_removal(c, p), nc - 1);
      };
      auto B = [&](int64_t p) {
        const int64_t l = memc[p].len;
        const double cr = seq_cost(pr, l);
        const double m2 = cr > st_.mx[r] ? cr : st_.mx[r];
        return est(pr, st_.W[r] + cr, st_.T[r] + l, m2, nr + 1);
      };
      around_crossing(A, B, lo, nc, Step{true, false, r, -1, -1, 0.0, 0.0}, best_val, best);
    }
    return best;
  }

  Step best_swap(int c, double thr, int skip) {
    const Params& pc = P_[c];
    const auto& memc = st_.mem[c];
    const int64_t nc = static_cast<int64_t>(memc.size());
    double best_val = thr;
    Step best;
    for (int r = 0; r < static_cast<int>(P_.size()); ++r) {
      if (r == c || r == skip) continue;
      const Params& pr = P_[r];
      const auto& memr = st_.mem[r];
      const int64_t nr = static_cast<int64_t>(memr.size());
      const int64_t lo = first_at_most(memc, caps_[r]);
      for (int64_t q = 0; q < nr; ++q) {
        const int64_t lj = memr[q].len;
        if (q > 0 && lj == memr[q - 1].len) continue;
        if (evals_ >= budget_) return best;
        if (lj > caps_[c]) continue;
        const int64_t hi = first_at_most(memc, lj);
        if (lo >= hi) continue;
        const double cj_c = seq_cost(pc, lj);
        const double cj_r = seq_cost(pr, lj);
        const double mr_after = max_after_removal(r, q);
        auto A = [&](int64_t p) {
          const int64_t li = memc[p].len;
          const double m_after = max_after_removal(c, p);
          const double m_new = cj_c > m_after ? cj_c : m_after;
          return est(pc, st_.W[c] - seq_cost(pc, li) + cj_c, st_.T[c] - li + lj, m_new, nc);
        };
        auto B = [&](int64_t p) {
          const int64_t li = memc[p].len;
          const double ci_r = seq_cost(pr, li);
          const double m_new = ci_r > mr_after ? ci_r : mr_after;
          return est(pr, st_.W[r] - cj_r + ci_r, st_.T[r] - lj + li, m_new, nr);
        };
        around_crossing(A, B, lo, hi, Step{true, true, r, -1, q, 0.0, 0.0}, best_val, best);
      }
    }
    return best;
  }

  void apply(int c, const Step& s) {
    const int r = s.r;
    const Params& pc = P_[c];
    const Params& pr = P_[r];
    auto& memc = st_.mem[c];
    auto& memr = st_.mem[r];
    const Item it = memc[s.p];
    const int64_t li = it.len;
    if (!s.swap) {
      st_.W[c] = st_.W[c] - seq_cost(pc, li);
      st_.T[c] -= li;
      st_.W[r] = st_.W[r] + seq_cost(pr, li);
      st_.T[r] += li;
      memc.erase(memc.begin() + s.p);
      insert_sorted(memr, it);
    } else {
      const Item jt = memr[s.q];
      const int64_t lj = jt.len;
      st_.W[c] = st_.W[c] - seq_cost(pc, li) + seq_cost(pc, lj);
      st_.T[c] += lj - li;
      st_.W[r] = st_.W[r] - seq_cost(pr, lj) + seq_cost(pr, li);
      st_.T[r] += li - lj;
      memc.erase(memc.begin() + s.p);
      memr.erase(memr.begin() + s.q);
      insert_sorted(memc, jt);
      insert_sorted(memr, it);
    }
    for (int x : {c, r}) st_.mx[x] = st_.mem[x].empty() ? 0.0 : seq_cost(P_[x], st_.mem[x][0].len);
    st_.est[c] = s.a;
    st_.est[r] = s.b;
  }

  State& st_;
  const std::vector<Params>& P_;
  std::vector<int64_t> caps_;
  int64_t budget_;
  int64_t evals_ = 0;
};

void kick(State& st, const int64_t* len, int64_t n, const std::vector<Params>& P, SplitMix64& rng, int64_t moves) {
  const int64_t R = static_cast<int64_t>(P.size());
  std::vector<int64_t> where(n, 0);
  for (int64_t r = 0; r < R; ++r)
    for (const Item& it : st.mem[r]) where[it.idx] = r;
  for (int64_t k = 0; k < moves; ++k) {
    const int64_t i = static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(n)));
    const int64_t r = where[i];
    int64_t t = static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(R - 1)));
    if (t >= r) ++t;
    if (len[i] > P[t].cap()) continue;
    const Item it{len[i], i};
    auto& from = st.mem[r];
    from.erase(std::lower_bound(from.begin(), from.end(), it, item_before));
    insert_sorted(st.mem[t], it);
    where[i] = t;
  }
  st.recompute(P);
}

std::vector<int64_t> search(const int64_t* len, int64_t n, const std::vector<Params>& P, uint64_t seed,
                            int64_t restarts, int64_t budget) {
  std::vector<Item> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = Item{len[i], i};
  std::stable_sort(order.begin(), order.end(), item_before);
  State best = greedy(P, order);
  best.recompute(P);
  Improve(best, P, budget).run();
  best.recompute(P);
  double best_ms = best.largest();
  SplitMix64 rng{seed};
  if (P.size() > 1 && n > 0) {
    for (int64_t k = 0; k < restarts; ++k) {
      State cur = best;
      kick(cur, len, n, P, rng, kKickMin + k % kKickSpread);
      Improve(cur, P, budget).run();
      cur.recompute(P);
      const double ms = cur.largest();
      if (ms <= best_ms) best = std::move(cur), best_ms = ms;
    }
  }
  std::vector<int64_t> assignment(n, 0);
  for (size_t r = 0; r < P.size(); ++r)
    for (const Item& it : best.mem[r]) assignment[it.idx] = static_cast<int64_t>(r);
  return assignment;
}

using LenArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::list stage1_search(const LenArray& lengths, const py::sequence& replicas, uint64_t seed, int64_t restarts,
                       int64_t budget) {
  std::vector<Params> P;
  for (const auto& h : replicas) {
    const py::tuple t = py::reinterpret_borrow<py::object>(h).cast<py::tuple>();
    if (t.size() != 7) throw py::value_error("a replica's costs are a 7-tuple (stage1_search.ReplicaCost)");
    P.push_back(Params{t[0].cast<double>(), t[1].cast<double>(), t[2].cast<double>(), t[3].cast<double>(),
                       t[4].cast<int64_t>(), t[5].cast<int64_t>(), t[6].cast<int64_t>()});
  }
  if (P.empty()) throw py::value_error("no replicas given");
  std::vector<int64_t> out;
  {
    py::gil_scoped_release nogil;
    out = search(lengths.data(), lengths.size(), P, seed, restarts, budget);
  }
  return py::cast(out);
}

}  // namespace

void register_stage1_search(py::module_& m) {
  m.def("stage1_search", &stage1_search, py::arg("lengths"), py::arg("replicas"), py::arg("seed"),
        py::arg("restarts"), py::arg("budget"));
}
