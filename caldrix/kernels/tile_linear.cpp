// A bfloat16 linear layer on AMX tiles, for the vision tower's 1024-row tiles:
// - caldrix::tile_pack_weight(w [N, K]) -> the weight in the layout the tile products read;
// - caldrix::tile_linear(x [..., K], wp, bias, residual, gelu, norm_weight, norm_bias, eps)
//   -> [..., N].
//
// Why: oneDNN's packed bfloat16 matmul runs the tower's 1024-row calls with 768 outputs (a
// tile's wo and fc2) on one of this project's two cores: 1.1 and 4.8 ms, here 0.55 and 2.4. At
// its other shapes it reaches 2.3-2.7 TFLOPS, about this kernel's rate, so the tower takes one
// tile a pass on these layers (models/siglip.py): 6.4 ms a layer's four matmuls against 7.7.
// What a plain tile loop lost, measured with microbenchmarks on this machine:
// - operands from L3 (a tile product waited 3.5x longer than one fed from L2), 16 rows apart
//   in memory, or off 64-byte alignment (each tile row then spans two cache lines): both
//   operands are repacked into 1 KiB contiguous aligned tiles, and each thread sweeps
//   ROW_BYTES of its rows against GROUP_BYTES of the weight, both in its L2;
// - storing a block's four sum tiles at its end: 800 cycles a block of 2,300 once the
//   operands came from L2, where one store cost nothing. Each block stores one at its end and
//   the other three between the next block's first products;
// - the epilogue (bias, residual, rounding, GELU) run whole between blocks: a sixth of the
//   time. It runs two rows a step inside the next block's loop, beside the tile products.
// The tile product's own rate depends on the data: 13.7 TSC cycles on zeros, 17 on random
// bfloat16 from L1, 28 from L2.
//
// tile_pack_weight. w [N, K] bfloat16 contiguous, N and K multiples of 32. Returns the same
// values as bfloat16 [N / 32, K / 32, 2, 16, 32]: per 32 outputs and 32 inputs, two tiles (16
// outputs each) whose row r holds each output's inputs 2r and 2r + 1 side by side (the B
// operand of the tile product).
//
// tile_linear. x [..., K] bfloat16 with M rows, M a multiple of 32; wp from tile_pack_weight;
// bias [N] bfloat16 or none; residual [..., N] bfloat16 like the output, or none; gelu: apply
// the tanh-approximated GELU. Each output is x w^T summed in float32 by the tiles (pairs of
// products, in the order of k), plus the bias, plus the residual, rounded once to bfloat16;
// with `gelu`, that rounded value's GELU (amx.h's gelu_tanh_ps), rounded again: what
// F.gelu(F.linear(x, w, b), approximate="tanh") computes in bfloat16, to its rounding. With
// norm_weight and norm_bias [K] bfloat16: x is LayerNorm(x; eps) first, each row normalised in
// float32 as it is packed and rounded once (F.layer_norm's bfloat16 result, to its rounding),
// which spares the norm's own pass over the rows. A row's result does not depend on the other
// rows, the row count or the thread count.
//
// Built only where the compiler targets AMX-BF16 and AVX512-BF16, as tower.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace {

using namespace caldrix_amx;

constexpr int64_t BLOCK = 32;  // rows and outputs a tile-product block: two tiles each way
constexpr int64_t TILE = 512;  // bfloat16 values a tile: 16 rows of 32
constexpr int64_t ROWS_A_STEP = 2;  // epilogue rows run beside each step of the next block
// A thread's packed rows and the weight group it sweeps them against, sized together for a
// 2 MiB L2 (512 rows and 256 outputs at K = 768; 128 and 64 at 3072). Measured at the tower's
// four shapes, 1024 rows: 256 rows a chunk ran fc2 (K = 3072) 15% slower, 64 nearly 2x.
constexpr int64_t ROW_BYTES = 768 << 10, GROUP_BYTES = 384 << 10;

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// This thread's buffer for packed rows, at least `values` long: kept between calls, since a
// fresh 768 KiB each call is fresh pages to fault in each call.
uint16_t* packed_rows(int64_t values) {
  static thread_local std::unique_ptr<uint16_t, AlignedFree> buffer;
  static thread_local int64_t capacity = 0;
  if (capacity < values) {
    buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, values * 2)));  // values * 2: a multiple of 64
    TORCH_CHECK(buffer, "tile_linear: no memory for ", values * 2, " bytes of packed rows");
    capacity = values;
  }
  return buffer.get();
}

at::Tensor tile_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "tile_pack_weight: w is a bfloat16 CPU [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % BLOCK == 0 && K % BLOCK == 0, "tile_pack_weight: [", N, ", ", K, "] is not in multiples of ", BLOCK);
  const at::Tensor src = w.contiguous();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<c10::BFloat16>());
  at::Tensor out = at::empty({N / BLOCK, K / BLOCK, 2, 16, BLOCK}, w.options());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nt = begin; nt < end; ++nt)  // 16 outputs: tile nt % 2 of block nt / 2
      for (int64_t kb = 0; kb < K / BLOCK; ++kb)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t n = 0; n < 16; ++n)
            for (int64_t j = 0; j < 2; ++j)
              d[(((nt / 2) * (K / BLOCK) + kb) * 2 + nt % 2) * TILE + r * BLOCK + 2 * n + j] =
                  s[(nt * 16 + n) * K + kb * BLOCK + 2 * r + j];
  });
  return out;
}

// A LayerNorm applied to the rows as they are packed: gamma and beta [K] bfloat16, eps.
struct Norm {
  const uint16_t* gamma;  // null: no norm
  const uint16_t* beta;
  float eps;
};

// Rows [m0, m0 + rows) of x [M, K] into `a` as [rows / 32][K / 32][2][16][32]: per block of 32
// rows and 32 inputs, two tiles of 16 rows (the A operand, contiguous). With a norm, each row
// is LayerNorm(x) first: mean and variance in float32 (two passes over the row), then
// (x - mean) rstd gamma + beta rounded once to bfloat16.
void pack_rows(const uint16_t* x, int64_t K, int64_t m0, int64_t rows, uint16_t* a, const Norm& norm) {
  const int64_t KB = K / BLOCK;
  for (int64_t mb = 0; mb < rows / BLOCK; ++mb)
    for (int64_t i = 0; i < BLOCK; ++i) {
      const uint16_t* row = x + (m0 + mb * BLOCK + i) * K;
      uint16_t* dst = a + mb * KB * 2 * TILE + i * BLOCK;  // then + kb * 2 TILE
      if (!norm.gamma) {
        for (int64_t kb = 0; kb < KB; ++kb)
          _mm512_store_si512(dst + kb * 2 * TILE, _mm512_loadu_si512(row + kb * BLOCK));
        continue;
      }
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) sum = _mm512_add_ps(sum, load_bf16(row + k));
      const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(K);
      const __m512 mu = _mm512_set1_ps(mean);
      __m512 sq = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 d = _mm512_sub_ps(load_bf16(row + k), mu);
        sq = _mm512_fmadd_ps(d, d, sq);
      }
      const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(K) + norm.eps));
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int64_t h = 0; h < BLOCK; h += 16) {
          const int64_t k = kb * BLOCK + h;
          const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(load_bf16(row + k), mu), rstd),
                                           load_bf16(norm.gamma + k), load_bf16(norm.beta + k));
          store_bf16(dst + kb * 2 * TILE + h, y);
        }
    }
}

struct Epilogue {
  const uint16_t* bias;  // [N] or null
  const uint16_t* residual;  // [M, N] or null
  bool gelu;
  uint16_t* out;  // [M, N]
  int64_t N;
};

// The 32 x 32 float32 sums c (row stride BLOCK) of rows m, outputs n, finished into out.
inline void finish(const float* c, int64_t m, int64_t n, const Epilogue& e, int64_t i0 = 0, int64_t i1 = BLOCK) {
  for (int64_t i = i0; i < i1; ++i) {
    __m256i r[2];
    for (int64_t h = 0; h < 2; ++h) {
      __m512 v = _mm512_load_ps(c + i * BLOCK + h * 16);
      if (e.bias) v = _mm512_add_ps(v, load_bf16(e.bias + n + h * 16));
      if (e.residual) v = _mm512_add_ps(v, load_bf16(e.residual + (m + i) * e.N + n + h * 16));
      r[h] = to_bf16(v);
      if (e.gelu)  // GELU of the rounded linear output, as the reference's two ops
        r[h] = to_bf16(gelu_tanh_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r[h]), 16))));
    }
    const __m512i row = _mm512_inserti64x4(_mm512_castsi256_si512(r[0]), r[1], 1);
    _mm512_storeu_si512(e.out + (m + i) * e.N + n, row);
  }
}

// The 32 x 32 blocks of one thread, one after another, each block's sums finished while the
// next one's tile products run (the header says why): a block is done once the following
// block has run, or flush() has. Tiles 0-3 hold the sums, 4-5 the rows, 6-7 the weight.
class Blocks {
 public:
  Blocks(int64_t KB, const Epilogue& e) : KB_(KB), e_(e) {}
  ~Blocks() { flush(); }

  // Rows m, outputs n: rows' packed tiles a, outputs' packed tiles b.
  void run(const uint16_t* a, const uint16_t* b, int64_t m, int64_t n) {
    // the first step, each sum's tile taking over from the last block's as that one is stored
    _tile_zero(0);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (pending_) _tile_stored(1, c_ + 16, BLOCK * 4);
    _tile_zero(1);
    _tile_loadd(7, b + TILE, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (pending_) _tile_stored(2, c_ + 16 * BLOCK, BLOCK * 4);
    _tile_zero(2);
    _tile_loadd(5, a + TILE, 64);
    _tile_dpbf16ps(2, 5, 6);
    if (pending_) _tile_stored(3, c_ + 16 * BLOCK + 16, BLOCK * 4);
    _tile_zero(3);
    _tile_dpbf16ps(3, 5, 7);
    // the last block's epilogue two rows a step, its vector work beside the tile products
    int64_t done = pending_ ? 0 : BLOCK;
    for (int64_t kb = 1; kb < KB_; ++kb) {
      if (done < BLOCK) {
        finish(c_, m_, n_, e_, done, done + ROWS_A_STEP);
        done += ROWS_A_STEP;
      }
      a += 2 * TILE;
      b += 2 * TILE;
      _tile_loadd(4, a, 64);
      _tile_loadd(5, a + TILE, 64);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + TILE, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (done < BLOCK) finish(c_, m_, n_, e_, done, BLOCK);
    _tile_stored(0, c_, BLOCK * 4);
    pending_ = true;
    m_ = m;
    n_ = n;
  }

  // The last block's other tiles stored and its epilogue run.
  void flush() {
    if (!pending_) return;
    _tile_stored(1, c_ + 16, BLOCK * 4);
    _tile_stored(2, c_ + 16 * BLOCK, BLOCK * 4);
    _tile_stored(3, c_ + 16 * BLOCK + 16, BLOCK * 4);
    finish(c_, m_, n_, e_);
    pending_ = false;
  }

 private:
  alignas(64) float c_[BLOCK * BLOCK];  // a block's float32 sums, row stride BLOCK
  int64_t KB_;
  const Epilogue& e_;
  bool pending_ = false;
  int64_t m_ = 0, n_ = 0;
};

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, bool gelu, const c10::optional<at::Tensor>& norm_weight,
                       const c10::optional<at::Tensor>& norm_bias, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() >= 1,
              "tile_linear: x is a bfloat16 CPU tensor");
  TORCH_CHECK(wp.dim() == 5 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.size(2) == 2 &&
                  wp.size(3) == 16 && wp.size(4) == BLOCK,
              "tile_linear: wp is not from tile_pack_weight");
  const int64_t N = wp.size(0) * BLOCK, K = wp.size(1) * BLOCK, KB = K / BLOCK;
  TORCH_CHECK(x.size(-1) == K, "tile_linear: x has ", x.size(-1), " inputs, the weight ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  TORCH_CHECK(M % BLOCK == 0, "tile_linear: ", M, " rows is not a multiple of ", BLOCK);
  TORCH_CHECK(!(gelu && residual.has_value()), "tile_linear: a residual sum takes no GELU");
  TORCH_CHECK(amx_granted(), "tile_linear: Linux did not grant the AMX register state");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  at::Tensor b, res;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "tile_linear: bias is not bfloat16 [", N, "]");
  }
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kBFloat16 && res.sizes() == out.sizes(), "tile_linear: residual is not ",
                out.sizes(), " bfloat16");
  }
  at::Tensor gamma, beta;
  TORCH_CHECK(norm_weight.has_value() == norm_bias.has_value(), "tile_linear: a norm takes both its weight and bias");
  if (norm_weight.has_value()) {
    gamma = norm_weight->contiguous();
    beta = norm_bias->contiguous();
    TORCH_CHECK(gamma.scalar_type() == at::kBFloat16 && gamma.numel() == K && beta.scalar_type() == at::kBFloat16 &&
                    beta.numel() == K,
                "tile_linear: the norm's weight and bias are not bfloat16 [", K, "]");
  }
  const Norm nm{gamma.defined() ? reinterpret_cast<const uint16_t*>(gamma.data_ptr<c10::BFloat16>()) : nullptr,
                beta.defined() ? reinterpret_cast<const uint16_t*>(beta.data_ptr<c10::BFloat16>()) : nullptr,
                static_cast<float>(eps)};
  const Epilogue e{b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<c10::BFloat16>()) : nullptr,
                   res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr<c10::BFloat16>()) : nullptr, gelu,
                   reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), N};
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x2.data_ptr<c10::BFloat16>());
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wp.data_ptr<c10::BFloat16>());
  const int64_t chunk = std::max<int64_t>(1, ROW_BYTES / (BLOCK * K * 2)) * BLOCK;  // rows packed at once
  const int64_t group = std::max<int64_t>(1, GROUP_BYTES / (BLOCK * K * 2)) * BLOCK;  // outputs swept at once
  // Each thread a contiguous range of 32-row blocks, so its packed rows stay in its own L2.
  at::parallel_for(0, M / BLOCK, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const FlushDenormals flush;
    uint16_t* a = packed_rows(chunk * K);
    {
      auto blocks = std::make_unique<Blocks>(KB, e);
      for (int64_t m0 = begin * BLOCK; m0 < end * BLOCK; m0 += chunk) {
        const int64_t rows = std::min(chunk, end * BLOCK - m0);
        pack_rows(xs, K, m0, rows, a, nm);
        for (int64_t g = 0; g < N; g += group)
          for (int64_t mb = 0; mb < rows / BLOCK; ++mb)
            for (int64_t n = g; n < std::min(N, g + group); n += BLOCK)
              blocks->run(a + mb * KB * 2 * TILE, ws + (n / BLOCK) * KB * 2 * TILE, m0 + mb * BLOCK, n);
      }
    }  // the last block flushed
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("tile_pack_weight(Tensor w) -> Tensor");
  m.def("tile_linear(Tensor x, Tensor wp, Tensor? bias, Tensor? residual, bool gelu, Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("tile_pack_weight", tile_pack_weight);
  m.impl("tile_linear", tile_linear);
}

#endif
