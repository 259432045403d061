// The multi-LoRA product of a mixed batch (BGMV, batched gather matrix-vector):
// each row r of x runs under its own adapter, or none (rank 0), whose A and B
// lie in two flat pools at element offsets, and
//
//   out[r, out_col : out_col + out_size] += B_r @ (A_r @ x[r])
//
// with A_r [rank, in_features] and B_r [out_size, rank] row-major (the adapter's
// scaling already folded into B). out is the base projection's output, updated
// in place, so the LoRA delta lands in its column slice (e.g. the k part of a
// fused q|k|v output) without a temporary of the batch's width.
//
// Two steps per row: the shrink h = A @ x (rank dot products of in_features, h
// kept in fp32, at most 64 values) and the expand delta = B @ h (out_size dot
// products of rank). The shrink runs as tiles of 4 A rows against x, 16 lanes
// along in_features; the expand takes 16 output columns at a time, one vector
// (or up to four, for rank 64) of B row times h per column, and one
// transpose-and-add tree (lanes.h) reduces the 16 columns' lanes at once.
//
// Rounding: every product and sum is fp32. bf16 operands widen exactly (a
// shift), h stays fp32, and out + delta is rounded to bf16 once. Hugging Face
// PEFT instead computes the delta in bf16 (rounding h and delta) and then adds
// it, so bf16 results differ from PEFT's at bf16 rounding level.
//
// Parallel work items are (row, block of 16 output columns) over the rows that
// have an adapter, split into one contiguous range per thread: with many rows a
// thread takes whole rows; with few (a decode step of 1-8 rows) the threads
// split a row's columns, and each thread shrinks the row it works on itself, a
// rank x in_features product that is cheaper than a second fork and join. Rows
// are taken in order, so consecutive rows sharing an adapter find it in cache.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "dtype.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "lanes.h"
#include "vec16.h"
#endif

namespace {

constexpr int64_t kMaxRank = 64;
constexpr int64_t kBlock = 16;  // output columns per work item
// Below this many multiply-adds in a call, one thread does it all: splitting
// costs a fork and join (a few microseconds) that such a call does not repay.
constexpr int64_t kParallelMacs = 1 << 16;

#if defined(__AVX512F__)

// 16 values (fewer under ``mask``, the rest zero) as fp32; bf16 widens by a shift, exactly.
inline __m512 load_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load_masked(const c10::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline __mmask16 mask_of(int64_t count) {  // the first min(count, 16) lanes
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// Four running dot products along K, one per A row of a tile. Named members,
// not an array, so GCC keeps them in registers.
struct TileSums {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
};

template <typename T>
inline TileSums dot_tile(const T* a0, const T* a1, const T* a2, const T* a3, const T* x, int64_t K) {
  TileSums sums;
  for (int64_t k = 0; k < K; k += 16) {  // whole steps of K, then a masked partial one
    const __mmask16 mask = mask_of(K - k);
    const __m512 xv = load_masked(x + k, mask);
    sums.s0 = _mm512_fmadd_ps(load_masked(a0 + k, mask), xv, sums.s0);
    sums.s1 = _mm512_fmadd_ps(load_masked(a1 + k, mask), xv, sums.s1);
    sums.s2 = _mm512_fmadd_ps(load_masked(a2 + k, mask), xv, sums.s2);
    sums.s3 = _mm512_fmadd_ps(load_masked(a3 + k, mask), xv, sums.s3);
  }
  return sums;
}

// h[0, rank) = A @ x, and h zero up to the next multiple of 16. A tile past
// the last A row repeats that row; its extra sums are dropped.
template <typename T>
void shrink(const T* a, const T* x, int64_t K, int64_t rank, float* h) {
  for (int64_t base = 0; base < rank; base += 16) {
    __m512 all[16];
    for (int64_t t = 0; t < 4; ++t) {
      const int64_t i = base + 4 * t;
      if (i >= rank) {
        for (int64_t j = 0; j < 4; ++j) all[4 * t + j] = _mm512_setzero_ps();
        continue;
      }
      const auto row = [&](int64_t j) { return a + std::min(i + j, rank - 1) * K; };
      const TileSums sums = dot_tile(row(0), row(1), row(2), row(3), x, K);
      all[4 * t] = sums.s0, all[4 * t + 1] = sums.s1, all[4 * t + 2] = sums.s2, all[4 * t + 3] = sums.s3;
    }
    _mm512_store_ps(h + base, _mm512_maskz_mov_ps(mask_of(rank - base), sum_lanes_of_16(all)));
  }
}

// o[0, n) += B[0, n) @ h for n <= 16 output columns; b is B's first of those rows.
template <typename T>
void expand(const T* b, int64_t rank, const float* h, T* o, int64_t n) {
  __m512 all[16];
  for (int64_t i = 0; i < 16; ++i) {
    __m512 acc = _mm512_setzero_ps();
    if (i < n)
      for (int64_t c = 0; c < rank; c += 16)
        acc = _mm512_fmadd_ps(load_masked(b + i * rank + c, mask_of(rank - c)), _mm512_load_ps(h + c), acc);
    all[i] = acc;
  }
  const __m512 delta = sum_lanes_of_16(all);  // lane i: column i
  if (n == 16) {
    store16(o, _mm512_add_ps(load16(o), delta));
    return;
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, delta);
  for (int64_t i = 0; i < n; ++i) o[i] = store<T>(load(o[i]) + lanes[i]);
}

#else  // without AVX-512: the same steps as plain loops

template <typename T>
void shrink(const T* a, const T* x, int64_t K, int64_t rank, float* h) {
  for (int64_t i = 0; i < rank; ++i) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < K; ++k) total += load(a[i * K + k]) * load(x[k]);
    h[i] = total;
  }
}

template <typename T>
void expand(const T* b, int64_t rank, const float* h, T* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float total = 0.0f;
    for (int64_t c = 0; c < rank; ++c) total += load(b[i * rank + c]) * h[c];
    o[i] = store<T>(load(o[i]) + total);
  }
}

#endif

struct Plan {
  const int64_t *a_offsets, *b_offsets, *ranks;
  std::vector<int64_t> active;  // the rows with an adapter (rank > 0), in order
  int64_t macs = 0;             // multiply-adds of the whole call
};

template <typename T>
void run(torch::Tensor& out, const torch::Tensor& x, const T* a_pool, const T* b_pool, const Plan& plan,
         int64_t out_col, int64_t out_size) {
  const int64_t K = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
  const int64_t blocks = (out_size + kBlock - 1) / kBlock;
  const int64_t items = static_cast<int64_t>(plan.active.size()) * blocks;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>() + out_col;
  // Grain 1 splits the items evenly over every thread; ``items`` keeps the call on one.
  const int64_t grain = plan.macs >= kParallelMacs ? 1 : items;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float h[kMaxRank];
    int64_t shrunk = -1;  // the index into ``active`` whose h this task holds
    for (int64_t item = begin; item < end; ++item) {
      const int64_t index = item / blocks, column = (item % blocks) * kBlock;
      const int64_t row = plan.active[index], rank = plan.ranks[row];
      if (index != shrunk) {
        shrink(a_pool + plan.a_offsets[row], xp + row * ldx, K, rank, h);
        shrunk = index;
      }
      expand(b_pool + plan.b_offsets[row] + column * rank, rank, h, op + row * ldo + column,
             std::min(kBlock, out_size - column));
    }
  });
}

void check_index(const torch::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 1 && t.numel() == rows && t.is_cpu(),
              "lora_bgmv: ", name, " must be an int64 CPU tensor of one entry per row of x (", rows, ")");
}

}  // namespace

void lora_bgmv(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a_pool, const torch::Tensor& b_pool,
               const torch::Tensor& a_offsets, const torch::Tensor& b_offsets, const torch::Tensor& ranks,
               int64_t out_col, int64_t out_size) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "lora_bgmv: x must be fp32 or bf16");
  TORCH_CHECK(out.scalar_type() == dtype && a_pool.scalar_type() == dtype && b_pool.scalar_type() == dtype,
              "lora_bgmv: out, a_pool and b_pool must have x's dtype");
  TORCH_CHECK(x.is_cpu() && out.is_cpu() && a_pool.is_cpu() && b_pool.is_cpu(), "lora_bgmv: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1),
              "lora_bgmv: x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && (out.stride(1) == 1 || out.size(1) <= 1),
              "lora_bgmv: out must be [rows, out_features], x's rows, with column stride 1");
  TORCH_CHECK(out_col >= 0 && out_size >= 0 && out_col <= out.size(1) - out_size, "lora_bgmv: columns [", out_col,
              ", ", out_col, " + ", out_size, ") are outside out's ", out.size(1));
  TORCH_CHECK(a_pool.dim() == 1 && a_pool.is_contiguous() && b_pool.dim() == 1 && b_pool.is_contiguous(),
              "lora_bgmv: a_pool and b_pool must be contiguous 1-D tensors");
  const int64_t rows = x.size(0), K = x.size(1);
  check_index(a_offsets, rows, "a_offsets");
  check_index(b_offsets, rows, "b_offsets");
  check_index(ranks, rows, "ranks");
  const auto a_off = a_offsets.contiguous(), b_off = b_offsets.contiguous(), rank_of = ranks.contiguous();
  Plan plan{a_off.data_ptr<int64_t>(), b_off.data_ptr<int64_t>(), rank_of.data_ptr<int64_t>()};
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rank = plan.ranks[r], a = plan.a_offsets[r], b = plan.b_offsets[r];
    TORCH_CHECK(rank >= 0 && rank <= kMaxRank, "lora_bgmv: row ", r, " has rank ", rank, ", outside [0, ", kMaxRank,
                "]");
    if (rank == 0) continue;
    TORCH_CHECK(a >= 0 && a <= a_pool.numel() - rank * K, "lora_bgmv: row ", r, "'s A [", a, ", ", a, " + ", rank,
                " x ", K, ") is outside a_pool (", a_pool.numel(), ")");
    TORCH_CHECK(b >= 0 && b <= b_pool.numel() - out_size * rank, "lora_bgmv: row ", r, "'s B [", b, ", ", b, " + ",
                out_size, " x ", rank, ") is outside b_pool (", b_pool.numel(), ")");
    plan.active.push_back(r);
    plan.macs += rank * (K + out_size);
  }
  if (plan.active.empty() || out_size == 0) return;
  if (dtype == torch::kFloat)
    run<float>(out, x, a_pool.data_ptr<float>(), b_pool.data_ptr<float>(), plan, out_col, out_size);
  else
    run<c10::BFloat16>(out, x, a_pool.data_ptr<c10::BFloat16>(), b_pool.data_ptr<c10::BFloat16>(), plan, out_col,
                       out_size);
}
