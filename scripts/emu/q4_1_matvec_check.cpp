// Harness appended to a rendered decode.cu (THIN_WEIGHTS_q4_1) by scripts/emu/run_quant.sh: the
// Q4_1 matvec kernels (down_residual, norm_gateup) and dequant, over the layout the runtime
// uploads (16 nibble bytes a block, then the f16 (d, m) pairs), against a float64 reference of
// q * d + m on random nibbles and f16 scales (subnormal ones included).
#include <cstdio>
#include <random>
static double f16(unsigned short h) { int e = (h >> 10) & 31, m = h & 1023; double v = e == 0 ? m * std::ldexp(1.0, -24) : (1 + m / 1024.0) * std::ldexp(1.0, e - 15); return (h & 0x8000) ? -v : v; }
int main() {
    using namespace w_q4_1;
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> byte(0, 255), ex(5, 14), mant(0, 1023);
    std::normal_distribution<float> nd(0.f, 1.f);
    struct T { std::vector<unsigned char> b; std::vector<double> w; };
    auto tensor = [&](int rows, int cols) {
        size_t n = (size_t)rows * cols, off = (n / 2 + 63) & ~(size_t)63;
        T t; t.b.resize(off + n / 32 * 4); t.w.resize(n);
        for (size_t i = 0; i < n / 2; ++i) t.b[i] = byte(rng);
        for (size_t k = 0; k < n / 32; ++k) {
            unsigned short d = (unsigned short)((k % 53 == 0 ? 0 : ex(rng)) << 10 | mant(rng)), m = (unsigned short)(0x8000 | ex(rng) << 10 | mant(rng));
            memcpy(&t.b[off + 4 * k], &d, 2); memcpy(&t.b[off + 4 * k + 2], &m, 2);
        }
        for (size_t i = 0; i < n; ++i) {
            size_t b = i / 32; unsigned j = i % 32; unsigned char by = t.b[b * 16 + (j & 15)]; unsigned q = j < 16 ? by & 15 : by >> 4;
            unsigned short d, m; memcpy(&d, &t.b[off + 4 * b], 2); memcpy(&m, &t.b[off + 4 * b + 2], 2);
            t.w[i] = q * f16(d) + f16(m);
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
        launch({8, 1, 1}, MATVEC_THREADS, [&] { down_residual_q4_1(act.data(), w.b.data(), x.data()); });
        std::vector<double> want(HIDDEN);
        for (int r = 0; r < HIDDEN; ++r) { double s = 0; for (int k = 0; k < FFN; ++k) s += w.w[(size_t)r * FFN + k] * act[k]; want[r] = x0[r] + s; }
        check("down_residual", x, want);
    }
    {
        T wg = tensor(FFN, HIDDEN), wu = tensor(FFN, HIDDEN);
        std::vector<float> x(HIDDEN), g(HIDDEN), act(FFN);
        for (auto& v : x) v = nd(rng); for (auto& v : g) v = 1 + 0.1f * nd(rng);
        launch({8, 1, 1}, MATVEC_THREADS, [&] { norm_gateup_q4_1(x.data(), g.data(), wg.b.data(), wu.b.data(), act.data()); });
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
        launch({2, 1, 1}, 256, [&] { dequant_q4_1(w.b.data(), R, C, out.data()); });
        for (int i = 0; i < R * C; ++i) { unsigned u = (unsigned)out[i] << 16; float f; memcpy(&f, &u, 4);
            if (std::fabs(f - w.w[i]) > std::fabs(w.w[i]) / 256 + std::ldexp(1.0, -133)) { printf("dequant %d: got %g want %g FAIL\n", i, f, w.w[i]); return 1; } }
        printf("dequant ok\n");
    }
}
