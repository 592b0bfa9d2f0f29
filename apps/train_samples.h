// The samples `tessera train --sample-interval N` prints, as llm.c does while
// it trains: every N steps and at the end, the model continues --sample-prompt
// (encoded with --data's tokenizer) for --sample-tokens tokens, and rank 0
// prints the text above the progress line. Every rank generates (the
// tensor-parallel group computes the logits together, ZeRO-3 gathers the
// parameters through the data-parallel group), drawing the same tokens, so
// the ranks stay in step. Time spent here is not counted in the step times.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/train_config.h"
#include "io/tokenizer.h"
#include "io/training_events.h"
#include "models/causal_lm.h"

namespace tessera::app {

class TrainingSamples {
 public:
  // Checks everything a sample needs up front (a language model: `model` is
  // this rank's first chunk if the model is one, else null; a tokenizer in
  // --data; a prompt that fits --seq-length with the tokens asked for),
  // naming the flag at fault; does nothing further when --sample-interval is 0.
  TrainingSamples(const TrainConfig& config, models::CausalLm* model);

  bool due(int64_t step, bool last) const;
  // Collective over every rank. Returns the text rank 0 prints ("sample at step 250: ...").
  std::string sample(int64_t step);

 private:
  const TrainConfig& config_;
  models::CausalLm* model_ = nullptr;
  std::optional<io::Tokenizer> tokenizer_;
  std::vector<int32_t> prompt_;
};

// The samples as a component of the training loop (io/training_events.h):
// at the end of each due step (after its evaluation: registered after it)
// every rank generates, and `say` shows the text (rank 0's line).
class SamplesDuringTraining : public io::TrainingComponent {
 public:
  SamplesDuringTraining(TrainingSamples& samples, std::function<void(const std::string&)> say)
      : samples_(samples), say_(std::move(say)) {}
  void on_step_end(io::StepEnd& end) override {
    if (samples_.due(end.step, end.last)) say_(samples_.sample(end.step));
  }

 private:
  TrainingSamples& samples_;
  std::function<void(const std::string&)> say_;
};

}  // namespace tessera::app
