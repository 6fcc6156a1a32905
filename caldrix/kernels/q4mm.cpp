// caldrix::q4_mm: y = x @ W.T for a few bfloat16 rows x and a GGUF's Q4_1 weights W, read in
// their own 4-bit blocks (w = d * q + m, 32 weights a block).
//
// Why a kernel of our own: at one row a decode step is a read of every weight, and torch's int4
// weight-only kernel reads them at about half of what this machine's memory gives two threads
// (4.1 ms for SmolLM2's 85 MB against about 2 ms for a plain sum over as many bytes). Here the
// nibbles become bfloat16 in registers and AVX512-BF16 dot products do the multiply-adds.
//
// Exactness contract (the engine's batch invariance rests on it): a row's outputs depend only on
// that row and W, never on the other rows of the call or the thread count. A vector holds 16
// output columns, one a lane, and each column group is computed whole by one thread, in a fixed
// order: per block, vdpbf16ps steps over its 32 k's (two products a lane a step) from zero,
// then the block's sum is scaled by d and (m - 128 d) * S_b is added (S_b: the block's sum of
// x), blocks in order. Rows run in passes of 8 over the weights, which changes no row's result;
// calls of more than 8 rows (prefill chunks) make the passes per pair of column groups instead,
// the same arithmetic in another loop order, so those rows' results are the same too.
// The products are exact in float32 (8-bit mantissas); d and m are the GGUF's float16 values,
// widened to float32 exactly, and m - 128 d is one float32 rounding (an FMA; 128 d is exact).
//
// Layout (made by kernels/q4.py, q4_mm_layout): qw uint8 [N, K / 2] in groups of 16 columns, each
// group 32 bytes per 4 k's (see `group`); dm float16 [N / 16, K / 32, 2, 16], per group and
// block the 16 d's, then the 16 m's. x [T, K] bfloat16 contiguous, any T; K a multiple of 32,
// N of 16. Returns [T, N] bfloat16.
//
// Why float16 d and m: a one-row step reads every byte once, and float32 ones were a third of
// the bytes (8 of the 24 a block a column); float16 is what the GGUF stores, so nothing is lost.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere
// this file compiles to nothing, native.py registers a stub of the name, and the engine keeps
// torch's int4 kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t COLS = 16;     // output columns a vector holds, one a lane
constexpr int64_t ROWS_AT_ONCE = 8;  // rows sharing one unpacking of the weights

// A column group's 32 bytes at k (4 k's) as two vectors of bfloat16 128 + q: k0, k1 and k2, k3
// pairs of each column (see `group`).
inline void widen(const uint8_t* qgk, __m512bh& lo, __m512bh& hi) {
  const __m512i nib = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qgk)));
  lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(bytes, nib), bias);
  hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
}

// A block's 16 d's and 16 (m - 128 d)'s, from its float16 d's and m's.
inline void scales(const uint16_t* dgb, __m512& d, __m512& m128) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dgb)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dgb + COLS)));
  m128 = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m);  // m - 128 d
}

// One group of 16 output columns for R rows. qg: the group's nibbles, 32 bytes per 4 k's (byte
// 2c holds column c's k0 | k2 << 4, byte 2c + 1 its k1 | k3 << 4); dg: per block, 16 d's then
// 16 (m - 128 d)'s; x: R rows of K; sums: R rows of K / 32 block sums.
//
// The 32 bytes widen to 32 words; OR-ing 0x4300 into the low and the high nibbles makes the
// bfloat16 values 128 + q exactly, k0 and k1 (or k2 and k3) beside each other for each column,
// as vdpbf16ps pairs them with a broadcast (x[k0], x[k1]). So a block gives sum (128 + q) x =
// sum q x + 128 S, and y = sum_b d_b * that + (m_b - 128 d_b) * S_b, block by block in order.
//
// One group at a time, read front to back: interleaving 2-4 groups for 1-3 rows (more
// independent dot-product chains) was faster with the weights in cache, but in a decode step
// they come from memory, and there one group at a time measured 16-35 % faster
// (docs/performance.md, "q4_mm reads one column group at a time").
template <int R>
inline void group(const uint8_t* qg, const uint16_t* dg, const c10::BFloat16* x, const float* sums, int64_t K,
                  c10::BFloat16* y, int64_t N, int64_t gi) {
  const int64_t blocks = K / BLOCK;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int64_t k4 = 0; k4 < BLOCK / 4; ++k4) {
      const int64_t k = b * BLOCK + 4 * k4;
      __m512bh lo, hi;
      widen(qg + k * 8, lo, hi);
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + k);
        part[r] = _mm512_dpbf16_ps(part[r], lo, (__m512bh)_mm512_set1_epi32(xr[0]));
        part[r] = _mm512_dpbf16_ps(part[r], hi, (__m512bh)_mm512_set1_epi32(xr[1]));
      }
    }
    __m512 d, m128;
    scales(dg + b * 2 * COLS, d, m128);
    for (int r = 0; r < R; ++r)
      total[r] = _mm512_fmadd_ps(m128, _mm512_set1_ps(sums[r * blocks + b]), _mm512_fmadd_ps(d, part[r], total[r]));
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float v[COLS];
    _mm512_store_ps(v, total[r]);
    for (int c = 0; c < COLS; ++c) y[r * N + gi * COLS + c] = c10::BFloat16(v[c]);
  }
}

template <int R>
void rows(const c10::BFloat16* x, const float* sums, const uint8_t* qw, const uint16_t* dm, c10::BFloat16* y, int64_t K,
          int64_t N) {
  const int64_t blocks = K / BLOCK, stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) group<R>(qw + gi * stride, dm + gi * dstride, x, sums, K, y, N, gi);
  });
}

void dispatch(int64_t R, const c10::BFloat16* x, const float* sums, const uint8_t* qw, const uint16_t* dm,
              c10::BFloat16* y, int64_t K, int64_t N) {
  switch (R) {
#define CASE(n) \
  case n: rows<n>(x, sums, qw, dm, y, K, N); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

// G column groups for R rows: a pass of `many` below. The same arithmetic as `group`, with the
// running totals kept in memory rather than registers (they are touched once a block), so that
// G x R partial sums fit in the registers and each broadcast of x serves G groups.
template <int G, int R>
inline void groups_many(const uint8_t* qg, const uint16_t* dg, const c10::BFloat16* x, const float* sums,
                        int64_t K, c10::BFloat16* y, int64_t N, int64_t gi) {
  const int64_t blocks = K / BLOCK, stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  alignas(64) float total[G][R][COLS] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 part[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) part[g][r] = _mm512_setzero_ps();
    for (int64_t k4 = 0; k4 < BLOCK / 4; ++k4) {
      const int64_t k = b * BLOCK + 4 * k4;
      __m512bh lo[G], hi[G];
      for (int g = 0; g < G; ++g) widen(qg + g * stride + k * 8, lo[g], hi[g]);
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * K + k);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[0]), x1 = (__m512bh)_mm512_set1_epi32(xr[1]);
        for (int g = 0; g < G; ++g) {
          part[g][r] = _mm512_dpbf16_ps(part[g][r], lo[g], x0);
          part[g][r] = _mm512_dpbf16_ps(part[g][r], hi[g], x1);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 d, m128;
      scales(dg + g * dstride + b * 2 * COLS, d, m128);
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(total[g][r], _mm512_fmadd_ps(m128, _mm512_set1_ps(sums[r * blocks + b]),
                                                     _mm512_fmadd_ps(d, part[g][r], _mm512_load_ps(total[g][r]))));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < COLS; ++c) y[r * N + (gi + g) * COLS + c] = c10::BFloat16(total[g][r][c]);
}

template <int G>
inline void pass_many(int64_t R, const c10::BFloat16* x, const float* sums, const uint8_t* qg, const uint16_t* dg,
                      int64_t K, c10::BFloat16* y, int64_t N, int64_t gi) {
  switch (R) {
#define CASE(n) \
  case n: groups_many<G, n>(qg, dg, x, sums, K, y, N, gi); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

// More than 8 rows (prefill chunks): one split of the column groups between the threads, and
// for each pair of groups passes over all rows, 8 at a time, while their nibbles stay in the L1
// cache. Each column's arithmetic is the same as in `rows`; only the loop order differs.
constexpr int MANY_G = 2;

void many(int64_t T, const c10::BFloat16* x, const float* sums, const uint8_t* qw, const uint16_t* dm,
          c10::BFloat16* y, int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  at::parallel_for(0, N / COLS, MANY_G, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end;) {
      const bool two = gi + MANY_G <= end;
      for (int64_t t0 = 0; t0 < T; t0 += ROWS_AT_ONCE) {
        const int64_t R = std::min(ROWS_AT_ONCE, T - t0);
        if (two)
          pass_many<MANY_G>(R, x + t0 * K, sums + t0 * blocks, qw + gi * stride, dm + gi * dstride, K, y + t0 * N, N, gi);
        else
          pass_many<1>(R, x + t0 * K, sums + t0 * blocks, qw + gi * stride, dm + gi * dstride, K, y + t0 * N, N, gi);
      }
      gi += two ? MANY_G : 1;
    }
  });
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "q4_mm: x is a contiguous bfloat16 CPU [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(K % BLOCK == 0, "q4_mm: K ", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(T >= 1, "q4_mm: no rows");
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 2 && qw.size(1) == K / 2 &&
                  N % COLS == 0,
              "q4_mm: qw is a contiguous uint8 [N, K / 2], N a multiple of 16, in q4.py's column-group order");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == 2 * N * (K / BLOCK),
              "q4_mm: dm holds d and m, contiguous float16, 2 * N * K / 32 values in q4.py's order");
  const auto* xp = x.data_ptr<c10::BFloat16>();
  // S[t, b]: each block's sum of x, in a fixed order (two 16-lane halves, then the lane sum).
  const int64_t blocks = K / BLOCK;
  std::vector<float> sums(T * blocks);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i raw = _mm512_loadu_si512(xp + t * K + b * BLOCK);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
      const __m512 hi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
      const __m512 s = _mm512_add_ps(lo, hi);
      __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
      __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      q = _mm_add_ps(q, _mm_movehl_ps(q, q));
      q = _mm_add_ss(q, _mm_movehdup_ps(q));
      sums[t * blocks + b] = _mm_cvtss_f32(q);
    }
  auto y = at::empty({T, N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());  // float16 bits
  // Rows in chunks of 8, each chunk a pass over the weights: a row's result is the same in
  // any chunk, so the split never changes it.
  if (T > ROWS_AT_ONCE) {
    many(T, xp, sums.data(), qw.data_ptr<uint8_t>(), dmp, yp, K, N);
    return y;
  }
  dispatch(T, xp, sums.data(), qw.data_ptr<uint8_t>(), dmp, yp, K, N);
  return y;
}

// caldrix::q4_dense: the dense weights W [N, K] back from q4_mm's layout, in bfloat16, for
// prefill chunks: at a hundred rows and more oneDNN's bfloat16 matmul (AMX where the CPU has it)
// on weights unpacked for the call is several times faster than q4_mm, which is built for the
// one-row read (kernels/q4.py, Int4Linear.forward, says which calls take it).
//
// Each value is bfloat16(d * q + m), rounded to nearest even: d * q is exact in float32 (an
// 11-bit d times a 4-bit q), so the one rounding of the sum gives the bits of the GGUF's float32
// dequantization (gguf-py: d * q, then + m) cast to bfloat16, the weights transformers and a
// dense engine use (tests/test_int4.py checks every projection of the real model against them).
// qw uint8 [N, K / 2], dm float16 [N / 16, K / 32, 2, 16] in q4_mm_layout's order.
at::Tensor q4_dense(const at::Tensor& qw, const at::Tensor& dm) {
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 2 && qw.size(0) % COLS == 0,
              "q4_dense: qw is a contiguous uint8 [N, K / 2], N a multiple of 16, in q4.py's column-group order");
  const int64_t N = qw.size(0), K = 2 * qw.size(1), blocks = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == 2 * N * blocks,
              "q4_dense: dm holds d and m, contiguous float16, 2 * N * K / 32 values in q4.py's order");
  auto y = at::empty({N, K}, qw.options().dtype(at::kBFloat16));
  auto* yp = reinterpret_cast<char*>(y.data_ptr<c10::BFloat16>());
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  const int64_t stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  // Lanes 2c and 2c + 1 of a widened step hold column c's two k's (see `group`): the columns'
  // d and m spread to match, columns 0-7 in one vector and 8-15 in the other.
  const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const uint8_t* qg = qp + gi * stride;
      char* rows = yp + gi * COLS * K * 2;  // the group's 16 output rows, K bfloat16 each
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* dgb = dmp + gi * dstride + b * 2 * COLS;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dgb)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dgb + COLS)));
        const __m512 d0 = _mm512_permutexvar_ps(pair_lo, d), d1 = _mm512_permutexvar_ps(pair_hi, d);
        const __m512 m0 = _mm512_permutexvar_ps(pair_lo, m), m1 = _mm512_permutexvar_ps(pair_hi, m);
        for (int64_t k4 = 0; k4 < BLOCK / 4; ++k4) {
          const int64_t k = b * BLOCK + 4 * k4;
          const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + k * 8)));
          const __m512i nib = _mm512_set1_epi16(0x0F);
          const __m512i q01 = _mm512_and_si512(words, nib), q23 = _mm512_srli_epi16(words, 4);  // (k0, k1), (k2, k3)
          auto value = [&](__m512i q, int half, __m512 dd, __m512 mm) {
            const __m256i part = half ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(part)), dd, mm);  // d q exact: one rounding
          };
          // dword c: column c's (k0, k1) in `lo`, its (k2, k3) in `hi`, as bfloat16
          const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(value(q01, 1, d1, m1), value(q01, 0, d0, m0));
          const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(value(q23, 1, d1, m1), value(q23, 0, d0, m0));
          // qword j: column (j / 2) * 4 + j % 2 in `a`, that + 2 in `c`: its k0..k3
          alignas(64) uint64_t a[8], c[8];
          _mm512_store_si512(a, _mm512_unpacklo_epi32(lo, hi));
          _mm512_store_si512(c, _mm512_unpackhi_epi32(lo, hi));
          for (int j = 0; j < 8; ++j) {
            const int64_t col = (j / 2) * 4 + j % 2;
            std::memcpy(rows + (col * K + k) * 2, &a[j], 8);
            std::memcpy(rows + ((col + 2) * K + k) * 2, &c[j], 8);
          }
        }
      }
    }
  });
  return y;
}

// caldrix::q8_rows: rows of a GGUF's Q8_0 matrix (w = d * q, q int8, 32 weights a block) read
// back from the two 4-bit halves q4.Q8AsInt4Linear keeps for q4_mm: hi nibbles (q >> 4) + 8, lo
// nibbles q & 15, the lo half's d the block's own. It serves a tied embedding from the head's
// blocks, so the model holds no dense copy of it (SmolLM2: 56 MB of bfloat16).
//
// Each value is bfloat16(float(d) * q), round to nearest even: the bits of the GGUF's float32
// dequantization cast to bfloat16, which q4.embed_from_head checks for every row before the
// dense table is dropped. ids [T] int64 in 0..N-1; hi_qw, lo_qw uint8 [N, K / 2] and lo_dm
// float16 in q4_mm's layout (q4_mm_layout). Returns [T, K] bfloat16.
at::Tensor q8_rows(const at::Tensor& ids, const at::Tensor& hi_qw, const at::Tensor& lo_qw, const at::Tensor& lo_dm) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), "q8_rows: ids is int64 [T]");
  TORCH_CHECK(hi_qw.scalar_type() == at::kByte && hi_qw.is_contiguous() && hi_qw.dim() == 2 &&
                  hi_qw.sizes() == lo_qw.sizes() && lo_qw.scalar_type() == at::kByte && lo_qw.is_contiguous() &&
                  hi_qw.size(0) % COLS == 0,
              "q8_rows: hi_qw and lo_qw are contiguous uint8 [N, K / 2] of one shape, in q4_mm's layout");
  const int64_t T = ids.size(0), N = hi_qw.size(0), K = 2 * hi_qw.size(1), blocks = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && lo_dm.scalar_type() == at::kHalf && lo_dm.is_contiguous() &&
                  lo_dm.numel() == 2 * N * blocks,
              "q8_rows: lo_dm holds the lo half's d and m, contiguous float16, in q4_mm's layout");
  const auto idc = ids.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  const uint8_t *hp = hi_qw.data_ptr<uint8_t>(), *lp = lo_qw.data_ptr<uint8_t>();
  const auto* dmp = lo_dm.data_ptr<at::Half>();
  const int64_t stride = COLS * (K / 2), dstride = blocks * 2 * COLS;
  auto y = at::empty({T, K}, hi_qw.options().dtype(at::kBFloat16));
  auto* yp = y.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = idp[t];
    TORCH_CHECK(n >= 0 && n < N, "q8_rows: id ", n, " is out of range for ", N, " rows");
    const int64_t g = n / COLS, c = n % COLS;
    for (int64_t k4 = 0; k4 < K / 4; ++k4) {
      // byte 2c: k0 | k2 << 4, byte 2c + 1: k1 | k3 << 4 (see `group`)
      const int64_t byte = g * stride + k4 * 2 * COLS + 2 * c;
      const int hi[4] = {hp[byte] & 15, hp[byte + 1] & 15, hp[byte] >> 4, hp[byte + 1] >> 4};
      const int lo[4] = {lp[byte] & 15, lp[byte + 1] & 15, lp[byte] >> 4, lp[byte + 1] >> 4};
      const float d = static_cast<float>(dmp[g * dstride + (4 * k4 / BLOCK) * 2 * COLS + c]);
      for (int j = 0; j < 4; ++j) yp[t * K + 4 * k4 + j] = c10::BFloat16(d * float(16 * (hi[j] - 8) + lo[j]));
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("q4_mm(Tensor x, Tensor qw, Tensor dm) -> Tensor");
  m.def("q8_rows(Tensor ids, Tensor hi_qw, Tensor lo_qw, Tensor lo_dm) -> Tensor");
  m.def("q4_dense(Tensor qw, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_rows", q8_rows);
  m.impl("q4_dense", q4_dense);
}

#endif
