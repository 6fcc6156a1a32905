// Pillow's Lanczos resize of an RGB image, bit for bit, in AVX-512:
// caldrix::lanczos_rgb(image, width, height, horizontal_first) -> the resized image;
// and the processor's rescale and normalise as a table lookup into channel planes:
// caldrix::normalise_pixels(frames [N, H, W, 3] uint8, table [3, 256]) -> [N, 3, H, W] of the
// table's dtype (float32, or int16 holding bfloat16's bits), out[n, c, y, x] = table[c, byte].
//
// Why: SmolVLM's processor resizes every image twice with Pillow (to 2048 on the long edge,
// then to 512 x 512 tiles), and Pillow's resampler is scalar C: 45 ms of a 512 x 512 image's
// 260 ms to first token on this project's 2-core machine, on two threads.
//
// image [H, W, 3] uint8 contiguous (numpy's view of an RGB PIL image). Returns [height, width, 3]
// uint8: what image.resize((width, height), Image.LANCZOS) gives, given Pillow's pass order
// (horizontal_first: vision/preprocess.py reads it off Pillow's rule). The arithmetic is
// Pillow's (libImaging/Resample.c, 8 bits a channel), so the bytes are the same:
// - per output position, the filter taps sinc(x) sinc(x / 3) over |x| < 3 (stretched by the
//   scale when shrinking), computed in double and divided by their sum, then rounded to
//   fixed point with 22 fraction bits, away from zero at halves;
// - each pass sums byte x tap in int32 from a half (1 << 21), then shifts right by 22 and
//   clamps to 0..255. The first pass's bytes feed the second.
// The int32 sums and the clamp are exact, so the order of the products does not matter; the
// taps must be the same doubles, which they are: the same expressions, in the same order,
// through the same libm sin (no -ffast-math here; the one contractible product, centre =
// (i + 0.5) scale, has an exact zero addend, and the tap rounding multiplies by 2^22).
// A thread computes whole output rows, so results do not depend on the thread count.
//
// Two threads of its own (`halves`), not at::parallel_for: the server runs preprocessing on the
// image decode slots' threads (vision/limiter.py), and an OpenMP team started there made the
// text streams' inter-token latency under 8 image requests 1.7-2.0x idle, against 1.0-1.1x
// without it (bench/vision_load.py, published shape, three runs each way).
//
// Built where the compiler targets AVX-512 F and BW; elsewhere this file compiles to nothing
// and preprocessing keeps Pillow's resize.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

constexpr int PRECISION_BITS = 32 - 8 - 2;  // Pillow's: 8 bits of result, 2 of headroom
constexpr int LANES = 16;
constexpr int64_t SPLIT_WORK = 1 << 18;  // output bytes from which a pass is worth a second thread

// fn(begin, end) over [0, n): the second half on a thread of its own, the first on the caller's,
// where `work` is worth it. Blocks until both are done; fn must not throw.
template <typename F>
void halves(int64_t n, int64_t work, const F& fn) {
  if (n < 2 || work < SPLIT_WORK) return fn(int64_t{0}, n);
  std::thread other([&] { fn(n / 2, n); });
  fn(int64_t{0}, n / 2);
  other.join();
}

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x = x * M_PI;
  return std::sin(x) / x;
}

double lanczos3(double x) { return (-3.0 <= x && x < 3.0) ? sinc(x) * sinc(x / 3) : 0.0; }

// The taps of a resize from `in` positions to `out` (Pillow's precompute_coeffs for the box
// [0, in], then normalize_coeffs_8bpc): for output o, `count[o]` taps from input `first[o]`,
// tap t at `taps[o * width + t]` (zero past count[o]).
struct Taps {
  int width = 0;
  std::vector<int32_t> first, count, taps;

  Taps(int64_t in, int64_t out) : first(out), count(out) {
    const double scale = static_cast<double>(static_cast<float>(in)) / static_cast<double>(out);
    const double filterscale = std::max(scale, 1.0);
    const double support = 3.0 * filterscale;
    width = static_cast<int>(std::ceil(support)) * 2 + 1;
    taps.assign(out * width, 0);
    std::vector<double> k(width);
    for (int64_t o = 0; o < out; ++o) {
      const double centre = 0.0 + (o + 0.5) * scale;
      const double ss = 1.0 / filterscale;
      int lo = static_cast<int>(centre - support + 0.5);
      if (lo < 0) lo = 0;
      int hi = static_cast<int>(centre + support + 0.5);
      if (hi > in) hi = static_cast<int>(in);
      const int n = hi - lo;
      double ww = 0.0;
      for (int x = 0; x < n; ++x) {
        k[x] = lanczos3((x + lo - centre + 0.5) * ss);
        ww += k[x];
      }
      for (int x = 0; x < n; ++x) {
        const double v = ww != 0.0 ? k[x] / ww : k[x];
        taps[o * width + x] = v < 0 ? static_cast<int32_t>(-0.5 + v * (1 << PRECISION_BITS))
                                    : static_cast<int32_t>(0.5 + v * (1 << PRECISION_BITS));
      }
      first[o] = lo;
      count[o] = n;
    }
  }
};

// int32 sums to bytes: >> 22, clamped to 0..255 (Pillow's clip8).
inline __m128i to_bytes(__m512i sum) {
  return _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_srai_epi32(sum, PRECISION_BITS), _mm512_setzero_si512()));
}

// Along columns: dst row o = the taps of o over src rows. Both [rows][bytes], rows `ld` apart
// (the three channels need no telling apart: each byte is summed with its own column).
void columns(const uint8_t* src, uint8_t* dst, int64_t bytes, int64_t ld, int64_t out, const Taps& tp) {
  const __m512i half = _mm512_set1_epi32(1 << (PRECISION_BITS - 1));
  halves(out, out * bytes, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int32_t* k = tp.taps.data() + o * tp.width;
      const uint8_t* base = src + static_cast<int64_t>(tp.first[o]) * ld;
      const int n = tp.count[o];
      for (int64_t i = 0; i < bytes; i += 4 * LANES) {
        const int64_t live = std::min<int64_t>(4 * LANES, bytes - i);
        const __mmask64 mask = live == 64 ? ~0ULL : (1ULL << live) - 1;
        __m512i s0 = half, s1 = half, s2 = half, s3 = half;
        for (int t = 0; t < n; ++t) {
          const __m512i b = _mm512_maskz_loadu_epi8(mask, base + t * ld + i);
          const __m512i kt = _mm512_set1_epi32(k[t]);
          s0 = _mm512_add_epi32(s0, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(b)), kt));
          s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b, 1)), kt));
          s2 = _mm512_add_epi32(s2, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b, 2)), kt));
          s3 = _mm512_add_epi32(s3, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b, 3)), kt));
        }
        const __m512i packed = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(to_bytes(s1), to_bytes(s0))),
            _mm256_set_m128i(to_bytes(s3), to_bytes(s2)), 1);
        _mm512_mask_storeu_epi8(dst + o * bytes + i, mask, packed);
      }
    }
  });
}

// Along rows: each of `rows` rows of src [rows][in][3] to dst [rows][out][3], 16 output pixels
// a step. One 4-byte gather a tap brings a pixel's three channels; it reads from the byte
// before the pixel (shifted off again), so the last pixel of the image is never read past.
void rows_pass(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t in, int64_t out, const Taps& tp) {
  const int64_t blocks = (out + LANES - 1) / LANES;
  // per block and tap: the 16 gather offsets, their shifts and the 16 taps (zero past an
  // output's count, the offset then that of the output's first pixel)
  const int64_t cells = blocks * tp.width * LANES;
  std::vector<int32_t> offs(cells), shifts(cells), taps(cells);
  for (int64_t o = 0; o < blocks * LANES; ++o) {
    const int64_t b = o / LANES, l = o % LANES, oc = std::min(o, out - 1);
    for (int t = 0; t < tp.width; ++t) {
      const bool live = o < out && t < tp.count[oc];
      const int64_t px = tp.first[oc] + (live ? t : 0), cell = (b * tp.width + t) * LANES + l;
      offs[cell] = static_cast<int32_t>(px == 0 ? 0 : px * 3 - 1);  // pixel 0 from its own first byte
      shifts[cell] = px == 0 ? 0 : 8;
      taps[cell] = live ? tp.taps[oc * tp.width + t] : 0;
    }
  }
  const __m512i half = _mm512_set1_epi32(1 << (PRECISION_BITS - 1)), low = _mm512_set1_epi32(0xFF);
  halves(rows, rows * out * 3, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = src + r * in * 3;
      uint8_t* drow = dst + r * out * 3;
      for (int64_t b = 0; b < blocks; ++b) {
        __m512i s0 = half, s1 = half, s2 = half;
        for (int t = 0; t < tp.width; ++t) {
          const int64_t cell = (b * tp.width + t) * LANES;
          const __m512i off = _mm512_loadu_si512(offs.data() + cell), kt = _mm512_loadu_si512(taps.data() + cell);
          const __m512i px = _mm512_srlv_epi32(_mm512_i32gather_epi32(off, row, 1), _mm512_loadu_si512(shifts.data() + cell));
          s0 = _mm512_add_epi32(s0, _mm512_mullo_epi32(_mm512_and_si512(px, low), kt));
          s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(px, 8), low), kt));
          s2 = _mm512_add_epi32(s2, _mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(px, 16), low), kt));
        }
        // interleave the three channels back into pixels
        alignas(64) uint8_t c[3][LANES];
        _mm_store_si128(reinterpret_cast<__m128i*>(c[0]), to_bytes(s0));
        _mm_store_si128(reinterpret_cast<__m128i*>(c[1]), to_bytes(s1));
        _mm_store_si128(reinterpret_cast<__m128i*>(c[2]), to_bytes(s2));
        const int64_t live = std::min<int64_t>(LANES, out - b * LANES);
        uint8_t* d = drow + b * LANES * 3;
        for (int64_t l = 0; l < live; ++l) {
          d[3 * l] = c[0][l];
          d[3 * l + 1] = c[1][l];
          d[3 * l + 2] = c[2][l];
        }
      }
    }
  });
}

at::Tensor lanczos_rgb(const at::Tensor& image, int64_t width, int64_t height, bool horizontal_first) {
  TORCH_CHECK(image.dim() == 3 && image.size(2) == 3 && image.scalar_type() == at::kByte && image.is_contiguous() &&
                  image.device().is_cpu(),
              "lanczos_rgb: image is a contiguous uint8 CPU [H, W, 3]");
  const int64_t H = image.size(0), W = image.size(1);
  // two pixels a row at least: a gather reads four bytes from a pixel's first (rows_pass)
  TORCH_CHECK(H >= 1 && W >= 2 && width >= 1 && height >= 1, "lanczos_rgb: the image is ", W, " x ", H,
              " pixels, the size ", width, " x ", height, "; it takes 2 x 1 and up");
  TORCH_CHECK(W * 3 < (int64_t{1} << 31) && width * 3 < (int64_t{1} << 31), "lanczos_rgb: rows too long");
  const uint8_t* src = image.data_ptr<uint8_t>();
  at::Tensor out = at::empty({height, width, 3}, image.options());
  const bool need_h = width != W, need_v = height != H;
  if (!need_h && !need_v) return out.copy_(image);
  if (need_h && need_v) {
    at::Tensor tmp;
    if (horizontal_first) {
      tmp = at::empty({H, width, 3}, image.options());
      rows_pass(src, tmp.data_ptr<uint8_t>(), H, W, width, Taps(W, width));
      columns(tmp.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), width * 3, width * 3, height, Taps(H, height));
    } else {
      tmp = at::empty({height, W, 3}, image.options());
      columns(src, tmp.data_ptr<uint8_t>(), W * 3, W * 3, height, Taps(H, height));
      rows_pass(tmp.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), height, W, width, Taps(W, width));
    }
  } else if (need_h) {
    rows_pass(src, out.data_ptr<uint8_t>(), H, W, width, Taps(W, width));
  } else {
    columns(src, out.data_ptr<uint8_t>(), W * 3, W * 3, height, Taps(H, height));
  }
  return out;
}

// Channel c's table entry for each byte of channel c: [N, T, T, 3] pixels to [N, 3, T, T].
template <typename V>
void lookup(const uint8_t* src, const V* table, V* dst, int64_t n, int64_t area) {
  halves(n * 3, n * area * 3, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) {  // plane: frame plane / 3, channel plane % 3
      const uint8_t* px = src + (plane / 3) * area * 3 + plane % 3;
      const V* t = table + (plane % 3) * 256;
      V* out = dst + plane * area;
      for (int64_t i = 0; i < area; ++i) out[i] = t[px[3 * i]];
    }
  });
}

at::Tensor normalise_pixels(const at::Tensor& frames, const at::Tensor& table) {
  TORCH_CHECK(frames.dim() == 4 && frames.size(3) == 3 && frames.scalar_type() == at::kByte && frames.is_contiguous() &&
                  frames.device().is_cpu(),
              "normalise_pixels: frames is a contiguous uint8 CPU [N, H, W, 3]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == 3 && table.size(1) == 256 && table.is_contiguous() &&
                  (table.scalar_type() == at::kFloat || table.scalar_type() == at::kShort),
              "normalise_pixels: table is a contiguous [3, 256] float32 or int16 (bfloat16's bits)");
  const int64_t n = frames.size(0), area = frames.size(1) * frames.size(2);
  at::Tensor out = at::empty({n, 3, frames.size(1), frames.size(2)}, table.options());
  if (table.scalar_type() == at::kFloat)
    lookup(frames.data_ptr<uint8_t>(), table.data_ptr<float>(), out.data_ptr<float>(), n, area);
  else
    lookup(frames.data_ptr<uint8_t>(), table.data_ptr<int16_t>(), out.data_ptr<int16_t>(), n, area);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("lanczos_rgb(Tensor image, int width, int height, bool horizontal_first) -> Tensor");
  m.def("normalise_pixels(Tensor frames, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("lanczos_rgb", lanczos_rgb);
  m.impl("normalise_pixels", normalise_pixels);
}

#endif
