// An image prompt's chunk attention, bfloat16 on CPUs with AMX (Sapphire Rapids and later):
// caldrix::prompt_attend(q, K, V, start, scale), causal attention of a prompt chunk's queries
// over its sequence's cache rows, on tower.cpp's tiles (attend_tiles.h).
//
// Why: torch's SDPA ran SmolVLM's 877-row image prompt's attention at 0.1-0.2 TFLOPS on this
// project's 2-core machine (77-104 ms of the text pass's 0.4 s): its CPU flash attention works
// in 512-key blocks, so a 512-row causal chunk costs what a full one does, and its exp bounds
// the rest. Only prompt chunks that carry image rows come here (models/base.attend_cached):
// an image reply already differs from transformers' in the tower's bfloat16 rounding, where a
// text reply keeps SDPA's bits.
//
// q [T, H, 64] bfloat16 contiguous, after RoPE: the chunk's queries at positions start..start+T-1.
// K, V [G, C, 64] bfloat16 contiguous (one sequence's cache rows, G key heads, H a multiple of
// G), rows 0..start+T-1 holding its keys and values, the chunk's own written already.
// Returns [T, H * 64] bfloat16: row i, head h is softmax(scale q k^T) v over keys 0..start+i of
// key head h / (H / G), what scaled_dot_product_attention(..., is_causal, enable_gqa) gives
// for the chunk, to bfloat16 rounding (tower.cpp's header says where the two differ). Hidden
// keys weigh exactly 0, and cache rows past the chunk are never read. A (head, 32 query rows)
// task is computed whole by one thread, so results do not depend on the thread count.
//
// Built only where the compiler targets AMX-BF16 and AVX512-BF16, as tower.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include "amx.h"
#include "attend_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

using namespace caldrix_amx;
using namespace caldrix_attend;

at::Tensor prompt_attend(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == E && q.scalar_type() == at::kBFloat16 && q.is_contiguous() &&
                  q.device().is_cpu(),
              "prompt_attend: q is a contiguous bfloat16 CPU [T, H, ", E, "]");
  TORCH_CHECK(K.dim() == 3 && K.size(2) == E && K.scalar_type() == at::kBFloat16 && K.is_contiguous() &&
                  V.sizes() == K.sizes() && V.scalar_type() == at::kBFloat16 && V.is_contiguous(),
              "prompt_attend: K and V are contiguous bfloat16 [G, C, ", E, "]");
  const int64_t T = q.size(0), H = q.size(1), G = K.size(0), C = K.size(1), n = start + T;
  TORCH_CHECK(T >= 1 && start >= 0 && n <= C, "prompt_attend: rows ", start, "..", n, " are not in the cache's ", C);
  TORCH_CHECK(G >= 1 && H % G == 0, "prompt_attend: ", H, " query heads over ", G, " key heads");
  TORCH_CHECK(amx_granted(), "prompt_attend: Linux did not grant the AMX register state");
  const int64_t blocks = (T + ROWS - 1) / ROWS, keys = (n + ROWS - 1) / ROWS * ROWS, D = H * E;
  // queries padded to whole 32-row tasks (zeros: finite scores, results dropped)
  at::Tensor qp = q;
  if (T % ROWS) {
    qp = at::zeros({blocks * ROWS, H, E}, q.options());
    std::memcpy(qp.data_ptr<c10::BFloat16>(), q.data_ptr<c10::BFloat16>(), T * D * 2);
  }
  const uint16_t* qs = reinterpret_cast<const uint16_t*>(qp.data_ptr<c10::BFloat16>());
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(K.data_ptr<c10::BFloat16>());
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(V.data_ptr<c10::BFloat16>());
  at::Tensor out = at::empty({T, D}, q.options());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t per_head = keys * E / 2;  // uint32 words of one key head's packed keys, and of its values
  const std::unique_ptr<uint32_t[]> kp(new uint32_t[G * per_head]), vp(new uint32_t[G * per_head]);
  at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      pack_head(ks + g * C * E, vs + g * C * E, keys, E, kp.get() + g * per_head, vp.get() + g * per_head, n);
  });
  // head-major, so that each thread's contiguous run of tasks holds whole heads: later rows
  // see more keys, and a split by rows would give one thread the longer half
  attend_tasks(H * blocks, [&](int64_t task, Scratch& scratch) {
    const int64_t h = task / blocks, b = task % blocks, g = h / (H / G), r0 = b * ROWS;
    const int64_t first = start + r0;  // the task's row 0 sees keys 0..first
    const int64_t seen = std::min(keys, (first + ROWS + ROWS - 1) / ROWS * ROWS);
    attend_rows(qs + r0 * D + h * E, D, kp.get() + g * per_head, vp.get() + g * per_head, seen,
                static_cast<float>(scale), scratch, dst + r0 * D + h * E, D, std::min(ROWS, T - r0), first);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(caldrix, m) {
  m.def("prompt_attend(Tensor q, Tensor K, Tensor V, int start, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(caldrix, CPU, m) {
  m.impl("prompt_attend", prompt_attend);
}

#endif
