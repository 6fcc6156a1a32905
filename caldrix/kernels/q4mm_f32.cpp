// caldrix::q4_mm_f32: y = x @ W.T for a few float32 rows x and a GGUF's Q4_1 weights W, read in
// their own 4-bit blocks (w = d * q + m, 32 weights a block). The float32 sibling of q4mm.cpp,
// for CPUs with AVX2, FMA and F16C but no native bfloat16, where the engine runs float32.
//
// Why: there the dense float32 weights are 6x the bytes of the 4-bit blocks, and a decode step
// is a read of every weight; torch's int4 weight-only kernel takes float32 activations, but
// ran about 20x slower than the dense matmul on the development machine (AMD Zen 3).
//
// Exactness contract, as q4mm.cpp's: a row's outputs depend only on that row and W, never on
// the other rows of the call or the thread count. A vector holds 8 output columns, one a lane;
// each column group is computed whole by one thread, in a fixed order: per block, one FMA a k
// from zero over its 32 k's in order, then total = d * part + (m * S_b + total), S_b the
// block's sum of x (summed in a fixed order), blocks in order.
//
// Layout (made by models/q4.py, q4_mm_f32_layout): qw uint8 [N, K / 2] in groups of 8 columns,
// each group 32 bytes per 8 k's: little-endian dword c holds column c's 8 nibbles, k j at bits
// 4j. dm float16 [N / 8, K / 32, 2, 8]: per group and block the 8 d's, then the 8 m's, the
// GGUF's own float16 values, widened to float32 exactly (half the bytes of float32 ones). x [T, K]
// float32 contiguous, any T; K a multiple of 32, N of 8. Returns [T, N] float32.
//
// Built only where the compiler targets AVX2, FMA and F16C (-march=native); elsewhere this file
// compiles to nothing and native.py registers a stub of the name.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t COLS = 8;          // output columns a vector holds, one a lane
constexpr int64_t ROWS_AT_ONCE = 8;  // rows sharing one pass over the weights
constexpr float SCALE[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};

// G groups of 8 output columns for R rows. qg: the first group's nibbles (a group every
// `stride` bytes); dg: its d's and m's; xs: R rows of K, x scaled (see q4_mm_f32); sums: R rows
// of K / 32 block sums; y: R rows of N, written at the groups' columns.
//
// A nibble is not shifted down: k j of a dword (j < 7) is masked in place and converted,
// giving q * 16^j exactly, and its x was scaled by 16^-j beforehand, so each product is q * x exactly
// as if unscaled (a power-of-two scaling is exact) and the FMA rounds it the same way. The
// accumulators of a column are the same for any G and R: G only puts independent FMA chains
// side by side, so a few rows do not wait on one chain's latency.
template <int G, int R>
inline void groups(const uint8_t* qg, const uint16_t* dg, const float* xs, const float* sums, int64_t K, float* y,
                   int64_t N, int64_t gi) {
  const int64_t blocks = K / BLOCK, stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  // The totals live in memory, touched once a block: registers go to the 32-k inner loop.
  alignas(32) float total[G][R][COLS] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 part[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) part[g][r] = _mm256_setzero_ps();
    for (int64_t k8 = 0; k8 < BLOCK / 8; ++k8) {
      const int64_t k = b * BLOCK + 8 * k8;
      for (int j = 0; j < 8; ++j) {
        const __m256i mask = _mm256_set1_epi32(0xF << (4 * j));  // unused at j = 7
        __m256 xb[R];
        for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(xs + r * K + k + j);
        for (int g = 0; g < G; ++g) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + g * stride + k * 4));
          // k 7's nibble holds the sign bit in place, so it alone is shifted down (scale 1).
          const __m256 w = _mm256_cvtepi32_ps(j == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, mask));
          for (int r = 0; r < R; ++r) part[g][r] = _mm256_fmadd_ps(w, xb[r], part[g][r]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const uint16_t* dgb = dg + g * dstride + b * 2 * COLS;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dgb)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dgb + COLS)));
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[r * blocks + b]), _mm256_load_ps(total[g][r]));
        _mm256_store_ps(total[g][r], _mm256_fmadd_ps(d, part[g][r], t));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + (gi + g) * COLS, _mm256_load_ps(total[g][r]));
}

// Column groups interleaved, and rows taken a tile at a time over a column group (its bytes
// stay in L1 between tiles): about eight independent FMA chains (two FMAs a cycle at four or
// five cycles' latency) within the 16 vector registers.
constexpr int interleave(int R) { return R == 1 ? 8 : R == 2 ? 4 : 2; }
constexpr int ROW_TILE = 4;

template <int G, int R>
inline void tiles(const uint8_t* qg, const uint16_t* dg, const float* xs, const float* sums, int64_t K, float* y,
                  int64_t N, int64_t gi) {
  constexpr int first = R < ROW_TILE ? R : ROW_TILE;
  groups<G, first>(qg, dg, xs, sums, K, y, N, gi);
  if constexpr (R > ROW_TILE) tiles<G, R - ROW_TILE>(qg, dg, xs + ROW_TILE * K, sums + ROW_TILE * (K / BLOCK), K,
                                                     y + ROW_TILE * N, N, gi);
}

template <int R>
void rows(const float* xs, const float* sums, const uint8_t* qw, const uint16_t* dm, float* y, int64_t K, int64_t N) {
  constexpr int G = interleave(R < ROW_TILE ? R : ROW_TILE);
  const int64_t blocks = K / BLOCK, stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  at::parallel_for(0, N / COLS, G, [&](int64_t begin, int64_t end) {
    int64_t gi = begin;
    for (; gi + G <= end; gi += G) tiles<G, R>(qw + gi * stride, dm + gi * dstride, xs, sums, K, y, N, gi);
    for (; gi < end; ++gi) tiles<1, R>(qw + gi * stride, dm + gi * dstride, xs, sums, K, y, N, gi);
  });
}

void dispatch(int64_t R, const float* xs, const float* sums, const uint8_t* qw, const uint16_t* dm, float* y, int64_t K,
              int64_t N) {
  switch (R) {
#define CASE(n) \
  case n: rows<n>(xs, sums, qw, dm, y, K, N); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

at::Tensor q4_mm_f32(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "q4_mm_f32: x is a contiguous float32 CPU [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(K % BLOCK == 0, "q4_mm_f32: K ", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(T >= 1, "q4_mm_f32: no rows");
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 2 && qw.size(1) == K / 2 &&
                  N % COLS == 0,
              "q4_mm_f32: qw is a contiguous uint8 [N, K / 2], N a multiple of 8, in q4.py's column-group order");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == 2 * N * (K / BLOCK),
              "q4_mm_f32: dm holds d and m, contiguous float16, 2 * N * K / 32 values in q4.py's order");
  const float* xp = x.data_ptr<float>();
  // xs: x with k scaled by 16^-(k mod 8) (k mod 8 < 7), the in-place nibbles' weights (see `groups`).
  std::vector<float> xs(T * K);
  for (int64_t i = 0; i < T * K; ++i) xs[i] = xp[i] * SCALE[i % 8];
  // S[t, b]: each block's sum of x, in a fixed order (four 8-lane quarters, then the lane sum).
  const int64_t blocks = K / BLOCK;
  std::vector<float> sums(T * blocks);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xp + t * K + b * BLOCK;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      q = _mm_add_ps(q, _mm_movehl_ps(q, q));
      q = _mm_add_ss(q, _mm_movehdup_ps(q));
      sums[t * blocks + b] = _mm_cvtss_f32(q);
    }
  auto y = at::empty({T, N}, x.options());
  float* yp = y.data_ptr<float>();
  // Rows in chunks of 8, each chunk a pass over the weights: a row's result is the same in
  // any chunk, so the split never changes it.
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());  // float16 bits
  for (int64_t t0 = 0; t0 < T; t0 += ROWS_AT_ONCE) {
    const int64_t R = std::min(ROWS_AT_ONCE, T - t0);
    dispatch(R, xs.data() + t0 * K, sums.data() + t0 * blocks, qw.data_ptr<uint8_t>(), dmp, yp + t0 * N, K, N);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) { m.def("q4_mm_f32(Tensor x, Tensor qw, Tensor dm) -> Tensor"); }

TORCH_LIBRARY_IMPL(caldrix, CPU, m) { m.impl("q4_mm_f32", q4_mm_f32); }

#endif
