// The decoder block of parallel/transformer_block.h: which parts its choices
// pick, and the gradients sequence parallelism leaves partial.
#include "parallel/transformer_block.h"

#include <vector>

#include "parallel/llama_layers.h"

namespace tessera::parallel {

std::unique_ptr<nn::Module> make_norm(const nn::ModelSpec& spec, std::string name, int64_t dim,
                                      const nn::ModelConfig& model) {
  if (model.decoder().normalization == nn::Normalization::rms_norm)
    return std::make_unique<nn::RMSNorm>(spec, std::move(name), dim, model.norm_epsilon);
  return std::make_unique<nn::LayerNorm>(spec, std::move(name), dim, model.norm_epsilon);
}

MoeConfig moe_config(const nn::ModelConfig& m) {
  MoeConfig moe;
  moe.num_experts = m.num_experts;
  moe.top_k = m.moe_router_topk;
  moe.ffn_hidden = m.moe_ffn();
  moe.capacity_factor = m.moe_expert_capacity_factor;
  moe.aux_loss_coeff = m.moe_aux_loss_coeff;
  moe.z_loss_coeff = m.moe_z_loss_coeff;
  return moe;
}

namespace {

nn::ModelConfig gpt2_block(int64_t hidden, int64_t heads, int64_t ffn_hidden, float dropout, float attention_dropout,
                           bool recompute) {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::gpt;
  m.hidden_size = hidden;
  m.num_heads = heads;
  m.ffn_hidden_size = ffn_hidden;
  m.dropout = dropout;
  m.attention_dropout = attention_dropout;
  m.recompute = recompute;
  return m;
}

// The row-parallel layer's bias (whole on every rank: each adds its part of the
// sequence's gradient under sequence parallelism), if it has one.
nn::Parameter* row_bias(nn::Module& layer) {
  for (nn::Parameter* p : layer.parameters())
    if (p->name.size() >= 10 && p->name.compare(p->name.size() - 10, 10, ".proj.bias") == 0) return p;
  return nullptr;
}

}  // namespace

ParallelTransformerBlock::ParallelTransformerBlock(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                                   const nn::ModelConfig& m, int64_t layer)
    : PreLnBlock(spec, std::move(name), m.recompute) {
  const nn::DecoderChoices choices = m.decoder();
  const int64_t c = m.hidden_size;
  nn::Module& ln1 = adopt_child(make_norm(spec, child_name("ln1"), c, m));
  if (m.grouped_attention())
    attn_ = &add_child<ParallelGroupedAttention>(spec, child_name("attn"), tp, c, m.num_heads, m.query_groups(),
                                                 choices.rotary ? m.rotary_base : 0.0f, m.dropout, m.attention_dropout,
                                                 choices.bias);
  else
    attn_ = &add_child<ParallelSelfAttention>(spec, child_name("attn"), tp, c, m.num_heads, m.dropout,
                                              m.attention_dropout, choices.bias);
  nn::Module& ln2 = adopt_child(make_norm(spec, child_name("ln2"), c, m));
  if (m.moe_layer(layer))
    mlp_ = &add_child<MixtureOfExperts>(spec, child_name("mlp"), c, moe_config(m), m.dropout, tp);
  else if (choices.swiglu)
    mlp_ = &add_child<ParallelGatedMlp>(spec, child_name("mlp"), tp, c, m.ffn(), m.dropout, choices.bias);
  else
    mlp_ = &add_child<ParallelMlp>(spec, child_name("mlp"), tp, c, m.ffn(), m.dropout, choices.bias);
  set_parts(ln1, *attn_, ln2, *mlp_);
  if (tp.sequence_parallel && tp.size() > 1) {
    std::vector<nn::Parameter*> partial = ln1.parameters();
    for (nn::Parameter* p : ln2.parameters()) partial.push_back(p);
    for (nn::Module* part : {attn_, mlp_})
      if (nn::Parameter* bias = row_bias(*part)) partial.push_back(bias);
    if (m.moe_layer(layer))  // each rank routes its part of the sequence through whole experts
      for (nn::Parameter* p : mlp_->parameters()) partial.push_back(p);
    partial_ = std::make_unique<SequenceParallelGradients>(partial, *tp.group);
  }
}

ParallelTransformerBlock::ParallelTransformerBlock(const nn::ModelSpec& spec, std::string name, TensorParallelism tp,
                                                   int64_t hidden, int64_t heads, int64_t ffn_hidden, float dropout,
                                                   float attention_dropout, bool recompute)
    : ParallelTransformerBlock(spec, std::move(name), tp,
                               gpt2_block(hidden, heads, ffn_hidden, dropout, attention_dropout, recompute)) {}

void ParallelTransformerBlock::before_backward() {
  if (partial_) partial_->begin();
}

void ParallelTransformerBlock::after_backward() {
  if (partial_) partial_->end();
}

}  // namespace tessera::parallel
