// Attention on CUDA whose result for a row never depends on the other rows of the call or on
// keys the row does not see: one block per (query head, row), the row's visible keys taken by
// their ordinal (the cache's keys in order, then a token tree's path), ordinal t always by warp
// t % WARPS, each warp's online softmax combined in warp order. A decode step and a verify
// block's row over the same keys run the same operations in the same order: the same bits.
// Compiled at run time with NVRTC (no headers needed); f32, bf16 or f16 in and out, f32 inside.

#define WARPS 4
#define LANE_DIMS 8  // head widths up to 32 * LANE_DIMS
#define NEG_INF __int_as_float(0xff800000)

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float load(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(bf16* p, float x) {
    // Round to nearest even, as candle's conversion does (a NaN stays a NaN).
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p->bits = (unsigned short)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p->bits = (unsigned short)(u >> 16);
}
__device__ __forceinline__ void store(f16* p, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
}

template <typename T>
__device__ void attention(
    const T* __restrict__ q,                // (heads, n, d)
    const T* __restrict__ k,                // (kv_heads, ·, d): a key head every kv_stride
    const T* __restrict__ v,                // likewise
    const unsigned int* __restrict__ rows,  // (n, 3): first and past-the-last cached key, path length
    const unsigned int* __restrict__ paths, // (n, max_path): a tree row's path keys
    T* __restrict__ out,                    // (n, heads, d)
    unsigned int n, unsigned int heads, unsigned int kv_heads, unsigned long long kv_stride,
    unsigned int d, unsigned int max_path, float scale)
{
    const unsigned int h = blockIdx.x, i = blockIdx.y;
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int kvh = h / (heads / kv_heads);
    const T* qr = q + ((size_t)h * n + i) * d;
    const T* kh = k + (size_t)kvh * kv_stride;
    const T* vh = v + (size_t)kvh * kv_stride;
    const unsigned int start = rows[3 * i], end = rows[3 * i + 1], extra = rows[3 * i + 2];
    const unsigned int cached = end - start, count = cached + extra;

    float qv[LANE_DIMS], acc[LANE_DIMS];
    for (int s = 0; s < LANE_DIMS; ++s) {
        const unsigned int x = lane + 32 * s;
        qv[s] = x < d ? load(qr[x]) : 0.0f;
        acc[s] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (unsigned int t = warp; t < count; t += WARPS) {
        const unsigned int j = t < cached ? start + t : paths[(size_t)i * max_path + (t - cached)];
        const T* kj = kh + (size_t)j * d;
        float part = 0.0f;
        for (int s = 0; s < LANE_DIMS; ++s) {
            const unsigned int x = lane + 32 * s;
            if (x < d) part = fmaf(qv[s], load(kj[x]), part);
        }
        for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        // Every lane takes lane 0's sum (the butterfly's lanes may differ in the last bit).
        const float score = __shfl_sync(0xffffffffu, part, 0) * scale;
        const float m2 = fmaxf(m, score);
        const float corr = expf(m - m2);
        const float p = expf(score - m2);
        l = l * corr + p;
        const T* vj = vh + (size_t)j * d;
        for (int s = 0; s < LANE_DIMS; ++s) {
            const unsigned int x = lane + 32 * s;
            if (x < d) acc[s] = acc[s] * corr + p * load(vj[x]);
        }
        m = m2;
    }

    __shared__ float sm[WARPS], sl[WARPS], sacc[WARPS][32 * LANE_DIMS];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    for (int s = 0; s < LANE_DIMS; ++s) {
        const unsigned int x = lane + 32 * s;
        if (x < d) sacc[warp][x] = acc[s];
    }
    __syncthreads();
    if (warp != 0) return;
    float big = sm[0];
    for (int w = 1; w < WARPS; ++w) big = fmaxf(big, sm[w]);
    float total_l = 0.0f, o[LANE_DIMS];
    for (int s = 0; s < LANE_DIMS; ++s) o[s] = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
        const float c = sm[w] == NEG_INF ? 0.0f : expf(sm[w] - big);
        total_l += sl[w] * c;
        for (int s = 0; s < LANE_DIMS; ++s) {
            const unsigned int x = lane + 32 * s;
            if (x < d) o[s] += sacc[w][x] * c;
        }
    }
    T* dst = out + ((size_t)i * heads + h) * d;
    for (int s = 0; s < LANE_DIMS; ++s) {
        const unsigned int x = lane + 32 * s;
        if (x < d) store(dst + x, o[s] / total_l);
    }
}

#define ATTENTION(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const T* q, const T* k, const T* v, const unsigned int* rows, \
        const unsigned int* paths, T* out, unsigned int n, unsigned int heads,                 \
        unsigned int kv_heads, unsigned long long kv_stride, unsigned int d,                   \
        unsigned int max_path, float scale) {                                                  \
        attention<T>(q, k, v, rows, paths, out, n, heads, kv_heads, kv_stride, d, max_path, scale); \
    }
ATTENTION(tandem_attention_f32, float)
ATTENTION(tandem_attention_bf16, bf16)
ATTENTION(tandem_attention_f16, f16)
