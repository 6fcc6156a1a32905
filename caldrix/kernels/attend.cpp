// caldrix::decode_attend: attention for decode-form rows over a bfloat16 or float32 KV cache; and two ops
// that take the rest of a decode layer's small work into C++ (at the end of the file):
// decode_rope_attend (RoPE on the fused projection's q and k, then decode_attend) and
// decode_norm (RMSNorm). Each op takes one dtype, bfloat16 or float32, for all its tensors, and
// returns that dtype: a bfloat16 engine (CPUs with AVX512-BF16) and a float32 one (the rest)
// make the same calls.
//
// Each row i is one query token of slot slots[i] at position lengths[i] - 1. The call writes the
// row's key and value into the cache at that position, then attends the row over its slot's
// keys 0..lengths[i]-1. A row of length 0 is padding: nothing is written and its output is 0.
//
// Why a kernel of our own: torch's scaled_dot_product_attention costs about 40-60 us a call
// for one query row on this project's 2-core machine, nearly all of it fixed overhead, and a
// decode step makes one call per row per layer (240 at 8 rows for SmolLM2). This file does the
// same work in a few microseconds a row.
//
// Exactness contract, relied on by the batch-invariance and speculation tests:
// - a row's result depends only on its query, its slot's keys and values, and its length:
//   never on the other rows of the call, their count, or the thread count (a (row, kv head)
//   pair is one task, computed whole by one thread, in a fixed order);
// - all sums run in float32 in a fixed order (dot products in 16 lanes, then a fixed pairwise
//   lane sum; the softmax and the weighted sum of values key by key).
// The results are not bit-equal to torch's SDPA (they agree to the dtype's rounding), so every
// decode-form pass of an engine uses this kernel or none does (caldrix/models/native.py).
//
// Shapes: q [T, H, E], k and v [T, G, E] (any row and head strides, unit stride in E);
// K, V [S, G, C, E] contiguous (one layer's cache); out [T, H * E]. E is 64 or 128.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A vector register's floats: 16 with AVX-512, else 8 (AVX2). Wider vectors than the registers
// made GCC spill and emulate the lane shuffles: on an AVX2 CPU 16 lanes ran the attention about
// three times slower. The lane count fixes the order of the float sums, so results are the same
// on every call on one machine, but not across machines of different vector widths.
#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
constexpr int NORM_LANES = 16;  // decode_norm's D must be a multiple of this, whatever LANES is
constexpr int MAX_GROUP = 8;  // query heads per kv head

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

// LANES bf16 values to float32, exactly: a bf16's bits are the high half of a float32's.
inline vf load_lanes(const c10::BFloat16* x) {
  vh h;
  std::memcpy(&h, x, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline vf load_lanes(const float* x) {
  vf f;
  std::memcpy(&f, x, sizeof f);
  return f;
}

// The lanes' sum in a fixed pairwise order (lane l with l + w, for w = LANES/2, ..., 2, 1).
inline float hsum(vf a) {
#ifdef __AVX512F__
  a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return a[0];
}

// e^x for x <= 0 (a score minus its row's max), to about 1 float32 ulp: Cody-Waite range
// reduction and Cephes' polynomial, in plain float arithmetic so the loop around it vectorizes
// (std::exp would be a scalar call per key).
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// The `group` query heads of one row that share one kv head, over n cached keys. q: the first
// of them (heads q_stride apart); Kb, Vb: the kv head's rows [C, E]; o: the heads' outputs,
// group * E contiguous; p: scratch. E = CH * LANES is a compile-time constant, so loops unroll.
template <int CH, typename S>
void attend_group(const S* q, int64_t q_stride, const S* Kb, const S* Vb, int64_t n, int64_t group, float scale, S* o,
                  std::vector<float>& p) {
  constexpr int64_t E = CH * LANES;
  vf qv[MAX_GROUP][CH];
  for (int64_t a = 0; a < group; ++a)
    for (int c = 0; c < CH; ++c) qv[a][c] = load_lanes(q + a * q_stride + c * LANES);
  p.resize(group * n);  // p[a * n + j]: head a's score for key j, then its weight
  for (int64_t j = 0; j < n; ++j) {
    vf kc[CH];  // key j, converted once for all the group's heads
    for (int c = 0; c < CH; ++c) kc[c] = load_lanes(Kb + j * E + c * LANES);
    for (int64_t a = 0; a < group; ++a) {
      vf acc = qv[a][0] * kc[0];
      for (int c = 1; c < CH; ++c) acc += qv[a][c] * kc[c];
      p[a * n + j] = hsum(acc) * scale;
    }
  }
  float inv[MAX_GROUP];
  for (int64_t a = 0; a < group; ++a) {
    float* pa = p.data() + a * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = pa[j] > mx ? pa[j] : mx;
    for (int64_t j = 0; j < n; ++j) pa[j] = exp_nonpos(pa[j] - mx);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += pa[j];
    inv[a] = 1.0f / sum;
  }
  vf acc[MAX_GROUP][CH] = {};
  for (int64_t j = 0; j < n; ++j) {
    vf vc[CH];  // value j, converted once for all the group's heads
    for (int c = 0; c < CH; ++c) vc[c] = load_lanes(Vb + j * E + c * LANES);
    for (int64_t a = 0; a < group; ++a) {
      const float w = p[a * n + j];
      for (int c = 0; c < CH; ++c) acc[a][c] += w * vc[c];
    }
  }
  for (int64_t a = 0; a < group; ++a)
    for (int c = 0; c < CH; ++c)
      for (int l = 0; l < LANES; ++l) o[a * E + c * LANES + l] = S(acc[a][c][l] * inv[a]);
}

template <int CH, typename S>
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& K, at::Tensor& V,
                       c10::IntArrayRef slots, c10::IntArrayRef lengths, double scale) {
  const int64_t T = q.size(0), H = q.size(1), E = q.size(2), G = k.size(1), slot_count = K.size(0), C = K.size(2);
  auto out = at::empty({T, H * E}, q.options());
  auto* Kp = K.data_ptr<S>();
  auto* Vp = V.data_ptr<S>();
  const auto* kp = k.data_ptr<S>();
  const auto* vp = v.data_ptr<S>();
  int64_t work = 0;
  for (int64_t i = 0; i < T; ++i) {  // every write before any read, as the torch path does
    const int64_t s = slots[i], n = lengths[i];
    TORCH_CHECK(n >= 0 && n <= C && s >= 0 && s < slot_count, "decode_attend: row ", i, " is slot ", s, " length ", n,
                " in a cache of ", slot_count, " slots of ", C, " rows");
    work += n;
    if (n == 0) continue;
    for (int64_t g = 0; g < G; ++g) {
      std::memcpy(Kp + ((s * G + g) * C + n - 1) * E, kp + i * k.stride(0) + g * k.stride(1), E * sizeof(S));
      std::memcpy(Vp + ((s * G + g) * C + n - 1) * E, vp + i * v.stride(0) + g * v.stride(1), E * sizeof(S));
    }
  }
  const int64_t group = H / G;
  const float sc = static_cast<float>(scale);
  auto* op = out.data_ptr<S>();
  const auto* qp = q.data_ptr<S>();
  // Threads only where the work is long (long contexts); short steps run inline, since waking
  // a second thread costs more than a few microseconds of work. Either way one task is one
  // (row, kv head) pair, so the split never changes a result.
  const int64_t grain = work * H * E >= (int64_t{1} << 21) ? 1 : T * G;
  at::parallel_for(0, T * G, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / G, g = t % G, n = lengths[i];
      S* o = op + i * H * E + g * group * E;
      if (n == 0) {
        std::fill(o, o + group * E, S(0.0f));
        continue;
      }
      const int64_t base = (slots[i] * G + g) * C * E;
      attend_group<CH, S>(qp + i * q.stride(0) + g * group * q.stride(1), q.stride(1), Kp + base, Vp + base, n, group,
                       sc, o, p);
    }
  });
  return out;
}

at::Tensor decode_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& K, at::Tensor& V,
                         c10::IntArrayRef slots, c10::IntArrayRef lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && K.dim() == 4 && V.dim() == 4,
              "decode_attend: q, k, v are [T, heads, E], K and V [S, G, C, E]");
  const at::Tensor* all[] = {&q, &k, &v, &K, &V};
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : all)
    TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && t->scalar_type() == dtype && t->device().is_cpu(),
                "decode_attend: bfloat16 or float32 CPU tensors only, all of one dtype");
  TORCH_CHECK(K.is_contiguous() && V.is_contiguous() && K.sizes() == V.sizes(), "decode_attend: K and V contiguous, alike");
  const int64_t T = q.size(0), E = q.size(2), G = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == G && k.size(2) == E && v.size(2) == E &&
                  K.size(1) == G && K.size(3) == E,
              "decode_attend: shapes disagree");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "decode_attend: unit stride along E");
  TORCH_CHECK(q.size(1) % G == 0 && q.size(1) / G <= MAX_GROUP, "decode_attend: at most 8 query heads a kv head");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == T && static_cast<int64_t>(lengths.size()) == T,
              "decode_attend: one slot and one length a row");
  TORCH_CHECK(E == 64 || E == 128, "decode_attend: head dim ", E, " is not 64 or 128");
  if (dtype == at::kFloat)
    return E == 64 ? attend_rows<64 / LANES, float>(q, k, v, K, V, slots, lengths, scale)
                   : attend_rows<128 / LANES, float>(q, k, v, K, V, slots, lengths, scale);
  return E == 64 ? attend_rows<64 / LANES, c10::BFloat16>(q, k, v, K, V, slots, lengths, scale)
                 : attend_rows<128 / LANES, c10::BFloat16>(q, k, v, K, V, slots, lengths, scale);
}


// RoPE as decoder.apply_rope computes it, out = x * cos + roll(x, E/2) * sin: each product and
// the sum rounded to the dtype as torch's elementwise ops round them (float math, then round to
// nearest even for bfloat16), so the rotated heads are torch's bit for bit. For float32 that
// means no fused multiply-add: GCC contracts a * b + c across statements at -O3, so contraction
// is off for this function (clang contracts only within one expression, and a and b are two).
// qkv [T, (H+2G)E] contiguous; cos, sin [T, 1, E] or [T, E] contiguous; returns [T, H+G, E].
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename S>
at::Tensor rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t E) {
  const int64_t T = qkv.size(0), width = qkv.size(1), half = E / 2;
  auto out = at::empty({T, heads, E}, qkv.options());
  const auto* x = qkv.data_ptr<S>();
  const auto* c = cos.data_ptr<S>();
  const auto* sn = sin.data_ptr<S>();
  auto* o = out.data_ptr<S>();
  for (int64_t i = 0; i < T; ++i) {
    const S* ci = c + i * E;
    const S* si = sn + i * E;
    for (int64_t hd = 0; hd < heads; ++hd) {
      const S* xh = x + i * width + hd * E;
      S* oh = o + (i * heads + hd) * E;
      for (int64_t j = 0; j < E; ++j) {  // roll by E/2: element j meets element j +- E/2
        const int64_t r = j < half ? j + half : j - half;
        const S a(static_cast<float>(xh[j]) * static_cast<float>(ci[j]));
        const S b(static_cast<float>(xh[r]) * static_cast<float>(si[j]));
        oh[j] = S(static_cast<float>(a) + static_cast<float>(b));
      }
    }
  }
  return out;
}
#pragma GCC pop_options

// decode_attend on the fused projection's output, with the RoPE above applied to its q and k
// heads first: the same bits as split, apply_rope and decode_attend, in one call a layer.
at::Tensor decode_rope_attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& K,
                              at::Tensor& V, c10::IntArrayRef slots, c10::IntArrayRef lengths, int64_t heads,
                              double scale) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && (dtype == at::kBFloat16 || dtype == at::kFloat) &&
                  qkv.device().is_cpu(),
              "decode_rope_attend: qkv is a contiguous bfloat16 or float32 CPU [T, (H+2G)E]");
  TORCH_CHECK(K.dim() == 4, "decode_rope_attend: K and V are [S, G, C, E]");
  const int64_t T = qkv.size(0), G = K.size(1), E = K.size(3);
  TORCH_CHECK(heads > 0 && qkv.size(1) == (heads + 2 * G) * E, "decode_rope_attend: qkv has ", qkv.size(1),
              " columns, not (", heads, " + 2 * ", G, ") * ", E);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->numel() == T * E,
                "decode_rope_attend: cos and sin are contiguous [T, 1, E] in qkv's dtype");
  at::Tensor qk = dtype == at::kFloat ? rope_rows<float>(qkv, cos, sin, heads + G, E)
                                      : rope_rows<c10::BFloat16>(qkv, cos, sin, heads + G, E);
  at::Tensor v = qkv.narrow(1, (heads + G) * E, G * E).view({T, G, E});
  return decode_attend(qk.narrow(1, 0, heads), qk.narrow(1, heads, G), v, K, V, slots, lengths, scale);
}

// RMSNorm for decode-form rows: w * bf16(x * rsqrt(mean(x^2) + eps)), the statistics in float32
// as decoder.RMSNorm takes them. Not torch's bits: its sum of squares runs in an order of its
// own, this one in 16 lanes and the fixed pairwise lane sum, so a row's result depends on the
// row alone. x [T, D] contiguous bfloat16 or float32, D a multiple of 16; w [D], the same dtype.
template <typename S>
void norm_rows(const S* xp, const S* wp, S* op, int64_t T, int64_t D, float e) {
  const float d = static_cast<float>(D);
  for (int64_t i = 0; i < T; ++i) {
    const S* xi = xp + i * D;
    vf acc = {};
    for (int64_t c = 0; c < D; c += LANES) {
      const vf f = load_lanes(xi + c);
      acc += f * f;
    }
    const float rstd = 1.0f / std::sqrt(hsum(acc) / d + e);
    S* oi = op + i * D;
    for (int64_t j = 0; j < D; ++j) {
      const S y(static_cast<float>(xi[j]) * rstd);
      oi[j] = S(static_cast<float>(wp[j]) * static_cast<float>(y));
    }
  }
}

at::Tensor decode_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() && x.size(1) == w.size(0),
              "decode_norm: x is a contiguous [T, D], w a [D]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && w.scalar_type() == dtype && x.device().is_cpu(),
              "decode_norm: bfloat16 or float32 CPU tensors only, x and w of one dtype");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(D % NORM_LANES == 0, "decode_norm: D ", D, " is not a multiple of ", NORM_LANES);
  auto out = at::empty({T, D}, x.options());
  const float e = static_cast<float>(eps);
  if (dtype == at::kFloat)
    norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), T, D, e);
  else
    norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), T, D, e);
  return out;
}

}  // namespace

TORCH_LIBRARY(caldrix, m) {
  m.def("decode_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) K, Tensor(b!) V, int[] slots, int[] lengths, "
        "float scale) -> Tensor");
  m.def("decode_rope_attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, int[] slots, "
        "int[] lengths, int heads, float scale) -> Tensor");
  m.def("decode_norm(Tensor x, Tensor w, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("decode_attend", decode_attend);
  m.impl("decode_rope_attend", decode_rope_attend);
  m.impl("decode_norm", decode_norm);
}
