// Plain parameter structs that every attention kernel takes (CPU and CUDA).
// No ATen include: the host functions fill these from tensors, the kernels see
// only pointers, sizes and element strides.
//
// Shapes after the host has flattened the leading batch dims into one, B:
//   q    (B, Hq,  L, E)
//   k    (B, Hkv, S, E)
//   v    (B, Hkv, S, Ev)
//   out  (B, Hq,  L, Ev)
//   lse  (B, Hq,  L)      contiguous, float32 (float64 for float64 inputs)
//   mask (B, Hq,  L, S)   broadcast strides (0 where the user's mask has size 1)
#pragma once

#include "host_device.h"

#include <cstdint>
#include <type_traits>

namespace mha_ext {

enum class MaskKind : int32_t { kNone = 0, kBool = 1, kFloat = 2 };

// Strides are in elements, one per dim of the 4-d view (b, h, row, col).
struct Strides4 {
  int64_t b = 0, h = 0, row = 0, col = 0;
};

// Dropout: element (b, h, i, j) is kept iff the 32-bit Philox draw for it is
// >= drop_threshold; see dropout.h for how the draw is addressed.
struct DropoutParams {
  double p = 0.0;                 // probability of dropping, in [0, 1)
  double rescale = 1.0;           // 1 / (1 - p)
  uint32_t drop_threshold = 0;    // floor(p * 2^32): draws below it are dropped
  uint64_t seed = 0;
  uint64_t offset = 0;
  // When set (an rng_state tensor on the GPU), kernels read the seed at
  // *seed_ptr and the offset at *offset_ptr + offset: no host sync, so the
  // ops can be captured in a CUDA graph.
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  // The frame (an rng_state of 5 entries: seed, offset, rows, row0, col0):
  // the call's (L x S) scores of each (b, h) are rows row0 .. and columns
  // col0 .. of one attention with `rows` query rows per (b, h), so blocks
  // of a sequence attended piecewise (ring attention) draw the mask of the
  // whole. rows = 0: no frame, the call is the whole. frame_ptr: the three
  // values in device memory, as seed_ptr.
  int64_t frame_rows = 0, frame_row0 = 0, frame_col0 = 0;
  const int64_t* frame_ptr = nullptr;
  MHA_HOST_DEVICE bool enabled() const { return p > 0.0; }
  MHA_HOST_DEVICE uint64_t seed_value() const {
    return seed_ptr != nullptr ? static_cast<uint64_t>(*seed_ptr) : seed;
  }
  MHA_HOST_DEVICE uint64_t offset_value() const {
    return offset_ptr != nullptr ? static_cast<uint64_t>(*offset_ptr) + offset : offset;
  }
};

struct DropoutFrame {
  int64_t rows = 0, row0 = 0, col0 = 0;
};
MHA_HOST_DEVICE DropoutFrame dropout_frame(const DropoutParams& d) {
  if (d.frame_ptr != nullptr) return DropoutFrame{d.frame_ptr[0], d.frame_ptr[1], d.frame_ptr[2]};
  return DropoutFrame{d.frame_rows, d.frame_row0, d.frame_col0};
}

// The attention variants: which keys a query row may see and how a score is
// changed before the softmax. Each backend applies it in one place (the CPU's
// transform_row, the CUDA masked_score) and skips key tiles outside
// begin(i) .. end(i); forward and backward call the same code.
//
// Row i's diagonal key is i + diag_offset: 0 aligns the top-left corners of
// the (L x S) score matrix (SDPA's is_causal), S - L the bottom-right ones
// (FlashAttention's causal, what a KV cache needs). Row i sees keys
// i + diag_offset - left .. i + diag_offset + right (-1: no bound on that
// side; is_causal makes right at most 0). A score s (scaled) becomes
//   softcap * tanh(s / softcap)              when softcap > 0, then
//   - slope[b, h] * |i + diag_offset - j|    with ALiBi slopes,
// then the attention mask is added (or applied) and hidden keys get -inf.
struct AttentionVariant {
  int64_t diag_offset = 0;
  bool bottom_right = false;  // diag_offset is len_kv - len_q (per sequence in a varlen batch)
  int64_t left = -1, right = -1;
  double softcap = 0.0;
  const void* alibi = nullptr;  // slopes (B, Hq) in the accumulation type, or null
  int64_t alibi_stride_b = 0, alibi_stride_h = 0;

  // Keys [begin(i), end(i)) are the ones row i may see (empty when begin >= end).
  MHA_HOST_DEVICE int64_t begin(int64_t i) const {
    const int64_t b = i + diag_offset - left;
    return left < 0 || b < 0 ? 0 : b;
  }
  MHA_HOST_DEVICE int64_t end(int64_t i, int64_t len_kv) const {
    const int64_t e = i + diag_offset + right + 1;
    return right < 0 || e > len_kv ? len_kv : (e < 0 ? 0 : e);
  }
  // Rows [rows_begin(j), rows_end(j)) are the ones that may see key j.
  MHA_HOST_DEVICE int64_t rows_begin(int64_t j) const {
    const int64_t r = j - diag_offset - right;
    return right < 0 || r < 0 ? 0 : r;
  }
  MHA_HOST_DEVICE int64_t rows_end(int64_t j, int64_t len_q) const {
    const int64_t r = j - diag_offset + left + 1;
    return left < 0 || r > len_q ? len_q : (r < 0 ? 0 : r);
  }
  MHA_HOST_DEVICE bool limits_keys() const { return left >= 0 || right >= 0; }
  // Whether scores need the transform beyond scale and mask.
  MHA_HOST_DEVICE bool changes_scores() const { return softcap > 0.0 || alibi != nullptr; }
};

// float32 products of the CUDA kernels: on the CUDA cores (float32 FMAs), or
// on the tensor cores in TF32 (operands rounded to 10 mantissa bits), or as
// 3xTF32 (each operand split into a TF32 part and a TF32 remainder, three
// products summed: near float32 accuracy, as torch's own float32 attention
// kernel computes on sm_80 and newer).
enum class Fp32Math : uint8_t { kCudaCores, kTf32, kTf32x3 };

struct AttentionFwdParams {
  const void* q = nullptr;   // (B, Hq, L, E)
  const void* k = nullptr;   // (B, Hkv, S, E)
  const void* v = nullptr;   // (B, Hkv, S, Ev)
  const void* mask = nullptr;  // (B, Hq, L, S) broadcast, bool or q's dtype
  void* out = nullptr;       // (B, Hq, L, Ev)
  void* lse = nullptr;       // (B, Hq, L), contiguous

  Strides4 q_stride, k_stride, v_stride, mask_stride, out_stride;

  int64_t batch = 0, heads_q = 0, heads_kv = 0;
  int64_t len_q = 0, len_kv = 0, head_dim = 0, head_dim_v = 0;
  double scale = 1.0;
  AttentionVariant variant;  // causal alignment, window, softcap, ALiBi
  MaskKind mask_kind = MaskKind::kNone;
  // CUDA only: tensor-core operands by plain shared-memory loads instead of
  // ldmatrix (launch.h sets it from MHA_EXT_CUDA_OPERANDS=scalar), so a first
  // GPU run can compare the two ways of loading the same fragments.
  bool scalar_operands = false;
  // CUDA only: how float32 products run (launch.h: TF32 where torch allows
  // TF32 matmuls, else the CUDA cores; 3xTF32 with MHA_EXT_CUDA_FLOAT32).
  Fp32Math fp32_math = Fp32Math::kCudaCores;
  // CUDA only: keys split across blocks (flash-decoding), where batch x
  // heads x query blocks would leave the GPU's multiprocessors idle (launch.h
  // picks the count; dense and KV-cache calls). With kv_splits > 1 the block
  // of split s attends to the s-th of kv_splits runs of whole key tiles of
  // what its rows may see, and leaves its rows' O (normalised by its own sum)
  // in part_out and their softmax max and sum in part_ml; the combine kernel
  // merges them into out and lse.
  int64_t kv_splits = 1;
  void* part_out = nullptr;  // (kv_splits, B, Hq, L, Ev), the accumulation type
  void* part_ml = nullptr;   // (2, kv_splits, B, Hq, L): max (in the softmax's units), then sum
  // CUDA only: where a bool mask shows keys (score_policy.h's
  // mask_ranges_kernel, run before the launch; null: not known): for each
  // query block of the kernel the keys [lo, hi) it shows some of its rows,
  // and (the key-block backward) for each key block the rows it shows some
  // of its keys to; (Bm, Hm, groups, 2), the mask's batches and heads (1
  // where it broadcasts them, and one group for a broadcast row or key index)
  const int32_t* mask_row_keys = nullptr;
  const int32_t* mask_key_rows = nullptr;
  DropoutParams dropout;

  // lse (and the CUDA backward's per-row buffers) of row i of (b, h) sit at
  // lse_index(b, h, i); the same number addresses the row's dropout draws.
  // Dense: (B, Hq, L) contiguous, strides (Hq L, L), row0_q = 0.
  int64_t lse_stride_b = 0, lse_stride_h = 0;
  int64_t row0_q = 0;

  // Varlen (the varlen ops): B sequences packed along the rows, batch strides
  // 0. Sequence b has the packed query rows cu_seqlens_q[b] ..
  // cu_seqlens_q[b + 1] and the key rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1];
  // len_q / len_kv are the longest (they size buffers and grids). Kernels see
  // one sequence at a time through sequence_params below. Null: dense.
  const int32_t* cu_seqlens_q = nullptr;  // (B + 1)
  const int32_t* cu_seqlens_k = nullptr;  // (B + 1)
  // A KV cache (kvcache_attention): batch b attends to the first seqlens_k[b]
  // keys of its cache rows; len_kv is the largest. Null: every batch has len_kv.
  const int32_t* seqlens_k = nullptr;  // (B)
  // A paged KV cache: key/value row j of batch b is row j % kv_block_size of
  // block block_table[b * block_table_stride + j / kv_block_size], and the k
  // / v batch strides step from block to block. A kernel reads a run of rows
  // from kv_offset of its first (rows within one block are evenly strided;
  // kv_block_size is a multiple of every kernel's key tile). Null: not paged.
  const int32_t* block_table = nullptr;  // (B, max_blocks)
  int64_t block_table_stride = 0, kv_block_size = 0;
  static constexpr int64_t kKVBlockMultiple = 256;  // CPU tiles: 256 keys, CUDA: at most 64

  // query head h reads key/value head h / group_size
  MHA_HOST_DEVICE int64_t group_size() const { return heads_q / heads_kv; }
  MHA_HOST_DEVICE int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return b * lse_stride_b + h * lse_stride_h + row0_q + i;
  }
  // Where key/value row j of (b, key/value head hk) is, in elements, for k's
  // or v's strides st.
  MHA_HOST_DEVICE int64_t kv_offset(const Strides4& st, int64_t b, int64_t hk, int64_t j) const {
    if (block_table == nullptr) return b * st.b + hk * st.h + j * st.row;
    const int64_t block = block_table[b * block_table_stride + j / kv_block_size];
    return block * st.b + hk * st.h + (j % kv_block_size) * st.row;
  }
  // The dropout row (dropout.h) of row i of (b, h): its lse entry's index,
  // or its row in the frame f (dense ops only).
  MHA_HOST_DEVICE uint64_t dropout_row(const DropoutFrame& f, int64_t b, int64_t h, int64_t i) const {
    return static_cast<uint64_t>(f.rows > 0 ? (b * heads_q + h) * f.rows + f.row0 + i : lse_index(b, h, i));
  }
};

// The backward recomputes P = exp(score - lse) from the saved logsumexp.
// When |lse| is large its rounding error (an ulp of lse) becomes an error of
// P, and where a row's scores all sit near finfo.min (a padding mask filled
// with it) the log(row sum) part of lse is lost entirely: exp(score - lse)
// then gives 1 for every key instead of 1 / S. For such rows the backward
// recomputes the row's exact maximum m and sum l (one more pass over the
// keys, for those rows only) and takes P = exp(score - m) / l. Below 2^8 an
// ulp of a float lse is 2^-15 (3e-5 relative in P); real scores stay far
// below it, so the extra pass runs only for padding rows and hostile logits.
template <typename A>
MHA_HOST_DEVICE bool lse_needs_exact_stats(A lse) {
  return (lse >= A(256) || lse <= A(-256)) && lse - lse == A(0);  // finite and large
}

struct AttentionBwdParams : AttentionFwdParams {
  const void* grad_out = nullptr;  // (B, Hq, L, Ev)
  void* grad_q = nullptr;          // (B, Hq, L, E), contiguous
  void* grad_k = nullptr;          // (B, Hq, S, E) per query head, accumulation type, contiguous
  void* grad_v = nullptr;          // (B, Hq, S, Ev) likewise; the host sums each GQA group
  void* grad_mask = nullptr;       // (B, Hq, L, S) contiguous float buffer, or null
  // CUDA only, contiguous, accumulation type (float; double for double):
  void* row_dot = nullptr;         // (B, Hq, L): D = rowsum(dO * O)
  void* grad_q_accum = nullptr;    // grad_q's layout (strides) zeroed, dQ added atomically; null: deterministic dQ kernel
  // (B, Hq, L): P = exp(min(score - row_shift, 0) - row_log_norm) in the
  // forward's softmax units (float: base 2, score and shift times log2(e),
  // exp2). The dot kernel writes lse and 0, or for rows lse_needs_exact_stats
  // picks the row's max and log(row sum).
  void* row_shift = nullptr;
  void* row_log_norm = nullptr;
  Strides4 grad_out_stride;
  // where grad_q, grad_k and grad_v put element (b, h, row, col); the col
  // stride is 1 (grad_k / grad_v: h counts query heads)
  Strides4 grad_q_stride, grad_k_stride, grad_v_stride;
};

// The params of sequence b of a varlen batch alone: pointers moved to its
// first rows, its own lengths and diagonal (of batch b of a KV cache: its key
// count and diagonal). The batch strides stay 0, so a
// kernel indexes with b as for a dense batch. Dense params come back as they
// are. T: the inputs' element type, A: the accumulation type (grad_k, grad_v).
template <typename T, typename A, typename P>
MHA_HOST_DEVICE P sequence_params(P p, int64_t b) {
  if (p.seqlens_k != nullptr) {  // a KV cache: batch b's own key count, the same rows
    p.len_kv = p.seqlens_k[b];
    p.variant.diag_offset = p.variant.bottom_right ? p.len_kv - p.len_q : 0;
    return p;
  }
  if (p.cu_seqlens_q == nullptr) return p;
  const int64_t q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  p.len_q = p.cu_seqlens_q[b + 1] - q0;
  p.len_kv = p.cu_seqlens_k[b + 1] - k0;
  p.variant.diag_offset = p.variant.bottom_right ? p.len_kv - p.len_q : 0;
  p.row0_q = q0;
  p.q = static_cast<const T*>(p.q) + q0 * p.q_stride.row;
  p.k = static_cast<const T*>(p.k) + k0 * p.k_stride.row;
  p.v = static_cast<const T*>(p.v) + k0 * p.v_stride.row;
  p.out = static_cast<T*>(p.out) + q0 * p.out_stride.row;
  if constexpr (std::is_base_of_v<AttentionBwdParams, P>) {
    p.grad_out = static_cast<const T*>(p.grad_out) + q0 * p.grad_out_stride.row;
    p.grad_q = static_cast<T*>(p.grad_q) + q0 * p.grad_q_stride.row;
    if (p.grad_q_accum != nullptr) p.grad_q_accum = static_cast<A*>(p.grad_q_accum) + q0 * p.grad_q_stride.row;
    p.grad_k = static_cast<A*>(p.grad_k) + k0 * p.grad_k_stride.row;
    p.grad_v = static_cast<A*>(p.grad_v) + k0 * p.grad_v_stride.row;
  }
  return p;
}

}  // namespace mha_ext
