// Attention of a prefill chunk's queries over its keys, on CPU: flash attention with the keys
// transposed once, so neither product needs a horizontal sum.
//
// q [Lq, Hq, D] over k, v [Lk, Hk, D] (GQA: query head h reads KV head h / (Hq / Hk)); with
// `causal`, bottom-right: query i sees key j iff j <= i + Lk - Lq (the chunk's queries are the
// last Lq tokens, after Lk - Lq cached ones). A work item is kRows consecutive queries of one
// head. For each run of 64 keys up to the item's last visible one:
//   scores  S [rows, 64] = Q · Kᵀ, as outer products: for each d, 4 vectors of Kᵀ[d] (64 keys)
//           times each row's q[d] broadcast, 24 accumulators in registers;
//   softmax online per row in base 2 (running max, and the running sum as 16 lane sums added
//           up once at the end), masked keys weigh 0;
//   output  O [rows, D] += P · V: each value row read once for the item's rows, the rows'
//           outputs in registers (a head dim of 128 in two halves of 64).
// Kᵀ is laid out once per call and KV head ([D, Lk] in float32, a few hundred KB at a prefill's
// lengths, in L2 while its head's items run). A run of 64 keys past the diagonal is skipped
// whole, so a causal square costs about half of a full one.
//
// Semantics are FlashInfer's (research notes §10), as `workers/attention/ops.py`: output in q's
// dtype, LSE in base 2, a query with no visible key gives output 0 and LSE -inf. float32 or
// bfloat16 (widened to float32 as laid out; float32 sums). Registered as
// torch.ops.cachesvc.prefill_attention(q, k, v, sm_scale, causal, out, lse).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "claim.h"
#include "vec_math.h"

namespace {

constexpr float kLog2E = 1.4426950408889634f;
constexpr int64_t kRows = 6;  // queries an item: 6 x 4 score and 6 x 4 output accumulators
constexpr int64_t kKeys = 64;  // keys a run
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0, 0 for -inf (scalar; the vector path has its own).
inline float exp2_neg(float x) {
  if (x == kNegInf) return 0.f;
  return std::exp2(x);
}

struct Problem {
  int64_t Lq, Lk, Hq, Hk, D, group, shift;  // shift = Lk - Lq: query i's diagonal key
  bool causal;
  // The last key query i sees (-1: none).
  int64_t last_key(int64_t i) const {
    return causal ? std::min(Lk - 1, i + shift) : Lk - 1;
  }
};

#ifdef __AVX512F__

using cachesvc_vec::exp2_neg16;

// S[r, 0:64] = sum over d of q[r, d] * kt[d, 0:64] for kRows rows (q rows of D floats).
inline void scores(const float* q, const float* kt, int64_t ldkt, int64_t D, float* s) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* row = kt + d * ldkt;
    const __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16),
                 k2 = _mm512_loadu_ps(row + 32), k3 = _mm512_loadu_ps(row + 48);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * D + d]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeys + 16 * c, acc[r][c]);
}

// o[r, 0:64] = o[r, 0:64] * scale[r] + sum over j < nj of p[r, j] * v[j, 0:64].
inline void values(const float* p, const float* v, int64_t ldv, int64_t nj, const float* scale,
                   float* o, int64_t ldo) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    const __m512 sc = _mm512_set1_ps(scale[r]);
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + 16 * c), sc);
  }
  for (int64_t j = 0; j < nj; ++j) {
    const float* row = v + j * ldv;
    const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16),
                 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * kKeys + j]);
      acc[r][0] = _mm512_fmadd_ps(pv, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(pv, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(pv, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(pv, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * ldo + 16 * c, acc[r][c]);
}

// One run's online-softmax update of row r: s [64] scores (keys past `last` are masked),
// running max m and the running sum kept as 16 lane sums l (added up once, at the end); leaves
// the weights in s and returns the old state's scale. The horizontal max is taken only when a
// lane passes m, and the scale is exactly 1 when m stays: after a row's first runs its max
// rarely moves, so most runs pay neither.
inline float softmax_run(float* s, int64_t j0, int64_t last, float& m, __m512& l) {
  __m512 sv[4];
  __mmask16 live[4];
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int c = 0; c < 4; ++c) {
    const int64_t visible = std::clamp<int64_t>(last - (j0 + 16 * c) + 1, 0, 16);
    live[c] = static_cast<__mmask16>((1u << visible) - 1);
    sv[c] = _mm512_mask_blend_ps(live[c], _mm512_set1_ps(kNegInf), _mm512_loadu_ps(s + 16 * c));
    mx = _mm512_max_ps(mx, sv[c]);
  }
  float scale = 1.f;
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_GT_OQ) != 0) {
    const float m_new = _mm512_reduce_max_ps(mx);
    scale = exp2_neg(m - m_new);  // 0 on the first run (m = -inf)
    m = m_new;
    l = _mm512_mul_ps(l, _mm512_set1_ps(scale));
  }
  const __m512 mn = _mm512_set1_ps(m);
  for (int c = 0; c < 4; ++c) {
    const __m512 e = _mm512_maskz_mov_ps(live[c], exp2_neg16(_mm512_sub_ps(sv[c], mn)));
    _mm512_storeu_ps(s + 16 * c, e);
    l = _mm512_add_ps(l, e);
  }
  return scale;
}

#else

inline void scores(const float* q, const float* kt, int64_t ldkt, int64_t D, float* s) {
  for (int r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kKeys; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * kt[d * ldkt + j];
      s[r * kKeys + j] = acc;
    }
}

inline void values(const float* p, const float* v, int64_t ldv, int64_t nj, const float* scale,
                   float* o, int64_t ldo) {
  for (int r = 0; r < kRows; ++r) {
    float* row = o + r * ldo;
    for (int64_t d = 0; d < 64; ++d) row[d] *= scale[r];
    for (int64_t j = 0; j < nj; ++j)
      for (int64_t d = 0; d < 64; ++d) row[d] += p[r * kKeys + j] * v[j * ldv + d];
  }
}

inline float softmax_run(float* s, int64_t j0, int64_t last, float& m, float& l) {
  float run_max = kNegInf;
  for (int64_t j = 0; j < kKeys; ++j)
    if (j0 + j <= last) run_max = std::max(run_max, s[j]);
  const float m_new = std::max(m, run_max);
  const float scale = exp2_neg(m - m_new);
  float sum = 0.f;
  for (int64_t j = 0; j < kKeys; ++j) {
    s[j] = j0 + j <= last ? exp2_neg(s[j] - m_new) : 0.f;
    sum += s[j];
  }
  l = l * scale + sum;
  m = m_new;
  return scale;
}

#endif

// Queries [i0, i0 + kRows) of query head hq (rows past Lq repeat the last one, unstored).
template <typename T>
void run_item(const Problem& pb, const T* q, int64_t q_stride, float q_scale, const float* kt,
              int64_t ldkt, const float* v, int64_t ldv, int64_t hq, int64_t i0, T* out,
              int64_t out_stride, float* lse, int64_t lse_stride) {
  const int64_t D = pb.D, h = hq / pb.group;
  std::vector<float> qs(kRows * D), s(kRows * kKeys), o(kRows * D, 0.f);
  float m[kRows], scale[kRows];
#ifdef __AVX512F__
  __m512 l[kRows];
#else
  float l[kRows];
#endif
  int64_t last[kRows];
  int64_t item_last = -1;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t i = std::min(i0 + r, pb.Lq - 1);
    const T* qi = q + i * q_stride + hq * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = static_cast<float>(qi[d]) * q_scale;
    last[r] = pb.last_key(i);
    item_last = std::max(item_last, last[r]);
    m[r] = kNegInf;
#ifdef __AVX512F__
    l[r] = _mm512_setzero_ps();
#else
    l[r] = 0.f;
#endif
  }
  const float* kt_h = kt + h * D * ldkt;
  for (int64_t j0 = 0; j0 <= item_last; j0 += kKeys) {
    scores(qs.data(), kt_h + j0, ldkt, D, s.data());
    for (int64_t r = 0; r < kRows; ++r) {
      if (last[r] < j0) {  // a row of the item that sees none of this run
        std::fill(s.begin() + r * kKeys, s.begin() + (r + 1) * kKeys, 0.f);
        scale[r] = 1.f;
        continue;
      }
      scale[r] = softmax_run(s.data() + r * kKeys, j0, last[r], m[r], l[r]);
    }
    const int64_t nj = std::min(kKeys, item_last - j0 + 1);
    const float* v_run = v + j0 * ldv + h * D;
    for (int64_t half = 0; half < D; half += 64)
      values(s.data(), v_run + half, ldv, nj, scale, o.data() + half, D);
  }
  for (int64_t r = 0; r < kRows && i0 + r < pb.Lq; ++r) {
    const int64_t i = i0 + r;
    T* oi = out + i * out_stride + hq * D;
#ifdef __AVX512F__
    const float sum = _mm512_reduce_add_ps(l[r]);
#else
    const float sum = l[r];
#endif
    if (sum == 0.f) {  // no visible key
      for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(0.f);
      lse[i * lse_stride + hq] = kNegInf;
      continue;
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(o[r * D + d] * inv);
    lse[i * lse_stride + hq] = m[r] + std::log2(sum);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double sm_scale,
         bool causal, at::Tensor& out, at::Tensor& lse) {
  const int64_t Lq = q.size(0), Lk = k.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  const Problem pb{Lq, Lk, Hq, Hk, D, Hq / Hk, Lk - Lq, causal};
  // Kᵀ per KV head, [Hk, D, ldkt] float32, keys padded to whole runs with zeros (masked). Laid
  // out a run of keys at a time: each key's row is read once, whole, and the run's 64 columns of
  // Kᵀ stay in L1 while it is written (a column at a time re-read every key's cache line once
  // per head dim).
  const int64_t ldkt = (Lk + kKeys - 1) / kKeys * kKeys, runs = ldkt / kKeys;
  std::unique_ptr<float[]> kt(new float[Hk * D * ldkt]);
  const T* kd = k.data_ptr<T>();
  at::parallel_for(0, Hk * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / runs, j0 = (item % runs) * kKeys, j1 = std::min(Lk, j0 + kKeys);
      float* kt_h = kt.get() + h * D * ldkt;
      for (int64_t j = j0; j < j1; ++j) {
        const T* row = kd + j * k.stride(0) + h * D;
        for (int64_t d = 0; d < D; ++d) kt_h[d * ldkt + j] = static_cast<float>(row[d]);
      }
      if (j1 < j0 + kKeys)
        for (int64_t d = 0; d < D; ++d) std::fill(kt_h + d * ldkt + j1, kt_h + d * ldkt + j0 + kKeys, 0.f);
    }
  });
  // Values as float32 rows [Lk, Hk * D] (+ a run's padding of zeros): float32 read in place
  // when contiguous, bfloat16 widened.
  std::vector<float> vbuf;
  const float* vf;
  int64_t ldv = Hk * D;
  if constexpr (std::is_same_v<T, float>) {
    vf = v.data_ptr<float>();
    ldv = v.stride(0);
  } else {
    vbuf.assign(Lk * Hk * D, 0.f);
    const T* vd = v.data_ptr<T>();
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t e = 0; e < Hk * D; ++e) vbuf[j * Hk * D + e] = static_cast<float>(vd[j * v.stride(0) + e]);
    vf = vbuf.data();
  }
  const int64_t blocks = (Lq + kRows - 1) / kRows;
  const float q_scale = static_cast<float>(sm_scale) * kLog2E;
  // Items claimed as threads finish them (claim.h), the costliest first: later queries see
  // more keys (causal), so blocks go last to first and the cheap ones even out the ends.
  cachesvc_claim::claim_items(Hq * blocks, Hq * blocks, [&](auto claim) {
    for (int64_t item; (item = claim()) >= 0;) {
      const int64_t hq = item % Hq, b = blocks - 1 - item / Hq;
      run_item<T>(pb, q.data_ptr<T>(), q.stride(0), q_scale, kt.get(), ldkt, vf, ldv, hq,
                  b * kRows, out.data_ptr<T>(), out.stride(0), lse.data_ptr<float>(),
                  lse.stride(0));
    }
  });
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double sm_scale, bool causal, at::Tensor out, at::Tensor lse) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prefill_attention runs on CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [Lq, Hq, D], k and v [Lk, Hk, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) == k.size(2), "k and v alike, one head dim");
  TORCH_CHECK(q.size(2) % 64 == 0, "head dim a multiple of 64");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "heads and head dims contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out like q");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.is_contiguous() && lse.scalar_type() == at::kFloat,
              "lse [Lq, Hq] float32");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "one dtype for q, k and v");
  if (q.size(0) == 0) return;
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, sm_scale, causal, out, lse);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, sm_scale, causal, out, lse);
  } else {
    TORCH_CHECK(false, "prefill_attention: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachesvc, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, float sm_scale, bool causal, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(cachesvc, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
