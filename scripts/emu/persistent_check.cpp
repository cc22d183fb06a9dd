// Harness appended to a rendered decode_bf16.cu by scripts/emu/persistent.sh (see there): one
// decode step by the persistent kernel against the same step by the kernel-per-op launches
// (embed, per layer norm_qkv | attn_decode | o_residual | norm_gateup | down_residual,
// norm_lm_head, argmax_step) on the same random weights, cache and token. The two compute every
// output with the same per-row arithmetic, so they must agree exactly: logits, the new KV rows,
// the residual stream, the token and the position. The persistent kernel runs in grids of 1 and
// of 3 blocks; with 3, each block is a process of its own (its own shared memory; every device
// buffer in one shared mapping), all at once, so the grid barrier is exercised for real.
#include <cstdio>
#include <random>
#include <csignal>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
// Device memory: one MAP_SHARED arena, so that forked block processes see each other's writes.
static char* g_arena;
static size_t g_used, g_size;
template <class T>
struct Shared {
    using value_type = T;
    Shared() = default;
    template <class U> Shared(const Shared<U>&) {}
    T* allocate(size_t n) {
        size_t at = (g_used + 63) & ~size_t(63);
        if (at + n * sizeof(T) > g_size) { fprintf(stderr, "arena full\n"); exit(2); }
        g_used = at + n * sizeof(T);
        return reinterpret_cast<T*>(g_arena + at);
    }
    void deallocate(T*, size_t) {}
    template <class U> bool operator==(const Shared<U>&) const { return true; }
};
template <class T> using Vec = std::vector<T, Shared<T>>;
int main() {
    g_size = (size_t)3 << 30;
    g_arena = (char*)mmap(nullptr, g_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (g_arena == MAP_FAILED) { perror("mmap"); return 2; }
    const int CTXN = 64, SPLITS = 4, POS = 37;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto bf = [](float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (bf16_t)(u >> 16); };
    auto wmat = [&](size_t n, float a) { Vec<W> v(n); for (auto& x : v) x = bf(a * nd(rng)); return v; };
    auto norm = [&](size_t n) { Vec<float> v(n); for (auto& x : v) x = 1.0f + 0.1f * nd(rng); return v; };
    Vec<W> emb = wmat((size_t)VOCAB * HIDDEN, 1.0f);
    Vec<float> out_norm = norm(HIDDEN);
    Vec<float> cos_t((size_t)CTXN * HEAD_DIM / 2), sin_t(cos_t.size());
    for (int p = 0; p < CTXN; ++p) for (int i = 0; i < HEAD_DIM / 2; ++i) {
        double f = pow(10000.0, -2.0 * i / HEAD_DIM); cos_t[p * HEAD_DIM / 2 + i] = cos(p * f); sin_t[p * HEAD_DIM / 2 + i] = sin(p * f); }
    struct Layer { Vec<float> an, fn, qn, kn; Vec<W> wq, wk, wv, wo, wg, wu, wd; Vec<bf16_t> kc, vc; };
    Vec<Layer> L(NUM_LAYERS);
    const float ws = 1.0f / sqrtf((float)HIDDEN);
    for (auto& l : L) {
        l.an = norm(HIDDEN); l.fn = norm(HIDDEN); l.qn = norm(HEAD_DIM); l.kn = norm(HEAD_DIM);
        l.wq = wmat((size_t)Q_DIM * HIDDEN, ws); l.wk = wmat((size_t)KV_DIM * HIDDEN, ws); l.wv = wmat((size_t)KV_DIM * HIDDEN, ws);
        l.wo = wmat((size_t)HIDDEN * Q_DIM, ws); l.wg = wmat((size_t)FFN * HIDDEN, ws); l.wu = wmat((size_t)FFN * HIDDEN, ws);
        l.wd = wmat((size_t)HIDDEN * FFN, 1.0f / sqrtf((float)FFN));
        l.kc = wmat((size_t)CTXN * KV_DIM, 1.0f); l.vc = wmat((size_t)CTXN * KV_DIM, 1.0f);
    }
    // Everything a kernel writes lives in the shared arena too (forked blocks write it).
    struct State { Vec<float> x, qkv, att, act, logits, part, arg; Vec<int> count; Vec<int> tok_pos; Vec<unsigned> bar; };
    auto fresh = [&] {
        State* s = Shared<State>().allocate(1);
        new (s) State{Vec<float>(HIDDEN), Vec<float>(QKV_DIM), Vec<float>(Q_DIM), Vec<float>(FFN), Vec<float>(VOCAB),
                      Vec<float>((size_t)HEADS * SPLITS * (HEAD_DIM + 2)), Vec<float>(8192), Vec<int>(HEADS, 0), Vec<int>{11, POS}, Vec<unsigned>(2, 0)};
        return s;
    };
    const int use_rope = 1, window = 0;
    // Kernel-per-op step, on copy A of the caches.
    Vec<Layer> A = L;
    State& a = *fresh();
    int* atok = &a.tok_pos[0];
    int* apos = &a.tok_pos[1];
    launch({2, 1, 1}, 256, [&] { embed(emb.data(), atok, a.x.data()); });
    for (int l = 0; l < NUM_LAYERS; ++l) {
        Layer& y = A[l];
        launch({3, 1, 1}, MATVEC_THREADS, [&] { norm_qkv(a.x.data(), y.an.data(), y.wq.data(), y.wk.data(), y.wv.data(), a.qkv.data()); });
        launch({HEADS, SPLITS, 1}, ATTN_WARPS * 32, [&] {
            attn_decode(a.qkv.data(), y.qn.data(), y.kn.data(), cos_t.data(), sin_t.data(), apos, y.kc.data(), y.vc.data(), use_rope, window,
                        a.part.data(), a.count.data(), a.att.data());
        });
        launch({3, 1, 1}, MATVEC_THREADS, [&] { o_residual(a.att.data(), y.wo.data(), a.x.data()); });
        launch({3, 1, 1}, MATVEC_THREADS, [&] { norm_gateup(a.x.data(), y.fn.data(), y.wg.data(), y.wu.data(), a.act.data()); });
        launch({3, 1, 1}, MATVEC_THREADS, [&] { down_residual(a.act.data(), y.wd.data(), a.x.data()); });
    }
    const int head_blocks = 5;
    launch({head_blocks, 1, 1}, MATVEC_THREADS, [&] { norm_lm_head(a.x.data(), out_norm.data(), emb.data(), a.logits.data(), a.arg.data()); });
    launch({1, 1, 1}, 1024, [&] { argmax_step(a.arg.data(), head_blocks, atok, apos); });

    int bad = 0;
    auto same = [&](const char* what, const auto& u, const auto& v) {
        size_t n = 0; for (size_t i = 0; i < u.size(); ++i) if (memcmp(&u[i], &v[i], sizeof(u[i])) != 0) ++n;
        if (n) { ++bad; printf("%s: %zu of %zu differ; ", what, n, u.size()); }
    };
    double mx = 0; for (float v : a.logits) mx = std::max(mx, (double)fabs(v));
    printf("%d layers, pos %d: tok %d, |logits| max %.3g\n", NUM_LAYERS, POS, *atok, mx);
    // The persistent step on a fresh copy B of the caches, in a grid of G blocks.
    for (unsigned G : {1u, 3u}) {
        Vec<Layer> B = L;
        State& b = *fresh();
        Vec<LayerArgs> table(NUM_LAYERS);
        for (int l = 0; l < NUM_LAYERS; ++l) {
            Layer& y = B[l];
            table[l] = LayerArgs{y.an.data(), y.wq.data(), y.wk.data(), y.wv.data(), y.wo.data(), y.fn.data(), y.wg.data(), y.wu.data(), y.wd.data(),
                                 y.qn.data(), y.kn.data(), cos_t.data(), sin_t.data(), y.kc.data(), y.vc.data(), use_rope, window};
        }
        auto body = [&] {
            decode_persistent(table.data(), emb.data(), out_norm.data(), emb.data(), &b.tok_pos[0], &b.tok_pos[1], b.x.data(), b.qkv.data(),
                              b.att.data(), b.act.data(), b.logits.data(), b.part.data(), b.count.data(), b.arg.data(), b.bar.data(), SPLITS);
        };
        std::vector<pid_t> kids;
        for (unsigned g = 0; g < G; ++g) {
            pid_t pid = fork();
            if (pid == 0) { run_block({G, 1, 1}, {g, 0, 0}, MATVEC_THREADS, body); _exit(0); }
            kids.push_back(pid);
        }
        bool hung = false;
        for (int waited = 0; !kids.empty(); ) {
            int st;
            pid_t done = waitpid(-1, &st, WNOHANG);
            if (done > 0) {
                kids.erase(std::find(kids.begin(), kids.end(), done));
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { ++bad; printf("a block process failed; "); }
                continue;
            }
            if (++waited > 1200) {  // 10 minutes
                hung = true;
                for (pid_t k : kids) kill(k, SIGKILL);
                for (pid_t k : kids) waitpid(k, &st, 0);
                break;
            }
            usleep(500000);
        }
        printf("  persistent, grid %u: ", G);
        if (hung) { ++bad; printf("HUNG (killed after 10 minutes)\n"); continue; }
        const int before = bad;
        same("logits", a.logits, b.logits);
        same("x", a.x, b.x);
        for (int l = 0; l < NUM_LAYERS; ++l) { same("k cache", A[l].kc, B[l].kc); same("v cache", A[l].vc, B[l].vc); }
        same("attn counters", a.count, b.count);
        if (a.tok_pos[0] != b.tok_pos[0] || b.tok_pos[1] != POS + 1) { ++bad; printf("tok/pos %d/%d; ", b.tok_pos[0], b.tok_pos[1]); }
        if (b.bar[0] != 0) { ++bad; printf("barrier count left at %u; ", b.bar[0]); }
        printf("%u barrier generations, %s\n", b.bar[1], bad == before ? "identical" : "MISMATCH");
    }
    return bad != 0;
}
