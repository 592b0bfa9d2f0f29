// The CPU launcher of row functors (see kernels/functors/row_group.h): rows
// split across the OpenMP threads, each row processed by one SerialGroup.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/parallel_for.h"
#include "kernels/functors/row_group.h"

namespace tessera {

// Runs op(SerialGroup{}, row) for every row; `row_length` sizes the grain so
// short rows are batched per thread.
template <typename Op>
void cpu_for_each_row(int64_t rows, int64_t row_length, const Op& op) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(row_length, 1));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) op(SerialGroup{}, row);
  });
}

}  // namespace tessera
