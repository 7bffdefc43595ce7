/* The syncer's hot loop, fused: decode a quantised contribution and fold it into fp64 sums.
 *
 * Built by workers/native.py on first use (cc -O3 -ffp-contract=off) and called through ctypes,
 * which releases the GIL for the duration of each call. pipeline/kernels.py holds the numpy
 * definition of every function here; the two agree bit for bit, dot products included (same
 * summation order: LANES below must equal pipeline.kernels.LANES).
 *
 * Element j of a tensor decodes exactly as pipeline/quant.py decodes it:
 *   int4  d = (float)((nibble ^ 8) - 8) * scale[j / block]  (element 2i: low nibble of byte i)
 *   int8  d = (float)q[j] * scale[j / block]
 *   bf16  d = the float whose upper 16 bits are q[j]
 *   fp32  d = x[j]
 * Two passes per tensor; neither writes the decoded tensor to memory (it goes through a small
 * buffer that stays in L1):
 *   stats: dd = sum d*d and ad = sum a*d (a: the anchor, may be NULL), in double;
 *   axpy:  acc[j] += c * (double)d[j].
 * -ffp-contract=off keeps every multiply and add separately rounded, as numpy does, so axpy is
 * bit-identical to its numpy twin. The dot products keep LANES partial sums (element j in lane
 * j % LANES), added lane 0..LANES-1 at the end: one fixed order whatever the vector width.
 */
#include <stdint.h>
#include <string.h>

#define LANES 32 /* 4 vectors of 8: independent add chains */
#define CHUNK 1024 /* elements decoded at a time: t and a chunk of acc stay in L1 */

/* GCC/Clang vector extensions: 8 lanes whatever the machine's vector width. */
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef double v8d __attribute__((vector_size(8 * sizeof(double))));

enum { FP32 = 0, INT4 = 4, INT8 = 8, BF16 = 16 };

static inline float nib(unsigned v) { return (float)((int)((v ^ 8u) & 15u) - 8); }

/* Decode elements [j0, j0 + len) of an int4/int8 tensor, all inside block j0 / block. */
static inline void decode_block(int codec, const void *q, float sc, int64_t j0, int64_t len,
                                float *t) {
    if (codec == INT4) {
        const uint8_t *p = (const uint8_t *)q;
        int64_t i = 0, j = j0;
        if (j & 1) { t[i++] = nib(p[j >> 1] >> 4) * sc; j++; }
        const uint8_t *pb = p + (j >> 1);
        int64_t pairs = (len - i) >> 1;
        for (int64_t k = 0; k < pairs; k++) {
            unsigned byte = pb[k];
            t[i + 2 * k] = nib(byte & 15u) * sc;
            t[i + 2 * k + 1] = nib(byte >> 4) * sc;
        }
        i += 2 * pairs;
        if (i < len) t[i] = nib(pb[pairs] & 15u) * sc;
    } else {
        const int8_t *p = (const int8_t *)q + j0;
        for (int64_t i = 0; i < len; i++) t[i] = (float)p[i] * sc;
    }
}

/* Decode elements [j0, j0 + len) into t (len <= CHUNK). */
static void decode(int codec, const void *q, const float *s, int64_t block, int64_t j0,
                   int64_t len, float *t) {
    if (codec == INT4 || codec == INT8) {
        for (int64_t j = j0, end = j0 + len; j < end;) {
            int64_t b = j / block, stop = (b + 1) * block < end ? (b + 1) * block : end;
            decode_block(codec, q, s[b], j, stop - j, t + (j - j0));
            j = stop;
        }
    } else if (codec == BF16) {
        const uint16_t *p = (const uint16_t *)q + j0;
        for (int64_t i = 0; i < len; i++) {
            uint32_t bits = (uint32_t)p[i] << 16;
            memcpy(&t[i], &bits, sizeof bits);
        }
    } else {
        memcpy(t, (const float *)q + j0, (size_t)len * sizeof(float));
    }
}

/* Statistics of k tensors: tensor i has codec[i], data q[i], scales s[i], n[i] elements,
 * block[i] and anchor a[i] (may be NULL). out[2i] = sum d*d, out[2i + 1] = sum a*d. */
void diloco_stats(int k, const int *codec, const void *const *q, const float *const *s,
                  const int64_t *n, const int64_t *block, const float *const *a, double *out) {
    float t[CHUNK];
    for (int i = 0; i < k; i++) {
        v8d dd[4], ad[4]; /* lane l = 8v + e holds the elements j with j % LANES == l */
        memset(dd, 0, sizeof dd);
        memset(ad, 0, sizeof ad);
        for (int64_t j0 = 0; j0 < n[i]; j0 += CHUNK) { /* j0 % LANES == 0 */
            int64_t len = j0 + CHUNK < n[i] ? CHUNK : n[i] - j0, m = 0;
            decode(codec[i], q[i], s[i], block[i], j0, len, t);
            const float *ai = a[i] ? a[i] + j0 : 0;
            for (; m + LANES <= len; m += LANES) {
                for (int v = 0; v < 4; v++) {
                    v8f tf;
                    memcpy(&tf, t + m + 8 * v, sizeof tf);
                    v8d d = __builtin_convertvector(tf, v8d);
                    dd[v] += d * d;
                    if (ai) {
                        v8f af;
                        memcpy(&af, ai + m + 8 * v, sizeof af);
                        ad[v] += __builtin_convertvector(af, v8d) * d;
                    }
                }
            }
            for (int l = 0; m < len; m++, l++) { /* the tensor's tail */
                double d = t[m];
                dd[l / 8][l % 8] += d * d;
                if (ai) ad[l / 8][l % 8] += (double)ai[m] * d;
            }
        }
        double sdd = 0.0, sad = 0.0;
        for (int l = 0; l < LANES; l++) { sdd += dd[l / 8][l % 8]; sad += ad[l / 8][l % 8]; }
        out[2 * i] = sdd;
        out[2 * i + 1] = sad;
    }
}

/* acc[i][j] += c[i] * d_i[j] for k tensors (same layout arguments as diloco_stats). */
void diloco_axpy(int k, const int *codec, const void *const *q, const float *const *s,
                 const int64_t *n, const int64_t *block, const double *c, double *const *acc) {
    float t[CHUNK];
    for (int i = 0; i < k; i++) {
        double ci = c[i];
        for (int64_t j0 = 0; j0 < n[i]; j0 += CHUNK) {
            int64_t len = j0 + CHUNK < n[i] ? CHUNK : n[i] - j0;
            double *out = acc[i] + j0;
            decode(codec[i], q[i], s[i], block[i], j0, len, t);
            for (int64_t m = 0; m < len; m++) out[m] += ci * (double)t[m];
        }
    }
}
