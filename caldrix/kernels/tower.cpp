// The vision tower's attention, bfloat16 on CPUs with AMX (Sapphire Rapids and later):
// caldrix::tile_attend(qkv, heads, scale), bidirectional attention over one tile's patches,
// straight from the fused q/k/v projection's output. (Its linears: tile_linear.cpp.)
//
// Why: in SmolVLM's SigLIP tower on this project's 2-core machine, torch's CPU flash attention
// took a third of the tower (0.6 TFLOPS: its exp and bookkeeping, not its matmuls). Here the
// two matmuls of attention run on AMX tiles and the exponentials are a polynomial in AVX-512
// (3.7 against torch's 5.1-5.4 ms a tile and layer at SmolVLM's shape).
//
// tile_attend. qkv [N, n, 3 D] bfloat16 contiguous, D = heads x 64, q then k then v, each
// head's 64 values together (the layout of SigLIP's q, k and v projections concatenated).
// Returns [N, n, D] bfloat16, softmax(scale q k^T) v per tile and head, heads side by side
// (what scaled_dot_product_attention's output is after transposing heads back).
// n must be a multiple of 32. Arithmetic: the scores q k^T are summed in float32 by the tiles;
// keys are taken 256 at a time with a running maximum per row (flash attention's online
// softmax): exp(scale s - scale max) in float32 (2^t by a degree-5 polynomial, within 2e-7
// relative), rounded to bfloat16 for the second matmul, while their float32 values are summed;
// the float32 weighted sums of values are rescaled when the maximum moves, divided by the
// row's sum at the end and rounded once. That is the arithmetic of torch's flash attention for
// bfloat16 except for the block size (torch's 512 keys) and the exp, so the two agree to
// bfloat16 rounding, not bit for bit. The float32 path keeps torch's kernel.
// A (tile, head, 32 query rows) task is computed whole by one thread, so results do not depend
// on the thread count or on the other tiles of the call.
//
// Built only where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on such a
// CPU); elsewhere this file compiles to nothing and the tower keeps torch's SDPA. The kernel
// asks Linux for the AMX register state (arch_prctl) before its first use, as oneDNN does.

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
#include <memory>

namespace {

using namespace caldrix_amx;

constexpr int64_t E = 64;  // head dim: two 32-wide k steps of a tile matmul
constexpr int64_t ROWS = 32;  // query rows a task: two 16-row tiles sharing each key tile
constexpr int64_t KEYS = 16;  // keys a score tile

// One tile and head's keys and values in the layouts the tile matmuls read.
// kp [n / 16][2][16][16] uint32: per block of 16 keys and half of the head dim, row r holds
// each key's pair of values 2r, 2r + 1 (the B operand of q k^T: k transposed, pairs kept).
// vp [n / 2][64] uint32: per pair of keys, each of the 64 values of both (the B operand of p v).
void pack_head(const uint16_t* k, const uint16_t* v, int64_t n, int64_t ld, uint32_t* kp, uint32_t* vp) {
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(ld / 2)));
  for (int64_t kb = 0; kb < n / KEYS; ++kb) {
    const int32_t* base = reinterpret_cast<const int32_t*>(k + kb * KEYS * ld);
    for (int64_t r = 0; r < E / 2; ++r)  // r: pair index 0..31 = (half c, row r % 16)
      _mm512_storeu_si512(kp + ((kb * 2 + r / 16) * 16 + r % 16) * 16, _mm512_i32gather_epi32(rows16, base + r, 4));
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < n / 2; ++p) {
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i a = _mm512_loadu_si512(v + 2 * p * ld + half * 32);
      const __m512i b = _mm512_loadu_si512(v + (2 * p + 1) * ld + half * 32);
      _mm512_storeu_si512(vp + p * E + half * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + p * E + half * 32 + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Keys are taken CHUNK at a time with a running maximum per row (flash attention's online
// softmax), so a chunk's scores (32 x 256 float32) and numerators stay in L1 between the tile
// matmuls and the exponentials; scores of all 1024 keys at once spilled to L2 and ran the
// tile stores and loads 3-4x slower.
constexpr int64_t CHUNK = 256;
// Scratch row strides padded off powers of two: 16 rows 1024 or 512 bytes apart share L1 sets.
constexpr int64_t SN = CHUNK + 16, PN = CHUNK + 32;

struct Scratch {
  alignas(64) float s[ROWS * SN];  // one chunk's scores
  alignas(64) uint16_t pb[ROWS * PN];  // and their softmax numerators in bfloat16
  alignas(64) float o[ROWS * E];  // the running weighted sums of values
  alignas(64) float oc[ROWS * E];  // one chunk's
  float max[ROWS], sum[ROWS], rescale[ROWS];
};

// q k^T for 32 query rows and the w keys of one chunk (kp at the chunk), into sc.s.
inline void scores(const uint16_t* q, int64_t ld, const uint32_t* kp, int64_t w, Scratch& sc) {
  const int64_t qstride = ld * 2;  // bytes between query rows in qkv
  _tile_loadd(4, q, qstride);
  _tile_loadd(5, q + 32, qstride);
  _tile_loadd(6, q + 16 * ld, qstride);
  _tile_loadd(7, q + 16 * ld + 32, qstride);
  for (int64_t kb = 0; kb < w / KEYS; ++kb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, kp + (kb * 2) * 256, 64);
    _tile_loadd(3, kp + (kb * 2 + 1) * 256, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(0, 5, 3);
    _tile_dpbf16ps(1, 6, 2);
    _tile_dpbf16ps(1, 7, 3);
    _tile_stored(0, sc.s + kb * KEYS, SN * 4);
    _tile_stored(1, sc.s + 16 * SN + kb * KEYS, SN * 4);
  }
}

// The chunk's softmax numerators exp(scale s - running max) into sc.pb (bfloat16), their float32
// sums into sc.sum, and each row's factor for what came before (exp(old max - new max)).
inline void numerators(int64_t w, float scale, bool first, Scratch& sc) {
  const __m512 sl = _mm512_set1_ps(scale * LOG2E);
  alignas(64) float before[ROWS], part[ROWS];
  for (int64_t i = 0; i < ROWS; ++i) {
    const float* row = sc.s + i * SN;
    __m512 m = _mm512_loadu_ps(row);
    for (int64_t j = 16; j < w; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
    const float top = std::max(_mm512_reduce_max_ps(m) * scale, first ? -INFINITY : sc.max[i]);
    before[i] = first ? top : sc.max[i];
    sc.max[i] = top;
    const __m512 shift = _mm512_set1_ps(top * LOG2E);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < w; j += 16) {
      const __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), sl, shift));
      total = _mm512_add_ps(total, e);
      store_bf16(sc.pb + i * PN + j, e);
    }
    part[i] = _mm512_reduce_add_ps(total);
  }
  // exp(old max - new max) for all rows at once, and the sums carried over by it
  for (int64_t i = 0; i < ROWS; i += 16) {
    const __m512 r = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(before + i), _mm512_loadu_ps(sc.max + i)),
                                           _mm512_set1_ps(LOG2E)));
    const __m512 sum = first ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_loadu_ps(sc.sum + i), r);
    _mm512_storeu_ps(sc.rescale + i, r);
    _mm512_storeu_ps(sc.sum + i, _mm512_add_ps(sum, _mm512_load_ps(part + i)));
  }
}

// The chunk's numerators times its values (vp at the chunk), added into sc.o after scaling what
// was there by each row's factor.
inline void weigh_values(const uint32_t* vp, int64_t w, bool first, Scratch& sc) {
  float* dst = first ? sc.o : sc.oc;
  // Two passes of 32 values each, so each value tile loaded serves both 16-row halves (tiles
  // 0-3 the sums, 4-5 the halves' numerators, 6-7 the values): the values come from L2, and
  // one load per product ran at half the speed.
  for (int64_t e0 = 0; e0 < E; e0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < w / 32; ++ks) {
      const uint32_t* vb = vp + ks * 16 * E + e0;  // 16 key pairs, 32 of their 64 values
      _tile_loadd(4, sc.pb + ks * 32, PN * 2);
      _tile_loadd(5, sc.pb + 16 * PN + ks * 32, PN * 2);
      _tile_loadd(6, vb, E * 4);
      _tile_loadd(7, vb + 16, E * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, dst + e0, E * 4);
    _tile_stored(1, dst + 16 * E + e0, E * 4);
    _tile_stored(2, dst + e0 + 16, E * 4);
    _tile_stored(3, dst + 16 * E + e0 + 16, E * 4);
  }
  if (first) return;
  for (int64_t i = 0; i < ROWS; ++i) {
    const __m512 r = _mm512_set1_ps(sc.rescale[i]);
    for (int64_t e = 0; e < E; e += 16)
      _mm512_storeu_ps(sc.o + i * E + e,
                       _mm512_fmadd_ps(_mm512_loadu_ps(sc.o + i * E + e), r, _mm512_loadu_ps(sc.oc + i * E + e)));
  }
}

// 32 query rows of one head (q in qkv, out in the result, kp and vp that head's packed keys and
// values) over all n keys.
void attend_rows(const uint16_t* q, int64_t ld, const uint32_t* kp, const uint32_t* vp, int64_t n, float scale,
                 Scratch& sc, uint16_t* out, int64_t ldo) {
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t w = std::min(CHUNK, n - c0);  // a multiple of 32
    scores(q, ld, kp + c0 * (E / 2), w, sc);
    numerators(w, scale, c0 == 0, sc);
    weigh_values(vp + (c0 / 2) * E, w, c0 == 0, sc);
  }
  for (int64_t i = 0; i < ROWS; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / sc.sum[i]);
    for (int64_t e = 0; e < E; e += 16) store_bf16(out + i * ldo + e, _mm512_mul_ps(_mm512_loadu_ps(sc.o + i * E + e), inv));
  }
}

at::Tensor tile_attend(const at::Tensor& qkv, int64_t heads, double scale) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && qkv.device().is_cpu(),
              "tile_attend: qkv is a contiguous bfloat16 CPU [N, n, 3 D]");
  const int64_t N = qkv.size(0), n = qkv.size(1), D = heads * E;
  TORCH_CHECK(heads >= 1 && qkv.size(2) == 3 * D, "tile_attend: qkv's last dim ", qkv.size(2), " is not 3 x ", heads,
              " heads x ", E);
  TORCH_CHECK(n >= ROWS && n % ROWS == 0, "tile_attend: ", n, " rows a tile is not a multiple of ", ROWS);
  TORCH_CHECK(amx_granted(), "tile_attend: Linux did not grant the AMX register state");
  const int64_t ld = 3 * D;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(qkv.data_ptr<c10::BFloat16>());
  at::Tensor out = at::empty({N, n, D}, qkv.options());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t per_head = n * E / 2;  // uint32 words of one head's packed keys, and of its values
  // uninitialised: pack_head writes every word (a std::vector zeroed 3 MB a tile and call first)
  const std::unique_ptr<uint32_t[]> kp(new uint32_t[N * heads * per_head]), vp(new uint32_t[N * heads * per_head]);
  at::parallel_for(0, N * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const uint16_t* base = src + b * n * ld + h * E;
      pack_head(base + D, base + 2 * D, n, ld, kp.get() + bh * per_head, vp.get() + bh * per_head);
    }
  });
  const int64_t blocks = n / ROWS;
  at::parallel_for(0, N * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    auto scratch = std::make_unique<Scratch>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, t0 = (task % blocks) * ROWS, b = bh / heads, h = bh % heads;
      attend_rows(src + (b * n + t0) * ld + h * E, ld, kp.get() + bh * per_head, vp.get() + bh * per_head, n,
                  static_cast<float>(scale), *scratch, dst + (b * n + t0) * D + h * E, D);
    }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("tile_attend(Tensor qkv, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("tile_attend", tile_attend);
}

#endif
