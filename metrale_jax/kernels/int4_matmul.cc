// int4 weight-only matmul for XLA:CPU, an XLA FFI custom call (metrale_jax/kernels).
//
//   y[M, N] = x[M, K] @ w[N, K]^T,   w[n, 32b + i] = d[n, b] * q[n, 32b + i] + m[n, b],
//
// x and y float32; q the 4-bit codes 0..15 packed two to a byte, [N, K / 2] uint8, in
// llama.cpp's Q4_1 block order: byte j (0..15) of block b holds element 32b + j in its low
// nibble and element 32b + 16 + j in its high one; dm [N, K / 32, 2] float16 holds each
// block's (d, m). The layout is each output row's blocks side by side (GGUF's own), so a
// row of q is one contiguous stream and a block's two nibble halves meet two contiguous
// 16-float slices of x.
//
// Decode reads each weight once per step: blocks of NR rows of q are dotted with up to MR
// rows of x at a time (5 when 5 are left), the accumulators in vector registers. Each block
// of 32 activations is first quantized to int8 (scale max|x| / 127, as llama.cpp's Q8 for
// its Q4 dot products), so a block's dot product is an integer one: AVX-512 VNNI's vpdpbusd
// (64 byte pairs an instruction), AVX2's maddubs + madd, or portable code, all giving the
// same integers; it is scaled by d * sx in float32, and m meets sx * sum(codes of x). Against
// the float product the error is the activations' rounding, at most sx / 2 * sum |w| a
// block. A row's arithmetic is the same in every pass, so its result does not depend on the
// call's other rows. Blocks of output rows are shared out over XLA's intra-op thread pool
// (parallel.h). Measurements: docs/quantization.md, "int4 weights".

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using metrale::load_f;
using metrale::splat;
using metrale::vf;
using metrale::VW;

constexpr int MR = 4;   // rows of x per pass
constexpr int NR = 4;   // rows of q per register block
constexpr int QB = 32;  // elements per quantization block
constexpr int64_t MAX_KB = 1024;  // blocks per row the kernel takes (K <= 32768)
static_assert(QB == 2 * VW, "a block's two nibble halves are one vector each");

// IEEE half -> float (F16C where the CPU has it).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// The kernel works on groups of 4 blocks (128 weights; the last group of a row may hold
// fewer, padded with zeros). A group's 64 packed bytes give two vectors of 64 codes, the low
// nibbles [b0 0-15, b1 0-15, b2 0-15, b3 0-15] and the high ones [b0 16-31, ...]; each meets
// 64 int8 activations in the same order, and the two integer dot products add up in 16
// int32 lanes, 4 bytes a lane: lanes 4g .. 4g + 3 hold block g's.
constexpr int GB = 4;  // blocks per group
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__F16C__)
struct codes_t {
  __m512i lo, hi;
};

// The group of `nb` blocks at p.
inline codes_t load_codes(const uint8_t* p, int nb) {
  const __m512i v = nb == GB ? _mm512_loadu_si512((const void*)p)
                             : _mm512_maskz_loadu_epi8((1ull << (16 * nb)) - 1, p);
  const __m512i mask = _mm512_set1_epi8(0x0f);
  return {_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask)};
}

// The group's integer dot products with xq (the low half's 64 bytes, then the high half's),
// as floats.
inline vf dot_codes(const codes_t& c, const int8_t* xq) {
  __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c.lo,
                                  _mm512_loadu_si512((const void*)xq));
  d = _mm512_dpbusd_epi32(d, c.hi, _mm512_loadu_si512((const void*)(xq + 64)));
  return (vf)_mm512_cvtepi32_ps(d);
}

typedef __m256 oct;  // a group's (d, m) pairs as floats, [d0, m0, d1, m1, d2, m2, d3, m3]

inline oct load_dm(const uint16_t* p, int nb) {
  const __m128i h = nb == GB ? _mm_loadu_si128((const __m128i*)p)
                             : _mm_maskz_loadu_epi16((1u << (2 * nb)) - 1, p);
  return _mm256_cvtph_ps(h);
}

// The scale of each lane of a group's dot product: [d0 x4, d1 x4, d2 x4, d3 x4].
inline vf lane_scales(oct f) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  return (vf)_mm512_permutexvar_ps(idx, _mm512_castps256_ps512(f));
}

inline oct oct_fma(oct acc, oct a, const float* b) {
  return _mm256_fmadd_ps(a, _mm256_loadu_ps(b), acc);
}

inline oct oct_zero() { return _mm256_setzero_ps(); }

inline float oct_sum(oct v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (and AVX-VNNI-less AVX-512) CPUs: the same integers from maddubs (u8 x s8 pairs to
// int16; 2 * 15 * 127 cannot saturate) and madd with ones (pairs to int32), 8 lanes a half.
struct codes_t {
  __m256i lo[2], hi[2];
};

inline codes_t load_codes(const uint8_t* p, int nb) {
  alignas(32) uint8_t tail[64] = {};
  if (nb != GB) {
    std::memcpy(tail, p, 16 * nb);
    p = tail;
  }
  const __m256i mask = _mm256_set1_epi8(0x0f);
  codes_t c;
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 * h));
    c.lo[h] = _mm256_and_si256(v, mask);
    c.hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  return c;
}

inline vf dot_codes(const codes_t& c, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i lo = _mm256_madd_epi16(
        _mm256_maddubs_epi16(c.lo[h], _mm256_loadu_si256((const __m256i*)(xq + 32 * h))), ones);
    const __m256i hi = _mm256_madd_epi16(
        _mm256_maddubs_epi16(c.hi[h], _mm256_loadu_si256((const __m256i*)(xq + 64 + 32 * h))),
        ones);
    out[h] = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
  }
  vf v;
  std::memcpy(&v, out, sizeof(v));
  return v;
}

typedef __m256 oct;

inline oct load_dm(const uint16_t* p, int nb) {
  alignas(16) uint16_t tail[8] = {};
  if (nb != GB) {
    std::memcpy(tail, p, 4 * nb);
    p = tail;
  }
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

inline vf lane_scales(oct f) {
  const __m256 a = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
  const __m256 b = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6));
  vf v;
  std::memcpy(&v, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(a), &b, sizeof(b));
  return v;
}

inline oct oct_fma(oct acc, oct a, const float* b) {
  return _mm256_fmadd_ps(a, _mm256_loadu_ps(b), acc);
}

inline oct oct_zero() { return _mm256_setzero_ps(); }

inline float oct_sum(oct v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hsum(vf v) {  // a halving tree
  for (int w = VW / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
#else
struct codes_t {
  uint8_t lo[64], hi[64];
};

inline codes_t load_codes(const uint8_t* p, int nb) {
  codes_t out{};
  for (int i = 0; i < 16 * nb; ++i) {
    out.lo[i] = p[i] & 0x0f;
    out.hi[i] = p[i] >> 4;
  }
  return out;
}

inline vf dot_codes(const codes_t& c, const int8_t* xq) {
  vf out;
  for (int l = 0; l < VW; ++l) {
    int32_t s = 0;
    for (int t = 0; t < 4; ++t) s += int32_t{c.lo[4 * l + t]} * int32_t{xq[4 * l + t]};
    for (int t = 0; t < 4; ++t) s += int32_t{c.hi[4 * l + t]} * int32_t{xq[64 + 4 * l + t]};
    out[l] = static_cast<float>(s);
  }
  return out;
}

typedef float oct __attribute__((vector_size(32)));

inline oct load_dm(const uint16_t* p, int nb) {
  oct f{};
  for (int i = 0; i < 2 * nb; ++i) f[i] = half_to_float(p[i]);
  return f;
}

inline vf lane_scales(oct f) {
  vf d;
  for (int l = 0; l < VW; ++l) d[l] = f[2 * (l / 4)];
  return d;
}

inline oct oct_fma(oct acc, oct a, const float* b) {
  oct bv;
  std::memcpy(&bv, b, sizeof(bv));
  return acc + a * bv;
}

inline oct oct_zero() { return oct{}; }

inline float oct_sum(oct v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

inline float hsum(vf v) {  // a halving tree
  for (int w = VW / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
#endif

// The activations of one call, quantized per block of 32 as llama.cpp's Q8 (scale
// sx = max|x| / 127, codes round(x / sx)) and laid out for the groups' dot products.
struct Acts {
  int64_t KB = 0, KG = 0;   // blocks, groups of blocks
  std::vector<int8_t> xq;   // [M, KG, 128], the order of dot_codes (zeros past the last block)
  std::vector<float> sx;    // [M, KG, VW], each lane's block scale
  std::vector<float> xm;    // [M, KG, 8], (0, sx_b * sum(xq_b)) per block b: dm's order

  Acts(const float* x, int64_t M, int64_t K) {
    KB = K / QB;
    KG = (KB + GB - 1) / GB;
    xq.assign(M * KG * 128, 0);
    sx.assign(M * KG * VW, 0.f);
    xm.assign(M * KG * 8, 0.f);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < KB; ++b) {
        const int64_t g = b / GB, slot = b % GB;
        const float* xb = x + r * K + b * QB;
        int8_t* out = xq.data() + (r * KG + g) * 128 + 16 * slot;
        const auto [scale, sum] = quantize_block(xb, out, out + 64);
        float* lanes = sx.data() + (r * KG + g) * VW;
        for (int l = 0; l < 4; ++l) lanes[4 * slot + l] = scale;
        xm[(r * KG + g) * 8 + 2 * slot + 1] = scale * static_cast<float>(sum);
      }
  }

  // A block of 32 activations at xb -> codes round(x / sx) (the first 16 at lo, the rest at
  // hi); returns (sx, the codes' sum). Round to nearest even, as the vector path rounds.
  static std::pair<float, int32_t> quantize_block(const float* xb, int8_t* lo, int8_t* hi) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float scale = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i*)lo, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)hi, _mm512_cvtepi32_epi8(qb));
    return {scale, _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb))};
#else
    float amax = 0.f;
    for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < QB; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      (i < 16 ? lo : hi)[i % 16] = static_cast<int8_t>(v);
      sum += v;
    }
    return {scale, sum};
#endif
  }
};

constexpr int64_t PF = 2 * NR;  // prefetch distance, in rows of q

// Rows [n0, n0 + NJ) of q against rows [m0, m0 + R) of x:
//   y = sum over blocks of d * sx * (codes . xq) + m * sx * sum(xq),
// the codes' integer dot products per group of blocks, scaled in float32 per lane.
template <int R, int NJ>
void block(const Acts& a, const uint8_t* q, const uint16_t* dm, float* y, int64_t K,
           int64_t N, int64_t m0, int64_t n0) {
  const int64_t K2 = K / 2, KB = a.KB, KG = a.KG;
  vf acc[R][NJ];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) acc[r][j] = vf{};
  const uint8_t* qr = q + n0 * K2;
  const uint16_t* dr = dm + n0 * KB * 2;
  // The NJ rows are contiguous (NJ * K / 2 bytes, a line of each read an iteration):
  // prefetch PF rows ahead.
  const uint8_t* pf = qr + PF * K2;
  const bool prefetch = n0 + NJ + PF <= N;
  // One group of `nb` blocks into the accumulators (full groups: nb a constant, no masks).
  auto group = [&](int64_t g, int nb) __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) {
      if (prefetch) __builtin_prefetch(pf + j * K2 + g * 64);
      const codes_t c = load_codes(qr + j * K2 + g * 64, nb);
      const vf d = lane_scales(load_dm(dr + j * KB * 2 + g * 8, nb));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (m0 + r) * KG + g;
        acc[r][j] += dot_codes(c, a.xq.data() + rg * 128) * (d * load_f(a.sx.data() + rg * VW));
      }
    }
  };
  const int64_t full = KB / GB;
  for (int64_t g = 0; g < full; ++g) group(g, GB);
  if (full < KG) group(full, static_cast<int>(KB - full * GB));
  // The minimums' term: each row's (d, m) against x's (0, sx * sum(xq)).
  for (int j = 0; j < NJ; ++j) {
    oct macc[R];
    for (int r = 0; r < R; ++r) macc[r] = oct_zero();
    for (int64_t g = 0; g < KG; ++g) {
      const int nb = static_cast<int>(std::min<int64_t>(GB, KB - g * GB));
      const oct f = load_dm(dr + j * KB * 2 + g * 8, nb);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        macc[r] = oct_fma(macc[r], f, a.xm.data() + ((m0 + r) * KG + g) * 8);
    }
    for (int r = 0; r < R; ++r)
      y[(m0 + r) * N + n0 + j] = hsum(acc[r][j]) + oct_sum(macc[r]);
  }
}

template <int NJ>
void rows(const Acts& a, const uint8_t* q, const uint16_t* dm, float* y, int64_t M,
          int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  // Five rows left take one pass of five (20 accumulators): a speculative verify of 4
  // drafts feeds 5 rows. A row's arithmetic is the same in any pass.
  for (; m + MR <= M && M - m != MR + 1; m += MR) block<MR, NJ>(a, q, dm, y, K, N, m, n0);
  switch (M - m) {
    case 5: block<5, NJ>(a, q, dm, y, K, N, m, n0); break;
    case 3: block<3, NJ>(a, q, dm, y, K, N, m, n0); break;
    case 2: block<2, NJ>(a, q, dm, y, K, N, m, n0); break;
    case 1: block<1, NJ>(a, q, dm, y, K, N, m, n0); break;
    default: break;
  }
}

constexpr int64_t NB = 64;  // rows of q per block handed to a thread

void row_block(const Acts& a, const uint8_t* q, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N, int64_t b) {
  int64_t n0 = b * NB;
  const int64_t n1 = std::min(N, n0 + NB);
  for (; n0 + NR <= n1; n0 += NR) rows<NR>(a, q, dm, y, M, K, N, n0);
  for (; n0 < n1; ++n0) rows<1>(a, q, dm, y, M, K, N, n0);
}

// At most one thread per kMinWork multiply-adds, so that small calls skip the hand-off.
constexpr int64_t kMinWork = 1 << 18;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                  ffi::Buffer<ffi::F16> dm, ffi::ResultBuffer<ffi::F32> y,
                  int64_t max_threads) {
  auto xd = x.dimensions(), qd = q.dimensions(), dd = dm.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || dd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("int4 matmul: x, q, y must be rank 2, dm rank 3");
  const int64_t M = xd[0], K = xd[1], N = qd[0];
  if (K % QB != 0 || K / QB > MAX_KB || qd[1] * 2 != K || dd[0] != N || dd[1] * QB != K ||
      dd[2] != 2 || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("int4 matmul: shapes do not match");
  const float* xp = x.typed_data();
  const uint8_t* qp = q.typed_data();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dm.untyped_data());
  float* yp = y->typed_data();
  const Acts acts(xp, M, K);
  int64_t threads = max_threads > 0 ? max_threads : pool.num_threads();
  threads = std::max<int64_t>(std::min(threads, M * K * N / kMinWork), 1);
  metrale::parallel_blocks(pool, threads, (N + NB - 1) / NB, [&](int64_t b) {
    row_block(acts, qp, dp, yp, M, K, N, b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleInt4Matmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_threads"));
