// What every libFuzzer harness in tests/fuzz/ shares: a scratch directory for
// the files a harness writes and hands to a parser, the policy on exceptions,
// and builders that turn fuzz bytes into HDF5 files (structure-aware: the
// bytes choose which attributes and datasets exist, with which types, shapes,
// layouts and values, so the fuzzer explores our validation rather than the
// HDF5 library's own decoder).
//
// Every decision a builder takes from the fuzz bytes is a choice whose first
// alternative (0) is the valid one: an empty input decodes to a valid file,
// and each mutation moves one decision away from it.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tessera::fuzz {

namespace fs = std::filesystem;

// This process's scratch directory (under $TMPDIR), emptied by every call so
// one input never sees the files of the one before.
const fs::path& fresh_scratch_dir();

void write_file(const fs::path& path, std::string_view bytes);
void write_file(const fs::path& path, const std::vector<uint8_t>& bytes);

// Cuts `path` to a fuzz-chosen shorter length with probability about 1/8:
// truncated files are among the faults the readers must report cleanly.
void maybe_truncate(FuzzedDataProvider& data, const fs::path& path);

// Runs `body`: tessera::Error is the parsers' documented answer to bad input
// and is swallowed; any other exception escapes, aborts the process and is
// reported by libFuzzer as a finding (the readers promise tessera::Error
// naming the file, not std::bad_alloc or std::length_error).
template <typename Body>
void expect_clean_errors(Body&& body) {
  try {
    body();
  } catch (const tessera::Error&) {
  }
}

// An integer near the edges that parsers get wrong: 0, ±1, the limits of
// 8/16/32/64-bit types, or any value.
int64_t interesting_int(FuzzedDataProvider& data);

// --- HDF5 builders --------------------------------------------------------

// Which HDF5 type a fuzzed dataset or attribute gets.
enum class ElementType { u8, i8, u16, i16, u32, i32, u64, i64, i64_be, f32, f64, fixed_string, kCount };
bool is_string(ElementType type);

// An integer attribute `name` on `object`: choice 0 writes `valid` as int64;
// others write an interesting value, another integer width, a float, a
// string, a 2-element array, a null dataspace, or nothing.
void fuzz_int_attribute(FuzzedDataProvider& data, hid_t object, const char* name, int64_t valid);
// A string attribute: choice 0 writes `valid` (fixed length, NUL terminated);
// others variable length, a fuzzed text, space or NUL padding with no
// terminator, an integer, an array of strings, or nothing.
void fuzz_string_attribute(FuzzedDataProvider& data, hid_t object, const char* name, std::string_view valid);

struct DatasetSpec {
  ElementType type = ElementType::u8;
  std::vector<hsize_t> dims;  // the valid shape
  int64_t value_bound = 256;  // valid element values are in [0, value_bound)
};

// A dataset `name` in `group`: choice 0 makes `valid` (values from the fuzz
// bytes reduced into range); others change its type, its rank and sizes,
// leave values out of range, make it huge and never written, make it a group
// instead, or leave it out. Storage is contiguous, chunked, compressed or
// compact. Returns the bytes written in the file's element type when the
// whole dataset was written (the checkpoint builder checksums them), else
// an empty vector.
std::vector<uint8_t> fuzz_dataset(FuzzedDataProvider& data, hid_t group, const char* name, const DatasetSpec& valid);

// A dataset of exactly this type, shape and data (no fuzzed choices), in
// contiguous storage.
void write_dataset(hid_t group, const char* name, hid_t type, const std::vector<hsize_t>& dims, const void* bytes);

// Aborts (a finding) when any HDF5 file, dataset, group, datatype or
// attribute is still open: the readers must close every id they open, also
// on their error paths. Call after the reader objects are gone.
void check_hdf5_ids_closed();

// Creates an HDF5 file for writing, throwing std::runtime_error on failure
// (a harness bug, not a finding about the parsers).
hid_t create_file(const fs::path& path);

}  // namespace tessera::fuzz
