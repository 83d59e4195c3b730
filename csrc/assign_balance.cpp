// Stage 1 (balance): sequences onto heterogeneous replicas, minimising the largest
// stage-1 estimate. Greedy by decreasing length (one heap per replica type; several
// starts that keep long sequences off pipeline replicas), each followed by a
// local search of moves, swaps and ejection chains off the critical replica, then
// iterated local search (seeded random kicks from the best solution).
// Mirrors dcp_ext/assign/ref_balance.py operation for operation (same results).
#include "assign_kernels.hpp"

namespace dcp {
namespace {

struct Type {
  Params p;
  std::vector<int> reps;
};

std::vector<Type> replica_types(const std::vector<Params>& params) {
  std::vector<Type> out;
  for (int r = 0; r < static_cast<int>(params.size()); ++r) {
    bool found = false;
    for (auto& t : out) {
      if (t.p == params[r]) {
        t.reps.push_back(r);
        found = true;
        break;
      }
    }
    if (!found) out.push_back(Type{params[r], {r}});
  }
  return out;
}

struct State {
  std::vector<double> W, mx, est;
  std::vector<int64_t> T;
  std::vector<std::vector<Item>> mem;
  explicit State(size_t R) : W(R, 0.0), mx(R, 0.0), est(R, 0.0), T(R, 0), mem(R) {}
};

// Min-heap of (estimate, replica); only its top ever changes (and only upwards).
struct Heap {
  std::vector<std::pair<double, int>> h;
  static bool less(const std::pair<double, int>& x, const std::pair<double, int>& y) {
    return x.first < y.first || (x.first == y.first && x.second < y.second);
  }
  void replace_top(std::pair<double, int> v) {
    size_t i = 0, n = h.size();
    for (;;) {
      size_t l = 2 * i + 1, r = l + 1, m = i;
      const std::pair<double, int>* best = &v;
      if (l < n && less(h[l], *best)) m = l, best = &h[l];
      if (r < n && less(h[r], *best)) m = r, best = &h[r];
      if (m == i) break;
      h[i] = h[m];
      i = m;
    }
    h[i] = v;
  }
};

// Items arrive sorted by (length desc, index asc), so members come out sorted too. The
// choices are recorded first and the member lists filled at their exact sizes afterwards.
// theta > 0: pipeline replicas (pp > 1) refuse sequences longer than theta unless no
// replica with pp == 1 can hold them.
State greedy(const std::vector<Params>& params, const std::vector<Type>& types, const std::vector<Item>& order,
             int64_t theta) {
  State st(params.size());
  std::vector<Heap> heaps(types.size());
  std::vector<int64_t> caps(types.size());
  int64_t flat_cap = 0;
  for (size_t t = 0; t < types.size(); ++t) {
    for (int r : types[t].reps) heaps[t].h.emplace_back(0.0, r);
    caps[t] = types[t].p.cap();
    if (types[t].p.pp == 1) flat_cap = std::max(flat_cap, caps[t]);
  }
  std::vector<int64_t> count(params.size(), 0);
  std::vector<int32_t> choice(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t s = order[k].len;
    double best_val = kInf, best_c = 0.0, best_m = 0.0;
    int best_r = -1;
    size_t best_t = 0;
    for (size_t t = 0; t < types.size(); ++t) {
      if (s > caps[t]) continue;
      if (theta > 0 && types[t].p.pp > 1 && s > theta && s <= flat_cap) continue;
      const int r = heaps[t].h[0].second;
      const Params& p = types[t].p;
      const double c = seq_cost(p, s);
      const double m2 = c > st.mx[r] ? c : st.mx[r];
      const double val = estimate(p, st.W[r] + c, st.T[r] + s, m2, count[r] + 1);
      if (val < best_val || (val == best_val && r < best_r)) {
        best_val = val, best_r = r, best_t = t, best_c = c, best_m = m2;
      }
    }
    const int r = best_r;
    st.W[r] += best_c;
    st.T[r] += s;
    st.mx[r] = best_m;
    st.est[r] = best_val;
    ++count[r];
    choice[k] = r;
    heaps[best_t].replace_top({best_val, r});
  }
  for (size_t r = 0; r < params.size(); ++r) st.mem[r].reserve(count[r]);
  for (size_t k = 0; k < order.size(); ++k) st.mem[choice[k]].push_back(order[k]);
  return st;
}

void recompute(State& st, const std::vector<Params>& params) {
  for (size_t r = 0; r < params.size(); ++r) {
    const Params& p = params[r];
    double W = 0.0;
    int64_t T = 0;
    for (const Item& it : st.mem[r]) {
      W += seq_cost(p, it.len);
      T += it.len;
    }
    st.W[r] = W;
    st.T[r] = T;
    st.mx[r] = st.mem[r].empty() ? 0.0 : seq_cost(p, st.mem[r][0].len);
    st.est[r] = estimate(p, W, T, st.mx[r], static_cast<int64_t>(st.mem[r].size()));
  }
}

struct Step {
  bool found = false, swap = false;
  int r = -1;
  int64_t p = -1, q = -1;
  double a = 0.0, b = 0.0;
};

class Search {
 public:
  Search(State& st, const std::vector<Params>& P, int64_t budget) : st_(st), P_(P), budget_(budget) {
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
  double max_after_removal(int r, int64_t pos) const {
    if (pos != 0) return st_.mx[r];
    return st_.mem[r].size() > 1 ? seq_cost(P_[r], st_.mem[r][1].len) : 0.0;
  }

  // Depth-2 ejection: move a sequence off c to r (overloading r), then the best move or
  // swap off r to a third replica; applied when both end below thr.
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
      const int64_t ps = crossing(A, B, lo, nc);
      for (int64_t p : {ps - 1, ps}) {
        if (lo <= p && p < nc) {
          const double a = A(p);
          const double b = B(p);
          const double val = a > b ? a : b;
          if (val < best_val) {
            best_val = val;
            best = Step{true, false, r, p, -1, a, b};
          }
        }
      }
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
        const int64_t ps = crossing(A, B, lo, hi);
        for (int64_t p : {ps - 1, ps}) {
          if (lo <= p && p < hi) {
            const double a = A(p);
            const double b = B(p);
            const double val = a > b ? a : b;
            if (val < best_val) {
              best_val = val;
              best = Step{true, true, r, p, q, a, b};
            }
          }
        }
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

double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

constexpr int64_t kKickMin = 2, kKickSpread = 3;  // restart k kicks with kKickMin + k % kKickSpread moves
// Greedy start k caps the sequences pipeline replicas take at this length quantile (1.0: no cap).
constexpr double kStartQuantiles[] = {1.0, 0.95, 0.85, 0.75, 0.65, 0.5, 0.35};

std::vector<int64_t> start_thresholds(const std::vector<Item>& order, const std::vector<Params>& params,
                                      int64_t starts) {
  std::vector<int64_t> out{0};
  bool pipe = false, flat = false;
  for (const auto& p : params) (p.pp > 1 ? pipe : flat) = true;
  const int64_t n = static_cast<int64_t>(order.size());
  if (n == 0 || !pipe || !flat) return out;
  const int64_t nq = static_cast<int64_t>(sizeof(kStartQuantiles) / sizeof(double));
  for (int64_t k = 1; k < std::min(starts, nq); ++k) {
    const int64_t pos = std::min(n - 1, static_cast<int64_t>(kStartQuantiles[k] * static_cast<double>(n)));
    const int64_t theta = order[n - 1 - pos].len;  // order is by length descending
    if (theta < order[0].len && std::find(out.begin(), out.end(), theta) == out.end()) out.push_back(theta);
  }
  return out;
}

// `moves` random moves (a random sequence to a random other replica that can hold it).
void kick(State& st, const int64_t* len, int64_t n, const std::vector<Params>& params, SplitMix64& rng,
          int64_t moves) {
  const int64_t R = static_cast<int64_t>(params.size());
  std::vector<int64_t> where(n, 0);
  for (int64_t r = 0; r < R; ++r)
    for (const Item& it : st.mem[r]) where[it.idx] = r;
  for (int64_t k = 0; k < moves; ++k) {
    const int64_t i = static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(n)));
    const int64_t r = where[i];
    int64_t t = static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(R - 1)));
    if (t >= r) ++t;
    if (len[i] > params[t].cap()) continue;
    const Item it{len[i], i};
    auto& from = st.mem[r];
    from.erase(std::lower_bound(from.begin(), from.end(), it, item_before));
    insert_sorted(st.mem[t], it);
    where[i] = t;
  }
  recompute(st, params);
}

}  // namespace

BalanceOut balance(const int64_t* len, int64_t n, const std::vector<Params>& params, uint64_t seed, int64_t restarts,
                   bool local_search, int64_t budget, int64_t starts) {
  const std::vector<Type> types = replica_types(params);
  const std::vector<Item> order = sorted_items(len, n);
  State best(params.size());
  double best_ms = 0.0, greedy_ms = 0.0;
  bool have = false;
  for (int64_t theta : start_thresholds(order, params, starts)) {
    State st = greedy(params, types, order, theta);
    recompute(st, params);
    if (!have) greedy_ms = max_of(st.est);
    if (local_search) {
      Search(st, params, budget).run();
      recompute(st, params);
    }
    if (!have || max_of(st.est) < best_ms) {
      best_ms = max_of(st.est);
      best = std::move(st);
      have = true;
    }
  }
  SplitMix64 rng(seed);
  if (params.size() > 1 && n > 0) {
    for (int64_t k = 0; k < restarts; ++k) {
      State cur = best;
      kick(cur, len, n, params, rng, kKickMin + k % kKickSpread);
      if (local_search) {
        Search(cur, params, budget).run();
        recompute(cur, params);
      }
      const double ms = max_of(cur.est);
      if (ms <= best_ms) {
        best = std::move(cur);
        best_ms = ms;
      }
    }
  }
  BalanceOut out;
  out.assignment.assign(n, 0);
  for (size_t r = 0; r < params.size(); ++r)
    for (const Item& it : best.mem[r]) out.assignment[it.idx] = static_cast<int64_t>(r);
  out.est = best.est;
  out.makespan = best_ms;
  out.greedy_makespan = greedy_ms;
  return out;
}

}  // namespace dcp
