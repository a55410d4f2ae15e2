// What the paged-decode kernel's paths share (`paged_decode.cpp`, `paged_decode_vec.h`): the
// cache's strides, a call's shapes, and a scalar 2^x for x <= 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cachesvc_paged {

// 2^x for x <= 0, in plain arithmetic so that loops of it vectorise (the library's exp2 is a
// call per element): Cephes' exp2f polynomial on [-0.5, 0.5], relative error below 2e-7.
// Arguments under -126 (and -inf) give 2^-126 instead of 0; every use multiplies a state that
// is then still 0, or adds a weight that a finite maximum's own 1 dwarfs.
inline float exp2_neg(float x) {
  x = std::max(x, -126.f);
  const float n = std::floor(x + 0.5f);
  const float f = x - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return (1.f + p * f) * scale;
}

// The strides of the cache, in elements: [page][k or v][token][kv head][d].
struct CacheStrides {
  int64_t page, kv, token, head;
};

// The shapes of one call, and the scratch of one work item (a request's run of pages).
struct Shape {
  int64_t num_kv_heads, group, head_dim, page_size;
  int64_t num_qo_heads() const { return num_kv_heads * group; }
};

}  // namespace cachesvc_paged
