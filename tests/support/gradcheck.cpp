// Central differences: (F(x + h) − F(x − h)) / 2h per input element, with h
// scaled to the element's magnitude.
#include "tests/support/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace tessera::testing {
namespace {

double weighted(const std::vector<double>& outputs, const std::vector<double>& upstream) {
  if (outputs.size() != upstream.size()) throw std::invalid_argument("numeric_gradient: upstream size mismatch");
  double total = 0;
  for (size_t j = 0; j < outputs.size(); ++j) total += upstream[j] * outputs[j];
  return total;
}

}  // namespace

std::vector<double> numeric_gradient(const ReferenceFunction& f, Inputs inputs, size_t wrt,
                                     const std::vector<double>& upstream, double step) {
  std::vector<double>& x = inputs.at(wrt);
  std::vector<double> gradient(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    const double h = step * std::max(1.0, std::abs(saved));
    x[i] = saved + h;
    const double plus = weighted(f(inputs), upstream);
    x[i] = saved - h;
    const double minus = weighted(f(inputs), upstream);
    x[i] = saved;
    gradient[i] = (plus - minus) / (2 * h);
  }
  return gradient;
}

}  // namespace tessera::testing
