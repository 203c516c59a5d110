// The float64 reference of the C++ tests, written with torch's C++ ops.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <optional>

namespace mha_ext_test {

// The attention variants (see AttentionVariant): row i's diagonal key is
// i + offset (0 top-left, S - L bottom-right); causal hides keys beyond it,
// a window (left, right) keeps diagonal - left .. diagonal + right (-1: no
// bound); softcap > 0 caps the scaled scores; ALiBi slopes (Hq) subtract
// slope * |diagonal - j|.
struct Variant {
  bool bottom_right = false;
  int64_t left = -1, right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi;
};

// softmax(q k^T * scale + mask) v in float64 with SDPA semantics (top-left
// causal unless the variant says otherwise, GQA by repeat, an optional
// dropout keep-mask scaled by 1 / (1 - p)).
inline at::Tensor reference(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                            bool causal, double scale, const std::optional<at::Tensor>& keep = std::nullopt,
                            double p = 0.0, const Variant& w = {}) {
  q = q.to(torch::kDouble);
  k = k.to(torch::kDouble);
  v = v.to(torch::kDouble);
  const int64_t group = q.size(-3) / k.size(-3);
  if (group > 1) {
    k = k.repeat_interleave(group, -3);
    v = v.repeat_interleave(group, -3);
  }
  const int64_t L = q.size(-2), S = k.size(-2);
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (w.softcap > 0) s = w.softcap * torch::tanh(s / w.softcap);
  const auto diag = torch::arange(L, torch::kLong).unsqueeze(-1) + (w.bottom_right ? S - L : 0);
  const auto col = torch::arange(S, torch::kLong);
  if (w.alibi) s = s - w.alibi->to(torch::kDouble).view({-1, 1, 1}) * (diag - col).abs().to(torch::kDouble);
  if (mask) s = mask->scalar_type() == torch::kBool ? s.masked_fill(mask->logical_not(), -INFINITY)
                                                     : s + mask->to(torch::kDouble);
  auto hidden = torch::zeros({L, S}, torch::kBool);
  const int64_t right = causal ? (w.right < 0 ? 0 : std::min<int64_t>(w.right, 0)) : w.right;
  if (right >= 0) hidden = hidden.logical_or(col > diag + right);
  if (w.left >= 0) hidden = hidden.logical_or(col < diag - w.left);
  s = s.masked_fill(hidden, -INFINITY);
  // a row that may see no key gives 0 (as the ops define it)
  const auto any_key = s.isinf().logical_and(s < 0).logical_not().any(-1, true);
  auto prob = torch::where(any_key, torch::softmax(torch::where(any_key, s, torch::zeros_like(s)), -1),
                           torch::zeros_like(s));
  if (keep) prob = prob * keep->to(torch::kDouble) / (1.0 - p);
  return torch::matmul(prob, v);
}

}  // namespace mha_ext_test
