// A Llama decoder stack's decode step for a few sequences in one Python -> C++ call.
//
// At batch 1 a step's per-operation overhead (a Python module call, tensor views and a
// pybind crossing per op, ~10 ops per layer) costs over a quarter of a Q4_1 token on one thread.
// DecodeStack holds each layer's weights and pool once (model/fused_decode.py builds it)
// and runs every layer by calling the very functions the per-op path reaches through
// Python (rms_norm, the three linear kernels, rotary_embedding, write_kv_cache,
// paged_decode_attention, silu_and_mul) on the same tensors in the same order, so its
// results are bit for bit the per-op path's. It knows only the plain Llama layer; the
// Python side decides once per step whether a step is one it runs.
#include "decode_stack.h"

namespace {

// Output rows up to which quant_linear decodes weight rows once for all rows of x
// (model/quantized/modules.py, SMALL_BATCH_ROWS): the value the per-op path passes.
constexpr int64_t kQuantSmallRows = 48;

}  // namespace

torch::Tensor FusedLinear::operator()(const torch::Tensor& x) const {
  switch (kind) {
    case Kind::kDense:
      return linear_small_batch(x, tensors[0], bias);
    case Kind::kPacked:
      return packed_linear(x, tensors[0], bias);
    case Kind::kQuantized: {
      // QuantizedLinear.forward: fp32 in, one fp32 output written segment by segment,
      // the bias added in fp32, then rounded to the activations' dtype.
      const torch::Tensor x32 = x.to(torch::kFloat32).contiguous();
      torch::Tensor out = torch::empty({x.size(0), out_features}, x.options().dtype(torch::kFloat32));
      for (size_t i = 0; i < tensors.size(); ++i) {
        quant_linear(x32, tensors[i], qtypes[i], out.narrow(1, starts[i], stops[i] - starts[i]), kQuantSmallRows,
                     packed_tiles);
      }
      if (bias.has_value()) out.add_(*bias);
      return out.to(x.scalar_type());
    }
  }
  TORCH_CHECK(false, "unknown fused linear kind");
}

FusedLinear make_linear(int64_t kind, std::vector<torch::Tensor> tensors, std::vector<int64_t> qtypes,
                        std::vector<int64_t> starts, std::vector<int64_t> stops, int64_t out_features,
                        std::optional<torch::Tensor> bias, bool packed_tiles) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "linear kind: 0 dense, 1 packed, 2 GGUF blocks");
  TORCH_CHECK(!tensors.empty(), "a linear needs its weight");
  const auto k = static_cast<FusedLinear::Kind>(kind);
  TORCH_CHECK(k == FusedLinear::Kind::kQuantized ? qtypes.size() == tensors.size() && starts.size() == tensors.size() &&
                                                       stops.size() == tensors.size()
                                                 : tensors.size() == 1,
              "one qtype and output range per GGUF segment, one weight otherwise");
  return FusedLinear{k, std::move(tensors), std::move(qtypes), std::move(starts), std::move(stops),
                     out_features, std::move(bias), packed_tiles};
}

void DecodeStack::add_layer(FusedLayer layer) { layers_.push_back(std::move(layer)); }

torch::Tensor DecodeStack::attention(const FusedLayer& layer, const torch::Tensor& hidden, const StepTensors& step) {
  // Attention.forward, then TorchPagedAttention's pure-decode branch.
  const int64_t tokens = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const torch::Tensor qkv = layer.qkv(hidden);
  const torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
  const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  rotary_embedding(step.positions, q, k, cos_cache_, sin_cache_);
  write_kv_cache(k, v, layer.key_cache, layer.value_cache, step.slot_mapping);
  const torch::Tensor out = paged_decode_attention(q, layer.key_cache, layer.value_cache, std::nullopt, std::nullopt,
                                                   step.block_tables, step.context_lens, scale_, 0, 0.0, std::nullopt,
                                                   std::nullopt, std::nullopt, std::nullopt);
  return layer.o_proj(out.reshape({tokens, q_size}));
}

torch::Tensor DecodeStack::forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
                                   torch::Tensor block_tables, torch::Tensor context_lens) {
  TORCH_CHECK(!layers_.empty(), "a decode stack needs its layers");
  const StepTensors step{positions, slot_mapping, block_tables, context_lens};
  // DecoderLayer.forward: the first layer's residual is the embedding output itself.
  torch::Tensor residual = hidden;
  hidden = rms_norm(hidden, layers_[0].input_norm, eps_, std::nullopt);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const FusedLayer& layer = layers_[i];
    if (i > 0) hidden = rms_norm(hidden, layer.input_norm, eps_, residual);
    hidden = rms_norm(attention(layer, hidden, step), layer.post_norm, eps_, residual);
    hidden = layer.down_proj(silu_and_mul(layer.gate_up_proj(hidden)));
  }
  return rms_norm(hidden, final_norm_, eps_, residual);
}
