// A sweep of small cases through the dispatcher, for the sanitizer build
// (scripts/sanitize.sh): every dtype, odd lengths, length 1, E != Ev, GQA,
// strided inputs, bool / float / finfo.min-padding masks, causal, dropout, a
// NaN row and huge logits, forward and backward, on the CPU backend
// (mha_ext) and on the CUDA backend compiled for the CPU emulation
// (mha_ext_emul, tests/emul/attention_emul.cpp). Results are checked against a
// float64 reference written with torch's C++ ops (loosely for float16 /
// bfloat16: the Python suite holds those to torch's own error); what the
// sanitizers add is that no case reads or writes out of bounds or overflows.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "reference.h"

namespace {

using Fwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Bwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using OptT = std::optional<at::Tensor>;

// the variant arguments of both ops: window_left, window_right, bottom_right, softcap, alibi_slopes
using FwdSig = Fwd(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, double, bool,
                   std::optional<double>, bool, const OptT&, int64_t, int64_t, bool, double, const OptT&);
using BwdSig = Bwd(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const OptT&, double, bool, std::optional<double>, bool, const at::Tensor&,
                   bool, int64_t, int64_t, bool, double, const OptT&);
struct Ops {
  c10::TypedOperatorHandle<FwdSig> fwd;
  c10::TypedOperatorHandle<BwdSig> bwd;
};

Ops ops_of(const std::string& ns) {
  auto& d = c10::Dispatcher::singleton();
  return {d.findSchemaOrThrow((ns + "::attention").c_str(), "").typed<FwdSig>(),
          d.findSchemaOrThrow((ns + "::attention_backward").c_str(), "").typed<BwdSig>()};
}

at::Tensor keep_mask(const at::Tensor& rng, at::IntArrayRef shape, double p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mha_ext::dropout_mask", "")
                       .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, double)>();
  return op.call(rng, shape, p);
}

double tolerance(at::ScalarType t) {
  return t == torch::kDouble ? 1e-9 : t == torch::kFloat ? 2e-4 : t == torch::kHalf ? 3e-2 : 1e-1;
}

void expect_near(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const double err = (got.to(torch::kDouble) - want).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what;
}

void sweep(const std::string& ns, int max_len) {
  const Ops ops = ops_of(ns);
  torch::manual_seed(0);
  int cases = 0;
  for (auto dtype : {torch::kDouble, torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    for (int c = 0; c < 12; ++c) {
      // shape: (N, Hq, Hkv, L, S, E, Ev) cycling through the awkward ones
      const int64_t N = 1 + c % 2, Hkv = 1 + c % 3 % 2, Hq = Hkv * (c % 4 == 3 ? 2 : 1);
      const int64_t lens[] = {1, 7, 33, max_len};
      const int64_t L = lens[c % 4], S = lens[(c / 2 + 1) % 4], E = c % 3 == 0 ? 8 : 40, Ev = c % 5 == 0 ? 24 : E;
      const bool causal = c % 3 == 1, dropout = c % 4 == 2, strided = c % 2 == 0;
      const int mask_kind = c % 4;  // none, bool, float, finfo.min padding
      const double scale = 1.0 / std::sqrt(static_cast<double>(E));
      auto q = torch::randn({N, Hq, L, E}, torch::kDouble);
      auto k = torch::randn({N, Hkv, S, E}, torch::kDouble);
      auto v = torch::randn({N, Hkv, S, Ev}, torch::kDouble);
      if (c == 5) q = q * 1e3;                       // huge logits
      if (strided) q = q.transpose(-1, -2).contiguous().transpose(-1, -2);
      q = q.to(dtype), k = k.to(dtype), v = v.to(dtype);
      OptT mask;
      if (mask_kind == 1) {
        auto m = torch::rand({N, 1, L, S}) > 0.3;
        m.select(-1, 0).fill_(true);  // every row sees a key (the reference would give NaN)
        mask = m;
      } else if (mask_kind == 2) {
        mask = torch::randn({L, S}, torch::kDouble).to(dtype);
      } else if (mask_kind == 3) {
        const double lo = dtype == torch::kHalf ? -65504.0 : -3.0e38;  // about finfo.min
        auto m = torch::zeros({N, 1, L, S}, torch::kDouble);
        m.narrow(-1, 0, (S + 1) / 2).fill_(lo);             // padding on half the keys
        m.select(0, N - 1).narrow(-2, 0, 1).fill_(lo);      // and a row that sees only padding
        mask = m.to(dtype);
      }
      const double p = dropout ? 0.25 : 0.0;
      auto rng = torch::tensor({int64_t(1000 + c), int64_t(7)}, torch::kLong);
      OptT keep;
      if (dropout) keep = keep_mask(rng, {N, Hq, L, S}, p);
      const bool gqa = Hq != Hkv;
      // the variants, on every other case: bottom-right alignment, windows, softcap, ALiBi
      mha_ext_test::Variant w;
      if (c % 2 == 1) {
        w.bottom_right = true;
        w.left = c % 4 == 1 ? 5 : -1;
        w.right = c % 3 == 0 ? 2 : -1;
        w.softcap = c == 7 ? 2.5 : 0.0;
        if (c == 9 || c == 11) w.alibi = torch::rand({Hq}) * 0.5;
      }
      auto [out, lse, rng_used] = ops.fwd.call(q, k, v, mask, p, causal, scale, gqa, rng, w.left, w.right,
                                               w.bottom_right, w.softcap, w.alibi);
      const std::string what = ns + " dtype " + std::string(c10::toString(dtype)) + " case " + std::to_string(c);
      // the reference in float64 with autograd, from the dtype's values
      auto qr = q.to(torch::kDouble).requires_grad_(), kr = k.to(torch::kDouble).requires_grad_(),
           vr = v.to(torch::kDouble).requires_grad_();
      auto ref = mha_ext_test::reference(qr, kr, vr, mask, causal, scale, keep, p, w);
      expect_near(out, ref.detach(), tolerance(dtype), what + " out");
      auto g = torch::randn(out.sizes(), torch::kDouble);
      auto want = torch::autograd::grad({ref}, {qr, kr, vr}, {g});
      auto [gq, gk, gv, gm] = ops.bwd.call(g.to(dtype), q, k, v, out, lse, mask, p, causal, scale, gqa, rng_used,
                                           false, w.left, w.right, w.bottom_right, w.softcap, w.alibi);
      // huge logits (case 5): dq and dk are rounding-level (their error is an
      // epsilon of the logits), so finite is what is asked of them
      const double logit_tol = c == 5 ? 1e3 : 1.0;
      expect_near(gq, want[0], tolerance(dtype) * logit_tol, what + " dq");
      expect_near(gk, want[1], tolerance(dtype) * logit_tol, what + " dk");
      expect_near(gv, want[2], tolerance(dtype), what + " dv");
      EXPECT_TRUE(torch::isfinite(gq).all().item<bool>() && torch::isfinite(gk).all().item<bool>()) << what;
      ++cases;
    }
    // a NaN in one query row stays in that row
    auto q = torch::randn({1, 2, 9, 16}).to(dtype), k = torch::randn({1, 2, 11, 16}).to(dtype);
    q[0][1][4][3] = NAN;
    auto out = std::get<0>(
        ops.fwd.call(q, k, k, std::nullopt, 0.0, false, std::nullopt, false, std::nullopt, -1, -1, false, 0.0, std::nullopt));
    auto nan_rows = torch::isnan(out).any(-1);
    EXPECT_EQ(nan_rows.sum().item<int64_t>(), 1) << ns;
    EXPECT_TRUE(nan_rows[0][1][4].item<bool>()) << ns;
  }
  EXPECT_EQ(cases, 48);
}

TEST(Sweep, CpuBackend) { sweep("mha_ext", 70); }

TEST(Sweep, CudaBackendUnderEmulation) { sweep("mha_ext_emul", 40); }

}  // namespace
