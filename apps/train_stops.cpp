// The stop decisions (apps/train_stops.h): the agreed preemption signal and
// --exit-interval, with the words the run's last lines give for them.
#include "apps/train_stops.h"

#include <string>

namespace tessera::app {

void PreemptionStop::on_run_start(const io::RunStart&) {
  signals_.training_started();  // from here a signal asks for a checkpoint at the next step boundary
}

void PreemptionStop::boundary_flags(const io::BoundaryRound&, std::vector<int32_t>& flags) {
  const int received = signals_.received();
  flags.push_back(received);
  flags.push_back(received ? rank_ : -1);
}

void PreemptionStop::on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                                 io::BoundaryDecision& decision) {
  const int signal = agreed[0], signal_rank = agreed[1];
  if (signal == 0) return;
  decision.request_stop({std::string(signal_name(signal)) + " received by rank " + std::to_string(signal_rank) +
                             "; stopped after step " + std::to_string(round.step),
                         signal});
}

void ExitInterval::on_boundary(const io::BoundaryRound& round, std::span<const int32_t>,
                               io::BoundaryDecision& decision) {
  if (round.after_save || config_.exit_interval <= 0 || round.step % config_.exit_interval != 0) return;
  decision.request_stop(
      {"--exit-interval " + std::to_string(config_.exit_interval) + " reached at step " + std::to_string(round.step)});
}

}  // namespace tessera::app
