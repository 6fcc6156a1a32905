// caldrix::delta_decode: one decode step of a Qwen3.5 linear-attention layer between its two
// projections, for a few rows, each in its own slot.
//
// Why a kernel of our own: in torch the step between in_proj and out_proj is about 60 small
// ops a layer (the conv window, the norms, the decay and write strength, the delta rule, the
// gated norm), each a few microseconds of dispatch on vectors of a few thousand floats; over
// 18 layers that was 10 ms of a 70 ms one-thread step with 4-bit weights. Here it is one call.
//
// Per row t (slot s = slots[t]), from the row's fused projection p = [qkv (W) | z (nv dv) | b (nv) | a (nv)]:
//   window = conv_state[s] ++ qkv (K taps a channel); conv_state[s] <- window's last K - 1
//   c = silu(sum window * conv), rounded to the model dtype as torch's path rounds it
//   q, k per key head L2-normalised (eps 1e-6 inside the root; q also times dk^-0.5)
//   g = neg_a * softplus(a + dt_bias); decay = exp(g), exactly 0 below FLOOR; beta = sigmoid(b)
//   per value head h (key head h / (nv / nk)), S = rec[s, h] [dk, dv], float32:
//     S <- decay S; delta = beta (v - k^T S); S <- S + k delta^T; o = q^T S
//   out = round(silu(z) * round(norm * round(rmsnorm(round(o)))))
// where round() is the model dtype's rounding (none for float32), at the points transformers'
// Qwen3_5GatedDeltaNet and caldrix's torch path round. Everything else is float32.
//
// Exactness contract: a row's output and its slot's new state depend only on that row, its
// slot's state and the weights: never on the other rows or the thread count (each value head
// is computed whole by one thread, in a fixed order). So batched decode stays batch invariant.
//
// Shapes: proj [T, W + nv dv + 2 nv], conv_state [S, W, K - 1] and conv [W, K] in the model
// dtype (bfloat16 or float32), rec [S, nv, dk, dv] float32, neg_a and dt_bias [nv] float32,
// norm [dv] model dtype; all contiguous CPU tensors. W = 2 nk dk + nv dv. Returns [T, nv dv].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr float FLOOR = -60.0f;  // gated_delta.FLOOR: log-decays below it are total forgetting

template <typename T>
inline float rnd(float x) {  // the model dtype's rounding
  return static_cast<float>(static_cast<T>(x));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

template <typename T>
void run(const T* proj, T* conv_state, const T* conv, float* rec, const std::vector<int64_t>& slots,
         const float* neg_a, const float* dt_bias, const T* norm, T* out, int64_t nk, int64_t dk, int64_t nv,
         int64_t dv, int64_t K, double eps) {
  const int64_t W = 2 * nk * dk + nv * dv, P = W + nv * dv + 2 * nv, per = nv / nk;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(dk));
  std::vector<float> c(W), decay(nv), beta(nv);
  for (size_t t = 0; t < slots.size(); ++t) {
    const T* p = proj + t * P;
    const int64_t s = slots[t];
    T* cs = conv_state + s * W * (K - 1);
    for (int64_t w = 0; w < W; ++w) {
      T* win = cs + w * (K - 1);
      const T* cw = conv + w * K;
      float acc = 0.0f;
      for (int64_t j = 0; j < K - 1; ++j) acc += static_cast<float>(win[j]) * static_cast<float>(cw[j]);
      acc += static_cast<float>(p[w]) * static_cast<float>(cw[K - 1]);
      for (int64_t j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
      win[K - 2] = p[w];
      c[w] = rnd<T>(silu(rnd<T>(acc)));
    }
    for (int64_t h = 0; h < 2 * nk; ++h) {  // q heads, then k heads
      float* x = c.data() + h * dk;
      float ss = 0.0f;
      for (int64_t i = 0; i < dk; ++i) ss += x[i] * x[i];
      const float r = (h < nk ? qscale : 1.0f) / std::sqrt(ss + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) x[i] *= r;
    }
    const T* z = p + W;
    for (int64_t h = 0; h < nv; ++h) {
      const float g = neg_a[h] * softplus(static_cast<float>(p[W + nv * dv + nv + h]) + dt_bias[h]);
      decay[h] = g < FLOOR ? 0.0f : std::exp(g);
      beta[h] = rnd<T>(1.0f / (1.0f + std::exp(-static_cast<float>(p[W + nv * dv + h]))));
    }
    float* rs = rec + s * nv * dk * dv;
    T* o_row = out + t * nv * dv;
    at::parallel_for(0, nv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> pred(dv), o(dv);
      for (int64_t h = begin; h < end; ++h) {
        const float* q = c.data() + (h / per) * dk;
        const float* k = c.data() + nk * dk + (h / per) * dk;
        const float* v = c.data() + 2 * nk * dk + h * dv;
        float* S = rs + h * dk * dv;
        const float d = decay[h], b = beta[h];
        // k^T (d S) as d (k^T S): the first pass only reads S, the second decays, writes and
        // reads it, so the state (1 MB a layer at decider-0.8b's shape) crosses memory 3 times, not 4
        std::fill(pred.begin(), pred.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          const float* Si = S + i * dv;
          const float ki = k[i];
          for (int64_t j = 0; j < dv; ++j) pred[j] += ki * Si[j];
        }
        for (int64_t j = 0; j < dv; ++j) pred[j] = (v[j] - d * pred[j]) * b;  // delta
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          const float ki = k[i], qi = q[i];
          for (int64_t j = 0; j < dv; ++j) {
            Si[j] = d * Si[j] + ki * pred[j];
            o[j] += qi * Si[j];
          }
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < dv; ++j) {
          o[j] = rnd<T>(o[j]);
          ss += o[j] * o[j];
        }
        const float r = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
        for (int64_t j = 0; j < dv; ++j) {
          const float normed = rnd<T>(static_cast<float>(norm[j]) * rnd<T>(o[j] * r));
          o_row[h * dv + j] = static_cast<T>(silu(static_cast<float>(z[h * dv + j])) * normed);
        }
      }
    });
  }
}

at::Tensor delta_decode(const at::Tensor& proj, at::Tensor conv_state, const at::Tensor& conv, at::Tensor rec,
                        at::IntArrayRef slots, const at::Tensor& neg_a, const at::Tensor& dt_bias,
                        const at::Tensor& norm, int64_t nk, int64_t dk, int64_t dv, double eps) {
  const auto dt = proj.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "delta_decode: bfloat16 or float32 rows");
  TORCH_CHECK(rec.dim() == 4 && rec.scalar_type() == at::kFloat && rec.is_contiguous(),
              "delta_decode: rec is contiguous float32 [S, nv, dk, dv]");
  const int64_t nv = rec.size(1), S = rec.size(0), T = proj.size(0);
  TORCH_CHECK(nv % nk == 0 && rec.size(2) == dk && rec.size(3) == dv, "delta_decode: rec's heads and dims");
  const int64_t W = 2 * nk * dk + nv * dv, K = conv.size(1);
  TORCH_CHECK(proj.dim() == 2 && proj.is_contiguous() && proj.size(1) == W + nv * dv + 2 * nv,
              "delta_decode: proj is contiguous [T, W + nv dv + 2 nv]");
  TORCH_CHECK(conv.scalar_type() == dt && conv.is_contiguous() && conv.size(0) == W && K >= 2,
              "delta_decode: conv is contiguous [W, K] in the rows' dtype");
  TORCH_CHECK(conv_state.scalar_type() == dt && conv_state.is_contiguous() && conv_state.size(0) == S &&
                  conv_state.size(1) == W && conv_state.size(2) == K - 1,
              "delta_decode: conv_state is contiguous [S, W, K - 1] in the rows' dtype");
  TORCH_CHECK(norm.scalar_type() == dt && norm.is_contiguous() && norm.numel() == dv, "delta_decode: norm [dv]");
  TORCH_CHECK(neg_a.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat && neg_a.is_contiguous() &&
                  dt_bias.is_contiguous() && neg_a.numel() == nv && dt_bias.numel() == nv,
              "delta_decode: neg_a and dt_bias are float32 [nv]");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == T, "delta_decode: one slot a row");
  std::vector<int64_t> sl(slots.begin(), slots.end());
  for (int64_t s : sl) TORCH_CHECK(s >= 0 && s < S, "delta_decode: slot ", s, " out of range");
  at::Tensor out = at::empty({T, nv * dv}, proj.options());
  if (dt == at::kBFloat16) {
    using B = c10::BFloat16;
    run<B>(proj.data_ptr<B>(), conv_state.data_ptr<B>(), conv.data_ptr<B>(), rec.data_ptr<float>(), sl,
           neg_a.data_ptr<float>(), dt_bias.data_ptr<float>(), norm.data_ptr<B>(), out.data_ptr<B>(), nk, dk, nv, dv,
           K, eps);
  } else {
    run<float>(proj.data_ptr<float>(), conv_state.data_ptr<float>(), conv.data_ptr<float>(), rec.data_ptr<float>(),
               sl, neg_a.data_ptr<float>(), dt_bias.data_ptr<float>(), norm.data_ptr<float>(), out.data_ptr<float>(),
               nk, dk, nv, dv, K, eps);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("delta_decode(Tensor proj, Tensor(a!) conv_state, Tensor conv, Tensor(b!) rec, int[] slots, Tensor neg_a, "
        "Tensor dt_bias, Tensor norm, int nk, int dk, int dv, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) { m.impl("delta_decode", delta_decode); }
