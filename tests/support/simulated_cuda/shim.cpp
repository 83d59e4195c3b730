// What a CPU-only build of torch lacks for tensors that say they are on "cuda:0":
// a device guard for CUDA (the autograd engine asks it for the device's streams) and
// CUDA hooks that say a CUDA device exists (the engine and pin_memory() ask for the
// accelerator). Both are stand-ins that do nothing, for tests/support/simulated_cuda only: the
// tensors themselves are CPU tensors wrapped by tests/support/simulated_cuda/device.py. Pinned
// host memory is plain host memory here, remembered so that `is_pinned()` answers true.
// Loaded (ctypes, RTLD_GLOBAL) before `import torch`: torch reads the hooks once.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstring>
#include <map>
#include <mutex>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace {

std::mutex pinned_mutex;
std::map<const char*, size_t>& pinned_blocks() {  // start -> size of every live pinned block
  static std::map<const char*, size_t> blocks;
  return blocks;
}

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks().erase(static_cast<const char*>(ptr));
  }
  c10::free_cpu(ptr);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* ptr = n ? c10::alloc_cpu(n) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks()[static_cast<const char*>(ptr)] = n;
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedHostAllocator pinned_allocator;

bool is_pinned(const void* data) {
  const char* p = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto& blocks = pinned_blocks();
  auto it = blocks.upper_bound(p);
  if (it == blocks.begin()) return false;
  --it;
  return p < it->first + it->second;
}

struct SimulatedCudaHooks final : at::CUDAHooksInterface {
  SimulatedCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
};

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", SimulatedCudaHooks);
}
