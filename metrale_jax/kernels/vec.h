// Shared by the CPU kernels of metrale_jax/kernels: vectors of 16 floats and their loads.
//
// Vectors are GCC vector extensions of VW floats, lowered to whatever -march gives (AVX-512,
// AVX2, NEON or scalar code). The int8 -> float conversion uses intrinsics on x86: GCC does
// not vectorize __builtin_convertvector from int8 to float (it emits 16 scalar conversions).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace metrale {

constexpr int VW = 16;  // floats per vector
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

// 16 int8 at p -> 16 floats.
inline vf load_q(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  const __m256 hi =
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
  vf v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline vf load_f(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_f(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline vf splat(float s) { return vf{} + s; }

}  // namespace metrale
