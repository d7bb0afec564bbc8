// The target's attention on the CPU: an ONNX Runtime custom op (mirror_sd.gqa.GroupQueryAttention) with the inputs,
// outputs and attributes of ONNX Runtime's GroupQueryAttention as the target graphs use them; runtime/cpu_attention.py
// compiles it and puts it in their place. The past and the present share one KV buffer, row b's new tokens go at
// positions seqlens_k[b] + 1 - S .. seqlens_k[b], each query attends causally to its row's keys up to its own
// position (within local_window_size where set), scores scaled, optionally soft-capped, then softmaxed.
//
// Why its own: the query heads that share a KV head read each key once, so a decode step's attention, bound by
// reading the KV, takes about 0.8x ONNX Runtime's time (docs/design.md: The target's attention on the CPU is the
// project's own kernel); and every query's result is computed the same way whatever the batch, the number of new
// tokens or the thread that runs it (its sums in one order), so that a window's position equals that position
// stepped alone bit for bit, and rows of several tokens after a past run at any batch.
//
// Three ops, by the KV's element (LoadOptions.kv_cache_precision): float32 (domain mirror_sd.gqa), float16
// (mirror_sd.f16: each new key and value rounded to nearest, ties to even) and uint8 (mirror_sd.ku8: each position's D
// values of a head as codes 0..255 between their minimum and maximum, the scale and the minimum after them as two
// float32, so a position takes D + 8 bytes). Keys and values are read back into float32 arithmetic: a decode step,
// bound by reading the KV, reads half or about a quarter of the bytes; scores and sums are float32 either way, and a
// position's stored bytes depend on its own key and value only.
#include <math.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

#include "ort_abi.h"

namespace {

const OrtApi* g_api = nullptr;

constexpr int kQueryBlock = 8;  // new tokens of one row a task takes (they share each transposed key block)

struct Attributes {
  int64_t heads = 0, kv_heads = 0, window = -1, rotary = 0;
  float scale = 0.f, softcap = 0.f;
};

struct Status {
  OrtStatus* status;
  ~Status() {
    if (status) ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(status);
  }
  bool ok() const { return status == nullptr; }
};

// x's first `rotary` values turned by position's angles (non-interleaved: value i pairs with i + rotary / 2)
inline void rotate(const float* x, float* out, int64_t head_dim, int64_t rotary, const float* cos, const float* sin) {
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i] + a * sin[i];
  }
  for (int64_t i = rotary; i < head_dim; ++i) out[i] = x[i];
}

// IEEE binary16, the float16 KV's element, as its bits: converted by F16C where the CPU has it, else in software (C++'s
// _Float16 would need GCC 12 on x86)
struct f16 {
  uint16_t bits;
};

inline float widen(f16 h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16, exponent = (h.bits >> 10) & 0x1fu;
  uint32_t mantissa = h.bits & 0x3ffu, bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;  // infinity, NaN
  } else if (exponent) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (!mantissa) {
    bits = sign;
  } else {  // subnormal: shifted up to a leading 1, the exponent lowered as far
    uint32_t e = 113;
    while (!(mantissa & 0x400u)) mantissa <<= 1, --e;
    bits = sign | e << 23 | (mantissa & 0x3ffu) << 13;
  }
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// x rounded to nearest, ties to even (numpy's float16 rounding); magnitudes from 65,520 up become infinite
inline f16 narrow(float x) {
#if defined(__F16C__)
  return {static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))};
#else
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t out;
  if (bits >= 143u << 23) {  // 2^16 and up, infinity, NaN
    out = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < 113u << 23) {  // below 2^-14: a subnormal, the float's own addition rounding it into place
    const uint32_t magic_bits = 126u << 23;
    float magic, y;
    memcpy(&magic, &magic_bits, sizeof magic);
    memcpy(&y, &bits, sizeof y);
    y += magic;
    memcpy(&out, &y, sizeof out);
    out -= magic_bits;
  } else {  // the exponent rebased, the mantissa rounded to its 10 bits (ties to even)
    out = (bits + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((bits >> 13) & 1u)) >> 13;
  }
  return {static_cast<uint16_t>(out | sign >> 16)};
#endif
}

template <typename T>
struct Step {
  Attributes attrs;
  int64_t batch, seq, head_dim, capacity;
  const float* q;  // [B, S, heads, D] after the rotary
  T *keys, *values;  // [B, kv_heads, capacity, row_of<T>(D)]
  const int32_t* seqlens;
  float* out;  // [B, S, heads, D]
  int64_t query_blocks;
  const float* kt = nullptr;  // keys transposed per 16 ([B, kv_heads, blocks, D, 16]) where several tasks read them
  int64_t kt_blocks = 0;
};

constexpr int kKeyBlock = 16;  // keys whose scores one pass computes: one AVX-512 register of them
constexpr int kQueries = 4;  // queries whose sums share each load of keys or values

// 16 floats as one value (one AVX-512 register): the loops below say which way they vectorise, where the compiler,
// keeping each sum's order, would otherwise sum across a register one lane at a time. Every operation is lane by lane,
// so a lane's arithmetic is the same whatever the register width.
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return v16{0} + x; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
constexpr int kScoreQueries = kQueries, kValueQueries = kQueries, kValueColumns = 4;  // 32 registers of 16 floats
#else
// Narrower registers (AVX2's 8 floats, SSE's and NEON's 4): 16 floats as that many registers' worth, spelt out, where
// GCC would move a 64-byte vector type through the stack a quarter or half at a time (docs/design.md, the kernel's
// record: AVX2).
// kLanes floats a register; kScoreQueries queries' scores share each load of 16 transposed keys, and a pass over the
// values sums kValueQueries queries' kValueColumns columns of 16: as many sums as the registers hold beside the loads
#if defined(__AVX__)
constexpr int kLanes = 8, kScoreQueries = 6, kValueQueries = 2, kValueColumns = 2;  // 16 registers
#elif defined(__aarch64__)
constexpr int kLanes = 4, kScoreQueries = 6, kValueQueries = 2, kValueColumns = 2;  // NEON's 32 registers
#else
constexpr int kLanes = 4, kScoreQueries = 4, kValueQueries = 4, kValueColumns = 1;  // SSE's 16 (smaller: no faster)
#endif
typedef float vn __attribute__((vector_size(kLanes * 4)));
typedef float vnu __attribute__((vector_size(kLanes * 4), aligned(4)));
struct v16 {
  vn part[16 / kLanes];
  float operator[](int i) const { return part[i / kLanes][i % kLanes]; }
  float& operator[](int i) { return reinterpret_cast<float*>(part)[i]; }
};
inline v16 load(const float* p) {
  v16 x;
  for (int c = 0; c < 16 / kLanes; ++c) x.part[c] = *reinterpret_cast<const vnu*>(p + c * kLanes);
  return x;
}
inline void store(float* p, v16 x) {
  for (int c = 0; c < 16 / kLanes; ++c) *reinterpret_cast<vnu*>(p + c * kLanes) = x.part[c];
}
inline v16 splat(float x) {
  v16 out;
  for (int c = 0; c < 16 / kLanes; ++c) out.part[c] = vn{0} + x;
  return out;
}
inline v16 operator+(v16 a, v16 b) {
  for (int c = 0; c < 16 / kLanes; ++c) a.part[c] += b.part[c];
  return a;
}
inline v16& operator+=(v16& a, v16 b) { return a = a + b; }
inline v16 operator*(v16 a, float x) {
  for (int c = 0; c < 16 / kLanes; ++c) a.part[c] *= x;
  return a;
}
inline v16 operator*(float x, v16 a) {
  for (int c = 0; c < 16 / kLanes; ++c) a.part[c] = x * a.part[c];
  return a;
}
inline v16 vmax(v16 a, v16 b) {
  for (int c = 0; c < 16 / kLanes; ++c) a.part[c] = a.part[c] > b.part[c] ? a.part[c] : b.part[c];
  return a;
}

#if defined(__AVX__) || defined(__SSE4_1__)
inline vn nearest(vn x) {
#if defined(__AVX__)
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return _mm_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}
inline vn times_power_of_two(vn p, vn n) {
  typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vn>(bits);
}
#endif
#endif

// nearbyintf (to nearest, ties to even), and p times 2^n for an integral n in [-126, 0] (its exponent field), as the
// narrower registers' vectors have them lane by lane above
inline float nearest(float x) { return nearbyintf(x); }
inline float times_power_of_two(float p, float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp(x) for x <= 0 in arithmetic the compiler vectorises: 2^n times a degree-6 polynomial on the remainder; F is
// float, or a vector of them whose every lane takes the same operations in the same order
template <typename F>
inline F exp_nonpositive(F x) {
  x = x < -87.0f ? F{} - 87.0f : x;
  const F n = nearest(x * 1.44269504088896341f);
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return times_power_of_two(p, n);
}

// exp_nonpositive(x - top) of 16 values: on the narrower registers a vector form per register (GCC vectorises the
// scalar loop over them on AVX-512, not on AVX2: there it called the scalar form a value at a time)
inline v16 exp_block(v16 x, float top) {
#if !defined(__AVX512F__) && (defined(__AVX__) || defined(__SSE4_1__))
  for (int c = 0; c < 16 / kLanes; ++c) x.part[c] = exp_nonpositive(x.part[c] - top);
#else
  for (int l = 0; l < 16; ++l) x[l] = exp_nonpositive(x[l] - top);
#endif
  return x;
}

inline v16 load(const f16* p) {  // 16 halves widened at once
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16 x;
  memcpy(&x, &lo, sizeof lo);
  memcpy(reinterpret_cast<char*>(&x) + sizeof lo, &hi, sizeof hi);
  return x;
#else
  v16 x;
  for (int i = 0; i < 16; ++i) x[i] = widen(p[i]);
  return x;
#endif
}

// the uint8 cache's element; a position's D codes are followed by kCodeTail bytes: its scale and minimum (float32)
struct u8code {
  uint8_t bits;
};
constexpr int64_t kCodeTail = 8;

// elements a position takes in a KV buffer of head size D
template <typename T>
constexpr int64_t row_of(int64_t D) {
  return D;
}
template <>
constexpr int64_t row_of<u8code>(int64_t D) {
  return D + kCodeTail;
}

// a position's scale and minimum (unused where the values are stored as themselves)
struct Dequant {
  float scale = 1.f, low = 0.f;
};
template <typename T>
inline Dequant dequant_of(const T*, int64_t) {
  return {};
}
inline Dequant dequant_of(const u8code* row, int64_t D) {
  Dequant q;
  memcpy(&q.scale, &row[D].bits, sizeof q.scale);
  memcpy(&q.low, &row[D].bits + sizeof q.scale, sizeof q.low);
  return q;
}

// value d of a position: a code is scaled back by one fused multiply-add, the same rounding in every loop below
// (whether the compiler would contract a * b + c is its choice per loop; a window's keys take another loop than a
// step's)
inline float value_at(const float* row, int64_t d, Dequant) { return row[d]; }
inline float value_at(const f16* row, int64_t d, Dequant) { return widen(row[d]); }
inline float value_at(const u8code* row, int64_t d, Dequant q) {
  return __builtin_fmaf(static_cast<float>(row[d].bits), q.scale, q.low);
}

inline v16 load(const u8code* p, Dequant q) {  // 16 values scaled back
#if defined(__AVX512F__)
  const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<v16>(_mm512_fmadd_ps(codes, _mm512_set1_ps(q.scale), _mm512_set1_ps(q.low)));
#elif defined(__AVX2__) && defined(__FMA__)
  v16 x;
  for (int c = 0; c < 2; ++c) {
    const __m256 codes =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c))));
    x.part[c] = _mm256_fmadd_ps(codes, _mm256_set1_ps(q.scale), _mm256_set1_ps(q.low));
  }
  return x;
#else
  v16 x;
  for (int i = 0; i < 16; ++i) x[i] = value_at(p, i, q);
  return x;
#endif
}
template <typename T>
inline v16 load(const T* p, Dequant) {
  return load(p);
}

// n <= 16 keys of D values into D x 16 (keys past n zero)
template <int kD>
inline void transpose(const float* keys, float* out, int64_t n, int64_t head_dim) {
  const int64_t D = kD ? kD : head_dim;
  for (int64_t j = 0; j < kKeyBlock; ++j)
    for (int64_t d = 0; d < D; ++d) out[d * kKeyBlock + j] = j < n ? keys[j * D + d] : 0.f;
}

// the same of float16 or uint8 keys, widened or scaled back 16 values at a time (value_at's rounding)
template <int kD, typename T>
inline void transpose(const T* keys, float* out, int64_t n, int64_t head_dim) {
  const int64_t D = kD ? kD : head_dim, row = row_of<T>(D);
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    const T* key = keys + j * row;
    const Dequant q = j < n ? dequant_of(key, D) : Dequant{};
    int64_t d = 0;
    if (j < n)
      for (; d + kKeyBlock <= D; d += kKeyBlock) {
        const v16 x = load(key + d, q);
        for (int l = 0; l < kKeyBlock; ++l) out[(d + l) * kKeyBlock + j] = x[l];
      }
    for (; d < D; ++d) out[d * kKeyBlock + j] = j < n ? value_at(key, d, q) : 0.f;
  }
}

// One task's queries against its keys, head size D (a compile-time constant where the kernel has one, so that the
// loops over it unroll into registers; 0: s.head_dim at run time). Scores of 16 keys at a time come from a transposed
// copy of their keys (D x 16: every query's d-th value times a row of it), so no sum runs across a register; each
// query's sums run over d, then over keys, in one order whatever the task holds.
template <int kD, typename T>
void attend_block(const Step<T>& s, int64_t b, int64_t kv, int64_t first, int64_t last) {
  const int64_t D = kD ? kD : s.head_dim, group = s.attrs.heads / s.attrs.kv_heads;
  const int64_t past = s.seqlens[b] + 1 - s.seq;
  const int64_t row = row_of<T>(D);
  const T* K = s.keys + (b * s.attrs.kv_heads + kv) * s.capacity * row;
  const T* V = s.values + (b * s.attrs.kv_heads + kv) * s.capacity * row;
  auto lo = [&](int64_t t) {
    return s.attrs.window > 0 ? std::max<int64_t>(0, past + t - s.attrs.window + 1) : int64_t{0};
  };
  auto hi = [&](int64_t t) { return std::min(past + t, s.capacity - 1); };  // the last key a token reads
  // key blocks start at multiples of 16 (a key's score is the same in any block)
  const int64_t begin = lo(first) / kKeyBlock * kKeyBlock, end = hi(last - 1) + 1;
  const int64_t width = (end - begin + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t queries = (last - first) * group;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(queries * width + D * kKeyBlock + D + queries));
  float* scores = scratch.data();
  float* kt = scores + queries * width;  // [D][16]
  float* o = kt + D * kKeyBlock;
  float* invs = o + D;  // each query's 1 / (sum of its weights)
  auto query = [&](int64_t q) {  // q = (t - first) * group + h
    const int64_t t = first + q / group, h = q % group;
    return s.q + ((b * s.seq + t) * s.attrs.heads + kv * group + h) * D;
  };
  for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, end - j0);
    const float* kb = kt;
    if (s.kt)
      kb = s.kt + ((b * s.attrs.kv_heads + kv) * s.kt_blocks + j0 / kKeyBlock) * D * kKeyBlock;
    else
      transpose<kD>(K + j0 * row, kt, n, D);
    // kScoreQueries queries at a time share each load of the transposed keys
    for (int64_t q0 = 0; q0 < queries; q0 += kScoreQueries) {
      const int64_t m = std::min<int64_t>(kScoreQueries, queries - q0);
      const int64_t t0 = first + q0 / group, t1 = first + (q0 + m - 1) / group;
      if (j0 > hi(t1) || j0 + kKeyBlock <= lo(t0)) continue;  // a block none of them reads
      const float* x[kScoreQueries];
      for (int i = 0; i < kScoreQueries; ++i) x[i] = query(q0 + std::min<int64_t>(i, m - 1));
      v16 acc[kScoreQueries];
      for (int i = 0; i < kScoreQueries; ++i) acc[i] = splat(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const v16 k = load(kb + d * kKeyBlock);
        for (int i = 0; i < kScoreQueries; ++i) acc[i] += x[i][d] * k;
      }
      for (int i = 0; i < m; ++i) store(scores + (q0 + i) * width + (j0 - begin), acc[i] * s.attrs.scale);
    }
  }
  for (int64_t q = 0; q < queries; ++q) {
    const int64_t t = first + q / group;
    float* row = scores + q * width - begin;  // row[j]: key j's score
    const int64_t a = lo(t), z = hi(t) + 1;
    if (a >= z) {  // a token past the buffer's end with a local window: no key to read
      invs[q] = 0.f;
      for (int64_t k = begin; k < end; ++k) row[k] = 0.f;
      continue;
    }
    if (s.attrs.softcap > 0)
      for (int64_t j = a; j < z; ++j) row[j] = s.attrs.softcap * tanhf(row[j] / s.attrs.softcap);
    // max and sum over 16 lanes (key j in lane (j - a) % 16), then across them: one order, vectorised
    float lanes[kKeyBlock];
    v16 most = splat(row[a]);
    int64_t j = a;
    for (; j + kKeyBlock <= z; j += kKeyBlock) {
      const v16 x = load(row + j);
      most = vmax(x, most);
    }
    store(lanes, most);
    for (int l = 0; j < z; ++j, ++l) lanes[l] = std::max(lanes[l], row[j]);
    float top = lanes[0];
    for (int l = 1; l < kKeyBlock; ++l) top = std::max(top, lanes[l]);
    v16 total = splat(0.f);
    for (j = a; j + kKeyBlock <= z; j += kKeyBlock) {
      store(row + j, exp_block(load(row + j), top));
      total += load(row + j);
    }
    store(lanes, total);
    for (int l = 0; j < z; ++j, ++l) {
      row[j] = exp_nonpositive(row[j] - top);
      lanes[l] += row[j];
    }
    for (int w = kKeyBlock / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    invs[q] = 1.f / lanes[0];
    // zero outside the query's keys within the task's range: a value times 0 adds nothing to a sum
    for (int64_t k = begin; k < a; ++k) row[k] = 0.f;
    for (int64_t k = z; k < end; ++k) row[k] = 0.f;
  }
  // values: each query's sum over its keys in key order, four queries at a time sharing each load of a value
  for (int64_t q0 = 0; q0 < queries; q0 += kQueries) {
    const int64_t m = std::min<int64_t>(kQueries, queries - q0);
    const int64_t t0 = first + q0 / group, t1 = first + (q0 + m - 1) / group;
    const int64_t a = lo(t0), z = hi(t1) + 1;
    const float* p[kQueries];
    for (int i = 0; i < kQueries; ++i) p[i] = scores + (q0 + std::min<int64_t>(i, m - 1)) * width - begin;
    if constexpr (kD > 0 && kD % kKeyBlock == 0 && kD <= 64) {  // the sums in registers
      constexpr int n = kD / kKeyBlock;
      // a pass over the keys: kValueQueries queries' sums of kValueColumns columns of 16
      constexpr int per_pass = kValueQueries, cols = std::min(kValueColumns, n);
      static_assert(kQueries % per_pass == 0 && n % cols == 0, "passes cover every query and column");
      for (int i0 = 0; i0 < m; i0 += per_pass)
        for (int c0 = 0; c0 < n; c0 += cols) {
          v16 acc[per_pass][cols];
          for (int i = 0; i < per_pass; ++i)
            for (int c = 0; c < cols; ++c) acc[i][c] = splat(0.f);
          for (int64_t k = a; k < z; ++k) {
            const T* v = V + k * row;
            const Dequant dq = dequant_of(v, kD);
            for (int c = 0; c < cols; ++c) {
              const v16 x = load(v + (c0 + c) * kKeyBlock, dq);
              for (int i = 0; i < per_pass; ++i) acc[i][c] += p[i0 + i][k] * x;
            }
          }
          for (int i = i0; i < std::min(m, static_cast<int64_t>(i0 + per_pass)); ++i) {
            const int64_t q = q0 + i, t = first + q / group, h = q % group;
            float* out = s.out + ((b * s.seq + t) * s.attrs.heads + kv * group + h) * D;
            for (int c = 0; c < cols; ++c) store(out + (c0 + c) * kKeyBlock, acc[i - i0][c] * invs[q]);
          }
        }
    } else {
      for (int i = 0; i < m; ++i) {
        const int64_t q = q0 + i, t = first + q / group, h = q % group;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        for (int64_t k = a; k < z; ++k) {
          const float w = p[i][k];
          const T* v = V + k * row;
          const Dequant dq = dequant_of(v, D);
          for (int64_t d = 0; d < D; ++d) o[d] += w * value_at(v, d, dq);
        }
        float* out = s.out + ((b * s.seq + t) * s.attrs.heads + kv * group + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = o[d] * invs[q];
      }
    }
  }
}

// task: one (row, KV head, block of 16 keys) of the keys all query blocks read
template <typename T>
void transpose_task(void* data, size_t task) {
  Step<T>& s = *static_cast<Step<T>*>(data);
  const int64_t block = static_cast<int64_t>(task) % s.kt_blocks, bk = static_cast<int64_t>(task) / s.kt_blocks;
  const int64_t D = s.head_dim, j0 = block * kKeyBlock, b = bk / s.attrs.kv_heads;
  const int64_t n = std::min<int64_t>(kKeyBlock, std::min<int64_t>(s.seqlens[b] + 1, s.capacity) - j0);
  float* out = const_cast<float*>(s.kt) + (bk * s.kt_blocks + block) * D * kKeyBlock;
  if (n <= 0) return;  // past the row's keys: never read
  const T* keys = s.keys + (bk * s.capacity + j0) * row_of<T>(D);
  switch (D) {
    case 64: return transpose<64>(keys, out, n, D);
    case 128: return transpose<128>(keys, out, n, D);
    default: return transpose<0>(keys, out, n, D);
  }
}

template <typename T>
void attend(void* data, size_t task) {
  const Step<T>& s = *static_cast<const Step<T>*>(data);
  const int64_t block = static_cast<int64_t>(task) % s.query_blocks;
  const int64_t kv = static_cast<int64_t>(task) / s.query_blocks % s.attrs.kv_heads;
  const int64_t b = static_cast<int64_t>(task) / s.query_blocks / s.attrs.kv_heads;
  const int64_t first = block * kQueryBlock, last = std::min(s.seq, first + kQueryBlock);
  if (s.seqlens[b] + 1 < s.seq) {  // fewer positions than new tokens (the target's graphs never feed it): zeros
    const int64_t group = s.attrs.heads / s.attrs.kv_heads;
    for (int64_t t = first; t < last; ++t)
      memset(s.out + ((b * s.seq + t) * s.attrs.heads + kv * group) * s.head_dim, 0,
             sizeof(float) * static_cast<size_t>(group * s.head_dim));
    return;
  }
  switch (s.head_dim) {
    case 64: return attend_block<64, T>(s, b, kv, first, last);
    case 128: return attend_block<128, T>(s, b, kv, first, last);
    default: return attend_block<0, T>(s, b, kv, first, last);
  }
}

struct Kernel {
  Attributes attrs;
};

std::vector<int64_t> shape_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  std::vector<int64_t> dims;
  Status st{ort::at<ort::GetTensorTypeAndShapeFn>(g_api, ort::kGetTensorTypeAndShape)(value, &info)};
  if (!st.ok()) return dims;
  size_t n = 0;
  Status sc{ort::at<ort::GetDimensionsCountFn>(g_api, ort::kGetDimensionsCount)(info, &n)};
  dims.resize(n);
  Status sd{ort::at<ort::GetDimensionsFn>(g_api, ort::kGetDimensions)(info, dims.data(), n)};
  ort::at<ort::ReleaseTypeAndShapeFn>(g_api, ort::kReleaseTensorTypeAndShapeInfo)(info);
  return dims;
}

template <typename T>
T* data_of(const OrtValue* value) {
  void* p = nullptr;
  Status st{ort::at<ort::GetTensorMutableDataFn>(g_api, ort::kGetTensorMutableData)(const_cast<OrtValue*>(value), &p)};
  return static_cast<T*>(p);
}

const OrtValue* input(OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  size_t count = 0;
  Status sc{ort::at<ort::KernelContextGetCountFn>(g_api, ort::kKernelContextGetInputCount)(context, &count)};
  if (index >= count) return nullptr;
  Status st{ort::at<ort::KernelContextGetInputFn>(g_api, ort::kKernelContextGetInput)(context, index, &value)};
  return value;
}

template <typename T = float>
T* output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  Status st{ort::at<ort::KernelContextGetOutputFn>(g_api, ort::kKernelContextGetOutput)(context, index, shape.data(),
                                                                                          shape.size(), &value)};
  return value ? data_of<T>(value) : nullptr;
}

// a rotated key (or a value) of D floats into the KV's element type
inline void put(const float* x, float* out, int64_t D) { memcpy(out, x, sizeof(float) * D); }
inline void put(const float* x, f16* out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] = narrow(x[d]);
}
// codes 0..255 between the values' minimum and maximum, rounded to nearest (ties to even), then the scale and the
// minimum; equal values take a scale of 0 (each read back as the minimum itself), a NaN among them a NaN minimum (the
// position read back as NaNs, as a float cache passes a NaN on); a zero minimum or maximum is +0 (the bytes
// runtime/kv_codes.py writes)
inline void put(const float* x, u8code* out, int64_t D) {
  float low = x[0], high = x[0];
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) low = std::min(low, x[d]), high = std::max(high, x[d]), nan |= x[d] != x[d];
  if (nan) low = high = NAN;
  low += 0.f, high += 0.f;
  const float scale = (high - low) / 255.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t d = 0; d < D; ++d)
    out[d].bits = static_cast<uint8_t>(std::min(255.f, std::max(0.f, nearbyintf((x[d] - low) * inverse))));
  memcpy(&out[D].bits, &scale, sizeof scale);
  memcpy(&out[D].bits + sizeof scale, &low, sizeof low);
}

// fn(data, 0 .. tasks - 1) on ONNX Runtime's threads (here, where the session has no pool)
void parallel(OrtKernelContext* context, void (*fn)(void*, size_t), size_t tasks, void* data) {
  OrtStatus* st = ort::at<ort::ParallelForFn>(g_api, ort::kKernelContextParallelFor)(context, fn, tasks, tasks, data);
  if (st) {
    ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
    for (size_t i = 0; i < tasks; ++i) fn(data, i);
  }
}

template <typename T>
void compute(void* kernel, OrtKernelContext* context) {
  Attributes a = static_cast<Kernel*>(kernel)->attrs;
  const OrtValue *query = input(context, 0), *key = input(context, 1), *value = input(context, 2);
  const OrtValue *past_key = input(context, 3), *past_value = input(context, 4), *seqlens = input(context, 5);
  const OrtValue *cos = input(context, 7), *sin = input(context, 8);
  const std::vector<int64_t> qshape = shape_of(query), kvshape = shape_of(past_key);
  // a uint8 cache's positions hold kCodeTail bytes after their D codes
  const int64_t B = qshape[0], S = qshape[1], D = kvshape[3] - row_of<T>(0), capacity = kvshape[2];
  const int64_t row = row_of<T>(D);
  const int64_t H = a.heads, KV = a.kv_heads;
  if (a.scale == 0.f) a.scale = 1.f / sqrtf(static_cast<float>(D));  // GroupQueryAttention's default
  const std::vector<int64_t> angles_shape = a.rotary && cos ? shape_of(cos) : std::vector<int64_t>{0, 0};
  const int64_t rotary = 2 * angles_shape[1];  // [positions, rotary / 2]

  float* out = output(context, 0, {B, S, H * D});
  T* keys = output<T>(context, 1, kvshape);
  T* values = output<T>(context, 2, kvshape);
  const T *pk = data_of<T>(past_key), *pv = data_of<T>(past_value);
  const size_t bytes = sizeof(T) * static_cast<size_t>(B * KV * capacity * row);
  if (keys != pk) memcpy(keys, pk, bytes);  // present bound apart from past: the past is carried over first
  if (values != pv) memcpy(values, pv, bytes);
  const int32_t* lengths = data_of<int32_t>(seqlens);
  const float* q_in = data_of<float>(query);
  const bool packed = key == nullptr;
  const float* k_in = packed ? q_in + H * D : data_of<float>(key);
  const float* v_in = packed ? q_in + (H + KV) * D : data_of<float>(value);
  const int64_t q_stride = packed ? (H + 2 * KV) * D : H * D, kv_stride = packed ? q_stride : KV * D;
  const float *cos_cache = rotary ? data_of<float>(cos) : nullptr, *sin_cache = rotary ? data_of<float>(sin) : nullptr;
  const int64_t half = rotary / 2, angles = angles_shape[0];

  std::vector<float> q(static_cast<size_t>(B * S * H * D)), turned(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t past = lengths[b] + 1 - S;
    for (int64_t t = 0; t < S; ++t) {
      const int64_t pos = past + t, token = b * S + t;
      // a position outside the buffer or the rotary table (never fed by the target's graphs) is neither turned nor
      // written, and its query attends to nothing (attend)
      const bool inside = pos >= 0 && pos < capacity && (!rotary || pos < angles);
      const float* c = rotary && inside ? cos_cache + pos * half : nullptr;
      const float* n = rotary && inside ? sin_cache + pos * half : nullptr;
      for (int64_t h = 0; h < H; ++h) {
        const float* src = q_in + token * q_stride + h * D;
        float* dst = q.data() + (token * H + h) * D;
        if (c) rotate(src, dst, D, rotary, c, n);
        else memcpy(dst, src, sizeof(float) * D);
      }
      if (!inside) continue;
      for (int64_t h = 0; h < KV; ++h) {
        const size_t at = static_cast<size_t>(((b * KV + h) * capacity + pos) * row);
        const float* ks = k_in + token * kv_stride + h * D;
        if (rotary) {
          rotate(ks, turned.data(), D, rotary, c, n);
          put(turned.data(), keys + at, D);
        } else {
          put(ks, keys + at, D);
        }
        put(v_in + token * kv_stride + h * D, values + at, D);
      }
    }
  }
  Step<T> step{a, B, S, D, capacity, q.data(), keys, values, lengths, out, (S + kQueryBlock - 1) / kQueryBlock};
  std::vector<float> kt;
  if (step.query_blocks > 1) {  // several tasks per row and KV head read the same keys: transposed once, first
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, std::min<int64_t>(lengths[b] + 1, capacity));
    step.kt_blocks = (longest + kKeyBlock - 1) / kKeyBlock;
    kt.resize(static_cast<size_t>(B * KV * step.kt_blocks * D * kKeyBlock));
    step.kt = kt.data();
    parallel(context, transpose_task<T>, static_cast<size_t>(B * KV * step.kt_blocks), &step);
  }
  parallel(context, attend<T>, static_cast<size_t>(B * KV * step.query_blocks), &step);
}

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Kernel* k = new Kernel;
  auto get_int = [&](const char* name, int64_t* out) {
    Status st{ort::at<ort::KernelInfoGetAttributeInt64Fn>(g_api, ort::kKernelInfoGetAttributeInt64)(info, name, out)};
  };
  auto get_float = [&](const char* name, float* out) {
    Status st{ort::at<ort::KernelInfoGetAttributeFloatFn>(g_api, ort::kKernelInfoGetAttributeFloat)(info, name, out)};
  };
  get_int("num_heads", &k->attrs.heads);
  get_int("kv_num_heads", &k->attrs.kv_heads);
  get_int("local_window_size", &k->attrs.window);
  get_int("do_rotary", &k->attrs.rotary);
  get_float("scale", &k->attrs.scale);
  get_float("softcap", &k->attrs.softcap);
  return k;
}

const char* name(const OrtCustomOp*) { return "GroupQueryAttention"; }
const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
template <int kKV>  // the past's and the present's element type
int input_type(const OrtCustomOp*, size_t index) {
  return index == 5 || index == 6 ? kOrtInt32 : index == 3 || index == 4 ? kKV : kOrtFloat;
}
size_t input_count(const OrtCustomOp*) { return 9; }
template <int kKV>
int output_type(const OrtCustomOp*, size_t index) { return index == 0 ? kOrtFloat : kKV; }
size_t output_count(const OrtCustomOp*) { return 3; }
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int input_characteristic(const OrtCustomOp*, size_t index) {
  return index == 1 || index == 2 || index >= 7 ? kOrtOptional : kOrtRequired;
}
int output_characteristic(const OrtCustomOp*, size_t) { return kOrtRequired; }
int memory_type(const OrtCustomOp*, size_t) { return 0; }
int one(const OrtCustomOp*) { return 1; }
int zero(const OrtCustomOp*) { return 0; }
int start_version(const OrtCustomOp*) { return 1; }
int end_version(const OrtCustomOp*) { return 1 << 30; }

template <typename T, int kKV>
OrtCustomOp op() {
  return {kOrtApiVersion, create_kernel, name, provider, input_type<kKV>, input_count, output_type<kKV>, output_count,
          compute<T>, destroy, input_characteristic, output_characteristic, memory_type, one, zero, one, zero, nullptr,
          nullptr, nullptr, start_version, end_version, nullptr, nullptr, nullptr, nullptr};
}

OrtCustomOp g_float_kv = op<float, kOrtFloat>(), g_half_kv = op<f16, kOrtFloat16>(), g_code_kv = op<u8code, kOrtUint8>();

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  g_api = base->GetApi(kOrtApiVersion);
  if (!g_api) return nullptr;  // an ONNX Runtime older than the API this library uses: it registers nothing
  // one domain per KV type (runtime/cpu_attention.py's DOMAINS), each as long as ONNX Runtime's own
  for (auto [name, op] : {std::pair{"mirror_sd.gqa", &g_float_kv}, std::pair{"mirror_sd.f16", &g_half_kv},
                          std::pair{"mirror_sd.ku8", &g_code_kv}}) {
    OrtCustomOpDomain* domain = nullptr;
    OrtStatus* st = ort::at<ort::CreateCustomOpDomainFn>(g_api, ort::kCreateCustomOpDomain)(name, &domain);
    if (st) return st;
    st = ort::at<ort::CustomOpDomainAddFn>(g_api, ort::kCustomOpDomainAdd)(domain, op);
    if (st) return st;
    st = ort::at<ort::AddCustomOpDomainFn>(g_api, ort::kAddCustomOpDomain)(options, domain);
    if (st) return st;
  }
  return nullptr;
}
