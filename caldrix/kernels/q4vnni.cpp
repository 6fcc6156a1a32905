// caldrix::q4_vnni: y = x @ W.T for a few bfloat16 rows x and 4-bit weights W in groups of 32
// (w = d q + m, q in 0..15, d and m float16), the blocks `--weights q4` makes at load
// (kernels/q4_quantize.py), with the activations rounded to 8 bits: llama.cpp's Q4_1 x Q8_1 dot.
//
// Why: a decode step reads every weight once. torch's int4 kernel widens each nibble to a float
// and reads about 10 GB/s on one core here, where a plain sum reads 12 GB/s; with x in int8 a
// VNNI instruction (vpdpbusd) multiplies 64 nibble-bytes by 64 activation bytes and adds them in
// fours, so unpacking is two logic ops per 128 weights and the kernel can run at memory speed.
//
// Arithmetic: per row and block b of 32 k's, x is rounded to xq = round(x / dx) with dx =
// max|x| / 127 (symmetric, 0 for an all-zero block), and S_b = sum x is kept exactly in float32.
// Then y = sum_b d_b dx_b (sum_k q_k xq_k) + m_b S_b, the integer sums exact, the rest float32,
// blocks in order. So only x's rounding departs from the exact product with the blocks' weights
// (under 1/254 of a block's largest |x| an element).
//
// Exactness contract (batch invariance rests on it): a row's outputs depend only on that row and
// W, never on the other rows or the thread count: a column group is computed whole by one
// thread, in the same order for any row count.
//
// Layout (q4_quantize.vnni_layout): qw uint8 [N / 16, K / 8, 64], per group of 16 columns and
// octet of k's, byte 4c + j holding column c's k j in its low nibble and k j + 4 in its high
// one; dm float16 [N / 16, K / 32, 2, 16], per group and block the 16 d's then the 16 m's.
// x [T, K] bfloat16 contiguous; K a multiple of 32, N of 16. Returns [T, N] bfloat16.
//
// Built only where the compiler targets AVX512-VNNI (-march=native on such a CPU); elsewhere
// this file compiles to nothing and the layers keep torch's int4 kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t COLS = 16;
constexpr int64_t ROWS_AT_ONCE = 4;

// One group of 16 output columns for R rows. qg: the group's bytes, 64 per octet of k's; dg: per
// block 16 d's then 16 m's (float16); xq: R rows of K int8; dx, sx: R rows of K / 32 floats.
template <int R>
inline void group(const uint8_t* qg, const uint16_t* dg, const int8_t* xq, const float* dx, const float* sx,
                  int64_t K, c10::BFloat16* y, int64_t N, int64_t gi) {
  const int64_t blocks = K / BLOCK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t o = 0; o < BLOCK / 8; ++o) {
      const __m512i v = _mm512_loadu_si512(qg + (b * 4 + o) * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * K + b * BLOCK + o * 8);
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(xr[0]));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(xr[1]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 2 * COLS)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 2 * COLS + COLS)));
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b]));
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * blocks + b]),
                                 _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc[r]), total[r]));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float v[COLS];
    _mm512_store_ps(v, total[r]);
    for (int c = 0; c < COLS; ++c) y[r * N + gi * COLS + c] = c10::BFloat16(v[c]);
  }
}

void rows(int64_t R, const int8_t* xq, const float* dx, const float* sx, const uint8_t* qg, const uint16_t* dg,
          int64_t K, c10::BFloat16* y, int64_t N, int64_t gi) {
  switch (R) {
    case 1: group<1>(qg, dg, xq, dx, sx, K, y, N, gi); break;
    case 2: group<2>(qg, dg, xq, dx, sx, K, y, N, gi); break;
    case 3: group<3>(qg, dg, xq, dx, sx, K, y, N, gi); break;
    default: group<4>(qg, dg, xq, dx, sx, K, y, N, gi); break;
  }
}

at::Tensor q4_vnni(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "q4_vnni: x is a contiguous bfloat16 CPU [T, K]");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0 && T >= 1, "q4_vnni: K ", K, " is not a multiple of ", BLOCK, ", or no rows");
  TORCH_CHECK(qw.dim() == 3 && qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.size(1) == K / 8 &&
                  qw.size(2) == 64,
              "q4_vnni: qw is contiguous uint8 [N / 16, K / 8, 64]");
  const int64_t groups = qw.size(0), N = groups * COLS, blocks = K / BLOCK;
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == groups * blocks * 2 * COLS,
              "q4_vnni: dm is contiguous float16 [N / 16, K / 32, 2, 16]");
  // the rows in 8 bits, per block: xq = round(x / dx), dx = max|x| / 127; sx the exact sums
  std::vector<int8_t> xq(T * K);
  std::vector<float> dx(T * blocks), sx(T * blocks);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < T * blocks; ++i) {
    const c10::BFloat16* xb = xp + i * BLOCK;
    float amax = 0.0f, sum = 0.0f;
    for (int64_t k = 0; k < BLOCK; ++k) {
      const float v = static_cast<float>(xb[k]);
      amax = std::max(amax, std::fabs(v));
      sum += v;
    }
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t k = 0; k < BLOCK; ++k) xq[i * BLOCK + k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[k]) * inv));
    dx[i] = scale;
    sx[i] = sum;
  }
  at::Tensor y = at::empty({T, N}, x.options());
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t qstride = (K / 8) * 64, dstride = blocks * 2 * COLS;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t t0 = 0; t0 < T; t0 += ROWS_AT_ONCE)
        rows(std::min(ROWS_AT_ONCE, T - t0), xq.data() + t0 * K, dx.data() + t0 * blocks, sx.data() + t0 * blocks,
             q + gi * qstride, d + gi * dstride, K, yp + t0 * N, N, gi);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) { m.def("q4_vnni(Tensor x, Tensor qw, Tensor dm) -> Tensor"); }

TORCH_LIBRARY_IMPL(caldrix, CPU, m) { m.impl("q4_vnni", q4_vnni); }

#endif
