// int8 weight-only matmul for XLA:CPU, an XLA FFI custom call (metrale_jax/kernels).
//
//   y[M, N] = (x[M, K] @ q) * scale[N],  x, scale, y float32, q int8, with q either
//   [K, N] (the [in, out] layout of the linear layers: target metrale_int8_matmul_kn) or
//   [N, K] (a tied embedding used as the LM head: target metrale_int8_matmul_nk).
//
// Decode reads each weight once per step, so the kernels read every weight byte once per
// call for up to MR rows of x. [K, N]: a thread's columns of y (MR rows, in L1) accumulate
// panels of KP rows of q, each panel read as KP sequential streams. [N, K]: blocks of NR
// rows of q are dotted with MR rows of x, the MR * NR accumulators in vector registers.
// Both prefetch q a few rows ahead (the streams are short for the hardware prefetcher).
// Vectors and their loads are vec.h's (GCC vector extensions; intrinsics for the int8 ->
// float conversion on x86). Blocks of output columns are
// shared out over XLA's intra-op thread pool (ffi::ThreadPool) when the call has enough
// work; the calling thread takes blocks too, so the call finishes even when the pool runs
// nothing in parallel. Measurements: docs/quantization.md, "int8 weights".

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using metrale::load_f;
using metrale::load_q;
using metrale::splat;
using metrale::store_f;
using metrale::vf;
using metrale::VW;

constexpr int MR = 4;  // rows of x per pass over the weights

// q [K, N]: the columns [n0, n1) (n1 - n0 < VW) of rows [m0, m1), scalar.
void kn_tail(const float* x, const int8_t* q, const float* scale, float* y, int64_t K,
             int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(q[k * N + n]);
      y[m * N + n] = acc * scale[n];
    }
}

// q [K, N], rows [m0, m0 + R) of y, columns [n0, n1) (a multiple of VW): walks q in panels
// of KP rows, each read once as KP sequential streams, and accumulates into y (kept in L1).
constexpr int KP = 4;
constexpr int64_t KN_PF = 2 * KP;  // prefetch distance, in rows of q

template <int R>
void kn_panel(const float* x, const int8_t* q, const float* scale, float* y, int64_t K,
              int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  float* yr = y + m0 * N;
  const float* xr = x + m0 * K;
  for (int r = 0; r < R; ++r) std::fill(yr + r * N + n0, yr + r * N + n1, 0.f);
  int64_t k = 0;
  for (; k + KP <= K; k += KP) {
    vf xs[R][KP];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < KP; ++j) xs[r][j] = splat(xr[r * K + k + j]);
    const int8_t* qk = q + k * N;
    // Rows of one panel are short streams (a thread's columns), too short for the hardware
    // prefetcher to ramp up: prefetch the panel KN_PF rows ahead, one line per iteration,
    // cycling over its KP rows (KP lines of VW * KP bytes per KP iterations).
    const int8_t* pf = qk + KN_PF * N;
    const bool prefetch = k + KN_PF + KP <= K;
    for (int64_t n = n0; n < n1; n += VW) {
      if (prefetch) __builtin_prefetch(pf + ((n / VW) % KP) * N + (n & ~int64_t{63}));
      vf w[KP];
#pragma GCC unroll 16
      for (int j = 0; j < KP; ++j) w[j] = load_q(qk + j * N + n);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        vf a = load_f(yr + r * N + n);
#pragma GCC unroll 16
        for (int j = 0; j < KP; ++j) a += xs[r][j] * w[j];
        store_f(yr + r * N + n, a);
      }
    }
  }
  for (; k < K; ++k) {
    vf xs[R];
    for (int r = 0; r < R; ++r) xs[r] = splat(xr[r * K + k]);
    for (int64_t n = n0; n < n1; n += VW) {
      const vf w = load_q(q + k * N + n);
      for (int r = 0; r < R; ++r) store_f(yr + r * N + n, load_f(yr + r * N + n) + xs[r] * w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t n = n0; n < n1; n += VW)
      store_f(yr + r * N + n, load_f(yr + r * N + n) * load_f(scale + n));
}

// q [K, N]: columns [n0, n1) of every row of y.
void kn_columns(const float* x, const int8_t* q, const float* scale, float* y, int64_t M,
                int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nv = n0 + (n1 - n0) / VW * VW;
  if (nv > n0) {
    int64_t m = 0;
    // Each pass walks the columns' weights once. Five rows left take one pass of five (its
    // 20 + 5 vectors still fit AVX-512's registers) rather than four and a lone one: a
    // speculative verify of 4 drafts feeds 5 rows. A row's arithmetic is the same in any
    // pass, so its result does not depend on the others.
    for (; m + MR <= M && M - m != MR + 1; m += MR) kn_panel<MR>(x, q, scale, y, K, N, m, n0, nv);
    switch (M - m) {
      case 5: kn_panel<5>(x, q, scale, y, K, N, m, n0, nv); break;
      case 3: kn_panel<3>(x, q, scale, y, K, N, m, n0, nv); break;
      case 2: kn_panel<2>(x, q, scale, y, K, N, m, n0, nv); break;
      case 1: kn_panel<1>(x, q, scale, y, K, N, m, n0, nv); break;
      default: break;
    }
  }
  if (nv < n1) kn_tail(x, q, scale, y, K, N, 0, M, nv, n1);
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// q [N, K]: rows [n0, n0 + NR) of q against rows [m0, m0 + R) of x.
constexpr int64_t NK_PF = 8;  // prefetch distance, in rows of q

template <int R, int NR>
void nk_block(const float* x, const int8_t* q, const float* scale, float* y, int64_t K,
              int64_t N, int64_t m0, int64_t n0) {
  vf acc[R][NR];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = vf{};
  const float* xr = x + m0 * K;
  const int8_t* qr = q + n0 * K;
  int64_t k = 0;
  // The NR rows are contiguous (NR * K bytes): prefetch the block NK_PF rows ahead, one
  // line per iteration (NR * VW bytes are read per iteration).
  const int8_t* pf = qr + NK_PF * K;
  const bool prefetch = n0 + NR + NK_PF <= N;
  for (; k + VW <= K; k += VW) {
    if (prefetch) __builtin_prefetch(pf + k / VW * (NR * VW));
    vf w[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) w[j] = load_q(qr + j * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf xv = load_f(xr + r * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t kk = k; kk < K; ++kk)
        s += xr[r * K + kk] * static_cast<float>(qr[j * K + kk]);
      y[(m0 + r) * N + n0 + j] = s * scale[n0 + j];
    }
}

template <int NR>
void nk_rows(const float* x, const int8_t* q, const float* scale, float* y, int64_t M,
             int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) nk_block<MR, NR>(x, q, scale, y, K, N, m, n0);
  switch (M - m) {
    case 3: nk_block<3, NR>(x, q, scale, y, K, N, m, n0); break;
    case 2: nk_block<2, NR>(x, q, scale, y, K, N, m, n0); break;
    case 1: nk_block<1, NR>(x, q, scale, y, K, N, m, n0); break;
    default: break;
  }
}

constexpr int NK_NR = 4;      // rows of q per register block
constexpr int64_t NK_NB = 64;  // rows of q per block handed to a thread

// q [N, K]: the row block `b` of q (NK_NB rows; the last block takes the remainder).
void nk_row_block(const float* x, const int8_t* q, const float* scale, float* y, int64_t M,
                  int64_t K, int64_t N, int64_t b) {
  int64_t n0 = b * NK_NB;
  const int64_t n1 = std::min(N, n0 + NK_NB);
  for (; n0 + NK_NR <= n1; n0 += NK_NR) nk_rows<NK_NR>(x, q, scale, y, M, K, N, n0);
  for (; n0 < n1; ++n0) nk_rows<1>(x, q, scale, y, M, K, N, n0);
}

// How many threads a call uses: `max_threads` (0 = the pool's size), at most one per
// `kMinWork` multiply-adds so that small calls do not pay for the hand-off.
constexpr int64_t kMinWork = 1 << 18;

int64_t thread_count(ffi::ThreadPool& pool, int64_t max_threads, int64_t work) {
  int64_t n = max_threads > 0 ? max_threads : pool.num_threads();
  n = std::min(n, work / kMinWork);
  return std::max<int64_t>(n, 1);
}

ffi::Error check(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& q,
                 ffi::Buffer<ffi::F32>& scale, ffi::ResultBuffer<ffi::F32>& y, bool nk,
                 int64_t& M, int64_t& K, int64_t& N) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument("int8 matmul: x, q, y must be rank 2, scale rank 1");
  M = xd[0];
  K = xd[1];
  N = nk ? qd[0] : qd[1];
  if ((nk ? qd[1] : qd[0]) != K || sd[0] != N || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("int8 matmul: shapes do not match");
  return ffi::Error::Success();
}

ffi::Error MatmulKN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                    int64_t max_threads) {
  int64_t M, K, N;
  if (ffi::Error e = check(x, q, scale, y, false, M, K, N); e.failure()) return e;
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  // One block of columns per thread (a multiple of VW columns; the last takes the rest).
  const int64_t threads = thread_count(pool, max_threads, M * K * N);
  const int64_t width = std::max<int64_t>((N / threads + VW - 1) / VW * VW, VW);
  const int64_t blocks = (N + width - 1) / width;
  metrale::parallel_blocks(pool, threads, blocks, [=](int64_t b) {
    kn_columns(xp, qp, sp, yp, M, K, N, b * width, std::min(N, (b + 1) * width));
  });
  return ffi::Error::Success();
}

ffi::Error MatmulNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                    int64_t max_threads) {
  int64_t M, K, N;
  if (ffi::Error e = check(x, q, scale, y, true, M, K, N); e.failure()) return e;
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  const int64_t blocks = (N + NK_NB - 1) / NK_NB;
  metrale::parallel_blocks(pool, thread_count(pool, max_threads, M * K * N), blocks,
                  [=](int64_t b) { nk_row_block(xp, qp, sp, yp, M, K, N, b); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleInt8MatmulKN, MatmulKN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleInt8MatmulNK, MatmulNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_threads"));
