// A stand-alone driver of runtime/native/attention.cc's compute<T> (float32, float16 and uint8 KV), built by
// lab/scripts/neon_kernel_check.py for x86 and, cross-compiled, for aarch64 (run under an emulator) so that the
// kernel's NEON path can be checked without an ARM machine. It includes the kernel's source (its internals sit in an
// anonymous namespace of this translation unit) and calls compute<T> through a hand-made OrtApi table holding only the
// entries compute and its helpers read; ParallelFor runs the tasks in order on the calling thread.
//
// Inputs come from a 64-bit LCG, as exactly representable values, so that every build starts from the same bits (each
// case prints a hash of them). Per case it prints, as little-endian bytes in hex: the attention output, then the
// present K and V rows of the new positions; then a hash of the whole present buffers, whether the positions outside
// the new ones were left as they were, the largest error against a float64 reference (softmax(q k * scale) v with the
// causal mask, the local window and the soft cap, the rotary applied as the kernel applies it; keys and values: the
// float32 case's new ones rotated in float64 from the inputs, otherwise those the kernel stored, read back in
// float64), and the largest error of the stored new keys and values against the float64 rotated inputs.
//
//     g++ -O3 -march=native -std=c++17 -o driver lab/scripts/neon_kernel_driver.cc && ./driver
#include "../../runtime/native/attention.cc"

#include <stdio.h>
#include <stdlib.h>

#include <string>

namespace driver {

struct Tensor {
  std::vector<int64_t> dims;
  void* data;
};

struct Context {
  const Tensor* in[9];
  Tensor* out[3];
};

Tensor* tensor_of(const void* p) { return const_cast<Tensor*>(static_cast<const Tensor*>(p)); }

OrtStatus* get_data(OrtValue* value, void** out) {
  *out = tensor_of(value)->data;
  return nullptr;
}
OrtStatus* get_type_and_shape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) {
  *out = reinterpret_cast<OrtTensorTypeAndShapeInfo*>(tensor_of(value));
  return nullptr;
}
OrtStatus* dims_count(const OrtTensorTypeAndShapeInfo* info, size_t* out) {
  *out = tensor_of(info)->dims.size();
  return nullptr;
}
OrtStatus* dims(const OrtTensorTypeAndShapeInfo* info, int64_t* values, size_t count) {
  const Tensor* t = tensor_of(info);
  for (size_t i = 0; i < count && i < t->dims.size(); ++i) values[i] = t->dims[i];
  return nullptr;
}
OrtStatus* input_count(const OrtKernelContext*, size_t* out) {
  *out = 9;
  return nullptr;
}
OrtStatus* get_input(const OrtKernelContext* context, size_t index, const OrtValue** out) {
  *out = reinterpret_cast<const OrtValue*>(reinterpret_cast<const Context*>(context)->in[index]);
  return nullptr;
}
OrtStatus* get_output(OrtKernelContext* context, size_t index, const int64_t* shape, size_t count, OrtValue** out) {
  Tensor* t = reinterpret_cast<Context*>(context)->out[index];
  if (count != t->dims.size() || !std::equal(shape, shape + count, t->dims.begin())) {
    fprintf(stderr, "output %zu asked with another shape\n", index);
    exit(3);
  }
  *out = reinterpret_cast<OrtValue*>(t);
  return nullptr;
}
void release_status(OrtStatus*) {}
void release_info(OrtTensorTypeAndShapeInfo*) {}
OrtStatus* parallel_for(const OrtKernelContext*, void (*fn)(void*, size_t), size_t total, size_t, void* data) {
  for (size_t i = 0; i < total; ++i) fn(data, i);
  return nullptr;
}

OrtApi make_api() {
  OrtApi api{};
  api.slot[ort::kGetTensorMutableData] = reinterpret_cast<void*>(get_data);
  api.slot[ort::kGetTensorTypeAndShape] = reinterpret_cast<void*>(get_type_and_shape);
  api.slot[ort::kGetDimensionsCount] = reinterpret_cast<void*>(dims_count);
  api.slot[ort::kGetDimensions] = reinterpret_cast<void*>(dims);
  api.slot[ort::kKernelContextGetInputCount] = reinterpret_cast<void*>(input_count);
  api.slot[ort::kKernelContextGetInput] = reinterpret_cast<void*>(get_input);
  api.slot[ort::kKernelContextGetOutput] = reinterpret_cast<void*>(get_output);
  api.slot[ort::kReleaseStatus] = reinterpret_cast<void*>(release_status);
  api.slot[ort::kReleaseTensorTypeAndShapeInfo] = reinterpret_cast<void*>(release_info);
  api.slot[ort::kKernelContextParallelFor] = reinterpret_cast<void*>(parallel_for);
  return api;
}

// 64-bit LCG (Knuth's MMIX constants); values are multiples of 2^-k, exact in float32 (and in float16 where asked)
struct Lcg {
  uint64_t x;
  uint32_t next24() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(x >> 40);
  }
  float unit() { return static_cast<float>(next24()) * (1.f / 16777216.f); }  // [0, 1)
  float signed_unit() { return static_cast<float>(static_cast<int32_t>(next24()) - (1 << 23)) * (1.f / 8388608.f); }
};

uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

std::string out_text;
void emit(const char* s) { out_text += s; }
void emit_hex(const void* p, size_t n) {  // bytes in hex, 64 a line
  static const char digits[] = "0123456789abcdef";
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    out_text += digits[c[i] >> 4];
    out_text += digits[c[i] & 15];
    if (i % 64 == 63 || i + 1 == n) out_text += '\n';
  }
}
void flush() {
  fwrite(out_text.data(), 1, out_text.size(), stdout);
  fflush(stdout);
  out_text.clear();
}

// a stored element (or row) read back in float64
double read_back(const float* row, int64_t d, int64_t) { return row[d]; }
double read_back(const f16* row, int64_t d, int64_t) { return widen(row[d]); }
double read_back(const u8code* row, int64_t d, int64_t D) {
  float scale, low;
  memcpy(&scale, &row[D].bits, sizeof scale);
  memcpy(&low, &row[D].bits + sizeof scale, sizeof low);
  return static_cast<double>(row[d].bits) * scale + low;
}

// a past's random element, exactly representable
void fill_row(Lcg& g, float* row, int64_t D) {
  for (int64_t d = 0; d < D; ++d) row[d] = g.signed_unit();
}
void fill_row(Lcg& g, f16* row, int64_t D) {  // multiples of 2^-11 in [-1, 1): exact in float16
  for (int64_t d = 0; d < D; ++d)
    row[d] = narrow(static_cast<float>(static_cast<int32_t>(g.next24() >> 12) - 2048) * (1.f / 2048.f));
}
void fill_row(Lcg& g, u8code* row, int64_t D) {
  for (int64_t d = 0; d < D; ++d) row[d].bits = static_cast<uint8_t>(g.next24() >> 16);
  const float scale = (1.f + g.unit()) / 255.f, low = -(1.f + g.unit());
  memcpy(&row[D].bits, &scale, sizeof scale);
  memcpy(&row[D].bits + sizeof scale, &low, sizeof low);
}

struct Case {
  const char* name;
  int64_t batch, seq;
  std::vector<int64_t> past;
  int64_t window;
  float softcap, scale;
  bool packed;
};

constexpr int64_t kHeads = 9, kKvHeads = 3, kCapacity = 300;

template <typename T>
void run_case(const Case& c, int64_t D, const char* type) {
  const int64_t B = c.batch, S = c.seq, H = kHeads, KV = kKvHeads, C = kCapacity, row = row_of<T>(D), half = D / 2;
  Lcg g{0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(D) << 32) ^ fnv(c.name, strlen(c.name))};
  // inputs: q (packed with k and v, or apart), each in [-1, 1) (q in [-2, 2))
  const int64_t width = c.packed ? (H + 2 * KV) * D : H * D;
  std::vector<float> q(B * S * width), k(c.packed ? 0 : B * S * KV * D), v(c.packed ? 0 : B * S * KV * D);
  for (int64_t i = 0; i < B * S; ++i)
    for (int64_t j = 0; j < width; ++j) q[i * width + j] = (j < H * D ? 2.f : 1.f) * g.signed_unit();
  for (float& x : k) x = g.signed_unit();
  for (float& x : v) x = g.signed_unit();
  std::vector<T> pk(B * KV * C * row), pv(B * KV * C * row);
  for (int64_t r = 0; r < B * KV * C; ++r) fill_row(g, pk.data() + r * row, D), fill_row(g, pv.data() + r * row, D);
  // rotary tables [C, D / 2] of float32 angles' cos and sin (libm's, rounded to float32: the hash below says whether
  // two builds agree on them)
  std::vector<float> cos_t(C * half), sin_t(C * half);
  for (int64_t p = 0; p < C; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * pow(10000.0, -static_cast<double>(i) / static_cast<double>(half));
      cos_t[p * half + i] = static_cast<float>(cos(angle));
      sin_t[p * half + i] = static_cast<float>(sin(angle));
    }
  std::vector<int32_t> seqlens(B);
  for (int64_t b = 0; b < B; ++b) seqlens[b] = static_cast<int32_t>(c.past[b] + S - 1);
  int32_t total = 0;
  for (int32_t s : seqlens) total = std::max(total, s + 1);

  uint64_t h = fnv(q.data(), q.size() * 4);
  h = fnv(k.data(), k.size() * 4, h), h = fnv(v.data(), v.size() * 4, h);
  h = fnv(pk.data(), pk.size() * sizeof(T), h), h = fnv(pv.data(), pv.size() * sizeof(T), h);
  h = fnv(cos_t.data(), cos_t.size() * 4, h), h = fnv(sin_t.data(), sin_t.size() * 4, h);
  const std::vector<T> pk0 = pk, pv0 = pv;

  std::vector<float> out(B * S * H * D, -12345.f);
  Tensor tq{{B, S, width}, q.data()}, tk{{B, S, KV * D}, k.data()}, tv{{B, S, KV * D}, v.data()};
  Tensor tpk{{B, KV, C, row}, pk.data()}, tpv{{B, KV, C, row}, pv.data()}, ts{{B}, seqlens.data()}, tt{{}, &total};
  Tensor tc{{C, half}, cos_t.data()}, tsn{{C, half}, sin_t.data()}, to{{B, S, H * D}, out.data()};
  Context context{{&tq, c.packed ? nullptr : &tk, c.packed ? nullptr : &tv, &tpk, &tpv, &ts, &tt, &tc, &tsn},
                  {&to, &tpk, &tpv}};  // the present bound in place of the past, as the target binds it
  Kernel kernel;
  kernel.attrs.heads = H, kernel.attrs.kv_heads = KV, kernel.attrs.window = c.window, kernel.attrs.rotary = 1;
  kernel.attrs.scale = c.scale, kernel.attrs.softcap = c.softcap;
  compute<T>(&kernel, reinterpret_cast<OrtKernelContext*>(&context));

  char line[256];
  snprintf(line, sizeof line, "case %s d%lld %s\nhash_in %016llx\n", type, static_cast<long long>(D), c.name,
           static_cast<unsigned long long>(h));
  emit(line);
  snprintf(line, sizeof line, "out %zu\n", out.size() * 4);
  emit(line);
  emit_hex(out.data(), out.size() * 4);
  // the new positions' rows, (b, kv head, position) in order; the rest should be the past's bytes
  bool untouched = true;
  for (int which = 0; which < 2; ++which) {
    const std::vector<T>& now = which ? pv : pk;
    const std::vector<T>& before = which ? pv0 : pk0;
    std::vector<T> rows;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kv = 0; kv < KV; ++kv)
        for (int64_t p = 0; p < C; ++p) {
          const T* r = now.data() + ((b * KV + kv) * C + p) * row;
          if (p >= c.past[b] && p < c.past[b] + S) rows.insert(rows.end(), r, r + row);
          else untouched &= memcmp(r, before.data() + ((b * KV + kv) * C + p) * row, sizeof(T) * row) == 0;
        }
    snprintf(line, sizeof line, "%s %zu\n", which ? "v" : "k", rows.size() * sizeof(T));
    emit(line);
    emit_hex(rows.data(), rows.size() * sizeof(T));
  }
  const uint64_t hk = fnv(pk.data(), pk.size() * sizeof(T)), hv = fnv(pv.data(), pv.size() * sizeof(T));

  // float64 reference
  const double scale = c.scale != 0.f ? c.scale : static_cast<double>(1.f / sqrtf(static_cast<float>(D)));
  auto rotated = [&](const float* x, int64_t pos, double* y) {  // rotate() in float64 (rotary = D)
    for (int64_t i = 0; i < half; ++i) {
      const double a = x[i], b2 = x[i + half], cs = cos_t[pos * half + i], sn = sin_t[pos * half + i];
      y[i] = a * cs - b2 * sn;
      y[i + half] = b2 * cs + a * sn;
    }
  };
  const int64_t kv_stride = c.packed ? width : KV * D;
  auto new_key = [&](int64_t b, int64_t t, int64_t kvh) {
    return c.packed ? q.data() + (b * S + t) * width + (H + kvh) * D : k.data() + (b * S + t) * kv_stride + kvh * D;
  };
  auto new_value = [&](int64_t b, int64_t t, int64_t kvh) {
    return c.packed ? q.data() + (b * S + t) * width + (H + KV + kvh) * D : v.data() + (b * S + t) * kv_stride + kvh * D;
  };
  const bool exact_kv = sizeof(T) == 4 && row == D;  // float32: new keys and values from the inputs
  double ref_err = 0, store_err = 0;
  std::vector<double> qr(D), key(D), score, ref(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < KV; ++kvh) {
      const T* K = pk.data() + (b * KV + kvh) * C * row;
      const T* V = pv.data() + (b * KV + kvh) * C * row;
      for (int64_t t = 0; t < S; ++t) {  // the stored new key and value against the float64 ones
        const int64_t pos = c.past[b] + t;
        rotated(new_key(b, t, kvh), pos, key.data());
        for (int64_t d = 0; d < D; ++d) {
          store_err = std::max(store_err, fabs(read_back(K + pos * row, d, D) - key[d]));
          store_err = std::max(store_err, fabs(read_back(V + pos * row, d, D) - new_value(b, t, kvh)[d]));
        }
      }
      for (int64_t hq = kvh * (H / KV); hq < (kvh + 1) * (H / KV); ++hq)
        for (int64_t t = 0; t < S; ++t) {
          const int64_t pos = c.past[b] + t, lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
          rotated(q.data() + (b * S + t) * width + hq * D, pos, qr.data());
          score.assign(pos + 1 - lo, 0.0);
          double top = -1e300;
          for (int64_t j = lo; j <= pos; ++j) {
            double s = 0;
            if (exact_kv && j >= c.past[b]) rotated(new_key(b, j - c.past[b], kvh), j, key.data());
            else
              for (int64_t d = 0; d < D; ++d) key[d] = read_back(K + j * row, d, D);
            for (int64_t d = 0; d < D; ++d) s += qr[d] * key[d];
            s *= scale;
            if (c.softcap > 0) s = c.softcap * tanh(s / c.softcap);
            score[j - lo] = s;
            top = std::max(top, s);
          }
          double sum = 0;
          for (double& s : score) sum += (s = exp(s - top));
          std::fill(ref.begin(), ref.end(), 0.0);
          for (int64_t j = lo; j <= pos; ++j)
            for (int64_t d = 0; d < D; ++d) {
              const double x = exact_kv && j >= c.past[b] ? new_value(b, j - c.past[b], kvh)[d]
                                                          : read_back(V + j * row, d, D);
              ref[d] += score[j - lo] / sum * x;
            }
          const float* o = out.data() + ((b * S + t) * H + hq) * D;
          for (int64_t d = 0; d < D; ++d) ref_err = std::max(ref_err, fabs(o[d] - ref[d]));
        }
    }
  snprintf(line, sizeof line, "hash_kv %016llx %016llx\nuntouched %s\nref_err %.9g\nstore_err %.9g\nend\n",
           static_cast<unsigned long long>(hk), static_cast<unsigned long long>(hv), untouched ? "yes" : "NO", ref_err,
           store_err);
  emit(line);
  flush();
}

}  // namespace driver

int main(int argc, char** argv) {
  static const OrtApi api = driver::make_api();
  g_api = &api;
  const driver::Case cases[] = {
      {"decode", 2, 1, {37, 200}, -1, 0.f, 0.f, true},       // a step of batch 2, pasts of different lengths
      {"chunk", 2, 40, {100, 60}, -1, 0.f, 0.f, true},       // 40 tokens after a past: query blocks, transposed keys
      {"prompt", 1, 70, {0}, -1, 0.f, 0.f, true},            // a prompt from nothing
      {"window", 2, 20, {100, 5}, 16, 0.f, 0.f, false},      // a local window, q / k / v apart
      {"softcap", 1, 24, {50}, -1, 1.f, 0.25f, true},        // a soft cap, an explicit scale
      {"step_window", 2, 1, {250, 3}, 16, 0.f, 0.f, true},   // a windowed step
  };
  const int64_t sizes[] = {64, 32, 128};
  // optional: a substring a case's name must hold ("decode", "f16", ...)
  const char* only = argc > 1 ? argv[1] : "";
  for (int64_t D : sizes)
    for (const driver::Case& c : cases) {
      char tag[96];
      snprintf(tag, sizeof tag, "d%lld %s", static_cast<long long>(D), c.name);
      auto want = [&](const char* type) { return strstr((std::string(type) + " " + tag).c_str(), only) != nullptr; };
      if (want("f32")) driver::run_case<float>(c, D, "f32");
      if (want("f16")) driver::run_case<f16>(c, D, "f16");
      if (want("u8")) driver::run_case<u8code>(c, D, "u8");
    }
  return 0;
}
