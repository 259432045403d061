// decode_stack.cpp: one decode step of a plain Llama decoder stack (<= a few sequences) in one call.
#pragma once
#include <vector>

#include "ops.h"

// One projection as the per-op path runs it: a dense weight (linear_small_batch), a packed
// fp32/bf16 weight (packed_linear) or packed GGUF segments (quant_linear, each writing
// output columns starts[i] .. stops[i] of one fp32 output).
struct FusedLinear {
  enum class Kind { kDense = 0, kPacked = 1, kQuantized = 2 };
  Kind kind;
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> qtypes, starts, stops;
  int64_t out_features;
  std::optional<torch::Tensor> bias;
  bool packed_tiles;

  torch::Tensor operator()(const torch::Tensor& x) const;
};

FusedLinear make_linear(int64_t kind, std::vector<torch::Tensor> tensors, std::vector<int64_t> qtypes,
                        std::vector<int64_t> starts, std::vector<int64_t> stops, int64_t out_features,
                        std::optional<torch::Tensor> bias, bool packed_tiles);

struct FusedLayer {
  torch::Tensor input_norm, post_norm;
  FusedLinear qkv, o_proj, gate_up_proj, down_proj;
  torch::Tensor key_cache, value_cache;
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
              torch::Tensor cos_cache, torch::Tensor sin_cache, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        cos_cache_(std::move(cos_cache)), sin_cache_(std::move(sin_cache)), final_norm_(std::move(final_norm)) {}

  void add_layer(FusedLayer layer);

  // hidden: the step's embeddings [tokens, hidden] (used as the first residual, in place);
  // returns the final norm's output. The rest is the step's decode metadata.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens);

 private:
  struct StepTensors {
    const torch::Tensor &positions, &slot_mapping, &block_tables, &context_lens;
  };
  torch::Tensor attention(const FusedLayer& layer, const torch::Tensor& hidden, const StepTensors& step);

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  torch::Tensor cos_cache_, sin_cache_, final_norm_;
  std::vector<FusedLayer> layers_;
};
