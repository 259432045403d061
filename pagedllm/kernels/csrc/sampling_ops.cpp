// Greedy sampling reads the [rows, vocab] logits once per row for both things
// it needs: the first index of the maximum (torch.argmax's tie rule) and the
// log-normaliser, so the chosen token's logprob is max - logsumexp. PyTorch
// would make an argmax pass, then a logsumexp that allocates and exponentiates
// a second [rows, vocab] tensor.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "dtype.h"
#include "fast_exp.h"
#include "ops.h"

namespace {

template <typename scalar_t>
void argmax_logsumexp_rows(const scalar_t* x, int64_t num_rows, int64_t vocab, int64_t* id, float* l) {
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * vocab;
      float peak = -std::numeric_limits<float>::infinity();
      // A ternary, not std::max: GCC leaves a std::max reduction scalar (one
      // dependent vmaxss per logit, 3x this whole op), the ternary it vectorizes.
#pragma omp simd reduction(max : peak)
      for (int64_t v = 0; v < vocab; ++v) peak = load(row[v]) > peak ? load(row[v]) : peak;
      int64_t first = 0;
      while (first < vocab - 1 && !(load(row[first]) == peak)) ++first;  // NaN rows end on the last index
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t v = 0; v < vocab; ++v) total += fast_exp(load(row[v]) - peak);
      id[r] = first;
      l[r] = peak + std::log(total);
    }
  });
}

}  // namespace

// bf16 logits are read as the fp32 values they are (the widening is exact), so
// the model's bf16 logits need no fp32 copy first.
std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16),
              "argmax_logsumexp: expects fp32 or bf16 logits [rows, vocab]");
  auto rows = logits.contiguous();
  const int64_t num_rows = rows.size(0), vocab = rows.size(1);
  TORCH_CHECK(vocab > 0, "argmax_logsumexp: empty vocabulary");
  auto ids = torch::empty({num_rows}, logits.options().dtype(torch::kLong));
  auto lse = torch::empty({num_rows}, logits.options().dtype(torch::kFloat));
  if (logits.scalar_type() == torch::kFloat)
    argmax_logsumexp_rows(rows.data_ptr<float>(), num_rows, vocab, ids.data_ptr<int64_t>(), lse.data_ptr<float>());
  else
    argmax_logsumexp_rows(rows.data_ptr<at::BFloat16>(), num_rows, vocab, ids.data_ptr<int64_t>(),
                          lse.data_ptr<float>());
  return {ids, lse};
}
