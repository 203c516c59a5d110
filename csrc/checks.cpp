#include "checks.h"

#include "attention_params.h"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

#include <cstdio>

#ifdef __linux__
#include <sys/sysinfo.h>
#endif

namespace mha_ext {

std::string format_shape(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + ")";
}

// The most memory this process can hold, in bytes: RAM and swap together, or
// less where a cgroup caps the RAM (v2: memory.max, v1: memory.limit_in_bytes,
// as /sys/fs/cgroup shows them; "max" caps nothing); 0 where the system does
// not say (not Linux: no check).
static double process_memory_bytes() {
#ifdef __linux__
  struct sysinfo si;
  if (sysinfo(&si) != 0) return 0.0;
  const double swap = double(si.totalswap) * double(si.mem_unit);
  double limit = double(si.totalram) * double(si.mem_unit) + swap;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      unsigned long long cap = 0;
      if (std::fscanf(f, "%llu", &cap) == 1) limit = std::min(limit, double(cap) + swap);
      std::fclose(f);
    }
  }
  return limit;
#else
  return 0.0;
#endif
}

static std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(int64_t(1) << 30));
  return buf;
}

void check_fits_in_memory(const char* what, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return;
  double bytes = double(options.dtype().itemsize());
  for (int64_t n : sizes) bytes *= double(n);
  static const double limit = process_memory_bytes();  // read once: no system call per op call
  TORCH_CHECK(limit == 0.0 || bytes <= limit, what, " of shape ", format_shape(sizes), " (",
              dtype_name(options.dtype().toScalarType()), ") needs ", gib(bytes),
              ", more than this process can hold (", gib(limit), ": RAM and swap, within its cgroup's limit)");
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

namespace {

std::string format_float(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// query, key and value: a supported float type, `dims_ok` (else `dims_want`),
// and (key, value) query's dtype and device. Returns whether t is not query.
bool check_qkv_common(const char* name, const at::Tensor& t, const at::Tensor& query, bool dims_ok,
                      const char* dims_want) {
  TORCH_CHECK(is_supported_float(t.scalar_type()), name,
              " must be a floating-point tensor (float64, float32, float16 or bfloat16), got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(dims_ok, name, " must have ", dims_want, ", got shape ", format_shape(t.sizes()));
  if (&t == &query) return false;
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), name, " must have the same dtype as query (",
              dtype_name(query.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == query.device(), name, " must be on the same device as query (",
              query.device().str(), "), got ", t.device().str());
  return true;
}

void check_qkv_tensor(const char* name, const at::Tensor& t, const at::Tensor& query) {
  if (!check_qkv_common(name, t, query, t.dim() >= 3, "at least 3 dims (..., heads, seq_len, head_dim)")) return;
  TORCH_CHECK(t.dim() == query.dim(), name, " must have the same number of dims as query (",
              query.dim(), "), got ", t.dim());
  const auto qb = query.sizes().slice(0, query.dim() - 3);
  const auto tb = t.sizes().slice(0, t.dim() - 3);
  TORCH_CHECK(qb == tb, name, " batch dims must equal query's ", format_shape(qb), ", got ",
              format_shape(tb));
}

}  // namespace

AttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value,
                                      const std::optional<at::Tensor>& attn_mask,
                                      double dropout_p, bool enable_gqa) {
  check_qkv_tensor("query", query, query);
  check_qkv_tensor("key", key, query);
  check_qkv_tensor("value", value, query);

  AttentionShape s;
  const int64_t nd = query.dim();
  s.batch_sizes = query.sizes().slice(0, nd - 3).vec();
  for (int64_t b : s.batch_sizes) s.batch *= b;
  s.heads_q = query.size(-3);
  s.len_q = query.size(-2);
  s.head_dim = query.size(-1);
  s.heads_kv = key.size(-3);
  s.len_kv = key.size(-2);
  s.head_dim_v = value.size(-1);

  TORCH_CHECK(key.size(-1) == s.head_dim, "key must have the same head_dim as query (", s.head_dim,
              "), got ", key.size(-1));
  TORCH_CHECK(value.size(-3) == s.heads_kv, "value must have the same number of heads as key (",
              s.heads_kv, "), got ", value.size(-3));
  TORCH_CHECK(value.size(-2) == s.len_kv, "value must have the same seq_len as key (", s.len_kv,
              "), got ", value.size(-2));
  if (enable_gqa) {
    TORCH_CHECK(s.heads_q == s.heads_kv || (s.heads_kv > 0 && s.heads_q % s.heads_kv == 0), "query heads (", s.heads_q,
                ") must be a multiple of key/value heads (", s.heads_kv, ") with enable_gqa=True");
  } else {
    TORCH_CHECK(s.heads_kv == s.heads_q, "key must have the same number of heads as query (",
                s.heads_q, ") unless enable_gqa=True, got ", s.heads_kv);
  }

  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == query.scalar_type(),
                "attn_mask must be bool or query's dtype (", dtype_name(query.scalar_type()),
                "), got ", dtype_name(m.scalar_type()));
    TORCH_CHECK(m.device() == query.device(), "attn_mask must be on the same device as query (",
                query.device().str(), "), got ", m.device().str());
    std::vector<int64_t> target = s.batch_sizes;
    target.insert(target.end(), {s.heads_q, s.len_q, s.len_kv});
    bool ok = m.dim() <= static_cast<int64_t>(target.size());
    for (int64_t i = 1; ok && i <= m.dim(); ++i) {
      const int64_t ms = m.size(-i), ts = target[target.size() - i];
      ok = ms == ts || ms == 1;
    }
    TORCH_CHECK(ok, "attn_mask must broadcast to (N..., Hq, L, S) = ", format_shape(target),
                ", got ", format_shape(m.sizes()));
  }
  check_dropout_p(dropout_p);
  return s;
}

namespace {

void check_packed(const char* name, const at::Tensor& t, const at::Tensor& query) {
  check_qkv_common(name, t, query, t.dim() == 3, "3 dims (total_seqlen, heads, head_dim)");
}

// Checks the values of cu_seqlens (see check_varlen_inputs); returns the
// longest sequence.
int64_t check_cu_seqlens(const char* name, const at::Tensor& cu, int64_t total, const char* max_name,
                         int64_t max_seqlen) {
  const at::Tensor host = cu.device().is_cpu() ? cu.contiguous() : cu.to(at::kCPU);
  const int32_t* c = host.const_data_ptr<int32_t>();
  const int64_t n = host.numel();
  TORCH_CHECK(c[0] == 0, name, "[0] must be 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t b = 0; b + 1 < n; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], name, " must not decrease, got ", name, "[", b, "] = ", c[b], " > ", name, "[",
                b + 1, "] = ", c[b + 1]);
    longest = std::max<int64_t>(longest, c[b + 1] - c[b]);
  }
  TORCH_CHECK(c[n - 1] == total, name, "[-1] must equal the packed length ", total, ", got ", c[n - 1]);
  TORCH_CHECK(longest <= max_seqlen, max_name, " must be at least the longest sequence (", longest, "), got ",
              max_seqlen);
  return longest;
}

}  // namespace

VarlenShape check_varlen_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p) {
  check_packed("query", query, query);
  check_packed("key", key, query);
  check_packed("value", value, query);
  VarlenShape s;
  s.total_q = query.size(0);
  s.heads_q = query.size(1);
  s.head_dim = query.size(2);
  s.total_kv = key.size(0);
  s.heads_kv = key.size(1);
  s.head_dim_v = value.size(2);
  TORCH_CHECK(key.size(2) == s.head_dim, "key must have the same head_dim as query (", s.head_dim, "), got ",
              key.size(2));
  TORCH_CHECK(value.size(0) == s.total_kv && value.size(1) == s.heads_kv,
              "value must have key's (total_seqlen, heads) = (", s.total_kv, ", ", s.heads_kv, "), got (",
              value.size(0), ", ", value.size(1), ")");
  TORCH_CHECK(s.heads_q == s.heads_kv || (s.heads_kv > 0 && s.heads_q % s.heads_kv == 0), "query heads (",
              s.heads_q, ") must be a multiple of key/value heads (", s.heads_kv, ")");
  const at::Tensor* cus[2] = {&cu_seqlens_q, &cu_seqlens_k};
  const char* names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  for (int t = 0; t < 2; ++t) {
    const at::Tensor& c = *cus[t];
    TORCH_CHECK(c.scalar_type() == at::kInt && c.dim() == 1 && c.numel() >= 1, names[t],
                " must be an int32 tensor of shape (batch + 1), got ", dtype_name(c.scalar_type()), " of shape ",
                format_shape(c.sizes()));
    TORCH_CHECK(c.device() == query.device(), names[t], " must be on the same device as query (",
                query.device().str(), "), got ", c.device().str());
  }
  TORCH_CHECK(cu_seqlens_k.numel() == cu_seqlens_q.numel(), "cu_seqlens_k must have cu_seqlens_q's shape (",
              cu_seqlens_q.numel(), "), got (", cu_seqlens_k.numel(), ")");
  TORCH_CHECK(max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  check_dropout_p(dropout_p);
  s.batch = cu_seqlens_q.numel() - 1;
  s.batch_sizes = {s.batch};
  s.len_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, s.total_q, "max_seqlen_q", max_seqlen_q);
  s.len_kv = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, s.total_kv, "max_seqlen_k", max_seqlen_k);
  return s;
}

namespace {

void check_sizes(const char* name, const at::Tensor& t, at::IntArrayRef want, const char* what) {
  TORCH_CHECK(t.sizes() == want, name, " must have shape ", what, " = ", format_shape(want), ", got ",
              format_shape(t.sizes()));
}

}  // namespace

KVCacheShape check_kvcache_inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new,
                                  const std::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value();
  const char* rows =
      paged ? "4 dims (num_blocks, block_size, heads, head_dim)" : "4 dims (batch, max_seqlen, heads, head_dim)";
  check_qkv_common("query", query, query, query.dim() == 4, "4 dims (batch, seqlen, heads, head_dim)");
  check_qkv_common("k_cache", k_cache, query, k_cache.dim() == 4, rows);
  check_qkv_common("v_cache", v_cache, query, v_cache.dim() == 4, rows);
  KVCacheShape s;
  s.batch = query.size(0);
  s.batch_sizes = {s.batch};
  s.len_q = query.size(1);
  s.heads_q = query.size(2);
  s.head_dim = query.size(3);
  s.heads_kv = k_cache.size(2);
  s.head_dim_v = v_cache.size(3);
  if (paged) {
    const at::Tensor& t = *block_table;
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 2 && t.size(0) == s.batch,
                "block_table must be an int32 tensor of shape (B, max_blocks) with B = ", s.batch, ", got ",
                dtype_name(t.scalar_type()), " of shape ", format_shape(t.sizes()));
    TORCH_CHECK(t.device() == query.device(), "block_table must be on the same device as query (",
                query.device().str(), "), got ", t.device().str());
    s.num_blocks = k_cache.size(0);
    s.block_size = k_cache.size(1);
    check_sizes("k_cache", k_cache, {s.num_blocks, s.block_size, s.heads_kv, s.head_dim},
                "(num_blocks, block_size, Hkv, E)");
    check_sizes("v_cache", v_cache, {s.num_blocks, s.block_size, s.heads_kv, s.head_dim_v},
                "(num_blocks, block_size, Hkv, Ev)");
    constexpr int64_t kMultiple = AttentionFwdParams::kKVBlockMultiple;
    TORCH_CHECK(s.block_size > 0 && s.block_size % kMultiple == 0,
                "with a block_table, the cache blocks (k_cache dim 1) must hold a multiple of ", kMultiple,
                " rows, got ", s.block_size);
    s.len_cache = t.size(1) * s.block_size;
  } else {
    s.len_cache = k_cache.size(1);
    check_sizes("k_cache", k_cache, {s.batch, s.len_cache, s.heads_kv, s.head_dim}, "(B, S_max, Hkv, E)");
    check_sizes("v_cache", v_cache, {s.batch, s.len_cache, s.heads_kv, s.head_dim_v}, "(B, S_max, Hkv, Ev)");
  }
  TORCH_CHECK(s.heads_q == s.heads_kv || (s.heads_kv > 0 && s.heads_q % s.heads_kv == 0), "query heads (",
              s.heads_q, ") must be a multiple of key/value heads (", s.heads_kv, ")");
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && cache_seqlens.dim() == 1 &&
                  cache_seqlens.size(0) == s.batch,
              "cache_seqlens must be an int32 tensor of shape (B) = (", s.batch, "), got ",
              dtype_name(cache_seqlens.scalar_type()), " of shape ", format_shape(cache_seqlens.sizes()));
  TORCH_CHECK(cache_seqlens.device() == query.device(), "cache_seqlens must be on the same device as query (",
              query.device().str(), "), got ", cache_seqlens.device().str());
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "k_new and v_new must be given together, got ",
              k_new.has_value() ? "k_new only" : "v_new only");
  if (k_new.has_value()) {
    check_qkv_common("k_new", *k_new, query, k_new->dim() == 4, "4 dims (batch, seqlen, heads, head_dim)");
    check_qkv_common("v_new", *v_new, query, v_new->dim() == 4, "4 dims (batch, seqlen, heads, head_dim)");
    s.len_new = k_new->size(1);
    check_sizes("k_new", *k_new, {s.batch, s.len_new, s.heads_kv, s.head_dim}, "(B, L_new, Hkv, E)");
    check_sizes("v_new", *v_new, {s.batch, s.len_new, s.heads_kv, s.head_dim_v}, "(B, L_new, Hkv, Ev)");
  }
  const at::Tensor host = cache_seqlens.device().is_cpu() ? cache_seqlens.contiguous() : cache_seqlens.to(at::kCPU);
  const int32_t* c = host.const_data_ptr<int32_t>();
  s.len_kv = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(c[b] >= 0 && c[b] + s.len_new <= s.len_cache, "cache_seqlens[", b, "] must be in [0, ",
                s.len_cache - s.len_new, "] (S_max = ", s.len_cache, paged ? " (max_blocks x block_size)" : "",
                " minus ", s.len_new, " new keys), got ", c[b]);
    s.len_kv = std::max<int64_t>(s.len_kv, c[b] + s.len_new);
  }
  if (paged) {  // the blocks a batch reads or writes must be in the pool
    const at::Tensor table = block_table->device().is_cpu() ? block_table->contiguous() : block_table->to(at::kCPU);
    const int32_t* t = table.const_data_ptr<int32_t>();
    const int64_t width = table.size(1);
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i * s.block_size < c[b] + s.len_new; ++i)
        TORCH_CHECK(t[b * width + i] >= 0 && t[b * width + i] < s.num_blocks, "block_table[", b, ", ", i,
                    "] must be in [0, num_blocks) = [0, ", s.num_blocks, "), got ", t[b * width + i]);
  }
  return s;
}

void check_variant(const AttentionShape& s, const at::Tensor& query, int64_t window_left, int64_t window_right,
                   double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(window_left >= -1, "window_left must be >= -1 (-1: no limit), got ", window_left);
  TORCH_CHECK(window_right >= -1, "window_right must be >= -1 (-1: no limit), got ", window_right);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, "softcap must be a finite number >= 0 (0: none), got ",
              format_float(softcap));
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    std::vector<int64_t> full = s.batch_sizes;
    full.push_back(s.heads_q);
    const bool shape_ok = a.sizes() == at::IntArrayRef{s.heads_q} || a.sizes() == at::IntArrayRef(full);
    TORCH_CHECK(a.is_floating_point() && shape_ok, "alibi_slopes must be a floating-point tensor of shape (Hq) = (",
                s.heads_q, ") or (N..., Hq) = ", format_shape(full), ", got ", dtype_name(a.scalar_type()),
                " of shape ", format_shape(a.sizes()));
    TORCH_CHECK(a.device() == query.device(), "alibi_slopes must be on the same device as query (",
                query.device().str(), "), got ", a.device().str());
  }
}

void check_dropout_p(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ",
              format_float(dropout_p));
}

void check_rng_state(const at::Tensor& r, const at::Device& query_device, int64_t frame_len_q) {
  const bool placed = r.device().is_cpu() || r.device() == query_device;
  const bool framed = frame_len_q >= 0 && r.numel() == 5;
  TORCH_CHECK(r.scalar_type() == at::kLong && (r.numel() == 2 || framed) && r.dim() == 1 && placed,
              "rng_state must be an int64 tensor of shape (2) holding (seed, offset)",
              frame_len_q >= 0 ? " or of shape (5) holding (seed, offset, rows, row0, col0)" : "", " ",
              query_device.is_cpu() ? std::string("on the CPU")
                                    : "on the CPU or on query's device (" + query_device.str() + ")",
              ", got ", dtype_name(r.scalar_type()), " of shape ", format_shape(r.sizes()), " on ",
              r.device().str());
  if (!framed || !r.device().is_cpu()) return;
  const at::Tensor c = r.contiguous();
  const int64_t* f = c.const_data_ptr<int64_t>() + 2;
  TORCH_CHECK(f[1] >= 0 && f[2] >= 0 && f[0] >= f[1] + frame_len_q,
              "rng_state's dropout frame (rows, row0, col0) must have row0 >= 0, col0 >= 0 and rows >= row0 + ",
              frame_len_q, " (the query length), got (", f[0], ", ", f[1], ", ", f[2], ")");
}

void check_compute_capability(int major, int minor, const std::string& gpu) {
  TORCH_CHECK(major >= 8, "mha_ext's CUDA kernels need a GPU of compute capability 8.0 (sm_80) or newer; ", gpu,
              " has compute capability ", major, ".", minor);
}

void check_same_shape(const char* name, const at::Tensor& t, at::IntArrayRef expected,
                      const at::Tensor& like, std::optional<at::ScalarType> dtype) {
  const at::ScalarType want = dtype.value_or(like.scalar_type());
  TORCH_CHECK(t.scalar_type() == want, name, " must have dtype ", dtype_name(want), ", got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == like.device(), name, " must be on the same device as query (",
              like.device().str(), "), got ", t.device().str());
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", format_shape(expected), ", got ",
              format_shape(t.sizes()));
}

}  // namespace mha_ext
