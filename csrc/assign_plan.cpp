// Stage 2 over a whole assignment (each replica's sequences, in index order, packed with
// seed derive_seed(seed, r)), and the full plan: stage 1 + stage 2 + calibration rounds
// that rerun stage 1 with costs scaled by each replica's packing loss. Mirrors
// dcp_ext/assign/ref_plan.py (documented there).
#include "assign_kernels.hpp"

namespace dcp {

void pack_assignment(const int64_t* len, int64_t n, const std::vector<Params>& params, const int64_t* assignment,
                     uint64_t seed, int64_t pack_restarts, int64_t pack_budget, std::vector<MicroBatches>& mbs,
                     std::vector<double>& times) {
  const size_t R = params.size();
  std::vector<std::vector<int64_t>> members(R);
  for (int64_t i = 0; i < n; ++i) members[assignment[i]].push_back(i);
  mbs.assign(R, MicroBatches{});
  times.assign(R, 0.0);
  std::vector<int64_t> sub;
  for (size_t r = 0; r < R; ++r) {
    sub.clear();
    for (int64_t i : members[r]) sub.push_back(len[i]);
    MicroBatches local = pack(sub.data(), static_cast<int64_t>(sub.size()), params[r], derive_seed(seed, r),
                              pack_restarts, pack_budget);
    for (auto& mb : local)
      for (auto& j : mb) j = members[r][j];
    times[r] = replica_time(params[r], len, local);
    mbs[r] = std::move(local);
  }
}

namespace {

constexpr double kCalibMin = 1e-3;  // recalibrate when a replica's packed time exceeds its estimate by this

std::vector<double> estimates(const int64_t* len, int64_t n, const std::vector<Params>& params,
                              const std::vector<int64_t>& assignment) {
  const size_t R = params.size();
  std::vector<double> W(R, 0.0), top(R, 0.0);
  std::vector<int64_t> T(R, 0), cnt(R, 0);
  for (const Item& it : sorted_items(len, n)) {
    const int64_t r = assignment[it.idx];
    if (cnt[r] == 0) top[r] = seq_cost(params[r], it.len);
    W[r] += seq_cost(params[r], it.len);
    T[r] += it.len;
    ++cnt[r];
  }
  std::vector<double> out(R);
  for (size_t r = 0; r < R; ++r) out[r] = estimate(params[r], W[r], T[r], top[r], cnt[r]);
  return out;
}

double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

}  // namespace

PlanOut plan(const int64_t* len, int64_t n, const std::vector<Params>& params, uint64_t seed, int64_t restarts,
             int64_t budget, int64_t starts, int64_t pack_restarts, int64_t pack_budget, int64_t calib_rounds) {
  BalanceOut bal = balance(len, n, params, seed, restarts, true, budget, starts);
  PlanOut best;
  best.assignment = std::move(bal.assignment);
  best.est = std::move(bal.est);
  pack_assignment(len, n, params, best.assignment.data(), seed, pack_restarts, pack_budget, best.mbs, best.times);
  std::vector<double> times = best.times, est = best.est, f(params.size(), 1.0);
  for (int64_t k = 0; k < calib_rounds; ++k) {
    std::vector<double> loss(params.size());
    for (size_t r = 0; r < params.size(); ++r) loss[r] = est[r] > 0.0 ? times[r] / est[r] : 1.0;
    if (!(max_of(loss) > 1.0 + kCalibMin)) break;
    std::vector<Params> scaled = params;
    for (size_t r = 0; r < params.size(); ++r) {
      f[r] = f[r] > loss[r] ? f[r] : loss[r];
      scaled[r].a = params[r].a * f[r], scaled[r].b = params[r].b * f[r];
      scaled[r].c = params[r].c * f[r], scaled[r].o = params[r].o * f[r];
    }
    PlanOut cur;
    cur.assignment = balance(len, n, scaled, seed, restarts, true, budget, starts).assignment;
    pack_assignment(len, n, params, cur.assignment.data(), seed, pack_restarts, pack_budget, cur.mbs, cur.times);
    cur.est = estimates(len, n, params, cur.assignment);
    times = cur.times;
    est = cur.est;
    if (max_of(cur.times) < max_of(best.times)) best = std::move(cur);
  }
  return best;
}

}  // namespace dcp
