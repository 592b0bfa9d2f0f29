// Central finite-difference gradients, in double precision, of a reference
// function written in double. An operator's backward is checked against the
// numerical derivative of the double reference of its forward:
//
//   auto f = [&](const Inputs& in) { return reference_forward(in[0], in[1]); };
//   auto expected = numeric_gradient(f, {x.values, w.values}, /*wrt=*/0, upstream);
//   EXPECT_TRUE(all_close(grad_x, expected, tolerance));
//
// `upstream` weights the outputs (the incoming gradient): the result is
// d/d inputs[wrt] of Σ_j upstream[j]·f(inputs)[j].
#pragma once

#include <functional>
#include <vector>

namespace tessera::testing {

using Inputs = std::vector<std::vector<double>>;
using ReferenceFunction = std::function<std::vector<double>(const Inputs&)>;

std::vector<double> numeric_gradient(const ReferenceFunction& f, Inputs inputs, size_t wrt,
                                     const std::vector<double>& upstream, double step = 1e-6);

}  // namespace tessera::testing
