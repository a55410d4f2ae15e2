// Decode attention straight over the paged KV cache, on CPU: no copy of the context.
//
// Each decode request has one query row; its keys and values stay in their pages
// ([num_pages, 2, page_size, Hk, D], FlashInfer's NHD layout). A work item is one request, one KV
// head and a run of its pages: the item reads each key and value row once for all the query heads
// of that KV head (GQA), scoring a page at a time and folding it into an online softmax in base 2.
// A request with few items per thread splits its pages into several runs whose partial states
// are merged afterwards, as flash-decoding does, so one long request still keeps every core busy.
//
// Semantics are FlashInfer's (research notes §10): output in q's dtype, LSE in base 2, a request
// with no key gives output 0 and LSE -inf. Registered as torch.ops.cachesvc.paged_decode.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "claim.h"
#include "paged_decode_common.h"
#include "paged_decode_vec.h"

namespace {

using namespace cachesvc_paged;

constexpr float kLog2E = 1.4426950408889634f;
constexpr int64_t kMaxPage = 64;  // tokens a page
constexpr int64_t kMinPagesPerSplit = 4;
// Below this many pages in all, or merged rows, a call runs on the calling thread: waking the
// pool costs more than the work, and on a shared machine every parallel region risks waiting
// for a descheduled thread.
constexpr int64_t kMinParallelPages = 64;
constexpr int64_t kMinParallelRows = 64;

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename KV>
inline void prefetch_page(const KV* page, const CacheStrides& st, int64_t page_size) {
  // Pages sit anywhere in the pool, so the hardware cannot guess the next one: ask for it while
  // this one is scored. Keys and values each span page_size * token stride elements.
  const char* k = reinterpret_cast<const char*>(page);
  const char* v = reinterpret_cast<const char*>(page + st.kv);
  const int64_t bytes = page_size * st.token * static_cast<int64_t>(sizeof(KV));
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off);
    __builtin_prefetch(v + off);
  }
}

// acc [D] = acc * rescale + sum over the page's tokens t of w[t] * v[t]. With the head dim known
// at compile time the row is a local array the compiler keeps in registers across the tokens.
template <typename KV, int64_t kD>
inline void accumulate_values(float* acc, float rescale, const float* w, const KV* v,
                              int64_t n, int64_t token_stride, int64_t head_dim) {
  if constexpr (kD > 0) {
    float a[kD];
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) a[d] = acc[d] * rescale;
    for (int64_t t = 0; t < n; ++t) {
      const KV* row = v + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < kD; ++d) a[d] += w[t] * to_float(row[d]);
    }
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) acc[d] = a[d];
  } else {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= rescale;
    for (int64_t t = 0; t < n; ++t) {
      const KV* row = v + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += w[t] * to_float(row[d]);
    }
  }
}

// Online softmax of every query head `q [Hq, D]` (scaled by sm_scale * log2 e) over pages
// [lo, hi) of one request. Leaves the running max `m [Hq]`, sum `l [Hq]` and the unnormalised
// output `acc [Hq, D]`; `scores` is scratch of kMaxPage floats. `kD` is the head dim when
// known at compile time (then the loops over it unroll into registers), 0 otherwise.
template <typename KV, int64_t kD>
void attend_pages(const float* q, const KV* kv, const int32_t* pages, int64_t lo, int64_t hi,
                  int64_t kv_len, const Shape& sh, const CacheStrides& st, float* m, float* l,
                  float* acc, float* scores) {
  const int64_t Hq = sh.num_qo_heads(), G = sh.group, ps = sh.page_size;
  const int64_t D = kD > 0 ? kD : sh.head_dim;
  std::fill(m, m + Hq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Hq, 0.f);
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t n = std::min(ps, kv_len - p * ps);
    const KV* k_page = kv + static_cast<int64_t>(pages[p]) * st.page;
    const KV* v_page = k_page + st.kv;
    if (p + 1 < hi) prefetch_page(kv + static_cast<int64_t>(pages[p + 1]) * st.page, st, ps);
    // One query head at a time over the page: its key and value rows (a few KB, in L1 after
    // the first head of the group) are read again for each head of the group, while the
    // head's scores and output row stay in registers.
    for (int64_t g = 0; g < Hq; ++g) {
      const int64_t h = g / G;
      const float* qg = q + g * D;
      float* w = scores;
      for (int64_t t = 0; t < n; ++t) {
        const KV* k = k_page + t * st.token + h * st.head;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(k[d]);
        w[t] = s;
      }
      float page_max = w[0];
      for (int64_t t = 1; t < n; ++t) page_max = std::max(page_max, w[t]);
      const float m_new = std::max(m[g], page_max);
      const float rescale = exp2_neg(m[g] - m_new);  // ~0 on the first page (m = -inf)
      float sum = l[g] * rescale;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        w[t] = exp2_neg(w[t] - m_new);
        sum += w[t];
      }
      l[g] = sum;
      m[g] = m_new;
      accumulate_values<KV, kD>(acc + g * D, rescale, w, v_page + h * st.head, n, st.token, D);
    }
  }
}

// How many runs of pages each request is cut into: about four work items per thread in all,
// no run shorter than kMinPagesPerSplit pages. Returns the first item of each request, and the
// total, in `first` (size n + 1).
std::vector<int64_t> split_requests(const int64_t* req, int64_t cols, int64_t n,
                                    int64_t page_size) {
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, (4 * threads + n - 1) / std::max<int64_t>(1, n));
  std::vector<int64_t> first(n + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t num_pages = (req[cols * r + 2] + page_size - 1) / page_size;
    const int64_t splits = std::max<int64_t>(1, std::min(want, num_pages / kMinPagesPerSplit));
    first[r + 1] = first[r] + splits;
  }
  return first;
}

template <typename KV, typename Q>
void run(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indices,
         const at::Tensor& requests, double sm_scale, at::Tensor& out, at::Tensor& lse) {
  const Shape sh{kv_cache.size(3), q.size(1) / kv_cache.size(3), q.size(2), kv_cache.size(2)};
  const CacheStrides st{kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                        kv_cache.stride(3)};
  const int64_t Hq = sh.num_qo_heads(), D = sh.head_dim, n = requests.size(0);
  // [n, 3]: query row, first page, kv_len; [n, 4] adds the request's number of query rows
  // (consecutive from its first), all attending to the same pages.
  const int64_t cols = requests.size(1);
  const int64_t* req = requests.data_ptr<int64_t>();
  auto num_rows = [&](int64_t r) { return cols == 4 ? req[cols * r + 3] : int64_t{1}; };
  const int32_t* pages = kv_indices.data_ptr<int32_t>();
  const Q* q_data = q.data_ptr<Q>();
  const KV* kv = kv_cache.data_ptr<KV>();
  const float scale = static_cast<float>(sm_scale) * kLog2E;
  const std::vector<int64_t> first = split_requests(req, cols, n, sh.page_size);
  const int64_t num_items = first[n];
  int64_t total_pages = 0;
  for (int64_t r = 0; r < n; ++r)
    total_pages += (req[cols * r + 2] + sh.page_size - 1) / sh.page_size;
  const int64_t max_threads = total_pages < kMinParallelPages ? 1 : num_items;
  // Each item's running state, one entry a (query row, head): items of request r hold
  // num_rows(r) * Hq of them, from offset[item].
  std::vector<int64_t> offset(num_items + 1, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t item = first[r]; item < first[r + 1]; ++item)
      offset[item + 1] = offset[item] + num_rows(r) * Hq;
  std::vector<float> ms(offset[num_items]), ls(offset[num_items]), accs(offset[num_items] * D);

  // Items claimed as threads finish them (claim.h): a preempted thread's share is taken up.
  cachesvc_claim::claim_items(num_items, max_threads, [&](auto claim) {
    std::vector<float> qs, scores(kMaxPage);
    for (int64_t item; (item = claim()) >= 0;) {
      const int64_t r = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t splits = first[r + 1] - first[r], split = item - first[r];
      const int64_t row = req[cols * r], kv_len = req[cols * r + 2], rows = num_rows(r);
      const int64_t num_pages = (kv_len + sh.page_size - 1) / sh.page_size;
      const int64_t per = (num_pages + splits - 1) / splits;
      const int64_t lo = std::min(num_pages, split * per), hi = std::min(num_pages, lo + per);
      // The rows' query heads by KV head: KV head h's group is every row's heads of h, so one
      // read of a key or value row serves all of them (a shared prefix read once).
      const Shape item_sh{sh.num_kv_heads, rows * sh.group, D, sh.page_size};
      qs.resize(rows * Hq * D);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const int64_t slot = (hq / sh.group) * rows * sh.group + i * sh.group + hq % sh.group;
          const Q* qg = q_data + (row + i) * q.stride(0) + hq * q.stride(1);
          for (int64_t d = 0; d < D; ++d) qs[slot * D + d] = to_float(qg[d]) * scale;
        }
      const int32_t* table = pages + req[cols * r + 1];
      float *m = &ms[offset[item]], *l = &ls[offset[item]], *acc = &accs[offset[item] * D];
#ifdef __AVX512F__
      if constexpr (std::is_same_v<KV, float> || std::is_same_v<KV, c10::BFloat16>) {
        if (D == 64) {
          attend_pages_vec<KV, 64>(qs.data(), kv, table, lo, hi, kv_len, item_sh, st, m, l, acc);
          continue;
        }
        if (D == 128) {
          attend_pages_vec<KV, 128>(qs.data(), kv, table, lo, hi, kv_len, item_sh, st, m, l, acc);
          continue;
        }
      }
#endif
      if (D == 64) {
        attend_pages<KV, 64>(qs.data(), kv, table, lo, hi, kv_len, item_sh, st, m, l, acc,
                             scores.data());
      } else if (D == 128) {
        attend_pages<KV, 128>(qs.data(), kv, table, lo, hi, kv_len, item_sh, st, m, l, acc,
                              scores.data());
      } else {
        attend_pages<KV, 0>(qs.data(), kv, table, lo, hi, kv_len, item_sh, st, m, l, acc,
                            scores.data());
      }
    }
  });

  // Merge each (query row, head)'s runs by their maxima, then normalise.
  std::vector<int64_t> row_start(n + 1, 0);
  for (int64_t r = 0; r < n; ++r) row_start[r + 1] = row_start[r] + num_rows(r);
  Q* out_data = out.data_ptr<Q>();
  float* lse_data = lse.data_ptr<float>();
  at::parallel_for(0, row_start[n] * Hq, kMinParallelRows, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t rg = begin; rg < end; ++rg) {
      const int64_t flat = rg / Hq, hq = rg % Hq;
      const int64_t r = std::upper_bound(row_start.begin(), row_start.end(), flat) -
                        row_start.begin() - 1;
      const int64_t i = flat - row_start[r], rows = num_rows(r), row = req[cols * r] + i;
      const int64_t slot = (hq / sh.group) * rows * sh.group + i * sh.group + hq % sh.group;
      Q* o = out_data + row * out.stride(0) + hq * out.stride(1);
      float* lse_row = lse_data + row * lse.stride(0) + hq * lse.stride(1);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t item = first[r]; item < first[r + 1]; ++item)
        m = std::max(m, ms[offset[item] + slot]);
      if (m == -std::numeric_limits<float>::infinity()) {  // no key: output 0, LSE -inf
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(0.f);
        *lse_row = m;
        continue;
      }
      float sum = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t item = first[r]; item < first[r + 1]; ++item) {
        const float w = std::exp2(ms[offset[item] + slot] - m);
        sum += ls[offset[item] + slot] * w;
        const float* a = &accs[(offset[item] + slot) * D];
        for (int64_t d = 0; d < D; ++d) merged[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(merged[d] / sum);
      *lse_row = m + std::log2(sum);
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indices,
                  const at::Tensor& requests, double sm_scale, at::Tensor& out, at::Tensor& lse) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode runs on CPU");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q [N, Hq, D], kv_cache [P, 2, S, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1 && out.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(kv_cache.size(2) <= kMaxPage, "page size at most 64");
  TORCH_CHECK(q.size(2) == kv_cache.size(4), "q and kv_cache differ in head_dim");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(kv_indices.scalar_type() == at::kInt && kv_indices.is_contiguous(), "kv_indices");
  TORCH_CHECK(requests.scalar_type() == at::kLong && requests.is_contiguous() &&
                  requests.dim() == 2 && (requests.size(1) == 3 || requests.size(1) == 4),
              "requests int64 [n, 3] or [n, 4]");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && lse.scalar_type() == at::kFloat, "out/lse");
  const auto kv_type = kv_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == kv_type, "q and kv_cache must share a dtype");
  if (kv_type == at::kFloat) {
    run<float, float>(q, kv_cache, kv_indices, requests, sm_scale, out, lse);
  } else if (kv_type == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(q, kv_cache, kv_indices, requests, sm_scale, out, lse);
  } else if (kv_type == at::kHalf) {
    run<c10::Half, c10::Half>(q, kv_cache, kv_indices, requests, sm_scale, out, lse);
  } else {
    TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only");
  }
}

}  // namespace

TORCH_LIBRARY(cachesvc, m) {
  m.def(
      "paged_decode(Tensor q, Tensor kv_cache, Tensor kv_indices, Tensor requests, "
      "float sm_scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(cachesvc, CPU, m) { m.impl("paged_decode", &paged_decode); }
