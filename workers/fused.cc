// Fused kernels for XLA's CPU backend, called through the XLA FFI (`pipeline/fused.py`
// defines the operations and holds the JAX definitions they must match; `workers/native.py`
// compiles this file and registers the targets): causal self-attention, layer norm, the
// weight gradient of a projection, and GELU.
//
// Attention. Both targets take the packed projection `qkv`, f32[b*t, 3*d] laid out as [b, t, 3, h, dh] (the
// model's `y @ W_qkv`), and work on one (batch row, head) slice at a time:
//
//   diloco_attention_fwd(qkv) -> (y f32[b*t, d] laid out as [b, t, h, dh],
//                                 lse f32[b*h*t]: each query row's log-sum-exp of its scores)
//   diloco_attention_bwd(qkv, y, lse, dy) -> dqkv f32[b*t, 3*d]
//
// with scores scale * q_i . k_j for j <= i only (the causal half: the masked half is never
// computed), a row softmax, and y_i = sum_j p_ij v_j. The backward pass recomputes p from the
// saved log-sum-exp (nothing of size t*t is kept between the passes) and forms, per row,
// ds_ij = p_ij (dy_i . v_j - dy_i . y_i), dq_i = scale sum_j ds_ij k_j,
// dk_j += scale ds_ij q_i and dv_j += p_ij dy_i.
//
// Layer norm over the last axis of x f32[n, d], as mu = mean(x), var = mean((x - mu)^2),
// y = (x - mu) rsqrt(var + eps) g + b:
//
//   diloco_layer_norm_fwd(x, g, b) -> (y f32[n, d], rstd f32[n])
//   diloco_layer_norm_bwd(x, g, rstd, dy) -> (dx f32[n, d], dg f32[d], db f32[d])
//
// with xhat = (x - mu) rstd, dx = rstd (dy g - mean(dy g) - xhat mean(dy g xhat)),
// dg = sum over rows of dy xhat, db = sum of dy (the backward pass recomputes mu).
//
// Work runs on XLA's intra-op thread pool in pieces of a fixed size (a slice, or a block of
// rows); each piece is computed by one thread in one fixed order, and the column sums of the
// layer norm's backward pass add the blocks' partial sums in block order, so the results do
// not depend on the number of threads.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;  // score columns computed together (kept in registers)
constexpr int64_t kRows = 8;    // query rows computed together (sharing each key/value load)
constexpr int64_t kMaxHeadDim = 256;

struct Dims {
  int64_t b, t, h, dh, d, tpad;
  float scale;
};

// Sixteen floats; GCC lowers it to whatever vector registers the target has (one AVX-512
// register, two AVX ones, four SSE ones). Loads and stores go through memcpy (unaligned).
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

typedef int32_t vi16 __attribute__((vector_size(64)));
const vi16 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// All lanes x (as a broadcast: `v16{} + x` would add 0 first, one more instruction each time)
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// e^x lane by lane for x <= ~0 (a score less its row's maximum or log-sum-exp), to ~2 ulp
// (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, 2^n from the exponent bits).
// Below -87 the result is ~0 (1e-38).
inline v16 exp16(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (x * 1.44269504088896341f + shifter) - shifter;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * __builtin_bit_cast(v16, bits);
}

// Lanes j0 + lane < n: true.
inline vi16 below(int64_t j0, int64_t n) {
  return kIota < static_cast<int32_t>(std::min<int64_t>(n - j0, 16));
}

// One score row s[0 .. n) (scaled in place by `scale`) becomes e^(s - max) with zeros from n
// to the next multiple of 16; returns the row's maximum and the sum of the exponentials.
inline void row_softmax(float* s, int64_t n, float scale, float* max_out, float* sum_out) {
  v16 m = splat(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const v16 v = load16(s + j0) * scale;
    m = below(j0, n) ? (v > m ? v : m) : m;
  }
  float mx = m[0];
  for (int u = 1; u < 16; ++u) mx = std::max(mx, m[u]);
  v16 l = {};
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const v16 e = below(j0, n) ? exp16(load16(s + j0) * scale - mx) : v16{};
    store16(s + j0, e);
    l += e;
  }
  float sum = 0.0f;
  for (int u = 0; u < 16; ++u) sum += l[u];
  *max_out = mx;
  *sum_out = sum;
}

// s[a][j] = x_a . kt[:, j] for the block's kRows rows x_a and j < ncols (a multiple of kBlock;
// columns past a row's causal limit are computed and overwritten by the caller).
inline void block_scores(const float* const* x, const float* kt, const Dims& D, int64_t ncols,
                         float* s) {
  static_assert(kBlock == 16, "block_scores is written for blocks of 16 columns");
  for (int64_t j0 = 0; j0 < ncols; j0 += kBlock) {
    v16 acc[kRows] = {};
    for (int64_t c = 0; c < D.dh; ++c) {
      const v16 k = load16(kt + c * D.tpad + j0);
      for (int64_t a = 0; a < kRows; ++a) acc[a] += x[a][c] * k;
    }
    for (int64_t a = 0; a < kRows; ++a) store16(s + a * D.tpad + j0, acc[a]);
  }
}

// out[a][:] = sum_{j < n} w[a][j] * rows[j * stride .. + dh] for each of the block's rows.
// NV > 0: dh = 16 * NV, in registers; NV = 0: any dh, plain loops.
template <int64_t NV>
inline void block_weighted_rows(const float* w, const float* rows, int64_t stride, int64_t n,
                                const Dims& D, float* out /* [kRows][dh] */) {
  if constexpr (NV > 0) {
    v16 acc[kRows][NV] = {};
    for (int64_t j = 0; j < n; ++j) {
      v16 r[NV];
      for (int64_t u = 0; u < NV; ++u) r[u] = load16(rows + j * stride + 16 * u);
      for (int64_t a = 0; a < kRows; ++a) {
        const float wj = w[a * D.tpad + j];
        for (int64_t u = 0; u < NV; ++u) acc[a][u] += wj * r[u];
      }
    }
    for (int64_t a = 0; a < kRows; ++a)
      for (int64_t u = 0; u < NV; ++u) store16(out + a * 16 * NV + 16 * u, acc[a][u]);
  } else {
    const int64_t dh = D.dh;
    std::fill(out, out + kRows * dh, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float* r = rows + j * stride;
      for (int64_t a = 0; a < kRows; ++a) {
        const float wj = w[a * D.tpad + j];
        for (int64_t c = 0; c < dh; ++c) out[a * dh + c] += wj * r[c];
      }
    }
  }
}

// acc[j][:] += sum_a w[a][j] * x_a for j < n (acc contiguous, dh floats per row)
template <int64_t NV>
inline void block_scatter_rows(const float* w, const float* const* x, int64_t n, const Dims& D,
                               float* acc) {
  if constexpr (NV > 0) {
    v16 xs[kRows][NV];
    for (int64_t a = 0; a < kRows; ++a)
      for (int64_t u = 0; u < NV; ++u) xs[a][u] = load16(x[a] + 16 * u);
    for (int64_t j = 0; j < n; ++j) {
      float* out = acc + j * 16 * NV;
      v16 sum[NV];
      for (int64_t u = 0; u < NV; ++u) sum[u] = load16(out + 16 * u);
      for (int64_t a = 0; a < kRows; ++a) {
        const float wj = w[a * D.tpad + j];
        for (int64_t u = 0; u < NV; ++u) sum[u] += wj * xs[a][u];
      }
      for (int64_t u = 0; u < NV; ++u) store16(out + 16 * u, sum[u]);
    }
  } else {
    const int64_t dh = D.dh;
    for (int64_t j = 0; j < n; ++j) {
      float* out = acc + j * dh;
      for (int64_t a = 0; a < kRows; ++a) {
        const float wj = w[a * D.tpad + j];
        for (int64_t c = 0; c < dh; ++c) out[c] += wj * x[a][c];
      }
    }
  }
}

// A slice's transposed copy of one of q/k/v (which = 0, 1, 2): out[c][tpad], zero-padded.
void transpose_part(const float* qkv, const Dims& D, int64_t bi, int64_t hi, int which,
                    float* out) {
  const int64_t row = 3 * D.d;
  const float* base = qkv + bi * D.t * row + which * D.d + hi * D.dh;
  for (int64_t i = 0; i < D.t; ++i) {
    const float* r = base + i * row;
    for (int64_t c = 0; c < D.dh; ++c) out[c * D.tpad + i] = r[c];
  }
  for (int64_t c = 0; c < D.dh; ++c)
    for (int64_t i = D.t; i < D.tpad; ++i) out[c * D.tpad + i] = 0.0f;
}

std::vector<float>& scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// The block of query rows i0 .. i0 + kRows: a row past t repeats row t - 1 (its results are
// dropped). Columns of the block reach `ncols` (rounded up to kBlock); row a's own ones end at
// i0 + a + 1.
struct RowBlock {
  int64_t i0, rows, nmax, ncols;
  RowBlock(const Dims& D, int64_t i0_) : i0(i0_) {
    rows = std::min(kRows, D.t - i0);
    nmax = i0 + rows;
    ncols = (nmax + kBlock - 1) / kBlock * kBlock;
  }
  int64_t row(int64_t a) const { return i0 + std::min(a, rows - 1); }
};

template <int64_t NV>
void forward_slice(const float* qkv, float* y, float* lse, const Dims& D, int64_t slice) {
  const int64_t bi = slice / D.h, hi = slice % D.h, row = 3 * D.d, dh = D.dh;
  std::vector<float>& buf = scratch(dh * D.tpad + kRows * D.tpad);
  float* kt = buf.data();
  float* s = kt + dh * D.tpad;
  transpose_part(qkv, D, bi, hi, 1, kt);
  const float* q = qkv + bi * D.t * row + hi * dh;
  const float* v = q + 2 * D.d;
  float o[kRows * kMaxHeadDim];
  for (int64_t i0 = 0; i0 < D.t; i0 += kRows) {
    const RowBlock B(D, i0);
    const float* x[kRows];
    for (int64_t a = 0; a < kRows; ++a) x[a] = q + B.row(a) * row;
    block_scores(x, kt, D, B.ncols, s);
    float inv[kRows];
    for (int64_t a = 0; a < kRows; ++a) {
      const int64_t n = B.row(a) + 1;
      float* sa = s + a * D.tpad;
      float m, l;
      row_softmax(sa, n, D.scale, &m, &l);
      for (int64_t j = (n + 15) / 16 * 16; j < B.nmax; ++j) sa[j] = 0.0f;
      inv[a] = 1.0f / l;
      if (a < B.rows) lse[slice * D.t + i0 + a] = m + std::log(l);
    }
    block_weighted_rows<NV>(s, v, row, B.nmax, D, o);
    for (int64_t a = 0; a < B.rows; ++a) {
      float* yi = y + (bi * D.t + i0 + a) * D.d + hi * dh;
      for (int64_t c = 0; c < dh; ++c) yi[c] = o[a * dh + c] * inv[a];
    }
  }
}

template <int64_t NV>
void backward_slice(const float* qkv, const float* y, const float* lse, const float* dy,
                    float* dqkv, const Dims& D, int64_t slice) {
  const int64_t bi = slice / D.h, hi = slice % D.h, row = 3 * D.d;
  const int64_t t = D.t, dh = D.dh;
  std::vector<float>& buf = scratch(2 * dh * D.tpad + 2 * t * dh + 2 * kRows * D.tpad);
  float* kt = buf.data();
  float* vt = kt + dh * D.tpad;
  float* dk = vt + dh * D.tpad;
  float* dv = dk + t * dh;
  float* s = dv + t * dh;
  float* ds = s + kRows * D.tpad;
  transpose_part(qkv, D, bi, hi, 1, kt);
  transpose_part(qkv, D, bi, hi, 2, vt);
  std::fill(dk, dk + 2 * t * dh, 0.0f);
  const float* q = qkv + bi * t * row + hi * dh;
  const float* k = q + D.d;
  float dq[kRows * kMaxHeadDim];
  for (int64_t i0 = 0; i0 < t; i0 += kRows) {
    const RowBlock B(D, i0);
    const float *qa[kRows], *dya[kRows];
    float delta[kRows], li[kRows];
    for (int64_t a = 0; a < kRows; ++a) {
      const int64_t i = B.row(a);
      qa[a] = q + i * row;
      dya[a] = dy + (bi * t + i) * D.d + hi * dh;
      const float* yi = y + (bi * t + i) * D.d + hi * dh;
      float sum = 0.0f;
      for (int64_t c = 0; c < dh; ++c) sum += dya[a][c] * yi[c];
      delta[a] = sum;
      li[a] = lse[slice * t + i];
    }
    block_scores(qa, kt, D, B.ncols, s);
    block_scores(dya, vt, D, B.ncols, ds);
    for (int64_t a = 0; a < kRows; ++a) {
      const int64_t n = a < B.rows ? i0 + a + 1 : 0;  // a repeated row contributes nothing
      float* sa = s + a * D.tpad;
      float* dsa = ds + a * D.tpad;
      const float scale = D.scale, la = li[a], da = delta[a];
      for (int64_t j0 = 0; j0 < B.nmax; j0 += 16) {
        const vi16 keep = below(j0, n);
        const v16 p = keep ? exp16(load16(sa + j0) * scale - la) : v16{};
        store16(sa + j0, p);
        store16(dsa + j0, keep ? p * (load16(dsa + j0) - da) * scale : v16{});
      }
    }
    block_weighted_rows<NV>(ds, k, row, B.nmax, D, dq);
    for (int64_t a = 0; a < B.rows; ++a) {
      float* dqi = dqkv + (bi * t + i0 + a) * row + hi * dh;
      for (int64_t c = 0; c < dh; ++c) dqi[c] = dq[a * dh + c];
    }
    block_scatter_rows<NV>(ds, qa, B.nmax, D, dk);
    block_scatter_rows<NV>(s, dya, B.nmax, D, dv);
  }
  for (int64_t j = 0; j < t; ++j) {
    float* dkj = dqkv + (bi * t + j) * row + D.d + hi * dh;
    float* dvj = dkj + D.d;
    for (int64_t c = 0; c < dh; ++c) {
      dkj[c] = dk[j * dh + c];
      dvj[c] = dv[j * dh + c];
    }
  }
}

// Runs f(0 .. n) on the calling thread and the pool. Work is claimed from a shared counter,
// so the caller finishes whatever no pool thread has taken and never waits on a task that has
// not started; a task that starts after the work is gone touches only the shared counters.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const F& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (workers <= 0) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  auto st = std::make_shared<State>();
  const F* fp = &f;
  auto run = [st, fp, n]() {
    for (int64_t i; (i = st->next.fetch_add(1)) < n;) {
      (*fp)(i);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 0; w < workers; ++w) pool.Schedule(decltype(run)(run));
  run();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

constexpr int64_t kNormRows = 64;  // rows per block of the layer norm

// sum of a[c] * b[c] (b = nullptr: of a[c]) over c < d, in 16 lanes, then across them
inline float lane_sum(const float* a, const float* b, int64_t d) {
  v16 acc = {};
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) acc += b ? load16(a + c) * load16(b + c) : load16(a + c);
  float sum = 0.0f;
  for (int u = 0; u < 16; ++u) sum += acc[u];
  for (; c < d; ++c) sum += b ? a[c] * b[c] : a[c];
  return sum;
}

void layer_norm_block(const float* x, const float* g, const float* b, float* y, float* rstd,
                      int64_t d, float eps, int64_t r0, int64_t r1) {
  std::vector<float>& buf = scratch(d);
  float* xc = buf.data();
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * d;
    const float mu = lane_sum(xr, nullptr, d) / static_cast<float>(d);
    for (int64_t c = 0; c < d; ++c) xc[c] = xr[c] - mu;
    const float rs = 1.0f / std::sqrt(lane_sum(xc, xc, d) / static_cast<float>(d) + eps);
    float* yr = y + r * d;
    for (int64_t c = 0; c < d; ++c) yr[c] = xc[c] * rs * g[c] + b[c];
    rstd[r] = rs;
  }
}

// dx for rows r0 .. r1, and that block's column sums of dy xhat and dy into pg, pb
void layer_norm_grad_block(const float* x, const float* g, const float* rstd, const float* dy,
                           float* dx, float* pg, float* pb, int64_t d, int64_t r0, int64_t r1) {
  std::fill(pg, pg + d, 0.0f);
  std::fill(pb, pb + d, 0.0f);
  std::vector<float>& buf = scratch(2 * d);
  float* xhat = buf.data();
  float* gy = xhat + d;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const float mu = lane_sum(xr, nullptr, d) / static_cast<float>(d), rs = rstd[r];
    for (int64_t c = 0; c < d; ++c) {
      xhat[c] = (xr[c] - mu) * rs;
      gy[c] = dyr[c] * g[c];
      pg[c] += dyr[c] * xhat[c];
      pb[c] += dyr[c];
    }
    const float m1 = lane_sum(gy, nullptr, d) / static_cast<float>(d);
    const float m2 = lane_sum(gy, xhat, d) / static_cast<float>(d);
    float* dxr = dx + r * d;
    for (int64_t c = 0; c < d; ++c) dxr[c] = rs * (gy[c] - m1 - xhat[c] * m2);
  }
}

ffi::Error layer_norm_fwd_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> b,
                               ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> rstd,
                               float eps) {
  auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] < 1)
    return ffi::Error::InvalidArgument("layer norm: x must be 2-D with a non-empty last axis");
  const int64_t n = dims[0], d = dims[1];
  if (g.element_count() != d || b.element_count() != d || y->element_count() != n * d ||
      rstd->element_count() != n)
    return ffi::Error::InvalidArgument("layer norm: operand shapes do not match x");
  const float *xp = x.typed_data(), *gp = g.typed_data(), *bp = b.typed_data();
  float *yp = y->typed_data(), *rp = rstd->typed_data();
  const int64_t blocks = (n + kNormRows - 1) / kNormRows;
  parallel_for(pool, blocks, [&](int64_t k) {
    layer_norm_block(xp, gp, bp, yp, rp, d, eps, k * kNormRows,
                     std::min(n, (k + 1) * kNormRows));
  });
  return ffi::Error::Success();
}

ffi::Error layer_norm_bwd_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> rstd,
                               ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx,
                               ffi::ResultBuffer<ffi::F32> dg, ffi::ResultBuffer<ffi::F32> db) {
  auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] < 1)
    return ffi::Error::InvalidArgument("layer norm: x must be 2-D with a non-empty last axis");
  const int64_t n = dims[0], d = dims[1];
  if (g.element_count() != d || rstd.element_count() != n || dy.element_count() != n * d ||
      dx->element_count() != n * d || dg->element_count() != d || db->element_count() != d)
    return ffi::Error::InvalidArgument("layer norm: operand shapes do not match x");
  const int64_t blocks = (n + kNormRows - 1) / kNormRows;
  std::vector<float> partial(2 * blocks * d);  // each block's column sums, added in order
  const float *xp = x.typed_data(), *gp = g.typed_data(), *rp = rstd.typed_data(),
              *dyp = dy.typed_data();
  float* dxp = dx->typed_data();
  parallel_for(pool, blocks, [&](int64_t k) {
    layer_norm_grad_block(xp, gp, rp, dyp, dxp, partial.data() + 2 * k * d,
                          partial.data() + (2 * k + 1) * d, d, k * kNormRows,
                          std::min(n, (k + 1) * kNormRows));
  });
  float *dgp = dg->typed_data(), *dbp = db->typed_data();
  std::fill(dgp, dgp + d, 0.0f);
  std::fill(dbp, dbp + d, 0.0f);
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t c = 0; c < d; ++c) {
      dgp[c] += partial[2 * k * d + c];
      dbp[c] += partial[(2 * k + 1) * d + c];
    }
  return ffi::Error::Success();
}

// The weight gradient of a projection y = x W, dW = x^T dy: c f32[m, n] = a^T b for
// a f32[k, m] and b f32[k, n]. The work is cut by shape alone (never by the thread count): c's
// columns into groups of at most kGroup, and k into `splits` ranges where c is small enough to
// keep a partial sum per range (so that a product with a small result and a long k still has
// several tasks). A task walks its k range in chunks of kChunk, copying the chunk's rows of b
// into panels of 32 columns (zero-padded at c's edge: they stay in the L1 cache while every
// part of c's rows reads them) and adds each 8 x 32 block of c's partial sum as 16 vectors
// kept in registers while the chunk runs: a row of a (8 values, each broadcast) times a row
// of b per k. a's rows are read in place (a zero-padded copy only where c's rows end in a
// partial part of 8). Each element of a range's partial sum is one sequential sum in k order, and the
// ranges' partial sums are added in range order: the result does not depend on the number of
// threads.
constexpr int64_t kPanel = 32;   // columns of c per block (two vectors)
constexpr int64_t kGroup = 256;  // columns of c per task, at most
constexpr int64_t kChunk = 64;   // rows of a and b copied at a time
constexpr int64_t kRowBlock = 256;  // rows of c per copied block of a
constexpr int64_t kSplitMin = 256;  // fewest rows of a and b per k range
constexpr int64_t kPartialFloats = int64_t{4} << 20;  // the partial sums' buffer, at most
#ifdef __AVX512F__
constexpr int kPartM = 8;  // 16 accumulators of the 32 vector registers
#else
constexpr int kPartM = 4;  // a v16 is two or four registers: fewer rows, fewer spills
#endif

// c[r * ldc + 0 .. 32) += sum over i < kc of a[i * as + r] * b[i * kPanel + 0 .. 32) for
// r < kPartM, in i order, the sums kept in vector registers while i runs
inline void gram_block(const float* a, int64_t as, const float* b, int64_t kc, float* c,
                       int64_t ldc) {
  v16 s[kPartM][2];
  for (int r = 0; r < kPartM; ++r) {
    s[r][0] = load16(c + r * ldc);
    s[r][1] = load16(c + r * ldc + 16);
  }
  for (int64_t i = 0; i < kc; ++i) {
    const v16 b0 = load16(b + i * kPanel), b1 = load16(b + i * kPanel + 16);
    for (int r = 0; r < kPartM; ++r) {
      const v16 x = splat(a[i * as + r]);
      s[r][0] += x * b0;
      s[r][1] += x * b1;
    }
  }
  for (int r = 0; r < kPartM; ++r) {
    store16(c + r * ldc, s[r][0]);
    store16(c + r * ldc + 16, s[r][1]);
  }
}

// out[r * n + j] = sum over k0 <= i < k1 of a[i * m + r] * b[i * n + n0 + j], r < m, j < nw
void gram_task(const float* a, const float* b, int64_t m, int64_t n, int64_t k0, int64_t k1,
               int64_t n0, int64_t nw, float* out) {
  const int64_t panels = (nw + kPanel - 1) / kPanel, wp = panels * kPanel;
  const int64_t mp = (m + kPartM - 1) / kPartM * kPartM;
  const int64_t rb = std::min(kRowBlock, mp);
  std::vector<float>& buf = scratch(mp * wp + kChunk * (wp + rb));
  float* acc = buf.data();     // [mp][wp]
  float* bp = acc + mp * wp;   // [panels][kChunk][kPanel]
  float* ap = bp + kChunk * wp;  // [rb / kPartM][kChunk][kPartM]
  std::fill(acc, acc + mp * wp, 0.0f);
  std::fill(bp, bp + kChunk * wp, 0.0f);
  std::fill(ap, ap + kChunk * rb, 0.0f);
  for (int64_t c0 = k0; c0 < k1; c0 += kChunk) {
    const int64_t kc = std::min(kChunk, k1 - c0);
    for (int64_t i = 0; i < kc; ++i) {
      const float* row = b + (c0 + i) * n + n0;
      for (int64_t j = 0; j < panels; ++j) {
        float* dst = bp + (j * kChunk + i) * kPanel;
        if (nw - j * kPanel >= kPanel) {
          store16(dst, load16(row + j * kPanel));
          store16(dst + 16, load16(row + j * kPanel + 16));
        } else {
          std::memcpy(dst, row + j * kPanel, (nw - j * kPanel) * sizeof(float));
        }
      }
    }
    for (int64_t r0 = 0; r0 < m; r0 += rb) {
      const int64_t rw = std::min(rb, m - r0), parts = (rw + kPartM - 1) / kPartM;
      // a's rows are read where they are (kc rows of m floats: in the L1 cache for a small
      // m), unless a partial part needs a zero-padded copy
      const bool whole = rw % kPartM == 0;
      if (!whole) {
        for (int64_t i = 0; i < kc; ++i) {
          const float* row = a + (c0 + i) * m + r0;
          for (int64_t p = 0; p < parts; ++p) {
            float* dst = ap + (p * kChunk + i) * kPartM;
            std::memcpy(dst, row + p * kPartM,
                        std::min<int64_t>(kPartM, rw - p * kPartM) * sizeof(float));
          }
        }
      }
      for (int64_t j = 0; j < panels; ++j)
        for (int64_t p = 0; p < parts; ++p)
          gram_block(whole ? a + c0 * m + r0 + p * kPartM : ap + p * kChunk * kPartM,
                     whole ? m : kPartM, bp + j * kChunk * kPanel, kc,
                     acc + (r0 + p * kPartM) * wp + j * kPanel, wp);
    }
  }
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(out + r * n, acc + r * wp, nw * sizeof(float));
}

// c = a^T b (see above); run(n, f) calls f(0 .. n), in any order and on any threads
template <typename Run>
void gram(const float* a, const float* b, float* c, int64_t k, int64_t m, int64_t n,
          const Run& run) {
  if (m == 0 || n == 0) return;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = (panels * kPanel + kGroup - 1) / kGroup;
  const int64_t gw = (panels + groups - 1) / groups * kPanel;  // equal groups of panels
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>(4 / groups, k / kSplitMin));
  while (splits > 1 && (splits - 1) * m * n > kPartialFloats) --splits;
  const int64_t klen = ((k + splits - 1) / splits + kChunk - 1) / kChunk * kChunk;
  // every element is written by a task before it is read: no zero fill
  std::unique_ptr<float[]> partial(new float[(splits - 1) * m * n]);
  run(splits * groups, [&](int64_t t) {
    const int64_t s = t / groups, g = t % groups;
    const int64_t k0 = std::min(k, s * klen), n0 = g * gw;
    float* out = (s == 0 ? c : partial.get() + (s - 1) * m * n) + n0;
    gram_task(a, b, m, n, k0, std::min(k, k0 + klen), n0, std::min(gw, n - n0), out);
  });
  if (splits > 1) {
    constexpr int64_t rows = 64;  // of c per task of the sum
    run((m + rows - 1) / rows, [&](int64_t i) {
      for (int64_t r = i * rows; r < std::min(m, (i + 1) * rows); ++r)
        for (int64_t s = 1; s < splits; ++s) {
          const float* src = partial.get() + ((s - 1) * m + r) * n;
          float* dst = c + r * n;
          for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
        }
    });
  }
}

ffi::Error gram_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                     ffi::ResultBuffer<ffi::F32> c) {
  auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
  if (da.size() != 2 || db.size() != 2 || dc.size() != 2 || da[0] != db[0] ||
      dc[0] != da[1] || dc[1] != db[1])
    return ffi::Error::InvalidArgument(
        "weight gradient: a must be [k, m], b [k, n] and the result [m, n]");
  gram(a.typed_data(), b.typed_data(), c->typed_data(), da[0], da[1], db[1],
       [&](int64_t n, const auto& f) { parallel_for(pool, n, f); });
  return ffi::Error::Success();
}

// GELU, tanh form (jax.nn.gelu's default): y = x (1 + tanh(u)) / 2 with
// u = sqrt(2 / pi) (x + 0.044715 x^3), and its derivative
// dy/dx = (1 + t) / 2 + x (1 - t^2) sqrt(2 / pi) (1 + 3 * 0.044715 x^2) / 2, t = tanh(u).
// With e = e^(-2|u|) <= 1, 1 + t is 2 / (1 + e) for u >= 0 and 2e / (1 + e) below, and
// 1 - t^2 = 4e / (1 + e)^2: no difference of nearly equal numbers, so a large negative x keeps
// its small result. Elementwise, in blocks of kActBlock; a block's last partial vector goes
// through a zero-padded copy.
constexpr int64_t kActBlock = 1 << 14;
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

// 1 + tanh(u) and 1 - tanh(u)^2
inline void tanh_parts16(v16 u, v16* one_plus, v16* one_minus_sq) {
  const v16 a = 2.0f * (u < 0.0f ? -u : u);
  const v16 e = a > 87.0f ? splat(0.0f) : exp16(-a);  // exp16 stops at e^-87, not at 0
  const v16 inv = 1.0f / (1.0f + e);
  *one_plus = (u < 0.0f ? 2.0f * e : splat(2.0f)) * inv;
  *one_minus_sq = 4.0f * e * inv * inv;
}

inline v16 gelu16(v16 x) {
  v16 p, q;
  tanh_parts16(kGeluC * x * (1.0f + kGeluA * x * x), &p, &q);
  return 0.5f * x * p;
}

inline v16 gelu_grad16(v16 x, v16 dy) {
  const v16 x2 = x * x;
  v16 p, q;
  tanh_parts16(kGeluC * x * (1.0f + kGeluA * x2), &p, &q);
  // q is 0 beyond |x| ~ 9: x^2 capped there keeps 0 * inf out of a huge x's derivative
  const v16 x2c = x2 > 1e4f ? splat(1e4f) : x2;
  return dy * (0.5f * p + 0.5f * x * q * (kGeluC * (1.0f + 3.0f * kGeluA * x2c)));
}

// out[i] = f(x[i], dy[i]) for i in [i0, i1) (dy = nullptr: f(x[i], 0))
template <typename F>
void elementwise(const float* x, const float* dy, float* out, int64_t i0, int64_t i1,
                 const F& f) {
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16)
    store16(out + i, f(load16(x + i), dy ? load16(dy + i) : v16{}));
  if (i < i1) {
    float xs[16] = {}, ds[16] = {}, os[16];
    std::memcpy(xs, x + i, (i1 - i) * sizeof(float));
    if (dy) std::memcpy(ds, dy + i, (i1 - i) * sizeof(float));
    store16(os, f(load16(xs), load16(ds)));
    std::memcpy(out + i, os, (i1 - i) * sizeof(float));
  }
}

ffi::Error gelu_fwd_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> y) {
  const int64_t n = x.element_count();
  if (y->element_count() != n)
    return ffi::Error::InvalidArgument("gelu: the result must have x's size");
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  parallel_for(pool, (n + kActBlock - 1) / kActBlock, [&](int64_t b) {
    elementwise(xp, nullptr, yp, b * kActBlock, std::min(n, (b + 1) * kActBlock),
                [](v16 v, v16) { return gelu16(v); });
  });
  return ffi::Error::Success();
}

ffi::Error gelu_bwd_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx) {
  const int64_t n = x.element_count();
  if (dy.element_count() != n || dx->element_count() != n)
    return ffi::Error::InvalidArgument("gelu: x, dy and the result must have one size");
  const float *xp = x.typed_data(), *dyp = dy.typed_data();
  float* dxp = dx->typed_data();
  parallel_for(pool, (n + kActBlock - 1) / kActBlock, [&](int64_t b) {
    elementwise(xp, dyp, dxp, b * kActBlock, std::min(n, (b + 1) * kActBlock),
                [](v16 v, v16 d) { return gelu_grad16(v, d); });
  });
  return ffi::Error::Success();
}

ffi::Error check(const Dims& D, int64_t rows, int64_t cols) {
  if (D.b < 1 || D.t < 1 || D.h < 1)
    return ffi::Error::InvalidArgument("attention: b, t and h must be positive");
  if (cols % 3 != 0 || (cols / 3) % D.h != 0 || D.dh < 1 || D.dh > kMaxHeadDim)
    return ffi::Error::InvalidArgument(
        "attention: qkv's width must be 3 * h * head_dim, with head_dim 1 .. 256");
  if (rows != D.b * D.t)
    return ffi::Error::InvalidArgument("attention: qkv must have b * t rows");
  return ffi::Error::Success();
}

Dims dims_of(int64_t b, int64_t t, int64_t h, int64_t cols) {
  Dims D;
  D.b = b;
  D.t = t;
  D.h = h;
  D.d = cols / 3;
  D.dh = h > 0 ? D.d / h : 0;
  D.tpad = (t + kBlock - 1) / kBlock * kBlock;
  D.scale = D.dh > 0 ? 1.0f / std::sqrt(static_cast<float>(D.dh)) : 0.0f;
  return D;
}

// f.template operator()<NV>(slice) over every slice, with NV = head_dim / 16 where the vector
// code is compiled for it (16, 32, 64) and the plain loops (NV = 0) otherwise.
template <typename F>
void dispatch(ffi::ThreadPool& pool, const Dims& D, const F& f) {
  const int64_t n = D.b * D.h;
  switch (D.dh) {
    case 16: parallel_for(pool, n, [&](int64_t s) { f.template operator()<1>(s); }); break;
    case 32: parallel_for(pool, n, [&](int64_t s) { f.template operator()<2>(s); }); break;
    case 64: parallel_for(pool, n, [&](int64_t s) { f.template operator()<4>(s); }); break;
    default: parallel_for(pool, n, [&](int64_t s) { f.template operator()<0>(s); });
  }
}

ffi::Error forward_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                        ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> lse,
                        int64_t b, int64_t t, int64_t h) {
  auto dims = qkv.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("attention: qkv must be 2-D");
  const Dims D = dims_of(b, t, h, dims[1]);
  if (ffi::Error e = check(D, dims[0], dims[1]); e.failure()) return e;
  if (y->element_count() != b * t * D.d || lse->element_count() != b * h * t)
    return ffi::Error::InvalidArgument("attention: output shapes do not match qkv");
  const float* in = qkv.typed_data();
  float* yo = y->typed_data();
  float* lo = lse->typed_data();
  dispatch(pool, D, [&]<int64_t NV>(int64_t s) { forward_slice<NV>(in, yo, lo, D, s); });
  return ffi::Error::Success();
}

ffi::Error backward_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                         ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> lse,
                         ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dqkv, int64_t b,
                         int64_t t, int64_t h) {
  auto dims = qkv.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("attention: qkv must be 2-D");
  const Dims D = dims_of(b, t, h, dims[1]);
  if (ffi::Error e = check(D, dims[0], dims[1]); e.failure()) return e;
  if (y.element_count() != b * t * D.d || dy.element_count() != b * t * D.d ||
      lse.element_count() != b * h * t || dqkv->element_count() != qkv.element_count())
    return ffi::Error::InvalidArgument("attention: operand shapes do not match qkv");
  const float *in = qkv.typed_data(), *yi = y.typed_data(), *li = lse.typed_data(),
              *dyi = dy.typed_data();
  float* out = dqkv->typed_data();
  dispatch(pool, D, [&]<int64_t NV>(int64_t s) {
    backward_slice<NV>(in, yi, li, dyi, out, D, s);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoAttentionFwd, forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("b")
                                  .Attr<int64_t>("t")
                                  .Attr<int64_t>("h"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoAttentionBwd, backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("b")
                                  .Attr<int64_t>("t")
                                  .Attr<int64_t>("h"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoLayerNormFwd, layer_norm_fwd_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoLayerNormBwd, layer_norm_bwd_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoWeightGrad, gram_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoGeluFwd, gelu_fwd_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DilocoGeluBwd, gelu_bwd_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The width in bits of the widest vector registers this build targets: the kernels keep their
// blocks (8 rows x 16 lanes of scores, 8 x 32 of a weight gradient) in registers only where
// one register holds 16 floats; with narrower ones the blocks spill to memory
// (`workers/native.py` uses the kernels only at 512 bits unless told otherwise).
extern "C" __attribute__((visibility("default"))) int diloco_fused_vector_bits() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX__)
  return 256;
#else
  return 128;
#endif
}
