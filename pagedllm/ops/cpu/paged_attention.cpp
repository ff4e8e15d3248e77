// Decode attention over the paged KV cache on the CPU, reading K and V in place.
//
// One query token per request. Work item = (request, KV head): the G = H / KVH query heads
// that share the KV head walk the request's blocks together, so every key and value is read
// once for the whole group (no gather copy, no GQA expansion). Keys are taken a block at a
// time: the G x block_size scores, their maximum, one rescale of the accumulators per block
// (online softmax), then the weighted values. Accumulation in float32 whatever the cache's
// dtype (float32 or bfloat16).
//
// bfloat16 on a CPU with AMX (blocks of 16, D a multiple of 32 up to 128, G <= 16): a block's
// G x 16 scores are one tile product (TDPBF16PS: the keys as they lie in the cache times the
// query heads laid out once per work item), its softmax one 16-lane vector per query head.
// The values are read as bfloat16 in place (accumulate_bf16). Faster than the AVX-512 path,
// most where the cache sits in L3; over a whole model's caches in DRAM the kernel is bound by
// memory and the gain is smaller (benchmarks/cpu_kernel_ab.py, --layers 1 against 30).
//
// Shapes: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (contiguous);
// block_tables [B, max_blocks] int32; seq_lens [B] int32 (keys of request b: positions
// 0 .. seq_lens[b] - 1, or the last `window` of them when window > 0); out [B, H, D].
// Example: block_size 16, seq_len 40, window 0 -> blocks 0, 1, 2 of the row's table; the
// last holds positions 32..39 (8 valid slots).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

inline float to_float(float x) { return x; }

// float8 e4m3fn caches (kv_cache_dtype fp8) hold their bytes as uint8: a 256-entry table of
// their values (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 subnormal;
// 0x7f / 0xff NaN, which the writes never store: they clamp at 448)
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = (b & 128) ? -x : x;
    }
  }
};
inline float to_float(uint8_t x) {
  static const Fp8Table table;
  return table.v[x];
}

// float32 caches are read in place; bfloat16 ones are widened into a small buffer first
template <typename T>
inline const float* widen(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}
template <>
inline const float* widen<float>(const float* src, float*, int64_t) {
  return src;
}
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) in a form the compiler vectorizes (std::exp stays a scalar call without fast-math):
// 2^(x log2 e) = 2^n 2^f with n = round(x log2 e), f in [-0.5, 0.5], 2^f = 1 + f P(f) (a
// degree-6 polynomial, relative error ~2e-7), 2^n put into the exponent bits. For softmax
// arguments (x <= 0, the block's maximum subtracted); x is clamped at -87 (exp(-87) ~ 1.6e-38,
// nothing beside the maximum's 1; the exponent stays normal). Faster than std::exp in the
// decode kernel in both dtypes (benchmarks/cpu_kernel_ab.py).
// P's coefficients, highest degree first (the vector forms below use the same ones)
constexpr float kExp2Poly[6] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                9.618437357674640e-3f, 5.550332471162809e-2f,
                                2.402264791363012e-1f, 6.931472028550421e-1f};
inline float exp_softmax(float x) {
  const float y = std::max(x, -87.f) * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 6; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return (1.f + f * p) * __builtin_bit_cast(float, bits);
}

#if defined(__AVX512F__)
// AVX-512 forms of the two inner loops, for head sizes that are a multiple of 16 (the build is
// -march=native: on a CPU without AVX-512 the AVX2 forms below, or the plain loops).

// exp of 16 arguments <= 88 (softmax ones are <= 0): the vector form of exp_softmax
inline __m512 exp512(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(_mm512_fmadd_ps(f, p, _mm512_set1_ps(1.f)), _mm512_castsi512_ps(bits));
}

// out[i] = the sum of a[i]'s 16 lanes, i < 8, with 8 horizontal reductions folded into one:
// halves added (16 -> 8 lanes), then pairwise adds across registers (hadd: 8 -> 4 -> 2),
// then the two 128-bit lanes. ~25 instructions where eight _mm512_reduce_add_ps take ~64.
inline void reduce8(const __m512* a, float* out) {
  __m256 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  // per 128-bit lane: c01 = [b0 b0 b1 b1] pair sums, ... ; e0 = [b0 b1 b2 b3] quarter sums
  const __m256 e0 = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
  const __m256 e1 = _mm256_hadd_ps(_mm256_hadd_ps(b[4], b[5]), _mm256_hadd_ps(b[6], b[7]));
  const __m256 lo = _mm256_permute2f128_ps(e0, e1, 0x20);  // lane 0 of each
  const __m256 hi = _mm256_permute2f128_ps(e0, e1, 0x31);  // lane 1 of each
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

// s[t] = q . k_t for the slots t in [lo, hi): four keys at a time, each with its own
// accumulator (four independent FMA chains instead of one dependent chain and a horizontal
// sum per key before the next key starts).
inline void scores_f32(const float* qg, const float* const* kr, int64_t lo, int64_t hi,
                       int64_t D, float* s) {
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(qg + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[t + i] + d), a[i]);
    }
    reduce8(a, s + t);
  }
  for (; t + 4 <= hi; t += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(qg + d);
      a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[t] + d), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[t + 1] + d), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[t + 2] + d), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[t + 3] + d), a3);
    }
    s[t] = _mm512_reduce_add_ps(a0);
    s[t + 1] = _mm512_reduce_add_ps(a1);
    s[t + 2] = _mm512_reduce_add_ps(a2);
    s[t + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; t < hi; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(kr[t] + d), a);
    s[t] = _mm512_reduce_add_ps(a);
  }
}

// a = a * corr + sum over t in [lo, hi) of p[t] v_t: 64 lanes of a at a time held in four
// registers across the slots (not loaded and stored back once per slot).
inline void accumulate_f32(float* a, float corr, const float* p, const float* const* vr,
                           int64_t lo, int64_t hi, int64_t D) {
  const __m512 c = _mm512_set1_ps(corr);
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 r0 = _mm512_mul_ps(_mm512_loadu_ps(a + d), c);
    __m512 r1 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 16), c);
    __m512 r2 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 32), c);
    __m512 r3 = _mm512_mul_ps(_mm512_loadu_ps(a + d + 48), c);
    for (int64_t t = lo; t < hi; ++t) {
      const __m512 pv = _mm512_set1_ps(p[t]);
      const float* v = vr[t] + d;
      r0 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v), r0);
      r1 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + 16), r1);
      r2 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + 32), r2);
      r3 = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + 48), r3);
    }
    _mm512_storeu_ps(a + d, r0);
    _mm512_storeu_ps(a + d + 16, r1);
    _mm512_storeu_ps(a + d + 32, r2);
    _mm512_storeu_ps(a + d + 48, r3);
  }
  for (; d < D; d += 16) {
    __m512 r = _mm512_mul_ps(_mm512_loadu_ps(a + d), c);
    for (int64_t t = lo; t < hi; ++t)
      r = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vr[t] + d), r);
    _mm512_storeu_ps(a + d, r);
  }
}
constexpr int64_t kF32Lanes = 16;  // the float32 decode loops' vector width
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 forms of the same two loops (8 lanes; head sizes a multiple of 8), for CPUs without
// AVX-512, where the plain loops would take a horizontal sum per key.
constexpr int64_t kF32Lanes = 8;

// out[i] = the sum of a[i]'s 8 lanes, i < 8 (reduce8's second half: pairwise adds across
// registers, then the two 128-bit lanes)
inline void reduce8_256(const __m256* a, float* out) {
  const __m256 e0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 e1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 lo = _mm256_permute2f128_ps(e0, e1, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(e0, e1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

// exp of 8 arguments <= 88: exp512's 8-lane form (the same polynomial)
inline __m256 exp256(__m256 x) {
  const __m256 y = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(_mm256_fmadd_ps(f, p, _mm256_set1_ps(1.f)), _mm256_castsi256_ps(bits));
}

inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_hadd_ps(x, x);
  return _mm_cvtss_f32(_mm_hadd_ps(x, x));
}

// s[t] = q . k_t, eight keys at a time with their own accumulators (the AVX-512 form's plan)
inline void scores_f32(const float* qg, const float* const* kr, int64_t lo, int64_t hi,
                       int64_t D, float* s) {
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t + i] + d), a[i]);
    }
    reduce8_256(a, s + t);
  }
  for (; t < hi; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kr[t] + d), a);
    s[t] = hsum256(a);
  }
}

// a = a * corr + sum over t of p[t] v_t: 64 lanes of a held in eight registers across the
// slots, then 8 at a time
inline void accumulate_f32(float* a, float corr, const float* p, const float* const* vr,
                           int64_t lo, int64_t hi, int64_t D) {
  const __m256 c = _mm256_set1_ps(corr);
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(a + d + 8 * i), c);
    for (int64_t t = lo; t < hi; ++t) {
      const __m256 pv = _mm256_set1_ps(p[t]);
      const float* v = vr[t] + d;
      for (int i = 0; i < 8; ++i) r[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * i), r[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(a + d + 8 * i, r[i]);
  }
  for (; d < D; d += 8) {
    __m256 r = _mm256_mul_ps(_mm256_loadu_ps(a + d), c);
    for (int64_t t = lo; t < hi; ++t)
      r = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vr[t] + d), r);
    _mm256_storeu_ps(a + d, r);
  }
}
#else
constexpr int64_t kF32Lanes = 0;  // the plain loops
inline void scores_f32(const float*, const float* const*, int64_t, int64_t, int64_t, float*) {}
inline void accumulate_f32(float*, float, const float*, const float* const*, int64_t, int64_t,
                           int64_t) {}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kAvx512Bf16 = true;

// The bfloat16 form of the AVX-512 scores_f32, reading the keys in place (no widening): s[t] =
// scale * (q . k_t), the products summed in float32 by VDPBF16PS (32 bfloat16 products per
// instruction; a bfloat16 product is exact in float32). q is the unscaled bfloat16 query.
// D is a multiple of 32; key t starts at kb + t * stride.
inline void scores_bf16(const at::BFloat16* q, const at::BFloat16* kb, int64_t stride,
                        int64_t lo, int64_t hi, int64_t D, float scale, float* s) {
  auto ld = [](const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
    const at::BFloat16* k0 = kb + t * stride;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = ld(q + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbf16_ps(a[i], qv, ld(k0 + i * stride + d));
    }
    reduce8(a, s + t);
    for (int i = 0; i < 8; ++i) s[t + i] *= scale;
  }
  for (; t + 4 <= hi; t += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    const at::BFloat16* k0 = kb + t * stride;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = ld(q + d);
      a0 = _mm512_dpbf16_ps(a0, qv, ld(k0 + d));
      a1 = _mm512_dpbf16_ps(a1, qv, ld(k0 + stride + d));
      a2 = _mm512_dpbf16_ps(a2, qv, ld(k0 + 2 * stride + d));
      a3 = _mm512_dpbf16_ps(a3, qv, ld(k0 + 3 * stride + d));
    }
    s[t] = scale * _mm512_reduce_add_ps(a0);
    s[t + 1] = scale * _mm512_reduce_add_ps(a1);
    s[t + 2] = scale * _mm512_reduce_add_ps(a2);
    s[t + 3] = scale * _mm512_reduce_add_ps(a3);
  }
  for (; t < hi; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
      a = _mm512_dpbf16_ps(a, ld(q + d), ld(kb + t * stride + d));
    s[t] = scale * _mm512_reduce_add_ps(a);
  }
}

// 16 bfloat16 values to float32, and float32 to bfloat16 rounded to nearest even (VCVTNEPS2BF16:
// at::BFloat16's rounding, but for denormal inputs, which it takes as zero)
inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_bf16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round_bf16(__m512 v) {  // v rounded to bfloat16, as float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// n bfloat16 values to float32 (n a multiple of 16)
inline void widen_bf16(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load_bf16(src + i));
}
// The values of a block of 16 slots into the G accumulators of a work item (the AMX path,
// and the VDPBF16PS one for blocks of 16): acc[g] += sum over t in [lo, hi) of p[g][t] v_t
// (after acc[g] *= corr[g]), the values read as bfloat16 in place: a 32-value row piece as
// 16 32-bit lanes is its odd values' float32 bits with junk below (masked off) and its even
// values' bits shifted up (no widening pass).
// So acc holds, per 32 dimensions, the 16 even ones then the 16 odd ones (``acc_to_dims``
// puts them back in order). NG query heads at a time keep 2 NG accumulators in registers.
// Example: D 64 -> acc[g] = [d0 d2 .. d30, d1 d3 .. d31, d32 d34 .. d62, d33 .. d63].
template <int NG>
inline void accumulate_bf16(float* acc, const float* corr, const float* p,
                            const at::BFloat16* vb, int64_t row_stride, int64_t lo, int64_t hi,
                            int64_t D) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t c = 0; c < D; c += 32) {
    __m512 ev[NG], od[NG];
    for (int g = 0; g < NG; ++g) {
      const __m512 cg = _mm512_set1_ps(corr[g]);
      ev[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), cg);
      od[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c + 16), cg);
    }
    for (int64_t t = lo; t < hi; ++t) {
      const __m512i x = _mm512_loadu_si512(vb + t * row_stride + c);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      for (int g = 0; g < NG; ++g) {
        const __m512 pv = _mm512_set1_ps(p[g * 16 + t]);
        ev[g] = _mm512_fmadd_ps(pv, e, ev[g]);
        od[g] = _mm512_fmadd_ps(pv, o, od[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm512_storeu_ps(acc + g * D + c, ev[g]);
      _mm512_storeu_ps(acc + g * D + c + 16, od[g]);
    }
  }
}

// accumulate_bf16 for the G query heads of a work item, 4 at a time (8 accumulators);
// p = sc + g * 16 is head g's block of probabilities, corr[g] its rescale.
inline void accumulate_heads(float* acc, const float* corr, const float* sc,
                             const at::BFloat16* vb, int64_t row_stride, int64_t lo, int64_t hi,
                             int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; g += 4) {
    float* a = acc + g * D;
    const float* c = corr + g;
    const float* p = sc + g * 16;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: accumulate_bf16<4>(a, c, p, vb, row_stride, lo, hi, D); break;
      case 3: accumulate_bf16<3>(a, c, p, vb, row_stride, lo, hi, D); break;
      case 2: accumulate_bf16<2>(a, c, p, vb, row_stride, lo, hi, D); break;
      default: accumulate_bf16<1>(a, c, p, vb, row_stride, lo, hi, D);
    }
  }
}

// One query head's accumulator from accumulate_bf16's order back to dimension order.
inline void acc_to_dims(const float* acc, float* out, int64_t D) {
  for (int64_t c = 0; c < D; c += 32)
    for (int64_t i = 0; i < 16; ++i) {
      out[c + 2 * i] = acc[c + i];
      out[c + 2 * i + 1] = acc[c + 16 + i];
    }
}

#else
constexpr bool kAvx512Bf16 = false;
inline void scores_bf16(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, int64_t,
                        int64_t, float, float*) {}
inline void widen_bf16(const at::BFloat16*, float*, int64_t) {}
#endif


#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
constexpr bool kAmx = true;

// Linux hands out the AMX tile registers to a process that asks (arch_prctl); asked once.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The tile configuration (palette 1): tile 0 the scores C [16 slots, G], tiles 1-2 a block's
// keys A [16 slots, 32 dims] (two alternating), tiles 3.. the query B, one tile per 32 dims.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig amx_config(int64_t G, int64_t chunks) {
  TileConfig c;
  c.rows[0] = 16, c.colsb[0] = static_cast<uint16_t>(G * 4);
  for (int i = 1; i <= 2; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  for (int64_t i = 0; i < chunks; ++i) c.rows[3 + i] = 16, c.colsb[3 + i] = G * 4;
  return c;
}


// The query heads g < G of one KV head as the B operand of TDPBF16PS, 32 dims per tile:
// qt[c][p][g][j] = q_g[32 c + 2 p + j] (pairs of dims side by side, "VNNI" order).
// Example: G 3, D 64 -> qt [2][16][3][2]; tile 3 + c holds chunk c, rows p, 12 bytes a row.
inline void query_tiles(const at::BFloat16* q, int64_t G, int64_t D, at::BFloat16* qt) {
  for (int64_t c = 0; c < D / 32; ++c)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < 2; ++j)
          qt[((c * 16 + p) * G + g) * 2 + j] = q[g * D + c * 32 + 2 * p + j];
}

// Tiles 3.. <- the query tiles, one per 32 dims (up to 4: D <= 128); then C (tile 0) = the
// block's 16 keys (rows `stride` bytes apart) times the query, 32 dims at a time (keys into
// tiles 1 and 2 by turns), stored as cbuf[t * 16 + g]. (The tile numbers are literals: GCC's
// intrinsics paste them into the instruction.)
inline void load_query_tiles(const at::BFloat16* qt, int64_t G, int64_t chunks) {
  const int row = static_cast<int>(G * 4);
  const int64_t tile = 16 * G * 2;  // bfloat16 values per query tile
  _tile_loadd(3, qt, row);
  if (chunks > 1) _tile_loadd(4, qt + tile, row);
  if (chunks > 2) _tile_loadd(5, qt + 2 * tile, row);
  if (chunks > 3) _tile_loadd(6, qt + 3 * tile, row);
}
inline void scores_amx(const at::BFloat16* kb, int64_t stride, int64_t chunks, float* cbuf) {
  _tile_zero(0);
  _tile_loadd(1, kb, stride);
  _tile_dpbf16ps(0, 1, 3);
  if (chunks > 1) {
    _tile_loadd(2, kb + 32, stride);
    _tile_dpbf16ps(0, 2, 4);
  }
  if (chunks > 2) {
    _tile_loadd(1, kb + 64, stride);
    _tile_dpbf16ps(0, 1, 5);
  }
  if (chunks > 3) {
    _tile_loadd(2, kb + 96, stride);
    _tile_dpbf16ps(0, 2, 6);
  }
  _tile_stored(0, cbuf, 64);
}

// One block of one work item on the AMX path: the 16 slots' scores for every query head in
// one tile product, then per head the softmax over the block in one vector (masked to the
// valid slots [lo, hi)), the rescale only when the running maximum grows, and the values
// (accumulate_bf16).
inline void block_amx(const at::BFloat16* kb, const at::BFloat16* vb, int64_t row_stride,
                      int64_t lo, int64_t hi, int64_t G, int64_t D, float scale, float* cbuf,
                      float* m, float* l, float* acc, float* sc, float* corr) {
  scores_amx(kb, row_stride * 2, D / 32, cbuf);
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    __m512 s = _mm512_mul_ps(_mm512_i32gather_ps(rows, cbuf + g, 4), _mm512_set1_ps(scale));
    s = _mm512_mask_blend_ps(valid, ninf, s);
    const float new_m = std::max(m[g], _mm512_reduce_max_ps(s));
    // 0 for the first block (m = -inf); 1 with no call while the maximum holds
    corr[g] = new_m == m[g] ? 1.f : std::exp(m[g] - new_m);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(new_m))));
    _mm512_storeu_ps(sc + g * 16, p);
    l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(p);
    m[g] = new_m;
  }
  accumulate_heads(acc, corr, sc, vb, row_stride, lo, hi, G, D);
}
#else
constexpr bool kAmx = false;
#endif

// Prefetch a block's rows for one KV head: `rows` rows of `row_bytes` at k and v, each
// `stride_bytes` after the last; locality 3 = into L1, 2 and 1 = into L2 (on current x86).
template <int where, typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t rows, int64_t row_bytes,
                          int64_t stride_bytes) {
  const char* kc = reinterpret_cast<const char*>(k);
  const char* vc = reinterpret_cast<const char*>(v);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(kc + t * stride_bytes + o, 0, where);
      __builtin_prefetch(vc + t * stride_bytes + o, 0, where);
    }
}

// T: the query's dtype; C: the cache's (T, or uint8_t for an fp8 cache, whose rows are widened
// through the table and whose K / V scales per KV head, k_scale / v_scale, go into the query
// and the output)
template <typename T, typename C = T>
void decode_kernel(const T* q, const C* kc, const C* vc, const int32_t* tables,
                   const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                   int64_t bs, int64_t max_blocks, float scale, int64_t window,
                   bool allow_amx, const float* k_scale = nullptr,
                   const float* v_scale = nullptr) {
  const int64_t G = H / KVH;
  const int64_t row_stride = KVH * D;  // one token's K (or V) for all KV heads
  const bool vec = kF32Lanes > 0 && D % kF32Lanes == 0;  // AVX-512 or AVX2 float32 loops
  // bfloat16 caches: keys read in place by VDPBF16PS, values widened 16 at a time
  constexpr bool is_bf16 = std::is_same_v<C, at::BFloat16>;
  const bool dp = is_bf16 && kAvx512Bf16 && D % 32 == 0;
  // AMX (bfloat16 tile products): a block's scores for all G query heads in one product
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
  const bool amx = allow_amx && dp && bs == 16 && D <= 128 && G <= 16 && amx_permitted();
#else
  const bool amx = false;
#endif
  // bfloat16 without AMX, blocks of 16: the values read in place by accumulate_bf16 for all
  // G heads at once (no widening pass), faster than the widened path (cpu_kernel_ab.py
  // --layers 30)
  const bool inplace_v = dp && !amx && bs == 16;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(bs * D), vf(bs * D), sc(G * bs);
    std::vector<float> m(G), l(G);
    std::vector<float> corr(G), dims(D);  // rescales and dimension order (in-place values)
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
    // the AMX path's query tiles, block scores [16 slots x 16]
    std::vector<at::BFloat16> qt(amx ? G * D : 0);
    alignas(64) float cbuf[256];
    const TileConfig cfg = amx_config(G, D / 32);
    if (amx) _tile_loadconfig(&cfg);
#endif
    // The thread's walk: every block of its work items in the order they are worked on, as
    // element offsets of the block's rows for the item's KV head in the K (and V) cache.
    // Example: block_size 16, KVH 3, D 64, items 4..5 = request 1, heads 1..2, len 20, table
    // [7, 2] -> offsets [(7 16 3 + 1) 64, (2 16 3 + 1) 64, (7 16 3 + 2) 64, (2 16 3 + 2) 64].
    std::vector<int64_t> walk;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / KVH, len = lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t j = first / bs; j * bs < len; ++j)
        walk.push_back((tables[r * max_blocks + j] * bs * KVH + it % KVH) * D);
    }
    const int64_t walk_len = static_cast<int64_t>(walk.size());
    int64_t pos = 0;  // the walk's current block
    constexpr int64_t kFar = 3;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
    const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(C));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const float qscale = k_scale ? scale * k_scale[h] : scale;  // q . (k s_k) = (q s_k) . k
      for (int64_t g = 0; g < G; ++g) {
        const T* qs = q + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qs[d]) * qscale;
      }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
      if (amx) {
        query_tiles(reinterpret_cast<const at::BFloat16*>(q) + (b * H + h * G) * D, G, D,
                    qt.data());
        load_query_tiles(qt.data(), G, D / 32);
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = first - first % bs; start < len; start += bs) {
        const int64_t block = tables[b * max_blocks + start / bs];
        const int64_t lo = std::max(start, first) - start;  // valid slots [lo, hi)
        const int64_t hi = std::min(start + bs, len) - start;
        const C* kb = kc + block * bs * row_stride + h * D;
        const C* vb = vc + block * bs * row_stride + h * D;
        // Blocks ahead on the walk, fetched while this one is worked on (their place in the
        // cache is a table lookup away, which the hardware prefetcher cannot follow; without
        // this the loads stall much of the kernel's time): the next one into L1 (float32; L2
        // for bfloat16, which is faster there), the one kFar ahead into L2, both running on
        // into the thread's next work items (whose first blocks would otherwise start cold).
        // Over a whole model's caches in DRAM both are faster than the next block alone, more
        // in bfloat16; kFar 2-4 alike (cpu_kernel_ab.py --layers 30).
        if (pos + 1 < walk_len)
          prefetch_rows<is_bf16 ? 2 : 3>(kc + walk[pos + 1], vc + walk[pos + 1], bs, row_bytes,
                                          stride_bytes);
        if (pos + kFar < walk_len)
          prefetch_rows<1>(kc + walk[pos + kFar], vc + walk[pos + kFar], bs, row_bytes,
                           stride_bytes);
        ++pos;
        const float* kr[64];  // each slot's key and value rows (block_size <= 64)
        const float* vr[64];
        if constexpr (is_bf16) {
          if (dp && !amx && !inplace_v) {  // (else the values are read in place)
            for (int64_t t = lo; t < hi; ++t) {
              widen_bf16(reinterpret_cast<const at::BFloat16*>(vb + t * row_stride),
                         vf.data() + t * D, D);
              vr[t] = vf.data() + t * D;
            }
          }
        }
        if (!dp) {
          for (int64_t t = lo; t < hi; ++t) {
            kr[t] = widen(kb + t * row_stride, kf.data() + t * D, D);
            vr[t] = widen(vb + t * row_stride, vf.data() + t * D, D);
          }
        }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
        if (amx) {
          block_amx(reinterpret_cast<const at::BFloat16*>(kb),
                    reinterpret_cast<const at::BFloat16*>(vb), row_stride, lo, hi, G, D, scale,
                    cbuf, m.data(), l.data(), acc.data(), sc.data(), corr.data());
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* s = sc.data() + g * bs;
          float block_max = -std::numeric_limits<float>::infinity();
          if (dp) {
            scores_bf16(reinterpret_cast<const at::BFloat16*>(q + (b * H + h * G + g) * D),
                        reinterpret_cast<const at::BFloat16*>(kb), row_stride, lo, hi, D,
                        scale, s);
          } else if (vec) {
            scores_f32(qg, kr, lo, hi, D, s);
          } else {
            for (int64_t t = lo; t < hi; ++t) {
              const float* kd = kr[t];
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qg[d] * kd[d];
              s[t] = dot;
            }
          }
          for (int64_t t = lo; t < hi; ++t) block_max = std::max(block_max, s[t]);
          const float new_m = std::max(m[g], block_max);
          const float cg = std::exp(m[g] - new_m);  // 0 for the first block (m = -inf)
          float* a = acc.data() + g * D;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = lo; t < hi; ++t) {
            s[t] = exp_softmax(s[t] - new_m);
            sum += s[t];
          }
          if (inplace_v) {
            corr[g] = cg;  // the values after the loop, all heads at once
          } else if (vec) {
            accumulate_f32(a, cg, s, vr, lo, hi, D);
          } else {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= cg;
            for (int64_t t = lo; t < hi; ++t) {
              const float p = s[t];
              const float* vd = vr[t];
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p * vd[d];
            }
          }
          l[g] = l[g] * cg + sum;
          m[g] = new_m;
        }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (inplace_v)
          accumulate_heads(acc.data(), corr.data(), sc.data(),
                           reinterpret_cast<const at::BFloat16*>(vb), row_stride, lo, hi, G, D);
#endif
      }
      for (int64_t g = 0; g < G; ++g) {
        T* os = out + (b * H + h * G + g) * D;
        const float inv = (l[g] > 0.f ? 1.f / l[g] : 0.f) * (v_scale ? v_scale[h] : 1.f);
        const float* a = acc.data() + g * D;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (amx || inplace_v) a = (acc_to_dims(a, dims.data(), D), dims.data());
#endif
        for (int64_t d = 0; d < D; ++d) os[d] = static_cast<T>(a[d] * inv);
      }
    }
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
    if (amx) _tile_release();
#endif
  });
}

// Index of each row's maximum (the first one; the first NaN where a row has one, as
// torch.argmax). Two passes over a row: a vectorized maximum and NaN count, then a scan for
// the first element equal to it. torch's argmax keeps an index beside every comparison and
// does not vectorize; this is several times faster on a step's logits.
template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      float m = -std::numeric_limits<float>::infinity();
      int64_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float(row[i]);
        m = v > m ? v : m;
        nans += v != v;
      }
      int64_t idx = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float(row[i]);
        if (nans ? v != v : v == m) {
          idx = i;
          break;
        }
      }
      out[r] = idx;
    }
  });
}

}  // namespace

torch::Tensor argmax_last(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_last takes [rows, n] with n > 0");
  x = x.contiguous();
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows<float>(x.data_ptr<float>(), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  } else if (x.scalar_type() == at::kBFloat16) {
    argmax_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<int64_t>(), x.size(0),
                              x.size(1));
  } else {
    TORCH_CHECK(false, "argmax_last supports float32 and bfloat16");
  }
  return out;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, bool allow_amx,
                           c10::optional<torch::Tensor> kv_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || q.scalar_type() == k_cache.scalar_type(),
              "q and the cache differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache not contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head shapes do not match");
  TORCH_CHECK(bs <= 64, "block_size above 64");
  auto out = torch::empty_like(q);
  if (fp8) {  // e4m3 bytes; kv_scale [2, KVH] float32: K's scales, then V's
    TORCH_CHECK(kv_scale.has_value() && kv_scale->scalar_type() == at::kFloat &&
                    kv_scale->numel() == 2 * KVH && kv_scale->is_contiguous(),
                "an fp8 cache needs kv_scale [2, num_kv_heads] float32");
    const auto* kb = reinterpret_cast<const uint8_t*>(k_cache.data_ptr());
    const auto* vb = reinterpret_cast<const uint8_t*>(v_cache.data_ptr());
    const float* ks = kv_scale->data_ptr<float>();
    if (q.scalar_type() == at::kFloat) {
      decode_kernel<float, uint8_t>(q.data_ptr<float>(), kb, vb,
                                    block_tables.data_ptr<int32_t>(),
                                    seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, H,
                                    KVH, D, bs, block_tables.size(1),
                                    static_cast<float>(scale), window, false, ks, ks + KVH);
    } else if (q.scalar_type() == at::kBFloat16) {
      decode_kernel<at::BFloat16, uint8_t>(
          q.data_ptr<at::BFloat16>(), kb, vb, block_tables.data_ptr<int32_t>(),
          seq_lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, D, bs,
          block_tables.size(1), static_cast<float>(scale), window, false, ks, ks + KVH);
    } else {
      TORCH_CHECK(false, "paged_decode over an fp8 cache takes float32 or bfloat16 queries");
    }
  } else if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), block_tables.data_ptr<int32_t>(),
                         seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, H, KVH, D, bs,
                         block_tables.size(1), static_cast<float>(scale), window, false);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(
        q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
        v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int32_t>(),
        seq_lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, D, bs,
        block_tables.size(1), static_cast<float>(scale), window, allow_amx);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16");
  }
  return out;
}

// ---------------------------------------------------------------- bfloat16 small ops
// The element-wise layers of a bfloat16 model, with the rounding of the PyTorch code they
// replace (model/layers/norm.py, rotary.py): each PyTorch op computes in float32 and rounds
// its result to bfloat16 (round to nearest even), and so do these, op for op. Eight to ten
// PyTorch kernels a layer become two: at small models' decode shapes those kernels' launches
// are a noticeable part of a step (benchmarks/throughput.py, PAGEDLLM_CPU_KERNELS=0 against
// the default).

inline at::BFloat16 rb(float x) { return at::BFloat16(x); }  // round to nearest even

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// the element-wise kernels below for float32 or bfloat16 rows: 16 values in, out, and the
// rounding to T (none for float32)
template <typename T>
inline __m512 ld16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else return load_bf16(p);
}
template <typename T>
inline void st16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(p, v);
  else store_bf16(p, v);
}
template <typename T>
inline __m512 rnd16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_bf16(v);
}
#endif
template <typename T>
inline float tof(T x) { return to_float(x); }
template <typename T>
inline T fromf(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return rb(x);
}

// RMSNorm of each row of x [rows, n] (optionally of x + residual, the sum rounded to T
// first and returned in residual's place): offset 0 -> w * T(x / rms(x)) with the product
// rounded; offset != 0 (Gemma) -> T(x / rms(x) * (offset + w)) in float32. bfloat16: the
// roundings of the PyTorch code, op for op (the sum of squares in another order); float32:
// the same arithmetic, the sum of squares in 16 lanes (torch's reduction adds in another
// order: results within an ulp or so, not bit for bit).
template <typename T>
void rms_norm_rows(const T* xs, const T* rs, T* sums, const T* w, T* ys, int64_t rows,
                   int64_t n, float e, float off) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = xs + i * n;
      if (rs != nullptr) {  // the row's sum first (one pass: the norm reads it from L1)
        const T* rr = rs + i * n;
        T* sr = sums + i * n;
        int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; j + 16 <= n; j += 16) st16(sr + j, _mm512_add_ps(ld16(xr + j), ld16(rr + j)));
#endif
        for (; j < n; ++j) sr[j] = fromf<T>(tof(xr[j]) + tof(rr[j]));
        xr = sr;
      }
      T* yr = ys + i * n;
      float ss = 0.f;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      __m512 acc = _mm512_setzero_ps();
      for (; j + 16 <= n; j += 16) {
        const __m512 v = ld16(xr + j);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (; j < n; ++j) ss += tof(xr[j]) * tof(xr[j]);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + e);
      j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const __m512 rv = _mm512_set1_ps(r), ov = _mm512_set1_ps(off);
      for (; j + 16 <= n; j += 16) {  // the loops below, 16 at a time (the same roundings)
        const __m512 xv = ld16(xr + j), wv = ld16(w + j);
        st16(yr + j, off != 0.f ? _mm512_mul_ps(_mm512_mul_ps(xv, rv), _mm512_add_ps(ov, wv))
                                : _mm512_mul_ps(wv, rnd16<T>(_mm512_mul_ps(xv, rv))));
      }
#endif
      if (off != 0.f) {
        for (; j < n; ++j) yr[j] = fromf<T>(tof(xr[j]) * r * (off + tof(w[j])));
      } else {
        for (; j < n; ++j) yr[j] = fromf<T>(tof(w[j]) * tof(fromf<T>(tof(xr[j]) * r)));
      }
    }
  });
}

std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    double offset, c10::optional<torch::Tensor> residual) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && weight.scalar_type() == dt,
              "rms_norm: float32 or bfloat16 tensors of one dtype");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight size");
  auto xc = x.contiguous().view({-1, n});
  const int64_t rows = xc.size(0);
  torch::Tensor rc, sum;  // sum = x + residual, rounded: returned in the residual's place
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == dt, "rms_norm: residual dtype");
    rc = residual->contiguous().view({-1, n});
    sum = torch::empty_like(xc);
  }
  auto out = torch::empty_like(xc);
  auto w = weight.contiguous();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  if (dt == at::kFloat) {
    rms_norm_rows<float>(xc.data_ptr<float>(), rc.defined() ? rc.data_ptr<float>() : nullptr,
                         sum.defined() ? sum.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                         out.data_ptr<float>(), rows, n, e, off);
  } else {
    using B = at::BFloat16;
    rms_norm_rows<B>(xc.data_ptr<B>(), rc.defined() ? rc.data_ptr<B>() : nullptr,
                     sum.defined() ? sum.data_ptr<B>() : nullptr, w.data_ptr<B>(),
                     out.data_ptr<B>(), rows, n, e, off);
  }
  auto y = out.view(x.sizes());
  if (residual.has_value()) return {y, sum.view(x.sizes())};
  return {y};
}

// Rotary embedding of x [tokens, heads, D] (any strides, unit stride along D) by its
// tokens' positions: cos_sin [max_position, D] float32 (the D/2 cosines, then the sines);
// out = (x1 c - x2 s, x2 c + x1 s) in float32, each product rounded before the sum as in
// PyTorch (no fused multiply-add: fp-contract off), then x's dtype: float32 bit for bit as
// PyTorch, bfloat16 rounded to nearest even. Returns a new tensor.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_rows(const T* xs, int64_t st, int64_t sh, const int64_t* p, const float* cs, T* o,
               int64_t T_, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_ * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      const T* xr = xs + t * st + h * sh;
      const float* c = cs + p[t] * D;
      const float* s = c + half;
      T* orow = o + i * D;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      // 16 at a time: the same products and sums (no fused multiply-add: fp-contract off)
      for (; j + 16 <= half; j += 16) {
        const __m512 x1 = ld16(xr + j), x2 = ld16(xr + j + half);
        const __m512 cv = _mm512_loadu_ps(c + j), sv = _mm512_loadu_ps(s + j);
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
        st16(orow + j, lo);
        st16(orow + j + half, hi);
      }
#endif
      for (; j < half; ++j) {
        const float x1 = to_float(xr[j]), x2 = to_float(xr[j + half]);
        const float a = x1 * c[j], b = x2 * s[j], u = x2 * c[j], v = x1 * s[j];
        orow[j] = fromf<T>(a - b);
        orow[j + half] = fromf<T>(u + v);
      }
    }
  });
}

torch::Tensor rope(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin) {
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.dim() == 3 && x.stride(2) == 1,
              "rope: float32 or bfloat16 [tokens, heads, D] with unit stride along D");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "rope: cos_sin");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  auto pos = positions.to(at::kLong).contiguous();
  auto out = torch::empty({T, H, D}, x.options());
  const auto* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos_sin.size(0), "rope: position out of range");
  const float* cs = cos_sin.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), p, cs,
                     out.data_ptr<float>(), T, H, D);
  } else {
    rope_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), p, cs,
                            out.data_ptr<at::BFloat16>(), T, H, D);
  }
  return out;
}
#pragma GCC pop_options

// ------------------------------------------------------------- KV write, silu-and-mul
// The step's new keys and values into their slots: k_cache.view(-1, KVH, D)[slot[t]] =
// key[t] (the same for values), a row copy per token; slots < 0 are skipped. key/value
// [T, KVH, D] with unit strides inside a token (a slice of the QKV projection is fine), the
// cache's dtype. Far cheaper a call than index_copy_ (the PyTorch reference,
// kv_layout.write_kv_ref) at a decode step's rows.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
              torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "write_kv: key/value shapes");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "write_kv: key/value and cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: cache layout");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) <= key.size(0),
              "write_kv: slot_mapping");
  const int64_t KVH = key.size(1), D = key.size(2);
  const int64_t row = KVH * D;
  TORCH_CHECK(k_cache.numel() % row == 0 && v_cache.numel() == k_cache.numel(),
              "write_kv: cache shape");
  auto rowwise = [&](torch::Tensor x) {
    return (x.stride(2) == 1 && x.stride(1) == D) ? x : x.contiguous();
  };
  key = rowwise(key);
  value = rowwise(value);
  slots = slots.contiguous();
  const int64_t n = slots.size(0), num_slots = k_cache.numel() / row;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sl[t] < num_slots, "write_kv: slot ", sl[t], " past the cache");
  const int64_t bytes = row * static_cast<int64_t>(key.element_size());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sl[t] < 0) continue;
      std::memcpy(kc + sl[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sl[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// silu(gate) * up for x = [gate | up] [rows, 2n] in float32 or bfloat16, with PyTorch's
// roundings: silu in float32 (x / (1 + exp(-x))) rounded to T, then the product in float32
// rounded. One pass over x instead of torch's two (silu, then the multiply) and no
// intermediate tensor. The exponential is a polynomial (relative error ~2e-7, torch's SLEEF
// one is within 1 ulp): float32 results within an ulp or two of torch's; in bfloat16 a silu
// that lands within that of a rounding boundary may round the other way (none in 3.1M random
// values here).
template <typename T>
void silu_and_mul_rows(const T* xs, T* os, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xs + r * 2 * n;
      const T* u = g + n;
      T* o = os + r * n;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; j + 16 <= n; j += 16) {
        const __m512 gv = ld16(g + j);
        // exp(-g): g > 87 gives ~0 (silu = g); -g in (87, 88.72] exp(-g / 2) squared (2^n
        // of exp512 would overflow), past float32's range infinity, as torch's exponential
        // (silu = -0 there)
        const __m512 ng = _mm512_sub_ps(_mm512_setzero_ps(), gv);
        __m512 e = exp512(_mm512_min_ps(ng, _mm512_set1_ps(87.f)));
        const __mmask16 big = _mm512_cmp_ps_mask(ng, _mm512_set1_ps(87.f), _CMP_GT_OQ);
        if (big) {
          const __m512 h = exp512(_mm512_mul_ps(_mm512_min_ps(ng, _mm512_set1_ps(88.7228394f)),
                                                _mm512_set1_ps(0.5f)));
          e = _mm512_mask_blend_ps(big, e, _mm512_mul_ps(h, h));
          e = _mm512_mask_blend_ps(
              _mm512_cmp_ps_mask(ng, _mm512_set1_ps(88.7228394f), _CMP_GT_OQ), e,
              _mm512_set1_ps(std::numeric_limits<float>::infinity()));
        }
        const __m512 silu = rnd16<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
        st16(o + j, _mm512_mul_ps(silu, ld16(u + j)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {  // the same steps, 8 lanes (float32 only)
        const __m256 one = _mm256_set1_ps(1.f);
        for (; j + 8 <= n; j += 8) {
          const __m256 gv = _mm256_loadu_ps(g + j);
          const __m256 ng = _mm256_sub_ps(_mm256_setzero_ps(), gv);
          __m256 e = exp256(_mm256_min_ps(ng, _mm256_set1_ps(87.f)));
          const __m256 big = _mm256_cmp_ps(ng, _mm256_set1_ps(87.f), _CMP_GT_OQ);
          if (_mm256_movemask_ps(big)) {
            const __m256 h = exp256(_mm256_mul_ps(_mm256_min_ps(ng, _mm256_set1_ps(88.7228394f)),
                                                  _mm256_set1_ps(0.5f)));
            e = _mm256_blendv_ps(e, _mm256_mul_ps(h, h), big);
            e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                                 _mm256_cmp_ps(ng, _mm256_set1_ps(88.7228394f), _CMP_GT_OQ));
          }
          const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
        }
      }
#endif
      for (; j < n; ++j) {
        const float gv = tof(g[j]);
        o[j] = fromf<T>(tof(fromf<T>(gv / (1.f + std::exp(-gv)))) * tof(u[j]));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && x.size(-1) % 2 == 0,
              "silu_and_mul: float32 or bfloat16 [..., 2n]");
  const int64_t n = x.size(-1) / 2;
  auto xc = x.contiguous().view({-1, 2 * n});
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = torch::empty(shape, x.options());
  if (dt == at::kFloat) {
    silu_and_mul_rows<float>(xc.data_ptr<float>(), out.data_ptr<float>(), xc.size(0), n);
  } else {
    silu_and_mul_rows<at::BFloat16>(xc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                                    xc.size(0), n);
  }
  return out;
}

// Whether float32's silu-and-mul runs vectorized here (AVX-512 with BF16, or AVX2 + FMA):
// float32 callers take it only then (its scalar loop is slower than PyTorch's ops; the norm's
// one scalar pass is not, and runs everywhere: ops/cpu/__init__.py).
#if defined(__AVX2__) && defined(__FMA__)
bool small_ops_vectorized() { return true; }
#else
bool small_ops_vectorized() { return kAvx512Bf16; }
#endif

// ---------------------------------------------------------------- prefill attention
// The prefill chunks of a step (several query tokens of one request) over the request's keys
// as they lie in the paged cache, their own new keys included (written before the call):
// causal, and within the window when one is given. On a CPU with AVX512-BF16, head sizes up
// to 128: bfloat16 (D a multiple of 32) by AMX tile products where the CPU has AMX, VDPBF16PS
// (32 products an instruction) elsewhere; float32 (D a multiple of 16) by AVX-512 FMAs, the
// same plan in float32 (prefill_group_f32). Elsewhere the caller keeps torch's SDPA.
//
// Per (request, KV head), once: the keys laid out for S = Q K^T (Kt: per 16 keys, 16 x D / 32
// rows of one dim pair of the 16 keys - a 32-bit transpose) and the values for O = P V (Vv:
// per 32 keys and 16 dims, 16 rows of one key pair's 16 dims, the pair side by side). Every
// query head of the KV head and every group of 16 queries reads them. A row of either is what
// one VDPBF16PS takes beside one broadcast pair (a query's two dims, or two keys' weights) and
// what a tile product takes as its B operand (16 rows of 64 bytes).
// Per (request, query head, group of 16 queries): S [16, keys], the softmax of each row over
// all its keys at once (the scores are kept, 64 bytes a key: no online rescale), P rounded to
// bfloat16, O [16, D] accumulated over every 32 keys in float32, then divided by the sum.
// Keys the rows read: positions [klo, pos_last], klo the window's start for the group's first
// row rounded down to 32 (the packs start at such a multiple too); a key past a row's
// position, or before its window, is masked. Example: a chunk of 40 queries at positions
// 100..139 (context 100), window 0: groups 0, 1, 2 hold positions 100..115, 116..131,
// 132..139; group 2 reads keys 0..139 (ns = 160 score columns, the last 20 masked for all).
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {

// The cache row (all D dims) of position `pos` of a request for KV head `kvh`.
template <typename T>
inline const T* kv_row(const T* cache, const int32_t* table, int64_t pos, int64_t bs,
                       int64_t KVH, int64_t kvh, int64_t D) {
  const int64_t slot = static_cast<int64_t>(table[pos / bs]) * bs + pos % bs;
  return cache + (slot * KVH + kvh) * D;
}

alignas(64) const float kZeroRow[128] = {};  // a row of zeros (D <= 128), either dtype
template <typename T = at::BFloat16>
inline const T* zero_row() {
  return reinterpret_cast<const T*>(kZeroRow);
}
inline __m512i iota16() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// Kt for keys [k0, k0 + nk) (nk a multiple of 32; keys at or past `len` as zeros): the keys'
// 32-bit words transposed, 16 keys at a time - kt[j][w][n] = word w of key k0 + 16 j + n, W =
// D sizeof(T) / 4 words a key. bfloat16: word w is the dim pair (2 w, 2 w + 1), and a tile
// product's B for dims 32 c .. 32 c + 31 is rows 16 c .. 16 c + 15 (D 64 -> 32 rows a j);
// float32: word w is dim w (D rows a j).
template <typename T>
inline void pack_keys(const T* kc, const int32_t* table, int64_t k0, int64_t nk, int64_t len,
                      int64_t bs, int64_t KVH, int64_t kvh, int64_t D, uint32_t* kt) {
  const int64_t W = D * static_cast<int64_t>(sizeof(T)) / 4;  // 32-bit words a key
  alignas(64) uint32_t tmp[16 * 128];
  for (int64_t j = 0; j < nk / 16; ++j) {
    const int64_t first = k0 + 16 * j;
    const int32_t* src;
    int64_t row;  // words from one key to the next
    if (bs % 16 == 0 && first + 16 <= len) {  // 16 keys of one block: read in place
      src = reinterpret_cast<const int32_t*>(kv_row(kc, table, first, bs, KVH, kvh, D));
      row = KVH * W;
    } else {
      for (int64_t n = 0; n < 16; ++n) {
        const T* key = first + n < len ? kv_row(kc, table, first + n, bs, KVH, kvh, D)
                                       : zero_row<T>();
        std::memcpy(tmp + n * W, key, W * 4);
      }
      src = reinterpret_cast<const int32_t*>(tmp);
      row = W;
    }
    const __m512i rows = _mm512_mullo_epi32(iota16(), _mm512_set1_epi32(static_cast<int>(row)));
    uint32_t* dst = kt + j * 16 * W;
    for (int64_t w = 0; w < W; ++w)
      _mm512_storeu_si512(dst + w * 16, _mm512_i32gather_epi32(
          _mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(w))), src, 4));
  }
}

// Vv for keys [k0, k0 + nk): vv[t][g][p][n][i] = dim 16 g + n of key k0 + 32 t + 2 p + i
// (512 values a (t, g)).
inline void pack_values(const at::BFloat16* vc, const int32_t* table, int64_t k0, int64_t nk,
                        int64_t len, int64_t bs, int64_t KVH, int64_t kvh, int64_t D,
                        at::BFloat16* vv) {
  const int64_t DG = D / 16;
  alignas(64) static const uint16_t lo_i[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_i[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_i), hi = _mm512_load_si512(hi_i);
  for (int64_t t = 0; t < nk / 32; ++t)
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t a = k0 + 32 * t + 2 * p;
      const at::BFloat16* ra = a < len ? kv_row(vc, table, a, bs, KVH, kvh, D) : zero_row();
      const at::BFloat16* rb =
          a + 1 < len ? kv_row(vc, table, a + 1, bs, KVH, kvh, D) : zero_row();
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i x = _mm512_loadu_si512(ra + c), y = _mm512_loadu_si512(rb + c);
        at::BFloat16* d0 = vv + ((t * DG + c / 16) * 16 + p) * 32;
        _mm512_storeu_si512(d0, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(d0 + 16 * 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
}

// The group's geometry: its first key klo and its score columns ns (a multiple of 32).
struct GroupKeys {
  int64_t klo, ns;
};
inline GroupKeys group_keys(int64_t nq, int64_t pos0, int64_t k0, int64_t window) {
  int64_t klo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  klo = k0 + (klo - k0) / 32 * 32;
  return {klo, (pos0 + nq - klo + 31) / 32 * 32};
}

// Rows i < nq of s [16, ns] (raw scores of keys klo ..) to P (bfloat16 or float32, 0 where
// masked); inv[i] = 1 / the row's sum. Rows past nq: P zeros.
template <typename P>
inline void softmax_rows(float* s, P* pb, float* inv, int64_t nq, int64_t pos0, GroupKeys gk,
                         float scale, int64_t window) {
  const int64_t ns = gk.ns;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < 16; ++i) {
    float* si = s + i * ns;
    P* pi = pb + i * ns;  // may be si itself (float32: P over the scores in place)
    if (i >= nq) {
      std::memset(pi, 0, ns * sizeof(P));
      inv[i] = 0.f;
      continue;
    }
    const int64_t pos = pos0 + i;  // visible: offsets first .. last from klo
    const __m512i last = _mm512_set1_epi32(static_cast<int>(pos - gk.klo));
    const __m512i first = _mm512_set1_epi32(static_cast<int>(
        window > 0 ? pos - window + 1 - gk.klo : std::numeric_limits<int>::min()));
    __m512 mx = ninf;
    for (int64_t x = 0; x < ns; x += 16) {
      const __m512i off = _mm512_add_epi32(iota16(), _mm512_set1_epi32(static_cast<int>(x)));
      const __mmask16 ok =
          _mm512_cmple_epi32_mask(off, last) & _mm512_cmpge_epi32_mask(off, first);
      const __m512 v =
          _mm512_mask_blend_ps(ok, ninf, _mm512_mul_ps(_mm512_loadu_ps(si + x), vs));
      _mm512_storeu_ps(si + x, v);
      mx = _mm512_max_ps(mx, v);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t x = 0; x < ns; x += 32) {
      const __m512 a = _mm512_loadu_ps(si + x), b = _mm512_loadu_ps(si + x + 16);
      // exp512 clamps its argument at -87: the masked lanes are zeroed instead
      const __m512 pa = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, ninf, _CMP_NEQ_OQ),
                                            exp512(_mm512_sub_ps(a, m)));
      const __m512 pv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, ninf, _CMP_NEQ_OQ),
                                            exp512(_mm512_sub_ps(b, m)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(pa, pv));
      if constexpr (std::is_same_v<P, float>) {
        _mm512_storeu_ps(pi + x, pa);
        _mm512_storeu_ps(pi + x + 16, pv);
      } else {
        _mm512_storeu_si512(pi + x, (__m512i)_mm512_cvtne2ps_pbh(pv, pa));
      }
    }
    inv[i] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// The rows' outputs: out row i = o row i * inv[i] (rounded to bfloat16 for a bfloat16 out).
template <typename T>
inline void store_rows(const float* o, const float* inv, T* out, int64_t out_stride, int64_t nq,
                       int64_t D) {
  for (int64_t i = 0; i < nq; ++i) {
    const __m512 r = _mm512_set1_ps(inv[i]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), r);
      if constexpr (std::is_same_v<T, float>)
        _mm512_storeu_ps(out + i * out_stride + d, v);
      else
        store_bf16(out + i * out_stride + d, v);
    }
  }
}

// float32: Vv for keys [k0, k0 + nk), their rows side by side (vv[k][d]; zeros past `len`).
inline void pack_values_f32(const float* vc, const int32_t* table, int64_t k0, int64_t nk,
                            int64_t len, int64_t bs, int64_t KVH, int64_t kvh, int64_t D,
                            float* vv) {
  for (int64_t k = 0; k < nk; ++k)
    std::memcpy(vv + k * D,
                k0 + k < len ? kv_row(vc, table, k0 + k, bs, KVH, kvh, D) : zero_row<float>(),
                D * 4);
}

// O rows [0, nr) (of 4), dims 16 g0 .. 16 (g0 + NG) - 1: o[r] = sum over keys k of p[r][k] v_k,
// p the rows' weights (ns a row). NG a constant, so the 4 NG accumulators stay in registers
// (with a run-time group count they went to the stack, and prefill ran much slower, most in
// float32: cpu_kernel_ab.py --op prefill).
template <int NG>
inline void pv_f32(const float* p, int64_t ns, const float* v0, int64_t D, int64_t g0,
                   int64_t nr, float* o) {
  __m512 acc[4][NG];
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t k = 0; k < ns; ++k) {
    __m512 v[NG];
    for (int g = 0; g < NG; ++g) v[g] = _mm512_loadu_ps(v0 + k * D + (g0 + g) * 16);
    for (int r = 0; r < 4; ++r) {
      const __m512 pw = _mm512_set1_ps(p[r * ns + k]);
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_fmadd_ps(pw, v[g], acc[r][g]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(o + r * D + (g0 + g) * 16, acc[r][g]);
}

// float32, AVX-512 FMAs. S: 8 queries x 32 keys a step, a query's dim (broadcast) times a Kt
// row. P over the scores in place. O: 4 queries x 64 dims a step, a key's weight (broadcast)
// times the key's value row.
inline void prefill_group_f32(const float* qbuf, int64_t nq, int64_t pos0, int64_t k0,
                              const float* kt, const float* vv, int64_t D, float scale,
                              int64_t window, float* s, float* obuf, float* inv) {
  const GroupKeys gk = group_keys(nq, pos0, k0, window);
  const int64_t ns = gk.ns, DG = D / 16;
  const float* kt0 = kt + (gk.klo - k0) * D;  // 16 D values per 16 keys
  for (int64_t i = 0; i < nq; i += 8) {  // (qbuf's rows past nq are zeros)
    const int64_t nr = std::min<int64_t>(8, nq - i);
    for (int64_t j = 0; j < ns / 16; j += 2) {
      const float* ka = kt0 + j * 16 * D;
      const float* kb = ka + 16 * D;
      __m512 acc[8][2];
      for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 x = _mm512_loadu_ps(ka + d * 16), y = _mm512_loadu_ps(kb + d * 16);
        for (int r = 0; r < 8; ++r) {
          const __m512 qb = _mm512_set1_ps(qbuf[(i + r) * D + d]);
          acc[r][0] = _mm512_fmadd_ps(qb, x, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(qb, y, acc[r][1]);
        }
      }
      for (int r = 0; r < nr; ++r) {
        _mm512_storeu_ps(s + (i + r) * ns + j * 16, acc[r][0]);
        _mm512_storeu_ps(s + (i + r) * ns + j * 16 + 16, acc[r][1]);
      }
    }
  }
  softmax_rows(s, s, inv, nq, pos0, gk, scale, window);
  const float* v0 = vv + (gk.klo - k0) * D;
  for (int64_t i = 0; i < nq; i += 4) {
    const int64_t nr = std::min<int64_t>(4, nq - i);
    int64_t g0 = 0;
    for (; g0 + 4 <= DG; g0 += 4) pv_f32<4>(s + i * ns, ns, v0, D, g0, nr, obuf + i * D);
    for (; g0 + 2 <= DG; g0 += 2) pv_f32<2>(s + i * ns, ns, v0, D, g0, nr, obuf + i * D);
    for (; g0 < DG; ++g0) pv_f32<1>(s + i * ns, ns, v0, D, g0, nr, obuf + i * D);
  }
}

// 32 bfloat16 values in a 512-bit register as VDPBF16PS's operand type
inline __m512bh bh(__m512i x) { return (__m512bh)x; }

// pv_f32 for bfloat16 P and Vv (VDPBF16PS: a key pair of P broadcast times a Vv row); p32
// the rows' weights as key pairs (ns / 2 a row).
template <int NG>
inline void pv_bf16(const int32_t* p32, int64_t ns, const at::BFloat16* vt0, int64_t DG,
                    int64_t g0, int64_t D, int64_t nr, float* o) {
  __m512 acc[4][NG];
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ns / 32; ++t)
    for (int64_t p = 0; p < 16; ++p) {
      __m512i v[NG];
      for (int g = 0; g < NG; ++g)
        v[g] = _mm512_loadu_si512(vt0 + ((t * DG + g0 + g) * 16 + p) * 32);
      for (int r = 0; r < 4; ++r) {
        const __m512i pw = _mm512_set1_epi32(p32[r * (ns / 2) + t * 16 + p]);
        for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], bh(pw), bh(v[g]));
      }
    }
  for (int r = 0; r < nr; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(o + r * D + (g0 + g) * 16, acc[r][g]);
}

// The VDPBF16PS path. S: 8 queries x 32 keys a step (16 accumulators), each instruction a
// query's dim pair (broadcast) times a Kt row. O: 4 queries x 64 dims a step (16
// accumulators), each instruction a query's key pair of P (broadcast) times a Vv row.
inline void prefill_group_avx(const at::BFloat16* qbuf, int64_t nq, int64_t pos0, int64_t k0,
                              const uint32_t* kt, const at::BFloat16* vv, int64_t D,
                              float scale, int64_t window, float* s, at::BFloat16* pb,
                              float* obuf, float* inv) {
  const GroupKeys gk = group_keys(nq, pos0, k0, window);
  const int64_t ns = gk.ns, half = D / 2, DG = D / 16;
  const auto* q32 = reinterpret_cast<const int32_t*>(qbuf);  // [16][half]
  const uint32_t* kt0 = kt + (gk.klo - k0) / 16 * 8 * D;
  for (int64_t i = 0; i < nq; i += 8) {
    const int64_t nr = std::min<int64_t>(8, nq - i);
    for (int64_t j = 0; j < ns / 16; j += 2) {
      const uint32_t* ka = kt0 + j * 8 * D;
      const uint32_t* kb = ka + 8 * D;
      __m512 acc[8][2];
      for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t p = 0; p < half; ++p) {
        const __m512i x = _mm512_loadu_si512(ka + p * 16), y = _mm512_loadu_si512(kb + p * 16);
        for (int r = 0; r < 8; ++r) {
          const __m512i qb = _mm512_set1_epi32(q32[(i + r) * half + p]);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], bh(qb), bh(x));
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], bh(qb), bh(y));
        }
      }
      for (int r = 0; r < nr; ++r) {
        _mm512_storeu_ps(s + (i + r) * ns + j * 16, acc[r][0]);
        _mm512_storeu_ps(s + (i + r) * ns + j * 16 + 16, acc[r][1]);
      }
    }
  }
  softmax_rows(s, pb, inv, nq, pos0, gk, scale, window);
  const at::BFloat16* vt0 = vv + (gk.klo - k0) / 32 * DG * 512;
  for (int64_t i = 0; i < nq; i += 4) {
    const int64_t nr = std::min<int64_t>(4, nq - i);
    const auto* p32 = reinterpret_cast<const int32_t*>(pb + i * ns);  // [rows][ns / 2]
    int64_t g0 = 0;  // (DG is even: D a multiple of 32)
    for (; g0 + 4 <= DG; g0 += 4) pv_bf16<4>(p32, ns, vt0, DG, g0, D, nr, obuf + i * D);
    for (; g0 < DG; g0 += 2) pv_bf16<2>(p32, ns, vt0, DG, g0, D, nr, obuf + i * D);
  }
}

#if defined(__AMX_BF16__) && defined(__linux__)
// The AMX path (tile configuration: tiles 0-7 all 16 rows of 64 bytes). S: Q in tiles 1..
// (32 dims each), 16 keys' Kt rows as B, scores in tile 0. O: 32 keys of P as A (tile 4), a
// Vv (t, g) as B, the 64 dims of a pass in tiles 0-3.
inline void prefill_group_amx(const at::BFloat16* qbuf, int64_t nq, int64_t pos0, int64_t k0,
                              const uint32_t* kt, const at::BFloat16* vv, int64_t D,
                              float scale, int64_t window, float* s, at::BFloat16* pb,
                              float* obuf, float* inv) {
  const GroupKeys gk = group_keys(nq, pos0, k0, window);
  const int64_t C = D / 32, DG = D / 16, ns = gk.ns;
  _tile_loadd(1, qbuf, D * 2);
  if (C > 1) _tile_loadd(2, qbuf + 32, D * 2);
  if (C > 2) _tile_loadd(3, qbuf + 64, D * 2);
  if (C > 3) _tile_loadd(4, qbuf + 96, D * 2);
  const uint32_t* ktb = kt + (gk.klo - k0) / 16 * 8 * D;  // 8 D pairs per 16 keys
  for (int64_t j = 0; j < ns / 16; ++j, ktb += 8 * D) {
    _tile_zero(0);
    _tile_loadd(5, ktb, 64);
    _tile_dpbf16ps(0, 1, 5);
    if (C > 1) {
      _tile_loadd(6, ktb + 256, 64);
      _tile_dpbf16ps(0, 2, 6);
    }
    if (C > 2) {
      _tile_loadd(5, ktb + 512, 64);
      _tile_dpbf16ps(0, 3, 5);
    }
    if (C > 3) {
      _tile_loadd(6, ktb + 768, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, s + j * 16, ns * 4);
  }
  softmax_rows(s, pb, inv, nq, pos0, gk, scale, window);
  const at::BFloat16* vt0 = vv + (gk.klo - k0) / 32 * DG * 512;
  for (int64_t g0 = 0; g0 < DG; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, DG - g0);
    _tile_zero(0);
    if (ng > 1) _tile_zero(1);
    if (ng > 2) _tile_zero(2);
    if (ng > 3) _tile_zero(3);
    for (int64_t t = 0; t < ns / 32; ++t) {
      const at::BFloat16* vb = vt0 + (t * DG + g0) * 512;
      _tile_loadd(4, pb + t * 32, ns * 2);
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (ng > 1) {
        _tile_loadd(6, vb + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (ng > 2) {
        _tile_loadd(5, vb + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (ng > 3) {
        _tile_loadd(6, vb + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, obuf + g0 * 16, D * 4);
    if (ng > 1) _tile_stored(1, obuf + g0 * 16 + 16, D * 4);
    if (ng > 2) _tile_stored(2, obuf + g0 * 16 + 32, D * 4);
    if (ng > 3) _tile_stored(3, obuf + g0 * 16 + 48, D * 4);
  }
}
#endif

}  // namespace
#endif

// Prefill attention for the prefill rows of a step (see the section's header), written into
// `out` [T, H, D] (contiguous) at rows q_starts[r] .. q_starts[r] + q_lens[r] - 1; the key
// positions of request r are 0 .. seq_lens[r] - 1, its queries the last q_lens[r] of them.
// bfloat16 (D a multiple of 32) or float32 (D a multiple of 16), D <= 128. Returns false,
// writing nothing, where this build or CPU cannot (no AVX512-BF16; another dtype or D): the
// caller then attends with SDPA. allow_amx=false takes the VDPBF16PS path on a CPU with AMX
// too (tests, A/B runs).
bool paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor seq_lens,
                   torch::Tensor block_tables, double scale, int64_t window, torch::Tensor out,
                   bool allow_amx) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  const int64_t H = q.size(1), D = q.size(2);
  const auto dt = q.scalar_type();
  const bool f32 = dt == at::kFloat;
  if ((dt != at::kBFloat16 && !f32) || k_cache.scalar_type() != dt ||
      v_cache.scalar_type() != dt || D % (f32 ? 16 : 32) != 0 || D > 128)
    return false;
#if defined(__AMX_BF16__) && defined(__linux__)
  const bool amx = !f32 && allow_amx && amx_permitted();
#else
  (void)allow_amx;  // (no AMX in this build)
#endif
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "cache and out must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == dt, "bad out");
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && q_lens.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt,
              "q_starts int64; q_lens, seq_lens, block_tables int32");
  if (q.stride(2) != 1 || q.stride(1) != D) q = q.contiguous();
  q_starts = q_starts.contiguous();
  q_lens = q_lens.contiguous();
  seq_lens = seq_lens.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head shapes do not match");
  const int64_t G = H / KVH, esize = f32 ? 4 : 2;
  const int64_t R = q_starts.size(0), max_blocks = block_tables.size(1);
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int32_t* ql = q_lens.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // per request: the packs' first key and size, their offset (values of the dtype, Kt and Vv
  // alike: nk D a KV head), its first item of the second phase
  std::vector<int64_t> k0(R), nk(R), off(R + 1, 0), items(R + 1, 0);
  int64_t max_ns = 32;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ql[r] >= 1 && ql[r] <= sl[r] && (sl[r] + bs - 1) / bs <= max_blocks,
                "bad q_lens / seq_lens");
    TORCH_CHECK(qs[r] >= 0 && qs[r] + ql[r] <= q.size(0), "q_starts out of range");
    const int64_t ctx = sl[r] - ql[r];
    k0[r] = window > 0 ? std::max<int64_t>(0, ctx - window + 1) / 32 * 32 : 0;
    nk[r] = (sl[r] - k0[r] + 31) / 32 * 32;
    off[r + 1] = off[r] + KVH * nk[r] * D;
    items[r + 1] = items[r] + H * ((ql[r] + 15) / 16);
    max_ns = std::max(max_ns, nk[r]);
  }
  auto kt_buf = torch::empty({std::max<int64_t>(off[R], 1)}, q.options());
  auto vv_buf = torch::empty({std::max<int64_t>(off[R], 1)}, q.options());
  char* ktp = static_cast<char*>(kt_buf.data_ptr());
  char* vvp = static_cast<char*>(vv_buf.data_ptr());
  const void* kc = k_cache.data_ptr();
  const void* vc = v_cache.data_ptr();
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / KVH, h = i % KVH;
      const int32_t* table = tables + r * max_blocks;
      const int64_t o = (off[r] + h * nk[r] * D) * esize;  // bytes
      if (f32) {
        pack_keys(static_cast<const float*>(kc), table, k0[r], nk[r], sl[r], bs, KVH, h, D,
                  reinterpret_cast<uint32_t*>(ktp + o));
        pack_values_f32(static_cast<const float*>(vc), table, k0[r], nk[r], sl[r], bs, KVH, h,
                        D, reinterpret_cast<float*>(vvp + o));
      } else {
        pack_keys(static_cast<const at::BFloat16*>(kc), table, k0[r], nk[r], sl[r], bs, KVH, h,
                  D, reinterpret_cast<uint32_t*>(ktp + o));
        pack_values(static_cast<const at::BFloat16*>(vc), table, k0[r], nk[r], sl[r], bs, KVH,
                    h, D, reinterpret_cast<at::BFloat16*>(vvp + o));
      }
    }
  });
  const char* qd = static_cast<const char*>(q.data_ptr());
  char* od = static_cast<char*>(out.data_ptr());
  const int64_t q_stride = q.stride(0);
  // items (request, query head, group of 16), query heads outermost within a request
  at::parallel_for(0, items[R], 1, [&](int64_t begin, int64_t end) {
#if defined(__AMX_BF16__) && defined(__linux__)
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    if (amx) _tile_loadconfig(&cfg);
#endif
    std::vector<float> qbuf(16 * D), s(16 * max_ns), obuf(16 * D), inv(16);
    std::vector<at::BFloat16> pb(f32 ? 0 : 16 * max_ns);
    int64_t r = std::upper_bound(items.begin(), items.end(), begin) - items.begin() - 1;
    for (int64_t it = begin; it < end; ++it) {
      while (it >= items[r + 1]) ++r;
      const int64_t groups = (ql[r] + 15) / 16, local = it - items[r];
      const int64_t h = local / groups, g = local % groups;
      const int64_t row0 = qs[r] + 16 * g, nq = std::min<int64_t>(16, ql[r] - 16 * g);
      const int64_t pos0 = sl[r] - ql[r] + 16 * g;
      const int64_t o = (off[r] + (h / G) * nk[r] * D) * esize;  // bytes
      char* qb = reinterpret_cast<char*>(qbuf.data());
      for (int64_t i = 0; i < 16; ++i)  // the group's queries, zeros past nq
        std::memcpy(qb + i * D * esize,
                    i < nq ? qd + ((row0 + i) * q_stride + h * D) * esize
                           : reinterpret_cast<const char*>(kZeroRow),
                    D * esize);
      char* orow = od + (row0 * H + h) * D * esize;
      if (f32) {
        prefill_group_f32(qbuf.data(), nq, pos0, k0[r], reinterpret_cast<const float*>(ktp + o),
                          reinterpret_cast<const float*>(vvp + o), D, static_cast<float>(scale),
                          window, s.data(), obuf.data(), inv.data());
        store_rows(obuf.data(), inv.data(), reinterpret_cast<float*>(orow), H * D, nq, D);
        continue;
      }
      const auto* qh = reinterpret_cast<const at::BFloat16*>(qb);
      const auto* kth = reinterpret_cast<const uint32_t*>(ktp + o);
      const auto* vvh = reinterpret_cast<const at::BFloat16*>(vvp + o);
#if defined(__AMX_BF16__) && defined(__linux__)
      if (amx)
        prefill_group_amx(qh, nq, pos0, k0[r], kth, vvh, D, static_cast<float>(scale), window,
                          s.data(), pb.data(), obuf.data(), inv.data());
      else
#endif
        prefill_group_avx(qh, nq, pos0, k0[r], kth, vvh, D, static_cast<float>(scale), window,
                          s.data(), pb.data(), obuf.data(), inv.data());
      store_rows(obuf.data(), inv.data(), reinterpret_cast<at::BFloat16*>(orow), H * D, nq, D);
    }
#if defined(__AMX_BF16__) && defined(__linux__)
    if (amx) _tile_release();
#endif
  });
  return true;
#else
  return false;
#endif
}

// Whether bfloat16 decode attention takes the AMX path here (built for a CPU with AMX-BF16,
// and the kernel lets this process use the tiles).
bool amx_decode() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
  return amx_permitted();
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_decode", &amx_decode, "Whether bfloat16 decode attention uses AMX tiles here");
  m.def("write_kv", &write_kv, "New keys and values into their cache slots (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, float32 or bfloat16 (CPU)");
  m.def("small_ops_vectorized", &small_ops_vectorized, "Element-wise kernels vectorized here");
  m.def("rms_norm", &rms_norm, "RMSNorm (optionally of x + residual), float32 or bfloat16");
  m.def("rope", &rope, "Rotary embedding of [tokens, heads, D], float32 or bfloat16");
  m.def("paged_decode", &paged_decode, "Decode attention over the paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("allow_amx") = true,
        py::arg("kv_scale") = py::none());
  m.def("paged_prefill", &paged_prefill,
        "Prefill attention over the paged KV cache, bfloat16 (CPU); False where not built",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("q_starts"),
        py::arg("q_lens"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"),
        py::arg("window"), py::arg("out"), py::arg("allow_amx") = true);
  m.def("argmax_last", &argmax_last, "Index of each row's maximum, as torch.argmax(-1)");
}
