// numpy's float rules the planner kernels copy: np.maximum/np.minimum keep NaN.
// Shared by bound.cpp and planner.cpp, whose results must equal numpy's bit for bit.
#pragma once

#include <cmath>
#include <limits>

namespace dcp_np {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

inline double nmax(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? kNaN : (a > b ? a : b); }
inline double nmin(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? kNaN : (a < b ? a : b); }

}  // namespace dcp_np
