// y = x · wᵀ (+ bias) for the few rows of a decode step, on CPU: every weight row read once.
//
// At 1-16 rows a linear layer is a stream of its weights: SmolLM2's 540 MB a step against a few
// KB of activations. The library's sgemm packs and blocks for large M and, at these shapes,
// reads the weights at about half the machine's bandwidth on one core. Here a work item is a
// block of kNR (8) consecutive weight rows: it is read from memory once, for the first kMR input
// rows, and from L1 for the next ones, while kMR x kNR (2 x 8) dot products accumulate in registers
// (lanes of 16 partial sums, added up at the end: float32 results differ from sgemm's only in
// the last bits, by summation order). bfloat16 weights are widened to float32 as they are read;
// the sums are float32 and rounded once, to the output's dtype.
//
// Registered as torch.ops.cachesvc.small_linear(x [M, K], weight [N, K], bias? [N], out [M, N]):
// all contiguous, one dtype (float32 or bfloat16). Output columns are split among threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Weight rows a block: 8 concurrent streams of weights read one core's memory bandwidth better
// than 4 (a pass over SmolLM2's matmuls at 1 row took ~0.8x the time, alternating passes).
constexpr int64_t kNR = 8;
constexpr int64_t kMR = 2;  // input rows a block (16 accumulators + 8 weight vectors)
// Weight elements a thread's share must reach before a call splits: waking the pool costs
// more than streaming a few KB.
constexpr int64_t kMinParallelElements = 1 << 16;

#ifdef __AVX512F__

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is float32's upper half: widen each to 32 bits and shift it into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The MR x NR dot products of x's rows (float32, row stride K) with w's rows, into
// sums[m * kNR + n].
template <int MR, int NR, typename W>
void tile(const float* x, const W* w, int64_t K, float* sums) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load16(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load16(w + n * K + k, mask);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) sums[m * kNR + n] = _mm512_reduce_add_ps(acc[m][n]);
}

#else

// Portable: the same blocking and 16 lanes of partial sums, left to the compiler to vectorise.
template <int MR, int NR, typename W>
void tile(const float* x, const W* w, int64_t K, float* sums) {
  constexpr int L = 16;
  float acc[MR][NR][L] = {};
  int64_t k = 0;
  for (; k + L <= K; k += L)
    for (int n = 0; n < NR; ++n)
      for (int m = 0; m < MR; ++m)
        for (int l = 0; l < L; ++l)
          acc[m][n][l] += x[m * K + k + l] * static_cast<float>(w[n * K + k + l]);
  for (; k < K; ++k)
    for (int n = 0; n < NR; ++n)
      for (int m = 0; m < MR; ++m) acc[m][n][0] += x[m * K + k] * static_cast<float>(w[n * K + k]);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float total = 0.f;
      for (int l = 0; l < L; ++l) total += acc[m][n][l];
      sums[m * kNR + n] = total;
    }
}

#endif

template <typename W>
using TileFn = void (*)(const float*, const W*, int64_t, float*);

template <typename W, int MR>
constexpr TileFn<W> tile_of(int64_t nr) {
  switch (nr) {
    case 1: return tile<MR, 1, W>;
    case 2: return tile<MR, 2, W>;
    case 3: return tile<MR, 3, W>;
    case 4: return tile<MR, 4, W>;
    case 5: return tile<MR, 5, W>;
    case 6: return tile<MR, 6, W>;
    case 7: return tile<MR, 7, W>;
    default: return tile<MR, 8, W>;
  }
}

template <typename W>
TileFn<W> tile_of(int64_t mr, int64_t nr) {
  switch (mr) {
    case 1: return tile_of<W, 1>(nr);
    default: return tile_of<W, 2>(nr);
  }
}

// Weight rows [block_begin * kNR, block_end * kNR) of out = x · wᵀ + bias.
template <typename T>
void run_blocks(const float* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias,
                T* out, int64_t block_begin, int64_t block_end) {
  float sums[kMR * kNR];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t n0 = b * kNR;
    const int64_t nr = std::min(kNR, N - n0);
    // Input rows in blocks of kMR: the first block reads this block's weights from memory,
    // the others from L1.
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t mr = std::min(kMR, M - m0);
      tile_of<T>(mr, nr)(x + m0 * K, w + n0 * K, K, sums);
      for (int64_t m = 0; m < mr; ++m)
        for (int64_t n = 0; n < nr; ++n) {
          const float b_n = bias == nullptr ? 0.f : static_cast<float>(bias[n0 + n]);
          out[(m0 + m) * N + n0 + n] = static_cast<T>(sums[m * kNR + n] + b_n);
        }
    }
  }
}

template <typename T>
void small_linear_typed(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* xt = x.data_ptr<T>();
  // Input rows in float32 once (a few KB); bfloat16 ones are widened exactly.
  std::vector<float> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = xt;
  } else {
    widened.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xt[i]);
    xf = widened.data();
  }
  const T* w = weight.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* o = out.data_ptr<T>();
  const int64_t num_blocks = (N + kNR - 1) / kNR;
  const int64_t grain = std::max<int64_t>(1, kMinParallelElements / (kNR * K));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    run_blocks<T>(xf, M, K, w, N, b, o, begin, end);
  });
}

void small_linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(),
              "small_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "small_linear: out [M, N]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "small_linear: contiguous tensors");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && out.scalar_type() == dtype,
              "small_linear: one dtype for x, weight and out");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == weight.size(0),
                "small_linear: bias [N] of the weight's dtype");
  }
  if (dtype == at::kFloat) {
    small_linear_typed<float>(x, weight, bias, out);
  } else if (dtype == at::kBFloat16) {
    small_linear_typed<c10::BFloat16>(x, weight, bias, out);
  } else {
    TORCH_CHECK(false, "small_linear: float32 or bfloat16, not ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachesvc, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(cachesvc, CPU, m) { m.impl("small_linear", small_linear); }
