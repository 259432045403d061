// Paged decode attention for CPUs: one new query token per sequence attends to
// its context straight through the block table. Nothing is gathered into a
// padded copy: each task walks its sequence's blocks once, so the work and the
// memory read are exactly the sequence's tokens.
//
// Shapes: query [B, H, D]; key_cache / value_cache [num_blocks, block_size,
// H_kv, D] (block-major, contiguous); block_tables [B, max_blocks] int64;
// context_lens [B] int64. Query head h reads KV head h / (H / H_kv).
// Caches are in the query's dtype, or int8 with an fp32 scale per (slot, KV
// head) in key_scale / value_scale [num_blocks, block_size, H_kv]: a token's
// score is scale_k * (q . k_int8) and its value weight is p * scale_v, so the
// int8 values are never expanded into a dequantized copy.
// Per-layer options (Hugging Face's conventions): sliding_window W > 0 reads
// only the last W tokens (from max(0, context_len - W); earlier blocks are
// never touched, their table entries may be released), and logits_soft_cap
// c > 0 turns each score into c * tanh(score / c). Both cost per block, not
// per token, when unset, so plain layers run the same per-token work. sinks
// [H] fp32 (gpt-oss's attention sinks): head h's softmax sum gains exp(sinks[h]),
// a logit that weighs no value, added once per head when the output is normalised.
//
// One pass per task with an online softmax (as flash-decoding does): for each
// block, score its tokens for every query head, rescale the running sums to
// the new maximum, then accumulate that block's values while they are still in
// cache. K and V are each read exactly once, the next block is prefetched
// (blocks are scattered, so the hardware cannot guess it), and the scratch is
// O(heads * (block_size + head_dim)) instead of O(context). Everything is
// accumulated in fp32 whatever the storage dtype.
#include <ATen/Parallel.h>

#include "ops.h"
#include "paged_decode_block.h"
#include "paged_decode_grouped.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

// One task: all H query heads of one sequence over the blocks [block_begin,
// block_end) of its table. Taking every KV head at once makes each block one
// contiguous read (block_size * H_kv * D elements). The task leaves its
// unnormalised partial result in ``part``: per query head the running max, the
// running sum and the weighted value sum, which combine() merges across tasks.
// kHeadDim > 0 fixes the head size at compile time (fully unrolled dot products
// for the common 64 and 128); 0 reads it from ``runtime_head_dim``.
// ``after`` is the first block of the task this thread runs next (-1:
// none), fetched during this task's last block: at short contexts a
// sequence's first block would otherwise be a cold miss every time.
// Tokens before ``first_token`` (the sliding window's start, else 0) are skipped;
// ``soft_cap`` > 0 caps the scores. With ``tail_slot`` >= 0 the sequence's last
// block (the one holding context_len - 1) is read from that slot of the
// full-precision tails (scalar_t, no scales, the same layout as a block).
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void decode_task(const scalar_t* query, const cache_t* key_cache, const cache_t* value_cache,
                 const float* key_scale, const float* value_scale, const scalar_t* tail_key,
                 const scalar_t* tail_value, int64_t tail_slot,
                 const int64_t* table, int64_t block_begin, int64_t block_end, int64_t first_token, int64_t context_len,
                 int64_t block_size, int64_t num_kv_heads, int64_t runtime_head_dim, int64_t group, float scale,
                 float soft_cap, int64_t after, bool dpbf16, Scratch& s, Partial part) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t rows = num_kv_heads * group;
  const int64_t token_stride = num_kv_heads * head_dim;
  s.q.resize(rows * head_dim);
  s.scores.resize(rows * (block_size + 1));  // the VDPBF16PS path: rows * 17
  std::fill(part.acc, part.acc + rows * head_dim, 0.0f);
  std::fill(part.max, part.max + rows, -std::numeric_limits<float>::infinity());
  std::fill(part.sum, part.sum + rows, 0.0f);
  // Fold the softmax scale into q once instead of into every score.
  for (int64_t i = 0; i < rows * head_dim; ++i) s.q[i] = load(query[i]) * scale;

  const int64_t block_lines = (block_size * token_stride * static_cast<int64_t>(sizeof(cache_t)) + 63) / 64;
  const int64_t tail_block = tail_slot >= 0 ? (context_len - 1) / block_size : -1;
#if defined(__AVX512F__)
  const GroupedBlockFn<cache_t> grouped =
      grouped_block_fn<cache_t, kHeadDim>(block_size, group, key_scale != nullptr, soft_cap > 0.0f);
#endif
#if defined(__AVX512BF16__)
  Dpbf16BlockFn grouped_dpbf16 = nullptr;
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<scalar_t, c10::BFloat16>) {
    if (dpbf16) grouped_dpbf16 = dpbf16_block_fn<kHeadDim>(block_size, group, soft_cap > 0.0f);
  }
#endif
  for (int64_t b = block_begin; b < block_end; ++b) {
    // The block's tokens before the window are skipped (none in a plain layer).
    const int64_t skipped = std::max<int64_t>(0, first_token - b * block_size);
    const int64_t first_slot = table[b] * block_size + skipped;
    const int64_t n = std::min(block_size, context_len - b * block_size) - skipped;
    const char* k_next = nullptr;
    const char* v_next = nullptr;
    const int64_t next_block = b + 1 < block_end ? table[b + 1] : after;
    if (next_block >= 0) {
      const int64_t next_slot = next_block * block_size;
      k_next = reinterpret_cast<const char*>(key_cache + next_slot * token_stride);
      v_next = reinterpret_cast<const char*>(value_cache + next_slot * token_stride);
    }
    if (b == tail_block) {
      // Always the task's last block: nothing of this sequence after it to fetch.
      const int64_t first_tail = tail_slot * block_size + skipped;
      attend_block<scalar_t, kHeadDim>(s.q.data(), tail_key + first_tail * token_stride,
                                       tail_value + first_tail * token_stride, nullptr, nullptr, n, rows, group,
                                       num_kv_heads, head_dim, block_size, soft_cap, k_next, v_next, block_lines, s,
                                       part);
      continue;
    }
    const cache_t* k_block = key_cache + first_slot * token_stride;
    const cache_t* v_block = value_cache + first_slot * token_stride;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<scalar_t, c10::BFloat16>) {
      if (grouped_dpbf16 != nullptr) {
        grouped_dpbf16(query, scale, k_block, v_block, num_kv_heads, n, part.max, part.sum, part.acc,
                       s.scores.data(), k_next, v_next, block_lines);
        continue;
      }
    }
#endif
#if defined(__AVX512F__)
    if (grouped != nullptr) {
      // Each KV head's call fetches an equal share of the next block's lines.
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t first = block_lines * h / num_kv_heads;
        const PrefetchShare share{k_next, v_next, first, block_lines * (h + 1) / num_kv_heads - first};
        grouped(s.q.data() + h * group * head_dim, k_block + h * head_dim, v_block + h * head_dim, token_stride, n,
                part.max + h * group, part.sum + h * group, part.acc + h * group * head_dim, share);
      }
      continue;
    }
#endif
    attend_block<cache_t, kHeadDim>(s.q.data(), k_block, v_block,
                                    key_scale != nullptr ? key_scale + first_slot * num_kv_heads : nullptr,
                                    value_scale != nullptr ? value_scale + first_slot * num_kv_heads : nullptr, n,
                                    rows, group, num_kv_heads, head_dim, block_size, soft_cap, k_next, v_next,
                                    block_lines, s, part);
  }
}

// exp(sink - max): a head's sink term in a softmax sum taken relative to ``max`` (0 without
// sinks). Past exp's range it is inf and the head's output 0, the limit the true value has.
inline float sink_term(const float* sinks, int64_t r, float max) {
  return sinks != nullptr ? std::exp(sinks[r] - max) : 0.0f;
}

// A sequence with one partition: its output is the weighted value sum over the softmax sum
// (with ``sinks``, one logit per query head that joins the sum and weighs no value).
template <typename scalar_t>
void normalize(const Partial& part, const float* sinks, int64_t rows, int64_t head_dim, scalar_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / (part.sum[r] + sink_term(sinks, r, part.max[r]));
    for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = store<scalar_t>(part.acc[r * head_dim + d] * inv);
  }
}

// Merge a sequence's partial results (one per context partition) into its output:
// rescale each partition to the global max, then divide by the global sum.
template <typename scalar_t>
void combine(const Partial* parts, int64_t num_parts, const float* sinks, int64_t rows, int64_t head_dim,
             scalar_t* out) {
  std::vector<float> acc(head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    float global_max = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) global_max = std::max(global_max, parts[p].max[r]);
    float total = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p = 0; p < num_parts; ++p) {
      if (parts[p].sum[r] == 0.0f) continue;  // an empty partition
      const float weight = fast_exp(parts[p].max[r] - global_max);
      total += parts[p].sum[r] * weight;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += parts[p].acc[r * head_dim + d] * weight;
    }
    const float inv = 1.0f / (total + sink_term(sinks, r, global_max));
    for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = store<scalar_t>(acc[d] * inv);
  }
}


// Run every task of one call with queries of scalar_t and caches of cache_t.
template <typename scalar_t, typename cache_t>
void run_decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                const float* key_scale, const float* value_scale, const scalar_t* tail_key,
                const scalar_t* tail_value, const int64_t* tail_slots, const int64_t* bt, const int64_t* cl,
                int64_t max_blocks, int64_t parts_per_seq, int64_t blocks_per_part, double scale,
                int64_t sliding_window, double soft_cap, const float* sinks, std::vector<Partial>& parts,
                torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, query_stride = query.stride(0);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* kc = key_cache.data_ptr<cache_t>();
  const cache_t* vc = value_cache.data_ptr<cache_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const bool dpbf16 = dpbf16_decode_enabled();
  auto run_task = head_dim == 64    ? decode_task<scalar_t, cache_t, 64>
                  : head_dim == 128 ? decode_task<scalar_t, cache_t, 128>
                                    : decode_task<scalar_t, cache_t, 0>;
  // The first token sequence b reads: its window's start, else 0.
  auto first_token = [&](int64_t b) { return sliding_window > 0 ? std::max<int64_t>(0, cl[b] - sliding_window) : 0; };
  // Task t covers blocks [block_begin, block_end) of sequence t / parts_per_seq,
  // counted from the sequence's first block read.
  auto task_blocks = [&](int64_t task) {
    const int64_t b = task / parts_per_seq, part = task % parts_per_seq;
    const int64_t seq_blocks = (cl[b] + block_size - 1) / block_size;
    const int64_t block_begin = std::min(seq_blocks, first_token(b) / block_size + part * blocks_per_part);
    return std::pair<int64_t, int64_t>{block_begin, std::min(seq_blocks, block_begin + blocks_per_part)};
  };
  at::parallel_for(0, batch * parts_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / parts_per_seq;
      const auto [block_begin, block_end] = task_blocks(task);
      int64_t after = -1;
      if (task + 1 < end) {
        const auto [next_begin, next_end] = task_blocks(task + 1);
        if (next_begin < next_end) after = bt[(task + 1) / parts_per_seq * max_blocks + next_begin];
      }
      run_task(q + b * query_stride, kc, vc, key_scale, value_scale, tail_key, tail_value,
               tail_slots != nullptr ? tail_slots[b] : -1, bt + b * max_blocks, block_begin, block_end,
               first_token(b), cl[b], block_size, num_kv_heads, head_dim, group, static_cast<float>(scale),
               static_cast<float>(soft_cap), after, dpbf16, scratch, parts[task]);
      // One partition per sequence (the usual decode batch): finish it here,
      // with its blocks' values still in cache and no second pass over the batch.
      if (parts_per_seq == 1)
        normalize<scalar_t>(parts[task], sinks, num_heads, head_dim, o + b * num_heads * head_dim);
    }
  });
  if (parts_per_seq == 1) return;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      combine<scalar_t>(parts.data() + b * parts_per_seq, parts_per_seq, sinks, num_heads, head_dim,
                        o + b * num_heads * head_dim);
  });
}

// Whether the pool is int8, and its per-token scales (null for a pool in the query's dtype).
struct PoolScales {
  bool quantized;
  const float* key;
  const float* value;
};

// The pool's scales, once the query and caches are checked to be a shape and dtype the kernel reads.
PoolScales checked_scales(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                          const std::optional<torch::Tensor>& key_scale,
                          const std::optional<torch::Tensor>& value_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode_attention needs contiguous caches");
  // The query may be a row-strided view (the q part of the fused qkv output):
  // only its heads and dims must be packed, which saves a copy per layer.
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode_attention needs each query row's heads and dims contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const bool quantized = key_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(quantized ? value_cache.scalar_type() == torch::kChar && key_scale.has_value() && value_scale.has_value()
                        : key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "paged_decode_attention: caches must be in the query's dtype, or int8 with key and value scales");
  if (!quantized) return {false, nullptr, nullptr};
  for (const auto& scales : {key_scale.value(), value_scale.value()})
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                    scales.numel() == key_cache.numel() / key_cache.size(3),
                "paged_decode_attention: scales must be contiguous fp32 [num_blocks, block_size, num_kv_heads]");
  return {true, key_scale.value().data_ptr<float>(), value_scale.value().data_ptr<float>()};
}

// tail_slots, contiguous, once the tails are checked against the pool and the
// query and every slot against the tails (an undefined tensor without tails).
torch::Tensor checked_tail_slots(const torch::Tensor& query, const torch::Tensor& key_cache,
                                 const std::optional<torch::Tensor>& tail_key,
                                 const std::optional<torch::Tensor>& tail_value,
                                 const std::optional<torch::Tensor>& tail_slots) {
  if (!tail_slots.has_value()) return {};
  TORCH_CHECK(key_cache.scalar_type() == torch::kChar && tail_key.has_value() && tail_value.has_value(),
              "paged_decode_attention: tail slots need an int8 pool and its tails");
  for (const auto& tail : {tail_key.value(), tail_value.value()})
    TORCH_CHECK(tail.scalar_type() == query.scalar_type() && tail.is_contiguous() && tail.dim() == 4 &&
                    tail.size(1) == key_cache.size(1) && tail.size(2) == key_cache.size(2) &&
                    tail.size(3) == query.size(2),
                "paged_decode_attention: tails must be contiguous [slots, block_size, num_kv_heads, head_dim] "
                "in the query's dtype");
  auto slots = tail_slots.value().contiguous();
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == query.size(0),
              "paged_decode_attention: tail_slots must be int64, one per query row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < query.size(0); ++b)
    TORCH_CHECK(slot[b] < tail_key.value().size(0), "paged_decode_attention: tail slot out of range");
  return slots;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     std::optional<torch::Tensor> key_scale, std::optional<torch::Tensor> value_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap,
                                     std::optional<torch::Tensor> tail_key, std::optional<torch::Tensor> tail_value,
                                     std::optional<torch::Tensor> tail_slots, std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens must be int64");
  const PoolScales pool = checked_scales(query, key_cache, value_cache, key_scale, value_scale);
  const torch::Tensor slots = checked_tail_slots(query, key_cache, tail_key, tail_value, tail_slots);
  const bool tails = slots.defined();
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == num_heads),
              "paged_decode_attention: sinks must be contiguous fp32 [num_heads]");
  const float* sink_logits = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty({batch, num_heads, head_dim}, query.options());
  const int64_t max_blocks = tables.size(1);
  const int64_t block_size = key_cache.size(1);
  // Blocks one sequence reads: its table, or at most those a window straddles.
  const int64_t read_blocks =
      sliding_window > 0 ? std::min(max_blocks, (sliding_window + block_size - 2) / block_size + 1) : max_blocks;

  // A task per sequence keeps each block's read contiguous. With fewer
  // sequences than twice the threads, each sequence's blocks are also split
  // into partitions (flash-decoding) so every core has work.
  const int64_t threads = at::get_num_threads();
  const int64_t parts_per_seq = batch >= 2 * threads ? 1 : std::min<int64_t>(read_blocks, (2 * threads + batch - 1) / batch);
  const int64_t blocks_per_part = (read_blocks + parts_per_seq - 1) / parts_per_seq;
  const int64_t state = num_heads * (head_dim + 2);
  std::vector<float> partial_state(batch * parts_per_seq * state);
  std::vector<Partial> parts(batch * parts_per_seq);
  for (int64_t i = 0; i < batch * parts_per_seq; ++i) {
    float* base = partial_state.data() + i * state;
    parts[i] = Partial{base, base + num_heads, base + 2 * num_heads};
  }
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* cl = lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if (pool.quantized)
      run_decode<scalar_t, int8_t>(query, key_cache, value_cache, pool.key, pool.value,
                                   tails ? tail_key.value().data_ptr<scalar_t>() : nullptr,
                                   tails ? tail_value.value().data_ptr<scalar_t>() : nullptr,
                                   tails ? slots.data_ptr<int64_t>() : nullptr, bt, cl, max_blocks, parts_per_seq,
                                   blocks_per_part, scale, sliding_window, logits_soft_cap, sink_logits, parts, out);
    else
      run_decode<scalar_t, scalar_t>(query, key_cache, value_cache, nullptr, nullptr, nullptr, nullptr, nullptr, bt,
                                     cl, max_blocks, parts_per_seq, blocks_per_part, scale, sliding_window,
                                     logits_soft_cap, sink_logits, parts, out);
  });
  return out;
}
