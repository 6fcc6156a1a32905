// The vision tower's attention, bfloat16 on CPUs with AMX (Sapphire Rapids and later):
// caldrix::tile_attend(qkv, heads, scale), bidirectional attention over one tile's patches,
// straight from the fused q/k/v projection's output. (Its linears: tile_linear.cpp; the tile
// attention itself, shared with prompt_attend.cpp: attend_tiles.h.)
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
// softmax): exp(scale s - scale max) in float32 (2^t by a degree-3 polynomial, within 7.5e-5
// relative, finer than the rounding that follows), rounded to bfloat16 for the second matmul, while their float32 values are summed;
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include "amx.h"
#include "attend_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace {

using namespace caldrix_amx;
using namespace caldrix_attend;

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
      pack_head(base + D, base + 2 * D, n, ld, kp.get() + bh * per_head, vp.get() + bh * per_head, n);
    }
  });
  const int64_t blocks = n / ROWS;
  attend_tasks(N * heads * blocks, [&](int64_t task, Scratch& scratch) {
    const int64_t bh = task / blocks, t0 = (task % blocks) * ROWS, b = bh / heads, h = bh % heads;
    attend_rows(src + (b * n + t0) * ld + h * E, ld, kp.get() + bh * per_head, vp.get() + bh * per_head, n,
                static_cast<float>(scale), scratch, dst + (b * n + t0) * D + h * E, D);
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
