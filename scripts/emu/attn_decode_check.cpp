// Harness appended to a rendered decode_bf16.cu by scripts/emu/run.sh (see there).
#include <cstdio>
#include <random>
// kernel source included after emu.h by the build line
int main(int argc, char** argv) {
    const int SPLITS = 64, CTXN = 4096;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> qkv(QKV_DIM), cos_t((size_t)CTXN * HEAD_DIM / 2), sin_t(cos_t.size());
    for (int p = 0; p < CTXN; ++p) for (int i = 0; i < HEAD_DIM / 2; ++i) {
        double f = pow(10000.0, -2.0 * i / HEAD_DIM); cos_t[p * HEAD_DIM / 2 + i] = cos(p * f); sin_t[p * HEAD_DIM / 2 + i] = sin(p * f); }
    std::vector<bf16_t> kc((size_t)CTXN * KV_DIM), vc(kc.size());
    std::vector<float> part((size_t)HEADS * SPLITS * (HEAD_DIM + 2), NAN), att(Q_DIM);
    std::vector<int> count(HEADS, 0);
    std::vector<float> qn(HEAD_DIM), kn(HEAD_DIM);  // QK-norm weights (read only where the arch has QK-norm)
    for (int i = 0; i < HEAD_DIM; ++i) { qn[i] = 1.0f + 0.1f * nd(rng); kn[i] = 1.0f + 0.1f * nd(rng); }
    // QK-norm as the CPU reference does it, where the arch has it (run.sh sets QK_NORM).
    auto qk_norm = [&](std::vector<double>& v, const std::vector<float>& g) {
        if (!QK_NORM) return;
        float ss = 0; for (int i = 0; i < HEAD_DIM; ++i) ss += (float)v[i] * (float)v[i];
        double inv = 1.0 / sqrt(ss / HEAD_DIM + EPS); for (int i = 0; i < HEAD_DIM; ++i) v[i] = (float)v[i] * inv * g[i]; };
    auto bf = [](float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (bf16_t)(u >> 16); };
    auto fb = [](bf16_t b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; };
    std::vector<int> positions = argc > 1 ? std::vector<int>{150, 257, 329, 2000} : std::vector<int>{0, 5, 150, 255, 256, 257, 300, 329, 1000, 2000, 4095};
    double worst = 0; int bad = 0;
    for (int use_rope = argc > 1; use_rope < 2; ++use_rope)
    for (int pos : positions) for (int window : argc > 1 ? std::vector<int>{0, 40} : std::vector<int>{0, 40, 512}) {
        for (auto& x : kc) x = bf(nd(rng)); for (auto& x : vc) x = bf(nd(rng));
        for (auto& x : qkv) x = nd(rng);
        std::fill(att.begin(), att.end(), NAN);
        int posv = pos;
        auto kc0 = kc;
        launch({HEADS, SPLITS, 1}, ATTN_WARPS * 32, [&] {
            attn_decode(qkv.data(), qn.data(), kn.data(), cos_t.data(), sin_t.data(), &posv, kc.data(), vc.data(), use_rope, window, part.data(), count.data(), att.data());
        });
        // reference
        auto rot = [&](std::vector<double>& v) { if (!use_rope) return; int H = HEAD_DIM / 2;
            for (int i = 0; i < H; ++i) { double c = cos_t[pos * H + i], s = sin_t[pos * H + i], a = v[i], b = v[i + H]; v[i] = a * c - b * s; v[i + H] = b * c + a * s; } };
        for (int kvh = 0; kvh < KV_HEADS; ++kvh) {
            std::vector<double> k(HEAD_DIM); for (int i = 0; i < HEAD_DIM; ++i) k[i] = qkv[Q_DIM + kvh * HEAD_DIM + i];
            qk_norm(k, kn);
            rot(k);
            for (int i = 0; i < HEAD_DIM; ++i) {
                float kf = (float)k[i];
                // Exact without QK-norm; with it, one bf16 step of slack (the kernel's float sum of
                // squares may round the row the other way).
                const bf16_t got = kc[(size_t)pos * KV_DIM + kvh * HEAD_DIM + i];
                if (QK_NORM ? fabs(fb(got) - kf) > fabs(kf) / 128 + 1e-6 : got != bf(kf)) { if (bad++ < 5) printf("k row mismatch pos %d\n", pos); }
                if (vc[(size_t)pos * KV_DIM + kvh * HEAD_DIM + i] != bf(qkv[Q_DIM + KV_DIM + kvh * HEAD_DIM + i])) { if (bad++ < 5) printf("v row mismatch\n"); }
            }
        }
        for (size_t i = 0; i < kc.size(); ++i) if (i / KV_DIM != (size_t)pos && (kc[i] != kc0[i])) { if (bad++ < 5) printf("other row changed\n"); }
        int first = window > 0 ? std::max(0, pos + 1 - window) : 0;
        for (int h = 0; h < HEADS; ++h) {
            int kvh = h / (HEADS / KV_HEADS);
            std::vector<double> q(HEAD_DIM); for (int i = 0; i < HEAD_DIM; ++i) q[i] = qkv[h * HEAD_DIM + i]; qk_norm(q, qn); rot(q);
            std::vector<double> sc;
            double mx = -1e300;
            for (int p = first; p <= pos; ++p) { double s = 0; for (int i = 0; i < HEAD_DIM; ++i) s += q[i] * ATTN_SCALE * fb(kc[(size_t)p * KV_DIM + kvh * HEAD_DIM + i]); sc.push_back(s); mx = std::max(mx, s); }
            double L = 0; for (auto& s : sc) { s = exp(s - mx); L += s; }
            for (int d = 0; d < HEAD_DIM; ++d) {
                double a = 0; for (int p = first; p <= pos; ++p) a += sc[p - first] * fb(vc[(size_t)p * KV_DIM + kvh * HEAD_DIM + d]);
                a /= L; double e = fabs(a - att[h * HEAD_DIM + d]); if (!(e < 1e-4)) { if (bad++ < 10) printf("att mismatch pos %d win %d rope %d h %d d %d: %g vs %g\n", pos, window, use_rope, h, d, a, att[h*HEAD_DIM+d]); }
                worst = std::max(worst, std::isnan(e) ? 1e9 : e);
            }
        }
        for (int h = 0; h < HEADS; ++h) if (count[h] != 0) { if (bad++ < 5) printf("count not reset\n"); }
    }
    // qk_rope_kv (prefill and the unfused step): 3 rows at positions p..p+2, in place, plus the cache rows.
    for (int use_rope = 0; use_rope < 2; ++use_rope) for (int p : {0, 300}) {
        const int R = 3;
        std::vector<float> rows((size_t)R * QKV_DIM); for (auto& x : rows) x = nd(rng);
        auto rows0 = rows;
        int pv = p;
        launch({R, 1, 1}, 256, [&] { qk_rope_kv(rows.data(), qn.data(), kn.data(), cos_t.data(), sin_t.data(), &pv, kc.data(), vc.data(), use_rope); });
        for (int r = 0; r < R; ++r) for (int hh = 0; hh < HEADS + KV_HEADS; ++hh) {
            const int at = p + r;
            std::vector<double> v(HEAD_DIM); for (int i = 0; i < HEAD_DIM; ++i) v[i] = rows0[(size_t)r * QKV_DIM + hh * HEAD_DIM + i];
            qk_norm(v, hh < HEADS ? qn : kn);
            if (use_rope) { int H = HEAD_DIM / 2; for (int i = 0; i < H; ++i) { double c = cos_t[at * H + i], s = sin_t[at * H + i], a = v[i], b = v[i + H]; v[i] = a * c - b * s; v[i + H] = b * c + a * s; } }
            for (int i = 0; i < HEAD_DIM; ++i) {
                double e = fabs(v[i] - rows[(size_t)r * QKV_DIM + hh * HEAD_DIM + i]); worst = std::max(worst, e);
                if (!(e < 1e-4)) { if (bad++ < 10) printf("qk_rope_kv mismatch row %d head %d\n", r, hh); }
            }
        }
        for (int r = 0; r < R; ++r) for (int i = 0; i < KV_DIM; ++i) {
            if (kc[(size_t)(p + r) * KV_DIM + i] != bf(rows[(size_t)r * QKV_DIM + Q_DIM + i]) || vc[(size_t)(p + r) * KV_DIM + i] != bf(rows[(size_t)r * QKV_DIM + Q_DIM + KV_DIM + i])) { if (bad++ < 10) printf("qk_rope_kv cache row mismatch\n"); }
        }
    }
    printf("worst abs err %g, bad %d\n", worst, bad);
    return bad != 0;
}
