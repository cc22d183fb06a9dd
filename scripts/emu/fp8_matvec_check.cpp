// Harness appended to a rendered decode.cu (THIN_WEIGHTS_f8_e4m3) by scripts/emu/run_quant.sh: the
// FP8 matvec kernels (down_residual, norm_gateup) and dequant against a float64 reference of
// e4m3 * row scale, on random bytes (every code but the NaNs, subnormals included).
#include <cstdio>
#include <random>
static double e4m3(unsigned b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
    return s ? -v : v;
}
int main() {
    using namespace w_f8_e4m3;
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> byte(0, 255);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto tensor = [&](int rows, int cols, std::vector<float>& scale) {
        size_t off = ((size_t)rows * cols + 63) & ~(size_t)63;
        std::vector<unsigned char> t(off + rows * 4);
        for (size_t i = 0; i < (size_t)rows * cols; ++i) { int b; do b = byte(rng); while ((b & 0x7f) == 0x7f); t[i] = b; }
        scale.resize(rows);
        for (int r = 0; r < rows; ++r) { scale[r] = std::ldexp(1.0f + 0.5f * std::fabs(nd(rng)), -8 - r % 5); memcpy(&t[off + 4 * r], &scale[r], 4); }
        return t;
    };
    double worst = 0;
    auto cmp = [&](const char* what, double got, double want, double mag) { double e = std::fabs(got - want) / (mag + 1e-30); worst = std::max(worst, e); if (e > 1e-5) { printf("%s: got %g want %g\n", what, got, want); std::exit(1); } };
    // down_residual: x += Wd act
    {
        std::vector<float> sc; auto w = tensor(HIDDEN, FFN, sc);
        std::vector<float> act(FFN), x(HIDDEN), x0;
        for (auto& a : act) a = nd(rng) * 3; for (auto& v : x) v = nd(rng); x0 = x;
        launch({8, 1, 1}, MATVEC_THREADS, [&] { down_residual_f8_e4m3(act.data(), w.data(), x.data()); });
        double mag = 0; std::vector<double> want(HIDDEN);
        for (int r = 0; r < HIDDEN; ++r) { double s = 0; for (int k = 0; k < FFN; ++k) s += e4m3(w[(size_t)r * FFN + k]) * act[k]; want[r] = x0[r] + s * sc[r]; mag = std::max(mag, std::fabs(want[r])); }
        for (int r = 0; r < HIDDEN; ++r) cmp("down_residual", x[r], want[r], mag);
    }
    // norm_gateup: act = silu(Wg n) * (Wu n)
    {
        std::vector<float> sg, su; auto wg = tensor(FFN, HIDDEN, sg); auto wu = tensor(FFN, HIDDEN, su);
        std::vector<float> x(HIDDEN), g(HIDDEN), act(FFN);
        for (auto& v : x) v = nd(rng); for (auto& v : g) v = 1 + 0.1f * nd(rng);
        launch({8, 1, 1}, MATVEC_THREADS, [&] { norm_gateup_f8_e4m3(x.data(), g.data(), wg.data(), wu.data(), act.data()); });
        double ss = 0; for (float v : x) ss += (double)v * v; double inv = 1 / std::sqrt(ss / HIDDEN + EPS);
        std::vector<double> want(FFN); double mag = 0;
        for (int r = 0; r < FFN; ++r) {
            double a = 0, b = 0;
            for (int k = 0; k < HIDDEN; ++k) { double n = x[k] * inv * g[k]; a += e4m3(wg[(size_t)r * HIDDEN + k]) * n; b += e4m3(wu[(size_t)r * HIDDEN + k]) * n; }
            a *= sg[r]; b *= su[r];
            want[r] = a / (1 + std::exp(-a)) * b; mag = std::max(mag, std::fabs(want[r]));
        }
        for (int r = 0; r < FFN; ++r) cmp("norm_gateup", act[r], want[r], mag);
    }
    // dequant: bf16(e4m3 * scale)
    {
        const int R = 7, C = 64; std::vector<float> sc; auto w = tensor(R, C, sc);
        std::vector<bf16_t> out(R * C);
        launch({2, 1, 1}, 256, [&] { dequant_f8_e4m3(w.data(), R, C, out.data()); });
        for (int i = 0; i < R * C; ++i) { unsigned u = (unsigned)out[i] << 16; float f; memcpy(&f, &u, 4); double want = e4m3(w[i]) * sc[i / C];
            if (std::fabs(f - want) > std::fabs(want) / 256) { printf("dequant: got %g want %g\n", f, want); return 1; } }
    }
    printf("fp8 kernels match (worst rel %.2e)\n", worst);
}
