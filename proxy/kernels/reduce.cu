// Elementwise reductions of the device proxy's cuda backend (proxy/gpu.py), in the host backend's
// arithmetic (proxy/hal.py HostBackend.reduce), so that a job's numbers are the same whether its
// ranks' contributions were combined on a GPU or in host memory:
//
//   float32, float64   IEEE add, multiply, divide (no contraction: there is no multiply-add here);
//   float16            each step converts both operands to float32 exactly, combines them there and
//                      rounds the result to float16 (to nearest, ties to even), as numpy's half loops do;
//   bfloat16           contributions widened to float32 (exact), combined in float32 in the order
//                      given, rounded once at the end (to nearest, ties to even; NaN stays a quiet NaN);
//   integers           two's-complement wraparound, as numpy's;
//   bool               sum and max are "or", product and min are "and";
//   min, max           a NaN on either side wins, and of two equal values (+0 and -0) the second
//                      (float32, float64, bfloat16) or the first (float16), as numpy's minimum and
//                      maximum choose.
//
// A NaN result is a NaN, but its sign and payload are not promised: a GPU writes its canonical NaN
// where arithmetic makes one, x86 an operand's.
//
// The same functions compile for the host (g++ -x c++), where the unit tests run them against the host
// backend on the same inputs (tests/unit/test_proxy_gpu_kernels.py). `make kernels` turns this file into
// reduce.ptx, which the proxy loads with the driver (no compiler on the GPU node); the PTX targets
// compute capability 7.5 (Turing) and newer, which the driver compiles it for; on older GPUs the proxy
// offers no GPU buffers.

#include <stdint.h>

#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD static inline
#endif

// --- float16 and bfloat16 as bits ------------------------------------------------------------------

HD uint32_t f32_bits(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}

HD float f32_of(uint32_t u) {
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
}

HD float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t sig = h & 0x3ffu;
    if (exp == 0x1fu)  // infinity or NaN: the payload moves up, as numpy's conversion does
        return f32_of(sign | 0x7f800000u | (sig << 13));
    if (exp == 0) {
        if (sig == 0)
            return f32_of(sign);
        // a subnormal: normalise it
        exp = 113;  // 127 - 15 + 1
        while ((sig & 0x400u) == 0) {
            sig <<= 1;
            exp--;
        }
        return f32_of(sign | (exp << 23) | ((sig & 0x3ffu) << 13));
    }
    return f32_of(sign | ((exp + 112) << 23) | (sig << 13));
}

HD uint16_t float_to_half(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = u & 0x7f800000u;
    uint32_t sig = u & 0x007fffffu;
    if (exp >= 0x47800000u) {  // overflows float16, or is infinity or NaN
        if (exp == 0x7f800000u && sig != 0) {
            uint16_t nan = (uint16_t)(0x7c00u + (sig >> 13));
            return (uint16_t)(sign + (nan == 0x7c00u ? 0x7c01u : nan));  // stays a NaN
        }
        return (uint16_t)(sign + 0x7c00u);
    }
    if (exp <= 0x38000000u) {  // a float16 subnormal, or zero
        if (exp < 0x33000000u)  // below half the smallest subnormal: a signed zero
            return sign;
        uint32_t shift = 113 - (exp >> 23);  // 1 ..
        sig |= 0x00800000u;
        uint32_t kept = sig >> (shift + 13);
        uint32_t rest = sig & ((1u << (shift + 13)) - 1u);
        uint32_t half = 1u << (shift + 12);
        if (rest > half || (rest == half && (kept & 1u)))
            kept++;
        return (uint16_t)(sign + kept);
    }
    uint32_t h = ((exp - 0x38000000u) >> 13) | (sig >> 13);
    uint32_t rest = sig & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;  // may carry into the exponent, up to infinity: still the right rounding
    return (uint16_t)(sign + h);
}

HD float bf16_to_float(uint16_t b) { return f32_of((uint32_t)b << 16); }

HD uint16_t float_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if (f != f)
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// --- the combining steps ---------------------------------------------------------------------------

// numpy's float32 and float64 loops keep the second of two equal values, its float16 loop the first
template <typename T> HD T fmin_nan(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> HD T fmax_nan(T a, T b) { return (a > b || a != a) ? a : b; }
HD float fmin_first(float a, float b) { return (a <= b || a != a) ? a : b; }
HD float fmax_first(float a, float b) { return (a >= b || a != a) ? a : b; }

template <typename T, typename U> HD T wrap_add(T a, T b) { return (T)(U)((U)a + (U)b); }
template <typename T, typename U> HD T wrap_mul(T a, T b) {
    return (T)(U)((unsigned long long)(U)a * (unsigned long long)(U)b);
}
template <typename T> HD T imin(T a, T b) { return a < b ? a : b; }
template <typename T> HD T imax(T a, T b) { return a > b ? a : b; }

#define FLOAT_STEPS(T)                                                  \
    HD T sum_##T(T a, T b) { return a + b; }                            \
    HD T product_##T(T a, T b) { return a * b; }                        \
    HD T min_##T(T a, T b) { return fmin_nan<T>(a, b); }                \
    HD T max_##T(T a, T b) { return fmax_nan<T>(a, b); }
FLOAT_STEPS(float)
FLOAT_STEPS(double)

#define INT_STEPS(T, U)                                                 \
    HD T sum_##T(T a, T b) { return wrap_add<T, U>(a, b); }             \
    HD T product_##T(T a, T b) { return wrap_mul<T, U>(a, b); }         \
    HD T min_##T(T a, T b) { return imin<T>(a, b); }                    \
    HD T max_##T(T a, T b) { return imax<T>(a, b); }
INT_STEPS(int8_t, uint8_t)
INT_STEPS(int16_t, uint16_t)
INT_STEPS(int32_t, uint32_t)
INT_STEPS(int64_t, uint64_t)
INT_STEPS(uint8_t, uint8_t)

typedef uint8_t boolean;
HD boolean sum_boolean(boolean a, boolean b) { return (boolean)((a | b) != 0); }
HD boolean product_boolean(boolean a, boolean b) { return (boolean)(a != 0 && b != 0); }
HD boolean min_boolean(boolean a, boolean b) { return (boolean)(a != 0 && b != 0); }
HD boolean max_boolean(boolean a, boolean b) { return (boolean)((a | b) != 0); }

typedef uint16_t half_bits;
#define HALF_STEP(OP, F)                                                \
    HD half_bits OP##_half_bits(half_bits a, half_bits b) {             \
        return float_to_half(F(half_to_float(a), half_to_float(b)));    \
    }
HALF_STEP(sum, sum_float)
HALF_STEP(product, product_float)
HALF_STEP(min, fmin_first)
HALF_STEP(max, fmax_first)

// bfloat16: the accumulator is float32, the contribution bfloat16
#define BF16_STEP(OP)                                                   \
    HD float OP##_bf16(float acc, uint16_t b) { return OP##_float(acc, bf16_to_float(b)); }
BF16_STEP(sum)
BF16_STEP(product)
BF16_STEP(min)
BF16_STEP(max)

HD float div_float(float a, float d) { return a / d; }
HD double div_double(double a, double d) { return a / d; }
HD half_bits div_half_bits(half_bits a, float d) { return float_to_half(half_to_float(a) / d); }

// --- kernels (GPU) and the same loops (host, for the tests) ---------------------------------------
//
// Names: sp_<op>_<dtype>(acc, part, n) sets acc[i] = op(acc[i], part[i]); sp_widen_bfloat16(acc, part,
// n) sets the float32 acc[i] to part[i]; sp_narrow_bfloat16(out, acc, n) rounds acc into out;
// sp_div_<dtype>(acc, d, n) divides in place (avg). Host builds name them host_... instead.

#ifdef __CUDACC__
#define LOOP_HEAD(NAME, ...) extern "C" __global__ void sp_##NAME(__VA_ARGS__, uint64_t n) {          \
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;                       \
         i += (uint64_t)blockDim.x * gridDim.x)
#else
#define LOOP_HEAD(NAME, ...) extern "C" void host_##NAME(__VA_ARGS__, uint64_t n) {                   \
    for (uint64_t i = 0; i < n; i++)
#endif
#define LOOP_TAIL }

#define COMBINE(OP, NAME, T)                                            \
    LOOP_HEAD(OP##_##NAME, T* acc, const T* part) acc[i] = OP##_##T(acc[i], part[i]); LOOP_TAIL
#define COMBINE_ALL(NAME, T) COMBINE(sum, NAME, T) COMBINE(product, NAME, T) \
    COMBINE(min, NAME, T) COMBINE(max, NAME, T)

COMBINE_ALL(float32, float)
COMBINE_ALL(float64, double)
COMBINE_ALL(float16, half_bits)
COMBINE_ALL(int8, int8_t)
COMBINE_ALL(int16, int16_t)
COMBINE_ALL(int32, int32_t)
COMBINE_ALL(int64, int64_t)
COMBINE_ALL(uint8, uint8_t)
COMBINE_ALL(bool, boolean)

#define COMBINE_BF16(OP)                                                \
    LOOP_HEAD(OP##_bfloat16, float* acc, const uint16_t* part) acc[i] = OP##_bf16(acc[i], part[i]); LOOP_TAIL
COMBINE_BF16(sum)
COMBINE_BF16(product)
COMBINE_BF16(min)
COMBINE_BF16(max)

LOOP_HEAD(widen_bfloat16, float* acc, const uint16_t* part) acc[i] = bf16_to_float(part[i]); LOOP_TAIL
LOOP_HEAD(narrow_bfloat16, uint16_t* out, const float* acc) out[i] = float_to_bf16(acc[i]); LOOP_TAIL

LOOP_HEAD(div_float32, float* acc, float d) acc[i] = div_float(acc[i], d); LOOP_TAIL
LOOP_HEAD(div_float64, double* acc, double d) acc[i] = div_double(acc[i], d); LOOP_TAIL
LOOP_HEAD(div_float16, half_bits* acc, float d) acc[i] = div_half_bits(acc[i], d); LOOP_TAIL
