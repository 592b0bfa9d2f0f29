// Fault injection for tests: the environment variable TESSERA_FAULT names
// faults to provoke at chosen steps and ranks, so tests can prove that a
// crash, a hang or a bad value is survived (e.g. that a writer killed in the
// middle of a checkpoint leaves the previous one intact). Off by default and
// free when off: fault_due() returns false after one getenv() when the
// variable is unset.
//
//   TESSERA_FAULT=kind[@step][:rank][,kind[@step][:rank]...]
//   TESSERA_FAULT=checkpoint_crash@20:0     rank 0 dies while writing the step-20 checkpoint
//   TESSERA_FAULT=checkpoint_crash          every rank, every checkpoint
//
// A missing step matches every step, a missing rank every rank. Kinds:
//   checkpoint_crash  the process raises SIGKILL in the middle of writing a
//                     checkpoint (after some tensors, before the rename);
//   slow_checkpoint   it takes 6 s longer in the middle of writing a
//                     checkpoint, its writer making progress all along (a
//                     save slower than --comm-timeout must not be a stall);
//   checkpoint_hang   its writer stops for good in the middle of writing a
//                     checkpoint (a dead mount, a stopped process): the others
//                     must name it within --comm-timeout, not --save-timeout;
//   crash             the process kills itself (SIGKILL) as the step begins;
//   hang              it stops for good as the step begins (the others'
//                     next collective times out: --comm-timeout);
//   slow              it sleeps 2 s as the step begins;
//   nan_grad          its gradients of the step are NaN (the loss gradient is);
//   truncated_data    from the step on, the rank reads its --data file through
//                     a copy cut to half its bytes (the readers' own checks
//                     must end the job, naming the rank and the file);
//   startup_hang      it stops for good during start-up, after building the
//                     model and before the first step (use no @step): a
//                     start-up that never ends must still end on a signal;
//   device_fault      its device faults as the step begins, as after a
//                     kernel's illegal memory access (a real one on CUDA, an
//                     injected sticky error on the emulated device): the
//                     report must blame the device, not the communication.
//   selfcheck_gemm    `tessera selfcheck --cluster` only: the rank perturbs
//                     its GEMM result's checksum (use no @step), so the
//                     arithmetic check must name it;
//   selfcheck_payload `tessera selfcheck --cluster` only: the rank flips a
//                     bit of the payload it sends its ring neighbour, so the
//                     link check must name the pair.
// Steps count from 1: kind@N acts as step N begins (checkpoint_crash@N:
// while the checkpoint after step N is written).
//
// The plan is parsed when first needed and re-parsed only when the variable's
// value changes (a test may set it in a forked child): a function-local cache
// behind a mutex, no other state. A FaultPlan can also be built and queried
// directly, without the environment.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"

namespace tessera {

inline constexpr const char* kFaultVariable = "TESSERA_FAULT";

struct FaultPoint {
  std::string kind;
  std::optional<int64_t> step;  // nothing: every step
  std::optional<int> rank;      // nothing: every rank
};

class FaultPlan {
 public:
  FaultPlan() = default;
  // Parses `text` (the TESSERA_FAULT syntax above); throws tessera::Error
  // naming `source`, the bad entry and the syntax. Empty text: no faults.
  static FaultPlan parse(std::string_view text, std::string_view source = kFaultVariable);

  bool empty() const { return points_.empty(); }
  const std::vector<FaultPoint>& points() const { return points_; }
  // Whether a point of `kind` matches `step` and `rank`.
  bool due(std::string_view kind, int64_t step, int rank) const;

 private:
  std::vector<FaultPoint> points_;
};

// The kinds the parser accepts.
const std::vector<std::string_view>& fault_kinds();

// Whether TESSERA_FAULT asks for a fault of `kind` at `step` on `rank` (the
// world rank). False at the cost of one getenv() when the variable is unset;
// throws tessera::Error when it is set but malformed.
bool fault_due(std::string_view kind, int64_t step, int rank);

// Makes `device` fail as after a kernel's illegal memory access: every later
// call about it fails (the device_fault kind).
void provoke_device_fault(Device device);

namespace detail {
// A kernel that writes to an invalid address on CUDA device `device`
// (core/cuda/fault_kernel.cu; throws in builds without CUDA).
void cuda_provoke_illegal_address(int device);
}  // namespace detail

}  // namespace tessera
