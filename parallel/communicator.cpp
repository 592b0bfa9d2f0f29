// Helpers built on the Communicator interface alone (any backend).
#include "parallel/communicator.h"

#include <algorithm>
#include <cstring>

#include "core/context.h"

namespace tessera::parallel {

std::vector<std::vector<uint8_t>> all_gather_bytes(Communicator& group, Context& scratch,
                                                   const std::vector<uint8_t>& mine) {
  const int ranks = group.size();
  Tensor length = scratch.full(Shape{1}, DType::i64, double(mine.size()));
  Tensor lengths = scratch.empty(Shape{ranks}, DType::i64);
  group.all_gather(length, lengths)->wait();
  const int64_t* sizes = lengths.data<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(sizes, sizes + ranks));
  Tensor buffer = scratch.zeros(Shape{longest}, DType::u8);
  if (!mine.empty()) std::memcpy(buffer.data_ptr(), mine.data(), mine.size());
  Tensor gathered = scratch.empty(Shape{longest * ranks}, DType::u8);
  group.all_gather(buffer, gathered)->wait();
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(ranks));
  const uint8_t* all = gathered.data<uint8_t>();
  for (int r = 0; r < ranks; ++r) out[size_t(r)].assign(all + r * longest, all + r * longest + sizes[r]);
  return out;
}

}  // namespace tessera::parallel
