// A probe, not part of the engine: a one-row (up to 8 rows) FP8 projection written in CUDA C++, its e4m3
// weights multiplied on the tensor cores straight from registers, by e4m3 activations (W8A8, mma.sync m16n8k32
// e4m3, which sm_90 runs as f16 HMMA after unpacking e4m3 pairs) or by bf16 activations turned into f16
// (weight-only, mma.sync m16n8k16 f16, the weights unpacked with cvt.rn.f16x2.e4m3x2), to measure how
// near the bandwidth limit a hand-written kernel gets where the Triton GEMV (kernels/gemv.py) streams FP8 at
// 2.1-3.1 TB/s (benchmarks/cuda_gemv_probe.py builds and drives it; needs nvcc and an sm_89+ GPU).
//
// y[m, n] = w_scale[n] * x_scale[m] * sum_k w[n, k] * xq[m, k], w [N, K] and xq [M, K] e4m3 bytes, y bf16.
//
// A warp owns 16 weight rows (the mma's M side) and a contiguous share of K (WARPS_K warps a block split K,
// summed in shared memory in a fixed order). Each lane loads 16 contiguous bytes of its two rows (g and g + 8,
// g = lane / 4) at k0 + 16 * (lane % 4): one 16-byte load a row, every 64-byte run of a row read whole by a
// quad. The mma wants lane (g, t) to hold A[g][4t..4t+3] and A[g][16+4t..16+4t+3] of each 32-wide K step;
// a dot product does not care in which order K is summed, so the bytes a lane loaded are *named* those
// elements of two K steps, and the activations are loaded with the same naming (lane (g, t) holds xq[row g]
// at the same 16 bytes), which makes the sum the same. Activation rows past M are zeros.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ void mma_e4m3(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <int UNROLL>
__device__ __forceinline__ void load_run(uint4 (&lo)[UNROLL], uint4 (&hi)[UNROLL], const uint8_t* w_lo,
                                         const uint8_t* w_hi, int k0) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    lo[u] = load_streaming(w_lo + k0 + 64 * u);
    hi[u] = load_streaming(w_hi + k0 + 64 * u);
  }
}

template <int UNROLL>
__device__ __forceinline__ void multiply_run(float c[4], const uint4 (&lo)[UNROLL], const uint4 (&hi)[UNROLL],
                                             const uint8_t* x_row, bool has_x, int k0) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    uint4 b = make_uint4(0u, 0u, 0u, 0u);
    if (has_x) b = __ldg(reinterpret_cast<const uint4*>(x_row + k0 + 64 * u));
    mma_e4m3(c, lo[u].x, hi[u].x, lo[u].y, hi[u].y, b.x, b.y);
    mma_e4m3(c, lo[u].z, hi[u].z, lo[u].w, hi[u].w, b.z, b.w);
  }
}


// Weight-only: bf16 activations, each e4m3 weight pair unpacked to f16 (cvt.rn.f16x2.e4m3x2, exact) and
// multiplied on the tensor cores with f32 accumulation (mma.sync m16n8k16 f16). The same naming as above with
// 16-wide K steps: lane (g, t)'s 16 bytes of a row are the f16 pairs of four K steps. The activations are
// turned into f16 as they are read (values past f16's range would overflow: a probe on random data).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(static_cast<unsigned short>(two_bytes)));
  return out;
}

__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t v) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&v);
  __half2 h = __float22half2_rn(__bfloat1622float2(b));
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma_f16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-bit word of four e4m3 weights of each row (lo: row g, hi: row g + 8) and the four matching bf16
// activations (two words): one 16-wide K step, the word's first two bytes named A[.][2t, 2t + 1] and its last
// two A[.][8 + 2t, 8 + 2t + 1] (the activations alike).
__device__ __forceinline__ void mma_word(float c[4], uint32_t lo, uint32_t hi, uint32_t x01, uint32_t x23) {
  // K step: a0 = row g elements (0, 1), a2 = row g elements (2, 3); a1, a3 the same of row g + 8
  mma_f16(c, e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi), e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi >> 16),
          bf16x2_to_f16x2(x01), bf16x2_to_f16x2(x23));
}

template <int UNROLL>
__device__ __forceinline__ void multiply_run_weight_only(float c[4], const uint4 (&lo)[UNROLL],
                                                         const uint4 (&hi)[UNROLL],
                                                         const __nv_bfloat16* x_row, bool has_x, int k0) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    uint4 xa = make_uint4(0u, 0u, 0u, 0u), xb = make_uint4(0u, 0u, 0u, 0u);  // 16 bf16 activations
    if (has_x) {
      xa = __ldg(reinterpret_cast<const uint4*>(x_row + k0 + 64 * u));
      xb = __ldg(reinterpret_cast<const uint4*>(x_row + k0 + 64 * u + 8));
    }
    mma_word(c, lo[u].x, hi[u].x, xa.x, xa.y);
    mma_word(c, lo[u].y, hi[u].y, xa.z, xa.w);
    mma_word(c, lo[u].z, hi[u].z, xb.x, xb.y);
    mma_word(c, lo[u].w, hi[u].w, xb.z, xb.w);
  }
}

// UNROLL 64-byte K runs a lane has in flight per row; the next UNROLL are loaded before the current ones are
// multiplied (two register sets).
template <int UNROLL, int WARPS_K, bool WEIGHT_ONLY>
__global__ void __launch_bounds__(32 * WARPS_K) fp8_mma_gemv_kernel(
    const uint8_t* __restrict__ w, const float* __restrict__ w_scale, const void* __restrict__ x,
    const float* __restrict__ x_scale, __nv_bfloat16* __restrict__ y, int n, int k, int m) {
  __shared__ float partial[WARPS_K][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const uint8_t* w_lo = w + (size_t)(row0 + g) * k + 16 * t;
  const uint8_t* w_hi = w + (size_t)(row0 + g + 8) * k + 16 * t;
  // W8A8: e4m3 activations, a scale a row; WEIGHT_ONLY: bf16 activations (x_scale unused)
  const uint8_t* x_row = static_cast<const uint8_t*>(x) + (size_t)g * k + 16 * t;
  const __nv_bfloat16* x_row_bf16 = static_cast<const __nv_bfloat16*>(x) + (size_t)g * k + 16 * t;
  const bool has_x = g < m;
  const int k_per_warp = k / WARPS_K;
  const int k_begin = warp * k_per_warp, k_end = k_begin + k_per_warp;
  constexpr int STEP = 64 * UNROLL;

  uint4 lo_a[UNROLL], hi_a[UNROLL], lo_b[UNROLL], hi_b[UNROLL];  // two sets, named (never indexed at run time)
  load_run<UNROLL>(lo_a, hi_a, w_lo, w_hi, k_begin);
  wait_for_previous_kernel();  // the activations are the kernel before's output; the weights are not

  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int k0 = k_begin; k0 < k_end; k0 += 2 * STEP) {
    if (k0 + STEP < k_end) load_run<UNROLL>(lo_b, hi_b, w_lo, w_hi, k0 + STEP);
    if (WEIGHT_ONLY) multiply_run_weight_only<UNROLL>(c, lo_a, hi_a, x_row_bf16, has_x, k0);
    else multiply_run<UNROLL>(c, lo_a, hi_a, x_row, has_x, k0);
    if (k0 + STEP >= k_end) break;
    if (k0 + 2 * STEP < k_end) load_run<UNROLL>(lo_a, hi_a, w_lo, w_hi, k0 + 2 * STEP);
    if (WEIGHT_ONLY) multiply_run_weight_only<UNROLL>(c, lo_b, hi_b, x_row_bf16, has_x, k0 + STEP);
    else multiply_run<UNROLL>(c, lo_b, hi_b, x_row, has_x, k0 + STEP);
  }

  if (WARPS_K > 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][i] = c[i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float s = partial[0][lane][i];
#pragma unroll
      for (int j = 1; j < WARPS_K; ++j) s += partial[j][lane][i];
      c[i] = s;
    }
  }
  // c0, c1: weight row g, activation rows 2t and 2t + 1; c2, c3: weight row g + 8, the same activation rows
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int out_row = 2 * t + (i & 1);
    const int out_col = row0 + g + 8 * (i >> 1);
    if (out_row < m) {
      const float s = WEIGHT_ONLY ? w_scale[out_col] : w_scale[out_col] * x_scale[out_row];
      y[(size_t)out_row * n + out_col] = __float2bfloat16(c[i] * s);
    }
  }
}

template <int UNROLL, int WARPS_K, bool WEIGHT_ONLY>
cudaError_t launch(const uint8_t* w, const float* w_scale, const void* x, const float* x_scale,
                   __nv_bfloat16* y, int n, int k, int m, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(n / 16);
  config.blockDim = dim3(32 * WARPS_K);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, fp8_mma_gemv_kernel<UNROLL, WARPS_K, WEIGHT_ONLY>, w, w_scale, x, x_scale, y,
                            n, k, m);
}

}  // namespace

// Returns a cudaError_t, or -1 for a shape or variant the kernel does not take: n a multiple of 16, m <= 8,
// k a multiple of 64 * unroll * warps_k. weight_only: x is bf16 [m, k] and x_scale unused; else x is e4m3.
extern "C" int fp8_mma_gemv(const void* w, const float* w_scale, const void* x, const float* x_scale, void* y,
                            int n, int k, int m, int unroll, int warps_k, int weight_only, int pdl, void* stream) {
  if (n % 16 || m < 1 || m > 8 || k % (64 * unroll * warps_k)) return -1;
  auto wb = static_cast<const uint8_t*>(w);
  auto yb = static_cast<__nv_bfloat16*>(y);
  auto s = static_cast<cudaStream_t>(stream);
#define GS_CASE(U, W)                                                                              \
  if (unroll == U && warps_k == W) {                                                               \
    return weight_only ? launch<U, W, true>(wb, w_scale, x, x_scale, yb, n, k, m, pdl, s)          \
                       : launch<U, W, false>(wb, w_scale, x, x_scale, yb, n, k, m, pdl, s);        \
  }
  GS_CASE(2, 1) GS_CASE(2, 2) GS_CASE(2, 4) GS_CASE(2, 8)
  GS_CASE(4, 1) GS_CASE(4, 2) GS_CASE(4, 4) GS_CASE(4, 8)
  GS_CASE(8, 1) GS_CASE(8, 2) GS_CASE(8, 4)
#undef GS_CASE
  return -1;
}
