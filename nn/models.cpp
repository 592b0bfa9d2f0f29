// ModelConfig validation and the builders of the mlp, cnn and gpt models
// described in nn/models.h.
#include "nn/models.h"

#include <cmath>
#include <cstdlib>
#include <ostream>

#include "core/context.h"

namespace tessera::nn {
namespace {

// One row per ModelKind, in the enumerators' order.
constexpr ModelTraits kModels[] = {
    {"mlp", false, true, false, "layers"},
    {"cnn", false, false, false, "layers"},
    {"gpt", true, true, true, "blocks"},
};

}  // namespace

const ModelTraits& model_traits(ModelKind kind) {
  return kModels[size_t(kind)];
}

std::ostream& operator<<(std::ostream& out, ModelKind kind) {
  return out << model_name(kind);
}

ModelKind parse_model_kind(std::string_view text) {
  std::string known;
  for (size_t i = 0; i < std::size(kModels); ++i) {
    if (kModels[i].name == text) return ModelKind(i);
    known += std::string(i == 0 ? "" : i + 1 == std::size(kModels) ? " or " : ", ") + std::string(kModels[i].name);
  }
  TESSERA_THROW("--model '", text, "' is not a model this build knows; use ", known);
}

void ModelConfig::validate() const {
  const std::string_view name = model_name(kind);
  if (!model_traits(kind).reads_tokens) {
    TESSERA_CHECK(channels >= 1 && height >= 1 && width >= 1, name, ": the dataset's input shape (C, H, W) = (",
                  channels, ", ", height, ", ", width, ") has an empty dimension");
    TESSERA_CHECK(num_classes >= 2, name, ": the dataset has ", num_classes, " classes; a classifier needs at least 2");
  }
  if (kind == ModelKind::mlp) {
    for (size_t i = 0; i < hidden.size(); ++i)
      TESSERA_CHECK(hidden[i] >= 1, "--hidden: layer ", i, " has width ", hidden[i], "; widths must be at least 1");
  }
  if (kind == ModelKind::cnn) {
    TESSERA_CHECK(height >= 4 && width >= 4, "cnn: its two 2x2 poolings need images of at least 4x4, the dataset has ",
                  height, "x", width, "; use --model mlp");
  }
  if (kind == ModelKind::gpt) {
    TESSERA_CHECK(vocab_size >= 1, "--vocab-size ", vocab_size, " must be at least 1");
    TESSERA_CHECK(seq_length >= 1, "--seq-length ", seq_length, " must be at least 1");
    TESSERA_CHECK(num_layers >= 1, "--num-layers ", num_layers, " must be at least 1");
    TESSERA_CHECK(hidden_size >= 1, "--hidden-size ", hidden_size, " must be at least 1");
    TESSERA_CHECK(num_heads >= 1, "--num-heads ", num_heads, " must be at least 1");
    if (hidden_size % num_heads != 0) {
      int64_t nearest = 1;  // the divisor of hidden_size closest to the requested head count (the larger on a tie)
      for (int64_t d = 1; d <= hidden_size; ++d)
        if (hidden_size % d == 0 && std::abs(d - num_heads) <= std::abs(nearest - num_heads)) nearest = d;
      TESSERA_THROW("--num-heads ", num_heads, " does not divide --hidden-size ", hidden_size,
                    "; choose a head count that divides it (e.g. --num-heads ", nearest, ": heads of ",
                    hidden_size / nearest, ")");
    }
    TESSERA_CHECK(ffn_hidden_size >= 0, "--ffn-hidden-size ", ffn_hidden_size,
                  " must be positive (or 0 for 4 x --hidden-size)");
    TESSERA_CHECK(dropout >= 0.0f && dropout < 1.0f, "--dropout ", dropout, " must be in [0, 1)");
  }
}

// ---------------------------------------------------------------------------
// GPT
// ---------------------------------------------------------------------------
Gpt::Gpt(const ModelConfig& config, const ModelSpec& spec) : Module(spec, ""), config_(config) {
  config_.validate();
  TESSERA_CHECK(config_.kind == ModelKind::gpt, "Gpt built from a '", model_name(config_.kind), "' configuration");
  const int64_t c = config_.hidden_size;
  wte_ = &add_child<Embedding>(spec, "wte", config_.vocab_size, c);
  wpe_ = &add_child<PositionEmbedding>(spec, "wpe", config_.seq_length, c);
  dropout_ = &add_child<Dropout>(spec, "dropout", config_.dropout);
  for (int64_t i = 0; i < config_.num_layers; ++i)
    blocks_.push_back(&add_child<TransformerBlock>(spec, "blocks." + std::to_string(i), c, config_.num_heads,
                                                   config_.ffn(), config_.dropout, config_.recompute));
  ln_f_ = &add_child<LayerNorm>(spec, "ln_f", c);

  // GPT-2 initialisation (the layers' defaults are PyTorch's; norms already 1/0).
  constexpr float kStd = 0.02f;
  const float residual_std = kStd / std::sqrt(2.0f * float(config_.num_layers));
  init_normal(wte_->weight(), kStd);
  init_normal(wpe_->weight(), kStd);
  for (TransformerBlock* block : blocks_) {
    for (Linear* linear : {&block->attn().qkv(), &block->attn().proj(), &block->mlp().fc(), &block->mlp().proj()}) {
      const bool residual = linear == &block->attn().proj() || linear == &block->mlp().proj();
      init_normal(linear->weight(), residual ? residual_std : kStd);
      init_constant(*linear->bias(), 0.0f);
    }
  }
}

void Gpt::set_recompute(bool recompute) {
  config_.recompute = recompute;
  for (TransformerBlock* block : blocks_) block->set_recompute(recompute);
}

Tensor Gpt::forward(const Tensor& ids, Saved& saved, const Pass& pass) {
  TESSERA_CHECK(ids.ndim() == 2, "gpt: token ids must be [batch, tokens], got shape ", ids.shape().to_string());
  TESSERA_CHECK(ids.size(1) <= config_.seq_length, "gpt: a sequence of ", ids.size(1),
                " tokens is longer than --seq-length ", config_.seq_length);
  const int64_t batch = ids.size(0), tokens = ids.size(1), c = config_.hidden_size, vocab = config_.vocab_size;
  Tensor x = wte_->forward(ids, saved.child(0), pass);
  x = wpe_->forward(x, saved.child(1), pass);
  x = dropout_->forward(x, saved.child(2), pass);
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward(x, saved.child(3 + i), pass);
  x = ln_f_->forward(x, saved.child(3 + blocks_.size()), pass);
  const Tensor features = x.view(Shape{batch * tokens, c});
  Tensor logits = context().empty(Shape{batch * tokens, vocab}, spec().dtype, spec().device);
  ops::MatmulOptions options;
  options.transpose_b = true;
  ops::matmul(features, wte_->weight().value, logits, options);
  saved.tensors = {features};
  saved.scalars = {batch, tokens};
  return logits.view(Shape{batch, tokens, vocab});
}

Tensor Gpt::backward_impl(const Tensor& grad_logits, Saved& saved) {
  TESSERA_CHECK(saved.tensors.size() == 1 && saved.scalars.size() == 2, "gpt: backward without a matching forward");
  const Tensor features = saved.tensors[0];
  const int64_t batch = saved.scalars[0], tokens = saved.scalars[1];
  saved.tensors.clear();
  saved.scalars.clear();
  const int64_t rows = batch * tokens, c = config_.hidden_size, vocab = config_.vocab_size;
  TESSERA_CHECK(grad_logits.numel() == rows * vocab, "gpt: the logits gradient has shape ",
                grad_logits.shape().to_string(), ", expected ", rows, " rows of ", vocab);
  const Tensor dlogits = grad_logits.view(Shape{rows, vocab});
  Parameter& wte = wte_->weight();
  // logits = x·wteᵀ: the head's share of wte's gradient, then the features' gradient.
  ops::matmul_backward(dlogits, features, wte.value, nullptr, &wte.grad, false, true, /*accumulate=*/true);
  Tensor grad = context().empty(features.shape(), spec().dtype, spec().device);
  ops::matmul_backward(dlogits, features, wte.value, &grad, nullptr, false, true, /*accumulate=*/false);
  grad = grad.view(Shape{batch, tokens, c});
  grad = ln_f_->backward(grad, saved.child(3 + blocks_.size()));
  for (size_t i = blocks_.size(); i-- > 0;) grad = blocks_[i]->backward(grad, saved.child(3 + i));
  grad = dropout_->backward(grad, saved.child(2));
  grad = wpe_->backward(grad, saved.child(1));
  wte_->backward(grad, saved.child(0));  // the embedding's share of wte's gradient
  saved.clear();
  return Tensor();
}

// ---------------------------------------------------------------------------
// Classifiers
// ---------------------------------------------------------------------------
namespace {

// Layers [stage.begin, stage.end) of the MLP's linear layers (the input cast
// and flatten on the first stage).
std::unique_ptr<Module> build_mlp(const ModelConfig& config, const ModelSpec& spec, const StageLayers& stage) {
  auto model = std::make_unique<Sequential>(spec, "");
  if (stage.first()) {
    model->add<InputCast>(spec, "input_cast");
    model->add<Flatten>(spec, "flatten");
  }
  const int64_t layers = int64_t(config.hidden.size()) + 1, end = stage.end < 0 ? layers : stage.end;
  int64_t in = config.channels * config.height * config.width;
  for (int64_t index = 0; index < layers; ++index) {
    const bool head = index + 1 == layers;
    const int64_t width = head ? config.num_classes : config.hidden[size_t(index)];
    if (index >= stage.begin && index < end) {
      Linear& layer = model->add<Linear>(spec, "layers." + std::to_string(index), in, width, true,
                                         head ? ops::Activation::none : ops::Activation::relu);
      if (index == 0) layer.set_input_grad(false);  // the data needs no gradient
    }
    in = width;
  }
  return model;
}

std::unique_ptr<Module> build_cnn(const ModelConfig& config, const ModelSpec& spec) {
  auto model = std::make_unique<Sequential>(spec, "");
  model->add<InputCast>(spec, "input_cast");
  model->add<Conv2d>(spec, "conv1", config.channels, 32, 5, 1, 2).set_input_grad(false);
  model->add<ReLU>(spec, "relu1");
  model->add<MaxPool2d>(spec, "pool1", 2);
  model->add<Conv2d>(spec, "conv2", 32, 64, 5, 1, 2);
  model->add<ReLU>(spec, "relu2");
  model->add<MaxPool2d>(spec, "pool2", 2);
  model->add<Flatten>(spec, "flatten");
  const int64_t features = 64 * (config.height / 2 / 2) * (config.width / 2 / 2);
  model->add<Linear>(spec, "fc1", features, 1024, true, ops::Activation::relu);
  model->add<Linear>(spec, "fc2", 1024, config.num_classes);
  return model;
}

}  // namespace

int64_t pipeline_layers(const ModelConfig& config) {
  switch (config.kind) {
    case ModelKind::gpt:
      return config.num_layers;
    case ModelKind::mlp:
      return int64_t(config.hidden.size()) + 1;
    case ModelKind::cnn:
      return 0;
  }
  return 0;
}

LayerCosts layer_costs(const ModelConfig& m) {
  LayerCosts costs;
  const int64_t layers = pipeline_layers(m);
  if (m.kind == ModelKind::gpt) {
    // ln_1, attention (qkv and output projections), ln_2, the MLP's two layers.
    const int64_t h = m.hidden_size, f = m.ffn();
    const int64_t block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h);
    costs.layers.assign(size_t(layers), block);
    costs.first = m.vocab_size * h + m.seq_length * h;  // wte, wpe
    costs.last = m.vocab_size * h + 2 * h;              // ln_f and the head's tied copy of wte
  } else {
    int64_t in = m.channels * m.height * m.width;
    for (int64_t i = 0; i < layers; ++i) {
      const int64_t out = i + 1 == layers ? m.num_classes : m.hidden[size_t(i)];
      costs.layers.push_back(in * out + out);
      in = out;
    }
  }
  return costs;
}

std::unique_ptr<Module> build_model(const ModelConfig& config, const ModelSpec& spec, const StageLayers& stage) {
  config.validate();
  TESSERA_CHECK(config.kind == ModelKind::mlp || stage.stages == 1, "--pipeline-parallel ", stage.stages, ": --model ",
                model_name(config.kind),
                " is not split into pipeline stages here (gpt stages are built by "
                "parallel::TensorParallelGpt; cnn trains with --pipeline-parallel 1)");
  const int64_t layers = pipeline_layers(config), end = stage.end < 0 ? layers : stage.end;
  TESSERA_CHECK(stage.begin >= 0 && stage.begin <= end && end <= layers, "pipeline stage ", stage.stage, " of ",
                model_name(config.kind), ": layers [", stage.begin, ", ", end, ") are not among its ", layers,
                " layers");
  if (config.kind == ModelKind::mlp) return build_mlp(config, spec, stage);
  return build_model(config, spec);
}

std::unique_ptr<Module> build_model(const ModelConfig& config, const ModelSpec& spec) {
  config.validate();
  switch (config.kind) {
    case ModelKind::mlp:
      return build_mlp(config, spec, StageLayers{});
    case ModelKind::cnn:
      return build_cnn(config, spec);
    case ModelKind::gpt:
      return std::make_unique<Gpt>(config, spec);
  }
  TESSERA_THROW("build_model: model kind ", int(config.kind), " has no builder");
}

int64_t parameter_count(Module& model) {
  int64_t total = 0;
  for (const Parameter* p : model.parameters()) total += p->shard.global_shape.numel();
  return total;
}

}  // namespace tessera::nn
