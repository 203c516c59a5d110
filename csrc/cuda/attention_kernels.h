// CUDA device code of mha_ext::attention and attention_backward,
// FlashAttention-2 style, written only against simt.h / mma.h so the same
// source compiles with nvcc and runs under the CPU emulation in the tests.
// This header gathers it:
//   warp_tiles.h        tile shapes, warp products, the tile stream
//   tile_copies.h       global -> shared tile copies (plain and cp.async)
//   score_policy.h      the keys a row sees, the variants' score transform,
//                       softmax units, dropout draws
//   forward_kernels.h   forward (general and plain) and the key splits' merge
//   decode_kernels.h    forward of at most 16 query rows, warps sharing key tiles
//   backward_kernels.h  rowsum(dO * O), key-block backward, deterministic dQ
//
// Layout of work. Every warp owns 16 rows of its block's tile (the plain
// forward kernel's warps 32: two row tiles); products are
// warp-wide 16 x 8 x 16 steps whose accumulators use the mma C-fragment
// layout (mma.h): lane 4 g + t holds rows g and g + 8, columns 2t and 2t + 1
// of each 8-column slice. Half and bfloat16 tiles multiply on the tensor
// cores (mma.sync, float accumulation); float and double use the same layout
// on the CUDA cores (warp_mma), so one kernel serves every dtype.
//
//   forward      grid (query blocks, B * Hq over y and z). Q tile kept in shared memory,
//                K/V tiles streamed by cp.async into two stages (the next
//                tile loads while this one computes), online softmax in
//                registers, output and logsumexp written at the end; 16-bit
//                operands by ldmatrix and P kept in registers.
//   bwd_dot      D = rowsum(dO * O), one warp per row.
//   backward     grid (B * Hq, key blocks). K/V tile kept, query tiles (Q,
//                dO) streamed by cp.async, dK/dV accumulated in registers;
//                dQ added atomically into an accumulation-type buffer laid
//                out as grad_q, or left to
//   bwd_dq       grid (B * Hq, query blocks): dQ recomputed per query block
//                without atomics (deterministic mode), K/V tiles streamed.
//                Both take 16-bit operands by ldmatrix.
//
// Shared memory holds tiles in the element type, zero beyond the valid rows
// and the head dim, so padded products add zeros. Head dims are padded to a
// compile-time kHeadDim in {64, 128, 256} (launch.h's switch).
#pragma once

#include "backward_kernels.h"
#include "decode_kernels.h"
#include "forward_kernels.h"
