// Mamba2 SSD decode, prefill and ReplaySSM verify on CPU, as XLA FFI handlers (docs/kernels.md#cpu-ffi-kernels).
//
// XLA:CPU runs the reference's state gather, decay, read-out, write and scatter as separate loops, each
// streaming every state from memory. Here each (row, group) work item walks its heads' [P, N] states in place:
// one pass per token reads the state against C and writes its update, and a ring entry's fold runs in the same
// pass as the read that follows it.
//
// Inputs are f32: x [T, NH, P], dt [T, NH] (softplus'd and clamped), A and D [NH], B and C [T, G, N]; head h
// reads group h / (NH / G). The maths and the pool contract: pallas_kernels/mamba2/__init__.py and
// docs/kernels.md#mamba2-ssd. Per token: y = e^{dt A} (h . C) + (dt x)(B . C) + D x, h <- e^{dt A} h + (dt x) B.
//
// Built with -ffp-contract=off: every e * h + (dt x) b rounds the same way wherever it is evaluated, so a verify
// fold of a ring entry reproduces the decode update that made it, bit for bit (ReplaySSM with W = 1).

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ffi.h"

namespace {

using namespace jaxhybrid_cpu;  // NOLINT: the kernels' shared vocabulary

// Partial sums of a dot product: a fixed order (so every evaluation rounds alike) the compiler can vectorise.
constexpr int64_t kLanes = 16;

float Dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * y[i + l];
  }
  for (; i < n; ++i) lanes[i % kLanes] += x[i] * y[i];
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

struct Shape {
  int64_t tokens, rows, heads, groups, p, n, slots, entries;
  int64_t heads_per_group() const { return heads / groups; }
};

// A state update h <- e h + xd (x) b, xd = dt x [P], b [N].
struct Update {
  float e = 0.0f;
  const float* xd = nullptr;
  const float* b = nullptr;
};

// One pass over a [P, N] state from `src`: with `fold`, the state is first advanced (and the result written to
// `fold_dst` where that is not null); with `c`, reads[p] = state[p] . c; with `update`, update_dst = the state
// advanced by it (update_dst may be src). `row` is N floats of scratch.
void StatePass(const Shape& s, const float* src, const Update* fold, float* fold_dst, const float* c, float* reads,
               const Update* update, float* update_dst, float* row) {
  const int64_t N = s.n;
  for (int64_t p = 0; p < s.p; ++p) {
    const float* state = src + p * N;
    if (fold) {
      const float xd = fold->xd[p];
      for (int64_t n = 0; n < N; ++n) row[n] = fold->e * state[n] + xd * fold->b[n];
      if (fold_dst) std::copy(row, row + N, fold_dst + p * N);
      state = row;
    }
    if (c) reads[p] = Dot(state, c, N);
    if (update) {
      const float xd = update->xd[p];
      float* dst = update_dst + p * N;
      for (int64_t n = 0; n < N; ++n) dst[n] = update->e * state[n] + xd * update->b[n];
    }
  }
}

// The item's token inputs, in the order the passes use them.
struct Tokens {
  const Shape& s;
  const float *x, *dt, *a, *b, *c, *d;

  float Decay(int64_t t, int64_t h) const { return std::exp(dt[t * s.heads + h] * a[h]); }
  const float* X(int64_t t, int64_t h) const { return x + (t * s.heads + h) * s.p; }
  const float* B(int64_t t, int64_t g) const { return b + (t * s.groups + g) * s.n; }
  const float* C(int64_t t, int64_t g) const { return c + (t * s.groups + g) * s.n; }

  // y[p] = e reads[p] + xd[p] (B . C) + D x[p], the reference's order of operations.
  void Outputs(int64_t t, int64_t h, int64_t g, float e, const float* xd, const float* reads, float* y) const {
    const float b_dot_c = Dot(B(t, g), C(t, g), s.n);
    const float* xt = X(t, h);
    for (int64_t p = 0; p < s.p; ++p) y[p] = (e * reads[p] + xd[p] * b_dot_c) + d[h] * xt[p];
  }
};

void ScaleBy(float dt, const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = dt * x[i];
}

ffi::Error CheckShape(const Shape& s, const F32Buffer& x, const F32Buffer& dt, const F32Buffer& a,
                      const F32Buffer& b, const F32Buffer& c, const F32Buffer& d, const I32Buffer& cu,
                      const F32Buffer& state, const I32Buffer& slots) {
  const std::vector<int64_t> heads{s.heads};
  bool ok = Dims(x) == std::vector<int64_t>{s.tokens, s.heads, s.p} &&
            Dims(dt) == std::vector<int64_t>{s.tokens, s.heads} && Dims(a) == heads && Dims(d) == heads &&
            Dims(b) == std::vector<int64_t>{s.tokens, s.groups, s.n} && Dims(c) == Dims(b) &&
            Dims(cu) == std::vector<int64_t>{s.rows + 1} && Dims(slots) == std::vector<int64_t>{s.rows} &&
            Dims(state) == std::vector<int64_t>{s.slots, s.heads, s.p, s.n} && s.groups > 0 &&
            s.heads % s.groups == 0;
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument("ssd: inconsistent operand shapes");
}

Shape ShapeOf(const F32Buffer& x, const F32Buffer& b, const I32Buffer& slots, const F32Buffer& state,
              int64_t entries) {
  auto xd = x.dimensions();
  auto sd = state.dimensions();
  Shape s{};
  if (xd.size() != 3 || sd.size() != 4 || b.dimensions().size() != 3 || slots.dimensions().size() != 1) return s;
  s = Shape{xd[0], slots.dimensions()[0], sd[1], b.dimensions()[1], sd[2], sd[3], sd[0], entries};
  return s;
}

// Scratch per item: a state, the pass's row, the reads and two dt x vectors.
size_t ScratchFloats(const Shape& s) { return static_cast<size_t>(s.p * s.n + s.n + 3 * s.p); }

// Rows of any length token by token from their slots' states, each row's final state written back (never to the
// null slot 0). With `has_initial`, a row where it is 0 starts from zeros instead (a fresh prefill row).
ffi::Error SsdRows(ffi::ThreadPool& pool, const F32Buffer& x, const F32Buffer& dt, const F32Buffer& a,
                   const F32Buffer& b, const F32Buffer& c, const F32Buffer& d, const I32Buffer& cu_seqlens,
                   const F32Buffer& state_in, const I32Buffer& slot_ids, const int32_t* has_initial, F32Result& y,
                   F32Result& state_out) {
  const Shape s = ShapeOf(x, b, slot_ids, state_in, 0);
  if (auto error = CheckShape(s, x, dt, a, b, c, d, cu_seqlens, state_in, slot_ids); error.failure()) return error;
  const int32_t* cu = cu_seqlens.typed_data();
  const int32_t* slots = slot_ids.typed_data();
  if (auto error = CheckRows("ssd", s.tokens, s.rows, s.slots, cu, slots); error.failure()) return error;
  AliasOrCopy(state_in, state_out);
  float* states = state_out->typed_data();
  float* out = y->typed_data();
  ZeroPaddingOutputs(s.tokens, s.rows, s.heads * s.p, cu, out);
  const Tokens tokens{s, x.typed_data(), dt.typed_data(), a.typed_data(), b.typed_data(), c.typed_data(),
                      d.typed_data()};
  const int64_t PN = s.p * s.n;

  auto work = [&](int64_t item, float* scratch) {
    const int64_t row = item / s.groups, g = item % s.groups, slot = slots[row];
    float *state_scratch = scratch, *pass_row = scratch + PN, *reads = pass_row + s.n, *xd = reads + s.p;
    for (int64_t h = g * s.heads_per_group(); h < (g + 1) * s.heads_per_group(); ++h) {
      float* page = states + (slot * s.heads + h) * PN;
      float* dst = slot > 0 ? page : state_scratch;  // the null slot's state is never kept
      const bool fresh = has_initial != nullptr && !has_initial[row];
      if (fresh) std::fill(dst, dst + PN, 0.0f);
      const float* cur = fresh ? dst : page;
      for (int64_t t = cu[row]; t < cu[row + 1]; ++t) {
        const float e = tokens.Decay(t, h);
        ScaleBy(dt.typed_data()[t * s.heads + h], tokens.X(t, h), s.p, xd);
        const Update update{e, xd, tokens.B(t, g)};
        StatePass(s, cur, nullptr, nullptr, tokens.C(t, g), reads, &update, dst, pass_row);
        tokens.Outputs(t, h, g, e, xd, reads, out + (t * s.heads + h) * s.p);
        cur = dst;
      }
    }
  };
  ParallelFor(pool, s.rows * s.groups, s.heads_per_group() * PN, ScratchFloats(s), work);
  return ffi::Error::Success();
}

ffi::Error SsdDecodeImpl(ffi::ThreadPool pool, F32Buffer x, F32Buffer dt, F32Buffer a, F32Buffer b, F32Buffer c,
                         F32Buffer d, I32Buffer cu_seqlens, F32Buffer state_in, I32Buffer slot_ids, F32Result y,
                         F32Result state_out) {
  return SsdRows(pool, x, dt, a, b, c, d, cu_seqlens, state_in, slot_ids, nullptr, y, state_out);
}

ffi::Error SsdPrefillImpl(ffi::ThreadPool pool, F32Buffer x, F32Buffer dt, F32Buffer a, F32Buffer b, F32Buffer c,
                          F32Buffer d, I32Buffer cu_seqlens, F32Buffer state_in, I32Buffer slot_ids,
                          I32Buffer has_initial, F32Result y, F32Result state_out) {
  if (Dims(has_initial) != Dims(slot_ids)) return ffi::Error::InvalidArgument("ssd_prefill: has_initial is not [R]");
  return SsdRows(pool, x, dt, a, b, c, d, cu_seqlens, state_in, slot_ids, has_initial.typed_data(), y, state_out);
}

ffi::Error SsdVerifyImpl(ffi::ThreadPool pool, F32Buffer x, F32Buffer dt, F32Buffer a, F32Buffer b, F32Buffer c,
                         F32Buffer d, I32Buffer cu_seqlens, F32Buffer state_in, F32Buffer ring_x_in,
                         F32Buffer ring_dt_in, F32Buffer ring_b_in, I32Buffer slot_ids, I32Buffer ring_start_in,
                         I32Buffer committed_in, I32Buffer flush_in, F32Result y, F32Result state_out,
                         F32Result ring_x_out, F32Result ring_dt_out, F32Result ring_b_out) {
  const auto rd = ring_dt_in.dimensions();
  const Shape s = ShapeOf(x, b, slot_ids, state_in, rd.size() == 3 ? rd[2] : 0);
  if (auto error = CheckShape(s, x, dt, a, b, c, d, cu_seqlens, state_in, slot_ids); error.failure()) return error;
  const std::vector<int64_t> rows{s.rows};
  if (s.entries < 1 || Dims(ring_x_in) != std::vector<int64_t>{s.slots, s.heads, s.entries, s.p} ||
      Dims(ring_dt_in) != std::vector<int64_t>{s.slots, s.heads, s.entries} ||
      Dims(ring_b_in) != std::vector<int64_t>{s.slots, s.groups, s.entries, s.n} || Dims(ring_start_in) != rows ||
      Dims(committed_in) != rows || Dims(flush_in) != rows) {
    return ffi::Error::InvalidArgument("ssd_verify: inconsistent ring or tracker shapes");
  }
  const int32_t* cu = cu_seqlens.typed_data();
  const int32_t* slots = slot_ids.typed_data();
  const int32_t *ring_start = ring_start_in.typed_data(), *committed = committed_in.typed_data();
  const int32_t* flush = flush_in.typed_data();
  if (auto error = CheckVerifyRows("ssd_verify", s.tokens, s.rows, s.slots, s.entries, cu, slots, ring_start,
                                   committed);
      error.failure()) {
    return error;
  }
  AliasOrCopy(state_in, state_out);
  AliasOrCopy(ring_x_in, ring_x_out);
  AliasOrCopy(ring_dt_in, ring_dt_out);
  AliasOrCopy(ring_b_in, ring_b_out);
  float* states = state_out->typed_data();
  float *rx = ring_x_out->typed_data(), *rdt = ring_dt_out->typed_data(), *rb = ring_b_out->typed_data();
  float* out = y->typed_data();
  ZeroPaddingOutputs(s.tokens, s.rows, s.heads * s.p, cu, out);
  const Tokens tokens{s, x.typed_data(), dt.typed_data(), a.typed_data(), b.typed_data(), c.typed_data(),
                      d.typed_data()};
  const float* a_heads = a.typed_data();
  const int64_t PN = s.p * s.n, E = s.entries;

  auto work = [&](int64_t item, float* scratch) {
    const int64_t row = item / s.groups, g = item % s.groups, slot = slots[row];
    const int64_t length = cu[row + 1] - cu[row], count = committed[row];
    const bool store_checkpoint = flush[row] && slot > 0;
    if (length == 0 && !store_checkpoint) return;  // nothing it computes is kept
    float *state_scratch = scratch, *pass_row = scratch + PN, *reads = pass_row + s.n;
    float *fold_xd = reads + s.p, *token_xd = fold_xd + s.p;
    float* ring_b = rb + (slot * s.groups + g) * E * s.n;
    for (int64_t h = g * s.heads_per_group(); h < (g + 1) * s.heads_per_group(); ++h) {
      float* page = states + (slot * s.heads + h) * PN;
      float* ring_x = rx + (slot * s.heads + h) * E * s.p;
      float* ring_dt = rdt + (slot * s.heads + h) * E;
      // S0 advanced by the committed entries: the flush stores it in the page, else it lives in the scratch
      float* fold_dst = store_checkpoint ? page : state_scratch;
      const float* cur = page;
      Update fold;
      bool pending = false;  // the last fold waits to share a pass with the first token's read
      for (int64_t j = 0; j < count; ++j) {
        if (pending) {
          StatePass(s, cur, &fold, fold_dst, nullptr, nullptr, nullptr, nullptr, pass_row);
          cur = fold_dst;
        }
        const int64_t e = (ring_start[row] + j) % E;
        ScaleBy(ring_dt[e], ring_x + e * s.p, s.p, fold_xd);
        fold = Update{std::exp(ring_dt[e] * a_heads[h]), fold_xd, ring_b + e * s.n};
        pending = true;
      }
      for (int64_t t = cu[row], i = 0; t < cu[row + 1]; ++t, ++i) {
        const float e = tokens.Decay(t, h);
        ScaleBy(dt.typed_data()[t * s.heads + h], tokens.X(t, h), s.p, token_xd);
        const Update update{e, token_xd, tokens.B(t, g)};
        const bool last = t + 1 == cu[row + 1];  // the state after the row's last token is never stored
        // only a flush keeps the folded state; otherwise the pass reads it and moves on
        float* fold_write = store_checkpoint ? page : nullptr;
        StatePass(s, cur, pending ? &fold : nullptr, fold_write, tokens.C(t, g), reads, last ? nullptr : &update,
                  state_scratch, pass_row);
        tokens.Outputs(t, h, g, e, token_xd, reads, out + (t * s.heads + h) * s.p);
        cur = state_scratch;
        pending = false;
        if (slot > 0) {
          const int64_t entry = (ring_start[row] + count + i) % E;
          std::copy(tokens.X(t, h), tokens.X(t, h) + s.p, ring_x + entry * s.p);
          ring_dt[entry] = dt.typed_data()[t * s.heads + h];
        }
      }
      if (pending) StatePass(s, cur, &fold, fold_dst, nullptr, nullptr, nullptr, nullptr, pass_row);  // no tokens
    }
    // B is per group: written once every head of the group has folded it
    if (slot > 0) {
      for (int64_t i = 0; i < length; ++i) {
        const float* bt = tokens.B(cu[row] + i, g);
        std::copy(bt, bt + s.n, ring_b + ((ring_start[row] + count + i) % E) * s.n);
      }
    }
  };
  ParallelFor(pool, s.rows * s.groups, s.heads_per_group() * PN, ScratchFloats(s), work);
  return ffi::Error::Success();
}

// The arguments every handler starts with: the tokens, their rows and the state pool.
auto TokenArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<F32Buffer>()   // x [T, NH, P]
      .Arg<F32Buffer>()   // dt [T, NH]
      .Arg<F32Buffer>()   // A [NH]
      .Arg<F32Buffer>()   // B [T, G, N]
      .Arg<F32Buffer>()   // C [T, G, N]
      .Arg<F32Buffer>()   // D [NH]
      .Arg<I32Buffer>()   // cu_seqlens [R + 1]
      .Arg<F32Buffer>();  // state_pool [S, NH, P, N]
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridSsdDecode, SsdDecodeImpl,
                              TokenArgs()
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Ret<F32Buffer>()  // y [T, NH, P]
                                  .Ret<F32Buffer>()  // state_pool, aliased
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridSsdPrefill, SsdPrefillImpl,
                              TokenArgs()
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Arg<I32Buffer>()  // has_initial [R], 0 or 1
                                  .Ret<F32Buffer>()  // y [T, NH, P]
                                  .Ret<F32Buffer>()  // state_pool, aliased
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridSsdVerify, SsdVerifyImpl,
                              TokenArgs()
                                  .Arg<F32Buffer>()  // ring_x [S, NH, E, P]
                                  .Arg<F32Buffer>()  // ring_dt [S, NH, E]
                                  .Arg<F32Buffer>()  // ring_B [S, G, E, N]
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Arg<I32Buffer>()  // ring_start [R]
                                  .Arg<I32Buffer>()  // committed [R]
                                  .Arg<I32Buffer>()  // flush [R], 0 or 1
                                  .Ret<F32Buffer>()  // y [T, NH, P]
                                  .Ret<F32Buffer>()  // state_pool, aliased
                                  .Ret<F32Buffer>()  // ring_x, aliased
                                  .Ret<F32Buffer>()  // ring_dt, aliased
                                  .Ret<F32Buffer>()  // ring_B, aliased
);
