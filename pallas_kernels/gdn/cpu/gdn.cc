// Gated DeltaNet decode, prefill and ReplaySSM verify on CPU, as XLA FFI handlers
// (docs/kernels.md#cpu-ffi-kernels).
//
// XLA:CPU runs the reference's gather, decay, reads, write and scatter over the states as separate loops, each
// streaming every state from memory. Here each (row, qk head) work item walks its value heads' [K, V] states
// in place, fusing every update with the reads that follow it, so a state is read and written once.
//
// Inputs are f32 and pre-normalised by the caller: q^ (scaled) and k^ per qk head [T, H, K], v [T, HV, V],
// g and beta [T, HV]. The maths and the pool contract: pallas_kernels/gdn/__init__.py and
// docs/kernels.md#gated-delta-rule. Value head h reads qk head h / (HV / H).
//
// Built with -ffp-contract=off: every a * s + k * u rounds the same way wherever it is evaluated, so a verify
// fold of an entry reproduces the decode update that made it, bit for bit (ReplaySSM with W = 1).

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ffi.h"

namespace {

using namespace jaxhybrid_cpu;  // NOLINT: the kernels' shared vocabulary

struct Shape {
  int64_t tokens, rows, qk_heads, heads, k, v, slots, entries;
  int64_t group() const { return heads / qk_heads; }
};

// One pass over a [K, V] state: with kUpdate, dst = a * src + key (x) update (dst may be src); with kRead,
// out_k = state^T read_k and out_q = state^T read_q of the state after the update. Sums run in k order.
template <bool kUpdate, bool kRead>
void StatePass(const float* src, float* dst, int64_t K, int64_t V, float a, const float* __restrict key,
               const float* __restrict update, const float* __restrict read_k, const float* __restrict read_q,
               float* __restrict out_k, float* __restrict out_q) {
  if (kRead) {
    std::fill(out_k, out_k + V, 0.0f);
    std::fill(out_q, out_q + V, 0.0f);
  }
  for (int64_t i = 0; i < K; ++i) {
    const float* s = src + i * V;
    float* d = kUpdate ? dst + i * V : nullptr;
    const float ki = kUpdate ? key[i] : 0.0f;
    const float rk = kRead ? read_k[i] : 0.0f;
    const float rq = kRead ? read_q[i] : 0.0f;
    for (int64_t j = 0; j < V; ++j) {
      float x = s[j];
      if (kUpdate) {
        x = a * x + ki * update[j];
        d[j] = x;
      }
      if (kRead) {
        out_k[j] += x * rk;
        out_q[j] += x * rq;
      }
    }
  }
}

// A state update waiting to be fused with the next pass: dst = e^g cur + key (x) update.
struct Pending {
  bool active = false;
  float a = 0.0f;
  const float* key = nullptr;
  const float* update = nullptr;
  float* dst = nullptr;
};

// One value head's walk over its [K, V] state, from the slot's page: each update waits in `pending` and runs
// fused with the next reads (`Read`), or alone where no read follows (`Apply`). Where an update writes (the page
// or the item's scratch) is the caller's choice per update.
struct HeadWalk {
  const Shape& shape;
  float* reads;      // [2, V]
  float* deltas;     // [2, V], alternating: a pending update reads the previous token's
  const float* cur;  // the state the next reads see, once `pending` is applied
  Pending pending;

  void Apply(Pending next) {
    if (pending.active) {
      StatePass<true, false>(cur, pending.dst, shape.k, shape.v, pending.a, pending.key, pending.update, nullptr,
                             nullptr, nullptr, nullptr);
      cur = pending.dst;
    }
    pending = next;
  }

  // The reads of the state (after any pending update) against k^ and q^: reads[0..V) and reads[V..2V).
  void Read(const float* k_hat, const float* q_hat) {
    float* out_k = reads;
    float* out_q = reads + shape.v;
    if (pending.active) {
      StatePass<true, true>(cur, pending.dst, shape.k, shape.v, pending.a, pending.key, pending.update, k_hat,
                            q_hat, out_k, out_q);
      cur = pending.dst;
      pending.active = false;
    } else {
      StatePass<false, true>(cur, nullptr, shape.k, shape.v, 0.0f, nullptr, nullptr, k_hat, q_hat, out_k, out_q);
    }
  }
};

// One token for one value head, after HeadWalk::Read: delta = beta (v - e^g S^T k^), o = e^g S^T q^ + (k^.q^)
// delta (the reference's `recurrent_step`, same order of operations).
void TokenOutputs(const float* reads, int64_t V, float a, float beta, float k_dot_q, const float* v, float* delta,
                  float* o) {
  for (int64_t j = 0; j < V; ++j) delta[j] = beta * (v[j] - a * reads[j]);
  for (int64_t j = 0; j < V; ++j) o[j] = a * reads[V + j] + k_dot_q * delta[j];
}

float Dot(const float* x, const float* y, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

ffi::Error CheckShape(const Shape& s, const F32Buffer& q, const F32Buffer& k, const F32Buffer& v,
                      const F32Buffer& g, const F32Buffer& beta, const I32Buffer& cu, const F32Buffer& state,
                      const I32Buffer& slots) {
  bool ok = Dims(q) == std::vector<int64_t>{s.tokens, s.qk_heads, s.k} && Dims(k) == Dims(q) &&
            Dims(v) == std::vector<int64_t>{s.tokens, s.heads, s.v} &&
            Dims(g) == std::vector<int64_t>{s.tokens, s.heads} && Dims(beta) == Dims(g) &&
            Dims(cu) == std::vector<int64_t>{s.rows + 1} && Dims(slots) == std::vector<int64_t>{s.rows} &&
            Dims(state) == std::vector<int64_t>{s.slots, s.heads, s.k, s.v} && s.qk_heads > 0 &&
            s.heads % s.qk_heads == 0;
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument("gdn: inconsistent operand shapes");
}

Shape ShapeOf(const F32Buffer& q, const F32Buffer& v, const I32Buffer& slots, const F32Buffer& state,
              int64_t entries) {
  auto qd = q.dimensions();
  auto sd = state.dimensions();
  Shape s{};
  if (qd.size() != 3 || sd.size() != 4 || v.dimensions().size() != 3 || slots.dimensions().size() != 1) return s;
  s.tokens = qd[0];
  s.qk_heads = qd[1];
  s.k = qd[2];
  s.heads = sd[1];
  s.v = sd[3];
  s.slots = sd[0];
  s.rows = slots.dimensions()[0];
  s.entries = entries;
  return s;
}

size_t ScratchFloats(const Shape& s) { return static_cast<size_t>(s.k * s.v + 4 * s.v); }

// Rows of any length token by token from their slots' states, each row's final state written back (never to the
// null slot 0). With `has_initial`, a row where it is 0 starts from zeros instead (a fresh prefill row).
ffi::Error GdnRows(ffi::ThreadPool& pool, const F32Buffer& q, const F32Buffer& k, const F32Buffer& v,
                   const F32Buffer& g, const F32Buffer& beta, const I32Buffer& cu_seqlens, const F32Buffer& state_in,
                   const I32Buffer& slot_ids, const int32_t* has_initial, F32Result& o, F32Result& state_out) {
  const Shape s = ShapeOf(q, v, slot_ids, state_in, 0);
  if (auto error = CheckShape(s, q, k, v, g, beta, cu_seqlens, state_in, slot_ids); error.failure()) return error;
  const int32_t* cu = cu_seqlens.typed_data();
  const int32_t* slots = slot_ids.typed_data();
  if (auto error = CheckRows("gdn", s.tokens, s.rows, s.slots, cu, slots); error.failure()) return error;
  AliasOrCopy(state_in, state_out);
  float* states = state_out->typed_data();
  float* out = o->typed_data();
  ZeroPaddingOutputs(s.tokens, s.rows, s.heads * s.v, cu, out);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *gp = g.typed_data(), *bp = beta.typed_data();
  const int64_t group = s.group(), K = s.k, V = s.v, KV = K * V;

  auto work = [&](int64_t item, float* scratch) {
    const int64_t row = item / s.qk_heads, h = item % s.qk_heads, slot = slots[row];
    for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
      float* page = states + (slot * s.heads + hv) * KV;
      float* update_dst = slot > 0 ? page : scratch;
      const bool fresh = has_initial != nullptr && !has_initial[row];
      if (fresh) std::fill(update_dst, update_dst + KV, 0.0f);
      HeadWalk walk{s, scratch + KV, scratch + KV + 2 * V, fresh ? update_dst : page, {}};
      for (int64_t t = cu[row], i = 0; t < cu[row + 1]; ++t, ++i) {
        const float* q_hat = qp + (t * s.qk_heads + h) * K;
        const float* k_hat = kp + (t * s.qk_heads + h) * K;
        walk.Read(k_hat, q_hat);
        const float a = std::exp(gp[t * s.heads + hv]);
        float* delta = walk.deltas + (i % 2) * V;
        TokenOutputs(walk.reads, V, a, bp[t * s.heads + hv], Dot(k_hat, q_hat, K), vp + (t * s.heads + hv) * V,
                     delta, out + (t * s.heads + hv) * V);
        walk.pending = Pending{true, a, k_hat, delta, update_dst};
      }
      if (slot > 0) walk.Apply(Pending{});  // the final state is the row's one write
    }
  };
  ParallelFor(pool, s.rows * s.qk_heads, group * KV, ScratchFloats(s), work);
  return ffi::Error::Success();
}

ffi::Error GdnDecodeImpl(ffi::ThreadPool pool, F32Buffer q, F32Buffer k, F32Buffer v, F32Buffer g, F32Buffer beta,
                         I32Buffer cu_seqlens, F32Buffer state_in, I32Buffer slot_ids, F32Result o,
                         F32Result state_out) {
  return GdnRows(pool, q, k, v, g, beta, cu_seqlens, state_in, slot_ids, nullptr, o, state_out);
}

ffi::Error GdnPrefillImpl(ffi::ThreadPool pool, F32Buffer q, F32Buffer k, F32Buffer v, F32Buffer g,
                          F32Buffer beta, I32Buffer cu_seqlens, F32Buffer state_in, I32Buffer slot_ids,
                          I32Buffer has_initial, F32Result o, F32Result state_out) {
  if (Dims(has_initial) != Dims(slot_ids)) return ffi::Error::InvalidArgument("gdn_prefill: has_initial is not [R]");
  return GdnRows(pool, q, k, v, g, beta, cu_seqlens, state_in, slot_ids, has_initial.typed_data(), o, state_out);
}

ffi::Error GdnVerifyImpl(ffi::ThreadPool pool, F32Buffer q, F32Buffer k, F32Buffer v, F32Buffer g, F32Buffer beta,
                         I32Buffer cu_seqlens, F32Buffer state_in, F32Buffer ring_k_in, F32Buffer ring_u_in,
                         F32Buffer ring_g_in, I32Buffer slot_ids, I32Buffer ring_start_in, I32Buffer committed_in,
                         I32Buffer flush_in, F32Result o, F32Result state_out, F32Result ring_k_out,
                         F32Result ring_u_out, F32Result ring_g_out) {
  const auto gd = ring_g_in.dimensions();
  const Shape s = ShapeOf(q, v, slot_ids, state_in, gd.size() == 3 ? gd[2] : 0);
  if (auto error = CheckShape(s, q, k, v, g, beta, cu_seqlens, state_in, slot_ids); error.failure()) return error;
  const std::vector<int64_t> rows{s.rows};
  if (s.entries < 1 || Dims(ring_k_in) != std::vector<int64_t>{s.slots, s.qk_heads, s.entries, s.k} ||
      Dims(ring_u_in) != std::vector<int64_t>{s.slots, s.heads, s.entries, s.v} ||
      Dims(ring_g_in) != std::vector<int64_t>{s.slots, s.heads, s.entries} || Dims(ring_start_in) != rows ||
      Dims(committed_in) != rows || Dims(flush_in) != rows) {
    return ffi::Error::InvalidArgument("gdn_verify: inconsistent ring or tracker shapes");
  }
  const int32_t* cu = cu_seqlens.typed_data();
  const int32_t* slots = slot_ids.typed_data();
  const int32_t *ring_start = ring_start_in.typed_data(), *committed = committed_in.typed_data();
  const int32_t* flush = flush_in.typed_data();
  if (auto error = CheckVerifyRows("gdn_verify", s.tokens, s.rows, s.slots, s.entries, cu, slots, ring_start,
                                   committed);
      error.failure()) {
    return error;
  }
  AliasOrCopy(state_in, state_out);
  AliasOrCopy(ring_k_in, ring_k_out);
  AliasOrCopy(ring_u_in, ring_u_out);
  AliasOrCopy(ring_g_in, ring_g_out);
  float* states = state_out->typed_data();
  float *rk = ring_k_out->typed_data(), *ru = ring_u_out->typed_data(), *rg = ring_g_out->typed_data();
  float* out = o->typed_data();
  ZeroPaddingOutputs(s.tokens, s.rows, s.heads * s.v, cu, out);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *gp = g.typed_data(), *bp = beta.typed_data();
  const int64_t group = s.group(), K = s.k, V = s.v, E = s.entries, KV = K * V;

  auto work = [&](int64_t item, float* scratch) {
    const int64_t row = item / s.qk_heads, h = item % s.qk_heads, slot = slots[row];
    const int64_t length = cu[row + 1] - cu[row], count = committed[row];
    const bool store_checkpoint = flush[row] && slot > 0;
    if (length == 0 && !store_checkpoint) return;  // nothing it computes is kept
    float* keys = rk + (slot * s.qk_heads + h) * E * K;
    for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
      float* page = states + (slot * s.heads + hv) * KV;
      float* updates = ru + (slot * s.heads + hv) * E * V;
      float* decays = rg + (slot * s.heads + hv) * E;
      HeadWalk walk{s, scratch + KV, scratch + KV + 2 * V, page, {}};
      // S0 advanced by the committed entries: the flush stores it in the page, else it lives in the scratch
      float* fold_dst = store_checkpoint ? page : scratch;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t e = (ring_start[row] + j) % E;
        walk.Apply(Pending{true, std::exp(decays[e]), keys + e * K, updates + e * V, fold_dst});
      }
      for (int64_t t = cu[row], i = 0; t < cu[row + 1]; ++t, ++i) {
        const float* q_hat = qp + (t * s.qk_heads + h) * K;
        const float* k_hat = kp + (t * s.qk_heads + h) * K;
        walk.Read(k_hat, q_hat);  // applies the folds first: the ring entries below are free from here on
        const float g_t = gp[t * s.heads + hv], a = std::exp(g_t);
        float* delta = walk.deltas + (i % 2) * V;
        TokenOutputs(walk.reads, V, a, bp[t * s.heads + hv], Dot(k_hat, q_hat, K), vp + (t * s.heads + hv) * V,
                     delta, out + (t * s.heads + hv) * V);
        if (slot > 0) {
          const int64_t e = (ring_start[row] + count + i) % E;
          std::copy(delta, delta + V, updates + e * V);
          decays[e] = g_t;
        }
        // the state after the row's last token is never stored: no pass for it
        walk.pending = t + 1 < cu[row + 1] ? Pending{true, a, k_hat, delta, scratch} : Pending{};
      }
      if (walk.pending.dst == page) walk.Apply(Pending{});  // a flushed row without tokens
    }
    // the keys are per qk head: written once every value head of the group has folded them
    if (slot > 0) {
      for (int64_t i = 0; i < length; ++i) {
        const float* k_hat = kp + ((cu[row] + i) * s.qk_heads + h) * K;
        std::copy(k_hat, k_hat + K, keys + ((ring_start[row] + count + i) % E) * K);
      }
    }
  };
  ParallelFor(pool, s.rows * s.qk_heads, group * KV, ScratchFloats(s), work);
  return ffi::Error::Success();
}

// The arguments every handler starts with: the tokens, their rows and the state pool.
auto TokenArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<F32Buffer>()   // q^ [T, H, K]
      .Arg<F32Buffer>()   // k^ [T, H, K]
      .Arg<F32Buffer>()   // v [T, HV, V]
      .Arg<F32Buffer>()   // g [T, HV]
      .Arg<F32Buffer>()   // beta [T, HV]
      .Arg<I32Buffer>()   // cu_seqlens [R + 1]
      .Arg<F32Buffer>();  // state_pool [S, HV, K, V]
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridGdnDecode, GdnDecodeImpl,
                              TokenArgs()
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Ret<F32Buffer>()  // o [T, HV, V]
                                  .Ret<F32Buffer>()  // state_pool, aliased
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridGdnPrefill, GdnPrefillImpl,
                              TokenArgs()
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Arg<I32Buffer>()  // has_initial [R], 0 or 1
                                  .Ret<F32Buffer>()  // o [T, HV, V]
                                  .Ret<F32Buffer>()  // state_pool, aliased
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridGdnVerify, GdnVerifyImpl,
                              TokenArgs()
                                  .Arg<F32Buffer>()  // ring_k [S, H, E, K]
                                  .Arg<F32Buffer>()  // ring_u [S, HV, E, V]
                                  .Arg<F32Buffer>()  // ring_g [S, HV, E]
                                  .Arg<I32Buffer>()  // slots [R]
                                  .Arg<I32Buffer>()  // ring_start [R]
                                  .Arg<I32Buffer>()  // committed [R]
                                  .Arg<I32Buffer>()  // flush [R], 0 or 1
                                  .Ret<F32Buffer>()  // o [T, HV, V]
                                  .Ret<F32Buffer>()  // state_pool, aliased
                                  .Ret<F32Buffer>()  // ring_k, aliased
                                  .Ret<F32Buffer>()  // ring_u, aliased
                                  .Ret<F32Buffer>()  // ring_g, aliased
);
