// A decoder layer's elementwise steps on CPU, each one pass over its rows: RMSNorm (with the
// residual add before it), rotate-half RoPE on the q and k heads, and SwiGLU's silu(gate) * up.
//
// In eager torch each of them is several ops (RMSNorm alone is pow, mean, add, rsqrt and two
// muls), and each op is a dispatch and a pass over memory: at decode's one row a layer's
// elementwise work was ~30 dispatches, ~5 ms of a 31 ms step for SmolLM2 on one thread; at
// prefill's thousand rows silu and the rotation's muls and cat were each a pass over megabytes.
//
// What each computes is torch's (and Hugging Face's) arithmetic, op by op, rounded to the
// tensor's dtype where torch stores an intermediate tensor: RoPE's products and sums give the
// same bits (no fused multiply-add: the pragma below keeps a*b - c*d two roundings).
// Two steps differ in the last bits: RMSNorm's mean sums 16 lanes then folds them (fixed per
// row length, whatever the rows or threads), and silu's exp is a polynomial (vec_math.h,
// relative error under 2e-7) where ATen uses Sleef.
//
// Registered as torch.ops.cachesvc.{rms_norm, add_rms_norm, rope_qk, silu_mul}, float32 or
// bfloat16 with contiguous rows (checked here; `workers/model/layer_ops.py` falls back to torch
// where they do not apply), and write_kv, a new token's keys and values into their page slots.

// GCC contracts a*b - c*d into one fused multiply-add by default, rounding once where torch
// rounds twice; the vector helpers' own FMAs (vec_math.h) are explicit and stay.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "claim.h"
#include "vec_math.h"

namespace {

// Elements a call must reach before its rows are shared among threads.
constexpr int64_t kMinParallelElements = 1 << 16;
constexpr float kLog2E = 1.4426950408889634f;

template <typename T>
inline float f(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline float rounded(float v) {  // v stored in a T tensor and read back
  return static_cast<float>(static_cast<T>(v));
}

// fn(row) for rows [0, rows), shared among threads when there are `elements` enough.
template <typename Fn>
void for_rows(int64_t rows, int64_t elements, const Fn& fn) {
  const int64_t max_threads = std::max<int64_t>(1, elements / kMinParallelElements);
  constexpr int64_t kRowsAnItem = 8;
  const int64_t items = (rows + kRowsAnItem - 1) / kRowsAnItem;
  cachesvc_claim::claim_items(items, max_threads, [&](auto claim) {
    for (int64_t i; (i = claim()) >= 0;)
      for (int64_t r = i * kRowsAnItem; r < std::min(rows, (i + 1) * kRowsAnItem); ++r) fn(r);
  });
}

// ---- RMSNorm --------------------------------------------------------------------------------

// out = w * T(x * rsqrt(mean(x^2) + eps)), as Hugging Face's LlamaRMSNorm (in float32, the
// normalised row rounded to T before the weight's product). With `add`, x += add first (rounded
// to T, written back: the residual stream).
template <typename T>
void norm_row(T* x, const T* add, const T* w, int64_t H, float eps, T* out) {
  int64_t j = 0;
  float ss = 0.f;
#ifdef __AVX512F__
  using namespace cachesvc_vec;
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= H; j += 16) {
    __m512 v = load16(x + j);
    if (add != nullptr) {
      v = round_to(_mm512_add_ps(v, load16(add + j)), x);
      store16(x + j, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; j < H; ++j) {
    float v = f(x[j]);
    if (add != nullptr) {
      v = rounded<T>(v + f(add[j]));
      x[j] = static_cast<T>(v);
    }
    ss += v * v;
  }
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  j = 0;
#ifdef __AVX512F__
  const __m512 r = _mm512_set1_ps(rstd);
  for (; j + 16 <= H; j += 16) {
    const __m512 normed = round_to(_mm512_mul_ps(load16(x + j), r), x);
    store16(out + j, _mm512_mul_ps(load16(w + j), normed));
  }
#endif
  for (; j < H; ++j) out[j] = static_cast<T>(f(w[j]) * rounded<T>(f(x[j]) * rstd));
}

template <typename T>
void norm_rows(at::Tensor& x, const at::Tensor* add, const at::Tensor& w, double eps,
               at::Tensor& out) {
  const int64_t rows = x.size(0), H = x.size(1);
  T* xd = x.data_ptr<T>();
  const T* ad = add == nullptr ? nullptr : add->data_ptr<T>();
  const T* wd = w.data_ptr<T>();
  T* od = out.data_ptr<T>();
  for_rows(rows, rows * H, [&](int64_t r) {
    norm_row<T>(xd + r * H, ad == nullptr ? nullptr : ad + r * H, wd, H, static_cast<float>(eps),
                od + r * H);
  });
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.sizes() == like.sizes() &&
                  t.scalar_type() == like.scalar_type(),
              what, ": a contiguous CPU tensor like x");
}

template <typename Fn>
void by_dtype(const at::Tensor& t, const char* op, const Fn& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16, not ", t.scalar_type());
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.is_contiguous(), "x: contiguous [T, H] on CPU");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "w: [H] of x's dtype");
  check_rows(out, x, "out");
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor out) {
  check_norm(x, w, out);
  at::Tensor in = x;
  by_dtype(x, "rms_norm", [&](auto t) { norm_rows<decltype(t)>(in, nullptr, w, eps, out); });
}

void add_rms_norm(at::Tensor x, const at::Tensor& add, const at::Tensor& w, double eps,
                  at::Tensor out) {
  check_norm(x, w, out);
  check_rows(add, x, "add");
  by_dtype(x, "add_rms_norm", [&](auto t) { norm_rows<decltype(t)>(x, &add, w, eps, out); });
}

// ---- RoPE -----------------------------------------------------------------------------------

// The first `heads` heads of a row of qkv, rotate-half: for i < D/2, with x1 = x[i] and
// x2 = x[i + D/2], out[i] = x1 c - x2 s and out[i + D/2] = x2 c + x1 s, each product and sum
// rounded to T (torch's ops on T tensors: x1 * cos, x2 * sin, their difference, ...).
template <typename T>
void rope_row(const T* x, const T* c, const T* s, int64_t heads, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x1 = x + h * D;
    const T* x2 = x1 + half;
    T* o1 = out + h * D;
    T* o2 = o1 + half;
    int64_t i = 0;
#ifdef __AVX512F__
    using namespace cachesvc_vec;
    for (; i + 16 <= half; i += 16) {
      const __m512 a = load16(x1 + i), b = load16(x2 + i), cv = load16(c + i), sv = load16(s + i);
      const __m512 ac = round_to(_mm512_mul_ps(a, cv), x), bs = round_to(_mm512_mul_ps(b, sv), x);
      const __m512 bc = round_to(_mm512_mul_ps(b, cv), x), as = round_to(_mm512_mul_ps(a, sv), x);
      store16(o1 + i, _mm512_sub_ps(ac, bs));
      store16(o2 + i, _mm512_add_ps(bc, as));
    }
#endif
    for (; i < half; ++i) {
      const float a = f(x1[i]), b = f(x2[i]), cv = f(c[i]), sv = f(s[i]);
      o1[i] = static_cast<T>(rounded<T>(a * cv) - rounded<T>(b * sv));
      o2[i] = static_cast<T>(rounded<T>(b * cv) + rounded<T>(a * sv));
    }
  }
}

void rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             at::Tensor out) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.device().is_cpu() && qkv.stride(1) == 1,
              "qkv: [T, C] on CPU, rows contiguous");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.size(0) == qkv.size(0) &&
                  out.size(1) == heads && out.scalar_type() == qkv.scalar_type(),
              "out: contiguous [T, heads, D] of qkv's dtype");
  const int64_t T = qkv.size(0), D = out.size(2);
  TORCH_CHECK(D % 2 == 0 && heads * D <= qkv.size(1), "heads * D within a row of qkv, D even");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->dim() == 2 && table->size(0) == T && table->size(1) == D / 2 &&
                    table->stride(1) == 1 && table->scalar_type() == qkv.scalar_type(),
                "cos, sin: [T, D / 2] of qkv's dtype, rows contiguous");
  }
  by_dtype(qkv, "rope_qk", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* x = qkv.data_ptr<T_>();
    const T_* c = cos.data_ptr<T_>();
    const T_* s = sin.data_ptr<T_>();
    T_* o = out.data_ptr<T_>();
    for_rows(T, T * heads * D, [&](int64_t t) {
      rope_row<T_>(x + t * qkv.stride(0), c + t * cos.stride(0), s + t * sin.stride(0), heads, D,
                   o + t * heads * D);
    });
  });
}

// ---- SwiGLU ---------------------------------------------------------------------------------

// out[i] = T(T(silu(g[i])) * u[i]) for a row [gate | up] of 2 I values; silu(g) = g / (1 + e^-g).
template <typename T>
void silu_mul_row(const T* g, int64_t I, T* out) {
  const T* u = g + I;
  int64_t i = 0;
#ifdef __AVX512F__
  using namespace cachesvc_vec;
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; i + 16 <= I; i += 16) {
    const __m512 x = load16(g + i);
    // e = e^-|x| (never overflows); silu = x / (1 + e) for x >= 0, x e / (1 + e) below.
    const __m512 neg_abs = _mm512_or_ps(x, sign);
    const __m512 e = exp2_neg16(_mm512_mul_ps(neg_abs, _mm512_set1_ps(kLog2E)));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
    const __m512 silu = round_to(_mm512_div_ps(num, _mm512_add_ps(one, e)), g);
    store16(out + i, _mm512_mul_ps(silu, load16(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float x = f(g[i]);
    out[i] = static_cast<T>(rounded<T>(x / (1.f + std::exp(-x))) * f(u[i]));
  }
}

void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.device().is_cpu() && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [T, 2 I] on CPU");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == gate_up.size(0) &&
                  out.size(1) * 2 == gate_up.size(1) && out.scalar_type() == gate_up.scalar_type(),
              "out: contiguous [T, I] of gate_up's dtype");
  const int64_t T = gate_up.size(0), I = out.size(1);
  by_dtype(gate_up, "silu_mul", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* g = gate_up.data_ptr<T_>();
    T_* o = out.data_ptr<T_>();
    for_rows(T, T * I, [&](int64_t t) { silu_mul_row<T_>(g + t * 2 * I, I, o + t * I); });
  });
}

// ---- KV write ---------------------------------------------------------------------------------

// kv_cache [pages, 2, page_size, Hk, D]: token t's keys and values into slot slots[t] (page
// slot / page_size, offset slot % page_size). One call a layer where indexing took five (two
// index computations, a stack, a cast and an index_put: ~46 us a layer at one row).
void write_kv(at::Tensor kv_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.device().is_cpu() &&
                  kv_cache.is_contiguous(),
              "kv_cache: contiguous [pages, 2, page_size, Hk, D] on CPU");
  const int64_t T = slots.numel(), row = kv_cache.size(3) * kv_cache.size(4);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots: contiguous [T] int64");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) * t->size(2) == row &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    t->scalar_type() == kv_cache.scalar_type(),
                "k, v: [T, Hk, D] of the cache's dtype, heads contiguous");
  }
  const int64_t page_size = kv_cache.size(2), num_slots = kv_cache.size(0) * page_size;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t], " outside ",
                num_slots);
  const int64_t bytes = row * kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kd = static_cast<const char*>(k.data_ptr());
  const char* vd = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
    char* key_row = cache + ((page * 2) * page_size + offset) * bytes;
    std::memcpy(key_row, kd + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(key_row + page_size * bytes, vd + t * v.stride(0) * v.element_size(), bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachesvc, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor add, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int heads, Tensor(a!) out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(cachesvc, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
  m.impl("write_kv", &write_kv);
}
