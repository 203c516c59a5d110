// CPU attention kernels: FlashAttention-2 style tiling over plain parameter
// structs. No at::Tensor in here; the host functions in attention_cpu.cpp fill
// the params.
#pragma once

#include "../attention_params.h"

#include <cstdint>

namespace mha_ext {

// Forward: fills p.out and p.lse. scalar_t is double, float, c10::Half or
// c10::BFloat16; arithmetic in double for double, float otherwise.
template <typename scalar_t>
void attention_fwd_kernel(const AttentionFwdParams& p);

// Whether attention_fwd_kernel runs the decode kernel for p (at most 16 query
// rows per key/value head, or 64 against at least 8 keys a row; no dropout):
// the one CPU kernel that reads a paged KV cache in place. bf16: the inputs
// are bfloat16 (a varlen batch takes it only then, on AVX512-BF16, where the
// dense kernel would pad each sequence's rows to 32).
bool use_decode_kernel(const AttentionFwdParams& p, bool bf16);

// The decode kernel (decode_cpu.cpp): attention_fwd_kernel's path for p where
// use_decode_kernel(p); same results and contract.
template <typename scalar_t>
void attention_decode_kernel(const AttentionFwdParams& p);

// Backward: fills p.grad_q (scalar_t, contiguous), p.grad_k / p.grad_v
// (accumulator type, one slice per *query* head: (B, Hq, S, E) / (B, Hq, S, Ev),
// reduced over the GQA group by the host) and, when set, p.grad_mask
// (accumulator type, (B, Hq, L, S), zero-initialised by the caller).
template <typename scalar_t>
void attention_bwd_kernel(const AttentionBwdParams& p);

// dropout_keep_row (dropout.h), vectorised for the CPU: keep[t] for the
// call's columns j0 .. j0 + n - 1 (plus the dropout frame's col0) of row `row`.
void dropout_keep_row_cpu(const DropoutParams& d, uint64_t row, int64_t j0, int64_t n, uint8_t* keep);

}  // namespace mha_ext
