#include "decode_stack.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"), py::arg("value_scale"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("logits_soft_cap"), py::arg("tail_key") = py::none(), py::arg("tail_value") = py::none(),
        py::arg("tail_slots") = py::none(), py::arg("sinks") = py::none());
  m.def("prefill_attention", &prefill_attention,
        "Causal attention of query [queries, heads, dim] over key/value [keys, kv_heads, dim] (CPU)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("query_offset"));
  m.def("varlen_attention", &varlen_attention,
        "Bidirectional attention within each sequence of packed [tokens, heads, dim] q/k/v (CPU, AVX-512)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cu_seqlens"), py::arg("scale"),
        py::arg("window"));
  m.def("varlen_attention_available", &varlen_attention_available,
        "Whether varlen_attention was built for this dtype (fp32 and bf16 on AVX-512)", py::arg("dtype"));
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding the residual in place first (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [rows, 2 * width] gate|up output (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotate query and key in place (NeoX layout, CPU)");
  m.def("write_kv_cache", &write_kv_cache, "Copy each token's K/V rows to its pool slot (CPU)");
  m.def("linear_small_batch", &linear_small_batch, "fp32 or bf16 x @ weight^T + bias for few rows of x (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("packed_linear", &packed_linear,
        "fp32 / bf16 x @ W^T + bias for W packed [out / 16, in / g, 16, g], g = 1 / 2 (CPU, AVX-512)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
  m.def("packed_linear_available", &packed_linear_available,
        "Whether packed_linear was built for this dtype (AVX-512 for fp32, AVX-512 BF16 for bf16)", py::arg("dtype"));
  m.def("quant_dequantize", &quant_dequantize, "Packed GGUF rows [rows, bytes] as fp32 [rows, in_features] (CPU)");
  m.def("quant_linear", &quant_linear, "out = x @ W^T for a packed GGUF weight W, written into out (CPU)");
  m.def("moe_grouped_linear", &moe_grouped_linear,
        "Each expert's rows of x (sorted by expert, offsets[e]..offsets[e+1]) times its weights, into out (CPU)",
        py::arg("x"), py::arg("weights"), py::arg("qtype"), py::arg("offsets"), py::arg("out"));
  m.def("lora_bgmv", &lora_bgmv,
        "out[:, out_col:out_col + out_size] += B_r @ (A_r @ x[r]), each row's LoRA adapter from flat pools (CPU)",
        py::arg("out"), py::arg("x"), py::arg("a_pool"), py::arg("b_pool"), py::arg("a_offsets"), py::arg("b_offsets"),
        py::arg("ranks"), py::arg("out_col"), py::arg("out_size"));
  m.def("argmax_logsumexp", &argmax_logsumexp, "Per-row first argmax and fp32 logsumexp of fp32 or bf16 logits (CPU)");
  py::class_<FusedLinear>(m, "FusedLinear", "One projection of a DecodeStack layer (decode_stack.h)");
  m.def("fused_linear", &make_linear, "kind 0 dense, 1 packed fp32/bf16, 2 GGUF segments (decode_stack.h)",
        py::arg("kind"), py::arg("tensors"), py::arg("qtypes"), py::arg("starts"), py::arg("stops"),
        py::arg("out_features"), py::arg("bias"), py::arg("packed_tiles"));
  py::class_<DecodeStack>(m, "DecodeStack", "A Llama stack's decode step for a few sequences in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, torch::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"),
           py::arg("cos_cache"), py::arg("sin_cache"), py::arg("final_norm"))
      .def("add_layer",
           [](DecodeStack& self, torch::Tensor input_norm, torch::Tensor post_norm, FusedLinear qkv, FusedLinear o_proj,
              FusedLinear gate_up_proj, FusedLinear down_proj, torch::Tensor key_cache, torch::Tensor value_cache) {
             self.add_layer(FusedLayer{input_norm, post_norm, qkv, o_proj, gate_up_proj, down_proj, key_cache,
                                       value_cache});
           })
      .def("forward", &DecodeStack::forward, py::arg("hidden"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("context_lens"));
}
