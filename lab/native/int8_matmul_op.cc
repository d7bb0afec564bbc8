// A lab custom op in the place of ONNX Runtime's MatMulNBits with 8-bit symmetric blocks of 32 (the int8 target's
// MatMuls), domain mirror_sd.mmq: lab/native/int8_blocks_gemm.cc's VNNI tiles on ONNX Runtime's thread pool. Each row
// is quantized per block of 32 to int8 and computed alone (the same bits whatever rows share its call). Built with the
// attention kernel into one library by lab/scripts/int8_matmul_engine_ab.py; not the product's.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "ort_abi.h"

namespace {

const OrtApi* g_api = nullptr;
constexpr int kUint8 = 2;  // ONNX's element type
constexpr int kBlock = 32, kCols = 16, kRows = 8, kGroupsPerTask = 4;

struct Kernel {
  int64_t K = 0, N = 0;
  std::once_flag packed;
  std::vector<int8_t> w;        // [N / 16][K / 4][16][4]
  std::vector<float> scale;     // [K / 32][N]
  std::vector<int32_t> colsum;  // [K / 32][N]: 128 x the block's weights' sum
};

struct Call {
  const Kernel* k;
  const float* x;
  uint8_t* a;  // [M][K]: int8 + 128
  float* as;   // [M][K / 32]
  float* y;
  int64_t M;
};

template <typename T>
T* data_of(const OrtValue* value) {
  void* p = nullptr;
  OrtStatus* st = ort::at<ort::GetTensorMutableDataFn>(g_api, ort::kGetTensorMutableData)(const_cast<OrtValue*>(value), &p);
  if (st) ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
  return static_cast<T*>(p);
}

std::vector<int64_t> shape_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  std::vector<int64_t> dims;
  if (ort::at<ort::GetTensorTypeAndShapeFn>(g_api, ort::kGetTensorTypeAndShape)(value, &info)) return dims;
  size_t n = 0;
  ort::at<ort::GetDimensionsCountFn>(g_api, ort::kGetDimensionsCount)(info, &n);
  dims.resize(n);
  ort::at<ort::GetDimensionsFn>(g_api, ort::kGetDimensions)(info, dims.data(), n);
  ort::at<ort::ReleaseTypeAndShapeFn>(g_api, ort::kReleaseTensorTypeAndShapeInfo)(info);
  return dims;
}

void pack(Kernel& k, const uint8_t* B, const float* scales) {  // B [N][K / 32][32], scales [N][K / 32]
  const int64_t K = k.K, N = k.N, blocks = K / kBlock;
  k.w.resize(size_t(K * N));
  k.scale.resize(size_t(blocks * N));
  k.colsum.resize(size_t(blocks * N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t kk = b * kBlock + j;
        const int8_t v = int8_t(int(B[(n * blocks + b) * kBlock + j]) - 128);
        sum += v;
        k.w[size_t((((n / kCols) * (K / 4) + kk / 4) * kCols + n % kCols) * 4 + kk % 4)] = v;
      }
      k.scale[size_t(b * N + n)] = scales[n * blocks + b];
      k.colsum[size_t(b * N + n)] = 128 * sum;
    }
}

void quantize_row(void* data, size_t m) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t K = c.k->K, blocks = K / kBlock;
  const float* x = c.x + int64_t(m) * K;
  for (int64_t b = 0; b < blocks; ++b) {
    float most = 0.f;
    for (int j = 0; j < kBlock; ++j) most = std::max(most, std::fabs(x[b * kBlock + j]));
    const float s = most > 0 ? most / 127.f : 1.f, inv = 1.f / s;
    c.as[int64_t(m) * blocks + b] = s;
    for (int j = 0; j < kBlock; ++j)
      c.a[int64_t(m) * K + b * kBlock + j] =
          uint8_t(std::clamp(int(std::lrintf(x[b * kBlock + j] * inv)), -127, 127) + 128);
  }
}

// rows [r0, r0 + R) x G groups of 16 columns from group g0: R x G integer and float sums in flight
template <int R, int G>
void tile(const Call& c, int64_t r0, int64_t g0) {
  const Kernel& k = *c.k;
  const int64_t K = k.K, N = k.N, blocks = K / kBlock;
  __m512 acc[R][G];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][G];
    for (auto& row : dot)
      for (auto& v : row) v = _mm512_setzero_si512();
    for (int64_t k4 = b * kBlock / 4; k4 < (b + 1) * kBlock / 4; ++k4) {
      __m512i w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(&k.w[size_t((((g0 + g) * (K / 4) + k4) * kCols) * 4)]);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, c.a + (r0 + r) * K + k4 * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int g = 0; g < G; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], x, w[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const size_t at = size_t(b * N + (g0 + g) * kCols);
      const __m512i cs = _mm512_loadu_si512(&k.colsum[at]);
      const __m512 ws = _mm512_loadu_ps(&k.scale[at]);
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(c.as[(r0 + r) * blocks + b]));
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][g], cs)), s, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(c.y + (r0 + r) * N + (g0 + g) * kCols, acc[r][g]);
}

// Tasks: tiles of 8 rows x kGroupsPerTask groups; under 4 rows, all rows x kWideGroups groups (a lone row's sums in
// several column groups at once, where one group's would wait on each other)
constexpr int kWideGroups = 8;

int64_t span_groups(int64_t M) { return M >= 4 ? kGroupsPerTask : kWideGroups; }

void gemm_task(void* data, size_t task) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t groups = c.k->N / kCols, width = span_groups(c.M), spans = (groups + width - 1) / width;
  const int64_t g0 = int64_t(task) % spans * width, end = std::min(groups, g0 + width);
  if (c.M < 4) {  // every row, wide
    int64_t g = g0;
    for (; g + kWideGroups <= end; g += kWideGroups) {
      if (c.M == 1) tile<1, 8>(c, 0, g);
      else if (c.M == 2) tile<2, 8>(c, 0, g);
      else tile<3, 4>(c, 0, g), tile<3, 4>(c, 0, g + 4);
    }
    for (; g < end; ++g) {
      if (c.M == 1) tile<1, 1>(c, 0, g);
      else if (c.M == 2) tile<2, 1>(c, 0, g);
      else tile<3, 1>(c, 0, g);
    }
    return;
  }
  const int64_t r0 = int64_t(task) / spans * kRows, rows = std::min<int64_t>(kRows, c.M - r0);
  for (int64_t g = g0; g < end; ++g) {
    switch (rows) {
      case 8: tile<8, 1>(c, r0, g); break;
      case 7: tile<7, 1>(c, r0, g); break;
      case 6: tile<6, 1>(c, r0, g); break;
      case 5: tile<5, 1>(c, r0, g); break;
      case 4: tile<4, 1>(c, r0, g); break;
      case 3: tile<3, 1>(c, r0, g); break;
      case 2: tile<2, 1>(c, r0, g); break;
      default: tile<1, 1>(c, r0, g);
    }
  }
}

void parallel(OrtKernelContext* context, void (*fn)(void*, size_t), size_t tasks, void* data) {
  OrtStatus* st = ort::at<ort::ParallelForFn>(g_api, ort::kKernelContextParallelFor)(context, fn, tasks, tasks, data);
  if (st) {
    ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
    for (size_t i = 0; i < tasks; ++i) fn(data, i);
  }
}

const OrtValue* input(OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  OrtStatus* st = ort::at<ort::KernelContextGetInputFn>(g_api, ort::kKernelContextGetInput)(context, index, &value);
  if (st) ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
  return value;
}

void compute(void* kernel, OrtKernelContext* context) {
  Kernel& k = *static_cast<Kernel*>(kernel);
  const OrtValue *A = input(context, 0), *B = input(context, 1), *S = input(context, 2);
  std::call_once(k.packed, [&] { pack(k, data_of<uint8_t>(B), data_of<float>(S)); });
  std::vector<int64_t> shape = shape_of(A);
  int64_t M = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
  shape.back() = k.N;
  OrtValue* out = nullptr;
  OrtStatus* st = ort::at<ort::KernelContextGetOutputFn>(g_api, ort::kKernelContextGetOutput)(
      context, 0, shape.data(), shape.size(), &out);
  if (st) {
    ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
    return;
  }
  thread_local std::vector<uint8_t> a;
  thread_local std::vector<float> as;
  a.resize(size_t(M * k.K));
  as.resize(size_t(M * (k.K / kBlock)));
  Call c{&k, data_of<float>(A), a.data(), as.data(), data_of<float>(out), M};
  parallel(context, quantize_row, size_t(M), &c);
  const int64_t width = span_groups(M), spans = (k.N / kCols + width - 1) / width;
  parallel(context, gemm_task, size_t((M < 4 ? 1 : (M + kRows - 1) / kRows) * spans), &c);
}

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Kernel* k = new Kernel;
  auto get = [&](const char* name, int64_t* v) {
    OrtStatus* st = ort::at<ort::KernelInfoGetAttributeInt64Fn>(g_api, ort::kKernelInfoGetAttributeInt64)(info, name, v);
    if (st) ort::at<ort::ReleaseStatusFn>(g_api, ort::kReleaseStatus)(st);
  };
  get("K", &k->K);
  get("N", &k->N);
  return k;
}

const char* name(const OrtCustomOp*) { return "MatMulNBits"; }
const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
int input_type(const OrtCustomOp*, size_t index) { return index == 1 ? kUint8 : kOrtFloat; }
size_t input_count(const OrtCustomOp*) { return 3; }
int output_type(const OrtCustomOp*, size_t) { return kOrtFloat; }
size_t output_count(const OrtCustomOp*) { return 1; }
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int required(const OrtCustomOp*, size_t) { return kOrtRequired; }
int memory_type(const OrtCustomOp*, size_t) { return 0; }
int one(const OrtCustomOp*) { return 1; }
int zero(const OrtCustomOp*) { return 0; }
int start_version(const OrtCustomOp*) { return 1; }
int end_version(const OrtCustomOp*) { return 1 << 30; }

OrtCustomOp g_op = {kOrtApiVersion, create_kernel, name, provider, input_type, input_count, output_type,
                    output_count, compute, destroy, required, required, memory_type, one,
                    zero, one, zero, nullptr, nullptr, nullptr, start_version, end_version, nullptr, nullptr,
                    nullptr, nullptr};

}  // namespace

extern "C" OrtStatus* RegisterAttention(OrtSessionOptions* options, const OrtApiBase* base);

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  if (OrtStatus* st = RegisterAttention(options, base)) return st;
  g_api = base->GetApi(kOrtApiVersion);
  if (!g_api) return nullptr;
  OrtCustomOpDomain* domain = nullptr;
  OrtStatus* st = ort::at<ort::CreateCustomOpDomainFn>(g_api, ort::kCreateCustomOpDomain)("mirror_sd.mmq", &domain);
  if (st) return st;
  st = ort::at<ort::CustomOpDomainAddFn>(g_api, ort::kCustomOpDomainAdd)(domain, &g_op);
  if (st) return st;
  return ort::at<ort::AddCustomOpDomainFn>(g_api, ort::kAddCustomOpDomain)(options, domain);
}
