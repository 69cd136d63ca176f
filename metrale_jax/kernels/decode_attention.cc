// Paged decode attention for XLA:CPU, an XLA FFI custom call (metrale_jax/kernels).
//
//   out[n, H, D] = softmax(q . K^T * sm_scale [soft-capped]) V, one query per row, over the
//   row's cached positions read in place from the page pool:
//   q [n, H, D] f32; pages [N, ps, 2K, D] f32 (key head j at 2j, value head j at 2j + 1), or
//   for the int8 target [N, ps, 2K, D + 4] s8: each row's D values, then its float32 scale's
//   4 bytes (a row reads as value * scale; models/kv_quant.py);
//   table [n, PPS] s32 (position p of row r at page table[r, p / ps], offset p % ps);
//   lens [n] s32 (0: an idle row, whose output is 0). Attributes: sm_scale; soft_cap (0: none);
//   window (0: none; else only the last `window` positions are visible).
//
// A task is one (row, kv head): its G = H / K query heads walk the row's pages in order,
// page by page, with an online softmax (flash attention's recurrence) in float32. An int8
// row's scale multiplies its dot product (keys) or its softmax weight (values), so the int8
// pool is read as it lies, a quarter of float32's bytes. The arithmetic of a row depends on
// nothing but that row, so its result is the same in any batch. Tasks are shared out over
// XLA's intra-op pool when a call has enough work.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using metrale::load_f;
using metrale::load_q;
using metrale::store_f;
using metrale::vf;
using metrale::VW;

// 16 pool elements at p as floats: float32 rows as they are, int8 rows converted.
inline vf load_row(const float* p) { return load_f(p); }
inline vf load_row(const int8_t* p) { return load_q(p); }

template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
  if (D >= VW) {
    vf acc{};
    for (; d + VW <= D; d += VW) acc += load_f(a + d) * load_row(b + d);
    for (int i = 0; i < VW; ++i) s += acc[i];
  }
  for (; d < D; ++d) s += a[d] * static_cast<float>(b[d]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* x, float* y, int64_t D) {  // y += w x
  int64_t d = 0;
  const vf wv = vf{} + w;
  for (; d + VW <= D; d += VW) store_f(y + d, load_f(y + d) + wv * load_row(x + d));
  for (; d < D; ++d) y[d] += w * static_cast<float>(x[d]);
}

inline void scale_row(float c, float* y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] *= c;
}

// A pool row's scale: 1 for float32 rows; the float32 after the D values of an int8 row.
inline float row_scale(const float*, int64_t) { return 1.f; }

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// Elements per pool row: D for float32, D + 4 (the scale's bytes) for int8.
template <typename T>
constexpr int64_t row_extra() {
  return sizeof(T) == 1 ? 4 : 0;
}

struct Shape {
  int64_t n, H, D, ps, K, G, PPS;
};

// One (row r, kv head j) task over a pool of T rows. `s` is scratch of G * ps floats.
template <typename T>
void attend(const float* q, const T* pages, const int32_t* table, const int32_t* lens,
            float* out, const Shape& sh, int64_t r, int64_t j, float sm_scale, float soft_cap,
            int64_t window, float* s) {
  const int64_t D = sh.D, G = sh.G, ps = sh.ps, K2 = 2 * sh.K;
  const int64_t RD = D + row_extra<T>();  // elements per pool row
  const float* qr = q + (r * sh.H + j * G) * D;
  float* o = out + (r * sh.H + j * G) * D;
  std::fill(o, o + G * D, 0.f);
  const int64_t len = lens[r];
  if (len <= 0) return;
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  float m[64], l[64];  // G <= 64 (checked)
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  for (int64_t pi = first / ps; pi * ps < len; ++pi) {
    const int64_t page = table[r * sh.PPS + pi];
    const int64_t p0 = std::max(first, pi * ps), p1 = std::min(len, (pi + 1) * ps);
    const int64_t n_pos = p1 - p0;
    const T* base = pages + ((page * ps + (p0 - pi * ps)) * K2 + 2 * j) * RD;
    for (int64_t g = 0; g < G; ++g) {
      float mb = m[g];
      for (int64_t t = 0; t < n_pos; ++t) {
        const T* k = base + t * K2 * RD;
        float x = dot(qr + g * D, k, D) * (row_scale(k, D) * sm_scale);
        if (soft_cap > 0.f) x = soft_cap * std::tanh(x / soft_cap);
        s[g * ps + t] = x;
        mb = std::max(mb, x);
      }
      const float corr = std::exp(m[g] - mb);  // exp(-inf) = 0 on the first page
      l[g] *= corr;
      scale_row(corr, o + g * D, D);
      m[g] = mb;
    }
    for (int64_t t = 0; t < n_pos; ++t) {
      const T* v = base + t * K2 * RD + RD;
      const float vs = row_scale(v, D);
      for (int64_t g = 0; g < G; ++g) {
        const float w = std::exp(s[g * ps + t] - m[g]);
        l[g] += w;
        axpy(w * vs, v, o + g * D, D);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) scale_row(l[g] > 0.f ? 1.f / l[g] : 0.f, o + g * D, D);
}

constexpr int64_t kMinWork = 1 << 16;  // multiply-adds per thread before the pool helps

template <ffi::DataType PT>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<PT> pages, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> out,
                           float sm_scale, float soft_cap, int64_t window) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(pages.typed_data())>>;
  auto qd = q.dimensions(), pd = pages.dimensions(), td = table.dimensions(),
       ld = lens.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || td.size() != 2 || ld.size() != 1)
    return ffi::Error::InvalidArgument("decode attention: q, pages, table, lens of wrong rank");
  Shape sh{qd[0], qd[1], qd[2], pd[1], pd[2] / 2, 0, td[1]};
  if (pd[3] != sh.D + row_extra<T>() || pd[2] % 2 || sh.K == 0 || sh.H % sh.K ||
      td[0] != sh.n || ld[0] != sh.n)
    return ffi::Error::InvalidArgument("decode attention: shapes do not match");
  sh.G = sh.H / sh.K;
  if (sh.G > 64) return ffi::Error::InvalidArgument("decode attention: over 64 heads per kv head");
  const float* qp = q.typed_data();
  const T* pp = pages.typed_data();
  const int32_t* tp = table.typed_data();
  const int32_t* lp = lens.typed_data();
  float* op = out->typed_data();
  int64_t positions = 0;
  for (int64_t r = 0; r < sh.n; ++r) positions += std::max<int32_t>(lp[r], 0);
  const int64_t work = positions * sh.H * sh.D * 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(),
                                                                 work / kMinWork));
  const int64_t tasks = sh.n * sh.K;
  metrale::parallel_blocks(pool, threads, tasks, [=](int64_t b) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < sh.G * sh.ps) scratch.resize(sh.G * sh.ps);
    attend(qp, pp, tp, lp, op, sh, b / sh.K, b % sh.K, sm_scale, soft_cap, window,
           scratch.data());
  });
  return ffi::Error::Success();
}

}  // namespace

#define METRALE_DECODE_ATTENTION(name, PT)                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DecodeAttention<PT>,              \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<PT>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Ret<ffi::Buffer<ffi::F32>>()       \
                                    .Attr<float>("sm_scale")            \
                                    .Attr<float>("soft_cap")            \
                                    .Attr<int64_t>("window"))

METRALE_DECODE_ATTENTION(MetraleDecodeAttention, ffi::F32);
METRALE_DECODE_ATTENTION(MetraleDecodeAttentionInt8, ffi::S8);
