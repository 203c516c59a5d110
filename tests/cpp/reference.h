// The float64 reference of the C++ tests, written with torch's C++ ops.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <optional>

namespace mha_ext_test {

// softmax(q k^T * scale + mask) v in float64 with SDPA semantics (top-left
// causal, GQA by repeat, an optional dropout keep-mask scaled by 1 / (1 - p)).
inline at::Tensor reference(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                            bool causal, double scale, const std::optional<at::Tensor>& keep = std::nullopt,
                            double p = 0.0) {
  q = q.to(torch::kDouble);
  k = k.to(torch::kDouble);
  v = v.to(torch::kDouble);
  const int64_t group = q.size(-3) / k.size(-3);
  if (group > 1) {
    k = k.repeat_interleave(group, -3);
    v = v.repeat_interleave(group, -3);
  }
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (mask) s = mask->scalar_type() == torch::kBool ? s.masked_fill(mask->logical_not(), -INFINITY)
                                                     : s + mask->to(torch::kDouble);
  if (causal)
    s = s.masked_fill(torch::ones({q.size(-2), k.size(-2)}, torch::kBool).tril().logical_not(), -INFINITY);
  auto prob = torch::softmax(s, -1);
  if (keep) prob = prob * keep->to(torch::kDouble) / (1.0 - p);
  return torch::matmul(prob, v);
}

}  // namespace mha_ext_test
