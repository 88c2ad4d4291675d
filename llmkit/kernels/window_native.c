/* Causal sliding-window attention in fp32 on the CPU: forward and backward, O(L·W).
 *
 * Compiled on first use by llmkit/kernels/window_native.py for the CPU it runs on
 * (-march=native, with OpenMP where the compiler has it) and called through ctypes, once
 * for a range of (batch, kv head) pairs: an OpenMP build splits them over threads, in the
 * OpenMP runtime torch already loaded (so over its intra-op threads, not beside them).
 * A query at key position p attends p−W+1 … p.
 *
 * Rows of queries go in tiles of RT. A tile's keys are one span of at most W+RT−1 keys, so
 * the scores of a tile (RT × span) stay in L1/L2 and the work wasted on keys outside a row's
 * window is (RT−1)/W of the useful work. Within a tile, the softmax is exact (the whole row
 * is in the buffer), statistics and accumulation are fp32, and the backward recomputes P
 * from the row log-sum-exp the forward saved (FlashAttention-2, Dao 2023).
 *
 * Products are register-tiled loops over GCC/Clang vector extensions, which the compiler
 * maps to AVX-512 (16 lanes, 32 registers) or AVX2 with FMA (8 lanes, 16 registers) as the
 * CPU has; without either the build stops (plain SSE code ran 30× slower than the PyTorch
 * path, which then runs instead):
 *   scores:  S[r][j]  = Σ_d q[r][d]·kᵀ[d][j]   (keys as lanes, from a transposed copy)
 *   rows_pv: O[r][:]  = Σ_j P[r][j]·v[j][:]    (head dims as lanes)
 *   cols_acc: dV[j][:] += Σ_r P[r][j]·x[r][:]  (head dims as lanes, into the output)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "the window kernel needs AVX2 with FMA, or AVX-512 (x86-64)"
#endif

#if defined(__AVX512F__)
#define VL 16 /* fp32 lanes of a vector register */
#define RT 14 /* query rows of a tile: RT × 2 accumulators + 2 operands ≤ 32 registers */
#define NK 12 /* keys a cols_acc step updates */
#else
#define VL 8
#define RT 6
#define NK 6
#endif
#define NB (2 * VL) /* keys (or head dims) a product step covers */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static const float LOG2E = 1.4426950408889634f;

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return x - (vf){0}; }
static inline vf pick(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

static inline vi iota(void) {
    vi v;
    for (int i = 0; i < VL; i++) v[i] = i;
    return v;
}

/* 2^x for x ≤ 0 (clamped at −125), relative error ≈ 1e-7: round to n, 2^f by a degree-7
 * polynomial on f ∈ [−½, ½], then n added to the exponent bits. */
static inline vf exp2v(vf x) {
    x = pick(x < -125.f, splat(-125.f), x);
    vf t = x + 12582912.f; /* 1.5·2^23: rounds to the nearest integer */
    vf n = t - 12582912.f, f = x - n;
    vf p = splat(1.5252734e-05f);
    p = p * f + 1.5403530e-04f;
    p = p * f + 1.3333558e-03f;
    p = p * f + 9.6181291e-03f;
    p = p * f + 5.5504109e-02f;
    p = p * f + 2.4022651e-01f;
    p = p * f + 6.9314718e-01f;
    p = p * f + 1.0f;
    vi bits = (vi)p + (__builtin_convertvector(n, vi) << 23);
    return (vf)bits;
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* s[r][j] = Σ_d a[r][d]·bt[d][j] for r < RT, j < npad (a multiple of VL): steps of NB
 * keys, then one of VL if npad is an odd number of vectors; bt rows ldb apart. */
static void scores(const float *a, int D, const float *bt, long ldb, float *s, int ls, int npad) {
    int j0 = 0;
    for (; j0 + NB <= npad; j0 += NB) {
        vf acc[RT][2];
        for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = (vf){0};
        const float *b = bt + j0;
        for (int d = 0; d < D; d++) {
            vf b0 = load(b + d * ldb), b1 = load(b + d * ldb + VL);
            for (int r = 0; r < RT; r++) {
                float x = a[r * D + d];
                acc[r][0] += x * b0;
                acc[r][1] += x * b1;
            }
        }
        for (int r = 0; r < RT; r++) {
            store(s + r * ls + j0, acc[r][0]);
            store(s + r * ls + j0 + VL, acc[r][1]);
        }
    }
    if (j0 < npad) {
        vf acc[RT];
        for (int r = 0; r < RT; r++) acc[r] = (vf){0};
        const float *b = bt + j0;
        for (int d = 0; d < D; d++) {
            vf b0 = load(b + d * ldb);
            for (int r = 0; r < RT; r++) acc[r] += a[r * D + d] * b0;
        }
        for (int r = 0; r < RT; r++) store(s + r * ls + j0, acc[r]);
    }
}

/* out[r][:] = Σ_{j<n} p[r][j]·v[j][:] for r < rows (D a multiple of NB). */
static void rows_pv(const float *p, int ls, const float *v, int D, int n, float *out, int rows) {
    for (int d0 = 0; d0 < D; d0 += NB) {
        vf acc[RT][2];
        for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = (vf){0};
        for (int j = 0; j < n; j++) {
            vf b0 = load(v + (long)j * D + d0), b1 = load(v + (long)j * D + d0 + VL);
            for (int r = 0; r < RT; r++) {
                float x = p[r * ls + j];
                acc[r][0] += x * b0;
                acc[r][1] += x * b1;
            }
        }
        for (int r = 0; r < rows; r++) {
            store(out + (long)r * D + d0, acc[r][0]);
            store(out + (long)r * D + d0 + VL, acc[r][1]);
        }
    }
}

/* acc[j][:] += Σ_{r<rows} p[r][j]·x[r][:] for the `nk` keys j0 … and head dims d0 … d0+NB−1;
 * inlined with a constant nk, so its 2·nk accumulators stay in registers. */
static inline __attribute__((always_inline)) void cols_block(const float *p, int ls,
                                                             const float *x, int rows, int D,
                                                             float *acc, int j0, int d0,
                                                             const int nk) {
    vf c[NK][2];
    float *out = acc + (long)j0 * D + d0;
    for (int j = 0; j < nk; j++) {
        c[j][0] = load(out + (long)j * D);
        c[j][1] = load(out + (long)j * D + VL);
    }
    for (int r = 0; r < rows; r++) {
        vf b0 = load(x + r * D + d0), b1 = load(x + r * D + d0 + VL);
        const float *pr = p + r * ls + j0;
        for (int j = 0; j < nk; j++) {
            float y = pr[j];
            c[j][0] += y * b0;
            c[j][1] += y * b1;
        }
    }
    for (int j = 0; j < nk; j++) {
        store(out + (long)j * D, c[j][0]);
        store(out + (long)j * D + VL, c[j][1]);
    }
}

/* acc[j][:] += Σ_{r<rows} p[r][j]·x[r][:] for j < n (x: RT rows of D): blocks of NK keys,
 * then of 4, then single keys. */
static void cols_acc(const float *p, int ls, const float *x, int rows, int n, int D, float *acc) {
    for (int d0 = 0; d0 < D; d0 += NB) {
        int j0 = 0;
        for (; j0 + NK <= n; j0 += NK) cols_block(p, ls, x, rows, D, acc, j0, d0, NK);
        for (; j0 + 4 <= n; j0 += 4) cols_block(p, ls, x, rows, D, acc, j0, d0, 4);
        for (; j0 < n; j0++) cols_block(p, ls, x, rows, D, acc, j0, d0, 1);
    }
}

/* kt[d][j] = k[j][d] for j < Tk, zeros up to ldk; in blocks of VL keys, which read VL
 * whole key rows and write one vector of each of the D rows of kt. */
static void transpose_keys(const float *k, int Tk, int D, float *kt, long ldk) {
    int j0 = 0;
    for (; j0 + VL <= Tk; j0 += VL)
        for (int d = 0; d < D; d++) {
            vf x;
            for (int j = 0; j < VL; j++) x[j] = k[(long)(j0 + j) * D + d];
            store(kt + d * ldk + j0, x);
        }
    for (int d = 0; d < D; d++) {
        float *row = kt + d * ldk;
        for (int j = j0; j < Tk; j++) row[j] = k[(long)j * D + d];
        memset(row + Tk, 0, (ldk - Tk) * sizeof(float));
    }
}

/* Stride of a tile's score rows: the widest span, rounded up to whole product steps. */
static int span_stride(int W) { return (W + RT - 1 + NB - 1) / NB * NB; }

/* Key columns of the transposed copies: the keys attended (the last ≤ Tk), then room for
 * the last step's overreach. */
static long key_columns(int keys) { return (long)keys + NB; }

/* Head dims must be a multiple of this. */
int llmkit_window_lanes(void) { return NB; }

/* Floats of the work buffer a thread of a forward (backward) call needs, for `keys` keys
 * attended: min(Tk, Tq + W − 1), the keys from the first one a window reaches. */
long llmkit_window_work(int keys, int D, int W, int backward) {
    long copies = backward ? 2 : 1; /* kᵀ, q tile, scores (and vᵀ, dO tile, dS) */
    return copies * ((long)D * key_columns(keys) + (long)RT * D + (long)RT * span_stride(W));
}

/* A tile of rows i0 … i0+rows−1 (query key positions p0 …): its span lo … lo+n−1. */
typedef struct {
    int rows, p0, lo, n, npad;
} Tile;

static Tile tile_at(int i0, int Tq, int Tk, int W) {
    Tile t;
    t.rows = Tq - i0 < RT ? Tq - i0 : RT;
    t.p0 = Tk - Tq + i0;
    t.lo = t.p0 - W + 1 < 0 ? 0 : t.p0 - W + 1;
    t.n = t.p0 + t.rows - t.lo;
    t.npad = (t.n + VL - 1) / VL * VL;
    return t;
}

/* dst: the tile's `rows` rows of src (D floats each), then zero rows up to RT. */
static void copy_rows(const float *src, int rows, int D, float *dst) {
    memcpy(dst, src, (size_t)rows * D * sizeof(float));
    memset(dst + rows * D, 0, (size_t)(RT - rows) * D * sizeof(float));
}

/* The window of a score row whose query sits at span column b: columns a … b, which the
 * vectors starting at lo … hi (multiples of VL) touch. */
typedef struct {
    int a, b, lo, hi;
} Window;

static inline Window window_of(int b, int W) {
    Window w = {b - W + 1 < 0 ? 0 : b - W + 1, b, 0, 0};
    w.lo = w.a / VL * VL;
    w.hi = b / VL * VL;
    return w;
}

/* Lanes of the vector at j0 inside the window (all of them between its edge vectors). */
static inline vi inside(int j0, Window w) {
    vi idx = iota() + j0;
    return (idx >= w.a) & (idx <= w.b);
}

/* The logits of lanes j0 … j0+VL−1 of a score row, in log2 units: s·scale·log2e, minus
 * slope·log2e·(b − j) where `alibi` (a constant where inlined). Lanes outside the window are
 * not masked here: the caller masks the edge vectors. */
static inline __attribute__((always_inline)) vf logits(const float *row, int j0, float c,
                                                       float sl, int b, const int alibi) {
    if (!alibi) return load(row + j0) * c;
    vi idx = iota() + j0;
    vf dist = __builtin_convertvector((vi){0} + b - idx, vf);
    return load(row + j0) * c - sl * dist;
}

/* Softmax of one score row of npad columns in place (zeros outside the window); returns
 * the row max of the logits and sets *total to Σ 2^(logit − max). */
static inline __attribute__((always_inline)) float softmax_row(float *row, int npad, Window w,
                                                               float c, float sl, float *total,
                                                               const int alibi) {
    const vf ninf = splat(-INFINITY);
    vf m = ninf;
    for (int j0 = w.lo; j0 <= w.hi; j0 += VL) {
        vf x = logits(row, j0, c, sl, w.b, alibi);
        if (j0 == w.lo || j0 == w.hi) x = pick(inside(j0, w), x, ninf);
        m = pick(x > m, x, m);
    }
    const float mx = hmax(m);
    vf sum = (vf){0};
    for (int j0 = w.lo; j0 <= w.hi; j0 += VL) {
        vf e = exp2v(logits(row, j0, c, sl, w.b, alibi) - mx);
        if (j0 == w.lo || j0 == w.hi) e = pick(inside(j0, w), e, (vf){0});
        store(row + j0, e);
        sum += e;
    }
    memset(row, 0, w.lo * sizeof(float));
    memset(row + w.hi + VL, 0, (npad - w.hi - VL) * sizeof(float));
    *total = hsum(sum);
    return mx;
}

/* One row of the backward: P from the logits and the row's log2-sum-exp m (in p, which holds
 * the scores), dS = P ∘ (dP − δ)·scale (in ds, which holds dP); zeros outside the window. */
static inline __attribute__((always_inline)) void grad_row(float *p, float *ds, int npad,
                                                           Window w, float c, float sl, float m,
                                                           float delta, float scale,
                                                           const int alibi) {
    for (int j0 = w.lo; j0 <= w.hi; j0 += VL) {
        vf e = exp2v(logits(p, j0, c, sl, w.b, alibi) - m);
        if (j0 == w.lo || j0 == w.hi) e = pick(inside(j0, w), e, (vf){0});
        store(p + j0, e);
        store(ds + j0, e * (load(ds + j0) - delta) * scale);
    }
    const size_t before = w.lo * sizeof(float), after = (npad - w.hi - VL) * sizeof(float);
    memset(p, 0, before);
    memset(ds, 0, before);
    memset(p + w.hi + VL, 0, after);
    memset(ds + w.hi + VL, 0, after);
}

/* Forward of one kv head and its G query heads (Tq × D each, consecutive): o (G, Tq, D),
 * lse (G, Tq) natural-log row log-sum-exp of the scaled, biased scores. slopes: G ALiBi
 * slopes or NULL. work: llmkit_window_work(keys attended, D, W, 0) floats. */
static void forward_pair(const float *q, const float *k, const float *v, const float *slopes,
                           float *o, float *lse, int G, int Tq, int Tk, int D, int W, float scale,
                           float *work) {
    const int first = Tk - Tq - W + 1 > 0 ? Tk - Tq - W + 1 : 0; /* the first key attended */
    long ldk = key_columns(Tk - first);
    int ls = span_stride(W);
    float *kt = work, *qt = kt + D * ldk, *s = qt + RT * D;
    transpose_keys(k + (long)first * D, Tk - first, D, kt, ldk);
    const float c = scale * LOG2E;
    for (int g = 0; g < G; g++) {
        const float sl = slopes ? slopes[g] * LOG2E : 0.f;
        const float *qh = q + (long)g * Tq * D;
        float *oh = o + (long)g * Tq * D, *lh = lse + (long)g * Tq;
        for (int i0 = 0; i0 < Tq; i0 += RT) {
            Tile t = tile_at(i0, Tq, Tk, W);
            copy_rows(qh + (long)i0 * D, t.rows, D, qt);
            scores(qt, D, kt + (t.lo - first), ldk, s, ls, t.npad);
            float inv[RT];
            for (int r = 0; r < RT; r++) {
                float *row = s + r * ls, total;
                if (r >= t.rows) {
                    memset(row, 0, t.npad * sizeof(float));
                    continue;
                }
                Window w = window_of(t.p0 + r - t.lo, W);
                float mx = sl != 0.f ? softmax_row(row, t.npad, w, c, sl, &total, 1)
                                     : softmax_row(row, t.npad, w, c, sl, &total, 0);
                inv[r] = 1.f / total;
                lh[i0 + r] = (mx + log2f(total)) / LOG2E;
            }
            float *out = oh + (long)i0 * D;
            rows_pv(s, ls, v + (long)t.lo * D, D, t.n, out, t.rows);
            for (int r = 0; r < t.rows; r++)
                for (int d = 0; d < D; d++) out[r * D + d] *= inv[r];
        }
    }
}

/* Backward of one kv head and its G query heads: dq (G, Tq, D) written, dk and dv (Tk, D)
 * accumulated into (zero them first). lse from the forward. work:
 * llmkit_window_work(keys attended, D, W, 1) floats. */
static void backward_pair(const float *q, const float *k, const float *v, const float *slopes,
                            const float *o, const float *dout, const float *lse, float *dq,
                            float *dk, float *dv, int G, int Tq, int Tk, int D, int W,
                            float scale, float *work) {
    const int first = Tk - Tq - W + 1 > 0 ? Tk - Tq - W + 1 : 0;
    long ldk = key_columns(Tk - first);
    int ls = span_stride(W);
    float *kt = work, *vt = kt + D * ldk, *qt = vt + D * ldk, *dot = qt + RT * D;
    float *P = dot + RT * D, *dS = P + RT * ls;
    transpose_keys(k + (long)first * D, Tk - first, D, kt, ldk);
    transpose_keys(v + (long)first * D, Tk - first, D, vt, ldk);
    const float c = scale * LOG2E;
    for (int g = 0; g < G; g++) {
        const float sl = slopes ? slopes[g] * LOG2E : 0.f;
        const long head = (long)g * Tq * D;
        const float *qh = q + head, *oh = o + head, *doh = dout + head, *lh = lse + (long)g * Tq;
        float *dqh = dq + head;
        for (int i0 = 0; i0 < Tq; i0 += RT) {
            Tile t = tile_at(i0, Tq, Tk, W);
            copy_rows(qh + (long)i0 * D, t.rows, D, qt);
            copy_rows(doh + (long)i0 * D, t.rows, D, dot);
            scores(qt, D, kt + (t.lo - first), ldk, P, ls, t.npad);
            scores(dot, D, vt + (t.lo - first), ldk, dS, ls, t.npad);
            for (int r = 0; r < RT; r++) {
                float *pr = P + r * ls, *sr = dS + r * ls;
                if (r >= t.rows) {
                    memset(pr, 0, t.npad * sizeof(float));
                    memset(sr, 0, t.npad * sizeof(float));
                    continue;
                }
                const float *orow = oh + (long)(i0 + r) * D;
                vf dsum = (vf){0}; /* δ = Σ dO·O */
                for (int d = 0; d < D; d += VL) dsum += load(dot + r * D + d) * load(orow + d);
                const float delta = hsum(dsum);
                Window w = window_of(t.p0 + r - t.lo, W);
                float m = lh[i0 + r] * LOG2E;
                if (sl != 0.f)
                    grad_row(pr, sr, t.npad, w, c, sl, m, delta, scale, 1);
                else
                    grad_row(pr, sr, t.npad, w, c, sl, m, delta, scale, 0);
            }
            rows_pv(dS, ls, k + (long)t.lo * D, D, t.n, dqh + (long)i0 * D, t.rows);
            cols_acc(P, ls, dot, t.rows, t.n, D, dv + (long)t.lo * D);
            cols_acc(dS, ls, qt, t.rows, t.n, D, dk + (long)t.lo * D);
        }
    }
}

/* 1 when built with OpenMP: the calls below then split their pairs over `threads`. */
int llmkit_window_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The work buffer of the thread running a pair: `floats` each. */
static float *thread_work(float *work, long floats) {
#ifdef _OPENMP
    return work + omp_get_thread_num() * floats;
#else
    (void)floats;
    return work;
#endif
}

/* Forward of pairs p0 … p1−1 of (B·Hkv) (batch, kv head) pairs. Every tensor contiguous and
 * given from pair 0: q and o (B, Hkv·G, Tq, D), lse (B, Hkv·G, Tq), k and v (B, Hkv, Tk, D),
 * slopes (Hkv·G) or NULL. work: `threads` buffers of `floats` ≥ llmkit_window_work(…, 0).
 * Each pair writes only its own rows, so results do not depend on the thread count. */
void llmkit_window_forward(const float *q, const float *k, const float *v, const float *slopes,
                           float *o, float *lse, int p0, int p1, int Hkv, int G, int Tq, int Tk,
                           int D, int W, float scale, float *work, long floats, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int p = p0; p < p1; p++) {
        const long qo = (long)p * G * Tq * D, ko = (long)p * Tk * D;
        forward_pair(q + qo, k + ko, v + ko, slopes ? slopes + (p % Hkv) * G : NULL, o + qo,
                     lse + (long)p * G * Tq, G, Tq, Tk, D, W, scale, thread_work(work, floats));
    }
}

/* Backward of pairs p0 … p1−1, laid out as for the forward; dout and dq as q, dk and dv as k
 * (zeroed by the caller). work: `threads` buffers of `floats` ≥ llmkit_window_work(…, 1). */
void llmkit_window_backward(const float *q, const float *k, const float *v, const float *slopes,
                            const float *o, const float *dout, const float *lse, float *dq,
                            float *dk, float *dv, int p0, int p1, int Hkv, int G, int Tq, int Tk,
                            int D, int W, float scale, float *work, long floats, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int p = p0; p < p1; p++) {
        const long qo = (long)p * G * Tq * D, ko = (long)p * Tk * D;
        backward_pair(q + qo, k + ko, v + ko, slopes ? slopes + (p % Hkv) * G : NULL, o + qo,
                      dout + qo, lse + (long)p * G * Tq, dq + qo, dk + ko, dv + ko, G, Tq, Tk,
                      D, W, scale, thread_work(work, floats));
    }
}
