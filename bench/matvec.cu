// The decode matvec kernels alone (bench/matvec.sh builds and runs this): norm_gateup_<type> and
// down_residual_<type> of one rendered decode.cu (KSRC, included whole), for each weight type, at
// that arch's HIDDEN and FFN, random valid weights in the layout the runtime uploads, rotated over
// copies that together exceed L2, 300 launches timed with events. One JSON line per kernel (weight
// GB/s), the device-to-device copy rate of the same run (bytes read + written), and each kernel's
// output of one launch written to OUTDIR/TAG_<kernel>_<type>.f32 for comparison between builds.
//   matvec TAG OUTDIR
#define THIN_WEIGHTS_bf16 1
#define THIN_WEIGHTS_f8_e4m3 1
#define THIN_WEIGHTS_mxfp4 1
#define THIN_WEIGHTS_q8_0 1
#define THIN_WEIGHTS_q4_1 1
#include KSRC
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>
#include <random>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)
static size_t a64(size_t n) { return (n + 63) & ~(size_t)63; }
struct Ty { const char* name; int vec; };
// bytes of a [rows, cols] tensor in the device layout, filled with valid random data
static std::vector<unsigned char> make(const char* t, int rows, int cols, std::mt19937& g) {
    std::string s(t); size_t n = (size_t)rows * cols; std::vector<unsigned char> b;
    auto rnd = [&](size_t k) { std::vector<unsigned char> v(k); for (auto& x : v) x = g() & 0xff; return v; };
    if (s == "bf16") { b.resize(n * 2); for (size_t i = 0; i < n; ++i) { unsigned short h = 0x3c00 | (g() & 0x807f); memcpy(&b[2 * i], &h, 2); } }
    else if (s == "f8_e4m3") { b = rnd(n); for (auto& x : b) if ((x & 0x7f) == 0x7f) x ^= 1; b.resize(a64(n) + rows * 4); for (int r = 0; r < rows; ++r) { float f = 1.0f / 256; memcpy(&b[a64(n) + 4 * r], &f, 4); } }
    else if (s == "mxfp4") { b = rnd(n / 2); size_t e = a64(n / 2); b.resize(e + n / 32); for (size_t i = 0; i < n / 32; ++i) b[e + i] = 118 + g() % 6; size_t p = a64(e + n / 32); b.resize(p + rows * 2); for (int r = 0; r < rows; ++r) { b[p + 2 * r] = 0x80; b[p + 2 * r + 1] = 0x3f; } }
    else if (s == "q8_0") { b = rnd(n); size_t o = a64(n); b.resize(o + n / 32 * 2); for (size_t i = 0; i < n / 32; ++i) { b[o + 2 * i] = 0; b[o + 2 * i + 1] = 0x20; } }
    else if (s == "q4_1") { b = rnd(n / 2); size_t o = a64(n / 2); b.resize(o + n / 32 * 4); for (size_t i = 0; i < n / 32; ++i) { b[o + 4 * i] = 0; b[o + 4 * i + 1] = 0x20; b[o + 4 * i + 2] = 0; b[o + 4 * i + 3] = 0xa0; } }
    return b;
}
static int group_threads(int in, int vec, int nr) { int nv = in / vec; for (int t : {32, 64, 128}) if (nr * ((nv + t - 1) / t) <= 8) return t; return 256; }
static int grid(int in, int rows, int nr, int vec, int sms) { int need = (rows + MATVEC_THREADS / group_threads(in, vec, nr) - 1) / (MATVEC_THREADS / group_threads(in, vec, nr)); return std::min(std::min(need, sms * 4), 4096); }
template <typename K> void run(const char* tag, const char* kname, const char* t, int vec, int in, int rows, int nr, int sms, K launch, const char* out) {
    std::mt19937 g(7);
    size_t bytes1 = make(t, rows, in, g).size();
    int copies = std::max(2, (int)(400e6 / (bytes1 * nr)) );
    std::vector<unsigned char*> w(copies * nr);
    for (auto& p : w) { auto h = make(t, rows, in, g); CK(cudaMalloc(&p, h.size())); CK(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice)); }
    int gr = grid(in, rows, nr, vec, sms);
    for (int i = 0; i < 5; ++i) launch(gr, w.data() + (i % copies) * nr);
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    int reps = getenv("NCU") ? 2 : 300;
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) launch(gr, w.data() + (i % copies) * nr);
    cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b);
    double us = ms * 1e3 / reps;
    printf("{\"tag\":\"%s\",\"kernel\":\"%s\",\"type\":\"%s\",\"rows\":%d,\"in\":%d,\"grid\":%d,\"us\":%.2f,\"weight_gb_s\":%.0f}\n", tag, kname, t, rows, in, gr, us, bytes1 * nr / us / 1e3);
    for (auto p : w) cudaFree(p);
}
int main(int argc, char** argv) {
    const char* tag = argv[1]; std::string outdir = argv[2];
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float *x, *gm, *act, *res; CK(cudaMalloc(&x, HIDDEN * 4)); CK(cudaMalloc(&gm, HIDDEN * 4)); CK(cudaMalloc(&act, FFN * 4)); CK(cudaMalloc(&res, HIDDEN * 4));
    { std::mt19937 g(3); std::vector<float> h(FFN); for (auto& v : h) v = (g() % 2001 - 1000) / 500.0f; CK(cudaMemcpy(x, h.data(), HIDDEN * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(act, h.data(), FFN * 4, cudaMemcpyHostToDevice)); for (auto& v : h) v = 1.0f; CK(cudaMemcpy(gm, h.data(), HIDDEN * 4, cudaMemcpyHostToDevice)); }
    float* actout; CK(cudaMalloc(&actout, FFN * 4));
    // copy rate, counted as bytes read + written
    { size_t n = 1ull << 30; void *s, *d; CK(cudaMalloc(&s, n)); CK(cudaMalloc(&d, n)); cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice); cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); cudaEventRecord(a); for (int i = 0; i < 5; ++i) cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); printf("{\"tag\":\"%s\",\"copy_gb_s\":%.0f}\n", tag, 2.0 * 5 * n / ms / 1e6); cudaFree(s); cudaFree(d); }
#define BOTH(T, VEC) \
    run(tag, "norm_gateup", #T, VEC, HIDDEN, FFN, 2, sms, [&](int gr, unsigned char** w) { w_##T::norm_gateup_##T<<<gr, MATVEC_THREADS>>>(x, gm, (const w_##T::W*)w[0], (const w_##T::W*)w[1], actout); }, ""); \
    { std::vector<float> o(FFN); CK(cudaMemcpy(o.data(), actout, FFN * 4, cudaMemcpyDeviceToHost)); FILE* f = fopen((outdir + "/" + tag + "_gateup_" #T ".f32").c_str(), "wb"); fwrite(o.data(), 4, FFN, f); fclose(f); } \
    run(tag, "down_residual", #T, VEC, FFN, HIDDEN, 1, sms, [&](int gr, unsigned char** w) { CK(cudaMemsetAsync(res, 0, HIDDEN * 4)); w_##T::down_residual_##T<<<gr, MATVEC_THREADS>>>(act, (const w_##T::W*)w[0], res); }, ""); \
    { std::vector<float> o(HIDDEN); CK(cudaMemcpy(o.data(), res, HIDDEN * 4, cudaMemcpyDeviceToHost)); FILE* f = fopen((outdir + "/" + tag + "_down_" #T ".f32").c_str(), "wb"); fwrite(o.data(), 4, HIDDEN, f); fclose(f); }
    BOTH(bf16, 8) BOTH(f8_e4m3, 16) BOTH(mxfp4, 32) BOTH(q8_0, 16) BOTH(q4_1, 32)
    CK(cudaDeviceSynchronize());
    return 0;
}
