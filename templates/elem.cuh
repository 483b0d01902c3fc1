// ---- element arithmetic: conversions to the float32 (or int32, int64) accumulator and the four ops ----
// Reductions accumulate in float32 and round once per reduce (int32 wraps), in the order the
// sources are given, so results are bitwise reproducible (purlinc/dtypes.py does the same).
// No NVRTC include headers: fp16 through PTX cvt, bf16 too (by bit manipulation before sm_80).

__device__ __forceinline__ float purlin_f32_to_acc(float x) { return x; }
__device__ __forceinline__ float purlin_acc_to_f32(float x) { return x; }

__device__ __forceinline__ float purlin_f16_to_acc(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short purlin_acc_to_f16(float f)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float purlin_bf16_to_acc(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

// Round to nearest even; every NaN becomes the canonical 0x7fc0 (as dtypes.from_float32).  sm_80
// and later convert in one instruction (the same rounding; its NaN is 0x7fff, so NaNs are
// replaced): an epilogue rounds a few values per element, and the rounding by bit manipulation
// (five instructions and a select) made up much of its instruction count.
__device__ __forceinline__ unsigned short purlin_acc_to_bf16(float f)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return f != f ? (unsigned short)0x7fc0 : b;
#else
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// E bf16 values (E even, the array 4-byte aligned) widened, as purlin_bf16_to_acc each, a word
// (two values) at a time: a shift and a mask, where element by element the upper value of each
// word costs an extract, a move and a shift.
template <unsigned E>
__device__ __forceinline__ void purlin_bf16_to_acc_n(const unsigned short (&b)[E], float (&a)[E])
{
    static_assert(E % 2 == 0, "bf16 values go in pairs");
#pragma unroll
    for (unsigned k = 0; k < E; k += 2) {
        const unsigned w = reinterpret_cast<const unsigned*>(b)[k / 2];
        a[k] = __uint_as_float(w << 16);
        a[k + 1] = __uint_as_float(w & 0xffff0000u);
    }
}

// E values (E even, the array 4-byte aligned) rounded to bf16, as purlin_acc_to_bf16 each.  On
// sm_80 and later one cvt.rn.bf16x2 rounds a pair, and one NaN test per value guards a rare pass
// that writes the canonical NaNs: converted one at a time, ptxas spends a conversion and a select
// on every value (in a fused epilogue, a third of its instructions).
template <unsigned E>
__device__ __forceinline__ void purlin_acc_to_bf16_n(const float (&a)[E], unsigned short (&b)[E])
{
    static_assert(E % 2 == 0, "bf16 values go in pairs");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    bool nan = false;
#pragma unroll
    for (unsigned k = 0; k < E; k += 2) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(reinterpret_cast<unsigned*>(b)[k / 2]) : "f"(a[k + 1]), "f"(a[k]));
        nan |= (a[k] != a[k]) | (a[k + 1] != a[k + 1]);
    }
    if (nan) {
#pragma unroll
        for (unsigned k = 0; k < E; ++k) b[k] = purlin_acc_to_bf16(a[k]);
    }
#else
#pragma unroll
    for (unsigned k = 0; k < E; ++k) b[k] = purlin_acc_to_bf16(a[k]);
#endif
}

// E values (E even) rounded to bf16 and back, in place: purlin_bf16_to_acc(purlin_acc_to_bf16(x))
// except that a NaN stays some NaN, not the canonical one.  For values that are used, not stored
// (a fused epilogue's reduced output): a pair costs one conversion and two bit operations.
template <unsigned E>
__device__ __forceinline__ void purlin_round_bf16_n(float (&a)[E])
{
    static_assert(E % 2 == 0, "bf16 values go in pairs");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#pragma unroll
    for (unsigned k = 0; k < E; k += 2) {
        unsigned w;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(a[k + 1]), "f"(a[k]));
        a[k] = __uint_as_float(w << 16);
        a[k + 1] = __uint_as_float(w & 0xffff0000u);
    }
#else
#pragma unroll
    for (unsigned k = 0; k < E; ++k) a[k] = purlin_bf16_to_acc(purlin_acc_to_bf16(a[k]));
#endif
}

__device__ __forceinline__ int purlin_i32_to_acc(int x) { return x; }
__device__ __forceinline__ int purlin_acc_to_i32(int x) { return x; }
__device__ __forceinline__ long long purlin_i64_to_acc(long long x) { return x; }
__device__ __forceinline__ long long purlin_acc_to_i64(long long x) { return x; }

// float ops: explicit rounding (no contraction); max/min propagate NaN like numpy.
__device__ __forceinline__ float purlin_sum_f(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float purlin_prod_f(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float purlin_max_f(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float purlin_min_f(float a, float b) { return (a != a || a < b) ? a : b; }

// The sum of two sources' E bf16 values (E even, the arrays 4-byte aligned), rounded to bf16 and
// widened: purlin_sum_f of their floats, then purlin_round_bf16_n (a NaN stays some NaN).  On
// sm_90 and later one add.rn.bf16x2 rounds a pair's exact sums once, which gives the same bits: a
// float holds 24 bits, at least 2 * 8 + 2, so rounding the sum to a float and then to bf16 never
// differs from rounding it to bf16 once (double rounding is innocuous for addition at that width;
// the exponent ranges are the same, so subnormals and overflow agree too).  It replaces two
// widenings, two adds and a conversion per pair: a fused epilogue's reduce of two ranks.
template <unsigned E>
__device__ __forceinline__ void purlin_bf16_sum2_n(const unsigned short (&x)[E], const unsigned short (&y)[E],
                                                   float (&o)[E])
{
    static_assert(E % 2 == 0, "bf16 values go in pairs");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#pragma unroll
    for (unsigned k = 0; k < E; k += 2) {
        unsigned w;
        asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(w)
            : "r"(reinterpret_cast<const unsigned*>(x)[k / 2]), "r"(reinterpret_cast<const unsigned*>(y)[k / 2]));
        o[k] = __uint_as_float(w << 16);
        o[k + 1] = __uint_as_float(w & 0xffff0000u);
    }
#else
    float b[E];
    purlin_bf16_to_acc_n<E>(x, o);
    purlin_bf16_to_acc_n<E>(y, b);
#pragma unroll
    for (unsigned k = 0; k < E; ++k) o[k] = purlin_sum_f(o[k], b[k]);
    purlin_round_bf16_n<E>(o);
#endif
}

// int32 ops: sum and prod wrap (done in unsigned arithmetic, which has no overflow UB).
__device__ __forceinline__ int purlin_sum_i(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int purlin_prod_i(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int purlin_max_i(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int purlin_min_i(int a, int b) { return a < b ? a : b; }

// int64 ops: the same, in 64 bits.
__device__ __forceinline__ long long purlin_sum_l(long long a, long long b)
{
    return (long long)((unsigned long long)a + (unsigned long long)b);
}
__device__ __forceinline__ long long purlin_prod_l(long long a, long long b)
{
    return (long long)((unsigned long long)a * (unsigned long long)b);
}
__device__ __forceinline__ long long purlin_max_l(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long purlin_min_l(long long a, long long b) { return a < b ? a : b; }
