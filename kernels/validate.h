// Argument checks shared by the ops:: functions. Every message names the
// operator and the argument, and says what was expected.
#pragma once

#include <initializer_list>
#include <string_view>

#include "core/tensor.h"

namespace tessera::ops::detail {

struct Arg {
  std::string_view name;
  const Tensor& tensor;
};

void check_defined(std::string_view op, const Arg& arg);
// All defined tensors among `args` are on one device; returns it.
Device check_same_device(std::string_view op, std::initializer_list<Arg> args);
void check_floating(std::string_view op, const Arg& arg);
void check_index(std::string_view op, const Arg& arg);
void check_dtype(std::string_view op, const Arg& arg, DType dtype);
void check_same_dtype(std::string_view op, const Arg& a, const Arg& b);
void check_shape(std::string_view op, const Arg& arg, const Shape& expected);
void check_numel(std::string_view op, const Arg& arg, int64_t expected);
void check_ndim(std::string_view op, const Arg& arg, int ndim);
// True when the two tensors' bytes overlap (views of one storage may; an
// undefined or empty tensor overlaps nothing).
bool overlaps(const Tensor& a, const Tensor& b);
// An output may be an input itself (same bytes, same dtype) or lie apart from
// it; a partial overlap would let one element's write clobber another's read.
void check_alias(std::string_view op, const Arg& out, const Arg& in);

// Size of the last dimension, and the number of rows (all other dims flattened).
int64_t last_dim(const Tensor& t);
int64_t rows(const Tensor& t);

}  // namespace tessera::ops::detail
