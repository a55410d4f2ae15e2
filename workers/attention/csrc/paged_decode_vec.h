// The paged-decode kernel's AVX-512 path (`paged_decode.cpp` dispatches to it): head dims 64
// and 128, float32 or bfloat16 KV.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "paged_decode_common.h"
#include "vec_math.h"

namespace cachesvc_paged {

// `attend_pages`' online softmax (paged_decode.cpp) with AVX-512, head dim 64 or 128, in
// chunks of 16 tokens: each key row is read once for the query heads of its KV head, its 16
// lanes of partial products per head kept, and the chunk's 16 scores made by one transposing
// sum of those 16 vectors (45 instructions, where one horizontal sum per token and head took
// ~9); the value rows are then read once for the group's heads, their outputs in registers.
// The next page is asked into L2 while a page is scored (`prefetch_part`).

using cachesvc_vec::exp2_neg16;
using cachesvc_vec::load16;

// Lane t of the result = the sum of v[t]'s 16 lanes.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// parts[g][t] = lanes of q_g · k_t for the NG heads of one KV head, tokens t < nt of a chunk
// (zeros past nt).
template <typename KV, int64_t kD, int NG>
inline void chunk_products(const float* q, const KV* k, int64_t nt, int64_t token_stride,
                           __m512 (*parts)[16]) {
  constexpr int V = kD / 16;
  __m512 qv[NG][V];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < V; ++j) qv[g][j] = _mm512_loadu_ps(q + g * kD + 16 * j);
  for (int64_t t = 0; t < nt; ++t) {
    __m512 kv[V];
    for (int j = 0; j < V; ++j) kv[j] = load16(k + t * token_stride + 16 * j);
    for (int g = 0; g < NG; ++g) {
      __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int j = 1; j < V; ++j) s = _mm512_fmadd_ps(qv[g][j], kv[j], s);
      parts[g][t] = s;
    }
  }
  for (int64_t t = nt; t < 16; ++t)
    for (int g = 0; g < NG; ++g) parts[g][t] = _mm512_setzero_ps();
}

// acc_g = acc_g * rescale[g] + sum over t < nt of w[g][t] * v_t, for NG heads of one KV head.
template <typename KV, int64_t kD, int NG>
inline void chunk_values(float* acc, const float* rescale, const float (*w)[16], const KV* v,
                         int64_t nt, int64_t token_stride) {
  constexpr int V = kD / 16;
  __m512 a[NG][V];
  for (int g = 0; g < NG; ++g) {
    const __m512 r = _mm512_set1_ps(rescale[g]);
    for (int j = 0; j < V; ++j) a[g][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + 16 * j), r);
  }
  for (int64_t t = 0; t < nt; ++t) {
    __m512 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = load16(v + t * token_stride + 16 * j);
    for (int g = 0; g < NG; ++g) {
      const __m512 wt = _mm512_set1_ps(w[g][t]);
      for (int j = 0; j < V; ++j) a[g][j] = _mm512_fmadd_ps(wt, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(acc + g * kD + 16 * j, a[g][j]);
}

// One chunk of up to 16 tokens for NG query heads (q, m, l, acc at those heads) of one KV head.
template <typename KV, int64_t kD, int NG>
void attend_chunk(const float* q, const KV* k, const KV* v, int64_t nt, int64_t token_stride,
                  float* m, float* l, float* acc) {
  __m512 parts[NG][16];
  float w[NG][16], rescale[NG];
  chunk_products<KV, kD, NG>(q, k, nt, token_stride, parts);
  const __mmask16 live = static_cast<__mmask16>((1u << nt) - 1);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < NG; ++g) {
    const __m512 s = _mm512_mask_blend_ps(live, minus_inf, sum_lanes16(parts[g]));
    const float m_new = std::max(m[g], _mm512_reduce_max_ps(s));
    rescale[g] = exp2_neg(m[g] - m_new);  // ~0 on the first chunk (m = -inf)
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_neg16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    l[g] = l[g] * rescale[g] + _mm512_reduce_add_ps(e);
    m[g] = m_new;
    _mm512_storeu_ps(w[g], e);
  }
  chunk_values<KV, kD, NG>(acc, rescale, w, v, nt, token_stride);
}

// Share `pass` of `passes` of the lines of [span, span + bytes) asked into L2. Pages lie anywhere
// in the pool and a head's rows are strided by the token, so the hardware's prefetcher finds
// no stream to follow: each head pass over a page waited on its misses a few at a time. Asking
// for the next page while this one is scored, spread over this page's passes, took decode
// attention over 1,024-token contexts from 166-178 to 139-145 ns a token and layer on one thread
// (docs/benchmarks/step.md). Into L1 (T0) it was slower than no prefetch: the requests crowd out
// the loads the pass is waiting on.
inline void prefetch_part(const char* span, int64_t bytes, int64_t pass, int64_t passes) {
  const int64_t lines = (bytes + 63) / 64;
  const int64_t first = lines * pass / passes, last = lines * (pass + 1) / passes;
  for (int64_t i = first; i < last; ++i) _mm_prefetch(span + 64 * i, _MM_HINT_T1);
}

// The group's query heads a pass: their q rows, partial products and outputs in registers.
template <int64_t kD>
constexpr int kHeadsPerPass = kD == 64 ? 4 : 2;

template <typename KV, int64_t kD>
void attend_pages_vec(const float* q, const KV* kv, const int32_t* pages, int64_t lo, int64_t hi,
                      int64_t kv_len, const Shape& sh, const CacheStrides& st, float* m, float* l,
                      float* acc) {
  const int64_t Hq = sh.num_qo_heads(), G = sh.group, ps = sh.page_size;
  constexpr int NGmax = kHeadsPerPass<kD>;
  std::fill(m, m + Hq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Hq, 0.f);
  std::fill(acc, acc + Hq * kD, 0.f);
  // A page's keys then values, contiguous: the span the next page's prefetch covers.
  const int64_t page_bytes = 2 * st.kv * static_cast<int64_t>(sizeof(KV));
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t n = std::min(ps, kv_len - p * ps);
    const KV* k_page = kv + static_cast<int64_t>(pages[p]) * st.page;
    const KV* v_page = k_page + st.kv;
    const char* next = p + 1 < hi ? reinterpret_cast<const char*>(
                                        kv + static_cast<int64_t>(pages[p + 1]) * st.page)
                                  : nullptr;
    const int64_t passes = (n + 15) / 16 * sh.num_kv_heads;
    int64_t pass = 0;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t nt = std::min<int64_t>(16, n - t0);
      for (int64_t h = 0; h < sh.num_kv_heads; ++h, ++pass) {
        const KV* k = k_page + t0 * st.token + h * st.head;
        const KV* v = v_page + t0 * st.token + h * st.head;
        if (next != nullptr) prefetch_part(next, page_bytes, pass, passes);
        for (int64_t g0 = 0; g0 < G; g0 += NGmax) {
          const int64_t hq = h * G + g0;
          float *mg = m + hq, *lg = l + hq, *ag = acc + hq * kD;
          const float* qg = q + hq * kD;
          switch (std::min<int64_t>(NGmax, G - g0)) {
            case 1: attend_chunk<KV, kD, 1>(qg, k, v, nt, st.token, mg, lg, ag); break;
            case 2: attend_chunk<KV, kD, 2>(qg, k, v, nt, st.token, mg, lg, ag); break;
            case 3: attend_chunk<KV, kD, 3>(qg, k, v, nt, st.token, mg, lg, ag); break;
            default: attend_chunk<KV, kD, NGmax>(qg, k, v, nt, st.token, mg, lg, ag); break;
          }
        }
      }
    }
  }
}

}  // namespace cachesvc_paged

#endif
