// headmix's routers as one operation forward and one backward each (CPU), built on first use by
// headmix/kernels/cpp_build.py beside grouped_gemm.cpp; the Python side is headmix/kernels/fused_router.py, which
// states the equations.
//
// 1. softmax_topk_route: a softmax top-k router with its auxiliary losses (MoA eq. 7-9 and 13-17, grouped as
//    GQE's and MoH's per-group routers).
//
// Forward, on logits z (N, G*M) of G routers of M experts each, per token t and router g:
//   p = softmax(z_g)                                  (at::softmax: the reference's values bit for bit)
//   index, top_p = TopK(p, k)                         (topk_rows: at::topk's choice, ties included)
//   gates = c * top_p / S  (renorm 1, 2) or c * top_p (renorm 0),  S = sum of top_p; renorm 3 (live, total):
//           S = the sum of the token's top_p over all G routers (GQE's weighted slot, differentiated)
// and over the real tokens (mask), T of them (at least 1):
//   count_e = real slots routed to e,  mass_e = sum_t p_{t,e}
//   L_a = M / (G K T^2) sum_e count_e mass_e          (K = k, or 1 for per-token fractions)
//   L_z = (1/T) sum_t lse_t^2                         (G = 1 only; lse = logsumexp(z_t))
//   total = w_a L_a + w_z L_z
// Backward, per row (rows independent, parallel): dp = grad_probs + [real] (g_a M count / (G K T^2)) + the gates'
// gradient scattered to the selected experts, then the softmax's Jacobian, plus [real] p (2 g_z lse / T).
//
// 2. sigmoid_topk_route: SwitchHead's selectors (below).
// 3. moh_route: MoH's whole head weighting (eq. 5-6: routed heads by 1., the shared/routed split and the shared
//    heads' softmax) from the logits of one GEMM, forward and backward each one operation (below).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kNone = 0, kDetached = 1, kLive = 2, kLiveTotal = 3;

// The real-token mask as bools, or nullptr where every token is real; `keep` holds the converted tensor.
const bool* real_tokens(const c10::optional<at::Tensor>& token_mask, at::Tensor& keep) {
  if (!token_mask.has_value() || !token_mask->defined()) return nullptr;
  keep = token_mask->to(at::kBool).contiguous();
  return keep.data_ptr<bool>();
}

double scalar_or_zero(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->item<double>() : 0.0;
}

// rank[e] = how many of x[0..m) are larger than x[e] (no branch on the data: the loop vectorizes).  Equal values
// share a rank; a NaN is larger than nothing and nothing is larger than it, so it shares rank 0 with the largest.
template <typename scalar_t>
void rank_row(const scalar_t* __restrict x, int64_t m, int32_t* __restrict rank) {
  for (int64_t e = 0; e < m; ++e) {
    const scalar_t value = x[e];
    int32_t larger = 0;
    for (int64_t j = 0; j < m; ++j) larger += static_cast<int32_t>(x[j] > value);
    rank[e] = larger;
  }
}

// at::topk(values, k, -1) (the k largest, sorted) of an (R, M) matrix, the same values and indices on every row.
// Where each of the ranks 0..k-1 (rank_row) is held by one value, the choice and its order are unique and read off
// the ranks.  Two values sharing one of those ranks (a tie among the k largest or at the k-th, or a NaN) make
// at::topk's own order count (not by index: all-zero logits choose 10, 11, 12, 9 of 16), so those rows are handed
// to at::topk itself.  Rows of 16, 2048 of them, one thread: about 0.1 us a row here against at::topk's 0.24.
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& values, int64_t k) {
  TORCH_CHECK(values.dim() == 2 && k >= 1 && k <= values.size(1), "topk_rows: (R, M) values and 1 <= k <= M expected");
  const at::Tensor v = values.contiguous();
  const int64_t rows = v.size(0), m = v.size(1);
  at::Tensor top = at::empty({rows, k}, v.options());
  at::Tensor index = at::empty({rows, k}, v.options().dtype(at::kLong));
  std::vector<uint8_t> tied(rows, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "topk_rows", [&] {
    const scalar_t* x_all = v.data_ptr<scalar_t>();
    scalar_t* top_all = top.data_ptr<scalar_t>();
    int64_t* index_all = index.data_ptr<int64_t>();
    at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
      std::vector<int32_t> rank(m);
      std::vector<int64_t> at_rank(k);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* x = x_all + r * m;
        rank_row(x, m, rank.data());
        bool unique = true;
        std::fill(at_rank.begin(), at_rank.end(), int64_t(-1));
        for (int64_t e = 0; e < m && unique; ++e) {
          if (rank[e] >= k) continue;
          if (at_rank[rank[e]] >= 0) unique = false;
          at_rank[rank[e]] = e;
        }
        if (!unique) {
          tied[r] = 1;
          continue;
        }
        for (int64_t j = 0; j < k; ++j) {
          top_all[r * k + j] = x[at_rank[j]];
          index_all[r * k + j] = at_rank[j];
        }
      }
    });
  });
  std::vector<int64_t> rows_tied;
  for (int64_t r = 0; r < rows; ++r)
    if (tied[r]) rows_tied.push_back(r);
  if (!rows_tied.empty()) {
    const at::Tensor which = at::tensor(rows_tied, v.options().dtype(at::kLong));
    auto [tied_top, tied_index] = at::topk(v.index_select(0, which), k, -1);
    top.index_copy_(0, which, tied_top);
    index.index_copy_(0, which, tied_index);
  }
  return {top, index};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
softmax_topk_route(const at::Tensor& logits, const c10::optional<at::Tensor>& token_mask, int64_t groups, int64_t top_k,
                   int64_t renorm, double scale, double lb_weight, double z_weight, bool per_token, bool z_loss) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) % groups == 0, "softmax_topk_route: logits (N, G*M) expected");
  TORCH_CHECK(!z_loss || groups == 1, "softmax_topk_route: the z-loss is defined for one router group");
  const int64_t n = logits.size(0), experts = logits.size(1), per = experts / groups, k = top_k;
  const at::Tensor grouped = logits.contiguous().view({n, groups, per});
  const at::Tensor probs = at::softmax(grouped, -1).contiguous();
  auto [top_p, index] = topk_rows(probs.view({n * groups, per}), k);
  top_p = top_p.view({n, groups, k});
  index = index.view({n, groups, k});
  at::Tensor lse = z_loss ? at::logsumexp(logits, {-1}).contiguous() : at::empty({0}, logits.options());
  at::Tensor gates = at::empty_like(top_p);
  at::Tensor scaled_counts = at::zeros({experts}, logits.options());
  at::Tensor tokens_t = at::empty({}, logits.options());
  at::Tensor total = at::empty({}, logits.options()), la = at::empty({}, logits.options()),
             lz = at::empty({}, logits.options());
  at::Tensor mask;
  const bool* real = real_tokens(token_mask, mask);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "softmax_topk_route", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p = probs.data_ptr<scalar_t>();
    const scalar_t* tp = top_p.data_ptr<scalar_t>();
    const int64_t* idx = index.data_ptr<int64_t>();
    scalar_t* g = gates.data_ptr<scalar_t>();
    at::parallel_for(0, n * groups, 256, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        acc_t denominator = 1;
        if (renorm != kNone) {  // this router's selected probabilities, or (kLiveTotal) every router's of the token
          const int64_t first = renorm == kLiveTotal ? (r / groups) * groups * k : r * k;
          const int64_t count = renorm == kLiveTotal ? groups * k : k;
          acc_t sum = 0;
          for (int64_t j = 0; j < count; ++j) sum += tp[first + j];
          denominator = sum;
        }
        for (int64_t j = 0; j < k; ++j)
          g[r * k + j] = static_cast<scalar_t>(scale * static_cast<acc_t>(tp[r * k + j]) / denominator);
      }
    });
    // the sums over tokens, serially in token order (G*M numbers per token): the same result on every run
    std::vector<double> count(experts, 0.0), mass(experts, 0.0);
    double tokens = 0, lse_squares = 0;
    const scalar_t* l = z_loss ? lse.data_ptr<scalar_t>() : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      if (real && !real[t]) continue;
      tokens += 1;
      for (int64_t e = 0; e < experts; ++e) mass[e] += p[t * experts + e];
      for (int64_t gr = 0; gr < groups; ++gr)
        for (int64_t j = 0; j < k; ++j) count[gr * per + idx[(t * groups + gr) * k + j]] += 1;
      if (l) lse_squares += static_cast<double>(l[t]) * l[t];
    }
    const double t_real = std::max(tokens, 1.0);
    const double factor = static_cast<double>(per) / (groups * (per_token ? 1 : k) * t_real * t_real);
    double la_v = 0;
    scalar_t* sc = scaled_counts.data_ptr<scalar_t>();
    for (int64_t e = 0; e < experts; ++e) {
      sc[e] = static_cast<scalar_t>(count[e] * factor);
      la_v += count[e] * factor * mass[e];
    }
    const double lz_v = lse_squares / t_real;
    la.fill_(la_v);
    lz.fill_(lz_v);
    total.fill_(lb_weight * la_v + z_weight * lz_v);
    tokens_t.fill_(t_real);
  });
  return {probs.view({n, experts}), index, gates, total, la, lz, lse, scaled_counts, tokens_t};
}

at::Tensor softmax_topk_route_backward(const c10::optional<at::Tensor>& grad_probs,
                                       const c10::optional<at::Tensor>& grad_gates,
                                       const c10::optional<at::Tensor>& grad_total,
                                       const c10::optional<at::Tensor>& grad_la,
                                       const c10::optional<at::Tensor>& grad_lz, const at::Tensor& probs,
                                       const at::Tensor& index, const c10::optional<at::Tensor>& token_mask,
                                       const at::Tensor& lse, const at::Tensor& scaled_counts, const at::Tensor& tokens,
                                       int64_t groups, int64_t renorm, double scale, double lb_weight, double z_weight) {
  const int64_t n = probs.size(0), experts = probs.size(1), per = experts / groups, k = index.size(2);
  const double total_grad = scalar_or_zero(grad_total);
  const double g_a = total_grad * lb_weight + scalar_or_zero(grad_la);
  const double g_z = total_grad * z_weight + scalar_or_zero(grad_lz);
  const bool with_lse = lse.numel() == n && n > 0 && g_z != 0.0;
  const double z_factor = with_lse ? 2.0 * g_z / tokens.item<double>() : 0.0;
  at::Tensor grad = at::empty_like(probs);
  at::Tensor gp, gg, mask;
  if (grad_probs.has_value() && grad_probs->defined()) gp = grad_probs->contiguous();
  if (grad_gates.has_value() && grad_gates->defined()) gg = grad_gates->contiguous();
  const bool* real = real_tokens(token_mask, mask);
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "softmax_topk_route_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p_all = probs.data_ptr<scalar_t>();
    const int64_t* idx_all = index.data_ptr<int64_t>();
    const scalar_t* gp_all = gp.defined() ? gp.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gg_all = gg.defined() ? gg.data_ptr<scalar_t>() : nullptr;
    const scalar_t* sc = scaled_counts.data_ptr<scalar_t>();
    const scalar_t* l = with_lse ? lse.data_ptr<scalar_t>() : nullptr;
    scalar_t* out = grad.data_ptr<scalar_t>();
    at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> dp(per);
      for (int64_t t = t0; t < t1; ++t) {
        const bool is_real = !real || real[t];
        // kLiveTotal: the sums over every router of the token (else per router, below)
        acc_t total_sum = 0, total_weighted = 0;
        if (renorm == kLiveTotal && gg_all) {
          for (int64_t gr = 0; gr < groups; ++gr) {
            const scalar_t* p = p_all + t * experts + gr * per;
            const int64_t* idx = idx_all + (t * groups + gr) * k;
            const scalar_t* dg = gg_all + (t * groups + gr) * k;
            for (int64_t j = 0; j < k; ++j) {
              total_sum += p[idx[j]];
              total_weighted += static_cast<acc_t>(dg[j]) * p[idx[j]];
            }
          }
        }
        for (int64_t gr = 0; gr < groups; ++gr) {
          const int64_t base = t * experts + gr * per;
          const scalar_t* p = p_all + base;
          const int64_t* idx = idx_all + (t * groups + gr) * k;
          for (int64_t e = 0; e < per; ++e) {
            acc_t d = gp_all ? static_cast<acc_t>(gp_all[base + e]) : acc_t(0);
            if (is_real && g_a != 0.0) d += static_cast<acc_t>(g_a * sc[gr * per + e]);
            dp[e] = d;
          }
          if (gg_all) {
            const scalar_t* dg = gg_all + (t * groups + gr) * k;
            acc_t sum = 0, weighted = 0;
            for (int64_t j = 0; j < k; ++j) {
              sum += p[idx[j]];
              weighted += static_cast<acc_t>(dg[j]) * p[idx[j]];
            }
            if (renorm == kLiveTotal) sum = total_sum, weighted = total_weighted;
            const acc_t inv = renorm == kNone ? acc_t(1) : acc_t(1) / sum;
            const acc_t live = renorm == kLive || renorm == kLiveTotal ? weighted * inv * inv : acc_t(0);
            for (int64_t j = 0; j < k; ++j)
              dp[idx[j]] += static_cast<acc_t>(scale) * (static_cast<acc_t>(dg[j]) * inv - live);
          }
          acc_t dot = 0;
          for (int64_t e = 0; e < per; ++e) dot += static_cast<acc_t>(p[e]) * dp[e];
          const acc_t z = (l && is_real) ? static_cast<acc_t>(z_factor * l[t]) : acc_t(0);
          for (int64_t e = 0; e < per; ++e)
            out[base + e] = static_cast<scalar_t>(static_cast<acc_t>(p[e]) * (dp[e] - dot + z));
        }
      }
    });
  });
  return grad;
}

// 2. sigmoid_topk_route: SwitchHead's selectors (arXiv 2312.07987): per head h of H, s = sigmoid(z_h) over its E
//    experts, the k largest chosen (topk_rows: at::topk's choice), numbered h * E + e, weighted by their s.
//    Backward: ds = grad_s + the gates' gradient scattered to the chosen experts, dz = s (1 - s) ds.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sigmoid_topk_route(const at::Tensor& logits, int64_t heads,
                                                                  int64_t top_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) % heads == 0, "sigmoid_topk_route: logits (N, H*E) expected");
  const int64_t n = logits.size(0), per = logits.size(1) / heads, k = top_k;
  const at::Tensor s = at::sigmoid(logits).contiguous();
  auto [gates, index] = topk_rows(s.view({n * heads, per}), k);
  gates = gates.view({n, heads, k});
  index = index.view({n, heads, k});
  int64_t* idx = index.data_ptr<int64_t>();
  at::parallel_for(0, n * heads, 1024, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < k; ++j) idx[r * k + j] += (r % heads) * per;
  });
  return {s, index, gates.contiguous()};
}

at::Tensor sigmoid_topk_route_backward(const c10::optional<at::Tensor>& grad_s,
                                       const c10::optional<at::Tensor>& grad_gates, const at::Tensor& s,
                                       const at::Tensor& index) {
  const int64_t n = s.size(0), experts = s.size(1), slots = index.size(1) * index.size(2);
  at::Tensor ds = grad_s.has_value() && grad_s->defined() ? grad_s->to(s.scalar_type()).contiguous().clone()
                                                          : at::zeros_like(s);
  at::Tensor grad = at::empty_like(s);
  at::Tensor gg;
  if (grad_gates.has_value() && grad_gates->defined()) gg = grad_gates->contiguous();
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "sigmoid_topk_route_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* s_p = s.data_ptr<scalar_t>();
    const int64_t* idx = index.data_ptr<int64_t>();
    const scalar_t* gg_p = gg.defined() ? gg.data_ptr<scalar_t>() : nullptr;
    scalar_t* d = ds.data_ptr<scalar_t>();
    scalar_t* out = grad.data_ptr<scalar_t>();
    at::parallel_for(0, n, 256, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (gg_p)
          for (int64_t j = 0; j < slots; ++j) d[t * experts + idx[t * slots + j]] += gg_p[t * slots + j];
        for (int64_t e = 0; e < experts; ++e) {
          const acc_t v = s_p[t * experts + e];
          out[t * experts + e] = static_cast<scalar_t>(v * (acc_t(1) - v) * static_cast<acc_t>(d[t * experts + e]));
        }
      }
    });
  });
  return grad;
}

// 3. moh_route: MoH's head weights (Jin et al. 2024, eq. 5-6, per router group g of G; the composed form is
//    headmix/attention/moh.py's) from one GEMM's logits z = [z_r (N, R) | z_a (N, G, 2) | z_s (N, G, S)],
//    M = R / G routed heads per group, S shared heads per group (z_a and z_s absent when S = 0):
//   p, index, gates = softmax_topk_route(z_r): gates = k top_p / sum top_p (renormalized, the sum differentiated),
//                     M top_p (scaled) or top_p (paper); L_a and total = w_a L_a as there (no z-loss)
//   a = c softmax(z_a_g), s = c_s softmax(z_s_g)        (c = 2, c_s = S; paper: c = c_s = 1)
//   routed weights w_r = a_1 gates, shared weights w_s = a_0 s   (S = 0: w_r = gates)
// Group g's heads are numbered g (S + M) + j: its S shared heads, then its routed heads; each token's slots per
// group are its S shared heads then its k selected routed heads in top-k order.
// Backward, per row: dw = grad_slot_weights + grad_head_weights read at the slots' heads; the routed part is
// softmax_topk_route_backward with grad_gates = a_1 dw_r; da_1 = c sum_j dw_r,j gates_j,
// da_0 = c_s c sum_j dw_s,j softmax(z_s)_j, ds = c_s a_0 dw_s, then each softmax's Jacobian.
constexpr int64_t kRenormalized = 0, kPaper = 1, kScaled = 2;

// The routed gates' renormalisation and scale (softmax_topk_route's renorm and c) of a MoH weighting: renormalized:
// live, k; scaled: none, M; paper: none, 1.
std::tuple<int64_t, double> moh_routed_gates(int64_t weighting, int64_t top_k, int64_t per) {
  if (weighting == kRenormalized) return {kLive, static_cast<double>(top_k)};
  return {kNone, weighting == kScaled ? static_cast<double>(per) : 1.0};
}

// The group gate's and the shared gate's scales (c, c_s) of a MoH weighting: 2 and S, or 1 and 1 for the paper's.
std::pair<double, double> moh_gate_scales(int64_t weighting, int64_t shared) {
  if (weighting == kPaper) return {1.0, 1.0};
  return {2.0, static_cast<double>(shared)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moh_route(const at::Tensor& logits, const c10::optional<at::Tensor>& token_mask, int64_t routed, int64_t groups,
          int64_t top_k, int64_t shared, int64_t weighting, double lb_weight, bool per_token, bool dense) {
  TORCH_CHECK(logits.dim() == 2 && groups >= 1 && routed % groups == 0 && shared >= 0 &&
                  logits.size(1) == routed + (shared ? groups * (2 + shared) : 0),
              "moh_route: logits (N, R + 2G + G S) expected");
  TORCH_CHECK(weighting >= kRenormalized && weighting <= kScaled, "moh_route: weighting 0, 1 or 2 expected");
  const int64_t n = logits.size(0), per = routed / groups, k = top_k, slots = shared + top_k, heads = shared + per;
  const auto [renorm, scale] = moh_routed_gates(weighting, k, per);
  auto [probs, index, gates, total, la, lz, lse, scaled_counts, tokens] = softmax_topk_route(
      logits.narrow(1, 0, routed), token_mask, groups, k, renorm, scale, lb_weight, 0.0, per_token, false);
  const at::TensorOptions options = logits.options();
  at::Tensor a = at::empty({0}, options), s = at::empty({0}, options);
  if (shared) {
    a = at::softmax(logits.narrow(1, routed, 2 * groups).reshape({n, groups, 2}), -1).contiguous();
    s = at::softmax(logits.narrow(1, routed + 2 * groups, groups * shared).reshape({n, groups, shared}), -1)
            .contiguous();
  }
  at::Tensor expert_index = at::empty({n, groups * k}, options.dtype(at::kLong));
  at::Tensor slot_heads = at::empty({n, groups * slots}, options.dtype(at::kLong));
  at::Tensor slot_weights = at::empty({n, groups * slots}, options);
  at::Tensor head_weights = dense ? at::zeros({n, groups * heads}, options) : at::empty({0}, options);
  const std::pair<double, double> scales = moh_gate_scales(weighting, shared);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "moh_route", [&] {
    const scalar_t c = static_cast<scalar_t>(scales.first), c_s = static_cast<scalar_t>(scales.second);
    const scalar_t* a_all = shared ? a.data_ptr<scalar_t>() : nullptr;
    const scalar_t* s_all = shared ? s.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gates_all = gates.data_ptr<scalar_t>();
    const int64_t* idx_all = index.data_ptr<int64_t>();
    int64_t* ei_all = expert_index.data_ptr<int64_t>();
    int64_t* sh_all = slot_heads.data_ptr<int64_t>();
    scalar_t* sw_all = slot_weights.data_ptr<scalar_t>();
    scalar_t* hw_all = dense ? head_weights.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t r = t0 * groups; r < t1 * groups; ++r) {  // r = t G + g: token t's router group g
        const int64_t g = r % groups, first = g * heads;
        // the same products, in the same order and precision, as the composed form: (c a) (c_s s), (c a) gates
        const scalar_t a_shared = shared ? c * a_all[r * 2] : scalar_t(0);
        const scalar_t a_routed = shared ? c * a_all[r * 2 + 1] : scalar_t(1);
        scalar_t* sw = sw_all + r * slots;
        int64_t* sh = sh_all + r * slots;
        scalar_t* hw = hw_all ? hw_all + r * heads : nullptr;
        for (int64_t j = 0; j < shared; ++j) {
          const scalar_t w = a_shared * (s_all[r * shared + j] * c_s);
          sw[j] = w;
          sh[j] = first + j;
          if (hw) hw[j] = w;
        }
        for (int64_t j = 0; j < k; ++j) {
          const int64_t local = idx_all[r * k + j];
          const scalar_t w = shared ? a_routed * gates_all[r * k + j] : gates_all[r * k + j];
          sw[shared + j] = w;
          sh[shared + j] = first + shared + local;
          ei_all[r * k + j] = g * per + local;
          if (hw) hw[shared + local] = w;
        }
      }
    });
  });
  return {probs, expert_index, slot_heads, slot_weights, head_weights, total, la, index, gates, a, s, scaled_counts,
          tokens};
}

at::Tensor moh_route_backward(const c10::optional<at::Tensor>& grad_probs,
                              const c10::optional<at::Tensor>& grad_slot_weights,
                              const c10::optional<at::Tensor>& grad_head_weights,
                              const c10::optional<at::Tensor>& grad_total, const c10::optional<at::Tensor>& grad_la,
                              const at::Tensor& probs, const at::Tensor& index, const at::Tensor& gates,
                              const at::Tensor& a, const at::Tensor& s, const c10::optional<at::Tensor>& token_mask,
                              const at::Tensor& scaled_counts, const at::Tensor& tokens, int64_t groups,
                              int64_t shared, int64_t weighting, double lb_weight) {
  const int64_t n = probs.size(0), routed = probs.size(1), per = routed / groups, k = index.size(2);
  const int64_t slots = shared + k, heads = shared + per, width = routed + (shared ? groups * (2 + shared) : 0);
  const auto [renorm, scale] = moh_routed_gates(weighting, k, per);
  at::Tensor gsw, ghw, grad_gates;
  if (grad_slot_weights.has_value() && grad_slot_weights->defined()) gsw = grad_slot_weights->contiguous();
  if (grad_head_weights.has_value() && grad_head_weights->defined() && grad_head_weights->numel() > 0)
    ghw = grad_head_weights->contiguous();
  at::Tensor grad = at::empty({n, width}, probs.options());
  if (gsw.defined() || ghw.defined()) {
    grad_gates = at::empty({n, groups, k}, probs.options());
    const std::pair<double, double> scales = moh_gate_scales(weighting, shared);
    AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "moh_route_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const acc_t c = static_cast<acc_t>(scales.first), c_s = static_cast<acc_t>(scales.second);
      const scalar_t* gsw_all = gsw.defined() ? gsw.data_ptr<scalar_t>() : nullptr;
      const scalar_t* ghw_all = ghw.defined() ? ghw.data_ptr<scalar_t>() : nullptr;
      const scalar_t* a_all = shared ? a.data_ptr<scalar_t>() : nullptr;
      const scalar_t* s_all = shared ? s.data_ptr<scalar_t>() : nullptr;
      const scalar_t* gates_all = gates.data_ptr<scalar_t>();
      const int64_t* idx_all = index.data_ptr<int64_t>();
      scalar_t* gg_all = grad_gates.data_ptr<scalar_t>();
      scalar_t* out = grad.data_ptr<scalar_t>();
      at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
        std::vector<acc_t> dw_shared(shared);
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t r = t * groups + g;
            const scalar_t* dsw = gsw_all ? gsw_all + r * slots : nullptr;
            const scalar_t* dhw = ghw_all ? ghw_all + r * heads : nullptr;
            const int64_t* idx = idx_all + r * k;
            const acc_t a_routed = shared ? c * static_cast<acc_t>(a_all[r * 2 + 1]) : acc_t(1);
            acc_t da_routed = 0;
            for (int64_t j = 0; j < k; ++j) {
              acc_t dw = 0;
              if (dsw) dw += static_cast<acc_t>(dsw[shared + j]);
              if (dhw) dw += static_cast<acc_t>(dhw[shared + idx[j]]);
              gg_all[r * k + j] = static_cast<scalar_t>(a_routed * dw);
              da_routed += dw * static_cast<acc_t>(gates_all[r * k + j]);
            }
            if (!shared) continue;
            const acc_t a0 = a_all[r * 2], a1 = a_all[r * 2 + 1];
            const scalar_t* sg = s_all + r * shared;
            acc_t da_shared = 0, s_dot = 0;
            for (int64_t j = 0; j < shared; ++j) {
              acc_t dw = 0;
              if (dsw) dw += static_cast<acc_t>(dsw[j]);
              if (dhw) dw += static_cast<acc_t>(dhw[j]);
              dw_shared[j] = c * a0 * c_s * dw;  // the gradient of softmax(z_s)_j
              da_shared += dw * c_s * static_cast<acc_t>(sg[j]);
              s_dot += static_cast<acc_t>(sg[j]) * dw_shared[j];
            }
            da_shared *= c;
            da_routed *= c;
            const acc_t a_dot = a0 * da_shared + a1 * da_routed;
            scalar_t* out_a = out + t * width + routed + 2 * g;
            out_a[0] = static_cast<scalar_t>(a0 * (da_shared - a_dot));
            out_a[1] = static_cast<scalar_t>(a1 * (da_routed - a_dot));
            scalar_t* out_s = out + t * width + routed + 2 * groups + g * shared;
            for (int64_t j = 0; j < shared; ++j)
              out_s[j] = static_cast<scalar_t>(static_cast<acc_t>(sg[j]) * (dw_shared[j] - s_dot));
          }
        }
      });
    });
  } else if (shared) {
    grad.narrow(1, routed, width - routed).zero_();
  }
  const at::Tensor grad_routed = softmax_topk_route_backward(
      grad_probs, grad_gates.defined() ? c10::optional<at::Tensor>(grad_gates) : c10::nullopt, grad_total, grad_la,
      c10::nullopt, probs, index, token_mask, at::empty({0}, probs.options()), scaled_counts, tokens, groups, renorm,
      scale, lb_weight, 0.0);
  grad.narrow(1, 0, routed).copy_(grad_routed);
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(headmix_cpp, m) {
  m.def("softmax_topk_route(Tensor logits, Tensor? token_mask, int groups, int top_k, int renorm, float scale, "
        "float lb_weight, float z_weight, bool per_token, bool z_loss) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("softmax_topk_route_backward(Tensor? grad_probs, Tensor? grad_gates, Tensor? grad_total, Tensor? grad_la, "
        "Tensor? grad_lz, Tensor probs, Tensor index, Tensor? token_mask, Tensor lse, Tensor scaled_counts, "
        "Tensor tokens, int groups, int renorm, float scale, float lb_weight, float z_weight) -> Tensor");
  m.def("sigmoid_topk_route(Tensor logits, int heads, int top_k) -> (Tensor, Tensor, Tensor)");
  m.def("sigmoid_topk_route_backward(Tensor? grad_s, Tensor? grad_gates, Tensor s, Tensor index) -> Tensor");
  m.def("topk_rows(Tensor values, int k) -> (Tensor, Tensor)");
  m.def("moh_route(Tensor logits, Tensor? token_mask, int routed, int groups, int top_k, int shared, int weighting, "
        "float lb_weight, bool per_token, bool dense) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moh_route_backward(Tensor? grad_probs, Tensor? grad_slot_weights, Tensor? grad_head_weights, "
        "Tensor? grad_total, Tensor? grad_la, Tensor probs, Tensor index, Tensor gates, Tensor group_gates, "
        "Tensor shared_gates, Tensor? token_mask, Tensor scaled_counts, Tensor tokens, int groups, int shared, "
        "int weighting, float lb_weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(headmix_cpp, CPU, m) {
  m.impl("softmax_topk_route", &softmax_topk_route);
  m.impl("softmax_topk_route_backward", &softmax_topk_route_backward);
  m.impl("sigmoid_topk_route", &sigmoid_topk_route);
  m.impl("sigmoid_topk_route_backward", &sigmoid_topk_route_backward);
  m.impl("topk_rows", &topk_rows);
  m.impl("moh_route", &moh_route);
  m.impl("moh_route_backward", &moh_route_backward);
}
