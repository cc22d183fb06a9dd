// Harness appended to a rendered decode.cu (THIN_WEIGHTS_mxfp4) by scripts/emu/run_quant.sh: the
// MXFP4 matvec kernels (down_residual, norm_gateup) and dequant against a float64 reference of
// e2m1 * 2^(e - 127) * postscale, on random codes (all 16), scales and postscales.
#include <cstdio>
#include <random>
static double e2m1(unsigned c) { static const double v[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; return (c & 8) ? -v[c & 7] : v[c & 7]; }
int main() {
    using namespace w_mxfp4;
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> byte(0, 255), ex(110, 130);
    std::normal_distribution<float> nd(0.f, 1.f);
    struct T { std::vector<unsigned char> b; std::vector<double> w; };
    auto tensor = [&](int rows, int cols) {
        size_t e = ((size_t)rows * cols / 2 + 63) & ~(size_t)63, p = (e + (size_t)rows * cols / 32 + 63) & ~(size_t)63;
        T t; t.b.resize(p + 2 * rows); t.w.resize((size_t)rows * cols);
        for (size_t i = 0; i < (size_t)rows * cols / 2; ++i) t.b[i] = byte(rng);
        for (size_t i = 0; i < (size_t)rows * cols / 32; ++i) t.b[e + i] = i % 97 == 0 ? 0 : ex(rng);
        std::vector<float> post(rows);
        for (int r = 0; r < rows; ++r) { float f = 0.8f + 0.4f * std::fabs(nd(rng)); unsigned u; memcpy(&u, &f, 4); u &= 0xffff0000u; memcpy(&post[r], &u, 4); bf16_t h = u >> 16; memcpy(&t.b[p + 2 * r], &h, 2); }
        for (int r = 0; r < rows; ++r) for (int c = 0; c < cols; ++c) {
            size_t k = (size_t)r * cols + c; unsigned code = (t.b[k / 2] >> (4 * (k & 1))) & 15;
            t.w[k] = e2m1(code) * std::ldexp(1.0, (int)t.b[e + k / 32] - 127) * post[r];
        }
        return t;
    };
    auto check = [](const char* what, const std::vector<float>& got, const std::vector<double>& want) {
        double mag = 0, worst = 0; for (double w : want) mag = std::max(mag, std::fabs(w));
        for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]) / mag);
        printf("%s worst rel %.2e; ", what, worst); if (worst > 1e-5) { printf("FAIL\n"); std::exit(1); }
    };
    {
        T w = tensor(HIDDEN, FFN);
        std::vector<float> act(FFN), x(HIDDEN), x0;
        for (auto& a : act) a = nd(rng) * 3; for (auto& v : x) v = nd(rng); x0 = x;
        launch({8, 1, 1}, MATVEC_THREADS, [&] { down_residual_mxfp4(act.data(), w.b.data(), x.data()); });
        std::vector<double> want(HIDDEN);
        for (int r = 0; r < HIDDEN; ++r) { double s = 0; for (int k = 0; k < FFN; ++k) s += w.w[(size_t)r * FFN + k] * act[k]; want[r] = x0[r] + s; }
        check("down_residual", x, want);
    }
    {
        T wg = tensor(FFN, HIDDEN), wu = tensor(FFN, HIDDEN);
        std::vector<float> x(HIDDEN), g(HIDDEN), act(FFN);
        for (auto& v : x) v = nd(rng); for (auto& v : g) v = 1 + 0.1f * nd(rng);
        launch({8, 1, 1}, MATVEC_THREADS, [&] { norm_gateup_mxfp4(x.data(), g.data(), wg.b.data(), wu.b.data(), act.data()); });
        double ss = 0; for (float v : x) ss += (double)v * v; double inv = 1 / std::sqrt(ss / HIDDEN + EPS);
        std::vector<double> want(FFN);
        for (int r = 0; r < FFN; ++r) {
            double a = 0, b = 0;
            for (int k = 0; k < HIDDEN; ++k) { double n = x[k] * inv * g[k]; a += wg.w[(size_t)r * HIDDEN + k] * n; b += wu.w[(size_t)r * HIDDEN + k] * n; }
            want[r] = a / (1 + std::exp(-a)) * b;
        }
        check("norm_gateup", act, want);
    }
    {
        const int R = 5, C = 64; T w = tensor(R, C);
        std::vector<bf16_t> out(R * C);  // compared to 1/256 relative, plus bf16 subnormal spacing
        launch({2, 1, 1}, 256, [&] { dequant_mxfp4(w.b.data(), R, C, out.data()); });
        for (int i = 0; i < R * C; ++i) { unsigned u = (unsigned)out[i] << 16; float f; memcpy(&f, &u, 4);
            if (std::fabs(f - w.w[i]) > std::fabs(w.w[i]) / 256 + std::ldexp(1.0, -133)) { printf("dequant %d: got %g want %g FAIL\n", i, f, w.w[i]); return 1; } }
        printf("dequant ok\n");
    }
}
