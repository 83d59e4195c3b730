// pybind11 bindings of the assignment kernels: dcp_ext.assign._kernels.
// Inputs arrive validated by dcp_ext/assign/api.py (int64 lengths, parameter tuples);
// the GIL is released while a kernel runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "assign_kernels.hpp"

namespace py = pybind11;
using dcp::MicroBatches;
using dcp::Params;

namespace {

using LenArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

Params to_params(const py::handle& h) {
  py::tuple t = py::reinterpret_borrow<py::object>(h).cast<py::tuple>();
  if (t.size() != 7) throw py::value_error("replica parameters must be a 7-tuple");
  return Params{t[0].cast<double>(),  t[1].cast<double>(),  t[2].cast<double>(), t[3].cast<double>(),
                t[4].cast<int64_t>(), t[5].cast<int64_t>(), t[6].cast<int64_t>()};
}

std::vector<Params> to_params_list(const py::sequence& seq) {
  std::vector<Params> out;
  for (const auto& h : seq) out.push_back(to_params(h));
  if (out.empty()) throw py::value_error("no replicas given");
  return out;
}

py::list to_py(const MicroBatches& mbs) {
  py::list out(mbs.size());
  for (size_t k = 0; k < mbs.size(); ++k) {
    py::list mb(mbs[k].size());
    for (size_t j = 0; j < mbs[k].size(); ++j) PyList_SET_ITEM(mb.ptr(), j, PyLong_FromLongLong(mbs[k][j]));
    PyList_SET_ITEM(out.ptr(), k, mb.release().ptr());
  }
  return out;
}

py::list to_py(const std::vector<MicroBatches>& per_replica) {
  py::list out(per_replica.size());
  for (size_t r = 0; r < per_replica.size(); ++r) PyList_SET_ITEM(out.ptr(), r, to_py(per_replica[r]).release().ptr());
  return out;
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(v.size());
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::tuple balance(const LenArray& lengths, const py::sequence& params, uint64_t seed, int64_t restarts,
                  bool local_search, int64_t budget, int64_t starts) {
  const auto P = to_params_list(params);
  dcp::BalanceOut out;
  {
    py::gil_scoped_release nogil;
    out = dcp::balance(lengths.data(), lengths.size(), P, seed, restarts, local_search, budget, starts);
  }
  return py::make_tuple(to_array(out.assignment), out.est, out.makespan, out.greedy_makespan);
}

py::list pack(const LenArray& lengths, const py::handle& p, uint64_t seed, int64_t restarts, int64_t budget) {
  const Params P = to_params(p);
  MicroBatches mbs;
  {
    py::gil_scoped_release nogil;
    mbs = dcp::pack(lengths.data(), lengths.size(), P, seed, restarts, budget);
  }
  return to_py(mbs);
}

py::tuple plan(const LenArray& lengths, const py::sequence& params, uint64_t seed, int64_t restarts, int64_t budget,
               int64_t starts, int64_t pack_restarts, int64_t pack_budget, int64_t calib_rounds) {
  const auto P = to_params_list(params);
  dcp::PlanOut out;
  {
    py::gil_scoped_release nogil;
    out = dcp::plan(lengths.data(), lengths.size(), P, seed, restarts, budget, starts, pack_restarts, pack_budget,
                    calib_rounds);
  }
  return py::make_tuple(to_array(out.assignment), to_py(out.mbs), out.times, out.est);
}

py::tuple pack_assignment(const LenArray& lengths, const py::sequence& params, const LenArray& assignment,
                          uint64_t seed, int64_t pack_restarts, int64_t pack_budget) {
  const auto P = to_params_list(params);
  if (assignment.size() != lengths.size()) throw py::value_error("assignment and lengths differ in size");
  for (py::ssize_t i = 0; i < assignment.size(); ++i)
    if (assignment.data()[i] < 0 || assignment.data()[i] >= static_cast<int64_t>(P.size()))
      throw py::value_error("assignment out of range");
  std::vector<MicroBatches> mbs;
  std::vector<double> times;
  {
    py::gil_scoped_release nogil;
    dcp::pack_assignment(lengths.data(), lengths.size(), P, assignment.data(), seed, pack_restarts, pack_budget, mbs,
                         times);
  }
  return py::make_tuple(to_py(mbs), times);
}

py::list baseline(const std::string& name, const LenArray& lengths, const py::sequence& params, uint64_t seed) {
  const auto P = to_params_list(params);
  std::vector<MicroBatches> mbs;
  {
    py::gil_scoped_release nogil;
    mbs = dcp::baseline(name, lengths.data(), lengths.size(), P, seed);
  }
  return to_py(mbs);
}

}  // namespace

void register_bound(py::module_& m);   // bound.cpp: the lower bound's tables and search
void register_stage1(py::module_& m);  // planner.cpp: the adaptive planner's stage 1
void register_mix_dp(py::module_& m);  // planner.cpp: the candidate pool's dynamic program

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "C++ sequence-assignment kernels of dcp_ext.assign (use dcp_ext.assign, which validates input)";
  m.attr("name") = "cpp";
  m.def("balance", &balance, py::arg("lengths"), py::arg("params"), py::arg("seed"), py::arg("restarts"),
        py::arg("local_search"), py::arg("budget"), py::arg("starts"));
  m.def("pack", &pack, py::arg("lengths"), py::arg("p"), py::arg("seed"), py::arg("restarts"), py::arg("budget"));
  m.def("plan", &plan, py::arg("lengths"), py::arg("params"), py::arg("seed"), py::arg("restarts"), py::arg("budget"),
        py::arg("starts"), py::arg("pack_restarts"), py::arg("pack_budget"), py::arg("calib_rounds"));
  m.def("pack_assignment", &pack_assignment, py::arg("lengths"), py::arg("params"), py::arg("assignment"),
        py::arg("seed"), py::arg("pack_restarts"), py::arg("pack_budget"));
  m.def("baseline", &baseline, py::arg("name"), py::arg("lengths"), py::arg("params"), py::arg("seed"));
  register_bound(m);
  register_stage1(m);
  register_mix_dp(m);
}
