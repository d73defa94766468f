/* nanwidget's one native kernel: abs min / abs max of a CPU tensor in one read.
 *
 * One read-only pass over its elements computes the min and max of the
 * magnitude *bit patterns* (the float's bits with the sign bit cleared). For IEEE floats the
 * integer order of those patterns is the order of |x|, with +Inf above every finite value and
 * NaN above +Inf, so the two results are exactly abs_min and abs_max (NaN wins the max).
 * torch needs two kernels for this (|x| into a buffer, then a min/max), i.e. a write pass.
 *
 * The caller (nanwidget/core/native.py) guarantees that the block is a dense, readable span
 * of `n` elements of the given kind, kept alive for the duration of the call.
 * Masked patterns fit the signed type of the same width, so signed min/max (which SSE2 and
 * AVX2 have as vector instructions) gives the same result as unsigned.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#if defined(NANWIDGET_TARGET_CLONES)
#define NW_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define NW_CLONES
#endif

/* One loop per element width; the mask clears the sign bit and is also the largest pattern. */
#define NW_DEFINE_RANGE(name, type, mask)                                                  \
    NW_CLONES void name(const type *data, int64_t n, int64_t *out) {                       \
        type low = (mask), high = 0;                                                       \
        for (int64_t i = 0; i < n; i++) {                                                  \
            type v = (type)(data[i] & (mask));                                             \
            low = v < low ? v : low;                                                       \
            high = v > high ? v : high;                                                    \
        }                                                                                  \
        out[0] = low;                                                                      \
        out[1] = high;                                                                     \
    }

NW_DEFINE_RANGE(nanwidget_range16, int16_t, INT16_MAX)
NW_DEFINE_RANGE(nanwidget_range32, int32_t, INT32_MAX)
NW_DEFINE_RANGE(nanwidget_range64, int64_t, INT64_MAX)

/* Magnitude bit patterns back to values, as doubles (every value of these types is exact). */
static double from_half(int64_t h) {
    int64_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) return (double)mantissa / 16777216.0; /* subnormal: mantissa * 2^-24 */
    uint64_t bits = exponent == 31 ? (UINT64_C(0x7FF) << 52) | ((uint64_t)mantissa << 42)
                                   : ((uint64_t)(exponent - 15 + 1023) << 52) | ((uint64_t)mantissa << 42);
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static double from_float_bits(int64_t pattern) {
    uint32_t bits = (uint32_t)pattern;
    float value;
    memcpy(&value, &bits, sizeof value);
    return (double)value;
}

static double from_double_bits(int64_t pattern) {
    double value;
    memcpy(&value, &pattern, sizeof value);
    return value;
}

/* abs min and abs max of `n` (> 0) elements at `data` into out[0], out[1]. kind: 0 float16,
 * 1 bfloat16, 2 float32, 3 float64. Returns 0, or -1 for an unknown kind (out untouched). */
int nanwidget_abs_range(const void *data, int64_t n, int64_t kind, double *out) {
    int64_t range[2];
    switch (kind) {
    case 0:
        nanwidget_range16((const int16_t *)data, n, range);
        out[0] = from_half(range[0]);
        out[1] = from_half(range[1]);
        return 0;
    case 1:
        nanwidget_range16((const int16_t *)data, n, range);
        out[0] = from_float_bits(range[0] << 16);
        out[1] = from_float_bits(range[1] << 16);
        return 0;
    case 2:
        nanwidget_range32((const int32_t *)data, n, range);
        out[0] = from_float_bits(range[0]);
        out[1] = from_float_bits(range[1]);
        return 0;
    case 3:
        nanwidget_range64((const int64_t *)data, n, range);
        out[0] = from_double_bits(range[0]);
        out[1] = from_double_bits(range[1]);
        return 0;
    default:
        return -1;
    }
}

int nanwidget_abi_version(void) { return 2; }
