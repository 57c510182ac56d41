// Shared by the C++ CPU ops (kernels/csrc/*.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) written so loops over it vectorise (a libm call per element does not, and dominated silu):
// 2^(x log2 e) = 2^n * 2^f with n = round, |f| <= 0.5, and 2^f from a degree-6 polynomial (relative error ~2e-7, far
// below the bf16 rounding that follows). x is clamped where exp under/overflows floats; silu needs neither end.
static inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180206e-3f;
  p = p * f + 5.5503406e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314720e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

