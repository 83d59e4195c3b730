// A memory-mapped data file cut short under a running job (another job rewrote it) makes the
// next read of the lost pages raise SIGBUS, which kills the process with nothing printed.
// A Python handler cannot catch it (the faulting read would repeat forever), so this tiny
// module installs a C handler that writes one prepared line on stderr and exits 1.
// Only async-signal-safe calls (write, _exit) run inside the handler.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <string>
#include <unistd.h>

namespace {

char g_line[4096];
volatile size_t g_length = 0;

extern "C" void on_sigbus(int) {
  size_t n = g_length;
  size_t done = 0;
  while (done < n) {
    ssize_t w = write(2, g_line + done, n - done);
    if (w <= 0) break;
    done += static_cast<size_t>(w);
  }
  _exit(1);
}

void install(const std::string& line) {
  g_length = 0;  // the handler never sees a half-copied line
  std::string text = line + "\n";
  size_t n = std::min(text.size(), sizeof(g_line));
  std::memcpy(g_line, text.data(), n);
  g_length = n;
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = on_sigbus;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, nullptr);
}

}  // namespace

PYBIND11_MODULE(_sigbus, m) {
  m.doc() = "SIGBUS -> one prepared error line on stderr, exit 1";
  m.def("install", &install, "Install (or update the line of) the SIGBUS handler");
}
