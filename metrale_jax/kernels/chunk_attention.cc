// Prefill-chunk attention over paged context for XLA:CPU, an XLA FFI custom call
// (metrale_jax/kernels; the contract of models/paged_attention.py's chunk_attention).
//
//   q [C, H, D] f32; k, v [C, K, D] f32, the chunk's own keys and values; seq [C] s32, each
//   token's page-table row (-1: padding, output 0); pos [C] s32, its position; pages
//   [N, ps, 2K, D] f32 (key head j at 2j, value head j at 2j + 1) or, for the int8 target,
//   [N, ps, 2K, D + 4] s8 (each row's D values, then its float32 scale's 4 bytes: a row
//   reads as value * scale, models/kv_quant.py); table [S, PPS] s32. Attributes: sm_scale;
//   soft_cap (0: none); window (0: none); q_tile (queries per task).
//
// A piece is a maximal run of real tokens with the same row and consecutive positions; its
// first token's position p0 is its context length. Token t of a piece sees the key positions
// 0 .. pos[t] of its row (and, with a window w, only those with pos[t] - kp < w): a
// position below p0 is read from the row's pages, position p0 + i is the piece's i-th chunk
// token (k, v). out [C, H, D] f32.
//
// Flash attention, as one GEMM-shaped job per task: a task is (a tile of up to q_tile
// consecutive tokens of one piece, kv head j); its q_tile * G query rows (packed, pre-scaled
// by sm_scale) walk the visible key positions in blocks of 64: each block's keys are packed
// transposed ([D][64]) and its values row-major ([64][D]), int8 rows dequantized on the way
// (the next block's page rows prefetched meanwhile), so that both products run as
// register-tiled multiply-adds (6 query rows x 64 keys, then 6 query rows x 64 head dims, in
// vectors of 16 floats: 24 accumulators) with an online softmax in float32 between them (a
// vector exp; masked keys weigh exactly 0). A task depends on nothing but its piece, so a
// piece's result is the same beside any other pieces. Tasks are shared out over XLA's
// intra-op pool, the longest first.
//
// Measured (bench/chunk_attention.py, 2 cores, the default model's shape): at 7,500 positions
// of context about 3/4 of a plain matmul's FLOP rate; the tile (q_tile 128) and the
// register tile (6 rows, loads kept in registers) were each worth 10 to 30%.

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
using metrale::splat;
using metrale::store_f;
using metrale::vf;
using metrale::VW;

typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

constexpr int64_t LB = 64;        // key positions per block
constexpr int64_t NKV = LB / VW;  // vectors per block row
constexpr int64_t MR = 6;         // query rows per register tile (24 accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for a vector (Cephes' expf polynomial on x - n ln 2, |error| ~ 1 ulp); x below
// -87.3 gives ~0, above 88.3 is clamped.
// s in all lanes, as one broadcast (splat's `vf{} + s` costs an add more).
inline vf bcast(float s) { return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// Keeps v in a register: GCC otherwise folds a vector's loads into every multiply-add that
// reads it, one load per use (and 512-bit loads, not multiply-adds, then bound the loop).
// (Only where a vector is one register: AVX-512.)
#if defined(__AVX512F__)
inline void keep(vf& v) { asm volatile("" : "+v"(v)); }
#else
inline void keep(vf&) {}
#endif

inline vf vexp(vf x) {
  x = x < splat(88.3762626647949f) ? x : splat(88.3762626647949f);
  x = x > splat(-87.3365447504f) ? x : splat(-87.3365447504f);
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500E-4f);
  p = p * r + splat(1.3981999507E-3f);
  p = p * r + splat(8.3334519073E-3f);
  p = p * r + splat(4.1665795894E-2f);
  p = p * r + splat(1.6666665459E-1f);
  p = p * r + splat(5.0000001201E-1f);
  p = p * r * r + r + splat(1.f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &e, sizeof(e));
  return p * two_n;
}

// tanh(y) for a vector: 1 - 2 / (exp(2y) + 1), and y - y^3/3 + 2y^5/15 where |y| < 2^-4
// (there the first form loses digits).
inline vf vtanh(vf y) {
  const vf big = splat(1.f) - splat(2.f) / (vexp(y + y) + splat(1.f));
  const vf y2 = y * y;
  const vf small = y * (splat(1.f) + y2 * (splat(-1.f / 3.f) + y2 * splat(2.f / 15.f)));
  const vf ay = y < splat(0.f) ? -y : y;
  return ay < splat(0.0625f) ? small : big;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// A pool row's scale: 1 for float32 rows; the float32 after the D values of an int8 row.
inline float row_scale(const float*, int64_t) { return 1.f; }

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

template <typename T>
constexpr int64_t row_extra() {
  return sizeof(T) == 1 ? 4 : 0;
}

struct Shape {
  int64_t C, H, D, DP, ps, K, G, PPS, N;
};

struct Tile {
  int64_t t0, t1;   // chunk tokens [t0, t1), one piece's
  int64_t first;    // the piece's first chunk index
  int64_t lo, hi;   // key positions [lo, hi) any of its queries sees
};

// S[MR rows][LB] = Q[r..r+MR) . KT  (Q rows of DP floats, KT [D][LB]).
__attribute__((noinline)) void qk_tile(const float* Q, const float* KT, float* S, int64_t D, int64_t DP) {
  vf acc[MR][NKV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf kt[NKV];
    for (int64_t c = 0; c < NKV; ++c) {
      kt[c] = load_f(KT + d * LB + c * VW);
      keep(kt[c]);
    }
    for (int64_t i = 0; i < MR; ++i) {
      const vf qs = bcast(Q[i * DP + d]);
      for (int64_t c = 0; c < NKV; ++c) acc[i][c] += qs * kt[c];
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t c = 0; c < NKV; ++c) store_f(S + i * LB + c * VW, acc[i][c]);
}

// O[MR rows][c0 .. c0 + NV*VW) += P[MR rows][0 .. n) . V[0 .. n)[...]  (V rows of DP floats).
template <int NV>
__attribute__((noinline)) void pv_tile(const float* P, const float* V, float* O, int64_t n, int64_t DP,
                    int64_t c0) {
  vf acc[MR][NV];
  for (int64_t i = 0; i < MR; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = load_f(O + i * DP + c0 + c * VW);
  for (int64_t l = 0; l < n; ++l) {
    vf vv[NV];
    for (int c = 0; c < NV; ++c) {
      vv[c] = load_f(V + l * DP + c0 + c * VW);
      keep(vv[c]);
    }
    for (int64_t i = 0; i < MR; ++i) {
      const vf ps = bcast(P[i * LB + l]);
      for (int c = 0; c < NV; ++c) acc[i][c] += ps * vv[c];
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int c = 0; c < NV; ++c) store_f(O + i * DP + c0 + c * VW, acc[i][c]);
}

inline void pv_rows(const float* P, const float* V, float* O, int64_t n, int64_t DP) {
  int64_t c0 = 0;
  for (; c0 + 4 * VW <= DP; c0 += 4 * VW) pv_tile<4>(P, V, O, n, DP, c0);
  switch ((DP - c0) / VW) {
    case 3: pv_tile<3>(P, V, O, n, DP, c0); break;
    case 2: pv_tile<2>(P, V, O, n, DP, c0); break;
    case 1: pv_tile<1>(P, V, O, n, DP, c0); break;
    default: break;
  }
}

struct Scratch {
  std::vector<float> Q, O, S, KT, V, m, l;
  std::vector<int64_t> vlo, vhi;
};

template <typename T>
void run_task(const float* q, const float* k, const float* v, const int32_t* seq,
              const int32_t* pos, const T* pages, const int32_t* table, float* out,
              const Shape& sh, const Tile& tile, int64_t j, float sm_scale, float soft_cap,
              int64_t window, Scratch& w) {
  const int64_t D = sh.D, DP = sh.DP, G = sh.G, H = sh.H, K = sh.K, ps = sh.ps;
  const int64_t K2 = 2 * K, RD = D + row_extra<T>();
  const int64_t nt = tile.t1 - tile.t0, R = nt * G, RP = (R + MR - 1) / MR * MR;
  const int64_t row = seq[tile.t0], p0 = pos[tile.first];
  const int32_t* trow = table + row * sh.PPS;
  w.Q.assign(RP * DP, 0.f);
  w.O.assign(RP * DP, 0.f);
  w.S.resize(RP * LB);
  w.KT.assign(DP * LB, 0.f);
  w.V.assign(LB * DP, 0.f);
  w.m.assign(RP, kNegInf);
  w.l.assign(RP, 0.f);
  w.vlo.resize(RP);
  w.vhi.resize(RP);
  for (int64_t ti = 0; ti < nt; ++ti)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = q + ((tile.t0 + ti) * H + j * G + g) * D;
      float* dst = w.Q.data() + (ti * G + g) * DP;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sm_scale;
    }
  float* KT = w.KT.data();
  float* V = w.V.data();
  for (int64_t b0 = tile.lo; b0 < tile.hi; b0 += LB) {
    const int64_t n = std::min(LB, tile.hi - b0);
    // Pack the block's keys transposed and its values, as floats.
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = b0 + i;
      if (p + LB < std::min(tile.hi, p0)) {  // the next block's rows, on their way to cache
        const int64_t page = std::min<int64_t>(std::max<int32_t>(trow[(p + LB) / ps], 0), sh.N - 1);
        const char* next = reinterpret_cast<const char*>(
            pages + ((page * ps + (p + LB) % ps) * K2 + 2 * j) * RD);
        for (int64_t b = 0; b < static_cast<int64_t>(2 * RD * sizeof(T)); b += 64)
          __builtin_prefetch(next + b);
      }
      if (p < p0) {
        const int64_t page = std::min<int64_t>(std::max<int32_t>(trow[p / ps], 0), sh.N - 1);
        const T* kr = pages + ((page * ps + p % ps) * K2 + 2 * j) * RD;
        const T* vr = kr + RD;
        const float ks = row_scale(kr, D), vs = row_scale(vr, D);
        for (int64_t d = 0; d < D; ++d) {
          KT[d * LB + i] = static_cast<float>(kr[d]) * ks;
          V[i * DP + d] = static_cast<float>(vr[d]) * vs;
        }
      } else {
        const int64_t c = tile.first + (p - p0);
        const float* kr = k + (c * K + j) * D;
        const float* vr = v + (c * K + j) * D;
        for (int64_t d = 0; d < D; ++d) KT[d * LB + i] = kr[d];
        std::memcpy(V + i * DP, vr, D * sizeof(float));
      }
    }
    for (int64_t i = n; i < LB; ++i) {  // stale columns and rows past the block: zeros
      for (int64_t d = 0; d < D; ++d) KT[d * LB + i] = 0.f;
      std::memset(V + i * DP, 0, DP * sizeof(float));
    }
    // Each query row's visible keys in this block: [vlo, vhi) block offsets.
    bool any = false;
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t pt = pos[tile.t0 + ti];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pt - window + 1 - b0) : 0;
      const int64_t hi = std::min<int64_t>(n, pt + 1 - b0);
      for (int64_t g = 0; g < G; ++g) {
        w.vlo[ti * G + g] = lo;
        w.vhi[ti * G + g] = hi;
      }
      any |= lo < hi;
    }
    if (!any) continue;
    for (int64_t r = 0; r < RP; r += MR) qk_tile(w.Q.data() + r * DP, KT, w.S.data() + r * LB, D, DP);
    for (int64_t r = 0; r < RP; ++r) {
      float* s = w.S.data() + r * LB;
      const int64_t lo = r < R ? w.vlo[r] : 0, hi = r < R ? w.vhi[r] : 0;
      if (lo >= hi) {  // nothing visible: no weight, statistics unchanged
        std::memset(s, 0, LB * sizeof(float));
        continue;
      }
      if (soft_cap > 0.f)
        for (int64_t c = 0; c < NKV; ++c)
          store_f(s + c * VW, splat(soft_cap) * vtanh(load_f(s + c * VW) / splat(soft_cap)));
      float mb = kNegInf;
      if (lo == 0 && hi == LB) {
        vf mv = load_f(s);
        for (int64_t c = 1; c < NKV; ++c) {
          const vf x = load_f(s + c * VW);
          mv = mv > x ? mv : x;
        }
        for (int i = 0; i < VW; ++i) mb = std::max(mb, mv[i]);
      } else {
        for (int64_t i = lo; i < hi; ++i) mb = std::max(mb, s[i]);
      }
      const float m_new = std::max(w.m[r], mb);
      const float corr = std::exp(w.m[r] - m_new);  // exp(-inf) = 0 on the first block
      vf sum{};
      for (int64_t c = 0; c < NKV; ++c) {
        const vf e = vexp(load_f(s + c * VW) - splat(m_new));
        sum += e;
        store_f(s + c * VW, e);
      }
      float total = 0.f;
      if (lo == 0 && hi == LB) {
        total = hsum(sum);
      } else {  // masked keys weigh exactly 0
        for (int64_t i = 0; i < lo; ++i) s[i] = 0.f;
        for (int64_t i = hi; i < LB; ++i) s[i] = 0.f;
        for (int64_t i = lo; i < hi; ++i) total += s[i];
      }
      w.l[r] = w.l[r] * corr + total;
      w.m[r] = m_new;
      if (corr != 1.f) {
        float* o = w.O.data() + r * DP;
        for (int64_t d = 0; d < DP; ++d) o[d] *= corr;
      }
    }
    for (int64_t r = 0; r < RP; r += MR) pv_rows(w.S.data() + r * LB, V, w.O.data() + r * DP, n, DP);
  }
  for (int64_t ti = 0; ti < nt; ++ti)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = ti * G + g;
      const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
      const float* o = w.O.data() + r * DP;
      float* dst = out + ((tile.t0 + ti) * H + j * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
}

constexpr int64_t kMinWork = 1 << 16;  // multiply-adds per thread before the pool helps

template <ffi::DataType PT>
ffi::Error ChunkAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seq,
                          ffi::Buffer<ffi::S32> pos, ffi::Buffer<PT> pages,
                          ffi::Buffer<ffi::S32> table, ffi::ResultBuffer<ffi::F32> out,
                          float sm_scale, float soft_cap, int64_t window, int64_t q_tile) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(pages.typed_data())>>;
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = seq.dimensions(),
       xd = pos.dimensions(), pd = pages.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || sd.size() != 1 || xd.size() != 1 ||
      pd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("chunk attention: arguments of wrong rank");
  Shape sh{qd[0], qd[1], qd[2], 0, pd[1], pd[2] / 2, 0, td[1], pd[0]};
  if (pd[3] != sh.D + row_extra<T>() || pd[2] % 2 || sh.K == 0 || sh.H % sh.K ||
      kd[0] != sh.C || kd[1] != sh.K || kd[2] != sh.D || vd[0] != sh.C || vd[1] != sh.K ||
      vd[2] != sh.D || sd[0] != sh.C || xd[0] != sh.C || q_tile < 1)
    return ffi::Error::InvalidArgument("chunk attention: shapes do not match");
  sh.G = sh.H / sh.K;
  sh.DP = (sh.D + VW - 1) / VW * VW;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* sp = seq.typed_data();
  const int32_t* xp = pos.typed_data();
  const T* pp = pages.typed_data();
  const int32_t* tp = table.typed_data();
  float* op = out->typed_data();
  const int64_t S = td[0], max_pos = sh.PPS * sh.ps;
  // Pieces, cut into tiles of up to q_tile tokens.
  std::vector<Tile> tiles;
  int64_t work = 0;
  for (int64_t t = 0; t < sh.C;) {
    if (sp[t] < 0 || sp[t] >= S || xp[t] < 0 || xp[t] >= max_pos) {  // padding or out of range
      std::fill(op + t * sh.H * sh.D, op + (t + 1) * sh.H * sh.D, 0.f);
      ++t;
      continue;
    }
    int64_t e = t + 1;
    while (e < sh.C && sp[e] == sp[t] && xp[e] == xp[e - 1] + 1 && xp[e] < max_pos) ++e;
    for (int64_t a = t; a < e; a += q_tile) {
      Tile tile{a, std::min(e, a + q_tile), t, 0, 0};
      tile.hi = xp[tile.t1 - 1] + 1;
      tile.lo = window > 0 ? std::max<int64_t>(0, xp[a] - window + 1) : 0;
      work += (tile.hi - tile.lo) * (tile.t1 - tile.t0);
      tiles.push_back(tile);
    }
    t = e;
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
    return (a.hi - a.lo) * (a.t1 - a.t0) > (b.hi - b.lo) * (b.t1 - b.t0);
  });
  work *= sh.H * sh.D * 2;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), work / kMinWork));
  const int64_t K = sh.K;
  const Tile* tl = tiles.data();
  metrale::parallel_blocks(pool, threads, static_cast<int64_t>(tiles.size()) * K,
                           [=](int64_t b) {
                             thread_local Scratch scratch;
                             run_task(qp, kp, vp, sp, xp, pp, tp, op, sh, tl[b / K], b % K,
                                      sm_scale, soft_cap, window, scratch);
                           });
  return ffi::Error::Success();
}

}  // namespace

#define METRALE_CHUNK_ATTENTION(name, PT)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, ChunkAttention<PT>,               \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Arg<ffi::Buffer<PT>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Ret<ffi::Buffer<ffi::F32>>()       \
                                    .Attr<float>("sm_scale")            \
                                    .Attr<float>("soft_cap")            \
                                    .Attr<int64_t>("window")            \
                                    .Attr<int64_t>("q_tile"))

METRALE_CHUNK_ATTENTION(MetraleChunkAttention, ffi::F32);
METRALE_CHUNK_ATTENTION(MetraleChunkAttentionInt8, ffi::S8);
