// CPU emulation of the primitives in simt.h (test infrastructure).
//
// A launch runs the blocks of the grid one after another on the calling
// thread. The threads of a block are fibers (a stack switch of our own on
// x86-64, ucontext elsewhere and under AddressSanitizer); the lowest-numbered
// thread that is not waiting runs until it reaches a barrier or returns. A
// block barrier lets its threads go only when every thread of the block has
// reached it; a warp barrier (sync_warp, shuffles, votes, mma) when every lane
// of the warp has. So lanes run ahead of later lanes up to each barrier and
// warp 0 runs ahead of the other warps up to each block barrier: a missing
// sync_warp() or sync_threads() shows up as a wrong answer (reads see the
// 0xff poison or stale data instead of the other threads' writes), and a
// barrier some thread never reaches (it waits elsewhere or has returned) is
// reported as a deadlock, not a hang.
// Warps are 32 lanes; shuffles exchange through per-lane slots between two
// warp barriers. Atomics use std::atomic_ref. cp.async copies read their
// source when issued and write shared memory only at the wait_group that
// retires their group (never, if no wait does): reading the destination
// before the wait, or another thread's destination before a barrier after
// its wait, sees the poison. Shared memory is one arena per
// block that every thread of the block sees, filled with 0xff bytes (NaN in
// every floating type) so that reading it before writing shows up.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define MHA_DEVICE inline
#define MHA_KERNEL void
#define MHA_LAUNCH_BOUNDS(threads, blocks)
#define MHA_UNROLL
#define MHA_NO_UNROLL

namespace mha_ext::simt {

constexpr int kWarpSize = 32;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emul {

enum class Wait { kNone, kBlock, kWarp };

// Words a lane can publish at once in a warp-wide exchange (mma.h's emulated
// tensor-core operations publish their fragment registers this way).
constexpr int kWideWords = 16;
// Floats of a warp's scratch for work its lanes share in an exchange
// (warp_exchange_words_once): an m16n8k16 product's A and B, 16 x 16 + 16 x 8.
constexpr int kWarpScratch = 384;

// A cp.async in flight: 16 bytes read at issue, for `dst` in shared memory.
struct PendingCopy {
  unsigned char* dst = nullptr;
  unsigned char bytes[16];
};

// How a fiber's context is kept. On x86-64 (outside AddressSanitizer, which
// follows stacks through swapcontext only) a switch of our own: the
// callee-saved registers, MXCSR and the x87 control word pushed on the
// fiber's stack and its stack pointer kept. swapcontext also saves and sets
// the signal mask, a system call at every switch: with it, switches took
// about half of the emulated test suite's time.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define MHA_EMUL_STACK_SWITCH 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#undef MHA_EMUL_STACK_SWITCH
#endif
#endif

#ifdef MHA_EMUL_STACK_SWITCH
// Saves the caller's context on its stack and its stack pointer in *save,
// then resumes the context saved at `load` (as this function left it, or as
// start_frame built it).
__attribute__((naked, noinline)) inline void switch_stack(void** /*save*/, void* /*load*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

// The saved context of a fiber that has not run: switch_stack's frame at the
// top of `stack`, returning into entry (which never returns) with the stack
// aligned as after a call.
inline void* start_frame(char* stack, size_t bytes, void (*entry)()) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<uint64_t*>(top);
  slot[-1] = 0;                                    // entry's return address: none
  slot[-2] = reinterpret_cast<uintptr_t>(entry);  // switch_stack's
  for (int i = 3; i <= 8; ++i) slot[-i] = 0;      // rbp, rbx, r12 to r15
  uint32_t csr = 0;
  uint16_t cw = 0;
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr), "=m"(cw));
  slot[-9] = csr | static_cast<uint64_t>(cw) << 32;
  return slot - 9;
}

using Context = void*;  // the stack pointer of switch_stack's saved frame
// Saves the running context in *save and resumes *load.
inline void swap_context(Context* save, Context* load) { switch_stack(save, *load); }
#else
using Context = ucontext_t;
inline void swap_context(Context* save, Context* load) { swapcontext(save, load); }
#endif

struct Fiber {
  Context ctx{};
#ifndef MHA_EMUL_STACK_SWITCH
  std::unique_ptr<char[]> stack;  // (with the stack switch, the launch's, one a thread)
#endif
  bool done = false;
  Wait wait = Wait::kNone;
  std::vector<PendingCopy> open_group;            // issued since the last commit
  std::deque<std::vector<PendingCopy>> groups;    // committed, oldest first
};

struct Block {
  dim3 grid, block, idx;
  int n = 0;
  std::vector<Fiber> fibers;
  std::vector<uint64_t> slots;  // one exchange slot per thread
  std::vector<uint32_t> wide;   // kWideWords per thread, for warp-wide fragment exchanges
  std::vector<float> warp_scratch;  // kWarpScratch per warp (warp_exchange_words_once)
  std::vector<unsigned char> warp_once;  // per warp: its shared work of the open exchange still to do
  std::vector<unsigned char> shared;
  Context scheduler{};
  int current = -1;
  // The scheduler's books, kept as the threads wait, finish and are freed:
  // a bit a thread that can run (not done, not waiting), the threads at a
  // block barrier, and those at a warp barrier, a count a warp.
  std::vector<uint64_t> runnable;
  int at_block = 0;
  std::vector<int> at_warp;
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;  // thrown in a thread (a misused primitive): rethrown by launch()
};

inline thread_local Block* tl_block = nullptr;

inline Block& self() {
  if (tl_block == nullptr || tl_block->current < 0)
    throw std::logic_error("simt primitive called outside an emulated launch");
  return *tl_block;
}

inline void set_runnable(Block& b, int t, bool on) {
  const uint64_t bit = uint64_t(1) << (t % 64);
  b.runnable[t / 64] = on ? b.runnable[t / 64] | bit : b.runnable[t / 64] & ~bit;
}

// The running thread hands the calling OS thread back to the scheduler.
inline void yield_to_scheduler(Block& b, Fiber& f) { swap_context(&f.ctx, &b.scheduler); }

inline void fiber_entry() {
  Block& b = *tl_block;
  try {
    (*b.body)();
  } catch (...) {  // an exception cannot unwind past the fiber: the scheduler rethrows it
    b.error = std::current_exception();
  }
  b.fibers[b.current].done = true;
  set_runnable(b, b.current, false);
  yield_to_scheduler(b, b.fibers[b.current]);
}

// The calling thread waits at a barrier of `kind` until the scheduler frees it.
inline void wait_at(Wait kind) {
  Block& b = self();
  Fiber& f = b.fibers[b.current];
  f.wait = kind;
  set_runnable(b, b.current, false);
  if (kind == Wait::kBlock)
    ++b.at_block;
  else
    ++b.at_warp[b.current / kWarpSize];
  yield_to_scheduler(b, f);
}

inline void free_thread(Block& b, int t) {
  Fiber& f = b.fibers[t];
  if (f.wait == Wait::kBlock) --b.at_block;
  if (f.wait == Wait::kWarp) --b.at_warp[t / kWarpSize];
  f.wait = Wait::kNone;
  set_runnable(b, t, true);
}

// Frees the threads waiting at a complete barrier; returns whether any was.
// Complete means every thread of the block (warp) is there: one that has
// returned never arrives, which the caller reports as a deadlock.
inline bool release_barriers(Block& b) {
  bool released = false;
  bool block_ready = true;
  for (const Fiber& f : b.fibers) block_ready = block_ready && !f.done && f.wait == Wait::kBlock;
  if (block_ready) {
    for (int t = 0; t < b.n; ++t) free_thread(b, t);
    return true;
  }
  for (int w0 = 0; w0 < b.n; w0 += kWarpSize) {
    const int w1 = std::min(b.n, w0 + kWarpSize);
    bool warp_ready = true, any_warp = false;
    for (int t = w0; t < w1; ++t) {
      const Fiber& f = b.fibers[t];
      if (f.wait == Wait::kWarp) any_warp = true;
      warp_ready = warp_ready && !f.done && f.wait == Wait::kWarp;
    }
    if (any_warp && warp_ready) {
      for (int t = w0; t < w1; ++t) free_thread(b, t);
      released = true;
    }
  }
  return released;
}

// release_barriers after thread t stopped (waits or is done): only t's warp
// and the block can have become complete, the rest were checked before.
inline void release_after(Block& b, int t) {
  if (b.at_block == b.n) {
    for (int u = 0; u < b.n; ++u) free_thread(b, u);
    return;
  }
  const int w0 = t - t % kWarpSize, w1 = std::min(b.n, w0 + kWarpSize);
  if (b.at_warp[t / kWarpSize] == w1 - w0)
    for (int u = w0; u < w1; ++u) free_thread(b, u);
}

// The lowest-numbered thread that can run, or -1.
inline int first_runnable(const Block& b) {
  for (size_t i = 0; i < b.runnable.size(); ++i)
    if (b.runnable[i] != 0) return static_cast<int>(64 * i) + __builtin_ctzll(b.runnable[i]);
  return -1;
}

// Runs `body` once per thread of every block of `grid`.
inline void launch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body,
                   size_t stack_bytes = 64 * 1024) {
  const int n = static_cast<int>(block.x * block.y * block.z);
#ifdef MHA_EMUL_STACK_SWITCH
  // one stack a thread for the whole launch (a block's threads start afresh on them)
  std::vector<std::unique_ptr<char[]>> stacks(n);
  for (auto& st : stacks) st.reset(new char[stack_bytes]);
#endif
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.grid = grid;
        b.block = block;
        b.idx = dim3(bx, by, bz);
        b.n = n;
        b.fibers.resize(n);
        b.slots.assign(n, 0);
        b.wide.assign(static_cast<size_t>(n) * kWideWords, 0);
        b.warp_scratch.assign(static_cast<size_t>((n + kWarpSize - 1) / kWarpSize) * kWarpScratch, 0.0f);
        b.warp_once.assign((n + kWarpSize - 1) / kWarpSize, 0);
        b.shared.assign(shared_bytes, 0xff);  // NaN in every float type: reads before writes show
        b.body = &body;
        b.runnable.assign((n + 63) / 64, 0);
        b.at_warp.assign((n + kWarpSize - 1) / kWarpSize, 0);
        Block* outer = tl_block;
        tl_block = &b;
        for (int t = 0; t < n; ++t) {
          Fiber& f = b.fibers[t];
#ifdef MHA_EMUL_STACK_SWITCH
          f.ctx = start_frame(stacks[t].get(), stack_bytes, &fiber_entry);
#else
          f.stack.reset(new char[stack_bytes]);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.get();
          f.ctx.uc_stack.ss_size = stack_bytes;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, &fiber_entry, 0);
#endif
          set_runnable(b, t, true);
        }
        // Always run the lowest runnable thread, freeing barriers as soon as
        // they are complete: warp 0 runs through its warp barriers up to the
        // next block barrier before warp 1 starts, the order in which a
        // missing block barrier between warps does the most harm.
        for (;;) {
          const int t = first_runnable(b);
          if (t >= 0) {
            b.current = t;
            swap_context(&b.scheduler, &b.fibers[t].ctx);
            b.current = -1;
            if (b.error) {
              tl_block = outer;
              std::rethrow_exception(b.error);
            }
            release_after(b, t);
            continue;
          }
          bool live = false;
          for (const Fiber& f : b.fibers) live = live || !f.done;
          if (!live) break;
          if (!release_barriers(b)) {
            tl_block = outer;
            throw std::runtime_error(
                "simt emulation: deadlock, a barrier is not reached by every thread of its block or warp");
          }
        }
        tl_block = outer;
      }
}

inline int linear_tid() {
  Block& b = self();
  return b.current;
}

template <typename T>
T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  Block& b = self();
  const int tid = b.current;
  std::memcpy(&b.slots[tid], &v, sizeof(T));
  wait_at(Wait::kWarp);
  const int warp0 = tid - tid % kWarpSize;
  const int src = warp0 + src_lane;
  T r = v;
  if (src_lane >= 0 && src_lane < kWarpSize && src < b.n)
    std::memcpy(&r, &b.slots[src], sizeof(T));
  wait_at(Wait::kWarp);
  return r;
}

// Every lane of the calling warp publishes `n` words; after a warp barrier
// `read(word_of, scratch)` sees any lane's words, word_of(lane, word); a
// second barrier ends the exchange. Work the lanes share goes in
// `once(word_of, scratch)`, run a single time for the warp (by the first of
// its lanes to resume) before any lane's `read`: it fills the warp's
// kWarpScratch floats, which `read` sees. Every lane marks the work due as
// it publishes; the second barrier keeps the next exchange from marking it
// again before the last lane has read.
template <typename Once, typename Read>
void warp_exchange_words_once(const uint32_t* words, int n, Once&& once, Read&& read) {
  Block& b = self();
  const int tid = b.current, warp0 = tid - tid % kWarpSize, warp = tid / kWarpSize;
  if (n > kWideWords) throw std::logic_error("warp_exchange_words: too many words");
  std::memcpy(&b.wide[static_cast<size_t>(tid) * kWideWords], words, n * sizeof(uint32_t));
  b.warp_once[warp] = 1;
  wait_at(Wait::kWarp);
  auto word_of = [&b, warp0](int lane, int word) {
    if (warp0 + lane >= b.n) throw std::logic_error("warp_exchange_words: partial warp");
    return b.wide[static_cast<size_t>(warp0 + lane) * kWideWords + word];
  };
  float* scratch = &b.warp_scratch[static_cast<size_t>(warp) * kWarpScratch];
  if (b.warp_once[warp]) {
    b.warp_once[warp] = 0;
    once(word_of, scratch);
  }
  read(word_of, static_cast<const float*>(scratch));
  wait_at(Wait::kWarp);
}

// The same without shared work: `read(word_of)`.
template <typename Read>
void warp_exchange_words(const uint32_t* words, int n, Read&& read) {
  warp_exchange_words_once(
      words, n, [](auto&&, float*) {}, [&](auto&& word_of, const float*) { read(word_of); });
}

}  // namespace emul

inline dim3 thread_idx() {
  emul::Block& b = emul::self();
  const unsigned t = static_cast<unsigned>(b.current);
  return dim3(t % b.block.x, (t / b.block.x) % b.block.y, t / (b.block.x * b.block.y));
}
inline dim3 block_idx() { return emul::self().idx; }
inline dim3 block_dim() { return emul::self().block; }
inline dim3 grid_dim() { return emul::self().grid; }
inline void sync_threads() { emul::wait_at(emul::Wait::kBlock); }
inline void sync_warp() { emul::wait_at(emul::Wait::kWarp); }

template <typename T>
T shfl(T v, int src_lane) { return emul::exchange(v, src_lane); }
template <typename T>
T shfl_xor(T v, int lane_mask) { return emul::exchange(v, (emul::linear_tid() % kWarpSize) ^ lane_mask); }
template <typename T>
T shfl_down(T v, unsigned delta) {
  const int lane = emul::linear_tid() % kWarpSize;
  const int src = lane + static_cast<int>(delta);
  return emul::exchange(v, src < kWarpSize ? src : lane);
}
inline unsigned vote_ballot(bool p) {
  emul::Block& b = emul::self();
  const int tid = b.current, warp0 = tid - tid % kWarpSize;
  b.slots[tid] = p ? 1 : 0;
  emul::wait_at(emul::Wait::kWarp);
  unsigned bits = 0;
  for (int l = 0; l < kWarpSize && warp0 + l < b.n; ++l)
    if (b.slots[warp0 + l]) bits |= 1u << l;
  emul::wait_at(emul::Wait::kWarp);
  return bits;
}
inline bool vote_any(bool p) { return vote_ballot(p) != 0; }
inline bool vote_all(bool p) {
  emul::Block& b = emul::self();
  const int warp0 = b.current - b.current % kWarpSize;
  const int lanes = std::min(kWarpSize, b.n - warp0);
  const unsigned full = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
  return vote_ballot(p) == full;
}
template <typename T>
T* dynamic_shared() { return reinterpret_cast<T*>(emul::self().shared.data()); }

namespace emul {

// Whether [p, p + bytes) lies in the calling block's shared memory.
inline bool in_shared(const void* p, size_t bytes) {
  const Block& b = self();
  const auto* c = static_cast<const unsigned char*>(p);
  return c >= b.shared.data() && c + bytes <= b.shared.data() + b.shared.size();
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace emul

template <typename T>
void atomic_add_global(T* p, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic_add_global: float or double");
  if (emul::in_shared(p, sizeof(T))) throw std::logic_error("atomic_add_global: the address is in shared memory");
  std::atomic_ref<T>(*p).fetch_add(v);
}

inline void cp_async_16(void* smem, const void* gmem) {
  if (!emul::aligned16(smem) || !emul::aligned16(gmem))
    throw std::logic_error("cp_async_16: both addresses must be 16-byte aligned");
  if (!emul::in_shared(smem, 16)) throw std::logic_error("cp_async_16: the destination is not in shared memory");
  if (emul::in_shared(gmem, 1)) throw std::logic_error("cp_async_16: the source must be global memory");
  emul::PendingCopy c;
  c.dst = static_cast<unsigned char*>(smem);
  std::memcpy(c.bytes, gmem, 16);
  emul::Block& b = emul::self();
  b.fibers[b.current].open_group.push_back(c);
}
inline void cp_async_commit() {
  emul::Block& b = emul::self();
  emul::Fiber& f = b.fibers[b.current];
  f.groups.push_back(std::move(f.open_group));
  f.open_group.clear();
}
template <int N>
void cp_async_wait() {
  emul::Block& b = emul::self();
  emul::Fiber& f = b.fibers[b.current];
  while (f.groups.size() > static_cast<size_t>(N)) {
    for (const emul::PendingCopy& c : f.groups.front()) std::memcpy(c.dst, c.bytes, 16);
    f.groups.pop_front();
  }
}

using Stream = void*;

inline int max_shared_per_block() { return 227 * 1024; }
inline int shared_per_multiprocessor() { return 228 * 1024; }
inline int multiprocessor_count() { return 132; }

// The grids launched so far, (x, y, z) each: what the tests read to see
// which launches a call made (tests/emul: mha_ext_emul::launched_grids).
inline std::vector<std::array<unsigned, 3>>& launched_grids() {
  static std::vector<std::array<unsigned, 3>> grids;
  return grids;
}
// and the threads per block of each (mha_ext_emul::launched_threads)
inline std::vector<unsigned>& launched_threads() {
  static std::vector<unsigned> threads;
  return threads;
}

// and the dynamic shared bytes of each (mha_ext_emul::launched_shared)
inline std::vector<size_t>& launched_shared() {
  static std::vector<size_t> shared;
  return shared;
}

// Runs the kernel under the emulation; returns 0 (no error) to mirror the CUDA form.
template <typename... KArgs, typename... Args>
inline int launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                         Stream /*stream*/, Args&&... args) {
  auto& grids = launched_grids();
  if (grids.size() >= 4096) grids.erase(grids.begin(), grids.begin() + 2048);  // the recent ones are read
  grids.push_back({grid.x, grid.y, grid.z});
  auto& threads = launched_threads();
  if (threads.size() >= 4096) threads.erase(threads.begin(), threads.begin() + 2048);
  threads.push_back(block.x * block.y * block.z);
  auto& shared = launched_shared();
  if (shared.size() >= 4096) shared.erase(shared.begin(), shared.begin() + 2048);
  shared.push_back(shared_bytes);
  emul::launch(grid, block, shared_bytes, [&] { kernel(args...); });
  return 0;
}
template <typename... KArgs, typename... Args>
inline int launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, SharedMemory shared, Stream stream,
                         Args&&... args) {
  if (shared.limit < shared.bytes) throw std::logic_error("launch_kernel: the shared-memory limit is below the bytes");
  return launch_kernel(kernel, grid, block, shared.bytes, stream, static_cast<Args&&>(args)...);
}

}  // namespace mha_ext::simt
