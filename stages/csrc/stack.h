// A stage's decoder layers as one call from Python (stages/layer_loop.py says when it applies).
//
//   stack = LayerStack(weights, heads, kv_heads, head_dim, scale, eps, products, attn_bf16, decode_bf16_over,
//                      cos, sin)
//   products: "fp32", "bf16" or "int8", the linears' products (stages/layers.py: set_matmul_precision);
//   attn_bf16, decode_bf16_over: the attention kernels' bf16 products, the decode kernel's for steps
//   of more than decode_bf16_over decodes (TorchAttention.bf16, .decode_bf16_over, set there too)
//   h = stack.forward(h, caches, StepMeta(positions, slots, q_lens, ctx_lens, prefill_tables, decode_tables,
//                                         decode_lens), times, keep)
//   times: None, or a float64 (5,) tensor that each op's seconds are added to (preproj, attn, postproj,
//   ffn_ln1, ffn_ln2: stages/op_timing.py's buckets, as its hooks time them on the Python loop)
//   keep: None, or the (S,) int64 rows the step samples when this stack ends the model: then only
//   they go on past the last layer's attention, and h comes back (S, H) (stages/model.py says why)
//
// Why: driven from Python, the same kernels pay ~0.1 ms of interpreter and nn.Module dispatch a
// layer (a 1-row decode step at 1 thread: ~3 of 12 ms), and at 2 threads the other core spins
// through it. The ops, their order and their arguments are those of the CPU path of
// stages/model.py and stages/attention/torch_backend.py, so a step gives the same bits.
#pragma once
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "aten.h"
#include "kernels.h"

// a header of one includer (bindings.cpp, which binds LayerStack and StepMeta to Python), so its
// functions are inline and its names in a namespace of their own
namespace layer_stack {

// A layer's slots in the weight list; an empty tensor where the layer has no such part (no QKV
// bias; the half of a layer that a stage boundary gives to the other stage).
enum Slot { IN_NORM, QKV, QKV_BIAS, O, POST_NORM, GATE_UP, DOWN, PER_LAYER };
enum Op { PREPROJ, ATTN, POSTPROJ, FFN_LN1, FFN_LN2, NUM_OPS };  // the per-op timers' buckets

// f(), its seconds added to t[op] where there are timers (t null: just f())
template <typename F>
auto timed(double* t, Op op, const F& f) {
  if (!t) return f();
  const auto t0 = std::chrono::steady_clock::now();
  auto out = f();
  t[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

enum Products { FP32, BF16, INT8 };

inline Products products_of(const std::string& name) {
  if (name == "fp32") return FP32;
  if (name == "bf16") return BF16;
  TORCH_CHECK(name == "int8", "LayerStack: products must be fp32, bf16 or int8, got ", name);
  return INT8;
}

// x wᵀ (+ bias); bias: an empty tensor for none. INT8 applies to the block-quantized panels
// int8_takes (as stages/layers.py's set_matmul_precision: other weights keep fp32 products)
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Products p) {
  c10::optional<at::Tensor> b;
  if (bias.numel()) b = bias;
  if (p == INT8 && int8_takes(w)) return int8_linear(x, w, b, false);
  return panel_linear(x, w, b, p == BF16);
}

// What a step's attention needs beyond the layer: stages/attention/metadata.py's fields.
struct StepMeta {
  at::Tensor positions, slots;        // (T,) int64
  std::vector<int64_t> q_lens, ctx_lens;  // per prefill chunk
  std::vector<at::Tensor> prefill_tables;
  c10::optional<at::Tensor> decode_tables, decode_lens;  // (D, nb), (D,) int64; none without decodes
};

class LayerStack {
 public:
  LayerStack(std::vector<at::Tensor> weights, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
             double eps, const std::string& products, bool attn_bf16, int64_t decode_bf16_over, at::Tensor cos,
             at::Tensor sin)
      : w_(std::move(weights)), h_(heads), hkv_(kv_heads), d_(head_dim), scale_(scale), eps_(eps),
        products_(products_of(products)), attn_bf16_(attn_bf16), decode_bf16_over_(decode_bf16_over),
        cos_(std::move(cos)), sin_(std::move(sin)) {
    TORCH_CHECK(!w_.empty() && w_.size() % PER_LAYER == 0, "LayerStack: ", int(PER_LAYER), " weights a layer");
  }

  int64_t num_layers() const { return static_cast<int64_t>(w_.size()) / PER_LAYER; }

  // h (T, H) contiguous fp32 -> (T, H), or (S, H) with keep. caches: K, V of each layer with attention,
  // in order.
  at::Tensor forward(at::Tensor h, const std::vector<at::Tensor>& caches, const StepMeta& m,
                     c10::optional<at::Tensor> times, c10::optional<at::Tensor> keep) const {
    double* t = nullptr;
    if (times) {
      TORCH_CHECK(times->dtype() == at::kDouble && times->numel() == NUM_OPS && times->is_contiguous(),
                  "LayerStack: times must be a contiguous float64 (", int(NUM_OPS), ",) tensor");
      t = times->data_ptr<double>();
    }
    size_t c = 0;
    for (int64_t l = 0; l < num_layers(); ++l) {
      const at::Tensor* w = w_.data() + l * PER_LAYER;
      const bool attn = w[QKV].numel() > 0, mlp = w[GATE_UP].numel() > 0;
      const at::Tensor* rows = keep && l == num_layers() - 1 ? &*keep : nullptr;  // the last layer's
      if (attn) {
        TORCH_CHECK(c + 2 <= caches.size(), "LayerStack: fewer KV caches than attention layers");
        at::Tensor a = attention(rms_norm(h, w[IN_NORM], eps_), w, caches[c], caches[c + 1], m, t, rows);  // (T | S, H)
        c += 2;
        if (rows) h = h.index_select(0, *rows);
        if (!mlp) {
          h = a.add_(h);
          continue;
        }
        at::Tensor hn = add_rms_norm_(a, h, w[POST_NORM], eps_);  // a += h: the residual stream
        h = ffn(hn, w, t).add_(a);
      } else {
        if (rows) h = h.index_select(0, *rows);
        h = ffn(rms_norm(h, w[POST_NORM], eps_), w, t).add_(h);
      }
    }
    return h;
  }

 private:
  // o_proj(attention(rope(qkv_proj(x)))): x (T, H) normed -> (T, H), model.Attention's steps; with
  // keep, o_proj over those rows only -> (S, H)
  at::Tensor attention(const at::Tensor& x, const at::Tensor* w, const at::Tensor& kc,
                       const at::Tensor& vc, const StepMeta& m, double* tm, const at::Tensor* keep) const {
    const int64_t t = x.size(0), h = h_, hkv = hkv_, d = d_;
    at::Tensor qkv = timed(tm, PREPROJ, [&] { return linear(x, w[QKV], w[QKV_BIAS], products_); });  // (T, (H + 2 Hkv) D)
    at::Tensor qk = qkv.narrow(1, 0, (h + hkv) * d).view({t, h + hkv, d});
    rope_(qk, m.positions, cos_, sin_);
    at::Tensor q = qk.narrow(1, 0, h), k = qk.narrow(1, h, hkv);  // (T, H, D), (T, Hkv, D)
    at::Tensor v = qkv.narrow(1, (h + hkv) * d, hkv * d).view({t, hkv, d});
    at::Tensor out = timed(tm, ATTN, [&] { return attend(q, k, v, kc, vc, m); }).view({t, h * d});  // (T, H·D)
    if (keep) out = out.index_select(0, *keep);  // (S, H·D)
    return timed(tm, POSTPROJ, [&] { return linear(out, w[O], at::Tensor(), products_); });
  }

  // write_kv_, then each prefill chunk's causal attention and every decode's: the torch backend's
  // CPU path (q (T, H, D), k, v (T, Hkv, D) -> (T, H, D))
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                    const at::Tensor& vc, const StepMeta& m) const {
    const int64_t t = q.size(0);
    write_kv_(k, v, kc, vc, m.slots);
    int64_t row = 0;
    at::Tensor out;
    if (m.q_lens.empty() && m.decode_tables) {  // decodes only: their output is the step's
      out = paged_decode(q.contiguous(), kc, vc, *m.decode_tables, *m.decode_lens, scale_, attn_bf16_,
                         decode_bf16_over_);
    } else {
      out = at::empty({t, h_, d_}, q.options());
      for (size_t i = 0; i < m.q_lens.size(); ++i) {
        const int64_t n = m.q_lens[i];
        paged_prefill(q.narrow(0, row, n), kc, vc, m.prefill_tables[i], m.ctx_lens[i], scale_, out.narrow(0, row, n),
                      attn_bf16_);
        row += n;
      }
      if (m.decode_tables)
        out.narrow(0, row, t - row)
            .copy_(paged_decode(q.narrow(0, row, t - row).contiguous(), kc, vc, *m.decode_tables, *m.decode_lens,
                                scale_, attn_bf16_, decode_bf16_over_));
    }
    return out;
  }

  // down(silu(gate(x)) · up(x)), model.MLP's steps; an int8 down product makes silu · up itself,
  // row by row as it quantizes its input (int8_gemm.cpp: input_row), timed in its bucket
  at::Tensor ffn(const at::Tensor& x, const at::Tensor* w, double* tm) const {
    at::Tensor gu = timed(tm, FFN_LN1, [&] { return linear(x, w[GATE_UP], at::Tensor(), products_); });
    if (products_ == INT8 && int8_takes(w[DOWN]))
      return timed(tm, FFN_LN2, [&] { return int8_linear(gu, w[DOWN], c10::nullopt, true); });
    at::Tensor a = silu_mul(gu);
    return timed(tm, FFN_LN2, [&] { return linear(a, w[DOWN], at::Tensor(), products_); });
  }

  std::vector<at::Tensor> w_;
  int64_t h_, hkv_, d_;
  double scale_, eps_;
  Products products_;
  bool attn_bf16_;
  int64_t decode_bf16_over_;
  at::Tensor cos_, sin_;
};

}  // namespace layer_stack
