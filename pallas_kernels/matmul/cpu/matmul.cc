// A bf16 matmul on CPU, as an XLA FFI handler (docs/kernels.md#bf16-matmuls-on-cpu): out[M, N] = bf16(x[M, K] w[K, N])
// with f32 accumulation, rounded once, as XLA's bf16 dot; w comes packed ahead of time (bf16_gemm.h's form,
// [N / 32, K / 2, 32, 2]).
//
// At decode sizes (a few dozen rows) a projection does little arithmetic per byte of its weight, so its speed is
// the weight's read: packed, the weight streams from memory in order, once. The work items are blocks of
// kBlockStrips strips, shared among XLA's intra-op threads; each runs every row of x against its strips, one strip
// (K * 64 bytes) staying in the core's cache through all the rows.

#include <cstdint>

#include "bf16_gemm.h"
#include "cpu_ffi.h"

namespace {

using namespace jaxhybrid_cpu;  // NOLINT: the kernels' shared vocabulary

using Bf16Buffer = ffi::Buffer<ffi::BF16>;
using Bf16Result = ffi::ResultBuffer<ffi::BF16>;

constexpr int64_t kBlockStrips = 4;  // strips per work item: 128 columns
constexpr int64_t kBlockColumns = kBlockStrips * kStrip;

ffi::Error MatmulImpl(ffi::ThreadPool pool, Bf16Buffer x, Bf16Buffer w, Bf16Result out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || wd[2] != kStrip || wd[3] != 2 || xd[1] != 2 * wd[1] ||
      od[0] != xd[0] || od[1] != wd[0] * kStrip) {
    return ffi::Error::InvalidArgument("bf16_matmul: x [M, K], packed w [N / 32, K / 2, 32, 2], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = od[1];
  const uint16_t* a = x.typed_data();
  const uint16_t* packed = w.typed_data();
  uint16_t* c = out->typed_data();
  auto work = [&](int64_t block, float* acc) {  // acc: the block's f32 accumulators [M, kBlockColumns]
    const int64_t first = block * kBlockColumns, width = std::min(kBlockColumns, N - first);
    Gemm(a, M, Packed{packed + first * K, K, width}, acc, width);
    for (int64_t m = 0; m < M; ++m) StoreBf16(acc + m * width, width, c + m * N + first);
  };
  ParallelFor(pool, (N + kBlockColumns - 1) / kBlockColumns, K * kBlockColumns, M * kBlockColumns, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridBf16Matmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Buffer>()   // x [M, K]
                                  .Arg<Bf16Buffer>()   // w, packed [N / 32, K / 2, 32, 2]
                                  .Ret<Bf16Buffer>());  // out [M, N]
