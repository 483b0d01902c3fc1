// What a fused residual add + RMSNorm costs in a kernel that holds one row per thread block, and
// what splitting a row over a thread-block cluster would save: the bound behind the fused
// epilogue's design (templates/epilogue_fused.cuh.j2), measured without the runtime around it.
//
//     nvcc -arch=sm_90 -O3 -std=c++17 benchmarks/epilogue_floor.cu -o /tmp/epilogue_floor && /tmp/epilogue_floor
//
// Each variant is one kernel over [ROWS x 4096] bf16 (two loopback ranks' 16 rows each): it
// loads a row's two reduce sources (`a`, `b`), adds them and rounds the sum to bf16, as the
// fused pass does; what else it does is the variant:
//   base    stores the sum (no operands, no norm): the plain reduce
//   extra   + loads `residual` and `weight`, stores h = sum + residual and h * weight
//   norm    + the row's sum of squares (shuffles, one barrier, rsqrt), operands not loaded
//   full    both: the fused all-reduce + residual + RMSNorm, one row per 512-thread block
//   hoisted full, with residual and weight loaded into registers before a wait of SPIN cycles
//           that stands for the wait for the peers' data (every variant of that table waits)
//   Kn      full over a cluster of n blocks, each with 1/n of the row: "local" sums its part only
//           (wrong numbers: what the split saves before any exchange), "cluster.sync" exchanges
//           the n partial sums through distributed shared memory and a cluster barrier,
//           "st.async" through remote stores that complete the receivers' mbarriers
//   redundant  a row over K blocks with no exchange: each block loads the whole row and sums
//           its squares itself, then stores its 1/K ("early": the residual stored before the norm)
//   guarded  the redundant split over a 2-block cluster, its residual stores behind a cluster
//           barrier (the sibling block reads the old residual): sound for an in-place residual
// Modes: no argument, the first and second studies' tables; `redundant` and `early`, the third
// study's; `guarded` and `exchange_early` (the st.async exchange with the residual stored
// before the norm), the fourth's (benchmarks/results/2026-12-02-h200x1-epilogue-floor.md);
// `profile`, one launch of each variant for Nsight Compute.
// Time per kernel: the median of 15 replays of a CUDA graph of 100 launches (launch included,
// the same in every variant); "adds" is the difference to base.  The st.async exchange is
// checked against the one-block result, element by element.
#include <algorithm>
#include <cooperative_groups.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <string>
#include <vector>

namespace cg = cooperative_groups;

#define CHECK(x)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            std::printf("%s: %s\n", #x, cudaGetErrorString(e_));                                 \
            std::exit(1);                                                                        \
        }                                                                                        \
    } while (0)

constexpr int HIDDEN = 4096, ROW_VECTORS = HIDDEN / 8, ROWS = 32, THREADS = 512;
constexpr float EPS = 1e-6f;

__device__ __forceinline__ void widen(uint4 u, float (&f)[8])
{
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ unsigned round_pair(float lo, float hi)
{
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

__device__ __forceinline__ uint4 round8(const float (&f)[8])
{
    return make_uint4(round_pair(f[0], f[1]), round_pair(f[2], f[3]), round_pair(f[4], f[5]), round_pair(f[6], f[7]));
}

__device__ __forceinline__ unsigned add_pair(unsigned a, unsigned b)
{
    const __nv_bfloat162 s = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned*>(&s);
}

__device__ __forceinline__ uint4 add_packed(uint4 a, uint4 b)
{
    return make_uint4(add_pair(a.x, b.x), add_pair(a.y, b.y), add_pair(a.z, b.z), add_pair(a.w, b.w));
}

__device__ __forceinline__ unsigned shared_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

struct Buffers {
    const uint4 *a, *b, *weight;
    uint4 *residual, *out;
    unsigned* flag;  // the stand-in for a peer's signal (spin < 0)
};

enum class Exchange { NONE, LOCAL, CLUSTER_SYNC, ST_ASYNC };

// The stand-in for the wait for the peers' data: SPIN cycles, then the block's barrier (none for 0).
__device__ __forceinline__ void spin_wait(long long spin)
{
    if (spin > 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < spin) { }
        __syncthreads();
    }
}

// h = (a + b, one bf16x2 rounding) + residual for one vector, its squares added to two chains.
__device__ __forceinline__ void form_h(uint4 ua, uint4 ub, uint4 ur, float (&h)[8], float& s0, float& s1)
{
    float r[8];
    widen(add_packed(ua, ub), h);
    widen(ur, r);
    for (int k = 0; k < 8; ++k) h[k] += r[k];
    for (int k = 0; k < 8; k += 2) { s0 = fmaf(h[k], h[k], s0); s1 = fmaf(h[k + 1], h[k + 1], s1); }
}

// This block's part of the row's sum of squares: lanes by shuffles, warps through shared memory.
template <int BLOCK, int ACTIVE_WARPS>
__device__ __forceinline__ float block_sum(float s, float* sums)
{
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
    if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = s;
    __syncthreads();
    float total = 0;
    for (int w = 0; w < ACTIVE_WARPS; ++w) total += sums[w];
    return total;
}

// The K parts' sums, each block's written into every block of the cluster by a remote store that
// completes the receiver's mbarrier; each block waits for its own.
template <int K>
__device__ __forceinline__ float exchange_st_async(float total, float* parts, unsigned long long* bar)
{
    const int part = blockIdx.x % K;
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");  // every block started, mbarriers ready
    if (threadIdx.x < K) {
        unsigned slot, remote_bar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(slot) : "r"(shared_address(&parts[part])), "r"((unsigned)threadIdx.x));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(shared_address(bar)), "r"((unsigned)threadIdx.x));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];"
                     :: "r"(slot), "r"(__float_as_uint(total)), "r"(remote_bar) : "memory");
    }
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(4 * K) : "memory");
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(shared_address(bar)) : "memory");
    total = 0;
    for (int j = 0; j < K; ++j) total += parts[j];
    return total;
}

// One row over K blocks of BLOCK threads (K = 1: one block per row).  SPIN > 0: a wait first;
// HOIST: the operands are loaded before it.
template <int K, int BLOCK, bool OPERANDS, bool NORM, Exchange X, bool HOIST = false, bool PACKED = false, bool EARLY = false>
__global__ void __launch_bounds__(BLOCK) fused(Buffers p, long long spin)
{
    __shared__ float sums[BLOCK / 32];
    __shared__ float parts[K];
    __shared__ __align__(8) unsigned long long bar;
    constexpr int PART_VECTORS = ROW_VECTORS / K;
    constexpr int ACTIVE_WARPS = (PART_VECTORS + 31) / 32 < BLOCK / 32 ? (PART_VECTORS + 31) / 32 : BLOCK / 32;
    const int row = blockIdx.x / K, part = blockIdx.x % K, t = threadIdx.x;
    const bool active = t < PART_VECTORS;
    const int i = row * ROW_VECTORS + part * PART_VECTORS + t;
    if constexpr (X == Exchange::ST_ASYNC) {
        if (t == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(&bar)));
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // waited on before the exchange
    }
    uint4 ur = make_uint4(0x3c003c00u, 0, 0, 0), uw = make_uint4(0x3f803f80u, 0, 0, 0);
    if (HOIST && active) { ur = p.residual[i]; uw = p.weight[part * PART_VECTORS + t]; }
    if (spin < 0) {  // a signal: block 0 raises it after -spin cycles and every block waits for it, as for a peer's
        if (blockIdx.x == 0 && t == 0) {
            const long long t0 = clock64();
            while (clock64() - t0 < -spin) { }
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p.flag), "r"(1u) : "memory");
        }
        if (t == 0) {
            unsigned raised = 0;
            while (!raised) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(raised) : "l"(p.flag) : "memory");
        }
        __syncthreads();
    } else {
        spin_wait(spin);
    }
    float x[8] = {}, r[8] = {}, w[8] = {};
    if (active) {
        float y[8];
        const uint4 ua = p.a[i], ub = p.b[i];
        if (OPERANDS && !HOIST) { ur = p.residual[i]; uw = p.weight[part * PART_VECTORS + t]; }
        widen(ur, r); widen(uw, w);
        if constexpr (PACKED) {  // two sources: bf16x2 adds round once, as float adds then a rounding do
            widen(add_packed(ua, ub), x);
        } else {
            widen(ua, x); widen(ub, y);
            for (int k = 0; k < 8; ++k) x[k] += y[k];
            if (!OPERANDS && !NORM) { p.out[i] = round8(x); return; }  // base: the plain reduce
            widen(round8(x), x);  // the reduced value, as the output dtype holds it
        }
        for (int k = 0; k < 8; ++k) r[k] += x[k];  // h
        if (EARLY && OPERANDS) p.residual[i] = round8(r);  // h does not wait for the norm
    }
    float inv = 1.0f;
    if constexpr (NORM) {
        float s0 = 0, s1 = 0;
        for (int k = 0; k < 8; k += 2) { s0 = fmaf(r[k], r[k], s0); s1 = fmaf(r[k + 1], r[k + 1], s1); }
        float total = block_sum<BLOCK, ACTIVE_WARPS>(s0 + s1, sums);
        if constexpr (X == Exchange::CLUSTER_SYNC) {
            cg::cluster_group cluster = cg::this_cluster();
            if (t < K) cluster.map_shared_rank(parts, t)[part] = total;
            cluster.sync();
            total = 0;
            for (int j = 0; j < K; ++j) total += parts[j];
        } else if constexpr (X == Exchange::ST_ASYNC) {
            total = exchange_st_async<K>(total, parts, &bar);
        }
        inv = rsqrtf(total * (1.0f / HIDDEN) + EPS);
    }
    if (active) {
        float y[8];
        for (int k = 0; k < 8; ++k) y[k] = r[k] * inv * w[k];
        p.out[i] = round8(y);
        if (OPERANDS && !EARLY) p.residual[i] = round8(r);
    }
}

// ROWS x K blocks of BLOCK threads, as clusters of K blocks where K > 1.
void launch_rows(void (*kernel)(Buffers, long long), int K, int BLOCK, const Buffers& p, cudaStream_t stream,
                 long long spin)
{
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(ROWS * K);
    config.blockDim = dim3(BLOCK);
    config.stream = stream;
    cudaLaunchAttribute cluster[1];
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = K;
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = K > 1 ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, kernel, p, spin));
}

template <int K, int BLOCK, bool OPERANDS, bool NORM, Exchange X, bool HOIST = false, bool PACKED = false, bool EARLY = false>
void launch(const Buffers& p, cudaStream_t stream, long long spin = 0)
{
    if (spin < 0) CHECK(cudaMemsetAsync(p.flag, 0, sizeof(unsigned), stream));
    launch_rows(fused<K, BLOCK, OPERANDS, NORM, X, HOIST, PACKED, EARLY>, K, BLOCK, p, stream, spin);
}

// One row over K blocks of BLOCK threads with no exchange: every block loads the whole row of
// both sources and the residual and sums its squares itself (the loads of K - 1 parts repeated
// in every block), then computes and stores only its 1/K of the row (weight loaded for that
// part only).  Spreads the stores and the weight over K SMs for 2/3 more loads per SM.
// SPIN as in `fused`; HOIST: residual and weight loaded before the wait.
template <int K, int BLOCK, bool HOIST, bool EARLY = false>
__global__ void __launch_bounds__(BLOCK) redundant(Buffers p, long long spin)
{
    __shared__ float sums[BLOCK / 32];
    constexpr int PER_THREAD = ROW_VECTORS / BLOCK, PART_VECTORS = ROW_VECTORS / K;
    static_assert(PER_THREAD * BLOCK == ROW_VECTORS, "a block covers the row in whole vectors per thread");
    const int row = blockIdx.x / K, part = blockIdx.x % K, t = threadIdx.x;
    uint4 ur[PER_THREAD], uw[PER_THREAD];
    auto mine = [&](int j) { return (t + j * BLOCK) / PART_VECTORS == part; };  // vector t + j * BLOCK is this block's to store
    if (HOIST)
        for (int j = 0; j < PER_THREAD; ++j) {
            ur[j] = p.residual[row * ROW_VECTORS + t + j * BLOCK];
            if (mine(j)) uw[j] = p.weight[t + j * BLOCK];
        }
    spin_wait(spin);
    uint4 ua[PER_THREAD], ub[PER_THREAD];
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = row * ROW_VECTORS + t + j * BLOCK;
        ua[j] = p.a[i];
        ub[j] = p.b[i];
        if (!HOIST) {
            ur[j] = p.residual[i];
            if (mine(j)) uw[j] = p.weight[t + j * BLOCK];
        }
    }
    float h[PER_THREAD][8], s0 = 0, s1 = 0;
    for (int j = 0; j < PER_THREAD; ++j) {
        form_h(ua[j], ub[j], ur[j], h[j], s0, s1);
        if (EARLY && mine(j)) p.residual[row * ROW_VECTORS + t + j * BLOCK] = round8(h[j]);
    }
    const float inv = rsqrtf(block_sum<BLOCK, BLOCK / 32>(s0 + s1, sums) * (1.0f / HIDDEN) + EPS);
    for (int j = 0; j < PER_THREAD; ++j) {
        if (!mine(j)) continue;
        const int i = row * ROW_VECTORS + t + j * BLOCK;
        float w[8], y[8];
        widen(uw[j], w);
        for (int k = 0; k < 8; ++k) y[k] = h[j][k] * inv * w[k];
        p.out[i] = round8(y);
        if (!EARLY) p.residual[i] = round8(h[j]);
    }
}

template <int K, int BLOCK, bool HOIST, bool EARLY = false>
void launch_redundant(const Buffers& p, cudaStream_t stream, long long spin = 0)
{
    redundant<K, BLOCK, HOIST, EARLY><<<ROWS * K, BLOCK, 0, stream>>>(p, spin);
    CHECK(cudaGetLastError());
}

// Where the guarded split (`redundant_guarded`) waits for its sibling block, which reads this
// block's part of the residual (the whole row's old values, for its own sum of squares) before
// this block overwrites it with h: an arrive (release) once this block's loads are issued, a
// wait (acquire) before its first residual store, the stores placed after this block's sum of
// squares is formed (MID) or with `out` after the norm (LATE).  UNGUARDED: the same cluster
// launch with no barrier (wrong whenever a sibling lags: the floor of the guard's cost).
enum class Guard { UNGUARDED, EARLY, MID, LATE };

template <Guard G>
__device__ __forceinline__ void sibling_wait(Guard at)
{
    if (G == at) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// `redundant` (hoisted, bf16x2) over a K-block cluster, sound where the residual is updated in place.
template <int K, int BLOCK, Guard G>
__global__ void __launch_bounds__(BLOCK) redundant_guarded(Buffers p, long long spin)
{
    __shared__ float sums[BLOCK / 32];
    constexpr int PER_THREAD = ROW_VECTORS / BLOCK, PART_VECTORS = ROW_VECTORS / K;
    const int row = blockIdx.x / K, part = blockIdx.x % K, t = threadIdx.x;
    uint4 ur[PER_THREAD], uw[PER_THREAD];
    auto mine = [&](int j) { return (t + j * BLOCK) / PART_VECTORS == part; };
    for (int j = 0; j < PER_THREAD; ++j) {
        ur[j] = p.residual[row * ROW_VECTORS + t + j * BLOCK];
        if (mine(j)) uw[j] = p.weight[t + j * BLOCK];
    }
    spin_wait(spin);
    uint4 ua[PER_THREAD], ub[PER_THREAD];
    for (int j = 0; j < PER_THREAD; ++j) {
        ua[j] = p.a[row * ROW_VECTORS + t + j * BLOCK];
        ub[j] = p.b[row * ROW_VECTORS + t + j * BLOCK];
    }
    if (G != Guard::UNGUARDED) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    float h[PER_THREAD][8], s0 = 0, s1 = 0;
    for (int j = 0; j < PER_THREAD; ++j) form_h(ua[j], ub[j], ur[j], h[j], s0, s1);
    sibling_wait<G>(Guard::EARLY);
    if (G == Guard::EARLY || G == Guard::UNGUARDED)
        for (int j = 0; j < PER_THREAD; ++j)
            if (mine(j)) p.residual[row * ROW_VECTORS + t + j * BLOCK] = round8(h[j]);
    const float total = block_sum<BLOCK, BLOCK / 32>(s0 + s1, sums);
    sibling_wait<G>(Guard::MID);
    if (G == Guard::MID)
        for (int j = 0; j < PER_THREAD; ++j)
            if (mine(j)) p.residual[row * ROW_VECTORS + t + j * BLOCK] = round8(h[j]);
    const float inv = rsqrtf(total * (1.0f / HIDDEN) + EPS);
    sibling_wait<G>(Guard::LATE);
    for (int j = 0; j < PER_THREAD; ++j) {
        if (!mine(j)) continue;
        const int i = row * ROW_VECTORS + t + j * BLOCK;
        float w[8], y[8];
        widen(uw[j], w);
        for (int k = 0; k < 8; ++k) y[k] = h[j][k] * inv * w[k];
        p.out[i] = round8(y);
        if (G == Guard::LATE) p.residual[i] = round8(h[j]);
    }
}

template <int K, int BLOCK, Guard G>
void launch_guarded(const Buffers& p, cudaStream_t stream, long long spin = 0)
{
    static_assert(K > 1, "a cluster of siblings");
    launch_rows(redundant_guarded<K, BLOCK, G>, K, BLOCK, p, stream, spin);
}

// Microseconds per launch: the median over `reps` replays of a graph of `per_graph` launches.
template <typename F>
float per_launch_us(F launch_once, cudaStream_t stream, int per_graph = 100, int reps = 15)
{
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < per_graph; ++i) launch_once();
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    CHECK(cudaStreamSynchronize(stream));
    std::vector<float> us;
    for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(start, stream));
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaEventSynchronize(stop));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        us.push_back(ms * 1000.0f / per_graph);
    }
    std::sort(us.begin(), us.end());
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return us[us.size() / 2];
}

std::vector<uint16_t> output_of(const Buffers& p)
{
    std::vector<uint16_t> host(ROWS * HIDDEN);
    CHECK(cudaMemcpy(host.data(), p.out, host.size() * 2, cudaMemcpyDeviceToHost));
    return host;
}

int main(int argc, char** argv)
{
    const size_t bytes = (size_t)ROWS * HIDDEN * 2;
    std::vector<uint16_t> host(ROWS * HIDDEN);
    for (size_t j = 0; j < host.size(); ++j) host[j] = (uint16_t)(0x3c00u + (j * 2654435761u >> 20) % 0x300u);  // 0.0078..2
    uint4 *a, *b, *residual, *weight, *out;
    for (uint4** buffer : {&a, &b, &residual, &out}) {
        CHECK(cudaMalloc(buffer, bytes));
        CHECK(cudaMemcpy(*buffer, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    CHECK(cudaMalloc(&weight, HIDDEN * 2));
    CHECK(cudaMemcpy(weight, host.data(), HIDDEN * 2, cudaMemcpyHostToDevice));
    unsigned* flag;
    CHECK(cudaMalloc(&flag, sizeof(unsigned)));
    const Buffers p{a, b, weight, residual, out, flag};
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));

    // The exchange gives the one-block result (residual read, not written: NORM alone).
    launch<1, THREADS, false, true, Exchange::NONE>(p, s);
    CHECK(cudaStreamSynchronize(s));
    const std::vector<uint16_t> one = output_of(p);
    launch<4, 128, false, true, Exchange::ST_ASYNC>(p, s);
    CHECK(cudaStreamSynchronize(s));
    const std::vector<uint16_t> four = output_of(p);
    size_t differ = 0;
    for (size_t j = 0; j < one.size(); ++j) differ += one[j] != four[j];
    std::printf("check: st.async over 4 blocks against one block: %zu of %zu elements differ\n", differ, one.size());
    // Two fused variants' out and residual (the residual reset before each), element by element.
    auto differing = [&](auto launch_a, auto launch_b) {
        std::vector<std::vector<uint16_t>> got;
        for (int variant = 0; variant < 2; ++variant) {
            CHECK(cudaMemcpy(residual, host.data(), bytes, cudaMemcpyHostToDevice));
            if (variant) launch_b();
            else launch_a();
            CHECK(cudaStreamSynchronize(s));
            got.push_back(output_of(p));
            std::vector<uint16_t> h(ROWS * HIDDEN);
            CHECK(cudaMemcpy(h.data(), residual, bytes, cudaMemcpyDeviceToHost));
            got.push_back(h);
        }
        size_t d = 0;
        for (size_t j = 0; j < one.size(); ++j) d += (got[0][j] != got[2][j]) + (got[1][j] != got[3][j]);
        return d;
    };
    std::printf("check: bf16x2 reduce against the float reduce: %zu of %zu elements (out and residual) differ\n",
                differing([&] { launch<1, THREADS, true, true, Exchange::NONE>(p, s); },
                          [&] { launch<1, THREADS, true, true, Exchange::NONE, false, true>(p, s); }),
                2 * one.size());
    // The redundant split gives the one-block fused pass's output and residual (bf16x2, hoisted, the residual stored early).
    std::printf("check: redundant K2, residual early, against one block (residual early): %zu of %zu elements (out and "
                "residual) differ\n",
                differing([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s); },
                          [&] { launch_redundant<2, 256, true, true>(p, s); }),
                2 * one.size());

    if (argc > 1 && std::string(argv[1]) == "guarded") {  // the split made sound for an in-place residual
        const auto one_early = [&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s); };
        std::printf("check: guarded K2/256 (early, mid, late) and K2/512 (mid) against one block: %zu, %zu, %zu, %zu of %zu "
                    "elements (out and residual) differ\n",
                    differing(one_early, [&] { launch_guarded<2, 256, Guard::EARLY>(p, s); }),
                    differing(one_early, [&] { launch_guarded<2, 256, Guard::MID>(p, s); }),
                    differing(one_early, [&] { launch_guarded<2, 256, Guard::LATE>(p, s); }),
                    differing(one_early, [&] { launch_guarded<2, 512, Guard::MID>(p, s); }), 2 * one.size());
        for (long long spin : {0LL, 2000LL}) {
            for (int round = 0; round < 3; ++round) {
                const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s, spin); }, s);
                const float early = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s, spin); }, s);
                const float r2e = per_launch_us([&] { launch_redundant<2, 256, true, true>(p, s, spin); }, s);
                const float c0 = per_launch_us([&] { launch_guarded<2, 256, Guard::UNGUARDED>(p, s, spin); }, s);
                const float c1 = per_launch_us([&] { launch_guarded<2, 256, Guard::EARLY>(p, s, spin); }, s);
                const float c2 = per_launch_us([&] { launch_guarded<2, 256, Guard::MID>(p, s, spin); }, s);
                const float c3 = per_launch_us([&] { launch_guarded<2, 256, Guard::LATE>(p, s, spin); }, s);
                const float w2 = per_launch_us([&] { launch_guarded<2, 512, Guard::MID>(p, s, spin); }, s);
                std::printf("spin %lld round %d: base %.3f | adds: one block, residual early %+.3f | K2/256 unguarded: plain "
                            "launch %+.3f, cluster launch %+.3f | guarded K2/256: early %+.3f, mid %+.3f, late %+.3f | "
                            "K2/512 mid %+.3f\n", spin, round, base, early - base, r2e - base, c0 - base, c1 - base,
                            c2 - base, c3 - base, w2 - base);
            }
        }
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "exchange_early") {  // the st.async exchange, its residual stored early
        const auto one_early = [&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s); };
        std::printf("check: st.async K2/256, K4/128, K4/256 (hoisted, bf16x2, residual early) against one block: %zu, %zu, "
                    "%zu of %zu elements (out and residual) differ\n",
                    differing(one_early, [&] { launch<2, 256, true, true, Exchange::ST_ASYNC, true, true, true>(p, s); }),
                    differing(one_early, [&] { launch<4, 128, true, true, Exchange::ST_ASYNC, true, true, true>(p, s); }),
                    differing(one_early, [&] { launch<4, 256, true, true, Exchange::ST_ASYNC, true, true, true>(p, s); }),
                    2 * one.size());
        for (long long spin : {0LL, 2000LL}) {
            for (int round = 0; round < 3; ++round) {
                const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s, spin); }, s);
                const float early = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s, spin); }, s);
                const float late_loads = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, false, true, true>(p, s, spin); }, s);
                const float x2 = per_launch_us([&] { launch<2, 256, true, true, Exchange::ST_ASYNC, true, true, true>(p, s, spin); }, s);
                const float x4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::ST_ASYNC, true, true, true>(p, s, spin); }, s);
                const float x4w = per_launch_us([&] { launch<4, 256, true, true, Exchange::ST_ASYNC, true, true, true>(p, s, spin); }, s);
                const float x8 = per_launch_us([&] { launch<8, 64, true, true, Exchange::ST_ASYNC, true, true, true>(p, s, spin); }, s);
                const float l4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::LOCAL, true, true, true>(p, s, spin); }, s);
                std::printf("spin %lld round %d: base %.3f | adds: one block, residual early %+.3f (residual and weight "
                            "loaded after the sources: %+.3f) | st.async, residual early: K2/256 %+.3f, K4/128 %+.3f, "
                            "K4/256 %+.3f, K8/64 %+.3f | K4/128 no exchange %+.3f\n", spin, round, base, early - base,
                            late_loads - base, x2 - base, x4 - base, x4w - base, x8 - base, l4 - base);
            }
        }
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "early") {  // the residual stored before the norm, one block and split
        for (long long spin : {0LL, 2000LL}) {
            for (int round = 0; round < 3; ++round) {
                const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s, spin); }, s);
                const float one = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true>(p, s, spin); }, s);
                const float one_early = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true, true>(p, s, spin); }, s);
                const float r2 = per_launch_us([&] { launch_redundant<2, 256, true>(p, s, spin); }, s);
                const float r2e = per_launch_us([&] { launch_redundant<2, 256, true, true>(p, s, spin); }, s);
                const float r2w = per_launch_us([&] { launch_redundant<2, 512, true, true>(p, s, spin); }, s);
                const float r2n = per_launch_us([&] { launch_redundant<2, 128, true, true>(p, s, spin); }, s);
                const float r4 = per_launch_us([&] { launch_redundant<4, 256, true, true>(p, s, spin); }, s);
                std::printf("spin %lld round %d: base %.3f | adds: one block %+.3f, residual early %+.3f | redundant K2/256 %+.3f, "
                            "early: K2/256 %+.3f, K2/512 %+.3f, K2/128 %+.3f, K4/256 %+.3f\n",
                            spin, round, base, one - base, one_early - base, r2 - base, r2e - base, r2w - base, r2n - base, r4 - base);
            }
        }
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "redundant") {  // the split without an exchange, against base and the one-block pass
        for (long long spin : {0LL, 2000LL}) {
            for (int round = 0; round < 3; ++round) {
                const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s, spin); }, s);
                const float base4 = per_launch_us([&] { launch<4, 128, false, false, Exchange::NONE>(p, s, spin); }, s);
                const float hpacked = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true>(p, s, spin); }, s);
                const float r2 = per_launch_us([&] { launch_redundant<2, 256, true>(p, s, spin); }, s);
                const float r4 = per_launch_us([&] { launch_redundant<4, 128, true>(p, s, spin); }, s);
                const float r4w = per_launch_us([&] { launch_redundant<4, 512, true>(p, s, spin); }, s);
                const float r4n = per_launch_us([&] { launch_redundant<4, 128, false>(p, s, spin); }, s);
                const float r8 = per_launch_us([&] { launch_redundant<8, 64, true>(p, s, spin); }, s);
                const float r8w = per_launch_us([&] { launch_redundant<8, 256, true>(p, s, spin); }, s);
                std::printf("spin %lld round %d: base %.3f, base over 4 blocks of 128 %+.3f | adds: one block, bf16x2 + hoisted %+.3f | "
                            "redundant K2/256 %+.3f, K4/128 %+.3f, K4/512 %+.3f, K4/128 not hoisted %+.3f, K8/64 %+.3f, K8/256 %+.3f\n",
                            spin, round, base, base4 - base, hpacked - base, r2 - base, r4 - base, r4w - base, r4n - base, r8 - base, r8w - base);
            }
        }
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "profile") {  // one launch of each variant, for ncu
        launch<1, THREADS, false, false, Exchange::NONE>(p, s);
        launch<1, THREADS, true, false, Exchange::NONE>(p, s);
        launch<1, THREADS, false, true, Exchange::NONE>(p, s);
        launch<1, THREADS, true, true, Exchange::NONE>(p, s);
        launch<1, THREADS, true, true, Exchange::NONE, false, true>(p, s);
        launch<4, 128, true, true, Exchange::LOCAL>(p, s);
        launch<4, 128, true, true, Exchange::ST_ASYNC>(p, s);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }

    std::printf("us per kernel, [%d x %d] bf16, the median of 15 graph replays of 100 launches\n", ROWS, HIDDEN);
    for (int round = 0; round < 3; ++round) {
        const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s); }, s);
        const float extra = per_launch_us([&] { launch<1, THREADS, true, false, Exchange::NONE>(p, s); }, s);
        const float norm = per_launch_us([&] { launch<1, THREADS, false, true, Exchange::NONE>(p, s); }, s);
        const float full = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE>(p, s); }, s);
        const float local4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::LOCAL>(p, s); }, s);
        const float local4w = per_launch_us([&] { launch<4, THREADS, true, true, Exchange::LOCAL>(p, s); }, s);
        const float sync4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::CLUSTER_SYNC>(p, s); }, s);
        const float async2 = per_launch_us([&] { launch<2, 256, true, true, Exchange::ST_ASYNC>(p, s); }, s);
        const float async4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::ST_ASYNC>(p, s); }, s);
        const float async8 = per_launch_us([&] { launch<8, 64, true, true, Exchange::ST_ASYNC>(p, s); }, s);
        std::printf("round %d: base %.3f | adds: extra %+.3f norm %+.3f full %+.3f | K4 (128 threads) local %+.3f, "
                    "(512 threads) local %+.3f | cluster.sync K4 %+.3f | st.async K2 %+.3f K4 %+.3f K8 %+.3f\n",
                    round, base, extra - base, norm - base, full - base, local4 - base, local4w - base, sync4 - base,
                    async2 - base, async4 - base, async8 - base);
    }
    for (long long spin : {0LL, 2000LL, -2000LL}) {
        const float base = per_launch_us([&] { launch<1, THREADS, false, false, Exchange::NONE>(p, s, spin); }, s);
        const float full = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE>(p, s, spin); }, s);
        const float hoisted = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true>(p, s, spin); }, s);
        const float async4 = per_launch_us([&] { launch<4, 128, true, true, Exchange::ST_ASYNC>(p, s, spin); }, s);
        const float async4w = per_launch_us([&] { launch<4, THREADS, true, true, Exchange::ST_ASYNC>(p, s, spin); }, s);
        const float async4h = per_launch_us([&] { launch<4, THREADS, true, true, Exchange::ST_ASYNC, true>(p, s, spin); }, s);
        const float packed = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, false, true>(p, s, spin); }, s);
        const float hpacked = per_launch_us([&] { launch<1, THREADS, true, true, Exchange::NONE, true, true>(p, s, spin); }, s);
        const float async4hp = per_launch_us([&] { launch<4, 128, true, true, Exchange::ST_ASYNC, true, true>(p, s, spin); }, s);
        const float local4hp = per_launch_us([&] { launch<4, 128, true, true, Exchange::LOCAL, true, true>(p, s, spin); }, s);
        std::printf("spin %lld cycles (negative: a signal raised then): base %.3f | adds: full %+.3f, operands hoisted above the wait %+.3f | st.async K4 "
                    "(128 threads) %+.3f, (512 threads) %+.3f, (512, hoisted) %+.3f | bf16x2 reduce %+.3f, hoisted %+.3f, "
                    "K4 128 hoisted: st.async %+.3f local %+.3f\n", spin, base, full - base,
                    hoisted - base, async4 - base, async4w - base, async4h - base, packed - base, hpacked - base,
                    async4hp - base, local4hp - base);
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
