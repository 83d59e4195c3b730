// Declarations of the assignment kernels (one .cpp each) for the pybind11 module.
// The algorithms and their tie-breaking are documented in the Python reference they
// mirror: dcp_ext/assign/ref_balance.py, ref_pack.py, ref_plan.py, ref_baselines.py.
#pragma once

#include <string>
#include <vector>

#include "assign_core.hpp"

namespace dcp {

using MicroBatches = std::vector<std::vector<int64_t>>;

struct BalanceOut {
  std::vector<int64_t> assignment;
  std::vector<double> est;
  double makespan = 0.0;
  double greedy_makespan = 0.0;
};

// Stage 1 (ref_balance.py).
BalanceOut balance(const int64_t* len, int64_t n, const std::vector<Params>& params, uint64_t seed, int64_t restarts,
                   bool local_search, int64_t budget, int64_t starts);

// Stage 2 for one replica (ref_pack.py): micro-batches of local indices.
MicroBatches pack(const int64_t* len, int64_t n, const Params& p, uint64_t seed, int64_t restarts, int64_t budget);

// Stage 2 over a whole assignment (ref_plan.pack_assignment): global indices.
void pack_assignment(const int64_t* len, int64_t n, const std::vector<Params>& params, const int64_t* assignment,
                     uint64_t seed, int64_t pack_restarts, int64_t pack_budget, std::vector<MicroBatches>& mbs,
                     std::vector<double>& times);

struct PlanOut {
  std::vector<int64_t> assignment;
  std::vector<MicroBatches> mbs;
  std::vector<double> times, est;
};

// Stage 1 + stage 2 with calibration rounds (ref_plan.plan).
PlanOut plan(const int64_t* len, int64_t n, const std::vector<Params>& params, uint64_t seed, int64_t restarts,
             int64_t budget, int64_t starts, int64_t pack_restarts, int64_t pack_budget, int64_t calib_rounds);

// A baseline's micro-batches per replica (ref_baselines.py).
std::vector<MicroBatches> baseline(const std::string& name, const int64_t* len, int64_t n,
                                   const std::vector<Params>& params, uint64_t seed);

}  // namespace dcp
