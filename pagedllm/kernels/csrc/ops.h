// Declarations of the CPU kernels bound in bindings.cpp; each .cpp file holds one idea.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <tuple>

// paged_decode.cpp: decode attention read straight through the block tables
// (sliding_window / logits_soft_cap: 0 for none; tail_slots: an int8 pool's
// full-precision tail slot per row, -1 for none, or none at all; sinks: fp32 [heads], a
// logit per query head in the softmax's denominator, or none).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     std::optional<torch::Tensor> key_scale, std::optional<torch::Tensor> value_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap,
                                     std::optional<torch::Tensor> tail_key, std::optional<torch::Tensor> tail_value,
                                     std::optional<torch::Tensor> tail_slots, std::optional<torch::Tensor> sinks);

// layer_ops.cpp: the elementwise parts of a decoder layer, fused.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, std::optional<torch::Tensor> residual);
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos_cache,
                      torch::Tensor sin_cache);
torch::Tensor silu_and_mul(torch::Tensor x);

// prefill_attention.cpp: causal attention of a prefill's queries over its keys, bf16 with
// VDPBF16PS (query i sees keys j <= i + query_offset); PyTorch's SDPA for anything else.
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale,
                                int64_t query_offset);

// varlen_attention.cpp: bidirectional attention within each sequence of a packed batch (an
// encoder's): query/key/value [tokens, heads, dim] (strided views allowed), sequence s owning rows
// cu_seqlens[s] .. cu_seqlens[s + 1]; window >= 0: a token sees keys at most window positions away.
// Returns [tokens, heads * dim]. fp32 or bf16 on AVX-512: varlen_attention_available(dtype) says.
torch::Tensor varlen_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor cu_seqlens,
                               double scale, int64_t window);
bool varlen_attention_available(at::ScalarType dtype);

// kv_write.cpp: a step's new K/V rows into their pool slots.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                    torch::Tensor slot_mapping);

// small_batch_linear.cpp: x @ weight^T + bias for fp32 or bf16 with few rows (decode matmuls).
torch::Tensor linear_small_batch(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);

// packed_linear.cpp: fp32 or bf16 x @ W^T + bias with W packed [N / 16, K / g, 16, g]
// (g = 1 fp32, 2 bf16); built for AVX-512 (fp32) and AVX-512 BF16 (bf16):
// packed_linear_available(dtype) says which. packed_linear_out writes into a [rows, N] view
// with contiguous rows (a column slice of a wider output).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias);
void packed_linear_out(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, torch::Tensor out);
bool packed_linear_available(at::ScalarType dtype);

// quant_linear.cpp: matmuls and row lookups over weights kept in packed GGUF blocks.
torch::Tensor quant_dequantize(torch::Tensor packed, int64_t qtype, int64_t in_features);
void quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor out, int64_t small_rows,
                  bool packed_tiles);

// moe_grouped.cpp: out[rows of expert e] = x[rows of expert e] @ W_e^T for a stack of expert
// weights [experts, N, K] (qtype: 0 fp32, 30 bf16, else a packed GGUF type id), each expert's
// rows of x and out at offsets[e] .. offsets[e + 1] (the step's pairs sorted by expert).
void moe_grouped_linear(torch::Tensor x, torch::Tensor weights, int64_t qtype, torch::Tensor offsets,
                        torch::Tensor out);

// lora_ops.cpp: out[:, out_col : out_col + out_size] += B_r @ (A_r @ x[r]) per row r, with each row's
// adapter A_r [ranks[r], in] and B_r [out_size, ranks[r]] at a_offsets[r] / b_offsets[r] in two flat
// pools (rank 0: no adapter); fp32 or bf16, sums in fp32, out rounded once.
void lora_bgmv(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a_pool, const torch::Tensor& b_pool,
               const torch::Tensor& a_offsets, const torch::Tensor& b_offsets, const torch::Tensor& ranks,
               int64_t out_col, int64_t out_size);

// sampling_ops.cpp: greedy token and log-normaliser of each logits row in one read.
std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits);
