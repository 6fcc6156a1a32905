// The tile attention that tower.cpp (a vision tile's patches, all keys) and prompt_attend.cpp
// (an image prompt's chunk over its cache, causal) share, on CPUs with AMX-BF16 and
// AVX512-BF16. The arithmetic is tower.cpp's header's: scores summed in float32 by the tiles,
// keys 256 at a time with a running maximum per row, numerators from exp2_numerator_ps rounded to
// bfloat16 for the value products while their float32 values are summed, one division and
// rounding at the end. Included only inside each file's `#if defined(__AMX_TILE__) ...` block,
// after amx.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace caldrix_attend {

using namespace caldrix_amx;

constexpr int64_t E = 64;  // head dim: two 32-wide k steps of a tile matmul
constexpr int64_t ROWS = 32;  // query rows a task: two 16-row tiles sharing each key tile
constexpr int64_t KEYS = 16;  // keys a score tile

// One head's keys and values in the layouts the tile matmuls read, rows `ld` values apart.
// kp [n / 16][2][16][16] uint32: per block of 16 keys and half of the head dim, row r holds
// each key's pair of values 2r, 2r + 1 (the B operand of q k^T: k transposed, pairs kept).
// vp [n / 2][64] uint32: per pair of keys, each of the 64 values of both (the B operand of p v).
// Keys and values from row `valid` on are packed as zeros, unread: past a prompt chunk's last
// key a cache's rows hold anything, NaN included, and a zero weight times NaN is NaN.
inline void pack_head(const uint16_t* k, const uint16_t* v, int64_t n, int64_t ld, uint32_t* kp, uint32_t* vp,
                      int64_t valid) {
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(ld / 2)));
  for (int64_t kb = 0; kb < n / KEYS; ++kb) {
    const int32_t* base = reinterpret_cast<const int32_t*>(k + kb * KEYS * ld);
    const int64_t live = std::min<int64_t>(KEYS, std::max<int64_t>(0, valid - kb * KEYS));
    const __mmask16 rows = static_cast<__mmask16>((1u << live) - 1);
    for (int64_t r = 0; r < E / 2; ++r)  // r: pair index 0..31 = (half c, row r % 16)
      _mm512_storeu_si512(kp + ((kb * 2 + r / 16) * 16 + r % 16) * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, rows16, base + r, 4));
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < n / 2; ++p) {
    const __mmask32 a_live = 2 * p < valid ? ~0u : 0u, b_live = 2 * p + 1 < valid ? ~0u : 0u;
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i a = _mm512_maskz_loadu_epi16(a_live, v + 2 * p * ld + half * 32);
      const __m512i b = _mm512_maskz_loadu_epi16(b_live, v + (2 * p + 1) * ld + half * 32);
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

// 2^t for the softmax numerators: a degree-3 fit of 2^f on 0 <= f < 1, within 7.5e-5 relative,
// scaled by 2^floor(t). Each numerator is rounded to bfloat16 (2^-9 relative) for the value
// products, so amx.h's degree-5 exp2_ps (2e-7) bought nothing here; its two more products a
// score were a tenth of the attention's time. VREDUCEPS gives f = t - floor(t) in one step and
// scalef floors t itself, where exp2_ps rounds and subtracts (with the four maxima below, a
// SigLIP tile's attention layer 3.2-3.5 -> 2.9-3.1 ms). Hidden keys (t about -1e30) give 0.
inline __m512 exp2_numerator_ps(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t)
  __m512 p = _mm512_set1_ps(7.8024134039878845e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606770694255829e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583332538604736e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992525577545166e-1f));
  return _mm512_scalef_ps(p, t);
}

// The chunk's softmax numerators exp(scale s - running max) into sc.pb (bfloat16), their float32
// sums into sc.sum, and each row's factor for what came before (exp(old max - new max)).
inline void numerators(int64_t w, float scale, bool first, Scratch& sc) {
  const __m512 sl = _mm512_set1_ps(scale * LOG2E);
  alignas(64) float before[ROWS], part[ROWS];
  for (int64_t i = 0; i < ROWS; ++i) {
    const float* row = sc.s + i * SN;
    // four running maxima, w a multiple of 32: one would wait out each max's latency in turn
    __m512 m0 = _mm512_loadu_ps(row), m1 = _mm512_loadu_ps(row + 16), m2 = m0, m3 = m1;
    int64_t j = 32;
    for (; j + 64 <= w; j += 64) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(row + j));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(row + j + 16));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(row + j + 32));
      m3 = _mm512_max_ps(m3, _mm512_loadu_ps(row + j + 48));
    }
    for (; j < w; j += 32) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(row + j));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(row + j + 16));
    }
    const __m512 m = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
    const float top = std::max(_mm512_reduce_max_ps(m) * scale, first ? -INFINITY : sc.max[i]);
    before[i] = first ? top : sc.max[i];
    sc.max[i] = top;
    const __m512 shift = _mm512_set1_ps(top * LOG2E);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < w; j += 16) {
      const __m512 e = exp2_numerator_ps(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), sl, shift));
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

// Where a row's keys end: row i of a task sees keys up to first + i (NO_MASK: all of them).
constexpr int64_t NO_MASK = -1;
// What a hidden key's score becomes: finite, so the running maximum and exp2_ps stay NaN-free,
// and low enough that its exponential is exactly 0.
constexpr float HIDDEN = -1e30f;

// 32 query rows of one head (q in qkv, out in the result, kp and vp that head's packed keys and
// values) over keys [0, n), n a multiple of 32; with `first` >= 0, row i sees keys 0..first + i
// only (causal), the others weighing exactly 0.
inline void attend_rows(const uint16_t* q, int64_t ld, const uint32_t* kp, const uint32_t* vp, int64_t n,
                        float scale, Scratch& sc, uint16_t* out, int64_t ldo, int64_t rows = ROWS,
                        int64_t first = NO_MASK) {
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t w = std::min(CHUNK, n - c0);  // a multiple of 32
    scores(q, ld, kp + c0 * (E / 2), w, sc);
    if (first != NO_MASK && c0 + w - 1 > first)  // the chunk crosses the diagonal: hide what is past it
      for (int64_t i = 0; i < ROWS; ++i)
        for (int64_t j = std::max<int64_t>(0, first + i + 1 - c0); j < w; ++j) sc.s[i * SN + j] = HIDDEN;
    numerators(w, scale, c0 == 0, sc);
    weigh_values(vp + (c0 / 2) * E, w, c0 == 0, sc);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / sc.sum[i]);
    for (int64_t e = 0; e < E; e += 16) store_bf16(out + i * ldo + e, _mm512_mul_ps(_mm512_loadu_ps(sc.o + i * E + e), inv));
  }
}

// fn(task, scratch) for each task in [0, count), split over torch's threads: each thread loads
// the tile configuration, flushes subnormals while it runs (amx.h's FlushDenormals says why) and
// has a Scratch of its own. A task runs whole on one thread, so results do not depend on the
// thread count.
template <typename F>
void attend_tasks(int64_t count, const F& fn) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const FlushDenormals flush;
    auto scratch = std::make_unique<Scratch>();
    for (int64_t task = begin; task < end; ++task) fn(task, *scratch);
    _tile_release();
  });
}

}  // namespace caldrix_attend
