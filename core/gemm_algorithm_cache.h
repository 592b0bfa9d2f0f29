// GemmAlgorithmCache: the algorithm a GEMM library chose for a GEMM, kept by
// everything that decides the choice (shape, transposes, leading dimensions,
// batch and strides, dtypes, epilogue, pointer alignments), so that the
// library's heuristic runs once per distinct GEMM instead of on every call:
// cuBLASLt's costs tens of microseconds of host time, which a decode step's
// small GEMMs would otherwise pay each time. Held per GPU by CudaLibraries
// (core/cuda/cuda_libraries.h); keys come from kernels/functors/matmul_plan.h
// (gemm_algorithm_key). No CUDA types here: the value is a template argument,
// so CPU tests check the key and the bound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "core/dtype.h"

namespace tessera {

// One GEMM as the library's heuristic sees it. `epilogue` is the library's
// epilogue code (cuBLASLt: cublasLtEpilogue_t); alignments are the largest
// powers of two (≤ 256) dividing the A, B and C pointers.
struct GemmAlgorithmKey {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  bool trans_a = false, trans_b = false;
  DType ab_dtype = DType::f32, c_dtype = DType::f32;
  int32_t epilogue = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0;

  bool operator==(const GemmAlgorithmKey&) const = default;
};

struct GemmAlgorithmKeyHash {
  size_t operator()(const GemmAlgorithmKey& key) const {
    size_t h = 0;
    const auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    for (const int64_t v :
         {key.batch, key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.stride_a, key.stride_b, key.stride_c})
      mix(uint64_t(v));
    mix(uint64_t(key.trans_a) | uint64_t(key.trans_b) << 1 | uint64_t(key.ab_dtype) << 2 | uint64_t(key.c_dtype) << 10 |
        uint64_t(uint32_t(key.epilogue)) << 18);
    mix(uint64_t(key.align_a) | uint64_t(key.align_b) << 16 | uint64_t(key.align_c) << 32);
    return h;
  }
};

// A bounded map from GemmAlgorithmKey to the library's choice (Algorithm:
// whatever the caller stores, e.g. the algorithm and whether one was found).
// When full, the oldest entry makes room. Thread-safe.
template <typename Algorithm>
class GemmAlgorithmCache {
 public:
  static constexpr size_t kDefaultCapacity = 4096;  // a training run or a decode loop uses a few dozen GEMMs

  explicit GemmAlgorithmCache(size_t capacity = kDefaultCapacity) : capacity_(capacity > 0 ? capacity : 1) {}

  std::optional<Algorithm> find(const GemmAlgorithmKey& key) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return it->second;
  }

  void insert(const GemmAlgorithmKey& key, const Algorithm& algorithm) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const bool inserted = entries_.insert_or_assign(key, algorithm).second;
    if (!inserted) return;
    order_.push_back(key);
    if (order_.size() > capacity_) {
      entries_.erase(order_.front());
      order_.pop_front();
    }
  }

  size_t size() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  mutable std::mutex mutex_;
  std::unordered_map<GemmAlgorithmKey, Algorithm, GemmAlgorithmKeyHash> entries_;
  std::deque<GemmAlgorithmKey> order_;  // insertion order, oldest first
};

}  // namespace tessera
