// Launchers of the CUDA attention kernels: the one head-dim switch, and the
// grid, block and shared memory of each kernel. Host code, shared by the CUDA
// build (attention_cuda.cu) and the emulation tests (tests/emul).
//
// Instantiations: 4 element types x 3 head dims x 3 kernels (fwd, bwd, bwd_dq)
// + 4 plain forward kernels (16-bit types at head dims 64 and 128) + 6
// decode kernels (16-bit types) + 4 bwd_dot + 4 combine + 1 mask_ranges = 55 per architecture.
#pragma once

#include "attention_kernels.h"

#include <ATen/Context.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace mha_ext::device {

constexpr int64_t kMaxHeadDim = 256;

// The compile-time head dim a call runs with: max(E, Ev) rounded up to 64,
// 128 or 256 (tiles are zero-padded beyond E and Ev). 0 when too large.
inline int padded_head_dim(int64_t e, int64_t ev) {
  const int64_t d = std::max(e, ev);
  return d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

#define MHA_HEAD_DIM_SWITCH(D, ...)       \
  [&] {                                   \
    if ((D) == 64) {                      \
      constexpr int kHeadDim = 64;        \
      return __VA_ARGS__();               \
    } else if ((D) == 128) {              \
      constexpr int kHeadDim = 128;       \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr int kHeadDim = 256;       \
      return __VA_ARGS__();               \
    }                                     \
  }()

// Shared-memory bytes of the forward (TileConfig::kFwdSharedBytes): Q, two
// stages of K and V tiles (one for float and double at head dim 256), and P
// for float and double.
//   f16/bf16: D 64: 45.0 KiB, 128: 85.0 KiB, 256: 99.0 KiB
//   float:    D 64: 60.0 KiB, 128: 87.0 KiB, 256: 67.5 KiB
//   double:   D 64: 54.0 KiB, 128: 83.5 KiB, 256: 99.0 KiB
// (A100 allows 163 KiB per block, H100 227 KiB, sm_86 / sm_89 / sm_120 99 KiB.)
// With 128-row tiles (fwd_slices below; f16/bf16 only): D 64: 54.0 KiB, 128:
// 102.0 KiB, 256: 132.0 KiB.
template <typename T, int kHeadDim>
constexpr size_t fwd_shared_bytes() {
  return TileConfig<T, kHeadDim>::kFwdSharedBytes;
}
static_assert(fwd_shared_bytes<f16, 64>() == 45 * 1024 && fwd_shared_bytes<f16, 256>() == 99 * 1024 &&
              fwd_shared_bytes<float, 128>() == 89088 && fwd_shared_bytes<float, 256>() == 69120 &&
              fwd_shared_bytes<double, 256>() == 101376 && fwd_shared_bytes<double, 128>() == 85504);
static_assert(TileConfig<f16, 64>::fwd_shared_bytes(8) == 54 * 1024 &&
              TileConfig<f16, 128>::fwd_shared_bytes(8) == 102 * 1024 &&
              TileConfig<bf16, 256>::fwd_shared_bytes(8) == 132 * 1024 && TileConfig<float, 64>::kFwdWideWarps == 4);

// Backward (TileConfig::kBwdSharedBytes; the deterministic dQ kernel
// kBwdDqSharedBytes, one P tile fewer): two fixed tiles (K and V, or Q and
// dO), P^T and dS^T (dS), and one or two stages of the streamed tiles (Q and
// dO with their rows' shift, log_norm and D, or K and V); the key-block kernel:
//   f16/bf16: D 64: 73.5 KiB (2 stages), 128: 86.8 KiB (1), 256: 71.4 KiB (1)
//   float:    D 64: 60.8 KiB (2), 128: 75.4 KiB (1), 256: 67.7 KiB (1)
//   double:   D 64: 54.8 KiB (2), 128: 69.9 KiB (1), 256: 133.9 KiB (1)
template <typename T, int kHeadDim>
constexpr size_t bwd_shared_bytes() {
  return TileConfig<T, kHeadDim>::kBwdSharedBytes;
}
static_assert(bwd_shared_bytes<f16, 64>() == 75264 && TileConfig<f16, 64>::kBwdStages == 2 &&
              bwd_shared_bytes<f16, 128>() == 88832 && bwd_shared_bytes<double, 256>() == 137088);

// Grid rows (y) a launch over `rows` in blocks of `block` needs; CUDA allows
// 65535, which the host checks before launching: every launch covers at
// least 16 rows per block (static_asserts below), so up to 65535 * 16 rows.
// The forward's (batch, head) pairs fill grid y up to this and spill into z.
// CUDA allows 65535 on y; the emulation takes 3, so that its tests run the
// spill (most have more than 3 pairs).
#if defined(MHA_SIMT_EMULATION)
constexpr int64_t kGridYMax = 3;
#else
constexpr int64_t kGridYMax = 65535;
#endif

inline unsigned row_blocks(int64_t rows, int block) { return static_cast<unsigned>((rows + block - 1) / block); }
constexpr int64_t kMinRowsPerBlock = 16;
constexpr int64_t kMaxRows = 65535 * kMinRowsPerBlock;
static_assert(kDotRows >= kMinRowsPerBlock && TileConfig<double, 256>::kFwdBlockM >= kMinRowsPerBlock &&
              TileConfig<double, 256>::kBwdBlock >= kMinRowsPerBlock);

// Shared memory the calls of this element type and head dims need per block
// (the larger of forward and backward).
template <typename T>
size_t shared_bytes_needed(int64_t e, int64_t ev) {
  const int d = padded_head_dim(e, ev);
  return MHA_HEAD_DIM_SWITCH(d, [&] { return std::max(fwd_shared_bytes<T, kHeadDim>(), bwd_shared_bytes<T, kHeadDim>()); });
}

// How the kernels load tensor-core operands from shared memory, read at each
// launch from MHA_EXT_CUDA_OPERANDS: "ldmatrix" (unset: the default) or
// "scalar" (plain loads, the kernels' way before ldmatrix; the fragments are
// the same values, so the results are too), in a build that has that path
// (kScalarOperandsBuilt), else a clear error.
inline bool scalar_operands_requested() {
  const char* v = std::getenv("MHA_EXT_CUDA_OPERANDS");
  if (v == nullptr || std::string(v) == "ldmatrix") return false;
  if (std::string(v) == "scalar") {
    if (!kScalarOperandsBuilt)
      throw std::invalid_argument(
          "MHA_EXT_CUDA_OPERANDS=scalar needs the plain-load operand path, which this build leaves out "
          "(rebuild with MHA_EXT_SCALAR_OPERANDS=1)");
    return true;
  }
  throw std::invalid_argument(std::string("MHA_EXT_CUDA_OPERANDS must be \"ldmatrix\" or \"scalar\", got \"") + v +
                              "\"");
}

// How float32 products run, read at each float32 launch from
// MHA_EXT_CUDA_FLOAT32: unset or "auto": TF32 on the tensor cores where
// torch allows TF32 matmuls (torch.backends.cuda.matmul.fp32_precision ==
// "tf32", which allow_tf32 = True and set_float32_matmul_precision("high")
// set), else float32 FMAs on the CUDA cores, as torch's matmuls do;
// "3xtf32": 3xTF32 on the tensor cores (near float32 accuracy: about 2^-21
// of a product against float32's 2^-24, torch's own float32 attention
// arithmetic); "cuda-cores": float32 FMAs whatever torch allows.
inline Fp32Math fp32_math_requested() {
  const char* v = std::getenv("MHA_EXT_CUDA_FLOAT32");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode == "cuda-cores") return Fp32Math::kCudaCores;
  if (mode == "3xtf32") return Fp32Math::kTf32x3;
  if (mode != "auto")
    throw std::invalid_argument("MHA_EXT_CUDA_FLOAT32 must be \"auto\", \"3xtf32\" or \"cuda-cores\", got \"" + mode +
                                "\"");
  const bool tf32 = at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
                    at::Float32Precision::TF32;
  return tf32 ? Fp32Math::kTf32 : Fp32Math::kCudaCores;
}

// MHA_EXT_CUDA_FWD_WARP_ROWS, read once a launch: "auto" where unset.
inline std::string fwd_warp_rows_setting() {
  const char* v = std::getenv("MHA_EXT_CUDA_FWD_WARP_ROWS");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode != "auto" && mode != "16" && mode != "32")
    throw std::invalid_argument("MHA_EXT_CUDA_FWD_WARP_ROWS must be \"auto\", \"16\" or \"32\", got \"" + mode +
                                "\"");
  return mode;
}

// Whether a forward call runs the plain kernel (attention_fwd_kernel's
// kPlain: warps of 32 query rows, two row tiles sharing every K and V
// fragment the warp loads): a call without a mask tensor, dropout, softcap,
// ALiBi or a paged KV cache, with ldmatrix operands (MHA_EXT_CUDA_OPERANDS
// unset or "ldmatrix"), in a type and head dim that has it (TileConfig::kFwdRowTiles:
// 16-bit types up to head dim 128), unless MHA_EXT_CUDA_FWD_WARP_ROWS, read
// at each launch, is "16" (the general kernel, 16 rows a warp, as before);
// unset, "auto" or "32": wherever it can. A row's arithmetic is the same in
// both kernels but in the edge tiles (those that the lengths, causal
// alignment or a window cut), which take the softmax's one-FMA scores in
// the plain kernel (fma_scores) and the exact path in the general one, so
// the last bits may differ where a call has such tiles; for finite V and
// whole tiles the outputs are bit-identical (the plain kernel's warps skip
// key tiles none of their rows can see, where the general kernel adds 0 x
// V: an infinite V row there turns its rows NaN in the general kernel only;
// and with key splits under causal alignment or a window, a block's runs
// follow its own visible tiles, which differ with its rows: the last bits
// may differ there as with MHA_EXT_CUDA_FWD_ROWS).
template <typename T, int kHeadDim>
bool fwd_plain(const AttentionFwdParams& p, const std::string& warp_rows) {
  return TileConfig<T, kHeadDim>::kFwdRowTiles > 1 && warp_rows != "16" && p.mask_kind == MaskKind::kNone &&
         !p.dropout.enabled() && !p.variant.changes_scores() && p.block_table == nullptr && !p.scalar_operands;
}

// Whether a forward call runs the decode kernel (attention_decode_kernel,
// decode_kernels.h: a block's warps share each key tile): at most 16 query
// rows (a decode step, after pack_gqa_rows), dense or a KV cache (paged
// or not; not varlen), without dropout (masks, softcap and ALiBi go through
// masked_score there), 16-bit types. MHA_EXT_CUDA_DECODE, read at each
// launch: unset or "auto": wherever it can, unless
// MHA_EXT_CUDA_FWD_WARP_ROWS names a kernel ("16", "32"); "off": never (the
// plain or general kernel, as before). Its rows' bits differ from theirs in
// the last places (its sums run per warp, then merge).
template <typename T, int kHeadDim>
bool fwd_decode(const AttentionFwdParams& p, const std::string& warp_rows) {
  const char* v = std::getenv("MHA_EXT_CUDA_DECODE");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode != "auto" && mode != "off")
    throw std::invalid_argument("MHA_EXT_CUDA_DECODE must be \"auto\" or \"off\", got \"" + mode + "\"");
  return sizeof(T) == 2 && mode == "auto" && warp_rows == "auto" && p.len_q <= 16 &&
         p.cu_seqlens_q == nullptr && !p.dropout.enabled() && !p.scalar_operands;
}

// The decode kernel's shared bytes: a 16-row Q tile and the K/V stages, the
// forward's layout for one 16-row slice (16-bit types keep P in registers).
template <typename T, int kHeadDim>
constexpr int decode_shared_bytes() {
  return TileConfig<T, kHeadDim>::fwd_shared_bytes(1);
}
static_assert(decode_shared_bytes<f16, 64>() == 39168 && decode_shared_bytes<f16, 128>() == 73984 &&
              decode_shared_bytes<bf16, 256>() == 76032);

// The forward's query rows per block, in 16-row slices, for element type T
// at head dim kHeadDim: kFwdWideWarps (128 rows, 16-bit types) or kFwdWarps
// (64 rows). MHA_EXT_CUDA_FWD_ROWS, read at each launch: unset or "auto":
// 128 rows when the call has more than 64 query rows and the GPU's shared
// memory per block holds the wider Q tile, at head dims 128 and 256 with 16
// rows a warp (A100, H100: 8 warps per SM where 64-row blocks get 4 on
// sm_80, and each K/V tile serves twice the rows; at head dim 64, 128 rows
// of 16-row warps would take sm_80 from 12 warps per SM to 8) and, for the
// plain kernel's 32-row warps (head dims 64 and 128), at both head dims (4
// warps a block); 64 rows otherwise; "64": always 64 (the
// tiles before); "128": 128 wherever the shared memory holds it. For finite
// inputs a row's result does not depend on the block it is in (the same key
// tiles in the same order; a wider causal or window block only adds tiles
// fully masked for the row, which change nothing): the outputs are
// bit-identical either way, except with key splits under causal alignment,
// a window or a bool mask (a block's runs follow its own visible tiles, or
// the range the mask shows its rows). wide_fits: the
// GPU's shared memory per block holds the 128-row tiles.
template <typename T, int kHeadDim>
int fwd_slices(int64_t len_q, bool wide_fits, int row_tiles) {
  using C = TileConfig<T, kHeadDim>;
  const char* v = std::getenv("MHA_EXT_CUDA_FWD_ROWS");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode != "auto" && mode != "64" && mode != "128")
    throw std::invalid_argument("MHA_EXT_CUDA_FWD_ROWS must be \"auto\", \"64\" or \"128\", got \"" + mode + "\"");
  if (!wide_fits || mode == "64") return C::kFwdWarps;
  if (mode == "auto" && ((kHeadDim < 128 && row_tiles == 1) || len_q <= 64)) return C::kFwdWarps;
  return C::kFwdWideWarps;
}

// The forward's key splits (AttentionFwdParams::kv_splits), read at each
// launch from MHA_EXT_CUDA_KV_SPLITS: unset or "auto": where the call's
// blocks (query blocks x batch x heads) number fewer than twice the GPU's
// multiprocessors (a decode step has one query block a head), as many splits
// as one wave of blocks holds (fwd_resident_blocks a multiprocessor; never
// more blocks than that, which would run a second wave for a few of them:
// the H200's decode table of 2026-11-27 had 320 blocks where 264 fit, batch
// 8 at head dim 128), each of at least kMinSplitTiles key tiles, at most
// kMaxSplits; "1": never; a number N: N splits (at most one per key
// tile) where "auto" would consider splitting (fewer blocks than twice the
// multiprocessors). Never for varlen calls (their query rows are packed). The count depends on the shape, the GPU and the setting
// alone, so a CUDA graph replays the same work; the blocks are counted as
// blocks of kFwdWarps 16-row slices (64 rows for 16-bit types) whatever the
// launch's rows per block, so that the count does
// not move with MHA_EXT_CUDA_FWD_ROWS / MHA_EXT_CUDA_FWD_WARP_ROWS (a
// non-causal row then sums the same runs of tiles in every layout; not
// with a bool mask, whose shown range each block's runs divide, and which
// depends on the block's rows). (Chosen
// without a GPU to measure on: a starting point, not a tuned one.)
constexpr int64_t kMinSplitTiles = 4, kMaxSplits = 64;

inline int64_t kv_splits_requested() {  // 0: auto
  const char* v = std::getenv("MHA_EXT_CUDA_KV_SPLITS");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode == "auto") return 0;
  char* end = nullptr;
  const long n = std::strtol(mode.c_str(), &end, 10);
  if (mode.empty() || *end != '\0' || n < 1 || n > kMaxSplits)
    throw std::invalid_argument("MHA_EXT_CUDA_KV_SPLITS must be \"auto\" or a number from 1 to " +
                                std::to_string(kMaxSplits) + ", got \"" + mode + "\"");
  return n;
}

// The forward's blocks a multiprocessor holds at once, counted by their
// shared memory (shared_bytes each, and the 1 KiB the hardware reserves a
// block), at most 4 (what the plain kernel's registers allow: 64 threads of
// 255; the decode kernel's 128 threads of at most 128). On an H100 / H200:
// blocks of kFwdWarps slices (the plain and general kernels, counted alike
// so that their splits, and so their bits, are the same; the general
// kernel's 128 threads at head dim 64 fit 3 by registers) of 16-bit types 4
// at head dim 64, 2 at 128 and 256; the decode kernel's 4 and 3.
inline int64_t fwd_resident_blocks(int64_t shared_bytes) {
  return std::clamp<int64_t>(shared_per_multiprocessor() / (shared_bytes + 1024), 1, 4);
}

template <typename T, int kHeadDim>
int64_t fwd_kv_splits(const AttentionFwdParams& p, int64_t resident) {
  if (p.cu_seqlens_q != nullptr || p.len_q == 0 || p.len_kv == 0) return 1;
  const int64_t asked = kv_splits_requested();
  const int64_t tiles = (p.len_kv + TileConfig<T, kHeadDim>::kFwdBlockN - 1) / TileConfig<T, kHeadDim>::kFwdBlockN;
  const int64_t blocks = row_blocks(p.len_q, 16 * TileConfig<T, kHeadDim>::kFwdWarps) * p.batch * p.heads_q;
  const int64_t sms = multiprocessor_count();
  if (blocks >= 2 * sms) return 1;  // the GPU is full (and a long query's workspace would be large)
  if (asked > 0) return std::min(asked, tiles);
  const int64_t wave = resident * sms;
  return std::clamp<int64_t>(std::min(wave / blocks, tiles / kMinSplitTiles), 1, kMaxSplits);
}

// A bool mask's shown ranges (score_policy.h's mask_ranges_kernel) are
// found before the forward and backward kernels of a dense call (not varlen,
// a KV cache or the decode kernel, which scans the mask itself): their int32
// words for rows in blocks of `group` (keys_grouped false: the keys each
// block of rows is shown) or keys in blocks; 0 where a call takes none.
// MHA_EXT_CUDA_MASK_RANGES, read at each launch with a bool mask: unset or
// "auto": the ranges are found and used; "off": not (every tile is read, as
// before them), so that a GPU session can time both (bench_cuda.py --only masks).
inline bool mask_ranges_requested() {
  const char* v = std::getenv("MHA_EXT_CUDA_MASK_RANGES");
  const std::string mode = v == nullptr ? "auto" : v;
  if (mode != "auto" && mode != "off")
    throw std::invalid_argument("MHA_EXT_CUDA_MASK_RANGES must be \"auto\" or \"off\", got \"" + mode + "\"");
  return mode == "auto";
}
inline int64_t mask_range_words(const AttentionFwdParams& p, bool keys_grouped, int group) {
  if (p.mask_kind != MaskKind::kBool || !mask_ranges_requested() || p.cu_seqlens_q != nullptr || p.seqlens_k != nullptr ||
      p.block_table != nullptr || p.len_q <= 0 || p.len_kv <= 0 || p.len_q > INT32_MAX || p.len_kv > INT32_MAX)
    return 0;
  const Strides4& s = p.mask_stride;
  const int64_t ranges = (s.b == 0 ? 1 : p.batch) * (s.h == 0 ? 1 : p.heads_q) *
                         mask_groups(keys_grouped ? s.col : s.row, keys_grouped ? p.len_kv : p.len_q, group);
  // (a block a range on a 1-D grid: past its 2^31 - 1 blocks the kernels read every tile, as without)
  return ranges <= INT32_MAX ? 2 * ranges : 0;
}
// (words: mask_range_words' count for the same call, keys_grouped and group)
template <typename Check>
void launch_mask_ranges(const AttentionFwdParams& p, bool keys_grouped, int group, int64_t words, int32_t* out,
                        Stream stream, Check&& check) {
  MaskRangeParams m;
  m.mask = static_cast<const bool*>(p.mask);
  m.stride_b = p.mask_stride.b;
  m.stride_h = p.mask_stride.h;
  m.stride_g = keys_grouped ? p.mask_stride.col : p.mask_stride.row;
  m.stride_x = keys_grouped ? p.mask_stride.row : p.mask_stride.col;
  m.heads = p.mask_stride.h == 0 ? 1 : p.heads_q;
  m.len_g = static_cast<int>(keys_grouped ? p.len_kv : p.len_q);
  m.len_x = static_cast<int>(keys_grouped ? p.len_q : p.len_kv);
  m.group = group;
  m.out = out;
  constexpr int kWarps = 4;
  check(launch_kernel(mask_ranges_kernel<kWarps>, dim3(static_cast<unsigned>(words / 2)), dim3(32 * kWarps),
                      (2 * kWarps + 2) * sizeof(int), stream, m));
}

// The forward, and with key splits the combine kernel after it. workspace(n)
// returns n bytes of device memory for the splits' partial results, valid
// for work queued on `stream` (torch's caching allocator). `check` receives
// each launch's status.
template <typename T, typename Check, typename Workspace>
void launch_attention_fwd(const AttentionFwdParams& params, Stream stream, Check&& check, Workspace&& workspace) {
  AttentionFwdParams p = params;
  p.scalar_operands = scalar_operands_requested();
  if constexpr (std::is_same_v<T, float>) p.fp32_math = fp32_math_requested();
  const int d = padded_head_dim(p.head_dim, p.head_dim_v);
  MHA_HEAD_DIM_SWITCH(d, [&] {
    using C = TileConfig<T, kHeadDim>;
    using A = typename AccOf<T>::type;
    // 128-row tiles exist (16-bit types) and the GPU holds them: one device query a launch
    const bool wide_fits =
        C::kFwdWideWarps != C::kFwdWarps && C::fwd_shared_bytes(C::kFwdWideWarps) <= max_shared_per_block();
    const std::string warp_rows = fwd_warp_rows_setting();
    const bool plain = fwd_plain<T, kHeadDim>(p, warp_rows);
    const bool decode = fwd_decode<T, kHeadDim>(p, warp_rows);
    const int row_tiles = plain ? C::kFwdRowTiles : 1;  // a warp's 16-row tiles
    const int rows_slices = fwd_slices<T, kHeadDim>(p.len_q, wide_fits, row_tiles);  // (checks its setting too)
    const int slices = decode ? 1 : rows_slices;
    p.kv_splits = fwd_kv_splits<T, kHeadDim>(
        p, fwd_resident_blocks(decode ? decode_shared_bytes<T, kHeadDim>() : C::fwd_shared_bytes(C::kFwdWarps)));
    const int64_t bh = p.batch * p.heads_q, rows = bh * p.len_q;
    // one workspace: the bool mask's ranges (256-byte aligned), then the key splits' partial results
    const int64_t range_words = decode ? 0 : mask_range_words(p, false, 16 * slices);
    const size_t range_bytes = (static_cast<size_t>(range_words) * sizeof(int32_t) + 255) / 256 * 256;
    const int64_t parts = p.kv_splits > 1 ? p.kv_splits * rows : 0;
    const size_t part_bytes = static_cast<size_t>(parts * (p.head_dim_v + 2)) * sizeof(A);
    if (range_bytes + part_bytes > 0) {
      char* w = static_cast<char*>(workspace(range_bytes + part_bytes));
      if (range_words > 0) {
        p.mask_row_keys = reinterpret_cast<int32_t*>(w);
        launch_mask_ranges(p, false, 16 * slices, range_words, reinterpret_cast<int32_t*>(w), stream, check);
      }
      if (parts > 0) {
        p.part_out = w + range_bytes;
        p.part_ml = static_cast<A*>(p.part_out) + parts * p.head_dim_v;
      }
    }
    // query blocks (times the key splits) on x; the (batch, head) pairs on y, spilling into z past kGridYMax
    const int64_t y = std::min<int64_t>(bh, kGridYMax);
    const dim3 grid(row_blocks(p.len_q, 16 * slices) * static_cast<unsigned>(p.kv_splits), static_cast<unsigned>(y),
                    static_cast<unsigned>((bh + y - 1) / y));
    // the kernel's shared-memory limit: the larger size wherever the GPU has
    // it, for both row counts (launch_kernel)
    const int limit = C::fwd_shared_bytes(wide_fits ? C::kFwdWideWarps : C::kFwdWarps);
    const SharedMemory smem{static_cast<size_t>(C::fwd_shared_bytes(slices)), static_cast<size_t>(limit)};
    if constexpr (sizeof(T) == 2) {
      if (decode) {
        constexpr int kBytes = decode_shared_bytes<T, kHeadDim>();
        check(launch_kernel(attention_decode_kernel<T, kHeadDim>, grid, dim3(32 * C::kFwdBlockN / 16),
                            SharedMemory{kBytes, kBytes}, stream, p));
      }
    }
    if constexpr (C::kFwdRowTiles > 1) {
      if (plain && !decode) {
        check(launch_kernel(attention_fwd_kernel<T, kHeadDim, true>, grid, dim3(32 * slices / row_tiles), smem,
                            stream, p));
      }
    }
    if (!plain && !decode)
      check(launch_kernel(attention_fwd_kernel<T, kHeadDim, false>, grid, dim3(32 * slices), smem, stream, p));
    if (p.kv_splits > 1) {
      constexpr int kCombineWarps = 4;  // a row each
      check(launch_kernel(attention_combine_kernel<T>, dim3(row_blocks(rows, kCombineWarps)), dim3(32 * kCombineWarps),
                          0, stream, p));
    }
  });
}

// D = rowsum(dO * O) into p.row_dot, then the key-block kernel, then (when
// p.grad_q_accum is null) the deterministic dQ kernel; before them, with a
// bool mask, its shown ranges (launch_mask_ranges) in workspace(n), n bytes
// of device memory valid for work queued on `stream`. `check` receives each
// launch's status.
template <typename T, typename Check, typename Workspace>
void launch_attention_bwd(const AttentionBwdParams& params, Stream stream, Check&& check, Workspace&& workspace) {
  AttentionBwdParams p = params;
  p.scalar_operands = scalar_operands_requested();
  if constexpr (std::is_same_v<T, float>) p.fp32_math = fp32_math_requested();
  constexpr int kDotWarps = 4;
  const unsigned bh = static_cast<unsigned>(p.batch * p.heads_q);
  check(launch_kernel(attention_bwd_dot_kernel<T>, dim3(bh, row_blocks(p.len_q, kDotRows)),
                      dim3(32 * kDotWarps), 0, stream, p));
  const int d = padded_head_dim(p.head_dim, p.head_dim_v);
  MHA_HEAD_DIM_SWITCH(d, [&] {
    using C = TileConfig<T, kHeadDim>;
    const dim3 block(32 * C::kBwdWarps);
    const size_t smem = bwd_shared_bytes<T, kHeadDim>();
    // the bool mask's ranges: the keys of each query block (the dQ kernel's),
    // the rows of each key block (the key-block kernel's)
    const int64_t row_words = mask_range_words(p, false, C::kBwdBlock), key_words = mask_range_words(p, true, C::kBwdBlock);
    if (row_words > 0 && key_words > 0) {  // (both, or neither: every tile read)
      int32_t* w = static_cast<int32_t*>(workspace(static_cast<size_t>(row_words + key_words) * sizeof(int32_t)));
      p.mask_row_keys = w;
      p.mask_key_rows = w + row_words;
      launch_mask_ranges(p, false, C::kBwdBlock, row_words, w, stream, check);
      launch_mask_ranges(p, true, C::kBwdBlock, key_words, w + row_words, stream, check);
    }
    check(launch_kernel(attention_bwd_kernel<T, kHeadDim>, dim3(bh, row_blocks(p.len_kv, C::kBwdBlock)), block,
                        smem, stream, p));
    if (p.grad_q_accum == nullptr)
      check(launch_kernel(attention_bwd_dq_kernel<T, kHeadDim>, dim3(bh, row_blocks(p.len_q, C::kBwdBlock)), block,
                          static_cast<size_t>(C::kBwdDqSharedBytes), stream, p));
  });
}

}  // namespace mha_ext::device
