// Grouped GEMM over experts for headmix's routed projections (CPU), built on first use by
// headmix/kernels/grouped_cpp.py.  One generic slot pass covers MoA's map (eq. 10), reduce (eq. 12 + 6) and
// SwitchHead's gate-weighted map, forward and backward:
//
//   for every slot s (sorted by expert, expert e owns sort_order[offsets[e]:offsets[e+1]]):
//     dst[s / dst_div] += gate[s] * (src[s / src_div] @ W[e])          (gate 1 when there are no gates)
//     dots[s] = <src[s / src_div] @ W[e], dot_src[s / dot_div]>        (optional: the gates' gradient)
//
// and the weight gradient  grad_W[e] = sum_{s of e} (gate[s] a[s / a_div])^T b[s / b_div].
//
// Parallel over *parts*: runs of whole experts of nearly equal row counts, one part per thread, each
// expert's GEMM whole on one thread (MKL / oneDNN run single-threaded inside an OpenMP parallel region).
// Inputs are read in place: a tile of at most kTileBytes of input rows is copied into a thread-local buffer
// (the packing a GEMM does anyway), multiplied, and its rows are added, gated, straight into their
// destination rows.  Where several slots share a destination row (dst_div > 1) parts other than the first
// add into a private accumulator of the destination's size, summed in part order at the end: no races, and
// the result depends only on the number of parts, not on thread timing.  Each worker thread takes the caller's
// thread-local state (at::ThreadLocalStateGuard: below autograd, as the custom op is called), so its at::mm
// calls run as the caller's would.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTileBytes = 512 * 1024;  // input + output rows of one tile: stays in L2
constexpr int64_t kMinRowsPerPart = 32;

// Boundaries e_0 = 0 < e_1 < ... < e_P = E of runs of whole experts with nearly equal rows.
std::vector<int64_t> expert_parts(const int64_t* off, int64_t num_experts) {
  const int64_t total = off[num_experts];
  int64_t nonempty = 0;
  for (int64_t e = 0; e < num_experts; ++e) nonempty += off[e + 1] > off[e];
  int64_t parts = std::min<int64_t>({at::get_num_threads(), nonempty, std::max<int64_t>(1, total / kMinRowsPerPart)});
  parts = std::max<int64_t>(parts, 1);
  std::vector<int64_t> bounds{0};
  int64_t e = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = total * p / parts;
    while (e < num_experts && off[e + 1] <= target) ++e;
    // expert e straddles target: cut before or after it, whichever is nearer
    int64_t cut = (e < num_experts && off[e + 1] - target < target - off[e]) ? e + 1 : e;
    cut = std::max(cut, bounds.back());
    if (cut > bounds.back() && cut < num_experts) bounds.push_back(cut);
  }
  bounds.push_back(num_experts);
  return bounds;
}

int64_t tile_rows(int64_t width_in, int64_t width_out, int64_t elem) {
  return std::clamp<int64_t>(kTileBytes / ((width_in + width_out) * elem), 8, 512);
}

template <typename scalar_t>
void slot_pass_kernel(const at::Tensor& src, int64_t src_div, const at::Tensor& weight,
                      const scalar_t* gates, const int64_t* order, const int64_t* off,
                      at::Tensor* dst, int64_t dst_div, const at::Tensor* dot_src, int64_t dot_div,
                      scalar_t* dots) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_experts = weight.size(0), d_in = weight.size(1), d_out = weight.size(2);
  const scalar_t* src_p = src.data_ptr<scalar_t>();
  const int64_t src_ld = src.stride(0);
  const std::vector<int64_t> bounds = expert_parts(off, num_experts);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t rows = tile_rows(d_in, d_out, sizeof(scalar_t));

  // destination handling: direct writes (one slot per row) or per-part accumulators
  const bool shared_rows = dst != nullptr && dst_div > 1;
  const bool part0_direct = shared_rows && std::is_same_v<acc_t, scalar_t>;
  std::vector<at::Tensor> accs(parts);
  if (shared_rows) {
    for (int64_t p = part0_direct ? 1 : 0; p < parts; ++p)
      accs[p] = at::zeros({dst->size(0), d_out}, src.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  }
  scalar_t* dst_p = dst ? dst->data_ptr<scalar_t>() : nullptr;
  const scalar_t* dot_p = dot_src ? dot_src->data_ptr<scalar_t>() : nullptr;
  const int64_t dot_ld = dot_src ? dot_src->stride(0) : 0;

  const at::ThreadLocalState slot_caller_state;
  at::parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    at::ThreadLocalStateGuard slot_state_guard(slot_caller_state);
    at::Tensor in_tile = at::empty({rows, d_in}, src.options());
    at::Tensor out_tile = at::empty({rows, d_out}, src.options());
    scalar_t* in_p = in_tile.data_ptr<scalar_t>();
    const scalar_t* out_p = out_tile.data_ptr<scalar_t>();
    for (int64_t p = p_begin; p < p_end; ++p) {
      acc_t* acc_p = accs[p].defined() ? accs[p].data_ptr<acc_t>() : nullptr;
      for (int64_t e = bounds[p]; e < bounds[p + 1]; ++e) {
        const at::Tensor w_e = weight.select(0, e);
        for (int64_t t0 = off[e]; t0 < off[e + 1]; t0 += rows) {
          const int64_t m = std::min(rows, off[e + 1] - t0);
          const int64_t* slots = order + t0;
          for (int64_t i = 0; i < m; ++i)
            std::memcpy(in_p + i * d_in, src_p + (slots[i] / src_div) * src_ld, d_in * sizeof(scalar_t));
          at::Tensor out_m = out_tile.narrow(0, 0, m);
          at::mm_out(out_m, in_tile.narrow(0, 0, m), w_e);
          for (int64_t i = 0; i < m; ++i) {
            const int64_t s = slots[i];
            const scalar_t* o = out_p + i * d_out;
            if (dots) {
              const scalar_t* d = dot_p + (s / dot_div) * dot_ld;
              acc_t sum = 0;
              for (int64_t c = 0; c < d_out; ++c) sum += static_cast<acc_t>(o[c]) * static_cast<acc_t>(d[c]);
              dots[s] = static_cast<scalar_t>(sum);
            }
            if (!dst_p) continue;
            const acc_t g = gates ? static_cast<acc_t>(gates[s]) : acc_t(1);
            const int64_t r = s / dst_div;
            if (!shared_rows) {
              scalar_t* y = dst_p + r * d_out;
              for (int64_t c = 0; c < d_out; ++c) y[c] = static_cast<scalar_t>(g * static_cast<acc_t>(o[c]));
            } else if (acc_p) {
              acc_t* y = acc_p + r * d_out;
              for (int64_t c = 0; c < d_out; ++c) y[c] += g * static_cast<acc_t>(o[c]);
            } else {  // part 0 adds straight into the destination (acc_t == scalar_t)
              scalar_t* y = dst_p + r * d_out;
              for (int64_t c = 0; c < d_out; ++c) y[c] += static_cast<scalar_t>(g * static_cast<acc_t>(o[c]));
            }
          }
        }
      }
    }
  });

  if (shared_rows && (parts > 1 || !part0_direct)) {  // sum the accumulators in part order
    const int64_t dst_rows = dst->size(0);
    at::parallel_for(0, dst_rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* y = dst_p + r * d_out;
        for (int64_t c = 0; c < d_out; ++c) {
          acc_t sum = part0_direct ? static_cast<acc_t>(y[c]) : acc_t(0);
          for (int64_t p = part0_direct ? 1 : 0; p < parts; ++p) sum += accs[p].data_ptr<acc_t>()[r * d_out + c];
          y[c] = static_cast<scalar_t>(sum);
        }
      }
    });
  }
}

template <typename scalar_t>
void weight_grad_kernel(const at::Tensor& a, int64_t a_div, const scalar_t* gates, const at::Tensor& b,
                        int64_t b_div, const int64_t* order, const int64_t* off, at::Tensor& grad_w) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_experts = grad_w.size(0), d_in = grad_w.size(1), d_out = grad_w.size(2);
  const scalar_t* a_p = a.data_ptr<scalar_t>();
  const scalar_t* b_p = b.data_ptr<scalar_t>();
  const int64_t a_ld = a.stride(0), b_ld = b.stride(0);
  const std::vector<int64_t> bounds = expert_parts(off, num_experts);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t rows = tile_rows(d_in, d_out, sizeof(scalar_t));
  // reduced precision: sum the tiles in a float accumulator (d_in x d_out per part), then round once
  const bool acc_float = !std::is_same_v<acc_t, scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;

  const at::ThreadLocalState weight_caller_state;
  at::parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    at::ThreadLocalStateGuard weight_state_guard(weight_caller_state);
    at::Tensor a_tile = at::empty({rows, d_in}, a.options());
    at::Tensor b_tile = at::empty({rows, d_out}, b.options());
    at::Tensor acc = acc_float ? at::empty({d_in, d_out}, a.options().dtype(acc_dtype)) : at::Tensor();
    at::Tensor part_tile = acc_float ? at::empty({d_in, d_out}, a.options()) : at::Tensor();
    scalar_t* at_p = a_tile.data_ptr<scalar_t>();
    scalar_t* bt_p = b_tile.data_ptr<scalar_t>();
    for (int64_t p = p_begin; p < p_end; ++p) {
      for (int64_t e = bounds[p]; e < bounds[p + 1]; ++e) {
        at::Tensor g_e = grad_w.select(0, e);
        if (off[e + 1] == off[e]) {
          g_e.zero_();
          continue;
        }
        if (acc_float) acc.zero_();
        bool first = true;
        for (int64_t t0 = off[e]; t0 < off[e + 1]; t0 += rows) {
          const int64_t m = std::min(rows, off[e + 1] - t0);
          const int64_t* slots = order + t0;
          for (int64_t i = 0; i < m; ++i) {
            const int64_t s = slots[i];
            const scalar_t* ar = a_p + (s / a_div) * a_ld;
            scalar_t* at_r = at_p + i * d_in;
            if (gates) {
              const acc_t g = static_cast<acc_t>(gates[s]);
              for (int64_t c = 0; c < d_in; ++c) at_r[c] = static_cast<scalar_t>(g * static_cast<acc_t>(ar[c]));
            } else {
              std::memcpy(at_r, ar, d_in * sizeof(scalar_t));
            }
            std::memcpy(bt_p + i * d_out, b_p + (s / b_div) * b_ld, d_out * sizeof(scalar_t));
          }
          const at::Tensor a_m = a_tile.narrow(0, 0, m).t(), b_m = b_tile.narrow(0, 0, m);
          if (acc_float) {
            at::mm_out(part_tile, a_m, b_m);
            acc.add_(part_tile);
          } else if (first) {
            at::mm_out(g_e, a_m, b_m);
          } else {
            g_e.addmm_(a_m, b_m);
          }
          first = false;
        }
        if (acc_float) g_e.copy_(acc);
      }
    }
  });
}

void check_common(const at::Tensor& weight, const at::Tensor& order, const at::Tensor& offsets) {
  TORCH_CHECK(weight.dim() == 3, "weight must be (E, d_in, d_out)");
  TORCH_CHECK(order.scalar_type() == at::kLong && order.is_contiguous(), "sort_order must be contiguous int64");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == weight.size(0) + 1,
              "offsets must be contiguous int64 of E + 1 entries");
}

void check_rows(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, name, " must be 2-d rows of unit stride, width ",
              width);
}

// dst (num_slots / dst_div, d_out) = the slot pass of src through W; dots filled when dot_src is given.
std::tuple<at::Tensor, at::Tensor> slot_pass(const at::Tensor& src, int64_t src_div, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& gates, const at::Tensor& order,
                                             const at::Tensor& offsets, int64_t dst_div, bool need_dst,
                                             const std::optional<at::Tensor>& dot_src, int64_t dot_div) {
  check_common(weight, order, offsets);
  check_rows(src, "src", weight.size(1));
  TORCH_CHECK(weight.scalar_type() == src.scalar_type(), "weight and src must share a dtype");
  const int64_t num_slots = order.numel();
  at::Tensor dst = at::empty({0}, src.options());  // empty when not asked for
  if (need_dst) {
    dst = dst_div > 1 ? at::zeros({num_slots / dst_div, weight.size(2)}, src.options())
                      : at::empty({num_slots, weight.size(2)}, src.options());
  }
  at::Tensor dots = at::empty({0}, src.options());
  if (dot_src) {
    check_rows(*dot_src, "dot_src", weight.size(2));
    dots = at::empty({num_slots}, src.options());
  }
  at::Tensor g = gates ? gates->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "headmix_slot_pass", [&] {
    slot_pass_kernel<scalar_t>(src, src_div, weight, g.defined() ? g.data_ptr<scalar_t>() : nullptr,
                               order.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), need_dst ? &dst : nullptr,
                               dst_div, dot_src ? &*dot_src : nullptr, dot_div,
                               dot_src ? dots.data_ptr<scalar_t>() : nullptr);
  });
  return {dst, dots};
}

at::Tensor weight_grad(const at::Tensor& a, int64_t a_div, const std::optional<at::Tensor>& gates,
                       const at::Tensor& b, int64_t b_div, const at::Tensor& order, const at::Tensor& offsets,
                       int64_t num_experts) {
  TORCH_CHECK(offsets.numel() == num_experts + 1, "offsets must have E + 1 entries");
  check_rows(a, "a", a.size(1));
  check_rows(b, "b", b.size(1));
  at::Tensor grad_w = at::empty({num_experts, a.size(1), b.size(1)}, a.options());
  at::Tensor g = gates ? gates->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "headmix_weight_grad", [&] {
    weight_grad_kernel<scalar_t>(a, a_div, g.defined() ? g.data_ptr<scalar_t>() : nullptr, b, b_div,
                                 order.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), grad_w);
  });
  return grad_w;
}

}  // namespace

namespace {

// The slots n*k + j of expert_index (N, k) grouped by expert, stably (a counting sort: what torch.sort(stable=True)
// and torch.searchsorted give, in two passes over the slots): (sorted_expert, sort_order, offsets).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_by_expert(const at::Tensor& expert_index, int64_t num_experts) {
  TORCH_CHECK(expert_index.scalar_type() == at::kLong, "sort_by_expert: expert_index must be int64");
  const at::Tensor flat = expert_index.contiguous().view(-1);
  const int64_t slots = flat.numel();
  const int64_t* idx = flat.data_ptr<int64_t>();
  at::Tensor offsets = at::zeros({num_experts + 1}, flat.options());
  at::Tensor sort_order = at::empty({slots}, flat.options());
  at::Tensor sorted_expert = at::empty({slots}, flat.options());
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(idx[s] >= 0 && idx[s] < num_experts, "sort_by_expert: expert ", idx[s], " outside [0, ",
                num_experts, ")");
    ++off[idx[s] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + num_experts);
  int64_t* order = sort_order.data_ptr<int64_t>();
  int64_t* sorted = sorted_expert.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t p = next[idx[s]]++;
    order[p] = s;
    sorted[p] = idx[s];
  }
  return {sorted_expert, sort_order, offsets};
}

}  // namespace

TORCH_LIBRARY(headmix_cpp, m) {
  m.def("slot_pass(Tensor src, int src_div, Tensor weight, Tensor? gates, Tensor sort_order, Tensor offsets, "
        "int dst_div, bool need_dst, Tensor? dot_src, int dot_div) -> (Tensor, Tensor)");
  m.def("weight_grad(Tensor a, int a_div, Tensor? gates, Tensor b, int b_div, Tensor sort_order, Tensor offsets, "
        "int num_experts) -> Tensor");
  m.def("sort_by_expert(Tensor expert_index, int num_experts) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(headmix_cpp, CPU, m) {
  m.impl("slot_pass", &slot_pass);
  m.impl("weight_grad", &weight_grad);
  m.impl("sort_by_expert", &sort_by_expert);
}
