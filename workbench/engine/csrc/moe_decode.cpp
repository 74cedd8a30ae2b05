// Routed experts on the CPU, fused: gate+up, SiLU-gating and the weighted sum of the down
// projections in one call, bandwidth bound on the weights. A decode step passes one token; a
// prompt passes its tokens and the (token, expert) pairs the CPU computes.
//
// out[t] = sum_{pairs p of token t} weights[p] * w2[rows[p]] @ (silu(g_p) * u_p) (gpt-oss: its biases and
// clamped SwiGLU, ``Act``),
// [g_p; u_p] = w13[rows[p]] @ x[t]
//
// The pairs are grouped by expert. Two parallel passes over torch's intra-op pool
// (at::parallel_for, so torch.set_num_threads governs it): (1) the (gate row, up row) pairs of all
// selected experts at once, each row read once and dotted with every token of its expert, writing
// the activations a[n, I]; (2) the H output columns, each thread summing its block of columns over
// the experts (no atomics). Everything is accumulated in f32. Experts kept in GGUF blocks take the
// integer dots of int8_dots.h with AVX512-VNNI or AVX2 (inputs rounded to int8 per 32 values),
// unless set_int8_dots(false). Where the CPU has AVX512-BF16 and the
// inputs are bf16-exact, bf16 and Q4_K gate/up rows use VDPBF16PS; elsewhere a bf16 weight becomes f32 by a 16-bit
// shift, an f16 one by the CPU's conversion (F16C) or exact bit arithmetic; the dot products use
// vector extensions, which the compiler maps onto AVX-512 or AVX2 (with -march=native) and fuses
// into FMAs (-ffp-contract=fast).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int8_dots.h"

namespace {

// Helpers of the inner loops: always inlined. The dots' templates for one to four inputs make GCC's
// size heuristics leave some of them as calls otherwise: Q4_K decode rows measured a third slower.
#define HOT __attribute__((always_inline))

// f32 lanes of one vector: one register of the widest kind -march allows. (A 16-lane vector on an
// AVX2 machine is two registers, which GCC keeps in memory between loop iterations: 4x slower.)
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#else
constexpr int64_t LANES = 8;
#endif

// GCC/Clang vector extensions: the compiler maps them onto the widest vectors -march allows.
typedef float vf32 __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES)));
HOT inline vf32 load_vec(const float* p) {
  vf32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

HOT inline vf32 load_vec(const uint16_t* p) {  // bf16 is the top half of an f32
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vf32>(__builtin_convertvector(h, vu32) << 16);
}

// float16 weights: the CPU's conversion (F16C, AVX-512) where -march allows, else exact bit arithmetic.
struct Half {
  uint16_t bits;
};

HOT inline vf32 load_vec(const Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf32>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  const __m256 h = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  vf32 v;
  std::memcpy(&v, &h, sizeof(v));
  return v;
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 u = __builtin_convertvector(h, vu32);
  const vu32 em = (u & 0x7fff) << 13;  // exponent and mantissa in f32 position, exponent bias 15
  vf32 f = reinterpret_cast<vf32>(em) * 0x1p112f;  // rebias to 127: exact for normals and subnormals
  const vu32 special = em >= (0x7c00u << 13);  // inf / nan: all ones exponent
  const vu32 bits = (reinterpret_cast<vu32>(f) & ~special) | ((em | 0x7f800000u) & special);
  return reinterpret_cast<vf32>(bits | ((u & 0x8000) << 16));
#endif
}

inline float load_one(const Half* p) {
  const uint32_t em = static_cast<uint32_t>(p->bits & 0x7fff) << 13;
  float f;
  std::memcpy(&f, &em, sizeof(f));
  f *= 0x1p112f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(f));
  if (em >= (0x7c00u << 13)) bits = em | 0x7f800000u;
  bits |= static_cast<uint32_t>(p->bits & 0x8000) << 16;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float load_one(const float* p) { return *p; }

inline float load_one(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float hsum(vf32 v) {
  float s = 0.f;
  for (int64_t l = 0; l < LANES; ++l) s += v[l];
  return s;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// GGUF Q8_0: blocks of 32 int8 values q with one float16 scale d (value = d * q). The engine keeps
// a matrix [N, K] as qs int8 [N, K] and ds float16 [N, K / 32]; K is a multiple of 32.
// int8 -> f32 by the CPU's sign extension and conversion (compilers scalarise the generic form).
HOT inline vf32 load_vec(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf32>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vf32 v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
#else
  vf32 v;
  for (int64_t l = 0; l < LANES; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

HOT inline float half_to_float(const Half* p) {
#if defined(__F16C__)
  return _cvtsh_ss(p->bits);
#else
  return load_one(p);
#endif
}

// The dots of one weight row with N (1..4) inputs at once, for a prompt's expert that several
// tokens select: each weight vector is loaded and widened once for the N inputs. For every input
// the sums run in the same order whatever N is, so a token's result in a prompt is bit for bit its
// result alone (N = 1, a decode step).

// f(std::integral_constant<int, N>, j) for j = 0, 4, 8, ... < c, N = min(4, c - j).
template <typename F>
inline void in_fours(int64_t c, F&& f) {
  int64_t j = 0;
  for (; j + 4 <= c; j += 4) f(std::integral_constant<int, 4>{}, j);
  const int64_t r = c - j;
  if (r == 3) f(std::integral_constant<int, 3>{}, j);
  else if (r == 2) f(std::integral_constant<int, 2>{}, j);
  else if (r == 1) f(std::integral_constant<int, 1>{}, j);
}

// res[j] = w[0:K] . xs[j][0:K] in f32 for j < N, two vector accumulators each.
template <int N, typename W>
inline void dot_n(const W* w, const float* const* xs, int64_t K, float* res) {
  vf32 acc0[N] = {}, acc1[N] = {};
  int64_t k = 0;
  for (; k + 2 * LANES <= K; k += 2 * LANES) {
    const vf32 w0 = load_vec(w + k), w1 = load_vec(w + k + LANES);
    for (int j = 0; j < N; ++j) {
      acc0[j] += w0 * load_vec(xs[j] + k);
      acc1[j] += w1 * load_vec(xs[j] + k + LANES);
    }
  }
  if (k + LANES <= K) {
    const vf32 w0 = load_vec(w + k);
    for (int j = 0; j < N; ++j) acc0[j] += w0 * load_vec(xs[j] + k);
    k += LANES;
  }
  for (int j = 0; j < N; ++j) {
    vf32 a = acc0[j] + acc1[j];
    float s = 0.f;
    for (int64_t l = 0; l < LANES; ++l) s += a[l];
    for (int64_t i = k; i < K; ++i) s += load_one(w + i) * xs[j][i];
    res[j] = s;
  }
}

// res[j] = (d * q)[0:K] . xs[j][0:K] in f32 for j < N (GGUF Q8_0 values q, one scale d per 32):
// one 32-value block at a time, scaled once per block.
template <int N>
inline void dot_q8_n(const int8_t* q, const Half* d, const float* const* xs, int64_t K, float* res) {
  vf32 acc[N] = {};
  for (int64_t b = 0; b < K / 32; ++b) {
    const int64_t k = 32 * b;
    vf32 blk[N] = {};
    for (int64_t v = 0; v < 32; v += LANES) {
      const vf32 w = load_vec(q + k + v);
      for (int j = 0; j < N; ++j) blk[j] += w * load_vec(xs[j] + k + v);
    }
    const float scale = half_to_float(d + b);
    for (int j = 0; j < N; ++j) acc[j] += scale * blk[j];
  }
  for (int j = 0; j < N; ++j) {
    float s = 0.f;
    for (int64_t l = 0; l < LANES; ++l) s += acc[j][l];
    res[j] = s;
  }
}

// Four weight rows at once with N inputs, for a prompt's expert that four or more tokens select:
// each weight vector is loaded (and widened) once for the N inputs and each input vector once for
// the four rows, half a load per multiply-add where dot_n<4> needs one and a quarter. One
// accumulator per (row, input), so the sums run in another order than dot_n's (f32 rounding apart).
// The 4 x N accumulators need AVX-512's 32 registers; AVX2 builds keep to one row at a time.
constexpr bool ROW_BLOCKS = LANES == 16;

// res[r * ldr + j] = w[r][0:K] . xs[j][0:K] for r < 4, j < N.
template <int N, typename W>
inline void dot_4rows(const W* const* w, const float* const* xs, int64_t K, float* res, int64_t ldr) {
  vf32 acc[4][N] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vf32 xv[N];
    for (int j = 0; j < N; ++j) xv[j] = load_vec(xs[j] + k);
    for (int r = 0; r < 4; ++r) {
      const vf32 wv = load_vec(w[r] + k);
      for (int j = 0; j < N; ++j) acc[r][j] += wv * xv[j];
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < N; ++j) {
      float sum = hsum(acc[r][j]);
      for (int64_t i = k; i < K; ++i) sum += load_one(w[r] + i) * xs[j][i];
      res[r * ldr + j] = sum;
    }
}

// res[r * ldr + j] = (d[r] * q[r]) . xs[j] for r < 4, j < N: each 32-value block's int8
// values widened once, scaled by the block's d, then multiplied with the N inputs.
template <int N>
inline void dot_q8_4rows(const int8_t* const* q, const Half* const* d, const float* const* xs, int64_t K, float* res,
                         int64_t ldr) {
  vf32 acc[4][N] = {};
  for (int64_t b = 0; b < K / 32; ++b) {
    const int64_t k = 32 * b;
    float scale[4];
    for (int r = 0; r < 4; ++r) scale[r] = half_to_float(d[r] + b);
    for (int64_t v = 0; v < 32; v += LANES) {
      vf32 xv[N];
      for (int j = 0; j < N; ++j) xv[j] = load_vec(xs[j] + k + v);
      for (int r = 0; r < 4; ++r) {
        const vf32 wv = load_vec(q[r] + k + v) * scale[r];
        for (int j = 0; j < N; ++j) acc[r][j] += wv * xv[j];
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < N; ++j) res[r * ldr + j] = hsum(acc[r][j]);
}

// res[q * c + k] = the dot of row q < nrows with input k < c: one(q, j, N, out) for row q and
// inputs j .. j + N - 1, four(q, j, N, out) for rows q .. q + 3 (``out`` rows ``c`` apart), the
// latter where four or more inputs share the rows.
template <typename One, typename Four>
inline void rows_by_inputs(int64_t nrows, int64_t c, float* res, One&& one, Four&& four) {
  int64_t q = 0;
  if (ROW_BLOCKS && c >= 4)
    for (; q + 4 <= nrows; q += 4) in_fours(c, [&](auto n, int64_t j) { four(q, j, n, res + q * c + j); });
  for (; q < nrows; ++q) in_fours(c, [&](auto n, int64_t j) { one(q, j, n, res + q * c + j); });
}

// GGUF Q4_K: super-blocks of 256 values, 144 bytes each: float16 d and dmin, 12 bytes of 6-bit
// scales and minimums for 8 sub-blocks of 32, then 128 bytes of 4-bit values (in each 64-value
// chunk, the low nibbles of 32 bytes are values 0..31 and the high nibbles values 32..63).
// value = d * sc[j] * q - dmin * m[j]. A matrix [N, K] is kept as its raw bytes [N, K / 256 * 144].
HOT inline void nibbles(const uint8_t* p, vf32& lo, vf32& hi) {  // LANES bytes -> low and high nibbles
#if defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = reinterpret_cast<vf32>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask))));
  hi = reinterpret_cast<vf32>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask))));
#elif defined(__AVX2__)
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256 l = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, mask)));
  const __m256 h = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
#else
  for (int64_t l = 0; l < LANES; ++l) {
    lo[l] = static_cast<float>(p[l] & 0x0F);
    hi[l] = static_cast<float>(p[l] >> 4);
  }
#endif
}

// Q4_K's 6-bit scale and minimum of sub-block j (0..7) of the 12 scale bytes sc.
HOT inline void q4k_scale_min(const uint8_t* sc, int64_t j, int& s, int& m) {
  if (j < 4) {
    s = sc[j] & 63, m = sc[j + 4] & 63;
  } else {
    s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// GGUF Q5_K: Q4_K's super-block with 32 more bytes qh between the scales and the 4-bit values
// (176 bytes): value l of sub-block j gains 16 where bit j of qh[l] is set (l < 32).
// value = d * sc[j] * (q + 16 * bit) - dmin * m[j].
HOT inline void fifth_bits(const uint8_t* h, int64_t c, vf32& lo, vf32& hi) {  // LANES bytes of qh, chunk c
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i b0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>(2 * c)), one), 4);
  const __m512i b1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>(2 * c + 1)), one), 4);
  lo += reinterpret_cast<vf32>(_mm512_cvtepi32_ps(b0));
  hi += reinterpret_cast<vf32>(_mm512_cvtepi32_ps(b1));
#else
  for (int64_t l = 0; l < LANES; ++l) {
    lo[l] += static_cast<float>(((h[l] >> (2 * c)) & 1) << 4);
    hi[l] += static_cast<float>(((h[l] >> (2 * c + 1)) & 1) << 4);
  }
#endif
}

// Super-block sb of a Q4_K row (Q5: of a Q5_K row): d and dmin decoded, its 12 scale bytes, Q5_K's
// 32 bytes of fifth bits, and the 128 bytes of 4-bit values.
struct Q4kSuper {
  float d, dmin;
  const uint8_t* sc;
  const uint8_t* qh;
  const uint8_t* qs;
  Q4kSuper(const uint8_t* row, int64_t sb, bool q5 = false) {
    const uint8_t* b = row + (q5 ? 176 : 144) * sb;
    d = half_to_float(reinterpret_cast<const Half*>(b));
    dmin = half_to_float(reinterpret_cast<const Half*>(b + 2));
    sc = b + 4, qh = b + 16, qs = b + (q5 ? 48 : 16);
  }
  // Chunk c (values 64c .. 64c + 63, sub-blocks 2c and 2c + 1): d times each sub-block's scale into
  // d0 / d1, and the minimums' part of the dot (xs: the sums of x per 32 values) added to mins.
  HOT void chunk(int64_t c, const float* xs, float& d0, float& d1, float& mins) const {
    int s0, m0, s1, m1;
    q4k_scale_min(sc, 2 * c, s0, m0);
    q4k_scale_min(sc, 2 * c + 1, s1, m1);
    d0 = d * s0, d1 = d * s1;
    mins += dmin * (m0 * xs[2 * c] + m1 * xs[2 * c + 1]);
  }
};

// dots of one Q4_K (Q5: Q5_K) row with N inputs xs[j][0:K]; xsums[j][K/32] holds the sums of input
// j over each 32-value block. The row's values are decoded once for the N inputs; each input's sums
// run in the same order whatever N is.
template <int N, bool Q5 = false>
inline void dot_q4k_n(const uint8_t* row, const float* const* xs, const float* const* xsums, int64_t K, float* res) {
  vf32 acc[N] = {};
  float mins[N] = {};
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const Q4kSuper q(row, sb, Q5);
    for (int64_t c = 0; c < 4; ++c) {
      float d0 = 0.f, d1 = 0.f;
      for (int j = 0; j < N; ++j) q.chunk(c, xsums[j] + 8 * sb, d0, d1, mins[j]);
      vf32 low[N] = {}, high[N] = {};
      for (int64_t v = 0; v < 32; v += LANES) {
        vf32 lo, hi;
        nibbles(q.qs + 32 * c + v, lo, hi);
        if constexpr (Q5) fifth_bits(q.qh + v, c, lo, hi);
        for (int j = 0; j < N; ++j) {
          const float* xc = xs[j] + 256 * sb + 64 * c;
          low[j] += lo * load_vec(xc + v);
          high[j] += hi * load_vec(xc + 32 + v);
        }
      }
      for (int j = 0; j < N; ++j) acc[j] += d0 * low[j] + d1 * high[j];
    }
  }
  for (int j = 0; j < N; ++j) res[j] = hsum(acc[j]) - mins[j];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The Q4_K dot for inputs that bfloat16 holds exactly (a bf16 model's hidden state: the GPU sends
// it as f32, every value's low 16 bits zero), given as their bf16 bits xb[K]. A 4-bit value is a
// small integer, exact in bf16 too, so VDPBF16PS multiplies the same numbers the f32 path does and
// adds the exact products in f32: the result differs from dot_q4k_n only in the order of the sums.
// 64 values a step: one 32-byte load, one widening, two table lookups and two dot instructions,
// where the f32 path widens every value twice and converts it.
template <int N>
inline void dot_q4k_bf16_n(const uint8_t* row, const uint16_t* const* xb, const float* const* xsums, int64_t K,
                           float* res) {
  alignas(64) static constexpr uint16_t tab[32] = {  // bf16 bits of 0..15 (twice: 16..31 never indexed)
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(reinterpret_cast<const void*>(tab));
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[N];
  float mins[N] = {};
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const Q4kSuper q(row, sb);
    for (int64_t c = 0; c < 4; ++c) {
      float d0 = 0.f, d1 = 0.f;
      for (int j = 0; j < N; ++j) q.chunk(c, xsums[j] + 8 * sb, d0, d1, mins[j]);
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.qs + 32 * c)));
      const __m512bh qlo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low4), table);
      const __m512bh qhi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
      for (int j = 0; j < N; ++j) {
        const uint16_t* xc = xb[j] + 256 * sb + 64 * c;
        const __m512bh xlo = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xc));
        const __m512bh xhi = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xc + 32));
        const __m512 low = _mm512_dpbf16_ps(_mm512_setzero_ps(), qlo, xlo);
        const __m512 high = _mm512_dpbf16_ps(_mm512_setzero_ps(), qhi, xhi);
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d0), low, acc[j]);
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d1), high, acc[j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(acc[j]) - mins[j];
}
// res[j] = w[0:K] . xb[j][0:K] of bf16 weights with bf16-exact inputs given as their bits xb[j]
// (j < N): VDPBF16PS multiplies 32 pairs a step (exact products, summed in f32) straight from the
// loaded bits, where the f32 path widens and shifts every weight first; each 32 weights are loaded
// once for the N inputs. Four accumulators per input hide the instruction's latency.
template <int N>
inline void dot_bf16_n(const uint16_t* w, const uint16_t* const* xb, int64_t K, float* res) {
  __m512 acc[N][4];
  for (int j = 0; j < N; ++j)
    for (int u = 0; u < 4; ++u) acc[j][u] = _mm512_setzero_ps();
  auto bh = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p)); };
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
    for (int u = 0; u < 4; ++u) {
      const __m512bh wv = bh(w + k + 32 * u);
      for (int j = 0; j < N; ++j) acc[j][u] = _mm512_dpbf16_ps(acc[j][u], wv, bh(xb[j] + k + 32 * u));
    }
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = bh(w + k);
    for (int j = 0; j < N; ++j) acc[j][0] = _mm512_dpbf16_ps(acc[j][0], wv, bh(xb[j] + k));
  }
  for (int j = 0; j < N; ++j) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_add_ps(acc[j][2], acc[j][3])));
    for (int64_t i = k; i < K; ++i) s += load_one(w + i) * load_one(xb[j] + i);
    res[j] = s;
  }
}
// res[r * ldr + j] = the bf16 dot of w[r] with xb[j] for r < 4, j < N (one accumulator each).
template <int N>
inline void dot_bf16_4rows(const uint16_t* const* w, const uint16_t* const* xb, int64_t K, float* res, int64_t ldr) {
  __m512 acc[4][N];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
  auto bh = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p)); };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[N];
    for (int j = 0; j < N; ++j) xv[j] = bh(xb[j] + k);
    for (int r = 0; r < 4; ++r) {
      const __m512bh wv = bh(w[r] + k);
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < N; ++j) {
      float sum = _mm512_reduce_add_ps(acc[r][j]);
      for (int64_t i = k; i < K; ++i) sum += load_one(w[r] + i) * load_one(xb[j] + i);
      res[r * ldr + j] = sum;
    }
}
constexpr bool HAS_BF16_DOT = true;
#else
template <int N>
inline void dot_bf16_n(const uint16_t*, const uint16_t* const*, int64_t, float*) {}
template <int N>
inline void dot_bf16_4rows(const uint16_t* const*, const uint16_t* const*, int64_t, float*, int64_t) {}
template <int N>
inline void dot_q4k_bf16_n(const uint8_t*, const uint16_t* const*, const float* const*, int64_t, float*) {}
constexpr bool HAS_BF16_DOT = false;
#endif

// Whether every value of x[0:n] is a bfloat16 (low 16 bits of its f32 zero); its bf16 bits into xb.
inline bool as_bf16(const float* x, int64_t n, uint16_t* xb) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    low |= bits & 0xFFFFu;
    xb[i] = static_cast<uint16_t>(bits >> 16);
  }
  return low == 0;
}

// GGUF Q6_K: super-blocks of 256 values, 210 bytes each: 128 bytes of low 4 bits, 64 bytes of high
// 2 bits, 16 int8 scales (one per 16 values), float16 d. In each 128-value half, group g (32 values)
// takes nibble g / 2 of low bytes (g % 2) * 32 + l and bits 2g of high byte l; value = d * sc * (q - 32).
// Values j .. j + LANES - 1 of group g (j < 32).
HOT inline vf32 q6_values(const uint8_t* ql, const uint8_t* qh, int64_t g, int64_t j) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
#if defined(__AVX512F__)
  __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + (g % 2) * 32 + j));
  __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + j));
#else
  __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql + (g % 2) * 32 + j));
  __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh + j));
#endif
  if (g >= 2) lo = _mm_srli_epi16(lo, 4);
  hi = _mm_and_si128(_mm_srli_epi16(hi, static_cast<int>(2 * g)), m2);
  const __m128i q = _mm_or_si128(_mm_and_si128(lo, m4), _mm_slli_epi16(hi, 4));
#if defined(__AVX512F__)
  return reinterpret_cast<vf32>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))) - 32.f;
#else
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
  vf32 v;
  std::memcpy(&v, &f, sizeof(v));
  return v - 32.f;
#endif
#else
  vf32 v;
  for (int64_t l = 0; l < LANES; ++l) {
    const int lo = (ql[(g % 2) * 32 + j + l] >> (4 * (g / 2))) & 0x0F;
    const int hi = (qh[j + l] >> (2 * g)) & 0x03;
    v[l] = static_cast<float>((lo | (hi << 4)) - 32);
  }
  return v;
#endif
}

// dots of one Q6_K row with N inputs: the row's values decoded once for them, each input's sums in
// the same order whatever N is.
template <int N>
inline void dot_q6k_n(const uint8_t* row, const float* const* xs, const float* const*, int64_t K, float* res) {
  vf32 acc[N] = {};
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + 210 * sb;
    const float d = half_to_float(reinterpret_cast<const Half*>(b + 208));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int64_t h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int64_t g = 0; g < 4; ++g) {
        const int64_t s = 8 * h + 2 * g;  // one scale per 16 values
        for (int64_t j = 0; j < 32; j += LANES) {
          const vf32 q6 = q6_values(ql, qh, g, j);
          const float scale = d * sc[s + j / 16];
          for (int t = 0; t < N; ++t) acc[t] += scale * (q6 * load_vec(xs[t] + 256 * sb + 128 * h + 32 * g + j));
        }
      }
    }
  }
  for (int t = 0; t < N; ++t) res[t] = hsum(acc[t]);
}

// GGUF Q2_K (84 bytes per 256 values: a byte of 4-bit scale and minimum per 16 values, 64 bytes of
// 2-bit values, float16 d and dmin; value = d * sc * q - dmin * m) and Q3_K (110 bytes: 32 bytes of
// high bits, 64 of 2-bit values, 12 of 6-bit scales, float16 d; value = d * (sc - 32) * (q - 4)).
// In both, byte 32n + l of the 2-bit values holds value 128n + 32g + l in bits 2g; Q3_K's bit 2 of
// that value is bit 4n + g of high byte l. Their float dots decode a super-block, then dot it.
inline void decode_q2k(const uint8_t* b, float* v) {  // v[256]
  const float d = half_to_float(reinterpret_cast<const Half*>(b + 80));
  const float dmin = half_to_float(reinterpret_cast<const Half*>(b + 82));
  for (int u = 0; u < 16; ++u) {  // 16 values of one scale: bits 2g of bytes 32n + (u % 2) * 16 + l
    const int n = u / 8, g = (u % 8) / 2;
    const uint8_t* q = b + 16 + 32 * n + 16 * (u % 2);
    const float s = d * static_cast<float>(b[u] & 15), m = dmin * static_cast<float>(b[u] >> 4);
    for (int l = 0; l < 16; ++l) v[16 * u + l] = s * static_cast<float>((q[l] >> (2 * g)) & 3) - m;
  }
}

inline void decode_q3k(const uint8_t* b, float* v) {  // v[256]
  const float d = half_to_float(reinterpret_cast<const Half*>(b + 108));
  int8_t sc[16];
  int8dot::q3k_scales(b + 96, sc);
  for (int u = 0; u < 16; ++u) {  // as decode_q2k, with bit 4n + g of high bytes (u % 2) * 16 + l
    const int n = u / 8, g = (u % 8) / 2;
    const uint8_t* q = b + 32 + 32 * n + 16 * (u % 2);
    const uint8_t* h = b + 16 * (u % 2);
    const float s = d * static_cast<float>(sc[u]);
    for (int l = 0; l < 16; ++l)
      v[16 * u + l] = s * static_cast<float>((((q[l] >> (2 * g)) & 3) | (((h[l] >> (4 * n + g)) & 1) << 2)) - 4);
  }
}

// GGUF IQ4_XS (136 bytes per 256 values: float16 d, 16 bits holding the top 2 bits of 8 scales, 4
// bytes their low 4 bits, 128 bytes of 4-bit indices: sub-block j's 32 in bytes 16j .. 16j + 15,
// low nibbles first; value = d * (ls - 32) * kIq4Values[index]).
inline void decode_iq4xs(const uint8_t* b, float* v) {  // v[256]
  const float d = half_to_float(reinterpret_cast<const Half*>(b));
  const int high = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) {
    const int ls = (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) - 32;
    const float s = d * static_cast<float>(ls);
    float scaled[16];  // the sub-block's 16 values
    for (int i = 0; i < 16; ++i) scaled[i] = s * static_cast<float>(int8dot::kIq4Values[i]);
    const uint8_t* q = b + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      v[32 * j + l] = scaled[q[l] & 15];
      v[32 * j + 16 + l] = scaled[q[l] >> 4];
    }
  }
}

// GGUF MXFP4 (17 bytes per 32 values: an E8M0 exponent e, then 16 bytes of 4-bit indices, low
// nibbles values 0 .. 15, high ones 16 .. 31; value = int8dot::kMxValues[index] * 2^(e - 128)).
inline void decode_mxfp4(const uint8_t* b, float* v) {  // v[32]
  const float s = int8dot::mx_scale(b[0]);
  for (int l = 0; l < 16; ++l) {
    v[l] = s * static_cast<float>(int8dot::kMxValues[b[1 + l] & 15]);
    v[16 + l] = s * static_cast<float>(int8dot::kMxValues[b[1 + l] >> 4]);
  }
}

// dots of one row of blocks of VALUES values in BYTES bytes with N inputs, each block decoded by
// DECODE once for them; each input's sums in the same order whatever N is.
template <int N, void (*DECODE)(const uint8_t*, float*), int64_t BYTES, int64_t VALUES = 256>
inline void dot_decoded_n(const uint8_t* row, const float* const* xs, int64_t K, float* res) {
  alignas(64) float v[VALUES];
  vf32 acc[N] = {};
  for (int64_t sb = 0; sb < K / VALUES; ++sb) {
    DECODE(row + BYTES * sb, v);
    for (int64_t k = 0; k < VALUES; k += LANES) {
      const vf32 w = load_vec(v + k);
      for (int j = 0; j < N; ++j) acc[j] += w * load_vec(xs[j] + VALUES * sb + k);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = hsum(acc[j]);
}

// k-quant dots of one row with N inputs: fmt 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K, 5 IQ4_XS, 6 MXFP4.
template <int N>
inline void dot_kq_n(int64_t fmt, const uint8_t* row, const float* const* xs, const float* const* xsums, int64_t K,
                     float* res) {
  if (fmt == 0) {
    dot_q4k_n<N>(row, xs, xsums, K, res);
  } else if (fmt == 2) {
    dot_q4k_n<N, true>(row, xs, xsums, K, res);
  } else if (fmt == 3) {
    dot_decoded_n<N, decode_q2k, 84>(row, xs, K, res);
  } else if (fmt == 4) {
    dot_decoded_n<N, decode_q3k, 110>(row, xs, K, res);
  } else if (fmt == 5) {
    dot_decoded_n<N, decode_iq4xs, 136>(row, xs, K, res);
  } else if (fmt == 6) {
    dot_decoded_n<N, decode_mxfp4, 17, 32>(row, xs, K, res);
  } else {
    dot_q6k_n<N>(row, xs, xsums, K, res);
  }
}

// Block formats by code: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K, 5 IQ4_XS (super-blocks of 256 values),
// 6 MXFP4 (blocks of 32); kq_bytes: bytes per block, kq_values: values per block.
inline bool kq_known(int64_t fmt) { return fmt >= 0 && fmt <= 6; }
inline int64_t kq_bytes(int64_t fmt) {
  static constexpr int64_t bytes[7] = {144, 210, 176, 84, 110, 136, 17};
  return bytes[fmt];
}
inline int64_t kq_values(int64_t fmt) { return fmt == 6 ? 32 : 256; }
// Bytes of a row of K values (K a multiple of kq_values(fmt)).
inline int64_t kq_row(int64_t fmt, int64_t K) { return K / kq_values(fmt) * kq_bytes(fmt); }


// WORKBENCH_CPU_BF16_DOT=0 keeps the f32 path for bf16 inputs too (read once).
inline bool bf16_dots_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("WORKBENCH_CPU_BF16_DOT");
    return !(v && v[0] == '0');
  }();
  return on;
}

inline void block_sums(const float* x, int64_t K, float* out) {  // out[K/32]
  for (int64_t b = 0; b < K / 32; ++b) {
    float s = 0.f;
    for (int64_t i = 0; i < 32; ++i) s += x[32 * b + i];
    out[b] = s;
  }
}

// The selected (token, expert) pairs grouped by expert: group g is pairs [start[g], start[g + 1])
// of one weight row rows[g]; pair p reads token tok[p] (a row of x [T, H]) and has weight wt[p].
// A decode step is T = 1 with one pair per group.
// The experts' activation between gate/up and down, and their optional biases (gpt-oss).
struct Act {
  int64_t kind = 0;  // 0 SwiGLU: silu(g) * u; 1 gpt-oss: (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha g), g <= limit
  float alpha = 1.f, limit = 0.f;
  const float* b13 = nullptr;  // [E, 2I] gate then up biases, or none
  const float* b2 = nullptr;   // [E, H] down biases, or none
  float operator()(float g, float u) const {
    if (kind == 0) return silu(g) * u;
    g = std::min(g, limit), u = std::min(std::max(u, -limit), limit);
    return (u + 1.f) * g / (1.f + std::exp(-alpha * g));
  }
};

struct Pairs {
  std::vector<int64_t> start, rows, tok;
  std::vector<float> wt;
  Act act;
  int64_t groups() const { return static_cast<int64_t>(rows.size()); }
  int64_t size() const { return static_cast<int64_t>(tok.size()); }
};

// Pairs from per-pair rows, tokens (nullptr: all token 0) and weights, stably sorted by row.
Pairs group_pairs(const int64_t* rows, const int64_t* tok, const float* wt, int64_t n) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
  Pairs g;
  g.tok.reserve(n), g.wt.reserve(n);
  for (int64_t q = 0; q < n; ++q) {
    const int64_t p = order[q];
    if (q == 0 || rows[p] != g.rows.back()) g.start.push_back(q), g.rows.push_back(rows[p]);
    g.tok.push_back(tok ? tok[p] : 0);
    g.wt.push_back(wt[p]);
  }
  g.start.push_back(n);
  return g;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Parts per thread of a SpinTeam job (1: one contiguous part each, as at::parallel_for cuts a range).
// More parts are taken one by one from a shared count, so that a thread slowed by a neighbour on its
// core (the thread that waits for the GPU spins) or by the OS takes fewer of them. On an H100 host
// four gained nothing: one Q8_0 expert a packet already read at the RAM's rate (BENCHMARKS.md,
// twelfth stop).
std::atomic<int64_t> g_team_chunks{1};

// A team of threads for the decode server's two passes per packet. Between a decode step's hybrid
// layers the server waits ~0.1 ms for the next packet; OpenMP's workers (libgomp) sleep on a futex
// as soon as a process has more OpenMP threads than cores (torch's own pool counts), so each pass
// paid their wake-up: ~78 us per packet on the H200 host beyond the weights' read
// (scripts/time_served_handoff.py). These workers spin on a generation counter while packets keep
// coming (``spin_us`` after the last job, as the server thread does), then sleep on a condition
// variable. The calling thread runs part 0 itself. One caller at a time.
class SpinTeam {
 public:
  SpinTeam(int64_t threads, int64_t spin_us) : n_(std::max<int64_t>(1, threads)), spin_us_(spin_us) {
    for (int64_t i = 1; i < n_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~SpinTeam() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // f(b, e) over [begin, end) split into at most n_ contiguous parts of at least ``grain`` items.
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t len = end - begin;
    if (len <= 0) return;
    const int64_t parts = std::min<int64_t>(n_, std::max<int64_t>(1, len / std::max<int64_t>(1, grain)));
    if (parts == 1) {
      f(begin, end);
      return;
    }
    const int64_t chunks = std::max(parts, std::min(parts * std::max<int64_t>(1, g_team_chunks.load()),
                                                    len / std::max<int64_t>(1, grain)));
    job_ = &f, begin_ = begin, end_ = end, parts_ = parts, chunks_ = chunks;
    next_.store(parts, std::memory_order_relaxed);  // chunks past each thread's first, taken in turn
    // every worker acknowledges every job, taking a part or not: none still reads this job's fields
    // when the next one overwrites them
    pending_.store(n_ - 1, std::memory_order_relaxed);
    bool wake;
    {
      std::lock_guard<std::mutex> lk(m_);  // pairs with a worker about to sleep: no lost wake-up
      gen_.fetch_add(1, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    std::exception_ptr err;
    try {
      part(0);
    } catch (...) {
      err = std::current_exception();
    }
    for (unsigned n = 1; pending_.load(std::memory_order_acquire) != 0; ++n) relax(n);  // f outlives every part
    if (err) std::rethrow_exception(err);
    if (failed_.exchange(false)) throw std::runtime_error("a part of the decode server's pass failed");
  }

 private:
  // A spinning thread's pause; every 16th also yields the core, so that a thread the OS left
  // without one (more runnable threads than cores) gets it back within a time slice's fraction.
  static void relax(unsigned n) {
    cpu_relax();
    if (n % 16 == 0) std::this_thread::yield();
  }

  // Thread i's chunk i, then (with more chunks than threads) further chunks from the shared count.
  void part(int64_t i) {
    const int64_t len = end_ - begin_;
    for (int64_t c = i; c < chunks_; c = next_.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t b = begin_ + len * c / chunks_, e = begin_ + len * (c + 1) / chunks_;
      if (b < e) (*job_)(b, e);
      if (chunks_ == parts_) break;
    }
  }

  void work(int64_t i) {
    uint64_t seen = 0;
    auto last = std::chrono::steady_clock::now();
    const auto spin = std::chrono::microseconds(spin_us_);
    for (unsigned n = 1;; ++n) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        if (std::chrono::steady_clock::now() - last < spin) {
          relax(n);
          continue;
        }
        std::unique_lock<std::mutex> lk(m_);
        ++sleepers_;
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
        continue;
      }
      seen = g;
      if (stop_.load()) return;
      if (i < parts_) {
        try {
          part(i);
        } catch (...) {  // reported by run() on the calling thread
          failed_.store(true);
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      last = std::chrono::steady_clock::now();
    }
  }

  const int64_t n_, spin_us_;
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable cv_;
  int64_t sleepers_ = 0;  // guarded by m_
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> pending_{0};
  std::atomic<bool> stop_{false}, failed_{false};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t begin_ = 0, end_ = 0, parts_ = 1, chunks_ = 1;
  std::atomic<int64_t> next_{0};
};

// The decode server's thread runs its passes on its own team; every other thread on torch's pool.
thread_local SpinTeam* tl_team = nullptr;

template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (tl_team != nullptr) {
    tl_team->run(begin, end, grain, std::function<void(int64_t, int64_t)>(f));
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// Threads at::parallel_for gives [0, len) at ``grain`` on a pool of ``pool``: none past what the
// grain allows, one when the range is a single grain.
inline int64_t pass_parts(int64_t len, int64_t grain, int64_t pool) {
  if (len <= 0) return 0;
  if (len <= grain || pool <= 1) return 1;
  return std::min(pool, (len + grain - 1) / grain);
}

// Part ``t`` of ``parts`` of [0, len), as at::parallel_for cuts it (contiguous, equal but the last).
template <typename F>
inline void pass_part(int64_t len, int64_t parts, int64_t t, const F& f) {
  if (t >= parts) return;
  const int64_t chunk = (len + parts - 1) / parts, b = t * chunk, e = std::min(len, b + chunk);
  if (b < e) f(b, e);
}

// f1 over [0, n1), then between over [0, nb), then f2 over [0, n2), each split as at::parallel_for
// splits it (between in parts of at least one). With OpenMP the three share one parallel region whose
// threads meet at barriers: a call wakes torch's pool once, not three times (a pool asleep between
// decode packets costs tens of us per wake-up on the H200 host, scripts/time_served_handoff.py). On
// the decode server's own team, three jobs; elsewhere, three at::parallel_for calls.
template <typename F1, typename H, typename F2>
void parallel_passes(int64_t n1, int64_t g1, const F1& f1, int64_t nb, const H& between, int64_t n2, int64_t g2,
                     const F2& f2) {
#ifdef _OPENMP
  const int64_t pool = at::get_num_threads();
  const int64_t want = std::max(pass_parts(n1, g1, pool), pass_parts(n2, g2, pool));
  if (tl_team == nullptr && want > 1 && !at::in_parallel_region()) {
    std::exception_ptr err;
    std::atomic<bool> failed{false};
    auto guarded = [&](auto&& fn) {
      try {
        fn();
      } catch (...) {
        if (!failed.exchange(true)) err = std::current_exception();
      }
    };
#pragma omp parallel num_threads(static_cast<int>(want))
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      guarded([&] { pass_part(n1, std::min(n, pass_parts(n1, g1, pool)), t, f1); });
#pragma omp barrier
      if (!failed.load()) guarded([&] { pass_part(nb, std::min(n, nb), t, between); });
#pragma omp barrier
      if (!failed.load()) guarded([&] { pass_part(n2, std::min(n, pass_parts(n2, g2, pool)), t, f2); });
    }
    if (err) std::rethrow_exception(err);
    return;
  }
#endif
  parallel_rows(0, n1, g1, f1);
  parallel_rows(0, nb, 1, between);
  parallel_rows(0, n2, g2, f2);
}

struct NoHook {
  void operator()(const float*, int64_t, int64_t) const {}
};

// The fused experts over any weight layout. dot13(g, r0, nrows, s, c, res): res[q * c + k] = row
// r0 + q of group g's w13 . x[tok[s + k]] for q < nrows, k < c (rows < 2I, gate rows first);
// dot2(g, o0, nrows, s, c, as, res): res[q * c + k] = the first U values of row o0 + q of group g's
// w2 . as[k * U] (pair s + k's activations). out [T, H] is zeroed. U <= I: the experts' first U
// intermediate units only (gate rows [0, U), up rows [I, I + U), w2's first U columns), a part of
// each expert whose other units the accelerator computes meanwhile (the decode server's unit split).
// Each weight row is read from memory once per call and dotted with every token of its group
// while it sits in L1 (the float and Q8_0 dots widen each weight vector once per four tokens, and
// with four tokens or more take four rows at a time), so a prompt's expert hit by c tokens costs
// about one read of its weights and c cheap dots.
template <typename Dot13, typename Dot2, typename Hook = NoHook>
void grouped_rows(const Pairs& pr, int64_t H, int64_t I, int64_t U, float* out, Dot13 dot13, Dot2 dot2,
                  Hook between = Hook()) {
  const int64_t G = pr.groups(), n = pr.size();
  std::vector<float> act(static_cast<size_t>(n * U));  // silu(g) * u (pr.act) per pair, [n, U]
  float* a = act.data();
  const int64_t* start = pr.start.data();
  const Act& fn = pr.act;

  // pass 1: item (group g, row i) needs gate row i and up row I + i of g's expert. A task reads its
  // gate rows, then its up rows: one sequential stream at a time, which the hardware prefetchers
  // follow best (interleaving rows of several pages measured 1.5x slower per core).
  auto pass1 = [&](int64_t begin, int64_t end) {
    std::vector<float> gate, up;
    for (int64_t p = begin; p < end;) {
      const int64_t g = p / U, i0 = p % U, len = std::min(U - i0, end - p);
      const int64_t s = start[g], c = start[g + 1] - s;
      gate.resize(static_cast<size_t>(len * c));
      up.resize(static_cast<size_t>(len * c));
      dot13(g, i0, len, s, c, gate.data());
      dot13(g, I + i0, len, s, c, up.data());
      if (fn.kind == 0 && !fn.b13) {
        for (int64_t q = 0; q < len; ++q)
          for (int64_t k = 0; k < c; ++k) a[(s + k) * U + i0 + q] = silu(gate[q * c + k]) * up[q * c + k];
      } else {
        const float* bg = fn.b13 ? fn.b13 + pr.rows[g] * 2 * I + i0 : nullptr;
        for (int64_t q = 0; q < len; ++q)
          for (int64_t k = 0; k < c; ++k)
            a[(s + k) * U + i0 + q] = fn(gate[q * c + k] + (bg ? bg[q] : 0.f), up[q * c + k] + (bg ? bg[I + q] : 0.f));
      }
      p += len;
    }
  };

  // pass 2: a task owns output columns [begin, end) of every token and walks the groups one after
  // another, streaming one contiguous block of each expert's down matrix
  const int64_t* tok = pr.tok.data();
  const float* wt = pr.wt.data();
  auto pass2 = [&](int64_t begin, int64_t end) {
    std::vector<float> res;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t s = start[g], c = start[g + 1] - s;
      res.resize(static_cast<size_t>((end - begin) * c));
      dot2(g, begin, end - begin, s, c, a + s * U, res.data());
      const float* bd = fn.b2 ? fn.b2 + pr.rows[g] * H : nullptr;
      for (int64_t o = begin; o < end; ++o)
        for (int64_t k = 0; k < c; ++k)
          out[tok[s + k] * H + o] += wt[s + k] * (res[(o - begin) * c + k] + (bd ? bd[o] : 0.f));
    }
  };

  // between the passes, over the pairs: e.g. per-block sums of the activations, which Q4_K's
  // minimums need, or the activations rounded for the int8 dots
  parallel_passes(G * U, 16, pass1, n, [&](int64_t b, int64_t e) { between(a, b, e); }, H, 16, pass2);
}

// Pointers to N inputs: f(k) for k = j .. j + N - 1.
template <int N, typename T, typename F>
inline void inputs(int64_t j, const T** xs, F&& f) {
  for (int q = 0; q < N; ++q) xs[q] = f(j + q);
}

// rows_by_inputs over the matrix at ``base`` (rows ``ld`` values apart, their first K dotted; ld 0:
// K): one(N, row, xs, K, out) and four(N, rows[4], xs, K, out, ldr) against the inputs xk(k)
// (pointers to K values each).
template <typename R, typename XK, typename One, typename Four>
inline void matrix_rows(const R* base, int64_t K, int64_t nrows, int64_t c, float* res, XK xk, One one, Four four,
                        int64_t ld = 0) {
  if (ld == 0) ld = K;
  using X = std::remove_const_t<std::remove_pointer_t<decltype(xk(0))>>;
  rows_by_inputs(
      nrows, c, res,
      [&](int64_t q, int64_t j, auto n, float* o) {
        const X* xs[decltype(n)::value];
        inputs<decltype(n)::value>(j, xs, xk);
        one(n, base + q * ld, xs, K, o);
      },
      [&](int64_t q, int64_t j, auto n, float* o) {
        const R* w[4] = {base + q * ld, base + (q + 1) * ld, base + (q + 2) * ld, base + (q + 3) * ld};
        const X* xs[decltype(n)::value];
        inputs<decltype(n)::value>(j, xs, xk);
        four(n, w, xs, K, o, c);
      });
}

template <typename W>
void run_float(const float* x, const W* w13, const W* w2, const Pairs& pr, int64_t H, int64_t I, int64_t U,
               float* out) {
  const int64_t e13 = 2 * I * H, e2 = H * I;  // elements per expert
  const int64_t* rows = pr.rows.data();
  const int64_t* tok = pr.tok.data();
  // bf16 gate/up rows against bf16-exact inputs (a bf16 model's hidden state): the bf16 dot, the
  // same exact products summed in another order. The down rows' inputs (SiLU products) are not bf16.
  std::vector<uint16_t> xb;
  bool bf16 = false;
  if constexpr (std::is_same_v<W, uint16_t>) {
    bf16 = HAS_BF16_DOT && bf16_dots_enabled() && pr.size() > 0;
    if (bf16) {
      const int64_t T = 1 + *std::max_element(pr.tok.begin(), pr.tok.end());
      xb.resize(static_cast<size_t>(T * H));
      bf16 = as_bf16(x, T * H, xb.data());
    }
  }
  // the float dots, and the bf16 ones for bf16 rows against bf16-exact inputs
  auto f32_one = [](auto n, const W* row, const float* const* xs, int64_t K, float* o) {
    dot_n<decltype(n)::value>(row, xs, K, o);
  };
  auto f32_four = [](auto n, const W* const* w, const float* const* xs, int64_t K, float* o, int64_t ldr) {
    dot_4rows<decltype(n)::value>(w, xs, K, o, ldr);
  };
  grouped_rows(
      pr, H, I, U, out,
      [&](int64_t g, int64_t r0, int64_t nrows, int64_t s, int64_t c, float* res) {
        const W* base = w13 + rows[g] * e13 + r0 * H;
        if constexpr (std::is_same_v<W, uint16_t>) {
          if (bf16)
            return matrix_rows(
                base, H, nrows, c, res, [&](int64_t k) { return static_cast<const uint16_t*>(xb.data() + tok[s + k] * H); },
                [](auto n, const uint16_t* row, const uint16_t* const* xs, int64_t K, float* o) {
                  dot_bf16_n<decltype(n)::value>(row, xs, K, o);
                },
                [](auto n, const uint16_t* const* w, const uint16_t* const* xs, int64_t K, float* o, int64_t ldr) {
                  dot_bf16_4rows<decltype(n)::value>(w, xs, K, o, ldr);
                });
        }
        matrix_rows(base, H, nrows, c, res, [&](int64_t k) { return x + tok[s + k] * H; }, f32_one, f32_four);
      },
      [&](int64_t g, int64_t o0, int64_t nrows, int64_t, int64_t c, const float* as, float* res) {
        matrix_rows(w2 + rows[g] * e2 + o0 * I, U, nrows, c, res, [&](int64_t k) { return as + k * U; }, f32_one,
                    f32_four, I);
      });
}

// Whether experts kept in GGUF blocks (Q8_0, the k-quants Q2_K to Q6_K, IQ4_XS) take the integer dots (int8_dots.h): where the
// build has AVX512-VNNI or AVX2, unless set_int8_dots(false) (Python: cpu_kernel.int8_dots,
// WORKBENCH_CPU_INT8_DOT=0) keeps the exact float ones.
std::atomic<bool> g_int8_dots{true};
inline bool int8_dots_on() { return int8dot::AVAILABLE && g_int8_dots.load(std::memory_order_relaxed); }

// The T tokens of x [T, H] into ``in`` (a prompt's on torch's pool).
inline void round_tokens(int8dot::Inputs& in, const float* x, int64_t T, int64_t H) {
  if (T > 16) {
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) in.set(t, x + t * H);
    });
  } else {
    for (int64_t t = 0; t < T; ++t) in.set(t, x + t * H);
  }
}

// rows [0, nrows) of a matrix against c inputs in(k) (k < c): dot(row q, inputs, N, out) with N <= 4
// inputs at a time; res[q * c + k].
template <typename In, typename Dot>
inline void int8_rows(int64_t nrows, int64_t c, float* res, In in, Dot dot) {
  for (int64_t q = 0; q < nrows; ++q) {
    if (c == 1) {  // a decode step
      const int8dot::Input one = in(0);
      dot(q, &one, std::integral_constant<int, 1>{}, res + q);
      continue;
    }
    in_fours(c, [&](auto nn, int64_t j) {
      int8dot::Input xs[decltype(nn)::value];
      for (int i = 0; i < decltype(nn)::value; ++i) xs[i] = in(j + i);
      dot(q, xs, nn, res + q * c + j);
    });
  }
}

// The fused experts with the inputs rounded to int8 per 32 values (int8_dots.h), laid out for the
// gate/up rows' format (o13) and the down rows' (o2): gate/up rows against the tokens, down rows
// against each pair's activations (rounded between the passes). row13(g, r, xs, N, out): row r of
// group g's gate/up matrix against N inputs xs; row2(g, o, xs, N, out): row o of its down matrix.
template <typename Row13, typename Row2>
void run_int8(const float* x, int64_t T, const Pairs& pr, int64_t H, int64_t I, int64_t U, int8dot::Order o13,
              int8dot::Order o2, Row13 row13, Row2 row2, float* out) {
  const int64_t* tok = pr.tok.data();
  int8dot::Inputs xin, ain;
  xin.init(T, H, o13);
  ain.init(pr.size(), U, o2);
  round_tokens(xin, x, T, H);
  grouped_rows(
      pr, H, I, U, out,
      [&](int64_t g, int64_t r0, int64_t nrows, int64_t s, int64_t c, float* res) {
        int8_rows(nrows, c, res, [&](int64_t k) { return xin.at(tok[s + k]); },
                  [&](int64_t q, const int8dot::Input* xs, auto nn, float* o) { row13(g, r0 + q, xs, nn, o); });
      },
      [&](int64_t g, int64_t o0, int64_t nrows, int64_t s, int64_t c, const float*, float* res) {
        int8_rows(nrows, c, res, [&](int64_t k) { return ain.at(s + k); },
                  [&](int64_t q, const int8dot::Input* xs, auto nn, float* o) { row2(g, o0 + q, xs, nn, o); });
      },
      [&](const float* a, int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) ain.set(p, a + p * U);
      });
}

void run_q8(const float* x, const int8_t* q13, const Half* d13, const int8_t* q2, const Half* d2, const Pairs& pr,
            int64_t H, int64_t I, int64_t U, float* out) {
  const int64_t e13 = 2 * I * H, e2 = H * I;  // values per expert; scales: 1 per 32
  const int64_t* rows = pr.rows.data();
  if (int8_dots_on() && pr.size() > 0) {
    // row at value offset ``at`` of a matrix of K values a row
    auto row = [](const int8_t* q, const Half* d, int64_t at, int64_t K, const int8dot::Input* xs, auto nn, float* o) {
      int8dot::dot_q8<decltype(nn)::value>(q + at, reinterpret_cast<const uint16_t*>(d + at / 32), xs, K, o);
    };
    return run_int8(
        x, 1 + *std::max_element(pr.tok.begin(), pr.tok.end()), pr, H, I, U, int8dot::Order::kQ8, int8dot::Order::kQ8,
        [&](int64_t g, int64_t r, const int8dot::Input* xs, auto nn, float* o) {
          row(q13, d13, rows[g] * e13 + r * H, H, xs, nn, o);
        },
        [&](int64_t g, int64_t r, const int8dot::Input* xs, auto nn, float* o) {
          row(q2, d2, rows[g] * e2 + r * I, U, xs, nn, o);
        },
        out);
  }
  const int64_t* tok = pr.tok.data();
  // rows r0 .. r0 + nrows of the matrix at value offset ``off`` (rows ld values apart, their first K
  // dotted) against inputs xk(k)
  auto block = [](const int8_t* q, const Half* d, int64_t off, int64_t K, int64_t ld, int64_t nrows, int64_t c,
                  float* res, auto xk) {
    rows_by_inputs(
        nrows, c, res,
        [&](int64_t r, int64_t j, auto n, float* o) {
          constexpr int N = decltype(n)::value;
          const float* xs[N];
          inputs<N>(j, xs, xk);
          const int64_t at = off + r * ld;
          dot_q8_n<N>(q + at, d + at / 32, xs, K, o);
        },
        [&](int64_t r, int64_t j, auto n, float* o) {
          constexpr int N = decltype(n)::value;
          const float* xs[N];
          inputs<N>(j, xs, xk);
          const int8_t* qr[4];
          const Half* dr[4];
          for (int i = 0; i < 4; ++i) qr[i] = q + off + (r + i) * ld, dr[i] = d + (off + (r + i) * ld) / 32;
          dot_q8_4rows<N>(qr, dr, xs, K, o, c);
        });
  };
  grouped_rows(
      pr, H, I, U, out,
      [&](int64_t g, int64_t r0, int64_t nrows, int64_t s, int64_t c, float* res) {
        block(q13, d13, rows[g] * e13 + r0 * H, H, H, nrows, c, res, [&](int64_t k) { return x + tok[s + k] * H; });
      },
      [&](int64_t g, int64_t o0, int64_t nrows, int64_t, int64_t c, const float* as, float* res) {
        block(q2, d2, rows[g] * e2 + o0 * I, U, I, nrows, c, res, [&](int64_t k) { return as + k * U; });
      });
}

void run_kq(const float* x, int64_t T, const uint8_t* b13, int64_t f13, const uint8_t* b2, int64_t f2,
            const Pairs& pr, int64_t H, int64_t I, int64_t U, float* out) {
  const int64_t row13 = kq_row(f13, H), row2 = kq_row(f2, I);  // bytes per matrix row
  const int64_t n = pr.size();
  const int64_t* rows = pr.rows.data();
  if (int8_dots_on()) {
    return run_int8(
        x, T, pr, H, I, U, int8dot::order_for_kquant(f13), int8dot::order_for_kquant(f2),
        [&](int64_t g, int64_t r, const int8dot::Input* xs, auto nn, float* o) {
          int8dot::dot_kq<decltype(nn)::value>(f13, b13 + (rows[g] * 2 * I + r) * row13, xs, H, o);
        },
        [&](int64_t g, int64_t r, const int8dot::Input* xs, auto nn, float* o) {
          int8dot::dot_kq<decltype(nn)::value>(f2, b2 + (rows[g] * H + r) * row2, xs, U, o);
        },
        out);
  }
  const int64_t* tok = pr.tok.data();
  std::vector<float> xsum(static_cast<size_t>(T * (H / 32))), asum(static_cast<size_t>(n * (U / 32)));
  for (int64_t t = 0; t < T; ++t) block_sums(x + t * H, H, xsum.data() + t * (H / 32));
  // Q4_K gate/up rows against bf16-exact inputs: the bf16 dot (same products, see dot_q4k_bf16_n)
  std::vector<uint16_t> xb;
  bool bf16 = HAS_BF16_DOT && f13 == 0 && bf16_dots_enabled();
  if (bf16) {
    xb.resize(static_cast<size_t>(T * H));
    bf16 = as_bf16(x, T * H, xb.data());
  }
  grouped_rows(
      pr, H, I, U, out,
      [&](int64_t g, int64_t r0, int64_t nrows, int64_t s, int64_t c, float* res) {
        if (c == 1) {  // a decode step: one input, no pointer tables
          const int64_t t = tok[s];
          const float* sums = xsum.data() + t * (H / 32);
          const uint16_t* xh = xb.data() + t * H;
          const float* xf = x + t * H;
          for (int64_t q = 0; q < nrows; ++q) {
            const uint8_t* row = b13 + (rows[g] * 2 * I + r0 + q) * row13;
            if (bf16) {
              dot_q4k_bf16_n<1>(row, &xh, &sums, H, res + q);
            } else {
              dot_kq_n<1>(f13, row, &xf, &sums, H, res + q);
            }
          }
          return;
        }
        for (int64_t q = 0; q < nrows; ++q) {
          const uint8_t* row = b13 + (rows[g] * 2 * I + r0 + q) * row13;
          in_fours(c, [&](auto n, int64_t j) {
            constexpr int N = decltype(n)::value;
            const float* sums[N];
            inputs<N>(j, sums, [&](int64_t k) { return static_cast<const float*>(xsum.data() + tok[s + k] * (H / 32)); });
            if (bf16) {
              const uint16_t* xs[N];
              inputs<N>(j, xs, [&](int64_t k) { return static_cast<const uint16_t*>(xb.data() + tok[s + k] * H); });
              return dot_q4k_bf16_n<N>(row, xs, sums, H, res + q * c + j);
            }
            const float* xs[N];
            inputs<N>(j, xs, [&](int64_t k) { return x + tok[s + k] * H; });
            dot_kq_n<N>(f13, row, xs, sums, H, res + q * c + j);
          });
        }
      },
      [&](int64_t g, int64_t o0, int64_t nrows, int64_t s, int64_t c, const float* as, float* res) {
        if (c == 1) {
          const float* sums = asum.data() + s * (U / 32);
          for (int64_t q = 0; q < nrows; ++q) dot_kq_n<1>(f2, b2 + (rows[g] * H + o0 + q) * row2, &as, &sums, U, res + q);
          return;
        }
        for (int64_t q = 0; q < nrows; ++q) {
          const uint8_t* row = b2 + (rows[g] * H + o0 + q) * row2;
          in_fours(c, [&](auto n, int64_t j) {
            constexpr int N = decltype(n)::value;
            const float* xs[N];
            const float* sums[N];
            inputs<N>(j, xs, [&](int64_t k) { return as + k * U; });
            inputs<N>(j, sums, [&](int64_t k) { return static_cast<const float*>(asum.data() + (s + k) * (U / 32)); });
            dot_kq_n<N>(f2, row, xs, sums, U, res + q * c + j);
          });
        }
      },
      [&](const float* a, int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) block_sums(a + p * U, U, asum.data() + p * (U / 32));
      });
}

// One job at a time on a persistent native thread, so that a decode step's CPU experts run while
// the Python thread queues other work (the bus share's copies) without either waiting for the GIL:
// no Python runs on this thread. It sleeps between jobs; the caller spins briefly in ``wait`` before
// it sleeps. Never destroyed (a joinable std::thread destroyed at exit would terminate the process).
class Background {
 public:
  void submit(std::function<void()> job, int threads) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!started_) {
        std::thread([this] { loop(); }).detach();
        started_ = true;
      }
      job_ = std::move(job);
      threads_ = threads;
      state_.store(1);
    }
    cv_.notify_one();
  }
  // Blocks until the submitted job is done (call without the GIL); false if it threw.
  bool wait() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(300);
    while (state_.load() == 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return state_.load() != 1; });
    state_.store(0);
    return ok_;
  }

 private:
  void loop() {
    int current = -1;
    for (;;) {
      std::function<void()> job;
      int threads;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return state_.load() == 1; });
        job = std::move(job_);
        threads = threads_;
      }
#ifdef _OPENMP
      if (threads != current) {
        at::init_num_threads();
        omp_set_num_threads(threads);  // this thread's team only
        current = threads;
      }
#endif
      bool ok = true;
      try {
        job();
      } catch (...) {
        ok = false;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        ok_ = ok;
        state_.store(2);
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::function<void()> job_;
  std::atomic<int> state_{0};  // 0 idle, 1 submitted, 2 done
  int threads_ = 1;
  bool ok_ = true, started_ = false;
};

Background& background() {
  static Background* bg = new Background();
  return *bg;
}

// What every entry point does after checking its weights: check rows (int64, against E), weights
// (float32, one per row) and tokens against T (x is [H], T = 1, tokens empty; or [T, H] with tokens
// [n]), group the pairs by row, run
// run(x f32 [T, H], pairs, out f32 [T, H]) without the GIL, return out ([H] for a 1-D x). With
// ``threads`` > 0 the run goes to the background thread on that many threads and ``out`` is valid
// after ``wait_background()``; ``run`` must then hold its tensors by value, and x must not change
// until then (it is read there). ``dest``: where the result goes (float32, contiguous, T * H values,
// on the CPU; overwritten, and returned as given; an empty tensor: none) instead of a new tensor,
// e.g. a page-locked buffer the caller copies to the accelerator. Bad input is raised with
// the GIL held (an exception leaving a GIL-released call crashed the process with PyTorch 2.11 on
// Python 3.12).
template <typename Run>
at::Tensor checked_run(const char* name, const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& rows,
                       const at::Tensor& weights, int64_t E, int64_t H, int64_t threads, const at::Tensor& dest,
                       Run run, Act act = Act()) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, name, ": rows must be int64 [n]");
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.size(0) == rows.size(0), name,
              ": weights must be float32 [n] with n = len(rows) = ", rows.size(0));
  const at::Tensor r = rows.contiguous(), wt = weights.contiguous();
  const at::Tensor tk = tokens.defined() ? tokens.contiguous() : at::empty({0}, rows.options());
  const int64_t n = r.size(0), T = x.dim() == 2 ? x.size(0) : 1;
  TORCH_CHECK(x.dim() == 1 || (tk.numel() == n && tk.scalar_type() == at::kLong), name,
              ": a 2-D x needs int64 tokens, one per pair");
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* tp = tk.numel() ? tk.data_ptr<int64_t>() : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(rp[j] >= 0 && rp[j] < E, name, ": rows[", j, "] = ", rp[j], " is outside [0, ", E, ")");
    TORCH_CHECK(!tp || (tp[j] >= 0 && tp[j] < T), name, ": tokens[", j, "] is outside [0, ", T, ")");
  }
  const std::vector<int64_t> shape = x.dim() == 2 ? std::vector<int64_t>{T, H} : std::vector<int64_t>{H};
  const bool given = dest.defined() && dest.numel() > 0;  // empty: none given
  TORCH_CHECK(!given || (dest.scalar_type() == at::kFloat && dest.is_contiguous() && dest.device().is_cpu() &&
                         dest.numel() == T * H),
              name, ": out must be float32, contiguous, on the CPU, with ", T * H, " values");
  Pairs pr = group_pairs(rp, tp, wt.data_ptr<float>(), n);
  pr.act = act;
  if (threads > 0) {  // x's float copy and out's zeros are made there too: off the caller's thread
    at::Tensor out = given ? dest : at::empty(shape, x.options().dtype(at::kFloat));
    background().submit(
        [x, out, pr = std::move(pr), run]() {
          // raw zeros: an in-place op on the caller's inference-mode tensor is refused on this thread
          std::memset(out.data_ptr<float>(), 0, static_cast<size_t>(out.numel()) * sizeof(float));
          const at::Tensor xf = x.to(at::kFloat).contiguous();
          run(xf.data_ptr<float>(), pr, out.data_ptr<float>());
        },
        static_cast<int>(threads));
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = given ? dest : at::empty(shape, x.options().dtype(at::kFloat));
  std::memset(out.data_ptr<float>(), 0, static_cast<size_t>(out.numel()) * sizeof(float));  // raw, as above
  if (n == 0) return out;
  py::gil_scoped_release nogil;
  run(xf.data_ptr<float>(), pr, out.data_ptr<float>());
  return out;
}

// Waits for the background run (the GIL released); false if it failed.
bool wait_background() { return background().wait(); }

void check_x(const char* name, const at::Tensor& x, int64_t H) {
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.size(-1) == H, name, ": x must be [H] or [T, H] with H = ", H,
              ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              name, ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
}

// The activation and optional biases of an entry point's experts: act 0 SwiGLU, 1 gpt-oss's clamped
// SwiGLU (alpha, limit); b13 float32 [E, 2I] and b2 [E, H], both or neither (empty tensors: none).
Act checked_act(const char* name, int64_t act, double alpha, double limit, const at::Tensor& b13,
                const at::Tensor& b2, int64_t E, int64_t H, int64_t I) {
  TORCH_CHECK(act == 0 || act == 1, name, ": act must be 0 (SwiGLU) or 1 (gpt-oss's clamped SwiGLU)");
  const bool has13 = b13.defined() && b13.numel() > 0, has2 = b2.defined() && b2.numel() > 0;  // empty: none
  TORCH_CHECK(has13 == has2, name, ": give both biases or neither");
  Act fn;
  fn.kind = act, fn.alpha = static_cast<float>(alpha), fn.limit = static_cast<float>(limit);
  if (has13) {
    TORCH_CHECK(b13.scalar_type() == at::kFloat && b2.scalar_type() == at::kFloat && b13.is_contiguous() &&
                    b2.is_contiguous() && b13.device().is_cpu() && b2.device().is_cpu() && b13.dim() == 2 &&
                    b2.dim() == 2 && b13.size(0) == E && b13.size(1) == 2 * I && b2.size(0) == E && b2.size(1) == H,
                name, ": biases must be float32 [E, 2I] and [E, H], contiguous, on the CPU");
    fn.b13 = b13.data_ptr<float>(), fn.b2 = b2.data_ptr<float>();
  }
  return fn;
}

at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& rows,
                      const at::Tensor& weights, int64_t threads, const at::Tensor& tokens, const at::Tensor& b13,
                      const at::Tensor& b2, int64_t act, double alpha, double limit, const at::Tensor& out) {
  TORCH_CHECK(w13.device().is_cpu() && w2.device().is_cpu() && x.device().is_cpu() &&
                  rows.device().is_cpu() && weights.device().is_cpu(),
              "moe_decode: every tensor must be on the CPU");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "moe_decode: w13 must be [E, 2I, H] and w2 [E, H, I], got ",
              w13.sizes(), " and ", w2.sizes());
  const int64_t E = w13.size(0), I = w13.size(1) / 2, H = w13.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && I > 0 && H > 0, "moe_decode: w13 must be [E, 2I, H], got ", w13.sizes());
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == I, "moe_decode: w2 must be [E, H, I] = [",
              E, ", ", H, ", ", I, "], got ", w2.sizes());
  const auto wtype = w13.scalar_type();
  TORCH_CHECK(wtype == w2.scalar_type() && (wtype == at::kBFloat16 || wtype == at::kHalf || wtype == at::kFloat),
              "moe_decode: w13 and w2 must both be bfloat16, float16 or float32, got ", wtype, " and ",
              w2.scalar_type());
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "moe_decode: w13 and w2 must be contiguous");
  check_x("moe_decode", x, H);
  const Act fn = checked_act("moe_decode", act, alpha, limit, b13, b2, E, H, I);
  return checked_run("moe_decode", x, tokens, rows, weights, E, H, threads, out,
                     [=](const float* xp, const Pairs& pr, float* op) {
                       (void)b13, (void)b2;  // held while a background run reads them
                       if (wtype == at::kBFloat16) {
                         run_float(xp, reinterpret_cast<const uint16_t*>(w13.data_ptr()),
                                   reinterpret_cast<const uint16_t*>(w2.data_ptr()), pr, H, I, I, op);
                       } else if (wtype == at::kHalf) {
                         run_float(xp, reinterpret_cast<const Half*>(w13.data_ptr()),
                                   reinterpret_cast<const Half*>(w2.data_ptr()), pr, H, I, I, op);
                       } else {
                         run_float(xp, w13.data_ptr<float>(), w2.data_ptr<float>(), pr, H, I, I, op);
                       }
                     },
                     fn);
}

// Q8_0 experts: q13 int8 [E, 2I, H], d13 float16 [E, 2I, H/32], q2 int8 [E, H, I], d2 float16 [E, H, I/32].
// The Python wrapper checks the input; these checks only guard the reads.
at::Tensor moe_decode_q8(const at::Tensor& x, const at::Tensor& q13, const at::Tensor& d13, const at::Tensor& q2,
                         const at::Tensor& d2, const at::Tensor& rows, const at::Tensor& weights, int64_t threads,
                         const at::Tensor& tokens, const at::Tensor& out) {
  const int64_t E = q13.size(0), I = q13.size(1) / 2, H = q13.size(2);
  TORCH_CHECK(q13.dim() == 3 && q2.dim() == 3 && q13.size(1) == 2 * I && H % 32 == 0 && I % 32 == 0 &&
                  q2.size(0) == E && q2.size(1) == H && q2.size(2) == I && d13.numel() * 32 == q13.numel() &&
                  d2.numel() * 32 == q2.numel() && q13.scalar_type() == at::kChar && q2.scalar_type() == at::kChar &&
                  d13.scalar_type() == at::kHalf && d2.scalar_type() == at::kHalf && q13.is_contiguous() &&
                  q2.is_contiguous() && d13.is_contiguous() && d2.is_contiguous(),
              "moe_decode_q8: bad weight stacks");
  check_x("moe_decode_q8", x, H);
  return checked_run("moe_decode_q8", x, tokens, rows, weights, E, H, threads, out,
                     [=](const float* xp, const Pairs& pr, float* op) {
                       run_q8(xp, q13.data_ptr<int8_t>(), reinterpret_cast<const Half*>(d13.data_ptr()),
                              q2.data_ptr<int8_t>(), reinterpret_cast<const Half*>(d2.data_ptr()), pr, H, I, I, op);
                     });
}

// Experts as raw blocks (f13 / f2: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K, 5 IQ4_XS, 6 MXFP4): b13 uint8
// [E, 2I, kq_row(f13, H)], b2 uint8 [E, H, kq_row(f2, I)]; H, I multiples of kq_values. act, alpha,
// limit, b13b / b2b: as moe_decode's (gpt-oss's MXFP4 experts). The Python wrapper checks the
// input; these checks only guard the reads.
at::Tensor moe_decode_kq(const at::Tensor& x, const at::Tensor& b13, int64_t f13, const at::Tensor& b2, int64_t f2,
                         int64_t I, const at::Tensor& rows, const at::Tensor& weights, int64_t threads,
                         const at::Tensor& tokens, const at::Tensor& b13b, const at::Tensor& b2b, int64_t act,
                         double alpha, double limit, const at::Tensor& out) {
  const int64_t H = x.size(-1), E = b13.size(0), T = x.dim() == 2 ? x.size(0) : 1;
  TORCH_CHECK(kq_known(f13) && kq_known(f2), "moe_decode_kq: unknown format");
  TORCH_CHECK(H % kq_values(f13) == 0 && I % kq_values(f2) == 0 && I > 0 && b13.dim() == 3 && b2.dim() == 3 &&
                  b13.size(1) == 2 * I && b13.size(2) == kq_row(f13, H) && b2.size(0) == E && b2.size(1) == H &&
                  b2.size(2) == kq_row(f2, I) && b13.scalar_type() == at::kByte && b2.scalar_type() == at::kByte &&
                  b13.is_contiguous() && b2.is_contiguous(),
              "moe_decode_kq: bad weight stacks");
  check_x("moe_decode_kq", x, H);
  const Act fn = checked_act("moe_decode_kq", act, alpha, limit, b13b, b2b, E, H, I);
  return checked_run("moe_decode_kq", x, tokens, rows, weights, E, H, threads, out,
                     [=](const float* xp, const Pairs& pr, float* op) {
                       (void)b13b, (void)b2b;  // held while a background run reads them
                       run_kq(xp, T, b13.data_ptr<uint8_t>(), f13, b2.data_ptr<uint8_t>(), f2, pr, H, I, I, op);
                     },
                     fn);
}

// A decode server: a native thread that serves the CPU experts of the hybrid layers of one-token
// steps without Python and without a host round trip per layer. For each layer the accelerator
// copies a packet into page-locked memory, float32 [2k + H]: the rows of the CPU's experts among the
// token's k selections (-1: not the CPU's), their routing weights, and the token's hidden state; then
// it copies a step number into that layer's ``flag_in``. The thread polls every layer's flag_in;
// a new value means a new packet: it computes the experts into ``out`` (float32 [H], page-locked,
// zeroed first) and stores the same value into ``flag_out``, which the accelerator polls before it
// adds ``out``. The thread spins while steps keep coming (``spin_us`` after the last packet), then
// polls every 50 us, and after ``idle_us`` without a packet (a prompt running, the user reading)
// waits on a condition for ``wake`` (the engine calls it as a decode step starts) or for 1 ms: an
// idle engine no longer wakes a core 20,000 times a second, and a prompt's threads are not
// preempted by it. Its two passes per packet run on its own ``SpinTeam`` (``own_team``), or on
// torch's OpenMP pool.

struct ServedLayer {
  int64_t kind = 0;  // 0 float stacks (w13, w2), 1 Q8_0 (q13, d13, q2, d2), 2 k-quants (b13, b2)
  at::Tensor w[4];
  int64_t f13 = 0, f2 = 0;  // k-quant formats
  int64_t E = 0, H = 0, I = 0, k = 0;
  int64_t U = 0;                              // units computed of I (set_units; the rest: the bus's)
  Act act;                                    // gpt-oss: its biases and clamped SwiGLU
  at::Tensor b13, b2;                         // the biases act points into, or empty
  at::Tensor packet, flag_in, out, flag_out;  // kept alive while the server runs
  int64_t seen = 0;
};

class Server {
 public:
  Server(int64_t threads, int64_t spin_us, bool own_team, int64_t idle_us)
      : threads_(std::max<int64_t>(1, threads)), spin_us_(spin_us), idle_us_(std::max(spin_us, idle_us)),
        own_team_(own_team) {}
  ~Server() { stop(); }

  int64_t add_layer(int64_t kind, std::vector<at::Tensor> w, int64_t f13, int64_t f2, int64_t I, int64_t k,
                    at::Tensor packet, at::Tensor flag_in, at::Tensor out, at::Tensor flag_out, at::Tensor b13,
                    at::Tensor b2, int64_t act, double alpha, double limit) {
    TORCH_CHECK(!thread_.joinable(), "Server.add_layer: the server is running");
    TORCH_CHECK(kind >= 0 && kind <= 2 && w.size() == (kind == 1 ? 4u : 2u), "Server.add_layer: bad weights");
    for (const auto& t : w) TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 3,
                                         "Server.add_layer: weights must be contiguous [E, ...] CPU stacks");
    ServedLayer L;
    L.kind = kind, L.f13 = f13, L.f2 = f2, L.I = I, L.U = I, L.k = k, L.E = w[0].size(0);
    L.H = out.numel();
    if (kind == 0) {
      const auto t = w[0].scalar_type();
      TORCH_CHECK(t == w[1].scalar_type() && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) &&
                      w[0].size(1) == 2 * I && w[0].size(2) == L.H && w[1].size(1) == L.H && w[1].size(2) == I,
                  "Server.add_layer: float stacks must be w13 [E, 2I, H] and w2 [E, H, I] of one dtype");
    } else if (kind == 1) {
      TORCH_CHECK(w[0].scalar_type() == at::kChar && w[2].scalar_type() == at::kChar &&
                      w[1].scalar_type() == at::kHalf && w[3].scalar_type() == at::kHalf && w[0].size(1) == 2 * I &&
                      w[0].size(2) == L.H && w[2].size(1) == L.H && w[2].size(2) == I && L.H % 32 == 0 && I % 32 == 0,
                  "Server.add_layer: bad Q8_0 stacks");
    } else {
      TORCH_CHECK(kq_known(f13) && kq_known(f2) && L.H % kq_values(f13) == 0 && I % kq_values(f2) == 0 &&
                      w[0].scalar_type() == at::kByte && w[1].scalar_type() == at::kByte && w[0].size(1) == 2 * I &&
                      w[0].size(2) == kq_row(f13, L.H) && w[1].size(1) == L.H && w[1].size(2) == kq_row(f2, I),
                  "Server.add_layer: bad k-quant stacks");
    }
    TORCH_CHECK(packet.scalar_type() == at::kFloat && packet.numel() == 2 * k + L.H && packet.is_contiguous() &&
                    out.scalar_type() == at::kFloat && out.is_contiguous() && flag_in.scalar_type() == at::kLong &&
                    flag_out.scalar_type() == at::kLong && flag_in.numel() == 1 && flag_out.numel() == 1 &&
                    packet.device().is_cpu() && out.device().is_cpu() && flag_in.device().is_cpu() &&
                    flag_out.device().is_cpu(),
                "Server.add_layer: packet float32 [2k + H], out float32 [H], flags int64 [1], all on the CPU");
    TORCH_CHECK(kind != 1 || !(b13.defined() && b13.numel()), "Server.add_layer: Q8_0 experts take no biases");
    L.act = checked_act("Server.add_layer", act, alpha, limit, b13, b2, L.E, L.H, I);
    L.b13 = b13, L.b2 = b2;
    for (size_t j = 0; j < w.size(); ++j) L.w[j] = w[j];
    L.packet = packet, L.flag_in = flag_in, L.out = out, L.flag_out = flag_out;
    L.seen = flag_in.data_ptr<int64_t>()[0];
    layers_.push_back(std::move(L));
    return static_cast<int64_t>(layers_.size()) - 1;
  }

  // Layer ``index`` computes only its experts' first ``units`` intermediate units (gate rows [0, units),
  // up rows [I, I + units), down columns [0, units)): the accelerator computes the others from the
  // same stacks meanwhile and adds them. A whole number of the down rows' blocks; no biases (the down
  // bias would count twice). Only while the thread is stopped.
  void set_units(int64_t index, int64_t units) {
    TORCH_CHECK(!thread_.joinable(), "Server.set_units: the server is running");
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "Server.set_units: no such layer");
    ServedLayer& L = layers_[static_cast<size_t>(index)];
    const int64_t block = L.kind == 0 ? 1 : L.kind == 1 ? 32 : kq_values(L.f2);
    TORCH_CHECK(units > 0 && units <= L.I && units % block == 0,
                "Server.set_units: units must be in (0, I] and a multiple of ", block, ", got ", units);
    TORCH_CHECK(units == L.I || !(L.b2.defined() && L.b2.numel()), "Server.set_units: experts with biases take all units");
    L.U = units;
  }

  void start() {
    if (thread_.joinable()) return;
    stop_.store(false);
    thread_ = std::thread([this] { loop(); });
  }

  void stop() {
    stop_.store(true);
    wake();
    if (thread_.joinable()) thread_.join();  // the thread never takes the GIL
  }

  // A decode step starts: the thread spins again (it is waiting on the condition after idle_us).
  void wake() {
    {
      std::lock_guard<std::mutex> lk(wake_m_);
      ++wakes_;
    }
    wake_cv_.notify_one();
  }

  // Record each packet the thread serves, up to ``capacity`` of them (0: none), from the next start
  // on: what ``trace`` returns. Only while the thread is stopped.
  void set_trace(int64_t capacity) {
    TORCH_CHECK(!thread_.joinable(), "Server.set_trace: the server is running");
    TORCH_CHECK(capacity >= 0, "Server.set_trace: capacity must be >= 0");
    trace_.assign(static_cast<size_t>(capacity), TraceRec{});
    trace_n_.store(0);
  }

  // The packets recorded so far, int64 [n, 6]: the layer's index (order of add_layer), the step
  // number its flag_in carried, the steady clock (ns) when the thread saw it and when it stored the
  // result's flag_out, the packet's CPU pairs (0: an empty packet) and the pairs it marks as the
  // bus's (-2 rows: computed by the accelerator from the CPU's stacks meanwhile).
  at::Tensor trace() const {
    const int64_t n = trace_n_.load(std::memory_order_acquire);
    auto t = at::empty({n, 6}, at::kLong);
    int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const TraceRec& r = trace_[static_cast<size_t>(i)];
      int64_t* q = p + 6 * i;
      q[0] = r.layer, q[1] = r.step, q[2] = r.seen_ns, q[3] = r.done_ns, q[4] = r.pairs, q[5] = r.bus;
    }
    return t;
  }

  int64_t served() const { return served_.load(); }
  int64_t idle_waits() const { return idle_waits_.load(); }
  int64_t errors() const { return errors_.load(); }
  bool running() const { return thread_.joinable() && !stop_.load(); }

 private:
  void loop() {
#ifdef _OPENMP
    at::init_num_threads();
    omp_set_num_threads(static_cast<int>(threads_));
#endif
    std::unique_ptr<SpinTeam> team;
    if (own_team_ && threads_ > 1) team = std::make_unique<SpinTeam>(threads_, spin_us_);
    tl_team = team.get();  // this thread's passes run on it (null: torch's OpenMP pool)
    auto last = std::chrono::steady_clock::now();
    const auto spin = std::chrono::microseconds(spin_us_), idle = std::chrono::microseconds(idle_us_);
    uint64_t woken = 0;
    const bool tracing = !trace_.empty();
    while (!stop_.load(std::memory_order_relaxed)) {
      bool any = false;
      for (size_t li = 0; li < layers_.size(); ++li) {
        ServedLayer& L = layers_[li];
        int64_t* in = L.flag_in.data_ptr<int64_t>();
        const int64_t v = __atomic_load_n(in, __ATOMIC_ACQUIRE);
        if (v == L.seen) continue;
        const int64_t seen_ns = tracing ? clock_ns() : 0;
        if (!serve(L)) errors_.fetch_add(1);
        L.seen = v;
        const int64_t done_ns = tracing ? clock_ns() : 0;
        __atomic_store_n(L.flag_out.data_ptr<int64_t>(), v, __ATOMIC_RELEASE);
        served_.fetch_add(1, std::memory_order_relaxed);
        any = true;
        if (tracing) {
          const int64_t n = trace_n_.load(std::memory_order_relaxed);
          if (n < static_cast<int64_t>(trace_.size())) {
            trace_[static_cast<size_t>(n)] = TraceRec{static_cast<int64_t>(li), v, seen_ns, done_ns,
                                                      static_cast<int64_t>(rows_.size()), bus_};
            trace_n_.store(n + 1, std::memory_order_release);
          }
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (any) {
        last = now;
      } else if (now - last < spin) {
        cpu_relax();
      } else if (now - last < idle) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {  // long idle: until a step wakes it, or 1 ms (a step that does not call wake waits at most that)
        std::unique_lock<std::mutex> lk(wake_m_);
        wake_cv_.wait_for(lk, std::chrono::milliseconds(1), [&] { return wakes_ != woken; });
        if (wakes_ != woken) {
          woken = wakes_;
          last = std::chrono::steady_clock::now();  // spin for the step's packets
        }
        idle_waits_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    tl_team = nullptr;
  }

  // The layer's packet into its out; false (out zeroed) on a bad row or a failure.
  bool serve(ServedLayer& L) {
    const float* pk = L.packet.data_ptr<float>();
    float* out = L.out.data_ptr<float>();
    std::memset(out, 0, sizeof(float) * L.H);
    rows_.clear(), wt_.clear();
    bus_ = 0;
    for (int64_t j = 0; j < L.k; ++j) {
      const float r = pk[j];
      if (!(r >= 0.f)) {  // -1 (or NaN): not the CPU's; -2: the bus's
        bus_ += r == -2.f;
        continue;
      }
      const int64_t row = static_cast<int64_t>(r);
      if (row >= L.E) return false;
      rows_.push_back(row), wt_.push_back(pk[L.k + j]);
    }
    if (rows_.empty()) return true;
    try {
      Pairs pr = group_pairs(rows_.data(), nullptr, wt_.data(), static_cast<int64_t>(rows_.size()));
      pr.act = L.act;
      const float* x = pk + 2 * L.k;
      if (L.kind == 0) {
        const auto t = L.w[0].scalar_type();
        if (t == at::kBFloat16) {
          run_float(x, reinterpret_cast<const uint16_t*>(L.w[0].data_ptr()),
                    reinterpret_cast<const uint16_t*>(L.w[1].data_ptr()), pr, L.H, L.I, L.U, out);
        } else if (t == at::kHalf) {
          run_float(x, reinterpret_cast<const Half*>(L.w[0].data_ptr()),
                    reinterpret_cast<const Half*>(L.w[1].data_ptr()), pr, L.H, L.I, L.U, out);
        } else {
          run_float(x, L.w[0].data_ptr<float>(), L.w[1].data_ptr<float>(), pr, L.H, L.I, L.U, out);
        }
      } else if (L.kind == 1) {
        run_q8(x, L.w[0].data_ptr<int8_t>(), reinterpret_cast<const Half*>(L.w[1].data_ptr()),
               L.w[2].data_ptr<int8_t>(), reinterpret_cast<const Half*>(L.w[3].data_ptr()), pr, L.H, L.I, L.U, out);
      } else {
        run_kq(x, 1, L.w[0].data_ptr<uint8_t>(), L.f13, L.w[1].data_ptr<uint8_t>(), L.f2, pr, L.H, L.I, L.U, out);
      }
    } catch (...) {
      std::memset(out, 0, sizeof(float) * L.H);
      return false;
    }
    return true;
  }

  static int64_t clock_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  struct TraceRec {
    int64_t layer = 0, step = 0, seen_ns = 0, done_ns = 0, pairs = 0, bus = 0;
  };

  int64_t threads_, spin_us_, idle_us_;
  bool own_team_;
  std::vector<TraceRec> trace_;  // written by the thread only, up to trace_n_
  std::atomic<int64_t> trace_n_{0};
  std::mutex wake_m_;
  std::condition_variable wake_cv_;
  uint64_t wakes_ = 0;  // guarded by wake_m_
  std::atomic<int64_t> idle_waits_{0};
  std::vector<ServedLayer> layers_;
  std::vector<int64_t> rows_;
  std::vector<float> wt_;
  int64_t bus_ = 0;  // the last packet's pairs marked as the bus's
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> served_{0}, errors_{0};
};

// Threads that at::parallel_for gives a large range here (1 when the build lacks OpenMP).
int64_t parallel_threads() {
  std::atomic<int64_t> tasks{0};
  at::parallel_for(0, 1 << 20, 1, [&](int64_t, int64_t) { tasks.fetch_add(1); });
  return tasks.load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_decode", &moe_decode,
        "Fused routed experts: x [H] (or [T, H] with tokens [n] int64), w13 [E, 2I, H], w2 [E, H, I] (bf16, f16 "
        "or f32), rows [n] int64, weights [n] f32 -> [H] (or [T, H]) f32",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("rows"), py::arg("weights"), py::arg("threads") = 0,
        py::arg("tokens") = at::Tensor(), py::arg("b13") = at::Tensor(), py::arg("b2") = at::Tensor(),
        py::arg("act") = 0, py::arg("alpha") = 1.0, py::arg("limit") = 0.0, py::arg("out") = at::Tensor());
  m.def("moe_decode_q8", &moe_decode_q8,
        "moe_decode with GGUF Q8_0 experts: x [H], q13 int8 [E, 2I, H], d13 f16 [E, 2I, H/32], q2 int8 [E, H, I], "
        "d2 f16 [E, H, I/32], rows [n] int64, weights [n] f32 -> [H] f32",
        py::arg("x"), py::arg("q13"), py::arg("d13"), py::arg("q2"), py::arg("d2"), py::arg("rows"),
        py::arg("weights"), py::arg("threads") = 0, py::arg("tokens") = at::Tensor(), py::arg("out") = at::Tensor());
  m.def("moe_decode_kq", &moe_decode_kq,
        "moe_decode with GGUF experts as raw blocks (formats 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K, 5 IQ4_XS, "
        "6 MXFP4): x [H], b13 uint8 [E, 2I, row bytes of H], f13, b2 uint8 [E, H, row bytes of I], f2, I, rows [n] "
        "int64, weights [n] f32 -> [H] f32; biases and act as moe_decode's",
        py::arg("x"), py::arg("b13"), py::arg("f13"), py::arg("b2"), py::arg("f2"), py::arg("I"), py::arg("rows"),
        py::arg("weights"), py::arg("threads") = 0, py::arg("tokens") = at::Tensor(), py::arg("bias13") = at::Tensor(),
        py::arg("bias2") = at::Tensor(), py::arg("act") = 0, py::arg("alpha") = 1.0, py::arg("limit") = 0.0,
        py::arg("out") = at::Tensor());
  m.def("set_int8_dots", [](bool on) { g_int8_dots.store(on); },
        "Experts kept in GGUF blocks: dots with inputs rounded to int8 (True; AVX512-VNNI or AVX2 builds) or exact f32 ones",
        py::arg("on"));
  m.def("set_team_chunks", [](int64_t n) { g_team_chunks.store(std::max<int64_t>(1, n)); },
        "Parts per thread of the decode server's team jobs (1: one contiguous part each; more: taken in turn)",
        py::arg("n"));
  m.def("int8_dots", [] { return int8_dots_on(); }, "Whether experts kept in GGUF blocks take the int8 dots now");
  m.def("wait_background", &wait_background,
        "Wait for the run started with threads > 0; False if it failed (its output is then undefined)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Server>(m, "Server")
      .def(py::init<int64_t, int64_t, bool, int64_t>(), py::arg("threads"), py::arg("spin_us"),
           py::arg("own_team") = false, py::arg("idle_us") = 20000)
      .def("add_layer", &Server::add_layer,
           "A hybrid layer's CPU stacks and page-locked packet, flags and out; biases and act as moe_decode's",
           py::arg("kind"), py::arg("w"), py::arg("f13"), py::arg("f2"), py::arg("I"), py::arg("k"), py::arg("packet"),
           py::arg("flag_in"), py::arg("out"), py::arg("flag_out"), py::arg("b13"), py::arg("b2"), py::arg("act"),
           py::arg("alpha"), py::arg("limit"))
      .def("set_units", &Server::set_units,
           "Layer index computes only its experts' first units intermediate units (the rest: the accelerator's)",
           py::arg("index"), py::arg("units"))
      .def("start", &Server::start)
      .def("stop", &Server::stop, py::call_guard<py::gil_scoped_release>())
      .def("set_trace", &Server::set_trace, "Record up to capacity packets from the next start (0: none)",
           py::arg("capacity"))
      .def("trace", &Server::trace,
           "Packets recorded: int64 [n, 6] (layer index, step, seen ns, done ns, CPU pairs, bus pairs), steady clock")
      .def("served", &Server::served)
      .def("wake", &Server::wake, "A decode step starts: spin for its packets")
      .def("idle_waits", &Server::idle_waits, "Times the thread waited on its condition (idle)")
      .def("errors", &Server::errors)
      .def("running", &Server::running);
  m.def("parallel_threads", &parallel_threads, "Tasks at::parallel_for runs a large range in (a build check)",
        py::call_guard<py::gil_scoped_release>());
}
