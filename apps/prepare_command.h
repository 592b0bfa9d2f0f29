// `tessera prepare`: raw data into Tessera's HDF5 datasets (io/prepare.h).
//   tessera prepare idx --images F --labels F -o out.h5 [--num-classes K]
//   tessera prepare text -o out.h5 [--eval-output out.eval.h5] [--eval-fraction 0.05]
//                        [--tokenizer bytes|bpe] [--vocab-size N | --vocab vocab.json --merges merges.txt] FILES...
//   tessera prepare megatron|llmc INPUTS... -o out.h5 [--vocab-size N]
#pragma once

#include <CLI/CLI.hpp>

namespace tessera::app {

// Adds the `prepare` subcommand (with `idx`, `text`, `megatron` and `llmc`) to `app`. When one
// runs it prints what it wrote and sets `exit_code` to 0; preparation errors
// are thrown as tessera::Error for main() to print. On a terminal, a progress
// line on stderr is rewritten in place; elsewhere nothing is printed to stderr.
void register_prepare_command(CLI::App& app, int& exit_code);

}  // namespace tessera::app
