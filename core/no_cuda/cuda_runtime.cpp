// Stand-ins for the CUDA side of core/ when Tessera is built without the CUDA
// backend (TESSERA_CUDA=OFF or no nvcc): no devices, and a clear error if a
// CUDA resource is asked for anyway.
#include "core/cuda_runtime.h"

#include <string>

#include "core/allocator.h"
#include "core/error.h"
#include "core/fault.h"
#include "core/tensor_fill.h"

namespace tessera {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  TESSERA_THROW(what, ": this Tessera was built without the CUDA backend; rebuild with -DTESSERA_CUDA=ON");
}

}  // namespace

namespace cuda_runtime {

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}
std::string describe() {
  return "not built";
}
std::optional<std::array<unsigned char, 16>> uuid(int) {
  return std::nullopt;
}
void set_device(int) {
  no_cuda("set_device");
}
void* stream_create(int) {
  no_cuda("stream_create");
}
void stream_destroy(void*) noexcept {}
void stream_synchronize(void*) {
  no_cuda("stream_synchronize");
}
void* event_create(int, bool) {
  no_cuda("event_create");
}
void event_destroy(void*) noexcept {}
void event_record(void*, void*) {
  no_cuda("event_record");
}
void stream_wait_event(void*, void*) {
  no_cuda("stream_wait_event");
}
void event_synchronize(void*) {
  no_cuda("event_synchronize");
}
bool event_query(void*) {
  no_cuda("event_query");
}
float event_elapsed_ms(void*, void*) {
  no_cuda("event_elapsed_ms");
}
void* device_malloc(int, size_t) {
  no_cuda("device_malloc");
}
void device_free(int, void*) noexcept {}
void* pinned_malloc(size_t) {
  no_cuda("pinned_malloc");
}
void pinned_free(void*) noexcept {}
void memcpy_async(void*, const void*, size_t, void*) {
  no_cuda("memcpy_async");
}

}  // namespace cuda_runtime

class Context;
class CudaLibraries;

namespace detail {

CudaLibraries* create_cuda_libraries(Context&, int) {
  no_cuda("cuBLAS/cuDNN handles");
}
void destroy_cuda_libraries(CudaLibraries*) noexcept {}
std::string describe_cuda_libraries() {
  return {};
}

void cuda_provoke_illegal_address(int) {
  no_cuda("TESSERA_FAULT=device_fault");
}

void cuda_fill_constant(void*, DType, int64_t, double, int, void*) {
  no_cuda("fill_");
}
void cuda_fill_uniform(void*, DType, int64_t, uint64_t, uint64_t, uint64_t, float, float, int, void*) {
  no_cuda("uniform_");
}
void cuda_fill_normal(void*, DType, int64_t, uint64_t, uint64_t, uint64_t, float, float, int, void*) {
  no_cuda("normal_");
}

}  // namespace detail
}  // namespace tessera
