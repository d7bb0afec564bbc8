// How fast can a GEMM with the compressed targets' numerics run on AVX512-VNNI? Y[M, N] = sum over blocks of 32
// along K of (a row's block scale x a column's block scale) x the block's integer dot product, activations quantized
// per row and block to int8 (symmetric), weights int8 (symmetric): what MatMulNBits computes at accuracy level 4
// with int8 blocks, each row alike whatever the rows beside it. A lab prototype, not the product's: it times itself
// against a plain float32 loop's result for correctness, on SmolLM2's shapes, 2 threads (std::thread).
//
//   g++ -O3 -march=native -std=c++17 -pthread lab/native/int8_blocks_gemm.cc -o /tmp/gemm && /tmp/gemm [threads]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

constexpr int kBlock = 32;  // K values per scale
constexpr int kCols = 16;   // columns per zmm
constexpr int kRows = 8;    // rows per register tile: 8 integer and 8 float sums in flight (lab/log.md)
constexpr int kGroups = 1;  // 16-column groups per register tile
static int THREADS = 2;

struct Packed {  // weights for vpdpbusd: per 16 columns, per 4 K values, 16 x 4 bytes
  int K, N;
  std::vector<int8_t> w;         // [N / 16][K / 4][16][4]
  std::vector<float> scale;      // [K / 32][N]
  std::vector<int32_t> colsum;   // [K / 32][N]: 128 x the block's weights' sum (a's +128 offset taken back)
};

Packed pack(const std::vector<float>& W, int K, int N) {  // W [K][N]
  Packed p{K, N, std::vector<int8_t>(size_t(K) * N), std::vector<float>(size_t(K / kBlock) * N),
           std::vector<int32_t>(size_t(K / kBlock) * N)};
  std::vector<int8_t> q(size_t(K) * N);
  for (int b = 0; b < K / kBlock; ++b)
    for (int n = 0; n < N; ++n) {
      float most = 0.f;
      for (int k = b * kBlock; k < (b + 1) * kBlock; ++k) most = std::max(most, std::fabs(W[size_t(k) * N + n]));
      const float s = most > 0 ? most / 127.f : 1.f;
      p.scale[size_t(b) * N + n] = s;
      int32_t sum = 0;
      for (int k = b * kBlock; k < (b + 1) * kBlock; ++k) {
        const int v = int(std::lrintf(W[size_t(k) * N + n] / s));
        q[size_t(k) * N + n] = int8_t(std::clamp(v, -127, 127));
        sum += q[size_t(k) * N + n];
      }
      p.colsum[size_t(b) * N + n] = 128 * sum;
    }
  for (int g = 0; g < N / kCols; ++g)
    for (int k4 = 0; k4 < K / 4; ++k4)
      for (int c = 0; c < kCols; ++c)
        for (int j = 0; j < 4; ++j)
          p.w[((size_t(g) * (K / 4) + k4) * kCols + c) * 4 + j] = q[size_t(k4 * 4 + j) * N + g * kCols + c];
  return p;
}

// a row's activations per block of 32: uint8 (int8 + 128) and the block's scale
void quantize(const float* x, int K, uint8_t* out, float* scales) {
  for (int b = 0; b < K / kBlock; ++b) {
    float most = 0.f;
    for (int k = 0; k < kBlock; ++k) most = std::max(most, std::fabs(x[b * kBlock + k]));
    const float s = most > 0 ? most / 127.f : 1.f, inv = 1.f / s;
    scales[b] = s;
    for (int k = 0; k < kBlock; ++k)
      out[b * kBlock + k] = uint8_t(std::clamp(int(std::lrintf(x[b * kBlock + k] * inv)), -127, 127) + 128);
  }
}

// rows [r0, r0 + 4) x column groups [g0, g0 + 2): every block's integer sums, then scaled into float sums
void tile(const Packed& p, const uint8_t* a, const float* as, int r0, int g0, float* Y) {
  const int K = p.K, N = p.N, blocks = K / kBlock;
  __m512 acc[kRows][kGroups];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    __m512i dot[kRows][kGroups];
    for (auto& row : dot)
      for (auto& v : row) v = _mm512_setzero_si512();
    for (int k4 = b * kBlock / 4; k4 < (b + 1) * kBlock / 4; ++k4) {
      __m512i w[kGroups];
      for (int g = 0; g < kGroups; ++g)
        w[g] = _mm512_loadu_si512(&p.w[((size_t(g0 + g) * (K / 4) + k4) * kCols) * 4]);
      for (int r = 0; r < kRows; ++r) {
        int32_t four;
        std::memcpy(&four, a + size_t(r0 + r) * K + k4 * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int g = 0; g < kGroups; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], x, w[g]);
      }
    }
    for (int g = 0; g < kGroups; ++g) {
      const size_t at = size_t(b) * N + (g0 + g) * kCols;
      const __m512i cs = _mm512_loadu_si512(&p.colsum[at]);
      const __m512 ws = _mm512_loadu_ps(&p.scale[at]);
      for (int r = 0; r < kRows; ++r) {
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(as[size_t(r0 + r) * blocks + b]));
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][g], cs)), s, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(Y + size_t(r0 + r) * N + (g0 + g) * kCols, acc[r][g]);
}

void gemm(const Packed& p, const float* X, int M, float* Y, int threads, std::vector<uint8_t>& a,
          std::vector<float>& as) {
  const int K = p.K, blocks = K / kBlock;
  a.resize(size_t(M) * K);
  as.resize(size_t(M) * blocks);
  auto part = [&](int t) {
    for (int m = t; m < M; m += threads) quantize(X + size_t(m) * K, K, &a[size_t(m) * K], &as[size_t(m) * blocks]);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(part, t);
  part(0);
  for (auto& th : pool) th.join();
  pool.clear();
  const int tiles_n = p.N / (kCols * kGroups), tiles_m = M / kRows;
  auto work = [&](int t) {
    for (int i = t; i < tiles_m * tiles_n; i += threads) tile(p, a.data(), as.data(), (i / tiles_n) * kRows,
                                                               (i % tiles_n) * kGroups, Y);
  };
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

int main(int argc, char** argv) {
  if (argc > 1) THREADS = std::atoi(argv[1]);
  const int shapes[][2] = {{576, 960}, {576, 1536}, {1536, 576}};
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint8_t> a;
  std::vector<float> as;
  for (auto [K, N] : shapes) {
    std::vector<float> W(size_t(K) * N);
    for (auto& v : W) v = 0.05f * normal(rng);
    const Packed p = pack(W, K, N);
    for (int M : {16, 64, 512}) {
      std::vector<float> X(size_t(M) * K), Y(size_t(M) * N);
      for (auto& v : X) v = normal(rng);
      gemm(p, X.data(), M, Y.data(), THREADS, a, as);
      double worst = 0, scale = 0;  // against float32 sums of the same quantized values
      for (int m = 0; m < M; m += 7)
        for (int n = 0; n < N; n += 5) {
          double ref = 0;
          for (int b = 0; b < K / kBlock; ++b) {
            long dot = 0;
            for (int k = b * kBlock; k < (b + 1) * kBlock; ++k) {
              const int wq = int(std::lrintf(W[size_t(k) * N + n] / p.scale[size_t(b) * N + n]));
              dot += long(int(a[size_t(m) * K + k]) - 128) * std::clamp(wq, -127, 127);
            }
            ref += double(dot) * as[size_t(m) * (K / kBlock) + b] * p.scale[size_t(b) * N + n];
          }
          worst = std::max(worst, std::fabs(ref - Y[size_t(m) * N + n]));
          scale = std::max(scale, std::fabs(ref));
        }
      std::vector<double> times;
      const int repeats = std::max(1, 4000 / M);
      for (int i = 0; i < 9; ++i) {
        const auto start = std::chrono::steady_clock::now();
        for (int r = 0; r < repeats; ++r) gemm(p, X.data(), M, Y.data(), THREADS, a, as);
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats);
      }
      std::sort(times.begin(), times.end());
      std::printf("%4d rows x %4d x %4d: %6.0f GOP/s (error %.1e of %.1e)\n", M, K, N,
                  2.0 * M * K * N / times[4] / 1e9, worst, scale);
    }
  }
}
