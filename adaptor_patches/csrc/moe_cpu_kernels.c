/* Fused CPU passes around the routed experts' bmm, float32 and bfloat16 (_bf16): moe_cpu.py calls
 * them, moe_cpu_native.py builds them.
 *
 * The GEMMs stay with torch (MKL). These replace the eager ops between them: the slot tables (one
 * counting pass instead of argsort + ~20 small ops), the padded row gather, SwiGLU in one pass, and
 * the combine as a per-token weighted sum (parallel over tokens, no scatter). Layout of the padded
 * rows: expert e owns slots [e*largest, (e+1)*largest); its rows come in increasing flat-row order
 * (what a stable argsort gives); the remaining slots are pads: zero rows in, never read by the
 * combine.
 */
#include <stdint.h>
#include <string.h>

/* counts[e] = rows routed to expert e; returns the largest count (or -1 for an index out of range). */
int64_t moe_count(const int64_t *expert_of_row, int64_t rows, int64_t experts, int64_t *counts)
{
    int64_t largest = 0;
    memset(counts, 0, (size_t)experts * sizeof(int64_t));
    for (int64_t r = 0; r < rows; r++) {
        int64_t e = expert_of_row[r];
        if (e < 0 || e >= experts)
            return -1;
        counts[e]++;
    }
    for (int64_t e = 0; e < experts; e++)
        largest = counts[e] > largest ? counts[e] : largest;
    return largest;
}

/* token_of_slot[s]: the token a slot holds, -1 for a pad; slot_of_row[r]: the slot of flat row r
 * (r = token * topk + k). fill[] is scratch of `experts` entries. */
void moe_slots(const int64_t *expert_of_row, int64_t rows, int64_t topk, int64_t experts, int64_t largest,
               int64_t *fill, int64_t *token_of_slot, int64_t *slot_of_row)
{
    memset(fill, 0, (size_t)experts * sizeof(int64_t));
    for (int64_t s = 0; s < experts * largest; s++)
        token_of_slot[s] = -1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t e = expert_of_row[r];
        int64_t slot = e * largest + fill[e]++;
        token_of_slot[slot] = r / topk;
        slot_of_row[r] = slot;
    }
}

/* out[s] = x[token_of_slot[s]], or zeros for a pad; rows of row_bytes bytes (any dtype). */
void moe_gather(const char *x, int64_t row_bytes, const int64_t *token_of_slot, int64_t slots, char *out)
{
    #pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < slots; s++) {
        char *dst = out + s * row_bytes;
        int64_t t = token_of_slot[s];
        if (t < 0)
            memset(dst, 0, (size_t)row_bytes);
        else
            memcpy(dst, x + t * row_bytes, (size_t)row_bytes);
    }
}

/* bfloat16 <-> float: bf16 is the top half of a float; rounding to nearest even, NaN kept quiet. */
static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f)
{
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t rounded = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16;
    uint32_t nan = (v.u & 0x7FFFFFFFu) > 0x7F800000u;
    return (uint16_t)(nan ? ((v.u >> 16) | 0x40u) : rounded);
}

/* exp(x) for x in [-87, 88]: Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-6
 * polynomial (Cephes expf coefficients, ~1 ulp); plain arithmetic so that the loops vectorise. */
static inline float exp_f32(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float shifter = 12582912.0f;                 /* 1.5 * 2^23: float add rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* out[s, j] = silu(gate[s, j]) * up[s, j] for the non-pad slots (all when token_of_slot is NULL).
 * gate and up are the two halves of in[s, 0:2*inter]: gate first when gate_first, else second
 * (upstream HunyuanMLP's order). out rows are out_stride floats apart, so out may be in's gate half. */
void moe_swiglu(const float *in, int64_t slots, int64_t inter, int64_t gate_first, const int64_t *token_of_slot,
                float *out, int64_t out_stride)
{
    #pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < slots; s++) {
        if (token_of_slot && token_of_slot[s] < 0)
            continue;
        const float *gate = in + s * 2 * inter + (gate_first ? 0 : inter);
        const float *up = in + s * 2 * inter + (gate_first ? inter : 0);
        float *dst = out + s * out_stride;
        #pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            float g = gate[j];
            dst[j] = g / (1.0f + exp_f32(-g)) * up[j];
        }
    }
}

/* moe_swiglu for bfloat16, rounding where torch's bf16 ops round: silu's result, then the product. */
void moe_swiglu_bf16(const uint16_t *in, int64_t slots, int64_t inter, int64_t gate_first,
                     const int64_t *token_of_slot, uint16_t *out, int64_t out_stride)
{
    #pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < slots; s++) {
        if (token_of_slot && token_of_slot[s] < 0)
            continue;
        const uint16_t *gate = in + s * 2 * inter + (gate_first ? 0 : inter);
        const uint16_t *up = in + s * 2 * inter + (gate_first ? inter : 0);
        uint16_t *dst = out + s * out_stride;
        #pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            float g = bf16_to_f32(gate[j]);
            float silu = bf16_to_f32(f32_to_bf16(g / (1.0f + exp_f32(-g))));
            dst[j] = f32_to_bf16(silu * bf16_to_f32(up[j]));
        }
    }
}

/* out[t, :] += sum_k weight[t * topk + k] * down[slot_of_row[t * topk + k], :], k in order (the
 * routing weights applied after the expert, as upstream's combine does); one thread per token. */
void moe_combine(const float *down, int64_t hidden, const int64_t *slot_of_row, const float *weight, int64_t tokens,
                 int64_t topk, float *out)
{
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float *dst = out + t * hidden;
        for (int64_t k = 0; k < topk; k++) {
            const float *src = down + slot_of_row[t * topk + k] * hidden;
            float w = weight[t * topk + k];
            #pragma omp simd
            for (int64_t j = 0; j < hidden; j++)
                dst[j] += w * src[j];
        }
    }
}

/* moe_combine for bfloat16 down and out: the sum is taken in fp32 and rounded once per element. */
void moe_combine_bf16(const uint16_t *down, int64_t hidden, const int64_t *slot_of_row, const float *weight,
                      int64_t tokens, int64_t topk, uint16_t *out)
{
    #pragma omp parallel
    {
        float acc[1024];
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t j0 = 0; j0 < hidden; j0 += 1024) {
                int64_t n = hidden - j0 < 1024 ? hidden - j0 : 1024;
                uint16_t *dst = out + t * hidden + j0;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++)
                    acc[j] = bf16_to_f32(dst[j]);
                for (int64_t k = 0; k < topk; k++) {
                    const uint16_t *src = down + slot_of_row[t * topk + k] * hidden + j0;
                    float w = weight[t * topk + k];
                    #pragma omp simd
                    for (int64_t j = 0; j < n; j++)
                        acc[j] += w * bf16_to_f32(src[j]);
                }
                #pragma omp simd
                for (int64_t j = 0; j < n; j++)
                    dst[j] = f32_to_bf16(acc[j]);
            }
        }
    }
}
