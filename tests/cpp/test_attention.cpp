// C++ tests: the ops called through the dispatcher from a program that links
// libmha_ext (no Python), checked against a reference written with torch's
// C++ ops.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "../../csrc/checks.h"
#include "reference.h"

namespace {

using AttnOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

AttnOut attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask = std::nullopt, double dropout_p = 0.0,
                  bool is_causal = false, std::optional<double> scale = std::nullopt,
                  bool enable_gqa = false, const std::optional<at::Tensor>& rng = std::nullopt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mha_ext::attention", "")
                       .typed<AttnOut(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, double, bool,
                                      std::optional<double>, bool, const std::optional<at::Tensor>&,
                                      int64_t, int64_t, bool, double, const std::optional<at::Tensor>&)>();
  // window_left, window_right, bottom_right, softcap, alibi_slopes: none
  return op.call(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, rng, -1, -1, false, 0.0, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& mask,
    bool is_causal, bool enable_gqa, bool mask_grad) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mha_ext::attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool,
              std::optional<double>, bool, const at::Tensor&, bool, int64_t, int64_t, bool, double,
              const std::optional<at::Tensor>&)>();
  return op.call(g, q, k, v, out, lse, mask, 0.0, is_causal, std::nullopt, enable_gqa,
                 torch::zeros({2}, torch::kLong), mask_grad, -1, -1, false, 0.0, std::nullopt);
}

// softmax(q k^T / sqrt(E) + mask) v in float64; causal is top-left; GQA by repeat.
torch::Tensor reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::optional<torch::Tensor>& mask, bool is_causal) {
  return mha_ext_test::reference(q, k, v, mask, is_causal, 1.0 / std::sqrt(static_cast<double>(q.size(-1))));
}

TEST(Attention, ForwardMatchesReference) {
  torch::manual_seed(0);
  for (bool causal : {false, true}) {
    auto q = torch::randn({2, 4, 37, 16}, torch::kDouble);
    auto k = torch::randn({2, 2, 300, 16}, torch::kDouble);
    auto v = torch::randn({2, 2, 300, 24}, torch::kDouble);
    auto mask = torch::randn({37, 300}, torch::kDouble);
    auto [out, lse, rng] = attention(q, k, v, mask, 0.0, causal, std::nullopt, true);
    EXPECT_TRUE(torch::allclose(out, reference(q, k, v, mask, causal), 1e-10, 1e-10)) << causal;
    EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 4, 37}));
  }
}

TEST(Attention, Float32BoolMaskAndStrides) {
  torch::manual_seed(1);
  auto q = torch::randn({3, 20, 2, 32}).transpose(1, 2);  // (N, H, L, E), non-contiguous
  auto k = torch::randn({3, 2, 45, 32});
  auto v = torch::randn({3, 2, 45, 32});
  auto mask = torch::rand({3, 1, 20, 45}) > 0.3;
  mask.select(-1, 0).fill_(true);
  auto out = std::get<0>(attention(q, k, v, mask));
  EXPECT_TRUE(torch::allclose(out.to(torch::kDouble), reference(q, k, v, mask, false), 1e-5, 1e-5));
}

TEST(Attention, BackwardMatchesAutogradOfReference) {
  torch::manual_seed(2);
  auto q = torch::randn({2, 4, 70, 16}, torch::kDouble).requires_grad_();
  auto k = torch::randn({2, 2, 90, 16}, torch::kDouble).requires_grad_();
  auto v = torch::randn({2, 2, 90, 8}, torch::kDouble).requires_grad_();
  auto mask = torch::randn({1, 4, 70, 90}, torch::kDouble).requires_grad_();
  auto g = torch::randn({2, 4, 70, 8}, torch::kDouble);
  auto ref = reference(q, k, v, mask, true);
  auto want = torch::autograd::grad({ref}, {q, k, v, mask}, {g});
  at::Tensor out, lse, rng;
  {
    torch::NoGradGuard no_grad;
    std::tie(out, lse, rng) = attention(q, k, v, mask, 0.0, true, std::nullopt, true);
  }
  auto [gq, gk, gv, gm] = attention_backward(g, q.detach(), k.detach(), v.detach(), out, lse,
                                             mask.detach(), true, true, true);
  EXPECT_TRUE(torch::allclose(gq, want[0], 1e-9, 1e-9));
  EXPECT_TRUE(torch::allclose(gk, want[1], 1e-9, 1e-9));
  EXPECT_TRUE(torch::allclose(gv, want[2], 1e-9, 1e-9));
  EXPECT_TRUE(torch::allclose(gm, want[3], 1e-9, 1e-9));
}

TEST(Attention, FullyMaskedRowGivesZero) {
  auto q = torch::randn({1, 1, 4, 8});
  auto k = torch::randn({1, 1, 5, 8});
  auto v = torch::randn({1, 1, 5, 8});
  auto mask = torch::ones({4, 5}, torch::kBool);
  mask[2].fill_(false);
  auto [out, lse, rng] = attention(q, k, v, mask);
  EXPECT_TRUE(out[0][0][2].eq(0).all().item<bool>());
  EXPECT_TRUE(std::isinf(lse[0][0][2].item<float>()));
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
}

TEST(Attention, DropoutIsReproducibleFromRngState) {
  auto q = torch::randn({2, 2, 16, 8});
  auto rng = torch::tensor({int64_t(12345), int64_t(6)}, torch::kLong);
  auto a = std::get<0>(attention(q, q, q, std::nullopt, 0.3, false, std::nullopt, false, rng));
  auto b = std::get<0>(attention(q, q, q, std::nullopt, 0.3, false, std::nullopt, false, rng));
  auto none = std::get<0>(attention(q, q, q));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::allclose(a, none));
}

TEST(Attention, ClearErrors) {
  auto q = torch::randn({2, 4, 6, 8});
  auto k = torch::randn({2, 2, 5, 8});
  try {
    attention(q, k, k);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "key must have the same number of heads as query (4) unless enable_gqa=True, got 2");
  }
}

// The CUDA host code asks this of the GPU before any launch: sm_80 and newer
// pass, older GPUs get an error naming them and their capability.
TEST(Attention, ComputeCapabilityCheck) {
  EXPECT_NO_THROW(mha_ext::check_compute_capability(8, 0, "NVIDIA A100-SXM4-80GB"));
  EXPECT_NO_THROW(mha_ext::check_compute_capability(9, 0, "NVIDIA H100 80GB HBM3"));
  EXPECT_NO_THROW(mha_ext::check_compute_capability(12, 0, "a newer GPU"));
  try {
    mha_ext::check_compute_capability(7, 5, "Tesla T4");
    FAIL() << "no error for sm_75";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("mha_ext's CUDA kernels need a GPU of compute capability 8.0 (sm_80) or "
                                         "newer; Tesla T4 has compute capability 7.5"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
