// Harness appended to a rendered decode.cu by scripts/emu/run_moe.sh: qk_norm_whole (check_qk_norm_whole),
// and the mixture-of-experts kernels of one weight type (bf16, or FP8 e4m3 with f32 row scales under MOE_FP8) against a
// float64 reference, with and without renormalised weights, over 1, 3 and 17 rows: moe_router and
// moe_topk; the decode step's moe_gateup and moe_down (one row a block row, as decode runs them);
// and prefill's grouped path: moe_group (the lists, exactly), moe_gateup_grouped, moe_down_grouped
// and moe_combine, on grids sized as the plan sizes them (x over output groups, y the most tiles
// any routing makes). The 17-row case's inputs share most of their direction, so a few experts
// are chosen by many rows (more than a tile of them) and others by none. Every expert tensor is
// mapped PROT_NONE and only the experts the route chose are opened (and filled): a read of any
// other expert's rows is a segfault, reported as such, so the check also proves that only the
// chosen experts' rows are read.
#include <cstdio>
#include <random>
#include <csignal>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <fcntl.h>
#ifdef MOE_FP8
using namespace w_f8_e4m3;
#define KERNEL(name) name##_f8_e4m3
constexpr int EB = 1;  // bytes a weight
static const char* TYPE = "f8_e4m3";
#else
using namespace w_bf16;
#define KERNEL(name) name##_bf16
constexpr int EB = 2;
static const char* TYPE = "bf16";
#endif

static std::mt19937 rng(11);
static std::normal_distribution<float> nd(0.f, 1.f);
static std::uniform_int_distribution<int> byte(0, 255);

static double e4m3(unsigned b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
    return s ? -v : v;
}
static bf16_t to_bf(float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (bf16_t)(u >> 16); }
static double from_bf(bf16_t b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; }

// A stacked expert tensor [experts, rows, cols] as the runtime uploads it: values (row-major over
// experts * rows rows), then for FP8 (64-byte aligned) one f32 scale per row. Values start
// unmapped (PROT_NONE); open(e) maps expert e's rows and fills them with random weights.
struct Experts {
    int experts, rows, cols;
    unsigned char* base;
    size_t slice, scale_off, total;
    std::vector<bool> opened;
    Experts(int e, int r, int c) : experts(e), rows(r), cols(c), opened(e, false) {
        slice = (size_t)r * c * EB;
        scale_off = EB == 1 ? ((size_t)e * r * c + 63) & ~(size_t)63 : (size_t)e * slice;
        total = scale_off + (EB == 1 ? (size_t)e * r * 4 : 0);
        base = (unsigned char*)mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) { perror("mmap"); std::exit(1); }
        if (EB == 1) {  // the row scales: all readable (the kernels read only the chosen ones, but they share pages)
            size_t page = scale_off & ~(size_t)4095;
            mprotect(base + page, total - page, PROT_READ | PROT_WRITE);
            for (size_t i = 0; i < (size_t)e * r; ++i) { float s = std::ldexp(1.0f + 0.5f * std::fabs(nd(rng)), -6 - (int)(i % 3)); memcpy(base + scale_off + 4 * i, &s, 4); }
        }
    }
    // Expert e readable (filled with random weights the first time).
    void open(int e) {
        if (mprotect(base + e * slice, slice, PROT_READ | PROT_WRITE) != 0) { perror("mprotect"); std::exit(1); }
        if (opened[e]) return;
        opened[e] = true;
        const float amp = 1.0f / std::sqrt((float)cols);
        for (size_t i = 0; i < (size_t)rows * cols; ++i) {
            if (EB == 1) { int b; do b = byte(rng); while ((b & 0x7f) == 0x7f); base[e * slice + i] = (unsigned char)b; }
            else { bf16_t v = to_bf(amp * (2 * (nd(rng) > 0) - 1) * std::fabs(nd(rng))); memcpy(base + e * slice + 2 * i, &v, 2); }
        }
    }
    // Every expert unreadable again (contents kept): each case maps only its own route's.
    void close_all() {
        if (mprotect(base, (size_t)experts * slice, PROT_NONE) != 0) { perror("mprotect"); std::exit(1); }
    }
    double w(int e, int r, int c) const {
        size_t row = (size_t)e * rows + r, i = row * cols + c;
        if (EB == 1) { float s; memcpy(&s, base + scale_off + 4 * row, 4); return e4m3(base[i]) * s; }
        bf16_t v; memcpy(&v, base + 2 * i, 2); return from_bf(v);
    }
    const W* ptr() const { return reinterpret_cast<const W*>(base); }
};

static double worst = 0;
static void cmp(const char* what, int row, int i, double got, double want, double mag, double tol = 1e-5) {
    double e = std::fabs(got - want) / (mag + 1e-30);
    worst = std::max(worst, e);
    if (!(e <= tol)) { printf("%s row %d [%d]: got %.9g want %.9g (rel %.3g)\n", what, row, i, got, want, e); std::exit(1); }
}

static void segv(int) {
    const char m[] = "SEGFAULT: a kernel read an expert the route did not choose\n";
    if (write(2, m, sizeof m - 1)) {}
    _exit(1);
}

// The decode step's kernels over `rows` rows, then prefill's grouped ones, against float64:
// act_j = silu(Wg[e_j] n) * (Wu[e_j] n), x + sum_j w_j Wd[e_j] act_j (each path with its own act).
static void check_experts(int rows, const std::vector<float>& x, const std::vector<float>& g, const std::vector<std::vector<double>>& n,
                    const std::vector<int>& route, Experts& gate, Experts& up, Experts& down) {
    std::vector<double> want_act((size_t)rows * TOP_K * FFN), mag_act(rows);
    for (int r = 0; r < rows; ++r) for (int j = 0; j < TOP_K; ++j) {
        int e = route[r * MOE_ROUTE + j];
        for (int i = 0; i < FFN; ++i) {
            double a = 0, b = 0;
            for (int k = 0; k < HIDDEN; ++k) { a += gate.w(e, i, k) * n[r][k]; b += up.w(e, i, k) * n[r][k]; }
            double v = a / (1 + std::exp(-a)) * b;
            want_act[((size_t)r * TOP_K + j) * FFN + i] = v; mag_act[r] = std::max(mag_act[r], std::fabs(v));
        }
    }
    const auto check_act = [&](const char* what, const std::vector<float>& act) {
        for (int r = 0; r < rows; ++r) for (int i = 0; i < TOP_K * FFN; ++i) cmp(what, r, i, act[(size_t)r * TOP_K * FFN + i], want_act[(size_t)r * TOP_K * FFN + i], mag_act[r]);
    };
    const auto check_down = [&](const char* what, const std::vector<float>& act, const std::vector<float>& res) {
        for (int r = 0; r < rows; ++r) {
            std::vector<double> want(HIDDEN); double mag = 0;
            for (int i = 0; i < HIDDEN; ++i) {
                double s = x[r * HIDDEN + i];
                for (int j = 0; j < TOP_K; ++j) {
                    int e = route[r * MOE_ROUTE + j]; float wj; memcpy(&wj, &route[r * MOE_ROUTE + TOP_K + j], 4);
                    double d = 0; for (int k = 0; k < FFN; ++k) d += down.w(e, i, k) * act[((size_t)r * TOP_K + j) * FFN + k];
                    s += wj * d;
                }
                want[i] = s; mag = std::max(mag, std::fabs(s));
            }
            for (int i = 0; i < HIDDEN; ++i) cmp(what, r, i, res[r * HIDDEN + i], want[i], mag);
        }
    };
    // The decode step's kernels, a block row per row.
    std::vector<float> act((size_t)rows * TOP_K * FFN, NAN), res(x);
    launch({4, (unsigned)rows, 1}, MATVEC_THREADS, [&] { KERNEL(moe_gateup)(x.data(), g.data(), gate.ptr(), up.ptr(), route.data(), act.data()); });
    check_act("moe_gateup", act);
    launch({4, (unsigned)rows, 1}, MATVEC_THREADS, [&] { KERNEL(moe_down)(act.data(), down.ptr(), route.data(), res.data()); });
    check_down("moe_down", act, res);

    // Prefill's grouped kernels. The lists: each expert's pairs r * TOP_K + j, ascending.
    const int pairs = rows * TOP_K;
    std::vector<int> groups(EXPERTS + 1 + pairs, -1), want_groups(1, 0);
    launch({1, 1, 1}, 256, [&] { moe_group(route.data(), pairs, groups.data()); });
    std::vector<int> list;
    for (int e = 0; e < EXPERTS; ++e) {
        for (int p = 0; p < pairs; ++p) if (route[(p / TOP_K) * MOE_ROUTE + p % TOP_K] == e) list.push_back(p);
        want_groups.push_back((int)list.size());
    }
    want_groups.insert(want_groups.end(), list.begin(), list.end());
    if (groups != want_groups) { printf("moe_group rows %d: the lists differ from the route's\n", rows); std::exit(1); }
    // Grids as thin_core::cuda::plan::Layout::grid resolves Grid::ExpertTiles (8 output groups a block).
    const auto tiles = [&](int tile) { return (unsigned)((pairs + tile - 1) / tile + std::min(EXPERTS, pairs)); };
    const auto blocks_x = [](int out, int groups_per_pass) { return (unsigned)((out + 8 * groups_per_pass - 1) / (8 * groups_per_pass)); };
    std::vector<float> gact((size_t)rows * TOP_K * FFN, NAN), pdown((size_t)pairs * HIDDEN, NAN), gres(x);
    launch({blocks_x(FFN, Mv<HIDDEN, 2>::G), tiles(moe_tile<HIDDEN>()), 1}, MATVEC_THREADS,
           [&] { KERNEL(moe_gateup_grouped)(x.data(), g.data(), gate.ptr(), up.ptr(), groups.data(), gact.data()); });
    check_act("moe_gateup_grouped", gact);
    launch({blocks_x(HIDDEN, Mv<FFN, 1>::G), tiles(moe_tile<FFN>()), 1}, MATVEC_THREADS, [&] { KERNEL(moe_down_grouped)(gact.data(), down.ptr(), groups.data(), pdown.data()); });
    launch({(unsigned)rows, 1, 1}, 256, [&] { moe_combine(pdown.data(), route.data(), gres.data()); });
    check_down("moe_down_grouped + moe_combine", gact, gres);
}

// qk_norm_whole (OLMoE's q/k norm over the whole projections, before RoPE) against float64: the
// decode step's grid (1, 2, 1), q's block and k's, over one row, and prefill's (rows, 1, 1), a
// block per row over both, over 3 rows; v and the row after the last must stay as they were.
static void check_qk_norm_whole() {
    for (const auto& [rows, parts] : {std::pair{1, 2}, std::pair{3, 1}}) {
        std::vector<float> qkv((size_t)(rows + 1) * QKV_DIM), gq(Q_DIM), gk(KV_DIM);
        for (auto& v : qkv) v = 3 * nd(rng);
        for (auto& v : gq) v = 1 + 0.1f * nd(rng);
        for (auto& v : gk) v = 1 + 0.1f * nd(rng);
        const std::vector<float> in = qkv;
        launch({(unsigned)rows, (unsigned)parts, 1}, 256, [&] { qk_norm_whole(qkv.data(), gq.data(), gk.data()); });
        for (int r = 0; r <= rows; ++r) {
            const float* x = &in[(size_t)r * QKV_DIM];
            const float* got = &qkv[(size_t)r * QKV_DIM];
            for (int part = 0; part < 2 && r < rows; ++part) {
                const int off = part == 0 ? 0 : Q_DIM, n = part == 0 ? Q_DIM : KV_DIM;
                const float* g = part == 0 ? gq.data() : gk.data();
                double ss = 0, mag = 0;
                for (int i = 0; i < n; ++i) ss += (double)x[off + i] * x[off + i];
                const double inv = 1 / std::sqrt(ss / n + EPS);
                for (int i = 0; i < n; ++i) mag = std::max(mag, std::fabs(x[off + i] * inv * g[i]));
                for (int i = 0; i < n; ++i) cmp(part == 0 ? "qk_norm_whole q" : "qk_norm_whole k", r, i, got[off + i], x[off + i] * inv * g[i], mag);
            }
            const int from = r < rows ? Q_DIM + KV_DIM : 0;  // v, and all of the row after the last
            for (int i = from; i < QKV_DIM; ++i) {
                if (got[i] != x[i]) { printf("qk_norm_whole row %d [%d]: %g changed to %g (grid y %d)\n", r, i, x[i], got[i], parts); std::exit(1); }
            }
        }
    }
}

int main() {
    signal(SIGSEGV, segv);
    check_qk_norm_whole();
    // The router: every expert's row is read, so a plain tensor of the type.
    Experts router(1, EXPERTS, HIDDEN);
    router.open(0);
    Experts gate(EXPERTS, FFN, HIDDEN), up(EXPERTS, FFN, HIDDEN), down(EXPERTS, HIDDEN, FFN);
    int cases = 0, most = 0, unchosen = 0;
    for (int rows : {1, 3, 17}) for (int renorm : {0, 1}) {
        std::vector<float> x((size_t)rows * HIDDEN), g(HIDDEN), logits((size_t)rows * EXPERTS, NAN);
        std::vector<int> route((size_t)rows * MOE_ROUTE, -1);
        std::vector<float> common(HIDDEN);
        for (auto& v : common) v = nd(rng);
        // Many rows: one shared direction and some noise, so the rows agree on a few experts.
        const float shared = rows > 3 ? 1.0f : 0.0f;
        for (size_t i = 0; i < x.size(); ++i) x[i] = shared * common[i % HIDDEN] + (rows > 3 ? 0.3f : 1.0f) * nd(rng);
        for (auto& v : g) v = 1 + 0.1f * nd(rng);
        // moe_router: logits = Wr rmsnorm(x) * g
        launch({4, (unsigned)rows, 1}, MATVEC_THREADS, [&] { KERNEL(moe_router)(x.data(), g.data(), router.ptr(), logits.data()); });
        std::vector<std::vector<double>> n(rows, std::vector<double>(HIDDEN));
        for (int r = 0; r < rows; ++r) {
            double ss = 0; for (int k = 0; k < HIDDEN; ++k) ss += (double)x[r * HIDDEN + k] * x[r * HIDDEN + k];
            double inv = 1 / std::sqrt(ss / HIDDEN + EPS);
            for (int k = 0; k < HIDDEN; ++k) n[r][k] = x[r * HIDDEN + k] * inv * g[k];
            std::vector<double> want(EXPERTS); double mag = 0;
            for (int e = 0; e < EXPERTS; ++e) { double s = 0; for (int k = 0; k < HIDDEN; ++k) s += router.w(0, e, k) * n[r][k]; want[e] = s; mag = std::max(mag, std::fabs(s)); }
            for (int e = 0; e < EXPERTS; ++e) cmp("moe_router", r, e, logits[r * EXPERTS + e], want[e], mag);
        }
        // moe_topk: the TOP_K best of softmax(logits), lower index on ties, weights (renormalised)
        launch({(unsigned)rows, 1, 1}, 32, [&] { moe_topk(logits.data(), renorm, route.data()); });
        for (int r = 0; r < rows; ++r) {
            const float* l = &logits[r * EXPERTS];
            std::vector<int> order(EXPERTS); for (int e = 0; e < EXPERTS; ++e) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
            double mx = l[order[0]], sum = 0; for (int e = 0; e < EXPERTS; ++e) sum += std::exp((double)l[e] - mx);
            double chosen = 0; for (int j = 0; j < TOP_K; ++j) chosen += std::exp((double)l[order[j]] - mx) / sum;
            for (int j = 0; j < TOP_K; ++j) {
                int got = route[r * MOE_ROUTE + j];
                if (got != order[j]) { printf("moe_topk row %d: choice %d is expert %d, want %d\n", r, j, got, order[j]); std::exit(1); }
                float wgot; memcpy(&wgot, &route[r * MOE_ROUTE + TOP_K + j], 4);
                double p = std::exp((double)l[order[j]] - mx) / sum;
                cmp("moe_topk weight", r, j, wgot, renorm ? p / chosen : p, 1.0);
            }
        }
        for (Experts* t : {&gate, &up, &down}) t->close_all();
        std::vector<int> count(EXPERTS);
        for (int r = 0; r < rows; ++r) for (int j = 0; j < TOP_K; ++j) { int e = route[r * MOE_ROUTE + j]; ++count[e]; gate.open(e); up.open(e); down.open(e); }
        if (rows == 17) {
            most = std::max(most, *std::max_element(count.begin(), count.end()));
            unchosen = std::max(unchosen, (int)std::count(count.begin(), count.end(), 0));
        }
        check_experts(rows, x, g, n, route, gate, up, down);
        ++cases;
    }
    // The 17-row cases reached what they are for: an expert with more pairs than a tile, experts with none.
    if (most <= moe_tile<HIDDEN>() || unchosen == 0) { printf("the 17-row routes did not concentrate (most %d, unchosen %d)\n", most, unchosen); return 1; }
    // The guard works: a read of an expert no case's route mapped now dies in the handler.
    for (Experts* t : {&gate, &up, &down}) t->close_all();
    pid_t pid = fork();
    if (pid == 0) {
        dup2(open("/dev/null", O_WRONLY), 2);  // the handler's message is expected here
        volatile unsigned char c = gate.base[0];
        (void)c;
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1) { printf("the unmapped-expert guard did not fire\n"); return 1; }
    int opened = 0; for (int e = 0; e < EXPERTS; ++e) opened += gate.opened[e];
    printf("qk_norm_whole matches (decode grid (1, 2, 1), prefill 3 rows); %s moe kernels match (%d cases, each with only its route's experts mapped: %d of %d over all; 17 rows: up to %d rows on one expert, %d experts unchosen; worst rel %.2e)\n", TYPE, cases, opened, EXPERTS, most, unchosen, worst);
}
