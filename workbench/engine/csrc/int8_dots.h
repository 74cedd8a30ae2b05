// Integer dots for experts kept in GGUF blocks (Q8_0, the k-quants Q2_K to Q6_K, IQ4_XS, MXFP4): the input is rounded to int8
// per 32 values first, as llama.cpp rounds it (to Q8_K / Q8_0) for its own CPU dots, and VPDPBUSD
// multiplies 64 weight values by 64 input values per instruction (AVX2: 32, by VPMADDUBSW and
// VPMADDWD), summed in int32, without turning any weight into a float. The float paths of moe_decode.cpp convert every weight value to
// a float and apply the scales per 32 values in scalar code: on the 2-core AVX-512 test host Q4_K
// computed about 15 G weights/s per core, this path about 29 G (llama.cpp's ggml: 31 G; BENCHMARKS.md).
//
// Rounding: dx = max|x| / 127 per 32 values (float32), q = round-to-nearest-even(x / dx) (0 for a
// block of zeros). The dot is then exactly the float dot of the dequantized weights with dx * q,
// summed in another order: the inputs' rounding (0.3-1% of an expert's output, relative, on random
// weights) is its only error.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace int8dot {

// Two builds: AVX-512 with VNNI (64 values per instruction), and AVX2 (32 values: VPMADDUBSW and
// VPMADDWD, or AVX-VNNI's VPDPBUSD where -march has it), for the CPUs without AVX-512.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define INT8DOT_AVX512 1
constexpr bool AVAILABLE = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8DOT_AVX2 1
constexpr bool AVAILABLE = true;
#else
constexpr bool AVAILABLE = false;
#endif

// One input as the integer dots read it.
struct Input {
  const int8_t* q;    // [K] values, each 128 in the order of the weight layout (see Inputs)
  const float* dxe;   // [K/4] the scale dx of the four values q[4i .. 4i + 3]
  const float* s32;   // [K/32] dx * (sum of q) per 32 values, in the input's own order
  const float* s16;   // [K/16] the same per 16 values
};

// The weight format whose dot reads the Inputs: it sets how q is laid out. AVX-512: for Q4_K (and
// Q5_K, whose 4-bit values lie as Q4_K's) each
// 128 values in the order of Q4_K's 4-bit values as one 64-byte load splits them (32 low nibbles of
// sub-block 0, low of 2, high of 1, high of 3: sub-blocks 0, 2, 1, 3; K % 128 == 0); for Q8_0
// unsigned bytes q + 128 (VPDPBUSD's unsigned factor against the signed weights); Q6_K in order.
// For Q2_K and Q3_K each 256 values in the order of their 2-bit values as one 64-byte load shifted
// by 2g holds them (values 32g .. 32g + 31, then 128 + 32g .. 128 + 32g + 31, for g = 0..3).
// For IQ4_XS each 128 values as one 64-byte load of its indices splits them: the low nibbles (values
// 0 .. 15 of its 4 sub-blocks), then the high ones (values 16 .. 31). MXFP4 likewise per 4 blocks of
// 32 (its 16 bytes of indices a block, loaded four at a time), and a last group of fewer blocks
// (K % 128 != 0: gpt-oss's 2880) as its low nibbles, then its high ones.
// AVX2: every format in order, signed.
enum class Order { kQ4K, kQ6K, kQ8, kQ2K, kIQ4, kMX };

// Format codes of the weights as moe_decode.cpp passes them: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K,
// 5 IQ4_XS, 6 MXFP4.
inline Order order_for_kquant(int64_t fmt) {
  static constexpr Order order[7] = {Order::kQ4K, Order::kQ6K, Order::kQ4K, Order::kQ2K,
                                     Order::kQ2K, Order::kIQ4, Order::kMX};
  return order[fmt];
}

// IQ4_XS's values by index (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// MXFP4's FP4 (E2M1) values by index, doubled (llama.cpp's kvalues_mxfp4); a block's scale is
// 2^(e - 128), half its E8M0 exponent's power, to match.
constexpr int8_t kMxValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An MXFP4 block's E8M0 exponent e as its scale 2^(e - 128) (llama.cpp's e8m0_to_fp32_half).
inline float mx_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// IQ4_XS's 8 scales (6 bits, less 32) at b: low 4 bits in the nibbles of b[4 .. 7], top 2 in the
// 16 bits of b[2 .. 3].
inline void iq4_scales(const uint8_t* b, int* out) {
  const int high = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) out[j] = (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) - 32;
}

// Q3_K's 16 scales (6 bits, less 32): the low 4 bits of scale u in byte u % 8 (shifted by 4 for
// u >= 8), its top 2 in byte 8 + u % 4 (shifted by 2 * (u / 4)).
inline void q3k_scales(const uint8_t* sc, int8_t* out) {
  for (int u = 0; u < 16; ++u)
    out[u] = static_cast<int8_t>((((sc[u % 8] >> (4 * (u / 8))) & 15) | (((sc[8 + u % 4] >> (2 * (u / 4))) & 3) << 4)) - 32);
}

// Inputs [n, K] rounded to int8 for one weight layout (K a multiple of 32).
class Inputs {
 public:
  void init(int64_t n, int64_t K, Order order) {
    K_ = K, order_ = order;
    q_.resize(static_cast<size_t>(n * K));
    dxe_.resize(static_cast<size_t>(n * K / 4));
    s32_.resize(static_cast<size_t>(n * K / 32));
    s16_.resize(static_cast<size_t>(n * K / 16));
  }
  // Rounds input i (K floats).
  void set(int64_t i, const float* x);
  Input at(int64_t i) const {
    return {q_.data() + i * K_, dxe_.data() + i * K_ / 4, s32_.data() + i * K_ / 32, s16_.data() + i * K_ / 16};
  }

 private:
  int64_t K_ = 0;
  Order order_ = Order::kQ6K;
  std::vector<int8_t> q_;
  std::vector<float> dxe_, s32_, s16_;
};

#if defined(INT8DOT_AVX512) || defined(INT8DOT_AVX2)

#define INT8DOT_HOT __attribute__((always_inline))

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// Reads ahead of the weights: a single core's hardware prefetchers left the integer dots waiting
// on RAM (22 against 31 G weights/s from RAM, one core, prefetching 2 KiB ahead). On the 16-core
// H100 host one token's Q8_0 experts through the decode server on 15 threads took 40 us per expert
// 4 KiB ahead against 61 us 2 KiB ahead and 59 us with none (scripts/time_served_handoff.py, stage
// cpu_sweep; BENCHMARKS.md). Bytes ahead: WORKBENCH_CPU_PREFETCH_BYTES (0 to 65536, a multiple of
// 64; default 4096), read once at load.
inline int64_t prefetch_bytes_from_env() {
  const char* v = std::getenv("WORKBENCH_CPU_PREFETCH_BYTES");
  if (v == nullptr || *v == '\0') return 4096;
  const long long b = std::atoll(v);
  return b < 0 ? 0 : std::min<long long>(65536, b / 64 * 64);
}
inline const int64_t PREFETCH_BYTES = prefetch_bytes_from_env();

// Where the read-ahead lands: WORKBENCH_CPU_PREFETCH_HINT 0 (default) every cache level, 1 the L2
// and beyond (PREFETCHT1), 2 PREFETCHT2, 3 non-temporal (PREFETCHNTA).
inline int prefetch_hint_from_env() {
  const char* v = std::getenv("WORKBENCH_CPU_PREFETCH_HINT");
  const int h = v == nullptr ? 0 : std::atoi(v);
  return h < 0 || h > 3 ? 0 : h;
}
inline const int PREFETCH_HINT = prefetch_hint_from_env();

// The line PREFETCH_BYTES past p, at PREFETCH_HINT.
INT8DOT_HOT inline void read_ahead(const void* p) {
  const char* a = static_cast<const char*>(p) + PREFETCH_BYTES;
  switch (PREFETCH_HINT) {
    case 1: _mm_prefetch(a, _MM_HINT_T1); break;
    case 2: _mm_prefetch(a, _MM_HINT_T2); break;
    case 3: _mm_prefetch(a, _MM_HINT_NTA); break;
    default: _mm_prefetch(a, _MM_HINT_T0);
  }
}

INT8DOT_HOT inline void prefetch_block(const uint8_t* b, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) read_ahead(b + o);
}

INT8DOT_HOT inline float reduce256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 6-bit scales and minimums of a Q4_K super-block's 8 sub-blocks (its 12 bytes at sc), as bytes:
// sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 in the nibbles of
// bytes 8-11 with their top 2 bits in bytes 0-7's top bits. d * scale and dmin * minimum as floats.
INT8DOT_HOT inline void q4k_scales(const uint8_t* sc, float d, float dmin, __m256& s, __m256& m) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, sc, 4), std::memcpy(&a1, sc + 4, 4), std::memcpy(&a2, sc + 8, 4);
  const uint64_t scales = (a0 & 0x3f3f3f3fu) |
                          (static_cast<uint64_t>((a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4)) << 32);
  const uint64_t mins = (a1 & 0x3f3f3f3fu) |
                        (static_cast<uint64_t>(((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4)) << 32);
  s = _mm256_mul_ps(_mm256_set1_ps(d),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales)))));
  m = _mm256_mul_ps(_mm256_set1_ps(dmin),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mins)))));
}

// q3k_scales for SIMD: the 16 scales as int8 lanes.
INT8DOT_HOT inline __m128i q3k_scales16(const uint8_t* sc) {
  int64_t low8;
  uint32_t top;
  std::memcpy(&low8, sc, 8), std::memcpy(&top, sc + 8, 4);
  const __m128i m4 = _mm_set1_epi8(0x0F), v = _mm_cvtsi64_si128(low8);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
  const uint32_t m2 = 0x03030303u;
  const __m128i high = _mm_setr_epi32(static_cast<int>(top & m2), static_cast<int>((top >> 2) & m2),
                                      static_cast<int>((top >> 4) & m2), static_cast<int>((top >> 6) & m2));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

// Q4_K (or Q5_K: bytes 176) super-block sb at b (read ahead): d * scale of its 8 sub-blocks; dmin *
// minimum times each input's sums per sub-block (the minimums' part of the dot) added to mins[j].
template <int N>
INT8DOT_HOT inline __m256 q4k_super(const uint8_t* b, const Input* xs, int64_t sb, __m256* mins, int64_t bytes = 144) {
  prefetch_block(b, bytes);
  __m256 s, m;
  q4k_scales(b + 4, half_bits_to_float(b), half_bits_to_float(b + 2), s, m);
  for (int j = 0; j < N; ++j) mins[j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs[j].s32 + 8 * sb), mins[j]);
  return s;
}

// IQ4_XS super-block at b (read ahead): d * its 8 scales.
INT8DOT_HOT inline __m256 iq4_super(const uint8_t* b) {
  prefetch_block(b, 136);
  alignas(32) int ls[8];
  iq4_scales(b, ls);
  return _mm256_mul_ps(_mm256_set1_ps(half_bits_to_float(b)),
                       _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ls))));
}

#endif

#ifdef INT8DOT_AVX512

inline void Inputs::set(int64_t i, const float* x) {
  int8_t* q = q_.data() + i * K_;
  float* dxe = dxe_.data() + i * K_ / 4;
  float* s32 = s32_.data() + i * K_ / 32;
  float* s16 = s16_.data() + i * K_ / 16;
  static constexpr int64_t kSlot[4] = {0, 2, 1, 3};  // sub-block -> its place in Q4_K's order
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K_ / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const float dx = m / 127.f;
    __m512i v0 = _mm512_setzero_si512(), v1 = _mm512_setzero_si512();
    if (m > 0.f) {
      const __m512 d = _mm512_set1_ps(dx);
      v0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, d));  // round to nearest even (MXCSR's default)
      v1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, d));
    }
    // where the block's first and last 16 values go
    const int64_t at = order_ == Order::kQ4K                               ? 128 * (b / 4) + 32 * kSlot[b % 4]
                       : order_ == Order::kQ2K                             ? 256 * (b / 8) + 32 * (2 * (b % 4) + (b % 8) / 4)
                       : order_ == Order::kIQ4 || order_ == Order::kMX ? 128 * (b / 4) + 16 * (b % 4)
                                                                           : 32 * b;
    // IQ4_XS and MXFP4: the high halves after the group's low ones (a last group of fewer blocks)
    const int64_t at2 = at + (order_ == Order::kIQ4 || order_ == Order::kMX
                                  ? 16 * std::min<int64_t>(4, K_ / 32 - 4 * (b / 4))
                                  : 16);
    const __m128i flip = order_ == Order::kQ8 ? _mm_set1_epi8(static_cast<char>(0x80)) : _mm_setzero_si128();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at), _mm_xor_si128(_mm512_cvtepi32_epi8(v0), flip));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at2), _mm_xor_si128(_mm512_cvtepi32_epi8(v1), flip));
    _mm_storeu_ps(dxe + at / 4, _mm_set1_ps(dx));
    _mm_storeu_ps(dxe + at2 / 4, _mm_set1_ps(dx));
    const int lo = _mm512_reduce_add_epi32(v0), hi = _mm512_reduce_add_epi32(v1);
    s16[2 * b] = dx * static_cast<float>(lo);
    s16[2 * b + 1] = dx * static_cast<float>(hi);
    s32[b] = dx * static_cast<float>(lo + hi);
  }
}

// acc plus 128 values of input x from value ``at`` on, against two registers of 64 unsigned weight
// values w0, w1 (x's values at .. at + 63 and at + 64 .. at + 127, in the input's order): the int32
// sums of each 4 products, times the weights' scale per lane (s0, s1) and the input's dx per lane.
INT8DOT_HOT inline __m512 dot128(__m512i w0, __m512i w1, __m512 s0, __m512 s1, const Input& x, int64_t at, __m512 acc) {
  const __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(x.q + at));
  const __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512(x.q + at + 64));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, _mm512_loadu_ps(x.dxe + at / 4)), acc);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, _mm512_loadu_ps(x.dxe + at / 4 + 16)), acc);
}

// res[j] = Q4_K row . xs[j] for j < N (K values). Q4_K super-block (144 bytes, 256 values): float16
// d and dmin, 12 bytes of 6-bit scales and minimums of 8 sub-blocks, 128 bytes of 4-bit values;
// value = d * sc * q - dmin * m. Per super-block and input: d * sc * dx * (int dot of each
// sub-block) minus dmin * m * (dx * sum of the input's q), the minimums' part for all 8 at once.
// Q5: Q5_K (176 bytes: the 32 bytes after the scales hold bit j of value l of sub-block j in byte
// l; the 4-bit values follow), whose fifth bits join the nibbles as 16 before the dots.
template <int N, bool Q5 = false>
inline void dot_q4k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(0x01);
  // per 16-bit lane, the fifth bits' shift for the low nibbles of one 64-byte load (sub-blocks 0 | 2;
  // + 1: the high nibbles', 1 | 3; + 4: the second load's)
  const __m512i sh02 = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
                                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // lanes of a 64-value dot: 8 of one sub-block, 8 of another (see Inputs' order)
  const __m512i pick[4] = {_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                           _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
                           _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
                           _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
  __m512 acc[N];
  __m256 mins[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps(), mins[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + kBytes * sb;
    const __m256 s = q4k_super<N>(b, xs, sb, mins, kBytes);
    const __m512 s16 = _mm512_castps256_ps512(s);
    const uint8_t* qs = b + (Q5 ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if constexpr (Q5) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i w = _mm512_loadu_si512(reinterpret_cast<const void*>(qs + 64 * h));
      __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      if constexpr (Q5) {
        const __m512i sh = _mm512_add_epi16(sh02, _mm512_set1_epi16(static_cast<int16_t>(4 * h)));
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh), one), 4));
        hi = _mm512_or_si512(
            hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, _mm512_add_epi16(sh, _mm512_set1_epi16(1))), one), 4));
      }
      const __m512 slo = _mm512_permutexvar_ps(pick[2 * h], s16), shi = _mm512_permutexvar_ps(pick[2 * h + 1], s16);
      for (int j = 0; j < N; ++j) acc[j] = dot128(lo, hi, slo, shi, xs[j], 256 * sb + 128 * h, acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(acc[j]) - reduce256(mins[j]);
}

// res[j] = Q6_K row . xs[j] for j < N. Q6_K super-block (210 bytes, 256 values): 128 bytes of low
// 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16 values), float16 d; value =
// d * sc * (q - 32). In each 128-value half, 32-value group g takes nibble g / 2 of low bytes
// (g % 2) * 32 + l and bits 2g of high byte l: one 64-byte load holds groups 0 and 1 in its low
// nibbles and groups 2 and 3 in its high ones, the input's own order. The offset 32 is taken off
// once per super-block from the input's sums per 16 values.
template <int N>
inline void dot_q6k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
  // per 16-bit lane, the high bits' shift: groups 0 | 1 (then + 4: groups 2 | 3)
  const __m512i sh01 = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
                                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
  // lanes of a 64-value dot: 4 lanes (16 values) per scale; pick t: scales 4t .. 4t + 3
  alignas(64) static constexpr int32_t kPick[4][16] = {
      {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
      {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
      {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
  const __m512i pick[4] = {_mm512_load_si512(kPick[0]), _mm512_load_si512(kPick[1]), _mm512_load_si512(kPick[2]),
                           _mm512_load_si512(kPick[3])};
  __m512 acc[N], off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps(), off[j] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + 210 * sb;
    prefetch_block(b, 210);
    const float d = half_bits_to_float(b + 208);
    const __m512 s = _mm512_mul_ps(
        _mm512_set1_ps(d),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
    const __m512 s32 = _mm512_mul_ps(s, _mm512_set1_ps(-32.f));
    for (int j = 0; j < N; ++j) off[j] = _mm512_fmadd_ps(s32, _mm512_loadu_ps(xs[j].s16 + 16 * sb), off[j]);
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(reinterpret_cast<const void*>(b + 64 * h));
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      const __m512i v01 = _mm512_or_si512(
          _mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh01), low2), 4));
      const __m512i v23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh23), low2), 4));
      const __m512 s01 = _mm512_permutexvar_ps(pick[2 * h], s), s23 = _mm512_permutexvar_ps(pick[2 * h + 1], s);
      for (int j = 0; j < N; ++j) acc[j] = dot128(v01, v23, s01, s23, xs[j], 256 * sb + 128 * h, acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j], off[j]));
}

// res[j] = Q2_K (Q3: Q3_K) row . xs[j] for j < N (inputs in Order::kQ2K). One 64-byte load of the
// 2-bit values shifted by 2g is group g's 64 values (Q3_K: bit 2 from its high bytes, bit g for the
// first 32 and 4 + g for the rest); 4 lanes per scale of 16 values. Q2_K's minimums and Q3_K's
// offset 4 are taken off once per super-block from the input's sums per 16 values.
template <int N, bool Q3>
inline void dot_q23k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  constexpr int64_t kBytes = Q3 ? 110 : 84;
  const __m512i low2 = _mm512_set1_epi8(0x03), one = _mm512_set1_epi8(0x01);
  const __m512i hsh = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                       0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // lanes of group g's dot: sub-blocks 2g, 2g + 1, 8 + 2g, 9 + 2g, 4 lanes each
  alignas(64) static constexpr int32_t kPick[4][16] = {
      {0, 0, 0, 0, 1, 1, 1, 1, 8, 8, 8, 8, 9, 9, 9, 9}, {2, 2, 2, 2, 3, 3, 3, 3, 10, 10, 10, 10, 11, 11, 11, 11},
      {4, 4, 4, 4, 5, 5, 5, 5, 12, 12, 12, 12, 13, 13, 13, 13},
      {6, 6, 6, 6, 7, 7, 7, 7, 14, 14, 14, 14, 15, 15, 15, 15}};
  __m512 acc[N], off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps(), off[j] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + kBytes * sb;
    prefetch_block(b, kBytes);
    __m512 s, o;  // the scales of the 16 sub-blocks, and what each takes off per unit of the input's sum
    if constexpr (Q3) {
      s = _mm512_mul_ps(_mm512_set1_ps(half_bits_to_float(b + 108)),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3k_scales16(b + 96))));
      o = _mm512_mul_ps(s, _mm512_set1_ps(-4.f));
    } else {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      s = _mm512_mul_ps(_mm512_set1_ps(half_bits_to_float(b + 80)),
                        _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
      o = _mm512_mul_ps(_mm512_set1_ps(-half_bits_to_float(b + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
    }
    for (int j = 0; j < N; ++j) off[j] = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs[j].s16 + 16 * sb), off[j]);
    const __m512i qs = _mm512_loadu_si512(reinterpret_cast<const void*>(b + (Q3 ? 32 : 16)));
    __m512i hb = _mm512_setzero_si512();
    if constexpr (Q3) hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    __m512i v[4];
    for (int g = 0; g < 4; ++g) {
      v[g] = _mm512_and_si512(_mm512_srli_epi16(qs, static_cast<unsigned>(2 * g)), low2);
      if constexpr (Q3) {
        const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(hb, _mm512_add_epi16(hsh, _mm512_set1_epi16(static_cast<int16_t>(g)))), one);
        v[g] = _mm512_or_si512(v[g], _mm512_slli_epi16(bit, 2));
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      const __m512 s0 = _mm512_permutexvar_ps(_mm512_load_si512(kPick[2 * h]), s);
      const __m512 s1 = _mm512_permutexvar_ps(_mm512_load_si512(kPick[2 * h + 1]), s);
      for (int j = 0; j < N; ++j) acc[j] = dot128(v[2 * h], v[2 * h + 1], s0, s1, xs[j], 256 * sb + 128 * h, acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j], off[j]));
}

// res[j] = IQ4_XS row . xs[j] for j < N (inputs in Order::kIQ4). A 64-byte load of the indices holds
// 4 sub-blocks; VPSHUFB looks each nibble up as its value + 128 (VPDPBUSD's unsigned factor), and
// 128 times the input's sums per 32 is taken off once per super-block. 4 lanes per sub-block.
template <int N>
inline void dot_iq4xs(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  alignas(16) static constexpr uint8_t kBiased[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kBiased)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  alignas(64) static constexpr int32_t kPick[2][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                                      {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};
  __m512 acc[N];
  __m256 off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps(), off[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + 136 * sb;
    const __m256 s8 = iq4_super(b);
    const __m256 o = _mm256_mul_ps(s8, _mm256_set1_ps(-128.f));
    for (int j = 0; j < N; ++j) off[j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs[j].s32 + 8 * sb), off[j]);
    const __m512 s = _mm512_castps256_ps512(s8);
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i w = _mm512_loadu_si512(reinterpret_cast<const void*>(b + 8 + 64 * h));
      const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(w, low4));
      const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(w, 4), low4));
      const __m512 sh = _mm512_permutexvar_ps(_mm512_load_si512(kPick[h]), s);
      for (int j = 0; j < N; ++j) acc[j] = dot128(lo, hi, sh, sh, xs[j], 256 * sb + 128 * h, acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(acc[j]) + reduce256(off[j]);
}

// res[j] = MXFP4 row . xs[j] for j < N (inputs in Order::kMX; K a multiple of 32). A block is 17
// bytes: its E8M0 exponent e, then 16 bytes of 4-bit indices (low nibbles values 0 .. 15, high ones
// 16 .. 31); value = kMxValues[index] * mx_scale(e). Four blocks a step: their indices in one
// 64-byte register, looked up by VPSHUFB as value + 128 (VPDPBUSD's unsigned factor), and 128 times
// the input's sum per block taken off with the block's scale. A last 1 .. 3 blocks one at a time.
template <int N>
inline void dot_mxfp4(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  alignas(16) static constexpr uint8_t kBiased[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                                      128, 127, 126, 125, 124, 122, 120, 116};
  const __m128i table4 = _mm_load_si128(reinterpret_cast<const __m128i*>(kBiased)), low4x = _mm_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(table4), low4 = _mm512_set1_epi8(0x0F);
  alignas(64) static constexpr int32_t kLanes[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  const __m512i lanes = _mm512_load_si512(kLanes);
  __m512 acc[N];
  __m128 off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps(), off[j] = _mm_setzero_ps();
  const int64_t nb = K / 32;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    const uint8_t* p = row + 17 * b;
    prefetch_block(p, 68);
    __m512i w = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 1)));
    w = _mm512_inserti32x4(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)), 1);
    w = _mm512_inserti32x4(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 35)), 2);
    w = _mm512_inserti32x4(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 52)), 3);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(w, low4));
    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(w, 4), low4));
    const __m128 s4 = _mm_setr_ps(mx_scale(p[0]), mx_scale(p[17]), mx_scale(p[34]), mx_scale(p[51]));
    const __m512 s = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s4));
    for (int j = 0; j < N; ++j) {
      acc[j] = dot128(lo, hi, s, s, xs[j], 32 * b, acc[j]);
      off[j] = _mm_fmadd_ps(s4, _mm_loadu_ps(xs[j].s32 + b), off[j]);
    }
  }
  float tail[N] = {};
  const int64_t nt = nb - b;  // the last group's blocks: low nibbles at 32b + 16i, high at 32b + 16nt + 16i
  for (int64_t i = 0; i < nt; ++i) {
    const uint8_t* p = row + 17 * (b + i);
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 1));
    const __m128i lo = _mm_shuffle_epi8(table4, _mm_and_si128(w, low4x));
    const __m128i hi = _mm_shuffle_epi8(table4, _mm_and_si128(_mm_srli_epi16(w, 4), low4x));
    const float sc = mx_scale(p[0]);
    for (int j = 0; j < N; ++j) {
      const int64_t at = 32 * b + 16 * i;
      __m128i v = _mm_dpbusd_epi32(_mm_setzero_si128(), lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[j].q + at)));
      v = _mm_dpbusd_epi32(v, hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[j].q + at + 16 * nt)));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
      tail[j] += sc * (xs[j].dxe[at / 4] * static_cast<float>(_mm_cvtsi128_si32(v)) - 128.f * xs[j].s32[b + i]);
    }
  }
  for (int j = 0; j < N; ++j) {
    __m128 o = _mm_add_ps(off[j], _mm_movehl_ps(off[j], off[j]));
    o = _mm_add_ss(o, _mm_movehdup_ps(o));
    res[j] = _mm512_reduce_add_ps(acc[j]) - 128.f * _mm_cvtss_f32(o) + tail[j];
  }
}

// res[j] = Q8_0 row . xs[j] for j < N (inputs in Order::kQ8). Q8_0: per 32 values a float16
// scale (``d``, K / 32 of them for the row) and 32 int8 values. VPDPBUSD takes the input's q + 128
// as its unsigned factor; the row's 128 * (sum of each 4 values), one more VPDPBUSD per 64 values
// shared by the N inputs, is taken off in the same instruction (its accumulator starts there).
template <int N>
inline void dot_q8(const int8_t* w, const uint16_t* d, const Input* xs, int64_t K, float* res) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  // lanes of a 64-value dot: 8 per block; pick m: blocks 2m and 2m + 1 of 16 scales
  alignas(64) static constexpr int32_t kPick[8][16] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},         {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
      {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},         {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
      {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},         {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
      {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
      {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  __m512 scales = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const int64_t m = (k / 64) % 8;
    if (m == 0) {  // the next 16 blocks' scales (fewer at the row's end)
      const int64_t left = (K - k) / 32;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      scales = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + k / 32));
    }
    const __m512 s = _mm512_permutexvar_ps(_mm512_load_si512(kPick[m]), scales);
    read_ahead(w + k);
    const __m512i wv = _mm512_loadu_si512(reinterpret_cast<const void*>(w + k));
    const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv));
    for (int j = 0; j < N; ++j) {
      const __m512i i = _mm512_dpbusd_epi32(start, _mm512_loadu_si512(xs[j].q + k), wv);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, _mm512_loadu_ps(xs[j].dxe + k / 4)), acc[j]);
    }
  }
  float tail[N] = {};
  if (k < K) {  // one block of 32 left
    const float s = _cvtsh_ss(d[k / 32]);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i start = _mm256_sub_epi32(
        _mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(static_cast<char>(0x80)), wv));
    for (int j = 0; j < N; ++j) {
      const __m256i i = _mm256_dpbusd_epi32(start, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[j].q + k)), wv);
      tail[j] = s * reduce256(_mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_loadu_ps(xs[j].dxe + k / 4)));
    }
  }
  for (int j = 0; j < N; ++j) res[j] = _mm512_reduce_add_ps(acc[j]) + tail[j];
}

#elif defined(INT8DOT_AVX2)

inline void Inputs::set(int64_t i, const float* x) {  // every order is the values' own, signed
  int8_t* q = q_.data() + i * K_;
  float* dxe = dxe_.data() + i * K_ / 4;
  float* s32 = s32_.data() + i * K_ / 32;
  float* s16 = s16_.data() + i * K_ / 16;
  for (int64_t b = 0; b < K_ / 32; ++b) {
    const float* xb = x + 32 * b;
    float m = 0.f;
    for (int64_t l = 0; l < 32; ++l) m = std::fmax(m, std::fabs(xb[l]));
    const float dx = m / 127.f;
    int sums[2] = {0, 0};
    for (int64_t l = 0; l < 32; ++l) {
      const int v = m > 0.f ? static_cast<int>(std::nearbyint(xb[l] / dx)) : 0;  // round to nearest even
      q[32 * b + l] = static_cast<int8_t>(v);
      sums[l / 16] += v;
    }
    for (int64_t l = 0; l < 8; ++l) dxe[8 * b + l] = dx;
    s16[2 * b] = dx * static_cast<float>(sums[0]);
    s16[2 * b + 1] = dx * static_cast<float>(sums[1]);
    s32[b] = dx * static_cast<float>(sums[0] + sums[1]);
  }
}

// int32 sums of each 4 products of unsigned u and signed s (32 bytes each; each pair's sum must fit
// int16 without AVX-VNNI, which holds for the weights here: 4- and 6-bit values, |Q8_0| <= 128).
INT8DOT_HOT inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc plus the 32 values of input x from ``at`` on against 32 unsigned weight values w, with the
// weights' scale per lane ws.
INT8DOT_HOT inline __m256 dot32(__m256i w, __m256 ws, const Input& x, int64_t at, __m256 acc) {
  const __m256i i = dot_u8s8(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(ws, _mm256_loadu_ps(x.dxe + at / 4)), acc);
}

// As the AVX-512 dot_q4k (Q5: Q5_K): one 32-byte chunk (64 values) a step, its low nibbles
// sub-block 2c and its high ones 2c + 1, both in the input's order.
template <int N, bool Q5 = false>
inline void dot_q4k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01);
  __m256 acc[N], mins[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps(), mins[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + kBytes * sb;
    const __m256 s = q4k_super<N>(b, xs, sb, mins, kBytes);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));  // Q5_K's fifth bits
    for (int64_t c = 0; c < 4; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (Q5 ? 48 : 16) + 32 * c));
      __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      if constexpr (Q5) {
        auto bit = [&](int j) {  // 16 where bit j of each qh byte is set
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4);
        };
        lo = _mm256_or_si256(lo, bit(static_cast<int>(2 * c)));
        hi = _mm256_or_si256(hi, bit(static_cast<int>(2 * c + 1)));
      }
      const __m256 slo = _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(static_cast<int>(2 * c)));
      const __m256 shi = _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(static_cast<int>(2 * c + 1)));
      for (int j = 0; j < N; ++j) {
        acc[j] = dot32(lo, slo, xs[j], 256 * sb + 64 * c, acc[j]);
        acc[j] = dot32(hi, shi, xs[j], 256 * sb + 64 * c + 32, acc[j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(acc[j]) - reduce256(mins[j]);
}

// As the AVX-512 dot_q6k: one 32-value group a step (low nibbles of low bytes (g % 2) * 32 + l,
// shifted by 4 for g >= 2, with bits 2g of high byte l), 4 lanes per scale.
template <int N>
inline void dot_q6k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  __m256 acc[N], off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps(), off[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + 210 * sb;
    prefetch_block(b, 210);
    const __m256 d = _mm256_set1_ps(half_bits_to_float(b + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 s[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                         _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
    for (int j = 0; j < N; ++j)
      for (int h = 0; h < 2; ++h)
        off[j] = _mm256_fmadd_ps(_mm256_mul_ps(s[h], _mm256_set1_ps(-32.f)), _mm256_loadu_ps(xs[j].s16 + 16 * sb + 8 * h),
                                 off[j]);
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int64_t g = 0; g < 4; ++g) {
        __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (g % 2)));
        if (g >= 2) lo = _mm256_srli_epi16(lo, 4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * g))), low2);
        const __m256i v = _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_slli_epi16(hi, 4));
        const __m256i pick = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
        const __m256 ws = _mm256_permutevar8x32_ps(s[h], pick);
        for (int j = 0; j < N; ++j) acc[j] = dot32(v, ws, xs[j], 256 * sb + 128 * h + 32 * g, acc[j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(_mm256_add_ps(acc[j], off[j]));
}

// As the AVX-512 dot_q23k, 32 values a step in the input's order (value 128n + 32g + l: bits 2g of
// byte 32n + l), 4 lanes per scale.
template <int N, bool Q3>
inline void dot_q23k(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  constexpr int64_t kBytes = Q3 ? 110 : 84;
  const __m256i low2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(0x01);
  __m256 acc[N], off[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps(), off[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + kBytes * sb;
    prefetch_block(b, kBytes);
    __m256 s[2], o[2];
    if constexpr (Q3) {
      const __m128i sc = q3k_scales16(b + 96);
      const __m256 d = _mm256_set1_ps(half_bits_to_float(b + 108));
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc, 8) : sc)));
        o[h] = _mm256_mul_ps(s[h], _mm256_set1_ps(-4.f));
      }
    } else {
      const __m256 d = _mm256_set1_ps(half_bits_to_float(b + 80)), dmin = _mm256_set1_ps(-half_bits_to_float(b + 82));
      for (int h = 0; h < 2; ++h) {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * h)));
        s[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
        o[h] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4)));
      }
    }
    for (int j = 0; j < N; ++j)
      for (int h = 0; h < 2; ++h) off[j] = _mm256_fmadd_ps(o[h], _mm256_loadu_ps(xs[j].s16 + 16 * sb + 8 * h), off[j]);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));  // Q3_K's high bits
    for (int64_t n = 0; n < 2; ++n) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (Q3 ? 32 : 16) + 32 * n));
      for (int64_t g = 0; g < 4; ++g) {
        __m256i v = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(static_cast<int>(2 * g))), low2);
        if constexpr (Q3) {
          const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(static_cast<int>(4 * n + g))), one);
          v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 2));
        }
        const __m256i pick = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
        const __m256 ws = _mm256_permutevar8x32_ps(s[n], pick);
        for (int j = 0; j < N; ++j) acc[j] = dot32(v, ws, xs[j], 256 * sb + 128 * n + 32 * g, acc[j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(_mm256_add_ps(acc[j], off[j]));
}

// As the AVX-512 dot_iq4xs, a sub-block of 32 a step in the input's order, with Q8_0's signs (the
// biased values would overflow VPMADDUBSW's int16 pairs): |value| against the input's sign flipped
// where the value is negative.
// acc[j] plus 32 weight values against input j's values at .. at + 31 (in order): the 16 bytes of
// 4-bit indices at p (low nibbles the first 16) looked up in ``table`` (signed values), times the
// weights' scale ws; Q8_0's signs: |value| against the input's sign flipped where the value is negative.
template <int N>
INT8DOT_HOT inline void lookup_dot32(const uint8_t* p, __m128i table, __m256 ws, const Input* xs, int64_t at,
                                     __m256* acc) {
  const __m128i low4 = _mm_set1_epi8(0x0F), w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i v = _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(w, 4), low4)),
                                     _mm_shuffle_epi8(table, _mm_and_si128(w, low4)));
  const __m256i u = _mm256_abs_epi8(v);
  for (int j = 0; j < N; ++j) {
    const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[j].q + at)), v);
    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, sx)), _mm256_mul_ps(ws, _mm256_loadu_ps(xs[j].dxe + at / 4)),
                             acc[j]);
  }
}

template <int N>
inline void dot_iq4xs(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + 136 * sb;
    const __m256 s8 = iq4_super(b);
    for (int64_t g = 0; g < 8; ++g)
      lookup_dot32<N>(b + 8 + 16 * g, table, _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(static_cast<int>(g))), xs,
                      256 * sb + 32 * g, acc);
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(acc[j]);
}

// As the AVX-512 dot_mxfp4, a block of 32 a step in the input's order, with Q8_0's signs.
template <int N>
inline void dot_mxfp4(const uint8_t* row, const Input* xs, int64_t K, float* res) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxValues));
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = row + 17 * b;
    if (b % 4 == 0) prefetch_block(p, 68);
    lookup_dot32<N>(p + 1, table, _mm256_set1_ps(mx_scale(p[0])), xs, 32 * b, acc);
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(acc[j]);
}

// As the AVX-512 dot_q8, a block of 32 a step: |w| as the unsigned factor, the input's sign flipped
// where w is negative (and zeroed where w is 0) as the signed one.
template <int N>
inline void dot_q8(const int8_t* w, const uint16_t* d, const Input* xs, int64_t K, float* res) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    read_ahead(w + k);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i u = _mm256_abs_epi8(wv);
    const __m256 ws = _mm256_set1_ps(_cvtsh_ss(d[k / 32]));
    for (int j = 0; j < N; ++j) {
      const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[j].q + k)), wv);
      const __m256i i = dot_u8s8(u, sx);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(ws, _mm256_loadu_ps(xs[j].dxe + k / 4)), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) res[j] = reduce256(acc[j]);
}

#else

inline void Inputs::set(int64_t, const float*) {}
template <int N, bool Q5 = false>
inline void dot_q4k(const uint8_t*, const Input*, int64_t, float*) {}
template <int N>
inline void dot_q6k(const uint8_t*, const Input*, int64_t, float*) {}
template <int N, bool Q3>
inline void dot_q23k(const uint8_t*, const Input*, int64_t, float*) {}
template <int N>
inline void dot_iq4xs(const uint8_t*, const Input*, int64_t, float*) {}
template <int N>
inline void dot_mxfp4(const uint8_t*, const Input*, int64_t, float*) {}
template <int N>
inline void dot_q8(const int8_t*, const uint16_t*, const Input*, int64_t, float*) {}

#endif

// k-quant integer dots of one row with N inputs: fmt 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 Q2_K, 4 Q3_K, 5 IQ4_XS,
// 6 MXFP4.
template <int N>
inline void dot_kq(int64_t fmt, const uint8_t* row, const Input* xs, int64_t K, float* res) {
  if (fmt == 0) {
    dot_q4k<N>(row, xs, K, res);
  } else if (fmt == 2) {
    dot_q4k<N, true>(row, xs, K, res);
  } else if (fmt == 3) {
    dot_q23k<N, false>(row, xs, K, res);
  } else if (fmt == 4) {
    dot_q23k<N, true>(row, xs, K, res);
  } else if (fmt == 5) {
    dot_iq4xs<N>(row, xs, K, res);
  } else if (fmt == 6) {
    dot_mxfp4<N>(row, xs, K, res);
  } else {
    dot_q6k<N>(row, xs, K, res);
  }
}

}  // namespace int8dot
