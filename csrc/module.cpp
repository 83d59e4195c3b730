// The pybind11 module dcp_ext.kernels._kernels: the planner's C++ kernels, each registered
// by the file that holds it. dcp_ext/kernels/__init__.py is the one place that loads it.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_bound(py::module_& m);          // bound.cpp: the lower bound's tables and search
void register_stage1(py::module_& m);         // planner.cpp: the adaptive planner's stage 1
void register_mix_dp(py::module_& m);         // planner.cpp: the candidate pool's dynamic program
void register_stage1_search(py::module_& m);  // stage1_search.cpp: the side plan's stage 1

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "C++ kernels of the adaptive planner (dcp_ext.kernels.kernel(name) loads them)";
  register_bound(m);
  register_stage1(m);
  register_mix_dp(m);
  register_stage1_search(m);
}
