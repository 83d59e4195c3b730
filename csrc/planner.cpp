// The adaptive planner's hot loops in C++, each bit for bit its Python reference:
//  - stage 1, which replica runs each document: the earliest-finish pass of
//    AdaptivePlanner._stage1 (longest document first), then the moves and swaps of
//    dcp_ext/planning/planners/rebalance.py;
//  - stage 2's first-fit-decreasing packing (planners/packing.py, without a memory check);
//  - the candidate pool's dynamic program (planners/candidates.py);
//  - stage 2's pricing of a single-stage replica (planners/packing.finish_replica for
//    pp == 1 without quadratic memory: each micro-batch's statistics, the cap check and
//    the sum of StageCoeffs.mb_time);
//  - stage 2 of a whole full plan in one call (pack_replicas: planners/packing.pack_replica
//    for every replica with memory linear in tokens, then the pricing above for the
//    single-stage ones).
//
// Why it exists: the planner runs every iteration on every rank beside the step, and
// builds its pool at every start; these were Python loops over every document, replica
// and type. The Python code stays the reference (tests/planning/test_planner_kernels.py holds the
// two equal on real batches): every float expression keeps its operation order,
// np.maximum/np.minimum keep NaN, ties go the way Python's heapq, sorted() and np.argmin
// send them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <utility>
#include <vector>

#include "numpy_float.hpp"

namespace py = pybind11;
using dcp_np::kInf;
using dcp_np::nmax;
using dcp_np::nmin;

namespace {

struct Type {  // TypeOnBatch: what its finish estimate needs
  int64_t pp;
  double c0, mb_full;
  const double* cost;  // [n] per sorted position, inf where it cannot hold

  // TypeOnBatch.overhead (both of its branches: for work > 0 they agree, else 0)
  double overhead(double work, double big) const {
    if (pp == 1) return 0.0;
    const double q = static_cast<double>(pp - 1);
    const double over = nmin(2.0 * std::sqrt(q * c0 * nmax(work, 0.0)), q * mb_full);
    return nmax(over, q * big);
  }
  double finish(double sync, double work, double big) const {
    if (pp == 1) return sync + work;
    return sync + work + overhead(work, big);
  }
};

struct Stage1 {
  std::vector<Type> types;
  std::vector<int64_t> type_of;  // per replica
  std::vector<double> sync;
  int64_t n = 0;
  std::vector<std::vector<int64_t>> docs;  // per replica, positions in the order received
  std::vector<double> work, big, times;

  int64_t R() const { return static_cast<int64_t>(type_of.size()); }
  const Type& t(int64_t k) const { return types[type_of[k]]; }

  // rebalance.largest_cost
  double largest(int64_t k) const {
    if (t(k).pp == 1 || docs[k].empty()) return 0.0;
    double m = t(k).cost[docs[k][0]];
    for (size_t i = 1; i < docs[k].size(); ++i) m = std::max(m, t(k).cost[docs[k][i]]);
    return m;
  }

  void refresh(int64_t k) {
    big[k] = largest(k);
    times[k] = t(k).finish(sync[k], work[k], big[k]);
  }

  // the first m replicas of ks (ascending indices) by estimated finish, earliest first:
  // sorted() is stable, so ties go by index. A partial sort, not a full one (this runs on
  // every move); a NaN time, which a stable sort places by its own rules, takes the full sort.
  std::vector<int64_t> earliest(std::vector<int64_t> ks, int64_t m) const {
    const size_t keep = static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(m, static_cast<int64_t>(ks.size()))));
    bool nan = false;
    for (int64_t k : ks) nan = nan || std::isnan(times[k]);
    if (nan) {
      std::stable_sort(ks.begin(), ks.end(), [&](int64_t a, int64_t b) { return times[a] < times[b]; });
    } else {
      std::partial_sort(ks.begin(), ks.begin() + keep, ks.end(), [&](int64_t a, int64_t b) {
        return times[a] < times[b] || (times[a] == times[b] && a < b);
      });
    }
    ks.resize(keep);
    return ks;
  }

  // stage 1a: earliest finish, longest first; a document may go to the types of `order`
  // up to the one whose length range holds it (j_of_pos), else to any type that can
  void assign(const std::vector<int64_t>& order, const std::vector<int64_t>& j_of_pos) {
    using Entry = std::pair<double, int64_t>;  // (finish, replica): heapq's tuple order
    using Heap = std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>>;
    const int64_t nt = static_cast<int64_t>(order.size());
    std::vector<Heap> heaps(nt);
    for (int64_t j = 0; j < nt; ++j)
      for (int64_t k = 0; k < R(); ++k)
        if (type_of[k] == order[j]) heaps[j].push({sync[k], k});
    docs.assign(R(), {});
    work.assign(R(), 0.0);
    big.assign(R(), 0.0);
    for (int64_t p = 0; p < n; ++p) {
      int64_t jmax = std::min(j_of_pos[p], nt - 1);
      int64_t best_k = -1, best_j = -1;
      double best_t = kInf;
      for (int64_t j = 0; j <= jmax; ++j) {
        const Type& ty = types[order[j]];
        const double c = ty.cost[p];
        if (c == kInf || heaps[j].empty()) continue;
        const auto [load, k] = heaps[j].top();
        const double tt = ty.pp > 1 ? ty.finish(sync[k], work[k] + c, big[k] > c ? big[k] : c) : load + c;
        if (tt < best_t) best_k = k, best_t = tt, best_j = j;
      }
      if (best_k < 0) {  // nothing up to its range holds it: any type that can
        for (int64_t j = 0; j < nt; ++j) {
          const Type& ty = types[order[j]];
          const double c = ty.cost[p];
          if (c == kInf || heaps[j].empty()) continue;
          const int64_t k = heaps[j].top().second;
          const double tt = ty.finish(sync[k], work[k] + c, c > big[k] ? c : big[k]);  // max(big, c)
          if (tt < best_t) best_k = k, best_t = tt, best_j = j;
        }
      }
      if (best_k < 0) throw std::runtime_error("a sequence fits no replica");  // the caller checks first
      const Type& ty = types[order[best_j]];
      const double c = ty.cost[p];
      docs[best_k].push_back(p);
      work[best_k] += c;
      if (ty.pp > 1 && c > big[best_k]) big[best_k] = c;
      heaps[best_j].pop();
      heaps[best_j].push({best_t, best_k});
    }
  }

  // stage 1b (rebalance.rebalance): single moves off the latest replica, then swaps
  void rebalance(int64_t move_targets, int64_t max_moves) {
    const int64_t R_ = R();
    if (R_ < 2) return;
    big.assign(R_, 0.0);
    times.assign(R_, 0.0);
    for (int64_t k = 0; k < R_; ++k) refresh(k);
    std::vector<int64_t> all(R_);
    for (int64_t k = 0; k < R_; ++k) all[k] = k;
    const int64_t limit = max_moves >= 0 ? max_moves : 4 * R_ + 16;
    int64_t swaps = 0;
    std::vector<double> a;
    for (int64_t it = 0; it < limit; ++it) {
      int64_t hi = 0;  // latest; ties: the lowest index
      for (int64_t k = 1; k < R_; ++k)
        if (times[k] > times[hi]) hi = k;
      const double t_hi = times[hi];
      if (docs[hi].empty()) break;
      const Type& th = t(hi);
      const auto& dh = docs[hi];
      const int64_t nh = static_cast<int64_t>(dh.size());
      double top0 = -kInf, top1 = 0.0;  // the two largest costs on hi (np.sort, reversed)
      if (th.pp > 1) {
        std::vector<double> ch(nh);
        for (int64_t i = 0; i < nh; ++i) ch[i] = th.cost[dh[i]];
        std::sort(ch.begin(), ch.end(), std::greater<double>());
        top0 = ch[0];
        top1 = nh > 1 ? ch[1] : 0.0;
      }
      a.resize(nh);
      for (int64_t i = 0; i < nh; ++i) {
        const double c = th.cost[dh[i]];
        const double big_after = th.pp > 1 ? (c >= top0 ? top1 : top0) : 0.0;
        a[i] = th.finish(sync[hi], work[hi] - c, big_after);
      }
      bool found = false;
      double best_m = 0.0;
      int64_t best_i = -1, best_lo = -1;
      const auto targets = earliest(all, move_targets);
      for (int64_t x = 0; x < static_cast<int64_t>(targets.size()); ++x) {
        const int64_t lo = targets[x];
        if (lo == hi || t_hi - times[lo] <= 1e-9 * t_hi) continue;
        const Type& tl = t(lo);
        double mj = kInf;
        int64_t j = -1;
        for (int64_t i = 0; i < nh; ++i) {  // np.argmin: the first of the least
          const double cn = tl.cost[dh[i]];
          const double bl = tl.pp > 1 ? nmax(big[lo], cn) : 0.0;
          double m = nmax(a[i], tl.finish(sync[lo], work[lo] + cn, bl));
          if (!std::isfinite(cn)) m = kInf;
          if (j < 0 || m < mj || (std::isnan(m) && !std::isnan(mj))) mj = m, j = i;
          if (std::isnan(mj)) break;
        }
        if (mj < t_hi - 1e-12 && (!found || mj < best_m)) found = true, best_m = mj, best_i = j, best_lo = lo;
      }
      if (!found) {
        double least = times[0];
        for (int64_t k = 1; k < R_; ++k) least = std::min(least, times[k]);
        if (t_hi - least <= 2e-3 * t_hi || swaps >= R_) break;
        ++swaps;
        if (!swap(hi, move_targets)) break;
        continue;
      }
      const int64_t p = dh[best_i];
      docs[hi].erase(docs[hi].begin() + best_i);
      work[hi] -= th.cost[p];
      docs[best_lo].push_back(p);
      work[best_lo] += t(best_lo).cost[p];
      refresh(hi);
      refresh(best_lo);
    }
  }

  // rebalance._swap: one document of the latest replica for a cheaper one of an earlier
  // replica (of its layout, or of the move_targets earliest), if that lowers the later
  bool swap(int64_t hi, int64_t move_targets) {
    const int64_t R_ = R();
    const double t_hi = times[hi];
    std::vector<int64_t> same_type, all(R_);
    for (int64_t k = 0; k < R_; ++k) {
      all[k] = k;
      if (type_of[k] == type_of[hi]) same_type.push_back(k);
    }
    std::vector<int64_t> cands;
    for (const auto& group : {earliest(same_type, move_targets), earliest(all, move_targets)})
      for (int64_t x = 0; x < static_cast<int64_t>(group.size()); ++x)
        if (std::find(cands.begin(), cands.end(), group[x]) == cands.end()) cands.push_back(group[x]);
    // the sync as recovered from k's current time, as the reference does (the bits differ)
    auto base_of = [&](int64_t k) {
      double base = times[k] - work[k];
      if (t(k).pp > 1) base = base - t(k).overhead(work[k], big[k]);
      return base;
    };
    bool found = false;
    double best_m = 0.0;
    int64_t bi = -1, blo = -1, bj = -1;
    const Type& th = t(hi);
    for (int64_t lo : cands) {
      if (lo == hi || times[lo] >= t_hi) continue;
      const auto &dh = docs[hi], &dl = docs[lo];
      if (dh.empty() || dl.empty()) continue;
      const Type& tl = t(lo);
      const double base_hi = base_of(hi), base_lo = base_of(lo);
      double mm = kInf;
      int64_t fi = -1, fj = -1;
      for (size_t i = 0; i < dh.size(); ++i) {
        const double hp = th.cost[dh[i]], lp = tl.cost[dh[i]];
        for (size_t j = 0; j < dl.size(); ++j) {
          const double hq = th.cost[dl[j]], lq = tl.cost[dl[j]];
          const double w_hi = work[hi] - hp + hq, w_lo = work[lo] - lq + lp;
          const double b_hi = th.pp > 1 ? nmax(big[hi], hq) : 0.0;
          const double b_lo = tl.pp > 1 ? nmax(big[lo], lp) : 0.0;
          double m = nmax(th.finish(base_hi, w_hi, b_hi), tl.finish(base_lo, w_lo, b_lo));
          if (!(std::isfinite(m) && hq < hp)) m = kInf;
          if (fi < 0 || m < mm) mm = m, fi = static_cast<int64_t>(i), fj = static_cast<int64_t>(j);
        }
      }
      if (mm < t_hi - 1e-9 && (!found || mm < best_m)) found = true, best_m = mm, bi = fi, blo = lo, bj = fj;
    }
    if (!found) return false;
    const int64_t p = docs[hi][bi], q = docs[blo][bj];
    docs[hi][bi] = q;
    docs[blo][bj] = p;
    work[hi] += t(hi).cost[q] - t(hi).cost[p];
    work[blo] += t(blo).cost[p] - t(blo).cost[q];
    refresh(hi);
    refresh(blo);
    return true;
  }
};

using Arr = py::array_t<double, py::array::c_style | py::array::forcecast>;
using IntArr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

}  // namespace

// costs [T, n]: per type of the placement, its cost per sorted position; pp, c0, mb_full
// per type; type_of and sync per replica; order: type indices in the estimate's order;
// j_of_pos: per position, the last index into order allowed first. Returns each replica's
// positions (stage 1a, then rebalance with move_targets and max_moves, -1 for none).
py::list stage1(const Arr& costs, const IntArr& pp, const Arr& c0, const Arr& mb_full, const IntArr& type_of,
                const Arr& sync, const IntArr& order, const IntArr& j_of_pos, int64_t move_targets, int64_t max_moves) {
  if (costs.ndim() != 2) throw py::value_error("costs must be [types, n]");
  const int64_t T = costs.shape(0), n = costs.shape(1);
  if (pp.size() != T || c0.size() != T || mb_full.size() != T) throw py::value_error("one pp, c0, mb_full per type");
  if (sync.size() != type_of.size()) throw py::value_error("one sync per replica");
  if (j_of_pos.size() != n) throw py::value_error("one j_of_pos per document");
  Stage1 s;
  s.n = n;
  for (int64_t t = 0; t < T; ++t) s.types.push_back({pp.data()[t], c0.data()[t], mb_full.data()[t], costs.data() + t * n});
  for (py::ssize_t k = 0; k < type_of.size(); ++k) {
    const int64_t t = type_of.data()[k];
    if (t < 0 || t >= T) throw py::value_error("type_of out of range");
    s.type_of.push_back(t);
    s.sync.push_back(sync.data()[k]);
  }
  std::vector<int64_t> ord(order.data(), order.data() + order.size()), jp(j_of_pos.data(), j_of_pos.data() + n);
  for (int64_t t : ord)
    if (t < 0 || t >= T) throw py::value_error("order out of range");
  {
    py::gil_scoped_release nogil;
    s.assign(ord, jp);
    s.rebalance(move_targets, max_moves);
  }
  py::list out;
  for (const auto& d : s.docs) out.append(py::cast(d));
  return out;
}

void register_stage1(py::module_& m) {
  m.def("stage1", &stage1, py::arg("costs"), py::arg("pp"), py::arg("c0"), py::arg("mb_full"), py::arg("type_of"),
        py::arg("sync"), py::arg("order"), py::arg("j_of_pos"), py::arg("move_targets"), py::arg("max_moves"));
}

// ---------------------------------------------------------------------------------------
// The candidate pool's dynamic program (planners/candidates.py, best_mix_by_dynamic_program):
// per time T, the fewest devices that finish the batch by T, types in order, each taking
// a contiguous range of document bins; bisection on T; the replicas per type of the
// smallest feasible T. Same arithmetic as the numpy reference.
namespace {

struct MixType {
  double sync, c0, mb_full;
  int64_t pp, size;
  const double *cum, *alone, *first;  // [nb+1] prefix work at bin bounds; [nb] alone at a bin's start; [nb+1]
  const uint8_t* start_ok;             // [nb] the bin's first document is one the type can hold
};

double pipeline_capacity(double room, int64_t pp, double c0, double mb_full) {
  if (room <= 0) return 0.0;
  if (pp == 1) return room;
  const double k = static_cast<double>(pp - 1) * c0;
  const double r = std::sqrt(k + room) - std::sqrt(k);
  const double w_sqrt = r * r;
  const double other = room - static_cast<double>(pp - 1) * mb_full;
  return other > w_sqrt ? other : w_sqrt;  // max(w_sqrt, other)
}

struct MixDP {
  std::vector<MixType> types;  // in the order the reference lists them
  int64_t nb = 0, world = 0;
  std::vector<std::vector<int64_t>> e_choice;
  std::vector<std::vector<double>> q_choice;

  double solve(double T) {
    const int64_t nt = static_cast<int64_t>(types.size());
    std::vector<double> f_next(nb + 1, kInf), f(nb + 1);
    f_next[nb] = 0.0;
    e_choice.assign(nt, std::vector<int64_t>(nb + 1));
    q_choice.assign(nt, std::vector<double>(nb + 1, 0.0));
    for (int64_t j = nt - 1; j >= 0; --j) {
      const MixType& t = types[j];
      const double w = pipeline_capacity(T - t.sync, t.pp, t.c0, t.mb_full);
      auto& ec = e_choice[j];
      auto& qc = q_choice[j];
      if (w <= 0) {
        for (int64_t s = 0; s <= nb; ++s) ec[s] = s;
        continue;  // f_next unchanged
      }
      const double most = static_cast<double>(world / t.size);
      for (int64_t s = 0; s <= nb; ++s) {
        const bool ok_start = s < nb && t.start_ok[s] && t.alone[s] + t.sync <= T;
        double best = kInf, best_q = 0.0;
        int64_t best_e = 0;
        bool any = false;
        for (int64_t e = 0; e <= nb; ++e) {
          double diff = t.cum[e] - t.cum[s];
          if (t.pp > 1) diff = diff + static_cast<double>(t.pp - 1) * t.first[s];
          double q = std::ceil(diff / w - 1e-12);
          q = nmax(q, 1.0);
          const bool valid = e > s && ok_start && q <= most;
          const double gpus = valid ? q * static_cast<double>(t.size) + f_next[e] : kInf;
          if (!any || gpus < best) best = gpus, best_e = e, best_q = q, any = true;  // np.argmin: first least
        }
        const bool use = best < f_next[s];
        f[s] = use ? best : f_next[s];
        ec[s] = use ? best_e : s;
        qc[s] = use ? best_q : 0.0;
      }
      f_next.swap(f);
    }
    return f_next[0];
  }
};

}  // namespace

py::tuple mix_dynamic_program(const Arr& cum, const Arr& alone, const Arr& first,
                              const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& start_ok,
                              const Arr& sync, const IntArr& pp, const Arr& c0, const Arr& mb_full, const IntArr& size,
                              int64_t world, double lo, double rel_tol) {
  if (cum.ndim() != 2) throw py::value_error("cum must be [types, bins + 1]");
  const int64_t nt = cum.shape(0), nb = cum.shape(1) - 1;
  if (first.ndim() != 2 || first.shape(0) != nt || first.shape(1) != nb + 1 || alone.ndim() != 2 ||
      alone.shape(0) != nt || alone.shape(1) != nb || start_ok.ndim() != 2 || start_ok.shape(0) != nt ||
      start_ok.shape(1) != nb)
    throw py::value_error("per-type tables of mismatched shapes");
  if (sync.size() != nt || pp.size() != nt || c0.size() != nt || mb_full.size() != nt || size.size() != nt)
    throw py::value_error("one sync, pp, c0, mb_full and size per type");
  MixDP dp;
  dp.nb = nb;
  dp.world = world;
  for (int64_t j = 0; j < nt; ++j)
    dp.types.push_back({sync.data()[j], c0.data()[j], mb_full.data()[j], pp.data()[j], size.data()[j],
                        cum.data() + j * (nb + 1), alone.data() + j * nb, first.data() + j * (nb + 1),
                        start_ok.data() + j * nb});
  std::vector<int64_t> counts(nt, 0);
  double hi = std::max(lo, 1e-9);
  bool feasible = false;
  {
    py::gil_scoped_release nogil;
    for (int it = 0; it < 60; ++it) {
      if (dp.solve(hi) <= static_cast<double>(world)) {
        feasible = true;
        break;
      }
      lo = hi;
      hi = hi * 1.25;
    }
  }
  if (!feasible) return py::make_tuple(py::none(), hi);  // diverged
  {
    py::gil_scoped_release nogil;
    for (int it = 0; it < 40; ++it) {
      if (hi - lo <= rel_tol * hi) break;
      const double mid = 0.5 * (lo + hi);
      if (dp.solve(mid) <= static_cast<double>(world))
        hi = mid;
      else
        lo = mid;
    }
    dp.solve(hi);
    int64_t i = 0;
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t q = static_cast<int64_t>(dp.q_choice[j][i]);
      if (q > 0) counts[j] += q;
      i = dp.e_choice[j][i];
    }
  }
  return py::make_tuple(counts, hi);
}

// planners/packing.first_fit_decreasing without a check, on item indices 0..n-1 of sizes
// x: largest first (ties keep their order), each into the first bin with room, else a
// new bin.
std::vector<std::vector<int64_t>> ffd_indices(const std::vector<double>& x, double cap) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return -x[a] < -x[b]; });
  std::vector<std::vector<int64_t>> bins;
  std::vector<double> room;
  for (int64_t i : order) {
    size_t b = 0;
    while (b < room.size() && !(x[i] <= room[b])) ++b;
    if (b < room.size()) {
      bins[b].push_back(i);
      room[b] = room[b] - x[i];
    } else {
      bins.push_back({i});
      room.push_back(cap - x[i]);
    }
  }
  return bins;
}

// first_fit_decreasing for Python: bins of `docs` by their `sizes`.
py::list first_fit_decreasing(const IntArr& docs, const Arr& sizes, double cap) {
  const int64_t n = docs.size();
  if (sizes.size() != n) throw py::value_error("one size per document");
  std::vector<std::vector<int64_t>> bins;
  {
    py::gil_scoped_release nogil;
    bins = ffd_indices(std::vector<double>(sizes.data(), sizes.data() + n), cap);
    for (auto& b : bins)
      for (auto& i : b) i = docs.data()[i];
  }
  py::list out;
  for (const auto& b : bins) out.append(py::cast(b));
  return out;
}

// StageCoeffs.mb_time(s2, t, n) of one micro-batch, c = (c0, a, b, c, cp_att, cp_comm,
// cp_layers, cp_recompute), in its operation order (excess 0 without cp_comm).
double mb_time(const double* c, double S2, double T, int64_t n, double attn_bwd_factor) {
  double excess = 0.0;
  if (c[5] != 0.0) {
    double att = c[4] * S2, com = c[5] * T;
    double ex_f = nmax(0.0, com - att);
    double ex_b = nmax(0.0, 2.0 * com - attn_bwd_factor * att);
    excess = (c[6] + c[7]) * ex_f + c[6] * ex_b;
  }
  return c[0] + c[1] * S2 + c[2] * T + c[3] * static_cast<double>(n) + excess;
}

// One micro-batch of finish_replica's single-stage pricing: its exact integer sums s2 and
// t (rounded to double once), n documents, at recompute level rs; adds its mb_time to
// `pipe` and returns whether t is within caps[rs] (times 1 + 1e-12).
bool price_mb(int64_t s2, int64_t t, int64_t n, int64_t rs, const double* coef, const double* caps,
              double attn_bwd_factor, double& pipe) {
  const double S2 = static_cast<double>(s2), T = static_cast<double>(t);
  pipe += mb_time(coef + 8 * rs, S2, T, n, attn_bwd_factor);
  return T <= caps[rs] * (1 + 1e-12);
}

// planners/packing.finish_replica, pp == 1 and memory linear in tokens: per micro-batch
// (docs, rs) of `mbs`, s2 = sum of squared lengths and t = sum of lengths (exact integer
// sums, as Python's ints, then rounded to double once), n = its document count; ok while
// every t <= caps[rs] * (1 + 1e-12) (caps[rs] = -inf where rs is not allowed); pipe = the
// sequential sum of mb_time with coef[rs], in the micro-batches' order.
py::tuple price_single_stage(const py::object& lengths, const py::list& mbs, const Arr& coef, const Arr& caps,
                             double attn_bwd_factor) {
  // the batch's lengths: a list of Python ints (the planner's s_list, read only where a
  // micro-batch's document sits) or an int64 array
  const bool is_list = py::isinstance<py::list>(lengths);
  IntArr arr;
  if (!is_list) {
    if (!py::isinstance<py::array>(lengths)) throw py::type_error("lengths must be a list or an array of ints");
    py::array a = py::reinterpret_borrow<py::array>(lengths);
    if (a.dtype().kind() != 'i' && a.dtype().kind() != 'u') throw py::type_error("lengths must be ints");
    arr = IntArr::ensure(lengths);
  }
  PyObject* list = lengths.ptr();
  const int64_t n_len = is_list ? static_cast<int64_t>(PyList_GET_SIZE(list)) : arr.shape(0);
  const int64_t* data = is_list ? nullptr : arr.data();
  auto length_at = [&](int64_t i) -> int64_t {
    if (i < 0 || i >= n_len) throw std::out_of_range("document index outside the batch");
    if (!is_list) return data[i];
    PyObject* o = PyList_GET_ITEM(list, i);
    if (!PyLong_Check(o)) throw py::type_error("lengths must be ints");
    return PyLong_AsLongLong(o);
  };
  const int64_t levels = caps.shape(0);
  if (coef.ndim() != 2 || coef.shape(0) != levels || coef.shape(1) != 8)
    throw std::invalid_argument("coef must be [levels, 8] and caps [levels]");
  const double* cf = coef.data();
  const double* cap = caps.data();
  bool ok = true;
  double pipe = 0.0;
  for (const py::handle& item : mbs) {
    py::sequence mb = py::reinterpret_borrow<py::sequence>(item);
    int64_t rs = mb[1].cast<int64_t>();
    if (rs < 0 || rs >= levels) throw std::out_of_range("recompute level outside the coefficient table");
    int64_t s2 = 0, t = 0, n = 0;
    for (const py::handle& d : py::reinterpret_borrow<py::iterable>(mb[0])) {
      const int64_t x = length_at(d.cast<int64_t>());
      s2 += x * x;
      t += x;
      ++n;
    }
    if (!price_mb(s2, t, n, rs, cf, cap, attn_bwd_factor, pipe)) ok = false;
  }
  return py::make_tuple(ok, pipe);
}

// FFD of `items` (batch positions) by their lengths: ffd_indices, mapped back to positions.
std::vector<std::vector<int64_t>> ffd_bins(const std::vector<int64_t>& items, const int64_t* len, double cap) {
  std::vector<double> x(items.size());
  for (size_t i = 0; i < items.size(); ++i) x[i] = static_cast<double>(len[items[i]]);
  auto bins = ffd_indices(x, cap);
  for (auto& b : bins)
    for (auto& i : b) i = items[i];
  return bins;
}

// planners/packing.pack_replica's pipelined branch without a memory check: m micro-batches
// (balancing bubble against the per-micro-batch constant), filled longest first, each
// document into the least loaded bin with token room (up to 8 fuller ones set aside),
// else a new bin. heapq pops the least (load, bin) and bins are unique, so any priority
// queue pops the same. `items`: (batch position, sorted position) in the replica's order;
// cost: the type's stage cost per sorted position. false where the count is not finite.
bool lpt_bins(const std::vector<std::pair<int64_t, int64_t>>& items, const int64_t* len, const double* cost,
              double cap, int64_t pp, double c0, std::vector<std::vector<int64_t>>& bins) {
  const int64_t n = static_cast<int64_t>(items.size());
  double w = 0.0;
  int64_t tok = 0;
  for (const auto& it : items) {
    w += cost[it.second];
    tok += len[it.first];
  }
  const double tokens = static_cast<double>(tok);
  const double m_mem = cap > 0 ? std::ceil(1.0 * tokens / cap) : static_cast<double>(n);
  const double m_opt = c0 > 0 ? std::nearbyint(std::sqrt(static_cast<double>(pp - 1) * w / c0)) : static_cast<double>(n);
  if (!std::isfinite(m_mem) || !std::isfinite(m_opt)) return false;
  double md = std::max(std::max(m_mem, m_opt), 1.0);
  md = std::max(1.0, std::min(md, static_cast<double>(n)));
  const int64_t m = static_cast<int64_t>(md);
  struct Entry {
    double load;
    int64_t bin;
    double tokens;
    bool operator>(const Entry& o) const { return load > o.load || (load == o.load && bin > o.bin); }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  bins.assign(m, {});
  for (int64_t i = 0; i < m; ++i) heap.push({0.0, i, 0.0});
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return -len[items[a].first] < -len[items[b].first]; });
  std::vector<Entry> aside;
  for (int64_t i : order) {
    const double x = static_cast<double>(len[items[i].first]);
    const double c = cost[items[i].second];
    auto takes = [&](const Entry& e) { return e.tokens + x <= cap; };
    aside.clear();
    while (!heap.empty() && !takes(heap.top()) && aside.size() < 8) {
      aside.push_back(heap.top());
      heap.pop();
    }
    Entry e;
    if (!heap.empty() && takes(heap.top())) {
      e = heap.top();
      heap.pop();
    } else {
      bins.push_back({});
      e = {0.0, static_cast<int64_t>(bins.size()) - 1, 0.0};
    }
    bins[e.bin].push_back(items[i].first);
    heap.push({e.load + c, e.bin, e.tokens + x});
    for (const Entry& a : aside) heap.push(a);
  }
  bins.erase(std::remove_if(bins.begin(), bins.end(), [](const std::vector<int64_t>& b) { return b.empty(); }),
             bins.end());
  return true;
}

// Stage 2 of a full plan for its replicas with memory linear in tokens, in one call:
// planners/packing.pack_replica (a document longer than the type's longest packed one runs
// alone at the least recompute whose cap holds it, TypeTable.rs_planned; the rest packed by
// FFD, or on pipelines by lpt_bins), then, for single-stage replicas, finish_replica's
// pricing. docs[k]: replica k's sorted positions (stage 1's output); order: sorted position
// -> batch position; lengths by batch position. Per type t: cap_mb[t], pp[t], its allowed
// levels (levels[t, :n_levels[t]]) with their caps doc_caps[t, :] (TypeTable.doc_caps),
// coef[t] and caps[t] as price_single_stage's, stage costs cost[t] per sorted position.
// type_of[k] < 0: not here. Per replica: None where the Python path must run it (not here,
// a document no level holds, a micro-batch over its cap), else (pipe, [(batch positions,
// rs), ...]) with pipe = NaN on pipelines (finish_replica prices them).
py::list pack_replicas(const IntArr& lengths, const IntArr& order, const py::list& docs, const IntArr& type_of,
                       const Arr& cap_mb, const IntArr& pp, const IntArr& levels, const Arr& doc_caps,
                       const IntArr& n_levels, const Arr& coef, const Arr& caps, const Arr& cost,
                       double attn_bwd_factor) {
  const int64_t R = type_of.shape(0), T = cap_mb.shape(0);
  if (static_cast<int64_t>(py::len(docs)) != R) throw py::value_error("one document list per replica");
  if (levels.ndim() != 2 || levels.shape(0) != T || doc_caps.ndim() != 2 || doc_caps.shape(0) != T ||
      doc_caps.shape(1) != levels.shape(1) || n_levels.shape(0) != T || pp.shape(0) != T)
    throw py::value_error("levels and doc_caps must be [types, L], n_levels and pp [types]");
  if (coef.ndim() != 3 || coef.shape(0) != T || coef.shape(2) != 8 || caps.ndim() != 2 || caps.shape(0) != T ||
      caps.shape(1) != coef.shape(1) || coef.shape(1) < 1)
    throw py::value_error("coef must be [types, levels, 8] and caps [types, levels]");
  const int64_t L = levels.shape(1), C = caps.shape(1), n_len = lengths.shape(0), n_ord = order.shape(0);
  if (cost.ndim() != 2 || cost.shape(0) != T || cost.shape(1) != n_ord)
    throw py::value_error("cost must be [types, documents]");
  const int64_t* len = lengths.data();
  const int64_t* ord = order.data();
  const int64_t* tof = type_of.data();
  // read the positions first (Python objects), then pack and price without the GIL
  std::vector<std::vector<std::pair<int64_t, int64_t>>> items(R);  // (batch position, sorted position)
  for (int64_t k = 0; k < R; ++k) {
    if (tof[k] < 0) continue;
    if (tof[k] >= T) throw std::out_of_range("type index outside the tables");
    for (const py::handle& p : py::reinterpret_borrow<py::iterable>(docs[k])) {
      const int64_t pos = p.cast<int64_t>();
      if (pos < 0 || pos >= n_ord) throw std::out_of_range("position outside the batch");
      const int64_t b = ord[pos];
      if (b < 0 || b >= n_len) throw std::out_of_range("batch position outside the lengths");
      items[k].push_back({b, pos});
    }
  }
  struct Out {
    bool python = true;
    double pipe = 0.0;
    std::vector<std::pair<std::vector<int64_t>, int64_t>> mbs;
  };
  std::vector<Out> out(R);
  {
    py::gil_scoped_release nogil;
    std::vector<std::pair<int64_t, int64_t>> shorts;
    std::vector<int64_t> short_b;
    std::vector<std::vector<int64_t>> bins;
    for (int64_t k = 0; k < R; ++k) {
      const int64_t t = tof[k];
      Out& o = out[k];
      if (t < 0) continue;
      o.python = false;
      if (items[k].empty()) continue;
      const double cap = cap_mb.data()[t];
      const int64_t* lv = levels.data() + L * t;
      const double* dc = doc_caps.data() + L * t;
      const int64_t nl = n_levels.data()[t];
      const double* cf = coef.data() + C * 8 * t;
      const double* cp = caps.data() + C * t;
      const bool pipelined = pp.data()[t] > 1;
      shorts.clear();
      bool fine = true;
      for (const auto& it : items[k]) {
        const double x = static_cast<double>(len[it.first]);
        if (!(x > cap)) {
          shorts.push_back(it);
          continue;
        }
        const int64_t i = std::lower_bound(dc, dc + nl, x) - dc;  // bisect_left
        if (i >= nl) {
          fine = false;  // no level holds it: the Python path says so
          break;
        }
        o.mbs.push_back({{it.first}, lv[i]});
      }
      if (fine && !shorts.empty()) {
        if (pipelined) {
          fine = lpt_bins(shorts, len, cost.data() + n_ord * t, cap, pp.data()[t], cf[0], bins);
        } else {
          short_b.clear();
          for (const auto& it : shorts) short_b.push_back(it.first);
          bins = ffd_bins(short_b, len, cap);
        }
        if (fine)
          for (auto& bin : bins) o.mbs.push_back({std::move(bin), 0});
      }
      if (pipelined) {
        o.pipe = std::numeric_limits<double>::quiet_NaN();
        o.python = !fine;
        continue;
      }
      for (const auto& mb : o.mbs) {
        if (!fine) break;
        const int64_t rs = mb.second;
        if (rs < 0 || rs >= C) {
          fine = false;
          break;
        }
        int64_t s2 = 0, tok = 0;
        for (int64_t b : mb.first) {
          s2 += len[b] * len[b];
          tok += len[b];
        }
        if (!price_mb(s2, tok, static_cast<int64_t>(mb.first.size()), rs, cf, cp, attn_bwd_factor, o.pipe))
          fine = false;
      }
      o.python = !fine;
    }
  }
  py::list res;
  for (int64_t k = 0; k < R; ++k) {
    if (out[k].python) {
      res.append(py::none());
      continue;
    }
    py::list mbs;
    for (const auto& mb : out[k].mbs) mbs.append(py::make_tuple(py::cast(mb.first), mb.second));
    res.append(py::make_tuple(out[k].pipe, mbs));
  }
  return res;
}

void register_mix_dp(py::module_& m) {
  m.def("price_single_stage", &price_single_stage, py::arg("lengths"), py::arg("mbs"), py::arg("coef"), py::arg("caps"),
        py::arg("attn_bwd_factor"));
  m.def("pack_replicas", &pack_replicas, py::arg("lengths"), py::arg("order"), py::arg("docs"),
        py::arg("type_of"), py::arg("cap_mb"), py::arg("pp"), py::arg("levels"), py::arg("doc_caps"),
        py::arg("n_levels"), py::arg("coef"), py::arg("caps"), py::arg("cost"), py::arg("attn_bwd_factor"));
  m.def("first_fit_decreasing", &first_fit_decreasing, py::arg("docs"), py::arg("sizes"), py::arg("cap"));
  m.def("mix_dynamic_program", &mix_dynamic_program, py::arg("cum"), py::arg("alone"), py::arg("first"),
        py::arg("start_ok"), py::arg("sync"), py::arg("pp"), py::arg("c0"), py::arg("mb_full"), py::arg("size"),
        py::arg("world"), py::arg("lo"), py::arg("rel_tol"));
}
