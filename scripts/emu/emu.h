// A minimal CUDA emulator for scripts/emu/run.sh: one block at a time, one std::thread per CUDA thread.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <algorithm>
#include <barrier>
#include <thread>
#include <vector>
#include <functional>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n)
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx;
dim3 blockIdx, blockDim, gridDim;
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
// Byte n of the result: byte (selector nibble n & 7) of {x, y} as eight bytes, x's first.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x; unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
std::barrier<>* g_block_bar;
std::barrier<>* g_warp_bar[32];
float g_shfl[32][32];
int g_shfl_i[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_shfl[w][l] = v; g_warp_bar[w]->arrive_and_wait();
    float r = g_shfl[w][l ^ o]; g_warp_bar[w]->arrive_and_wait(); return r;
}
inline int __shfl_xor_sync(unsigned, int v, int o) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_shfl_i[w][l] = v; g_warp_bar[w]->arrive_and_wait();
    int r = g_shfl_i[w][l ^ o]; g_warp_bar[w]->arrive_and_wait(); return r;
}
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline float __expf(float x) { return expf(x); }
inline void __trap() { std::abort(); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
using std::max; using std::min;
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
// Run block b of grid with `threads` threads.
inline void run_block(dim3 grid, dim3 b, unsigned threads, const std::function<void()>& f) {
    gridDim = grid; blockDim = {threads, 1, 1};
    blockIdx = b;
    std::barrier<> bar(threads); g_block_bar = &bar;
    for (unsigned w = 0; w < threads / 32; ++w) { g_warp_bar[w] = new std::barrier<>(32); }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t) ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; f(); });
    for (auto& t : ts) t.join();
    for (unsigned w = 0; w < threads / 32; ++w) delete g_warp_bar[w];
}
// Run f on every block of grid with `threads` threads each, one block after another.
inline void launch(dim3 grid, unsigned threads, const std::function<void()>& f) {
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) run_block(grid, {x, y, z}, threads, f);
}
