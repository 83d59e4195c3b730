// The lower bound's kernels in C++: its tables (dcp_ext.planning.bound.bound_tables, one
// layout per call) and its search (bound._solve_py), bit for bit.
//
// Why it exists: building the adaptive planner prices each sample batch with the lower
// bound, and its bisection (a [documents x layouts] needs matrix per probed time, ~25
// probes per bisection, two or three bisections per batch, plus the longest-document
// refinement) was 85% of the build at h200x64 in numpy; its tables (every document at
// every recompute level of every layout) the most of the rest at h200x1024. Here the
// same arithmetic runs in one pass, no temporaries.
//
// Equality with the Python reference (tests/planning/test_bound_kernel.py): every expression keeps
// numpy's operation order, FP contraction is off (setup.py), np.maximum/np.minimum keep
// NaN, and every sum numpy takes (`ndarray.sum`, pairwise) is taken the same way
// (`pairwise_sum`). Ties in the refinement's ratio order are broken by document index.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <cstring>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "numpy_float.hpp"

namespace py = pybind11;
using dcp_np::kInf;
using dcp_np::nmax;
using dcp_np::nmin;

namespace {

constexpr double kEps = 1e-9;  // bound._EPS

// numpy's float64 add.reduce of a contiguous array: 0.0 + pairwise sum, 8-way unrolled
// blocks of at most 128.
double pairwise(const double* a, int64_t n) {
  if (n < 8) {
    double r = 0.0;
    for (int64_t i = 0; i < n; ++i) r += a[i];
    return r;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

double pairwise_sum(const std::vector<double>& v) { return 0.0 + pairwise(v.data(), static_cast<int64_t>(v.size())); }

// bound.capacity for one element.
double capacity(double room, double psi, double q, double c0, double c0fb, double cv, double gamma, double theta) {
  const double u = nmax(c0fb, psi);
  const double cap1 = room - q * (u - c0);
  const double simple = room - c0 - q * u;
  const bool cv_fin = std::isfinite(cv);
  const bool use_v = cv_fin && gamma > 0 && q > 0 && c0 > 0;
  const double cvv = cv_fin ? cv : 0.0;
  const double kg = q * gamma;
  const double Rp = room - q * cvv;
  const double c0s = c0 > 0 ? c0 : 1.0;
  const double m_s = nmax(1.0, -kg + std::sqrt(kg * kg + nmax(Rp, 0.0) * kg / c0s));
  const double den = q * u + c0 * kg - q * cvv;
  double m_c = den > 0 ? kg * (room - q * u) / den : 1.0;
  if (!std::isfinite(m_c)) m_c = 1.0;  // nan_to_num(nan=1, posinf=1, neginf=1)
  m_c = nmin(nmax(m_c, 1.0), m_s);     // clip
  auto g = [&](double m) {
    const double f2 = (kg + m > 0) ? (Rp - m * c0) * m / (m + kg) : -kInf;
    return nmin(room - m * c0 - q * u, f2);
  };
  const double best = nmax(nmax(g(1.0), g(m_s)), g(m_c));
  double cap0 = use_v ? best : simple;
  const double free_m = (cv_fin && gamma > 0) ? nmin(room - q * u, Rp) : room - q * u;
  cap0 = c0 > 0 ? cap0 : free_m;
  const double out = theta >= 1 ? cap1 : cap0;
  return out + kEps * std::abs(out);
}

using Arr = py::array_t<double, py::array::c_style | py::array::forcecast>;

struct Tables {  // bound.BoundTables, read-only views
  int64_t n, k;
  const double *x0, *x1, *psi, *alone, *sync, *size, *q, *c0, *c0fb, *cv, *gamma, *theta;
};

// bound._Needs: each document's least need over layouts at time T.
class Needs {
 public:
  // Documents of one length have equal rows in every table: each distinct row is priced
  // once per probe (rows are compared, not assumed equal).
  Needs(const Tables& tb, const int64_t* lengths) : tb_(tb), grp_(tb.n), kind_(tb.k) {
    for (int64_t j = 0; j < tb.k; ++j) {
      const bool th1 = tb.theta[j] >= 1;
      kind_[j] = th1 ? 0 : (tb.q[j] == 0 ? 1 : 2);
      any_cols0_ = any_cols0_ || kind_[j] == 2;
    }
    std::unordered_map<int64_t, int64_t> group_of;
    const size_t row = sizeof(double) * tb.k;
    for (int64_t i = 0; i < tb.n; ++i) {
      auto it = group_of.find(lengths[i]);
      if (it != group_of.end()) {
        const int64_t r = rep_[it->second] * tb.k, e = i * tb.k;
        if (!std::memcmp(tb.x0 + r, tb.x0 + e, row) && !std::memcmp(tb.x1 + r, tb.x1 + e, row) &&
            !std::memcmp(tb.psi + r, tb.psi + e, row) && !std::memcmp(tb.alone + r, tb.alone + e, row)) {
          grp_[i] = it->second;
          continue;
        }
      }
      grp_[i] = static_cast<int64_t>(rep_.size());
      if (it == group_of.end()) group_of.emplace(lengths[i], grp_[i]);
      rep_.push_back(i);
    }
    // per layout, its groups' values side by side (column-major): one pass per layout
    const int64_t G = static_cast<int64_t>(rep_.size());
    G_ = G;
    x_.resize(G * tb.k);
    u_.resize(G * tb.k);
    a_.resize(G * tb.k);
    p_.resize(G * tb.k);
    gbest_.resize(G);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < tb.k; ++j) {
        const int64_t e = rep_[g] * tb.k + j, c = j * G + g;
        x_[c] = tb.theta[j] >= 1 ? tb.x1[e] : tb.x0[e];
        u_[c] = nmax(tb.c0fb[j], tb.psi[e]);
        a_[c] = tb.alone[e];
        p_[c] = tb.psi[e];
      }
  }

  // Each group's least need over layouts at T (no value here is NaN: x is finite where
  // used and cap > 0, so plain minima match np.min).
  void best(double T, std::vector<double>& out) {
    const Tables& tb = tb_;
    const int64_t G = G_;
    std::fill(gbest_.begin(), gbest_.end(), kInf);
    for (int64_t j = 0; j < tb.k; ++j) {
      const double room = T - tb.sync[j];
      if (!(room > 0)) continue;  // no document fits this layout at T
      const double *x = &x_[j * G], *u = &u_[j * G], *al = &a_[j * G], *ps = &p_[j * G];
      const double q = tb.q[j], c0 = tb.c0[j], size = tb.size[j], c0fb = tb.c0fb[j];
      if (kind_[j] == 2) {
        // psi enters capacity only through u = max(c0fb, psi): documents on the c0fb
        // floor (most of them) share one capacity per probe
        const double shared = capacity(room, c0fb, q, c0, c0fb, tb.cv[j], tb.gamma[j], 0.0);
        for (int64_t g = 0; g < G; ++g) {
          if (!(std::isfinite(x[g]) && al[g] <= T)) continue;
          const double cap = u[g] == c0fb ? shared : capacity(room, ps[g], q, c0, c0fb, tb.cv[j], tb.gamma[j], 0.0);
          if (!(cap > 0)) continue;
          const double v = size * x[g] / cap;
          if (v < gbest_[g]) gbest_[g] = v;
        }
      } else {
        const bool pp1_free = kind_[j] == 1, eps = !any_cols0_;
        for (int64_t g = 0; g < G; ++g) {
          double cap = room - q * (u[g] - c0);
          if (pp1_free) cap -= c0;
          if (eps) cap = cap + kEps * std::abs(cap);
          const bool ok = std::isfinite(x[g]) && al[g] <= T && cap > 0;
          const double v = ok ? size * x[g] / cap : kInf;
          if (v < gbest_[g]) gbest_[g] = v;
        }
      }
    }
    out.resize(tb.n);
    for (int64_t i = 0; i < tb.n; ++i) out[i] = gbest_[grp_[i]];
  }

 public:
  int64_t groups() const { return static_cast<int64_t>(rep_.size()); }
  int64_t rep(int64_t g) const { return rep_[g]; }
  int64_t group(int64_t i) const { return grp_[i]; }
  double best_of(int64_t g) const { return gbest_[g]; }  // of the last probe
  double x(int64_t g, int64_t j) const { return x_[j * G_ + g]; }

 private:
  const Tables& tb_;
  std::vector<int64_t> rep_, grp_;  // a row per group; each document's group
  int64_t G_ = 0;
  std::vector<double> x_, u_, a_, p_;  // [layout][group]: x (by theta), max(c0fb, psi), alone, psi
  std::vector<double> gbest_;          // per group, of the last probe
  std::vector<int> kind_;
  bool any_cols0_ = false;
};

// bound._bisect
template <class F>
double bisect(F feasible, double lo, double rel = 1e-6) {
  if (feasible(lo)) return lo;
  double hi = std::max(lo, 1e-9) * 2;
  while (!feasible(hi)) {
    lo = hi;
    hi = hi * 2;
    if (hi > 1e9) throw std::runtime_error("lower bound diverged");
  }
  for (int it = 0; it < 80; ++it) {
    if (hi - lo <= rel * hi) break;
    const double mid = 0.5 * (lo + hi);
    if (feasible(mid))
      hi = mid;
    else
      lo = mid;
  }
  return lo;
}

class Solver {
 public:
  Solver(const Tables& tb, const int64_t* lengths, double n_dev, int64_t kk)
      : tb_(tb), needs_(tb, lengths), n_dev_(n_dev), kk_(kk) {}

  double solve(bool refine) {
    const Tables& tb = tb_;
    double lo = -kInf;
    for (int64_t i = 0; i < tb.n; ++i) {
      double m = tb.alone[i * tb.k];
      for (int64_t j = 1; j < tb.k; ++j) m = nmin(m, tb.alone[i * tb.k + j]);
      lo = i == 0 ? m : nmax(lo, m);
    }
    const double t0 = bisect([&](double T) { needs_.best(T, need_); return pairwise_sum(need_) <= n_dev_; }, lo);
    if (!refine || tb.n < 2) return t0;
    std::vector<int64_t> order;
    for (int64_t j = 0; j < tb.k; ++j)
      if (std::isfinite(at(tb.alone, kk_, j))) order.push_back(j);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return at(tb.alone, kk_, a) < at(tb.alone, kk_, b); });
    members_.assign(needs_.groups(), 0);
    for (int64_t i = 0; i < tb.n; ++i)
      if (i != kk_) ++members_[needs_.group(i)];
    auto any_special = [&](double T) {
      needs_.best(T, need_);
      // the same for every layout: the others that need more than any device (forced onto
      // the longest document's replica) and the sum of the rest's needs
      forced_.clear();
      rest_.clear();
      for (int64_t i = 0; i < tb.n; ++i) {
        if (i == kk_) continue;
        if (std::isfinite(need_[i]))
          rest_.push_back(need_[i]);
        else
          forced_.push_back(i);
      }
      rest_sum_ = pairwise_sum(rest_);
      for (int64_t j : order)
        if (at(tb.alone, kk_, j) <= T && special_ok(j, T)) return true;
      return false;
    };
    return std::max(t0, bisect(any_special, t0));
  }

 private:
  double at(const double* a, int64_t i, int64_t j) const { return a[i * tb_.k + j]; }

  bool eligible(int64_t i, int64_t j, double T, const double* xs) const {
    return at(tb_.alone, i, j) <= T && std::isfinite(at(xs, i, j));
  }

  // bound._solve.special_ok: feasible at T with the longest document on a replica of layout j
  bool special_ok(int64_t j, double T) {
    const Tables& tb = tb_;
    const double room = T - tb.sync[j];
    if (at(tb.alone, kk_, j) > T || tb.size[j] > n_dev_ || room <= 0) return false;
    const double* xs = tb.theta[j] >= 1 ? tb.x1 : tb.x0;
    double cap = capacity(room, at(tb.psi, kk_, j), tb.q[j], tb.c0[j], tb.c0fb[j], tb.cv[j], tb.gamma[j], tb.theta[j]) -
                 at(xs, kk_, j);
    if (cap < 0) return false;
    forced_st_.clear();
    for (int64_t i : forced_) {
      if (!eligible(i, j, T, xs)) return false;
      forced_st_.push_back(at(xs, i, j));
    }
    cap -= pairwise_sum(forced_st_);
    if (cap < 0) return false;
    double rest = rest_sum_;
    const double limit = n_dev_ - tb.size[j] + 1e-9;
    if (cap <= 0) return rest <= limit;
    // the best ratio (devices saved per unit of this replica's time) over the candidates,
    // one per group of equal documents
    double most = -1.0;
    for (int64_t g = 0; g < needs_.groups(); ++g) {
      const double need = needs_.best_of(g), st = needs_.x(g, j);
      if (members_[g] == 0 || !std::isfinite(need) || !eligible(needs_.rep(g), j, T, xs) || !(st > 0)) continue;
      most = std::max(most, need / st);
    }
    if (most < 0) return rest <= limit;  // no candidate
    // filling saves at most all of the rest and at most the best ratio times the spare
    // time: when even that leaves too much (by far more than any rounding of the sums
    // below), the answer is no, without sorting
    const double bound = std::min(rest, most * cap);
    if (rest - bound > limit + 1e-9 * (std::abs(rest) + bound + std::abs(limit) + 1.0)) return false;
    // fill its spare time with the documents that save the most devices elsewhere
    cand_.clear();
    for (int64_t i = 0; i < tb.n; ++i) {
      const double need = need_[i], st = at(xs, i, j);
      if (i != kk_ && std::isfinite(need) && eligible(i, j, T, xs) && st > 0) cand_.push_back({need / st, st, need});
    }
    std::stable_sort(cand_.begin(), cand_.end(), [](const Cand& a, const Cand& b) { return -a.ratio < -b.ratio; });
    int64_t full = 0;
    double cs = 0.0, used = 0.0;
    for (const Cand& c : cand_) {  // searchsorted(cumsum, cap, "right")
      cs += c.st;
      if (cs > cap) break;
      used = cs;
      ++full;
    }
    picked_.clear();
    for (int64_t i = 0; i < full; ++i) picked_.push_back(cand_[i].need);
    double saved = pairwise_sum(picked_);
    if (full < static_cast<int64_t>(cand_.size())) saved += cand_[full].need * (cap - used) / cand_[full].st;
    rest -= saved;
    return rest <= limit;
  }

  struct Cand {
    double ratio, st, need;
  };
  const Tables& tb_;
  Needs needs_;
  double n_dev_;
  int64_t kk_;
  std::vector<double> need_, forced_st_, rest_, picked_;
  std::vector<int64_t> forced_, members_;  // members_: per group, documents other than the longest
  double rest_sum_ = 0.0;
  std::vector<Cand> cand_;
};

const double* matrix(const Arr& a, int64_t n, int64_t k, const char* name) {
  if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != k) throw py::value_error(std::string(name) + " must be [n, k]");
  return a.data();
}

const double* vec(const Arr& a, int64_t k, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != k) throw py::value_error(std::string(name) + " must have one value per layout");
  return a.data();
}

}  // namespace

double bound_solve(const Arr& x0, const Arr& x1, const Arr& psi, const Arr& alone, const Arr& sync, const Arr& size,
                   const Arr& q, const Arr& c0, const Arr& c0fb, const Arr& cv, const Arr& gamma, const Arr& theta,
                   int64_t n_dev, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& lengths,
                   bool refine) {
  if (x0.ndim() != 2) throw py::value_error("x0 must be [n, k]");
  const int64_t n = x0.shape(0), k = x0.shape(1);
  if (n == 0 || k == 0) throw py::value_error("the bound needs documents and layouts");
  if (lengths.size() != n) throw py::value_error("lengths must have one value per document");
  const int64_t* len = lengths.data();
  const int64_t longest = std::max_element(len, len + n) - len;  // np.argmax: the first of the longest
  Tables tb{n, k, matrix(x0, n, k, "x0"), matrix(x1, n, k, "x1"), matrix(psi, n, k, "psi"), matrix(alone, n, k, "alone"),
            vec(sync, k, "sync"), vec(size, k, "size"), vec(q, k, "q"), vec(c0, k, "c0"), vec(c0fb, k, "c0fb"),
            vec(cv, k, "cv"), vec(gamma, k, "gamma"), vec(theta, k, "theta")};
  py::gil_scoped_release nogil;
  Solver s(tb, len, static_cast<double>(n_dev), longest);
  return s.solve(refine);
}

// lower_bound's choice of the micro-batch count argument per pipelined layout, at the
// unrefined all-memory bound t1: theta 0 (count free, floor (2)) where it charges the
// batch more, else 1.
py::array_t<double> bound_theta(const Arr& x0, const Arr& x1, const Arr& psi, const Arr& alone, const Arr& sync,
                                const Arr& q, const Arr& c0, const Arr& c0fb, const Arr& cv, const Arr& gamma, double t1) {
  if (x0.ndim() != 2) throw py::value_error("x0 must be [n, k]");
  const int64_t n = x0.shape(0), k = x0.shape(1);
  const double *X0 = matrix(x0, n, k, "x0"), *X1 = matrix(x1, n, k, "x1"), *P = matrix(psi, n, k, "psi"),
               *A = matrix(alone, n, k, "alone");
  const double *sy = vec(sync, k, "sync"), *qq = vec(q, k, "q"), *cc = vec(c0, k, "c0"), *cf = vec(c0fb, k, "c0fb"),
               *cvv = vec(cv, k, "cv"), *gg = vec(gamma, k, "gamma");
  py::array_t<double> theta(k);
  double* th = theta.mutable_data();
  {
    py::gil_scoped_release nogil;
    std::vector<double> r0, r1;
    for (int64_t j = 0; j < k; ++j) {
      th[j] = 1.0;
      const double room = t1 - sy[j];
      if (qq[j] == 0 || room <= 0) continue;
      r0.clear();
      r1.clear();
      bool none_free = false, none_memory = false;
      // psi enters only through max(c0fb, psi): documents on the c0fb floor share capacities
      const double floor0 = capacity(room, cf[j], qq[j], cc[j], cf[j], cvv[j], gg[j], 0.0);
      const double floor1 = capacity(room, cf[j], qq[j], cc[j], cf[j], cvv[j], gg[j], 1.0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t e = i * k + j;
        if (!(std::isfinite(X0[e]) && A[e] <= t1)) continue;
        const bool on_floor = nmax(cf[j], P[e]) == cf[j];
        const double cap0 = on_floor ? floor0 : capacity(room, P[e], qq[j], cc[j], cf[j], cvv[j], gg[j], 0.0);
        const double cap1 = on_floor ? floor1 : capacity(room, P[e], qq[j], cc[j], cf[j], cvv[j], gg[j], 1.0);
        none_free = none_free || cap0 <= 0;
        none_memory = none_memory || cap1 <= 0;
        r0.push_back(X0[e] / cap0);
        r1.push_back(X1[e] / cap1);
      }
      if (r0.empty() || none_free) continue;
      if (none_memory || pairwise_sum(r0) > pairwise_sum(r1)) th[j] = 0.0;
    }
  }
  return theta;
}

// bound_tables for one layout: per document, the least over the recompute levels that
// hold it (level r holds document i when r >= rs_min[i]) of its additive work (x0), that
// plus the memory-forced constants (x1), its backward (b_min) and pp times its
// micro-batch time alone (a_min). levels: [10, L] rows a, b, c, keep, a_b, b_b, c_b, c0,
// then the kv exchange's cp_att, cp_comm, cp_layers, cp_recompute as [4, L] in `cp`.
py::tuple bound_layout_tables(const Arr& lengths, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& rs_min,
                              const Arr& levels, const Arr& cp, int64_t pp, double attn_bwd_factor) {
  const int64_t n = lengths.size();
  if (levels.ndim() != 2 || levels.shape(0) != 8 || cp.ndim() != 2 || cp.shape(0) != 4 || cp.shape(1) != levels.shape(1))
    throw py::value_error("levels must be [8, L] and cp [4, L]");
  if (rs_min.size() != n) throw py::value_error("rs_min must have one level per document");
  const int64_t L = levels.shape(1);
  Arr x0(n), x1(n), b_min(n), a_min(n);
  const double *s = lengths.data(), *lv = levels.data(), *cpv = cp.data();
  const int64_t* rmin = rs_min.data();
  double *o0 = x0.mutable_data(), *o1 = x1.mutable_data(), *ob = b_min.mutable_data(), *oa = a_min.mutable_data();
  {
    py::gil_scoped_release nogil;
    auto row = [&](int k, int64_t r) { return lv[k * L + r]; };
    for (int64_t i = 0; i < n; ++i) {
      double v0 = kInf, v1 = kInf, vb = kInf, va = kInf;
      const double x = s[i], s2 = x * x;
      for (int64_t r = std::max<int64_t>(rmin[i], 0); r < L; ++r) {
        const double a = row(0, r), b = row(1, r), c = row(2, r);
        const double cost = a * x * x + b * x + c;
        v0 = nmin(v0, cost);
        v1 = nmin(v1, cost + row(3, r) * x);
        vb = nmin(vb, row(4, r) * x * x + row(5, r) * x + row(6, r));
        double ex = 0.0;  // StageCoeffs.excess
        const double comm_c = cpv[1 * L + r];
        if (comm_c != 0.0) {
          const double att = cpv[0 * L + r] * s2, com = comm_c * x;
          const double ex_f = nmax(0.0, com - att), ex_b = nmax(0.0, 2.0 * com - attn_bwd_factor * att);
          ex = (cpv[2 * L + r] + cpv[3 * L + r]) * ex_f + cpv[2 * L + r] * ex_b;
        }
        const double mb = row(7, r) + a * s2 + b * x + c * 1 + ex;
        va = nmin(va, static_cast<double>(pp) * mb);
      }
      o0[i] = v0;
      o1[i] = v1;
      ob[i] = vb;
      oa[i] = va;
    }
  }
  return py::make_tuple(x0, x1, b_min, a_min);
}

void register_bound(py::module_& m) {
  m.def("bound_theta", &bound_theta, py::arg("x0"), py::arg("x1"), py::arg("psi"), py::arg("alone"), py::arg("sync"),
        py::arg("q"), py::arg("c0"), py::arg("c0fb"), py::arg("cv"), py::arg("gamma"), py::arg("t1"));
  m.def("bound_layout_tables", &bound_layout_tables, py::arg("lengths"), py::arg("rs_min"), py::arg("levels"),
        py::arg("cp"), py::arg("pp"), py::arg("attn_bwd_factor"));
  m.def("bound_solve", &bound_solve, py::arg("x0"), py::arg("x1"), py::arg("psi"), py::arg("alone"), py::arg("sync"),
        py::arg("size"), py::arg("q"), py::arg("c0"), py::arg("c0fb"), py::arg("cv"), py::arg("gamma"),
        py::arg("theta"), py::arg("n_dev"), py::arg("lengths"), py::arg("refine"));
}
