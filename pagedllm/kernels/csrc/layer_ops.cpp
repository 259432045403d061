// The elementwise parts of a decoder layer, each one pass over its rows instead
// of PyTorch's chain of small ops (each a dispatch, an allocation and a trip
// through memory). Every op rounds exactly where Hugging Face's PyTorch code
// rounds to the storage dtype, so bf16 results stay those of the reference
// implementation; math in between is fp32.
#include <ATen/Parallel.h>

#include <cmath>

#include "dtype.h"
#include "fast_exp.h"
#include "ops.h"
#include "vec16.h"

namespace {

// Rows per parallel task: small enough to split a decode batch over threads,
// large enough that the thread hand-off is not the cost.
constexpr int64_t kRowGrain = 8;


// One row of rms_norm; ``residual`` (may be null) is updated in place.
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* residual, scalar_t* out, int64_t hidden,
                  float eps) {
  // With a residual, the normalised input is the new residual, written back.
  const scalar_t* src = x;
  if (residual != nullptr) {
    for (int64_t h = 0; h < hidden; ++h)
      residual[h] = store<scalar_t>(load(residual[h]) + load(x[h]));
    src = residual;
  }
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t h = 0; h < hidden; ++h) squares += load(src[h]) * load(src[h]);
  const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t h = 0; h < hidden; ++h)
    out[h] = store<scalar_t>(load(weight[h]) * round_to<scalar_t>(load(src[h]) * inv_rms));
}

// ``cache_t`` is fp32, or the model dtype when the tables were cast with the
// model: rounding an fp32 entry to the dtype gives the same value either way.
template <typename scalar_t, typename cache_t>
void rotate_head(scalar_t* __restrict x, const cache_t* __restrict cos, const cache_t* __restrict sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float lo = load(x[i]), hi = load(x[i + half]);
    const float c_lo = round_to<scalar_t>(load(cos[i]));
    const float s_lo = round_to<scalar_t>(load(sin[i]));
    const float c_hi = round_to<scalar_t>(load(cos[i + half]));
    const float s_hi = round_to<scalar_t>(load(sin[i + half]));
    x[i] = store<scalar_t>(round_to<scalar_t>(lo * c_lo) + round_to<scalar_t>(-hi * s_lo));
    x[i + half] = store<scalar_t>(round_to<scalar_t>(hi * c_hi) + round_to<scalar_t>(lo * s_hi));
  }
}

}  // namespace

// HF: residual = residual + x (in dtype); x32 = residual.float();
// out = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, std::optional<torch::Tensor> residual) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must have the hidden size and the input's dtype");
  auto rows = x.reshape({-1, hidden}).contiguous();
  auto out = torch::empty_like(rows);
  torch::Tensor res;
  if (residual.has_value()) {
    res = residual.value();
    TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(),
                "rms_norm: residual must be contiguous with the input's shape and dtype");
  }
  const int64_t num_rows = rows.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = rows.data_ptr<scalar_t>();
    const scalar_t* w = weight.contiguous().data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    scalar_t* r = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, num_rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        rms_norm_row<scalar_t>(in + row * hidden, w, r == nullptr ? nullptr : r + row * hidden, o + row * hidden,
                               hidden, static_cast<float>(eps));
    });
  });
  return out.view(x.sizes());
}

// HF: q * cos + rotate_half(q) * sin, with cos/sin cast to the dtype, where
// rotate_half(q) = [-q[half:], q[:half]]. query/key are [tokens, heads, dim]
// views (rows may be strided, as slices of the fused qkv output); each head's
// dim must be contiguous. Updated in place.
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos_cache,
                      torch::Tensor sin_cache) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  query.stride(1) == query.size(2) && key.stride(1) == key.size(2),
              "rotary_embedding: query/key must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(cos_cache.scalar_type() == sin_cache.scalar_type() &&
                  (cos_cache.scalar_type() == torch::kFloat || cos_cache.scalar_type() == query.scalar_type()) &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous(),
              "rotary_embedding: cos/sin caches must be contiguous, fp32 or the query's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kLong, "rotary_embedding: positions must be int64");
  // The cache width is the rotary dim: with partial rotary (Phi-4-mini) only
  // the first rot_dim channels of each head rotate, the rest pass through.
  const int64_t tokens = query.size(0), head_dim = query.size(2), rot_dim = cos_cache.size(1), half = rot_dim / 2;
  TORCH_CHECK(rot_dim <= head_dim && rot_dim % 2 == 0 && key.size(2) == head_dim,
              "rotary_embedding: cache width must be even and at most head_dim");
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos_cache.size(0), "rotary_embedding: position ", p[t],
                " is outside the rotary table (max_position ", cos_cache.size(0), ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    auto run = [&](auto* cos_base, auto* sin_base) {
      scalar_t* q = query.data_ptr<scalar_t>();
      scalar_t* k = key.data_ptr<scalar_t>();
      const int64_t q_heads = query.size(1), k_heads = key.size(1);
      const int64_t q_stride = query.stride(0), k_stride = key.stride(0);
      at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const auto* cos = cos_base + p[t] * rot_dim;
          const auto* sin = sin_base + p[t] * rot_dim;
          for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, cos, sin, half);
          for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, cos, sin, half);
        }
      });
    };
    if (cos_cache.scalar_type() == torch::kFloat)
      run(cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>());
    else
      run(cos_cache.data_ptr<scalar_t>(), sin_cache.data_ptr<scalar_t>());
  });
}

#if defined(__AVX512F__)
namespace {

// silu(g) * u for one row: HF rounds silu's result to the dtype before the
// product (two PyTorch ops), so this does too; the product is rounded on store.
template <typename scalar_t>
void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t width) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16(out + i, _mm512_mul_ps(round16<scalar_t>(silu), load16(up + i)));
  }
  for (; i < width; ++i) {
    const float g = load(gate[i]);
    out[i] = store<scalar_t>(round_to<scalar_t>(g / (1.0f + fast_exp(-g))) * load(up[i]));
  }
}

}  // namespace
#endif

// x is [rows, 2 * width]: gate | up, as the fused gate_up projection writes
// them. One pass and one output instead of PyTorch's silu, mul and the
// temporary between them. Without AVX-512 it is exactly PyTorch's two ops.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [rows, 2 * width] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "silu_and_mul: x must be float32 or bfloat16");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
#if defined(__AVX512F__)
  auto out = torch::empty({rows, width}, x.options());
  auto run = [&](auto* in, auto* o) {
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        silu_and_mul_row(in + row * row_stride, in + row * row_stride + width, o + row * width, width);
    });
  };
  if (x.scalar_type() == torch::kFloat)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
#else
  return at::silu(x.narrow(1, 0, width)) * x.narrow(1, width, width);
#endif
}
