// The message of the tessera::Error a call throws, and a check that a text
// holds a fragment (naming both when it does not): what the tests of error
// messages share.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace tessera::testing {

// What `fn` throws as tessera::Error, or "(no error)".
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

}  // namespace tessera::testing

#define EXPECT_CONTAINS(text, fragment) \
  EXPECT_NE(std::string(text).find(fragment), std::string::npos) << "expected '" << (fragment) << "' in: " << (text)
