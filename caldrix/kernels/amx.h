// What tower.cpp and tile_linear.cpp share on CPUs with AMX-BF16 and AVX512-BF16: asking Linux
// for the tile registers, the one tile shape both use, and the float32 vector helpers (2^t,
// bfloat16 loads and stores, the GELU of tile_linear's epilogue).
// Included only inside each file's `#if defined(__AMX_TILE__) ...` block.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace caldrix_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline bool amx_granted() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile
  // instruction faults. Granting is per process and idempotent.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Every tile 16 rows of 64 bytes: 16 x 32 bfloat16 operands, 16 x 16 float32 sums. Loaded at the
// start of every parallel task: the configuration is per thread, and oneDNN's kernels load
// their own between our calls.
inline void configure_tiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Flush-to-zero and denormals-are-zero (MXCSR) for one parallel task of a tile kernel, restored
// when the task ends, so torch's own work on that thread keeps its settings (MXCSR is per thread).
// Why: a float32 result below 2^-126 costs a microcode assist of some 150 cycles, and real
// weights make them: softmax numerators of keys 87+ nats below a row's maximum, and the GELU's
// 2^-|t| where x < -10. Measured on a SigLIP tile (1024 rows) with such values in 2% of the
// lanes: the attention 2.9 -> 9.0 ms, fc1 with its GELU 2.2 -> 8.3 ms; flushed, the times of
// ordinary inputs. Every value flushed is below bfloat16's smallest normal, which the bfloat16
// results these kernels write round to 0 anyway, and the tile products flush their own.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ (bit 15) and DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};

constexpr float LOG2E = 1.44269504088896341f;

// 2^t as p 2^n: n = round(t), p = 2^(t - n) by a degree-5 fit on |t - n| <= 1/2, within 2e-7
// relative; t <= 127.
inline void exp2_parts(__m512 t, __m512& p, __m512& n) {
  n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  p = _mm512_set1_ps(1.3218674575909972e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671702980995178e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550893023610115e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022237956523895e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931468844413757e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

// 2^t in float32 within 2e-7 relative (scalef underflows to 0 gracefully); t <= 127.
inline __m512 exp2_ps(__m512 t) {
  __m512 p, n;
  exp2_parts(t, p, n);
  return _mm512_scalef_ps(p, n);
}

// The live lanes of 16 bfloat16 values as float32, exactly (a bfloat16 is a float32's high half).
inline __m512 load_bf16(const uint16_t* p, __mmask16 live = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void store_bf16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, to_bf16(v)); }

// The tanh-approximated GELU of v in float32, as x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3):
// 0.5 (1 + tanh u) is sigmoid(2u), which does not cancel where x is very negative, as torch's
// 1 + tanh u does in float32. Rounded once to bfloat16 it is the correctly rounded value but at
// rounding ties and below bfloat16's smallest normal (flushed to 0), and within a bfloat16
// step of torch's gelu(approximate="tanh") where that one is itself accurate
// (tests/test_tile_linear.py). sigmoid(2u) = 1 / (1 + 2^t) with t = -2 u log2(e) =
// x (c1 + c3 x^2); as e / (1 + e) with e = 2^-t where t > 0, so 2^|t| is never formed and very
// negative x underflow gracefully. Why a kernel's own: oneDNN's fused tanh-GELU post-op cost as
// much as the fc1 matmul it follows (4 ms of 9 at 2048 x 3072).
inline __m512 gelu_tanh_ps(__m512 v) {
  const __m512 c1 = _mm512_set1_ps(-2.0f * 0.7978845608028654f * LOG2E);
  const __m512 c3 = _mm512_set1_ps(-2.0f * 0.7978845608028654f * LOG2E * 0.044715f);
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  const __m512i sign = _mm512_set1_epi32(0x80000000);
  const __m512 t = _mm512_mul_ps(v, _mm512_fmadd_ps(_mm512_mul_ps(v, v), c3, c1));
  __m512 p, n;
  exp2_parts(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), p, n);
  const __m512 e = _mm512_scalef_ps(p, n);  // 2^-|t|
  const __m512 d = _mm512_add_ps(one, e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));  // one Newton step: 2^-28 relative
  // x e as (x p) 2^n, the same bits where e is normal: under FlushDenormals e is 0 once below
  // 2^-126, where x e (|x| > 10 there) can still be a normal number
  const __m512 num = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GT_OQ),
                                        _mm512_scalef_ps(_mm512_mul_ps(v, p), n));
  return _mm512_mul_ps(num, r);
}

}  // namespace caldrix_amx
