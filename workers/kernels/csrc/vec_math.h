// Vector helpers the CPU kernels share (AVX-512): float32 and bfloat16 loads widened to
// float32, and 2^x for x <= 0. Included by the kernels' sources; the build (`workers/kernels/
// build.py`) puts this folder on the include path and keys its cache on this file too.
#pragma once

#ifdef __AVX512F__
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace cachesvc_vec {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is float32's upper half: widen each to 32 bits and shift it into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 2^x for x <= 0 on 16 lanes: Cephes' exp2f polynomial on [-0.5, 0.5] after splitting off the
// integer part, relative error below 2e-7. Inputs under -126 (and -inf) give 2^-126 instead of
// 0: callers mask the lanes that must weigh nothing.
inline __m512 exp2_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace cachesvc_vec

#endif

#ifdef __AVX512F__
namespace cachesvc_vec {

// float32 -> bfloat16 bits on 16 lanes, rounding to nearest even as c10::BFloat16 does (a NaN
// stays a quiet NaN).
inline __m256i to_bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// v rounded to dtype T's precision and back (identity for float32): what storing an op's
// result in a T tensor does between two ops.
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits16(v)), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits16(v));
}

}  // namespace cachesvc_vec
#endif
