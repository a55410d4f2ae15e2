// y = x · wᵀ (+ bias) on CPU, over weights packed once into panels of 64 output columns.
//
// The library's sgemm on this kind of machine reads a decode step's weights at about half the
// bandwidth one core has, and at prefill's hundreds of rows runs below the core's arithmetic
// rate as well. Here the weights are laid out once, at first use (`workers/kernels/linear.py`),
// as panels: panel b holds output columns [64 b, 64 b + 64) as K rows of 64 contiguous values,
// so a panel is one sequential stream the hardware prefetcher follows (a row-major weight read
// a few rows at a time is several short streams). For each k, the panel's 64 values (4 vectors)
// are multiplied by x[m, k] broadcast, for up to kMR input rows at once: kMR x 4 accumulators in
// registers, no horizontal sums. More rows re-read the panel from cache, kMR rows at a time;
// K is cut into chunks of kKC so a chunk of the panel stays in L2 across those re-reads.
//
// Each output is summed in order of k, in float32, whatever the rows, threads or chunks (a
// chunk's partial sums go through float32 memory exactly), so results do not depend on the
// batch an input row comes in. bfloat16 weights are widened as they are read; bfloat16 inputs
// are widened once; the output is rounded once to its dtype.
//
// Registered as torch.ops.cachesvc.packed_linear(x [M, K], packed [NB, K, 64], bias? [N],
// out [M, N]): contiguous, one dtype (float32 or bfloat16), 64 (NB - 1) < N <= 64 NB. Threads
// claim (panel, rows) items as they go (`run_items`).
//
// torch.ops.cachesvc.packed_linear_argmax(x, packed, out, argmax [M] int64), float32 and no
// bias: the same outputs, and each row's index of its largest output, the first of equals and
// the first NaN if any (NumPy's and torch's argmax). Greedy decoding over an LM head: each item
// finds its tile's largest while the tile is still in cache, and the panels' winners are
// compared once all are done; a separate argmax reads the whole [M, vocab] output back from
// memory (64 rows of a 49K vocabulary are 12.6 MB, ~0.5 ms a step on one core).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "claim.h"
#include "vec_math.h"

namespace {

constexpr int64_t kNB = 64;  // output columns a panel: 4 vectors of 16
constexpr int64_t kMR = 6;   // input rows a pass: 24 accumulators + 4 weight vectors + 1 input
// A chunk of K: 512 x 64 float32 is 128 KB of panel, held in L2 while every kMR rows re-read it.
constexpr int64_t kKC = 512;
// Rows an item of work takes at most (a multiple of kMR): prefill's hundreds of rows are cut so
// that threads share a panel's rows, not only whole panels (9 panels do not split evenly in 2).
constexpr int64_t kMC = 96;
// Multiply-adds a thread's share must reach before a call splits: waking the pool costs more
// than streaming a few KB of weights.
constexpr int64_t kMinParallelWork = 1 << 16;

#ifdef __AVX512F__

using cachesvc_vec::load16;

// out[m, 0:nn] (+)= sum over k in [0, kc) of x[m, k] * panel[k, 0:nn], for MR rows; `first`
// starts from zero, else from what out holds (the earlier chunks' sums).
template <int MR, typename W>
void pass(const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo,
          int64_t nn, bool first) {
  __m512 acc[MR][4];
  __mmask16 masks[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(nn - 16 * j, 0, 16);
    masks[j] = static_cast<__mmask16>((1u << left) - 1);
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(masks[j], out + m * ldo + 16 * j);
  for (int64_t k = 0; k < kc; ++k) {
    const W* row = panel + k * kNB;
    const __m512 w0 = load16(row), w1 = load16(row + 16), w2 = load16(row + 32),
                 w3 = load16(row + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(out + m * ldo + 16 * j, masks[j], acc[m][j]);
}

#else

// Portable: the same order of sums (k ascending per output), left to the compiler to vectorise.
template <int MR, typename W>
void pass(const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo,
          int64_t nn, bool first) {
  float acc[MR][kNB];
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < kNB; ++j) acc[m][j] = first || j >= nn ? 0.f : out[m * ldo + j];
  for (int64_t k = 0; k < kc; ++k) {
    const W* row = panel + k * kNB;
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < kNB; ++j) acc[m][j] += xv * static_cast<float>(row[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < nn; ++j) out[m * ldo + j] = acc[m][j];
}

#endif

template <typename W>
using PassFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, bool);

template <typename W>
PassFn<W> pass_of(int64_t mr) {
  switch (mr) {
    case 1: return pass<1, W>;
    case 2: return pass<2, W>;
    case 3: return pass<3, W>;
    case 4: return pass<4, W>;
    case 5: return pass<5, W>;
    default: return pass<6, W>;
  }
}

// Rows [m_begin, m_end) of output panel b of the float32 sums y[M, N] (row stride ldy) of
// x[M, K] · wᵀ.
template <typename W>
void run_item(const float* x, int64_t K, const W* packed, int64_t N, float* y, int64_t ldy,
              int64_t b, int64_t m_begin, int64_t m_end) {
  const W* panel = packed + b * K * kNB;
  const int64_t n0 = b * kNB, nn = std::min(kNB, N - n0);
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    // The rows in passes of near-equal size (8 as 4 + 4, not 6 + 2): a pass of few rows has
    // too few multiply-adds to each weight load (4-10% faster at 7-10 rows, one thread).
    const int64_t rows = m_end - m_begin, passes = (rows + kMR - 1) / kMR;
    for (int64_t p = 0, m0 = m_begin; m0 < m_end; ++p) {
      const int64_t mr = rows * (p + 1) / passes - rows * p / passes;
      pass_of<W>(mr)(x + m0 * K + k0, K, panel + k0 * kNB, kc, y + m0 * ldy + n0, ldy, nn,
                     k0 == 0);
      m0 += mr;
    }
  }
}

// Where each row's largest value of one panel lies: written per (row, panel) by the items, then
// compared across panels by `reduce_argmax`. A NaN lies above everything (argmax's rule).
struct PanelBest {
  float* value;     // [M, num_panels]
  int32_t* column;  // [M, num_panels]: the column of `value` within its panel
  int64_t num_panels;
};

// The first largest of row[0, nn) (1 <= nn <= 64), or its first NaN.
inline void tile_best(const float* row, int64_t nn, float* value, int32_t* column) {
#ifdef __AVX512F__
  __m512 v[4];
  uint64_t nan = 0;
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(nn - 16 * j, 0, 16);
    const auto mask = static_cast<__mmask16>((1u << left) - 1);
    // Columns past nn read as -inf: they never win over a column that is there.
    v[j] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, row + 16 * j);
    nan |= static_cast<uint64_t>(_mm512_cmp_ps_mask(v[j], v[j], _CMP_UNORD_Q)) << (16 * j);
  }
  if (nan != 0) {
    *column = static_cast<int32_t>(__builtin_ctzll(nan));
    *value = NAN;
    return;
  }
  const float best =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
  const __m512 b = _mm512_set1_ps(best);
  uint64_t at = 0;
  for (int j = 0; j < 4; ++j)
    at |= static_cast<uint64_t>(_mm512_cmp_ps_mask(v[j], b, _CMP_EQ_OQ)) << (16 * j);
  *column = static_cast<int32_t>(__builtin_ctzll(at));
  *value = best;
#else
  int64_t at = 0;
  for (int64_t j = 0; j < nn; ++j) {
    if (std::isnan(row[j])) {
      at = j;
      break;
    }
    if (row[j] > row[at]) at = j;
  }
  *column = static_cast<int32_t>(at);
  *value = row[at];
#endif
}

// Each row's first largest over the panels' winners, in order of columns.
void reduce_argmax(const PanelBest& best, int64_t M, int64_t* argmax) {
  for (int64_t m = 0; m < M; ++m) {
    const float* value = best.value + m * best.num_panels;
    const int32_t* column = best.column + m * best.num_panels;
    int64_t at = 0;
    for (int64_t b = 0; b < best.num_panels; ++b) {
      if (std::isnan(value[b])) {
        at = b;
        break;
      }
      if (value[b] > value[at]) at = b;
    }
    argmax[m] = at * kNB + column[at];
  }
}

// The work is cut into items (a panel, a run of at most kMC rows), panel by panel, and each
// thread claims the next item until none is left. A static split waits at its end for its
// slowest share: on a machine whose cores also serve the front end, one preempted thread held
// a decode matmul up by half its time (tried with a process busy 20% of one core).
template <typename W>
void run_items(const float* x, int64_t M, int64_t K, const W* packed, int64_t num_panels,
               int64_t N, float* y, const PanelBest* best = nullptr) {
  const int64_t row_runs = (M + kMC - 1) / kMC, num_items = num_panels * row_runs;
  auto run = [&](int64_t i) {
    const int64_t b = i / row_runs, m0 = (i % row_runs) * kMC, m1 = std::min(M, m0 + kMC);
    run_item<W>(x, K, packed, N, y, N, b, m0, m1);
    if (best == nullptr) return;
    const int64_t n0 = b * kNB, nn = std::min(kNB, N - n0);
    for (int64_t m = m0; m < m1; ++m)
      tile_best(y + m * N + n0, nn, best->value + m * num_panels + b,
                best->column + m * num_panels + b);
  };
  const int64_t max_threads = std::max<int64_t>(1, M * num_panels * kNB * K / kMinParallelWork);
  cachesvc_claim::claim_items(num_items, max_threads, [&](auto claim) {
    for (int64_t i; (i = claim()) >= 0;) run(i);
  });
}

template <typename T>
void packed_linear_typed(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), num_panels = packed.size(0);
  const T* w = packed.data_ptr<T>();
  // float32 inputs and sums as they are; bfloat16 inputs widened (exactly) and sums kept in
  // float32 until the one rounding at the end.
  std::vector<float> widened, sums;
  const float* xf;
  float* y;
  if constexpr (std::is_same_v<T, float>) {
    xf = x.data_ptr<float>();
    y = out.data_ptr<float>();
  } else {
    const T* xt = x.data_ptr<T>();
    widened.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xt[i]);
    xf = widened.data();
    sums.resize(M * N);
    y = sums.data();
  }
  run_items<T>(xf, M, K, w, num_panels, N, y);
  T* o = out.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  if (b == nullptr && std::is_same_v<T, float>) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      o[m * N + n] = static_cast<T>(y[m * N + n] + (b == nullptr ? 0.f : static_cast<float>(b[n])));
}

void check_args(const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "packed_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kNB &&
                  x.size(1) == packed.size(1),
              "packed_linear: x [M, K] and packed [NB, K, 64]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) <= packed.size(0) * kNB &&
                  out.size(1) > (packed.size(0) - 1) * kNB,
              "packed_linear: out [M, N] with 64 (NB - 1) < N <= 64 NB");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && out.is_contiguous(),
              "packed_linear: contiguous tensors");
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && out.scalar_type() == dtype,
              "packed_linear: one dtype for x, packed and out");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == out.size(1),
                "packed_linear: bias [N] of the weight's dtype");
  }
}

void packed_linear(const at::Tensor& x, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias, at::Tensor out) {
  check_args(x, packed, bias, out);
  if (x.size(0) == 0) return;
  const auto dtype = packed.scalar_type();
  if (dtype == at::kFloat) {
    packed_linear_typed<float>(x, packed, bias, out);
  } else if (dtype == at::kBFloat16) {
    packed_linear_typed<c10::BFloat16>(x, packed, bias, out);
  } else {
    TORCH_CHECK(false, "packed_linear: float32 or bfloat16, not ", dtype);
  }
}

void packed_linear_argmax(const at::Tensor& x, const at::Tensor& packed, at::Tensor out,
                          at::Tensor argmax) {
  check_args(x, packed, std::nullopt, out);
  TORCH_CHECK(packed.scalar_type() == at::kFloat, "packed_linear_argmax: float32");
  TORCH_CHECK(argmax.device().is_cpu() && argmax.scalar_type() == at::kLong &&
                  argmax.dim() == 1 && argmax.size(0) == x.size(0) && argmax.is_contiguous(),
              "packed_linear_argmax: argmax [M] int64");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), num_panels = packed.size(0);
  if (M == 0) return;
  std::vector<float> values(M * num_panels);
  std::vector<int32_t> columns(M * num_panels);
  const PanelBest best{values.data(), columns.data(), num_panels};
  run_items<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), num_panels, N,
                   out.data_ptr<float>(), &best);
  reduce_argmax(best, M, argmax.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachesvc, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("packed_linear_argmax(Tensor x, Tensor packed, Tensor(a!) out, Tensor(b!) argmax) -> ()");
}

TORCH_LIBRARY_IMPL(cachesvc, CPU, m) {
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_argmax", packed_linear_argmax);
}
