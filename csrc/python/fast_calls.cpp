// The Python module mha_ext._C: calls of the attention and KV-cache ops that
// skip torch.ops's argument boxing.
//
// From Python, torch.ops.mha_ext.attention converts its 14 arguments to
// IValues by the schema, looks for __torch_function__ on each, and wraps the
// three returned tensors; with the autograd kernel skipped that costs about as
// much as the op itself on a decode step of a small model. These functions
// take the common call (plain tensors, no torch function mode, grad off or no
// input requiring grad) and make the same dispatcher call from C++ below the
// autograd key, the choice torch's autograd kernel of a custom op makes in
// that case. Anything else returns None and the caller goes through torch.ops
// as before. The KV-cache op (forward only) is called through the same
// dispatch keys as from torch.ops. Built by setup.py only: the LibTorch library (CMakeLists.txt)
// has no Python in it.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/wrap_outputs.h>

#include <Python.h>

#include <optional>
#include <tuple>

namespace mha_ext {
namespace {

using AttentionFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool,
    std::optional<double>, bool, const std::optional<at::Tensor>&, int64_t, int64_t, bool, double,
    const std::optional<at::Tensor>&);

// The 14 arguments of the attention schema (csrc/schema.h), in its order.
struct AttentionArgs {
  at::Tensor query, key, value;
  std::optional<at::Tensor> attn_mask;
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;
  std::optional<at::Tensor> rng_state;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right = false;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
};

// A torch.Tensor (or nn.Parameter) itself, no subclass: no __torch_function__
// of its own (modes are checked once per call).
bool plain_tensor(PyObject* o, at::Tensor& t) {
  if (!THPVariable_CheckExact(o)) return false;
  t = THPVariable_Unpack(o);
  return !t.is_nested();  // (nested tensors of the strided layout: the Python path's clear error)
}

bool optional_tensor(PyObject* o, std::optional<at::Tensor>& t) {
  if (o == Py_None) return true;
  at::Tensor x;
  if (!plain_tensor(o, x)) return false;
  t = std::move(x);
  return true;
}

bool exact_float(PyObject* o, double& x) {
  if (!PyFloat_CheckExact(o)) return false;
  x = PyFloat_AS_DOUBLE(o);
  return true;
}

bool optional_float(PyObject* o, std::optional<double>& x) {
  if (o == Py_None) return true;
  double v = 0.0;
  if (!exact_float(o, v)) return false;
  x = v;
  return true;
}

bool exact_bool(PyObject* o, bool& x) {
  if (!PyBool_Check(o)) return false;
  x = o == Py_True;
  return true;
}

bool exact_int(PyObject* o, int64_t& x) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  x = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(x == -1 && PyErr_Occurred());
}

bool needs_autograd(const AttentionArgs& a) {
  if (!c10::GradMode::is_enabled()) return false;
  auto req = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); };
  return a.query.requires_grad() || a.key.requires_grad() || a.value.requires_grad() || req(a.attn_mask) ||
         req(a.alibi_slopes);
}

// Releases the GIL for the op's run, as torch.ops does.
struct NoGil {
  PyThreadState* state = PyEval_SaveThread();
  ~NoGil() { PyEval_RestoreThread(state); }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_below_autograd(const AttentionArgs& a) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mha_ext::attention", "").typed<AttentionFn>();
  NoGil no_gil;
  at::AutoDispatchBelowAutograd below;
  return op.call(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale, a.enable_gqa,
                 a.rng_state, a.window_left, a.window_right, a.bottom_right, a.softcap, a.alibi_slopes);
}

// The first n of the schema's arguments into `a` (the rest keep the
// schema's defaults): false where one is of another type than the schema's.
bool parse_attention(PyObject* const* args, Py_ssize_t n, AttentionArgs& a) {
  return n >= 3 && n <= 14 && plain_tensor(args[0], a.query) && plain_tensor(args[1], a.key) &&
         plain_tensor(args[2], a.value) && (n <= 3 || optional_tensor(args[3], a.attn_mask)) &&
         (n <= 4 || exact_float(args[4], a.dropout_p)) && (n <= 5 || exact_bool(args[5], a.is_causal)) &&
         (n <= 6 || optional_float(args[6], a.scale)) && (n <= 7 || exact_bool(args[7], a.enable_gqa)) &&
         (n <= 8 || optional_tensor(args[8], a.rng_state)) && (n <= 9 || exact_int(args[9], a.window_left)) &&
         (n <= 10 || exact_int(args[10], a.window_right)) && (n <= 11 || exact_bool(args[11], a.bottom_right)) &&
         (n <= 12 || exact_float(args[12], a.softcap)) && (n <= 13 || optional_tensor(args[13], a.alibi_slopes));
}

// attention(query, key, value[, attn_mask, dropout_p, is_causal, scale,
// enable_gqa, rng_state, window_left, window_right, bottom_right, softcap,
// alibi_slopes]), positional, the schema's defaults for those left out:
// (out, logsumexp, rng_state) as the op returns them, or None where the call
// must go through torch.ops (another argument type, a tensor subclass, a
// torch function mode, or autograd to record).
PyObject* attention(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  AttentionArgs a;
  const bool ok = parse_attention(args, n, a);
  if (!ok || at::impl::torch_function_mode_enabled() || needs_autograd(a)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return torch::autograd::utils::wrap(call_below_autograd(a));
  END_HANDLE_TH_ERRORS
}

// scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
// is_causal, scale, enable_gqa), all eight positional: the output, or None
// where mha_ext.scaled_dot_product_attention has more to do than call the op
// (what `attention` declines, dropout, or shapes it broadcasts first: the
// condition of ops._broadcast_inputs for the op's own shapes).
PyObject* sdpa(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  AttentionArgs a;
  bool ok = n == 8 && parse_attention(args, n, a) && a.dropout_p == 0.0;
  if (ok) {
    const int64_t d = a.query.dim();
    ok = d >= 3 && a.key.dim() == d && a.value.dim() == d;
    for (int64_t i = 0; ok && i < d - 3; ++i)
      ok = a.key.size(i) == a.query.size(i) && a.value.size(i) == a.query.size(i);
    if (ok) {
      const int64_t hq = a.query.size(-3), hk = a.key.size(-3);
      ok = hq == hk || (a.enable_gqa && hk > 0 && hq % hk == 0) || hk != a.value.size(-3);
    }
  }
  if (!ok || at::impl::torch_function_mode_enabled() || needs_autograd(a)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(std::get<0>(call_below_autograd(a)));
  END_HANDLE_TH_ERRORS
}

using KVCacheFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, std::optional<double>, bool, int64_t, int64_t, double,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

// kvcache_attention(query, k_cache, v_cache, cache_seqlens, k_new, v_new,
// scale, is_causal, window_left, window_right, softcap, alibi_slopes,
// block_table), all 13 positional: (out, logsumexp), or None where the call
// must go through torch.ops (another argument type, a tensor subclass, a
// torch function mode). The op has no autograd formula, so the call goes
// through every dispatch key torch.ops's does (autograd's fallback for such
// ops, the in-place bookkeeping of the caches), only without the boxing.
PyObject* kvcache_attention(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  at::Tensor query, k_cache, v_cache, cache_seqlens;
  std::optional<at::Tensor> k_new, v_new, alibi_slopes, block_table;
  std::optional<double> scale;
  bool is_causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  const bool ok = n == 13 && plain_tensor(args[0], query) && plain_tensor(args[1], k_cache) &&
                  plain_tensor(args[2], v_cache) && plain_tensor(args[3], cache_seqlens) &&
                  optional_tensor(args[4], k_new) && optional_tensor(args[5], v_new) &&
                  optional_float(args[6], scale) && exact_bool(args[7], is_causal) &&
                  exact_int(args[8], window_left) && exact_int(args[9], window_right) &&
                  exact_float(args[10], softcap) && optional_tensor(args[11], alibi_slopes) &&
                  optional_tensor(args[12], block_table);
  if (!ok || at::impl::torch_function_mode_enabled()) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mha_ext::kvcache_attention", "").typed<KVCacheFn>();
  std::tuple<at::Tensor, at::Tensor> res;
  {
    NoGil no_gil;
    res = op.call(query, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, is_causal, window_left, window_right,
                  softcap, alibi_slopes, block_table);
  }
  return torch::autograd::utils::wrap(std::move(res));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(attention)), METH_FASTCALL,
     "The attention op below autograd, or None where torch.ops must take the call."},
    {"sdpa", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sdpa)), METH_FASTCALL,
     "scaled_dot_product_attention's common call, or None."},
    {"kvcache_attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(kvcache_attention)),
     METH_FASTCALL, "The kvcache_attention op, or None where torch.ops must take the call."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "Fast calls of the mha_ext ops.", -1, methods};

}  // namespace
}  // namespace mha_ext

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&mha_ext::module_def); }
