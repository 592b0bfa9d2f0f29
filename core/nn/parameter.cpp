// Parameter helpers: the name hash that keys initialisation (FNV-1a, 64 bit)
// and zeroing of gradients at the start of an optimizer step.
#include "core/nn/parameter.h"

namespace tessera::nn {

uint64_t name_stream(const std::string& name) {
  constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull, kPrime = 0x100000001b3ull;
  uint64_t hash = kOffsetBasis;
  for (const char c : name) {
    hash ^= uint64_t(static_cast<unsigned char>(c));
    hash *= kPrime;
  }
  return hash;
}

void zero_grads(const std::vector<Parameter*>& parameters) {
  for (Parameter* p : parameters)
    if (p->grad.defined()) p->grad.fill_(0.0);
}

}  // namespace tessera::nn
