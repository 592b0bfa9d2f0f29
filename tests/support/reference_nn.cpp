// The double-precision reference layers and GPT of reference_nn.h: direct
// loops, no blocking, no online softmax, nothing shared with the kernels.
#include "tests/support/reference_nn.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace tessera::testing::reference {
namespace {

const Vec& get(const Params& p, const std::string& name) {
  const auto it = p.find(name);
  if (it == p.end()) throw std::invalid_argument("reference: no parameter '" + name + "'");
  return it->second;
}

}  // namespace

Vec linear(const Vec& x, const Vec& w, const Vec& b, int64_t rows, int64_t in, int64_t out) {
  Vec y(size_t(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double sum = b.empty() ? 0.0 : b[size_t(o)];
      for (int64_t i = 0; i < in; ++i) sum += x[size_t(r * in + i)] * w[size_t(o * in + i)];
      y[size_t(r * out + o)] = sum;
    }
  return y;
}

Vec relu(const Vec& x) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] > 0 ? x[i] : 0.0;
  return y;
}

Vec gelu(const Vec& x) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    y[i] = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
  }
  return y;
}

Vec add(const Vec& a, const Vec& b) {
  Vec y(a.size());
  for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] + b[i];
  return y;
}

Vec layernorm(const Vec& x, const Vec& w, const Vec& b, int64_t d, double eps) {
  Vec y(x.size());
  const int64_t rows = int64_t(x.size()) / d;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * d;
    double mean = 0;
    for (int64_t i = 0; i < d; ++i) mean += row[i];
    mean /= double(d);
    double var = 0;
    for (int64_t i = 0; i < d; ++i) var += (row[i] - mean) * (row[i] - mean);
    var /= double(d);
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < d; ++i)
      y[size_t(r * d + i)] = (row[i] - mean) * rstd * w[size_t(i)] + (b.empty() ? 0.0 : b[size_t(i)]);
  }
  return y;
}

Vec rmsnorm(const Vec& x, const Vec& w, int64_t d, double eps) {
  Vec y(x.size());
  const int64_t rows = int64_t(x.size()) / d;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * d;
    double ms = 0;
    for (int64_t i = 0; i < d; ++i) ms += row[i] * row[i];
    const double rstd = 1.0 / std::sqrt(ms / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[size_t(r * d + i)] = row[i] * rstd * w[size_t(i)];
  }
  return y;
}

Vec conv2d(const Vec& x, const Vec& weight, const Vec& b, int64_t n, int64_t c, int64_t h, int64_t w, int64_t k,
           int64_t r, int64_t stride, int64_t pad) {
  const int64_t p = (h + 2 * pad - r) / stride + 1, q = (w + 2 * pad - r) / stride + 1;
  Vec y(size_t(n * k * p * q));
  for (int64_t in = 0; in < n; ++in)
    for (int64_t ik = 0; ik < k; ++ik)
      for (int64_t ip = 0; ip < p; ++ip)
        for (int64_t iq = 0; iq < q; ++iq) {
          double sum = b.empty() ? 0.0 : b[size_t(ik)];
          for (int64_t ic = 0; ic < c; ++ic)
            for (int64_t dr = 0; dr < r; ++dr)
              for (int64_t ds = 0; ds < r; ++ds) {
                const int64_t ih = ip * stride - pad + dr, iw = iq * stride - pad + ds;
                if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
                sum += x[size_t(((in * c + ic) * h + ih) * w + iw)] * weight[size_t(((ik * c + ic) * r + dr) * r + ds)];
              }
          y[size_t(((in * k + ik) * p + ip) * q + iq)] = sum;
        }
  return y;
}

Vec maxpool2d(const Vec& x, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kernel, int64_t stride, int64_t pad) {
  const int64_t p = (h + 2 * pad - kernel) / stride + 1, q = (w + 2 * pad - kernel) / stride + 1;
  Vec y(size_t(n * c * p * q));
  for (int64_t plane = 0; plane < n * c; ++plane)
    for (int64_t ip = 0; ip < p; ++ip)
      for (int64_t iq = 0; iq < q; ++iq) {
        double best = -std::numeric_limits<double>::infinity();
        for (int64_t dr = 0; dr < kernel; ++dr)
          for (int64_t ds = 0; ds < kernel; ++ds) {
            const int64_t ih = ip * stride - pad + dr, iw = iq * stride - pad + ds;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            best = std::max(best, x[size_t((plane * h + ih) * w + iw)]);
          }
        y[size_t((plane * p + ip) * q + iq)] = best;
      }
  return y;
}

Vec attention(const Vec& qkv, int64_t b, int64_t t, int64_t heads, int64_t dh) {
  Vec out(size_t(b * t * heads * dh), 0.0);
  const double scale = 1.0 / std::sqrt(double(dh));
  // Element (batch, token, which ∈ {q, k, v}, head, d).
  const auto at = [&](int64_t ib, int64_t it, int64_t which, int64_t ih, int64_t d) {
    return qkv[size_t((((ib * t + it) * 3 + which) * heads + ih) * dh + d)];
  };
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t ih = 0; ih < heads; ++ih)
      for (int64_t i = 0; i < t; ++i) {
        Vec scores(size_t(i + 1));
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < dh; ++d) dot += at(ib, i, 0, ih, d) * at(ib, j, 1, ih, d);
          scores[size_t(j)] = dot * scale;
          top = std::max(top, scores[size_t(j)]);
        }
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - top));
        for (int64_t d = 0; d < dh; ++d) {
          double sum = 0;
          for (int64_t j = 0; j <= i; ++j) sum += scores[size_t(j)] / total * at(ib, j, 2, ih, d);
          out[size_t(((ib * t + i) * heads + ih) * dh + d)] = sum;
        }
      }
  return out;
}

Vec embedding(const Ids& ids, const Vec& table, int64_t dim) {
  Vec out(ids.size() * size_t(dim));
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t d = 0; d < dim; ++d) out[n * size_t(dim) + size_t(d)] = table[size_t(ids[n] * dim + d)];
  return out;
}

double cross_entropy(const Vec& logits, const Ids& targets, int64_t vocab, int64_t ignore_index) {
  double total = 0;
  int64_t count = 0;
  for (size_t n = 0; n < targets.size(); ++n) {
    if (targets[n] == ignore_index) continue;
    const double* row = logits.data() + n * size_t(vocab);
    const double top = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - top);
    total += top + std::log(sum) - row[targets[n]];
    ++count;
  }
  return count == 0 ? 0.0 : total / double(count);
}

Vec causal_self_attention(const Params& p, const std::string& prefix, const Vec& x, int64_t b, int64_t t, int64_t c,
                          int64_t heads) {
  const Vec qkv = linear(x, get(p, prefix + ".qkv.weight"), get(p, prefix + ".qkv.bias"), b * t, c, 3 * c);
  const Vec out = attention(qkv, b, t, heads, c / heads);
  return linear(out, get(p, prefix + ".proj.weight"), get(p, prefix + ".proj.bias"), b * t, c, c);
}

Vec mlp_block(const Params& p, const std::string& prefix, const Vec& x, int64_t rows, int64_t c, int64_t ffn) {
  const Vec hidden = gelu(linear(x, get(p, prefix + ".fc.weight"), get(p, prefix + ".fc.bias"), rows, c, ffn));
  return linear(hidden, get(p, prefix + ".proj.weight"), get(p, prefix + ".proj.bias"), rows, ffn, c);
}

Vec transformer_block(const Params& p, const std::string& prefix, const Vec& x, int64_t b, int64_t t, int64_t c,
                      int64_t heads, int64_t ffn) {
  const Vec a = layernorm(x, get(p, prefix + ".ln1.weight"), get(p, prefix + ".ln1.bias"), c);
  const Vec h = add(x, causal_self_attention(p, prefix + ".attn", a, b, t, c, heads));
  const Vec m = layernorm(h, get(p, prefix + ".ln2.weight"), get(p, prefix + ".ln2.bias"), c);
  return add(h, mlp_block(p, prefix + ".mlp", m, b * t, c, ffn));
}

Vec gpt_logits(const GptShape& shape, const Params& p, const Ids& ids, int64_t b, int64_t t) {
  const int64_t c = shape.hidden;
  const Vec& wte = get(p, "wte.weight");
  const Vec& wpe = get(p, "wpe.weight");
  Vec x = embedding(ids, wte, c);
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t it = 0; it < t; ++it)
      for (int64_t d = 0; d < c; ++d) x[size_t((ib * t + it) * c + d)] += wpe[size_t(it * c + d)];
  for (int64_t l = 0; l < shape.layers; ++l)
    x = transformer_block(p, "blocks." + std::to_string(l), x, b, t, c, shape.heads, shape.ffn);
  x = layernorm(x, get(p, "ln_f.weight"), get(p, "ln_f.bias"), c);
  return linear(x, wte, {}, b * t, c, shape.vocab);
}

double gpt_loss(const GptShape& shape, const Params& p, const Ids& ids, const Ids& targets, int64_t b, int64_t t,
                int64_t ignore_index) {
  return cross_entropy(gpt_logits(shape, p, ids, b, t), targets, shape.vocab, ignore_index);
}

namespace {

// Rows [first·width, (first + count)·width) of a row-major [*, c] matrix.
Vec rows_of(const Vec& w, int64_t first, int64_t count, int64_t c) {
  return Vec(w.begin() + first * c, w.begin() + (first + count) * c);
}

// q, k, v projections from the grouped qkv weight [G·(R+2)·Dh, c].
struct Projections {
  Vec q, k, v;  // [H·Dh, c], [G·Dh, c], [G·Dh, c]
};
Projections split_grouped_qkv(const Vec& w, int64_t heads, int64_t groups, int64_t dh, int64_t c) {
  const int64_t r = heads / groups;
  Projections out;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t base = g * (r + 2) * dh;
    const Vec q = rows_of(w, base, r * dh, c), k = rows_of(w, base + r * dh, dh, c),
              v = rows_of(w, base + (r + 1) * dh, dh, c);
    out.q.insert(out.q.end(), q.begin(), q.end());
    out.k.insert(out.k.end(), k.begin(), k.end());
    out.v.insert(out.v.end(), v.begin(), v.end());
  }
  return out;
}

// Hugging Face's apply_rotary_pos_emb on x [b, t, n, dh]: x·cos + rotate_half(x)·sin,
// the angle of feature i (and i + dh/2) at position p being p·base^(−2i/dh).
void rotate(Vec& x, int64_t b, int64_t t, int64_t n, int64_t dh, double base) {
  const int64_t half = dh / 2;
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t it = 0; it < t; ++it)
      for (int64_t ih = 0; ih < n; ++ih) {
        double* row = x.data() + ((ib * t + it) * n + ih) * dh;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = double(it) * std::pow(base, -2.0 * double(i) / double(dh));
          const double x1 = row[i], x2 = row[i + half];
          row[i] = x1 * std::cos(angle) - x2 * std::sin(angle);
          row[i + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
        }
      }
}

// The linear layer "<prefix>.weight" (and "<prefix>.bias" when the model has biases).
Vec linear_of(const LlamaShape& s, const Params& p, const std::string& prefix, const Vec& x, int64_t rows, int64_t in,
              int64_t out) {
  return linear(x, get(p, prefix + ".weight"), s.bias ? get(p, prefix + ".bias") : Vec{}, rows, in, out);
}

Vec llama_attention(const LlamaShape& s, const Params& p, const std::string& prefix, const Vec& x, int64_t b,
                    int64_t t) {
  const int64_t c = s.hidden, dh = c / s.heads, r = s.heads / s.groups;
  if (s.gpt2_qkv) {  // GPT-2's layout: multi-head, no rotation
    const Vec qkv = linear_of(s, p, prefix + ".qkv", x, b * t, c, 3 * c);
    return linear_of(s, p, prefix + ".proj", attention(qkv, b, t, s.heads, dh), b * t, c, c);
  }
  const Projections w = split_grouped_qkv(get(p, prefix + ".qkv.weight"), s.heads, s.groups, dh, c);
  const Projections bias = s.bias ? split_grouped_qkv(get(p, prefix + ".qkv.bias"), s.heads, s.groups, dh, 1)
                                  : Projections{};
  Vec q = linear(x, w.q, bias.q, b * t, c, s.heads * dh);
  Vec k = linear(x, w.k, bias.k, b * t, c, s.groups * dh);
  const Vec v = linear(x, w.v, bias.v, b * t, c, s.groups * dh);
  if (!s.learned_positions) {
    rotate(q, b, t, s.heads, dh, s.rotary_base);
    rotate(k, b, t, s.groups, dh, s.rotary_base);
  }
  // repeat_kv, packed as attention() reads it: [b, t, 3, heads, dh].
  Vec qkv(size_t(b * t * 3 * s.heads * dh));
  for (int64_t row = 0; row < b * t; ++row)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t d = 0; d < dh; ++d) {
        const size_t at = size_t((row * 3 * s.heads + h) * dh + d), step = size_t(s.heads * dh);
        qkv[at] = q[size_t((row * s.heads + h) * dh + d)];
        qkv[at + step] = k[size_t((row * s.groups + h / r) * dh + d)];
        qkv[at + 2 * step] = v[size_t((row * s.groups + h / r) * dh + d)];
      }
  const Vec out = attention(qkv, b, t, s.heads, dh);
  return linear_of(s, p, prefix + ".proj", out, b * t, s.heads * dh, c);
}

Vec llama_mlp(const LlamaShape& s, const Params& p, const std::string& prefix, const Vec& x, int64_t rows) {
  if (s.gelu) {
    const Vec hidden = gelu(linear_of(s, p, prefix + ".fc", x, rows, s.hidden, s.ffn));
    return linear_of(s, p, prefix + ".proj", hidden, rows, s.ffn, s.hidden);
  }
  const Vec& fc = get(p, prefix + ".fc.weight");
  const Vec fc_bias = s.bias ? get(p, prefix + ".fc.bias") : Vec{};
  const auto part = [&](int64_t first) {
    return linear(x, rows_of(fc, first, s.ffn, s.hidden), s.bias ? rows_of(fc_bias, first, s.ffn, 1) : Vec{}, rows,
                  s.hidden, s.ffn);
  };
  const Vec gate = part(0), up = part(s.ffn);
  Vec hidden(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) hidden[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  return linear_of(s, p, prefix + ".proj", hidden, rows, s.ffn, s.hidden);
}

Vec llama_norm(const LlamaShape& s, const Params& p, const std::string& prefix, const Vec& x) {
  if (s.layer_norm) return layernorm(x, get(p, prefix + ".weight"), get(p, prefix + ".bias"), s.hidden, s.eps);
  return rmsnorm(x, get(p, prefix + ".weight"), s.hidden, s.eps);
}

}  // namespace

Vec llama_logits(const LlamaShape& shape, const Params& p, const Ids& ids, int64_t b, int64_t t) {
  const int64_t c = shape.hidden;
  Vec x = embedding(ids, get(p, "wte.weight"), c);
  if (shape.learned_positions) {
    const Vec& wpe = get(p, "wpe.weight");
    for (int64_t row = 0; row < b * t; ++row)
      for (int64_t d = 0; d < c; ++d) x[size_t(row * c + d)] += wpe[size_t((row % t) * c + d)];
  }
  for (int64_t l = 0; l < shape.layers; ++l) {
    const std::string prefix = "blocks." + std::to_string(l);
    const Vec h = add(x, llama_attention(shape, p, prefix + ".attn", llama_norm(shape, p, prefix + ".ln1", x), b, t));
    x = add(h, llama_mlp(shape, p, prefix + ".mlp", llama_norm(shape, p, prefix + ".ln2", h), b * t));
  }
  x = llama_norm(shape, p, "ln_f", x);
  return linear(x, get(p, shape.tied ? "wte.weight" : "lm_head.weight"), {}, b * t, c, shape.vocab);
}

double llama_loss(const LlamaShape& shape, const Params& p, const Ids& ids, const Ids& targets, int64_t b, int64_t t,
                  int64_t ignore_index) {
  return cross_entropy(llama_logits(shape, p, ids, b, t), targets, shape.vocab, ignore_index);
}

}  // namespace tessera::testing::reference
