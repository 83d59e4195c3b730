// Stage 2 over a whole assignment: each replica's sequences (in index order) packed with
// seed derive_seed(seed, r), micro-batches mapped back to global indices, and the
// replica_time of each replica. Mirrors ref_plan.pack_assignment.
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

}  // namespace dcp
