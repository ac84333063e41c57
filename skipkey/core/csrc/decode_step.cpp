// SkipKey's fused CPU kernels for KV eviction: a decode step of an evicting layer, and prompt scoring.
//
// Eager PyTorch spends a decode step of an evicting layer in a dozen small calls
// (10-40 us each on a small CPU) and reads the cache at about 60% of SDPA's speed
// when it also needs the attention weights; its prompt scoring writes every chunk's
// logits to memory and passes over them about nine times. These kernels do the same
// work in one call each:
//
//   attend_score      the attention output for one query per row *and* the score
//                     contribution softmax((logits + Gumbel noise) / tau), added to
//                     (or written over) the layer's scores in place, reading every
//                     key and value once; with no scores, the output alone (an
//                     evicting layer of an unscored policy: faster than SDPA here);
//   write_slot        the new token's key, value and position into the slot eviction
//                     freed, per row and KV head, and its score reset;
//   lowest_unprotected  per row and head, the lowest-priority slot outside the recent
//                     window (the next victim);
//   score_prompt      a chunk of prompt queries' contributions, summed over queries:
//                     logits on AMX tiles (bfloat16, where the CPU has them), AVX-512 or
//                     AVX2, then mask, noise and softmax while they are still in cache.
//
// Semantics are those of skipkey/attention.py and skipkey/kv_policies.py's eager
// code, which stays the reference (tests compare the two). Rows and heads are
// independent, so a row evicts the same tokens alone or batched.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void narrow(float& dst, float x) { dst = x; }
inline void narrow(c10::BFloat16& dst, float x) { dst = c10::BFloat16(x); }

// exp(x) for x <= 0 as plain arithmetic, so the loops that call it vectorise:
// Cephes' expf polynomial on the reduced argument, scaled by 2^n through the
// exponent bits. Relative error about 2e-7; exp(-87) and below round to 2^-125.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, the same arithmetic.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// The largest of row[0, n) (-inf for none), in sixteen running maxima the compiler vectorises (one would be a
// chain of dependent instructions). The maximum is exact, so the order does not change it.
inline float max_of(const float* row, int64_t n) {
  float tops[16];
  std::fill(tops, tops + 16, kNegInf);
  int64_t s = 0;
  for (; s + 16 <= n; s += 16)
    for (int t = 0; t < 16; ++t) tops[t] = row[s + t] > tops[t] ? row[s + t] : tops[t];
  float top = kNegInf;
  for (; s < n; ++s) top = std::max(top, row[s]);
  for (int t = 0; t < 16; ++t) top = std::max(top, tops[t]);
  return top;
}

// In place: row <- exp(row - top) (top: row's maximum, finite), entries of -inf (masked keys) exactly 0;
// returns their sum.
float exp_below(float* row, int64_t n, float top) {
  float sum = 0.0f;
  int64_t s = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top), masked = _mm512_set1_ps(kNegInf);
  __m512 sums = _mm512_setzero_ps();
  for (; s < n; s += 16) {
    const __mmask16 live = n - s >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - s)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(masked, live, row + s);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, masked, _CMP_NEQ_OQ), exp_nonpositive16(_mm512_sub_ps(x, shift)));
    _mm512_mask_storeu_ps(row + s, live, e);
    sums = _mm512_add_ps(sums, e);
  }
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (; s < n; ++s) {
    const float x = row[s];
    row[s] = x == kNegInf ? 0.0f : exp_nonpositive(x - top);
    sum += row[s];
  }
  return sum;
}

// In place: row <- exp(row - max(row)), entries of -inf (masked keys) exactly 0; returns their sum (0 if every
// entry is -inf). softmax is this divided by the sum.
float exp_shifted(float* row, int64_t n) {
  float top = kNegInf;
  int64_t s = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(kNegInf);
  for (; s + 16 <= n; s += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(row + s));
  top = _mm512_reduce_max_ps(tops);
#endif
  top = std::max(top, max_of(row + s, n - s));
  if (top == kNegInf) {
    std::fill(row, row + n, 0.0f);
    return 0.0f;
  }
  return exp_below(row, n, top);
}

// In place: row <- softmax(row); entries of -inf (masked keys) become exactly 0.
void softmax_row(float* row, int64_t n) {
  const float sum = exp_shifted(row, n);
  if (sum == 0.0f) return;  // no visible key (a decode query always sees itself, so never in practice)
  const float inv = 1.0f / sum;
  for (int64_t s = 0; s < n; ++s) row[s] *= inv;
}

#if defined(__AVX512F__)
// 16 lanes of float32 from 16 floats, or from 16 bfloat16s (their bits are a float32's top half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// A slot holding position p is visible to a query at qpos: a token at or before it, inside its window
// (window <= 0: none). The rule of skipkey.attention.allowed_keys.
inline bool visible_to(int64_t p, int64_t qpos, int64_t window) {
  return p >= 0 && p <= qpos && (window <= 0 || qpos - p < window);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  int64_t i = 0;
  float acc = 0.0f;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), sum);
  acc = _mm512_reduce_add_ps(sum);
#endif
  for (; i < d; ++i) acc += q[i] * widen(k[i]);
  return acc;
}

// acc[0, d) = sum over s of w[s] * v[s * stride : + d): each value row read once, the sums kept in registers.
template <typename T>
void weighted_rows(float* acc, const float* w, const T* v, int64_t rows, int64_t stride, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 64 <= d; i += 64) {  // 64 dimensions at a time: four registers
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t s = 0; s < rows; ++s) {
      if (w[s] == 0.0f) continue;
      const __m512 weight = _mm512_set1_ps(w[s]);
      const T* row = v + s * stride + i;
      a0 = _mm512_fmadd_ps(weight, load16(row), a0);
      a1 = _mm512_fmadd_ps(weight, load16(row + 16), a1);
      a2 = _mm512_fmadd_ps(weight, load16(row + 32), a2);
      a3 = _mm512_fmadd_ps(weight, load16(row + 48), a3);
    }
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
    _mm512_storeu_ps(acc + i + 32, a2);
    _mm512_storeu_ps(acc + i + 48, a3);
  }
#endif
  for (; i < d; ++i) {
    float sum = 0.0f;
    for (int64_t s = 0; s < rows; ++s) sum += w[s] * widen(v[s * stride + i]);
    acc[i] = sum;
  }
}

#if defined(__AVX512F__)
// Lane j of the result: the sum of v[j]'s 16 lanes (a transpose-and-add tree, about 3 instructions per vector
// where 16 horizontal sums take 8 each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of v[4i], ..., v[4i + 3]
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// Bit j: slot j of the n <= 16 at p holds a position visible to a query at qpos (visible_to, 16 at a time).
inline __mmask16 visible16(const int64_t* p, int64_t n, int64_t qpos, int64_t window) {
  const __mmask8 m0 = n >= 8 ? 0xFF : static_cast<__mmask8>((1u << n) - 1);
  const __mmask8 m1 = n >= 16 ? 0xFF : n > 8 ? static_cast<__mmask8>((1u << (n - 8)) - 1) : 0;
  const __m512i above = _mm512_set1_epi64(window > 0 ? std::max<int64_t>(-1, qpos - window) : -1);
  const __m512i upto = _mm512_set1_epi64(qpos);
  const __m512i a = _mm512_maskz_loadu_epi64(m0, p), b = _mm512_maskz_loadu_epi64(m1, p + 8);
  const __mmask8 va = _mm512_mask_cmpgt_epi64_mask(_mm512_mask_cmple_epi64_mask(m0, a, upto), a, above);
  const __mmask8 vb = _mm512_mask_cmpgt_epi64_mask(_mm512_mask_cmple_epi64_mask(m1, b, upto), b, above);
  return static_cast<__mmask16>(va | (static_cast<unsigned>(vb) << 8));
}

// Logits of query head g's (scaled, float32 qf or bfloat16 q16 when paired) against slots [s0, s0 + n), n <= 16,
// into out[0, n): -inf where vis is clear. Sixteen independent sums in registers, reduced together.
template <typename T>
inline void logits16(float* out, const float* qf, const uint16_t* q16, bool paired, const T* k, int64_t k_row,
                     int64_t n, int64_t dim, __mmask16 vis) {
  const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  if ((vis & live) == 0) {
    _mm512_mask_storeu_ps(out, live, _mm512_set1_ps(kNegInf));
    return;
  }
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j >= n) continue;
    const T* kr = k + j * k_row;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (paired) {
        for (int64_t i = 0; i < dim; i += 32)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(q16 + i), (__m512bh)_mm512_loadu_si512(kr + i));
        continue;
      }
    }
#endif
    for (int64_t i = 0; i < dim; i += 16) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), load16(kr + i), acc[j]);
  }
  _mm512_mask_storeu_ps(out, live, _mm512_mask_blend_ps(vis, _mm512_set1_ps(kNegInf), sum_lanes16(acc)));
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 keys and values with AVX512-BF16: pairs of bfloat16 products summed straight into float32
// (vdpbf16ps), with no widening of the cache. The query and the attention weights are rounded to
// bfloat16 first, as eager attention in bfloat16 does. Head sizes a multiple of 32.
constexpr bool kPairedBf16 = true;

inline uint32_t bf16_bits(float x) { return c10::BFloat16(x).x; }

inline float dot_bf16(const uint16_t* q, const c10::BFloat16* k, int64_t d) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
  return _mm512_reduce_add_ps(sum);
}

// weighted_rows for bfloat16 values, two rows at a time: interleaving rows s and s + 1 element by element
// (unpack within 128-bit lanes) makes each float32 lane of vdpbf16ps add w[s] * v[s][i] + w[s+1] * v[s+1][i].
// The lanes then hold dimensions in the unpack's order, put back at the end.
void weighted_rows_bf16(float* acc, const float* w, const c10::BFloat16* v, int64_t rows, int64_t stride, int64_t d) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int chunks = d - c0 >= 64 ? 2 : 1;
    __m512 lo[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, hi[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t s = 0; s < rows; s += 2) {
      const bool pair = s + 1 < rows;
      const float w0 = w[s], w1 = pair ? w[s + 1] : 0.0f;
      if (w0 == 0.0f && w1 == 0.0f) continue;
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bf16_bits(w0) | (bf16_bits(w1) << 16)));
      const c10::BFloat16* r0 = v + s * stride + c0;
      for (int c = 0; c < chunks; ++c) {
        const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i b = pair ? _mm512_loadu_si512(r0 + stride + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(a, b), weights);
        hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(a, b), weights);
      }
    }
    for (int c = 0; c < chunks; ++c) {
      alignas(64) float low[16], high[16];
      _mm512_store_ps(low, lo[c]);
      _mm512_store_ps(high, hi[c]);
      float* out = acc + c0 + 32 * c;
      for (int j = 0; j < 16; ++j) {  // lane j: 128-bit lane j / 4, element j % 4 (low) or 4 + j % 4 (high)
        out[8 * (j / 4) + j % 4] = low[j];
        out[8 * (j / 4) + 4 + j % 4] = high[j];
      }
    }
  }
}
#else
constexpr bool kPairedBf16 = false;
inline uint32_t bf16_bits(float) { return 0; }
inline float dot_bf16(const uint16_t*, const c10::BFloat16*, int64_t) { return 0.0f; }
inline void weighted_rows_bf16(float*, const float*, const c10::BFloat16*, int64_t, int64_t, int64_t) {}
#endif

template <typename T>
void attend_score_impl(const at::Tensor& q, double scale, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                       const at::Tensor& query_positions, int64_t window, bool masked, at::Tensor& scores,
                       bool accumulate, const at::Tensor& noise_table, const at::Tensor& noise_start,
                       int64_t noise_cols, double tau, at::Tensor& out) {
  const int64_t rows = k.size(0), heads = k.size(1), slots = k.size(2), dim = k.size(3);
  const int64_t groups = q.size(1) / heads;
  const int64_t pos_heads = positions.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  const float scale_f = static_cast<float>(scale);
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  const int64_t* qpos_ptr = query_positions.data_ptr<int64_t>();
  const bool scoring = scores.numel() > 0;  // else the attention output alone (a layer that evicts unscored)
  float* score_ptr = scoring ? scores.data_ptr<float>() : nullptr;
  T* out_ptr = out.data_ptr<T>();
  const bool noisy = noise_table.numel() > 0;
  const float* table = noisy ? noise_table.data_ptr<float>() : nullptr;
  const int64_t* start_ptr = noisy ? noise_start.data_ptr<int64_t>() : nullptr;
  const bool plain = !noisy && tau == 1.0;  // the contribution is the attention weights themselves
  const float tau_f = static_cast<float>(tau);
  const int64_t col_mask = noise_cols - 1;
  const bool paired = kPairedBf16 && std::is_same_v<T, c10::BFloat16> && dim % 32 == 0;
  // Strides read once: Tensor::stride is a call, too slow for the inner loops.
  const int64_t k_strides[3] = {k.stride(0), k.stride(1), k.stride(2)}, k_row = k_strides[2];
  const int64_t v_strides[3] = {v.stride(0), v.stride(1), v.stride(2)}, v_row = v_strides[2];
  const int64_t pos_strides[2] = {positions.stride(0), positions.stride(1)};
  const int64_t score_strides[2] = {scoring ? scores.stride(0) : 0, scoring ? scores.stride(1) : 0};

  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(groups * slots), shaped(plain || !scoring ? 0 : slots), added(scoring ? slots : 0);
    std::vector<float> acc(groups * dim);
    std::vector<float> qf(groups * dim);
    std::vector<uint16_t> q16(paired ? groups * dim : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      for (int64_t g = 0; g < groups; ++g)  // this KV head's query heads, scaled, in float32
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = widen(q_ptr[b * q_strides[0] + (h * groups + g) * q_strides[1] + i]) * scale_f;
      for (size_t i = 0; i < q16.size(); ++i) q16[i] = static_cast<uint16_t>(bf16_bits(qf[i]));
      const float* qb = qf.data();
      const T* kb = k_ptr + b * k_strides[0] + h * k_strides[1];
      const T* vb = v_ptr + b * v_strides[0] + h * v_strides[1];
      const int64_t* pb = pos_ptr + b * pos_strides[0] + (pos_heads == 1 ? 0 : h) * pos_strides[1];
      const int64_t qpos = qpos_ptr[b];
      // Logits, -inf where the slot holds no token this query may see (skipkey.attention.allowed_keys).
      int64_t s = 0;
#if defined(__AVX512F__)
      if (dim % 16 == 0) {
        for (; s < slots; s += 16) {
          const int64_t n = std::min<int64_t>(16, slots - s);
          const __mmask16 vis = masked ? visible16(pb + s, n, qpos, window) : static_cast<__mmask16>(0xFFFF);
          {  // the values these slots' weights will read, into L2 while the keys stream in
            const char* vr = reinterpret_cast<const char*>(vb + s * v_row);
            const int64_t bytes = n * v_row * static_cast<int64_t>(sizeof(T));
            for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(vr + off, _MM_HINT_T1);
          }
          for (int64_t g = 0; g < groups; ++g)
            logits16(probs.data() + g * slots + s, qb + g * dim, paired ? q16.data() + g * dim : nullptr, paired,
                     kb + s * k_row, k_row, n, dim, vis);
        }
      }
#endif
      for (; s < slots; ++s) {
        const int64_t p = pb[s];
        const bool visible = !masked || visible_to(p, qpos, window);
        const T* kr = kb + s * k_row;
        for (int64_t g = 0; g < groups; ++g) {
          if (!visible)
            probs[g * slots + s] = kNegInf;
          else if constexpr (std::is_same_v<T, c10::BFloat16>)
            probs[g * slots + s] = paired ? dot_bf16(q16.data() + g * dim, kr, dim) : dot(qb + g * dim, kr, dim);
          else
            probs[g * slots + s] = dot(qb + g * dim, kr, dim);
        }
      }
      std::fill(added.begin(), added.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        float* row = probs.data() + g * slots;
        if (scoring && !plain) {  // Keyformer: softmax((logits + noise) / tau), from the logits before they are softmaxed
          const int64_t start = noisy ? start_ptr[(b * heads + h) * groups + g] : 0;
          for (int64_t s = 0; s < slots; ++s) {
            const float noise = noisy ? table[start + (pb[s] & col_mask)] : 0.0f;
            shaped[s] = (row[s] + noise) / tau_f;
          }
          softmax_row(shaped.data(), slots);
          for (int64_t s = 0; s < slots; ++s) added[s] += shaped[s];
        }
        softmax_row(row, slots);
        if (scoring && plain)
          for (int64_t s = 0; s < slots; ++s) added[s] += row[s];
      }
      // Output: the weights times the values.
      for (int64_t g = 0; g < groups; ++g) {
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (paired) {
            weighted_rows_bf16(acc.data() + g * dim, probs.data() + g * slots, vb, slots, v_row, dim);
            continue;
          }
        }
        weighted_rows(acc.data() + g * dim, probs.data() + g * slots, vb, slots, v_row, dim);
      }
      T* ob = out_ptr + (b * heads + h) * groups * dim;
      for (int64_t i = 0; i < groups * dim; ++i) narrow(ob[i], acc[i]);
      if (!scoring) continue;
      float* sb = score_ptr + b * score_strides[0] + h * score_strides[1];
      if (accumulate)
        for (int64_t s = 0; s < slots; ++s) sb[s] += added[s];
      else
        for (int64_t s = 0; s < slots; ++s) sb[s] = added[s];
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// The noise arguments both scoring kernels take: an empty table (no noise) or float32 draws with one start per
// query, a power-of-two row width; and a positive temperature.
void check_noise(const at::Tensor& table, const at::Tensor& start, int64_t starts, int64_t cols, double tau,
                 const char* shape) {
  if (table.numel() > 0) {
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous(), "noise_table: float32");
    TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() && start.numel() == starts,
                "noise_start must be int64 ", shape);
    TORCH_CHECK(cols > 0 && (cols & (cols - 1)) == 0, "noise_cols must be a power of two");
  }
  TORCH_CHECK(tau > 0, "tau must be positive");
}

}  // namespace

// q [B, Hq, 1, D] (Hq = G * Hkv query heads, KV head h serving query heads h*G .. h*G+G-1), scaled here by
// scale; q, k, v float32 or bfloat16 (one dtype) with unit stride along D; k, v [B, Hkv, S, D]; positions [B, 1 or Hkv, S] int64 (unit stride along S); query_positions [B] int64;
// scores [B, Hkv, S] float32 (unit stride along S), updated in place, or empty for the output alone; noise_table (flat float32, empty for
// none) and noise_start [B, Hkv, G] int64: a key at position p draws table[start + (p & (noise_cols - 1))].
// Returns the attention output [B, Hkv, G, D] in v's dtype.
at::Tensor attend_score(const at::Tensor& q, double scale, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                        const at::Tensor& query_positions, int64_t window, bool masked, at::Tensor scores,
                        bool accumulate, const at::Tensor& noise_table, const at::Tensor& noise_start,
                        int64_t noise_cols, double tau) {
  for (const at::Tensor* t : {&q, &k, &v, &positions, &query_positions, static_cast<const at::Tensor*>(&scores)})
    check_cpu(*t, "every input");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(q.size(2) == 1 && q.stride(3) == 1 && q.size(1) % k.size(1) == 0,
              "q must be [B, G * Hkv, 1, D] with unit stride in D");
  TORCH_CHECK(k.sizes() == v.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v: same shape, unit stride in D");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q does not match k");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 3 && positions.stride(2) == 1 &&
                  positions.size(0) == k.size(0) && positions.size(2) == k.size(2) &&
                  (positions.size(1) == 1 || positions.size(1) == k.size(1)),
              "positions must be int64 [B, 1 or Hkv, S] with unit stride in S");
  TORCH_CHECK(query_positions.scalar_type() == at::kLong && query_positions.is_contiguous() &&
                  query_positions.numel() == k.size(0), "query_positions must be int64 [B]");
  TORCH_CHECK(scores.numel() == 0 || (scores.scalar_type() == at::kFloat && scores.dim() == 3 &&
                  scores.stride(2) == 1 && scores.size(0) == k.size(0) && scores.size(1) == k.size(1) &&
                  scores.size(2) == k.size(2)),
              "scores must be empty (no scoring) or float32 [B, Hkv, S] with unit stride in S");
  check_noise(noise_table, noise_start, q.size(0) * q.size(1), noise_cols, tau, "[B, Hkv, G]");
  auto out = at::empty({k.size(0), k.size(1), q.size(1) / k.size(1), k.size(3)}, v.options());
  if (k.scalar_type() == at::kBFloat16) {
    attend_score_impl<c10::BFloat16>(q, scale, k, v, positions, query_positions, window, masked, scores, accumulate,
                                     noise_table, noise_start, noise_cols, tau, out);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "k and v must be float32 or bfloat16");
    attend_score_impl<float>(q, scale, k, v, positions, query_positions, window, masked, scores, accumulate, noise_table,
                             noise_start, noise_cols, tau, out);
  }
  return out;
}

// keys, values [B, Hkv, C, D] (contiguous storage); positions [B, Hp, C] int64; scores [B, Hs, C] float32 or
// empty; slot [B, Hp, 1] int64; new_keys, new_values [B, Hkv, 1, D]; new_positions [B] int64; start_scores [B]
// float32 (each new token's score) or empty (0). Hp and Hs are 1 or Hkv: slot[b, min(h, Hp - 1)] is the slot
// KV head h writes.
void write_slot(at::Tensor keys, at::Tensor values, at::Tensor positions, at::Tensor scores, const at::Tensor& slot,
                const at::Tensor& new_keys, const at::Tensor& new_values, const at::Tensor& new_positions,
                const at::Tensor& start_scores) {
  for (const at::Tensor* t : {&slot, &new_keys, &new_values, &new_positions}) check_cpu(*t, "every input");
  for (const at::Tensor* t : {&keys, &values, &positions}) check_cpu(*t, "every input");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && positions.is_contiguous(), "storage must be contiguous");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() && new_keys.scalar_type() == keys.scalar_type() &&
                  new_values.scalar_type() == keys.scalar_type(), "keys and values must share a dtype");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t rows = keys.size(0), heads = keys.size(1), capacity = keys.size(2), dim = keys.size(3);
  const int64_t pos_heads = positions.size(1);
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.is_contiguous() && slot.size(0) == rows &&
                  slot.size(1) == pos_heads, "slot must be int64 [B, Hp, 1]");
  TORCH_CHECK(new_positions.scalar_type() == at::kLong && new_positions.is_contiguous() &&
                  new_positions.numel() == rows, "new_positions must be int64 [B]");
  TORCH_CHECK(new_keys.stride(3) == 1 && new_values.stride(3) == 1, "new keys/values: unit stride in D");
  const bool has_scores = scores.numel() > 0;
  const bool has_start = start_scores.numel() > 0;
  TORCH_CHECK(!has_start || (start_scores.scalar_type() == at::kFloat && start_scores.is_contiguous() &&
                             start_scores.numel() == rows), "start_scores must be float32 [B]");
  if (has_scores)
    TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(2) == capacity,
                "scores must be contiguous float32 [B, Hs, C]");
  const int64_t* slot_ptr = slot.data_ptr<int64_t>();
  const int64_t* newpos = new_positions.data_ptr<int64_t>();
  const int64_t width = dim * keys.element_size();
  auto* kp = static_cast<char*>(keys.data_ptr());
  auto* vp = static_cast<char*>(values.data_ptr());
  const auto* nk = static_cast<const char*>(new_keys.data_ptr());
  const auto* nv = static_cast<const char*>(new_values.data_ptr());
  const int64_t item = keys.element_size();
  int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * pos_heads; ++i)  // checked before anything is written
    TORCH_CHECK(slot_ptr[i] >= 0 && slot_ptr[i] < capacity, "slot out of range");
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t s = slot_ptr[b * pos_heads + (pos_heads == 1 ? 0 : h)];
      const int64_t dst = ((b * heads + h) * capacity + s) * dim * item;
      std::memcpy(kp + dst, nk + (b * new_keys.stride(0) + h * new_keys.stride(1)) * item, width);
      std::memcpy(vp + dst, nv + (b * new_values.stride(0) + h * new_values.stride(1)) * item, width);
    }
    for (int64_t h = 0; h < pos_heads; ++h) pp[(b * pos_heads + h) * capacity + slot_ptr[b * pos_heads + h]] = newpos[b];
    if (has_scores) {
      float* sp = scores.data_ptr<float>();
      const int64_t score_heads = scores.size(1);
      for (int64_t h = 0; h < score_heads; ++h)
        sp[(b * score_heads + h) * capacity + slot_ptr[b * pos_heads + (pos_heads == 1 ? 0 : h)]] =
            has_start ? start_scores.data_ptr<float>()[b] : 0.0f;
    }
  }
}

// The first slot of lowest priority, slots whose position is at or past ``line`` ranking as float32's max.
int64_t lowest_in_row(const float* priority, const int64_t* positions, int64_t slots, int64_t line) {
  const float protected_value = std::numeric_limits<float>::max();
  float best_value = std::numeric_limits<float>::infinity();
  int64_t best = 0, s = 0;
#if defined(__AVX512F__)
  if (slots >= 16) {  // per lane: its lowest value and first slot holding it; then the lowest lane, first slot
    const __m512i limit = _mm512_set1_epi64(line);
    const __m512 protect = _mm512_set1_ps(protected_value);
    __m512 lowest = _mm512_set1_ps(best_value);
    __m512i where = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; s + 16 <= slots; s += 16) {
      const __mmask8 lo = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(positions + s), limit);
      const __mmask8 hi = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(positions + s + 8), limit);
      const __m512 value = _mm512_mask_mov_ps(_mm512_loadu_ps(priority + s), static_cast<__mmask16>(lo | (hi << 8)), protect);
      const __mmask16 lower = _mm512_cmp_ps_mask(value, lowest, _CMP_LT_OQ);
      lowest = _mm512_mask_mov_ps(lowest, lower, value);
      where = _mm512_mask_mov_epi32(where, lower, index);
      index = _mm512_add_epi32(index, step);
    }
    alignas(64) float values[16];
    alignas(64) int32_t slots_at[16];
    _mm512_store_ps(values, lowest);
    _mm512_store_si512(slots_at, where);
    for (int i = 0; i < 16; ++i)
      if (values[i] < best_value || (values[i] == best_value && slots_at[i] < best)) {
        best_value = values[i];
        best = slots_at[i];
      }
  }
#endif
  for (; s < slots; ++s) {
    const float value = positions[s] >= line ? protected_value : priority[s];
    if (value < best_value) {
      best_value = value;
      best = s;
    }
  }
  return best;
}

// priority [B, 1 or H, S] float32 and positions [B, 1 or H, S] int64 (unit stride along S);
// next_positions, recent [B] int64. Per row and head, the first slot of lowest priority among those
// holding a position below next - recent (slots inside the recent window rank as float32's max).
// Returns [B, H, 1] int64, H the larger head count: what min(dim=-1).indices of the masked priority gives.
at::Tensor lowest_unprotected(const at::Tensor& priority, const at::Tensor& positions,
                              const at::Tensor& next_positions, const at::Tensor& recent) {
  for (const auto* t : {&priority, &positions, &next_positions, &recent}) check_cpu(*t, "every input");
  TORCH_CHECK(priority.scalar_type() == at::kFloat && priority.dim() == 3 && priority.stride(2) == 1,
              "priority must be float32 [B, H, S] with unit stride in S");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 3 && positions.stride(2) == 1,
              "positions must be int64 [B, H, S] with unit stride in S");
  TORCH_CHECK(next_positions.scalar_type() == at::kLong && recent.scalar_type() == at::kLong &&
                  next_positions.is_contiguous() && recent.is_contiguous(), "next_positions, recent: int64 [B]");
  const int64_t rows = positions.size(0), slots = positions.size(2);
  TORCH_CHECK(priority.size(0) == rows && priority.size(2) == slots, "priority does not match positions");
  const int64_t prio_heads = priority.size(1), pos_heads = positions.size(1);
  const int64_t heads = std::max(prio_heads, pos_heads);
  TORCH_CHECK((prio_heads == 1 || prio_heads == heads) && (pos_heads == 1 || pos_heads == heads), "head counts");
  auto out = at::empty({rows, heads, 1}, positions.options());
  int64_t* op = out.data_ptr<int64_t>();
  const float* pr = priority.data_ptr<float>();
  const int64_t* ps = positions.data_ptr<int64_t>();
  const int64_t* nx = next_positions.data_ptr<int64_t>();
  const int64_t* rc = recent.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t line = nx[b] - rc[b];
    for (int64_t h = 0; h < heads; ++h) {
      const float* prow = pr + b * priority.stride(0) + (prio_heads == 1 ? 0 : h) * priority.stride(1);
      const int64_t* qrow = ps + b * positions.stride(0) + (pos_heads == 1 ? 0 : h) * positions.stride(1);
      op[b * heads + h] = lowest_in_row(prow, qrow, slots, line);
    }
  }
  return out;
}

// Prompt scoring, the softmax part: one query's row of logits (float32, slots [0, slots)) adds
// w * softmax((logits + noise) / tau) over the keys it may see to out. kp: the slots' positions; consecutive /
// first: they are first, first + 1, ... from slot `first` on (empty slots before), so the visible keys are one
// run and their noise one contiguous run of the query's table row.
void add_query_row(float* row, int64_t slots, const int64_t* kp, bool consecutive, int64_t first, int64_t qpos,
                   int64_t window, float w, const float* table, int64_t start, int64_t noise_cols, float inv_tau,
                   float* out) {
  const bool noisy = table != nullptr;
  const int64_t col_mask = noise_cols - 1;
  if (consecutive) {
    const int64_t p0 = kp[first];
    int64_t lo = first, hi = std::min(slots - 1, first + (qpos - p0));  // slots [lo, hi] are visible
    if (window > 0) lo = std::max(lo, first + (qpos - window + 1 - p0));
    const int64_t n = hi - lo + 1;
    if (n <= 0) return;
    if (!noisy || n <= noise_cols) {
      // Key position p draws table[start + (p mod C)]: the row's doubled copy makes that
      // table[row + (shift + p_lo) mod C + j] for the run's j-th key, C = noise_cols.
      const int64_t shift = start % (2 * noise_cols);
      const float* noise = noisy ? table + (start - shift) + ((shift + p0 + (lo - first)) & col_mask) : nullptr;
      float* x = row + lo;
      float top = kNegInf;  // (logits + noise) / tau in place, and their maximum, in one pass
      int64_t j = 0;
#if defined(__AVX512F__)
      __m512 tops = _mm512_set1_ps(kNegInf);
      const __m512 inv = _mm512_set1_ps(inv_tau);
      for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        if (noisy) v = _mm512_add_ps(v, _mm512_loadu_ps(noise + j));
        v = _mm512_mul_ps(v, inv);
        _mm512_storeu_ps(x + j, v);
        tops = _mm512_max_ps(tops, v);
      }
      top = _mm512_reduce_max_ps(tops);
#endif
      // The rest (all of it without AVX-512) in two loops the compiler vectorises.
      for (int64_t i = j; i < n; ++i) x[i] = (x[i] + (noisy ? noise[i] : 0.0f)) * inv_tau;
      top = std::max(top, max_of(x + j, n - j));
      const float scale = w / exp_below(x, n, top);
      for (j = 0; j < n; ++j) out[lo + j] += scale * x[j];
      return;
    }
  }
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t p = kp[s];
    const float noise = noisy ? table[start + (p & col_mask)] : 0.0f;
    row[s] = visible_to(p, qpos, window) ? (row[s] + noise) * inv_tau : kNegInf;
  }
  const float sum = exp_shifted(row, slots);
  if (sum == 0.0f) return;  // no visible key
  const float scale = w / sum;
  for (int64_t s = 0; s < slots; ++s) out[s] += scale * row[s];
}

#if defined(__AVX512F__)
// Logits of four queries against KC * 16 keys (fewer in the last block: live masks its keys), from keys packed
// [D / P, S, P]: for each pair (P = 2, bfloat16 with AVX512-BF16) or single dimension (P = 1) of the head,
// sixteen keys' values side by side. q: the four queries, P dimensions per 32-bit word (P = 2) or float32 (P = 1);
// each step loads the keys once for all four queries. out: four rows `stride` apart.
template <typename T, int P, int KC>
inline void logits_4xkeys(float* out, int64_t stride, const void* q, int64_t steps, const T* k, int64_t step_stride,
                          __mmask16 live) {
  __m512 acc[4][KC];
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < KC; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) {
    const T* kr = k + i * step_stride;
    if constexpr (P == 2) {
#if defined(__AVX512BF16__)
      __m512i kv[KC];
      for (int c = 0; c < KC; ++c)
        kv[c] = c + 1 < KC ? _mm512_loadu_si512(kr + 32 * c) : _mm512_maskz_loadu_epi32(live, kr + 32 * c);
      const uint32_t* qw = static_cast<const uint32_t*>(q);
      for (int j = 0; j < 4; ++j) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qw[j * steps + i]));
        for (int c = 0; c < KC; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qj, (__m512bh)kv[c]);
      }
#endif
    } else {
      __m512 kv[KC];
      for (int c = 0; c < KC; ++c) {
        if (c + 1 < KC || live == 0xFFFF) {
          kv[c] = load16(kr + 16 * c);
        } else if constexpr (std::is_same_v<T, float>) {
          kv[c] = _mm512_maskz_loadu_ps(live, kr + 16 * c);
        } else {
          alignas(64) T tail[16] = {};
          for (int t = 0; t < 16; ++t)
            if ((live >> t) & 1) tail[t] = kr[16 * c + t];
          kv[c] = load16(tail);
        }
      }
      const float* qf = static_cast<const float*>(q);
      for (int j = 0; j < 4; ++j) {
        const __m512 qj = _mm512_set1_ps(qf[j * steps + i]);
        for (int c = 0; c < KC; ++c) acc[j][c] = _mm512_fmadd_ps(qj, kv[c], acc[j][c]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < KC; ++c)
      if (c + 1 < KC) _mm512_storeu_ps(out + j * stride + 16 * c, acc[j][c]);
      else _mm512_mask_storeu_ps(out + j * stride + 16 * c, live, acc[j][c]);
}
#endif

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

// logits_4xkeys for CPUs without AVX-512 (P = 1): four float32 queries against kPortableKeys keys packed [D, S]
// (step_stride apart per dimension). Each sum runs over the dimensions in order, one fused multiply-add each, as in
// logits_4xkeys, so a CPU with AVX2 gives its logits bit for bit. The 4 x 16 sums stay in eight AVX2 registers
// (the compiler does not find that layout itself once the function is inlined).
constexpr int64_t kPortableKeys = 16;

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

template <typename T>
inline void logits_4xkeys_portable(float* out, int64_t stride, const float* q, int64_t steps, const T* k,
                                   int64_t step_stride) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4][2];
  for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) {
    const T* kr = k + i * step_stride;
    const __m256 k0 = load8(kr), k1 = load8(kr + 8);
    for (int j = 0; j < 4; ++j) {
      const __m256 qj = _mm256_broadcast_ss(q + j * steps + i);
      acc[j][0] = _mm256_fmadd_ps(qj, k0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(qj, k1, acc[j][1]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(out + j * stride, acc[j][0]);
    _mm256_storeu_ps(out + j * stride + 8, acc[j][1]);
  }
#else
  float acc[4][kPortableKeys] = {};
  for (int64_t i = 0; i < steps; ++i) {
    const T* kr = k + i * step_stride;
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t t = 0; t < kPortableKeys; ++t) acc[j][t] += q[j * steps + i] * widen(kr[t]);
  }
  for (int64_t j = 0; j < 4; ++j)
    for (int64_t t = 0; t < kPortableKeys; ++t) out[j * stride + t] = acc[j][t];
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Sapphire Rapids and later): 16 x 16 blocks of logits from tiles, for prompt scoring in bfloat16.
constexpr bool kAmx = true;

// Linux hands out the tile registers on request, once per process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Tiles 0-3: logits of 16 queries by 16 keys (float32); 4: 16 queries by 32 dimensions; 5: 16 dimension pairs of
// 16 keys (keys packed in pairs). Each thread loads the configuration before its first tile instruction.
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&config) : "memory");  // GCC 12 drops the stores above otherwise (ldtilecfg reads them)
  _tile_loadconfig(&config);
}

// out (rows out_stride bytes apart) <- 16 queries (a: dim bfloat16s each, rows a_stride bytes apart) times
// KC blocks of 16 keys (b: packed pairs, rows of 16 keys b_stride bytes apart).
template <int KC>
inline void logits_amx(float* out, int64_t out_stride, const c10::BFloat16* a, int64_t a_stride,
                       const c10::BFloat16* b, int64_t b_stride, int64_t dim) {
  _tile_zero(0);
  if constexpr (KC == 4) {
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < dim; t += 32) {
    _tile_loadd(4, a + t, a_stride);
    const char* bt = reinterpret_cast<const char*>(b) + (t / 2) * b_stride;  // pairs t/2 .. t/2 + 15
    _tile_loadd(5, bt, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (KC == 4) {
      _tile_loadd(5, bt + 64, b_stride);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, bt + 128, b_stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, bt + 192, b_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, out_stride);
  if constexpr (KC == 4) {
    _tile_stored(1, out + 16, out_stride);
    _tile_stored(2, out + 32, out_stride);
    _tile_stored(3, out + 48, out_stride);
  }
}
#else
constexpr bool kAmx = false;
bool amx_permitted() { return false; }
void configure_tiles() {}
template <int KC>
inline void logits_amx(float*, int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t) {}
#endif

// Prompt scoring: what a chunk of prompt queries adds to each key's score, logits and softmax in one pass.
// queries [B, Hkv, G * n, D] (scaled, contiguous; row g * n + i is query head g of query i); keys packed
// [B, Hkv, D / P, S, P] (unit strides in S and P; see pack_keys); query_positions [B, n] int64; weight [B, n]
// float32 (0: the query adds nothing, e.g. padding or outside the observation window); key_positions
// [B, 1 or Hkv, S] int64 (unit stride in S); window as in attend_score; noise as in attend_score with
// noise_start [B, Hkv, G, n]. Adds, per row and KV head, the weighted sum over queries of
// softmax((logits + noise) / tau) over the keys each query may see, to total [B, Hkv, S] float32.
// The logits stay in float32 (eager attention in bfloat16 rounds them to bfloat16).
template <typename T, int P>
void score_prompt_impl(const at::Tensor& queries, int64_t groups, const at::Tensor& keys,
                       const at::Tensor& query_positions, const at::Tensor& weight, const at::Tensor& key_positions,
                       int64_t window, const at::Tensor& noise_table, const at::Tensor& noise_start, int64_t noise_cols,
                       double tau, at::Tensor& total) {
  const int64_t rows = keys.size(0), heads = keys.size(1), steps = keys.size(2), slots = keys.size(3);
  const int64_t dim = queries.size(3), n_rows = queries.size(2), queries_per_row = n_rows / groups;
  const T* q_ptr = queries.data_ptr<T>();
  const T* k_ptr = keys.data_ptr<T>();
  const int64_t k_strides[3] = {keys.stride(0), keys.stride(1), keys.stride(2)};
  const int64_t* qpos_ptr = query_positions.data_ptr<int64_t>();
  const float* w_ptr = weight.data_ptr<float>();
  const int64_t* kpos_ptr = key_positions.data_ptr<int64_t>();
  const int64_t kpos_strides[2] = {key_positions.stride(0), key_positions.stride(1)};
  const int64_t kpos_heads = key_positions.size(1);
  const bool noisy = noise_table.numel() > 0;
  const float* table = noisy ? noise_table.data_ptr<float>() : nullptr;
  const int64_t* start_ptr = noisy ? noise_start.data_ptr<int64_t>() : nullptr;
  const float inv_tau = static_cast<float>(1.0 / tau);
  float* total_ptr = total.data_ptr<float>();
  const int64_t total_strides[2] = {total.stride(0), total.stride(1)};
  const int64_t stride = (slots + 15) / 16 * 16;  // a logits row, padded to whole blocks of 16
  // AMX takes 16 queries at a time, the vector path 4.
  const bool amx = P == 2 && kAmx && dim % 32 == 0 && amx_permitted();
  const int64_t block = amx ? 16 : 4;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    if (amx) configure_tiles();
    std::vector<float> logits(block * stride);
    std::vector<float> qf(P == 1 ? 4 * dim : 0);
    std::vector<uint32_t> qw(P == 2 && !amx ? 4 * steps : 0);
    std::vector<c10::BFloat16> padded_q(amx ? 16 * dim : 0), padded_k(amx ? 16 * dim : 0);
    std::vector<float> tail_keys(kAvx512 ? 0 : steps * kPortableKeys);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const int64_t* kp = kpos_ptr + b * kpos_strides[0] + (kpos_heads == 1 ? 0 : h) * kpos_strides[1];
      const T* kb = k_ptr + b * k_strides[0] + h * k_strides[1];
      float* out = total_ptr + b * total_strides[0] + h * total_strides[1];
      // A prompt chunk's keys are usually consecutive positions after any left padding.
      int64_t first = 0;
      while (first < slots && kp[first] < 0) ++first;
      bool consecutive = first < slots;
      for (int64_t s = first + 1; consecutive && s < slots; ++s) consecutive = kp[s] == kp[first] + (s - first);
      const int64_t tail = slots / kPortableKeys * kPortableKeys;
      if (!tail_keys.empty() && tail < slots) {  // the slots after the last whole block, widened, zero-padded
        std::fill(tail_keys.begin(), tail_keys.end(), 0.0f);
        for (int64_t i = 0; i < steps; ++i)
          for (int64_t s = tail; s < slots; ++s) tail_keys[i * kPortableKeys + s - tail] = widen(kb[i * k_strides[2] + s]);
      }
      for (int64_t r0 = 0; r0 < n_rows; r0 += block) {
        const int64_t count = std::min<int64_t>(block, n_rows - r0);
        bool any = false;
        for (int64_t j = 0; j < count; ++j) any = any || w_ptr[b * queries_per_row + (r0 + j) % queries_per_row] != 0.0f;
        if (!any) continue;
        const T* q_rows = q_ptr + ((b * heads + h) * n_rows + r0) * dim;
        bool tiled = false;  // the logits came from AMX tiles
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (amx) {
            const c10::BFloat16* a = q_rows;
            if (count < 16) {  // the chunk's last queries, padded with zeros to a whole tile
              std::fill(padded_q.begin(), padded_q.end(), c10::BFloat16(0.0f));
              std::memcpy(padded_q.data(), q_rows, count * dim * sizeof(T));
              a = padded_q.data();
            }
            const int64_t a_stride = dim * sizeof(T), b_stride = k_strides[2] * sizeof(T);
            const int64_t out_stride = stride * sizeof(float);
            int64_t s = 0;
            for (; s + 64 <= slots; s += 64)
              logits_amx<4>(logits.data() + s, out_stride, a, a_stride, kb + s * P, b_stride, dim);
            for (; s + 16 <= slots; s += 16)
              logits_amx<1>(logits.data() + s, out_stride, a, a_stride, kb + s * P, b_stride, dim);
            if (s < slots) {  // the last keys, padded with zeros to a whole tile
              std::fill(padded_k.begin(), padded_k.end(), c10::BFloat16(0.0f));
              for (int64_t i = 0; i < steps; ++i)
                std::memcpy(padded_k.data() + i * 32, kb + i * k_strides[2] + s * P, (slots - s) * P * sizeof(T));
              logits_amx<1>(logits.data() + s, out_stride, a, a_stride, padded_k.data(), 64, dim);
            }
            tiled = true;
          }
        }
        if (!tiled) {
          for (int64_t j = 0; j < 4; ++j) {  // the block's queries (the last one repeated to fill it)
            const T* qr = q_rows + std::min(j, count - 1) * dim;
            if constexpr (P == 2)
              std::memcpy(qw.data() + j * steps, qr, dim * sizeof(T));
            else
              for (int64_t i = 0; i < dim; ++i) qf[j * dim + i] = widen(qr[i]);
          }
          const void* qdata = P == 2 ? static_cast<const void*>(qw.data()) : static_cast<const void*>(qf.data());
          int64_t s = 0;
#if defined(__AVX512F__)
          for (; s + 64 <= slots; s += 64)
            logits_4xkeys<T, P, 4>(logits.data() + s, stride, qdata, steps, kb + s * P, k_strides[2], 0xFFFF);
          for (; s < slots; s += 16) {
            const int64_t left = slots - s;
            const __mmask16 live = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
            logits_4xkeys<T, P, 1>(logits.data() + s, stride, qdata, steps, kb + s * P, k_strides[2], live);
          }
#endif
          if constexpr (P == 1 && !kAvx512) {  // no AVX-512 (P = 2 needs AVX512-BF16)
            for (; s + kPortableKeys <= slots; s += kPortableKeys)
              logits_4xkeys_portable(logits.data() + s, stride, qf.data(), steps, kb + s, k_strides[2]);
            if (s < slots)  // the last keys, from the task's zero-padded copy
              logits_4xkeys_portable(logits.data() + s, stride, qf.data(), steps, tail_keys.data(), kPortableKeys);
            s = slots;
          }
        }
        for (int64_t j = 0; j < count; ++j) {
          const int64_t r = r0 + j, g = r / queries_per_row, i = r % queries_per_row;
          const float w = w_ptr[b * queries_per_row + i];
          if (w == 0.0f) continue;
          const int64_t start = noisy ? start_ptr[((b * heads + h) * groups + g) * queries_per_row + i] : 0;
          add_query_row(logits.data() + j * stride, slots, kp, consecutive, first, qpos_ptr[b * queries_per_row + i],
                        window, w, table, start, noise_cols, inv_tau, out);
        }
      }
    }
    if (amx) _tile_release();
  });
}

// Whether score_prompt takes bfloat16 keys packed in pairs of dimensions (this CPU has AVX512-BF16).
bool bf16_pairs() { return kPairedBf16; }

void score_prompt(const at::Tensor& queries, int64_t groups, const at::Tensor& keys, const at::Tensor& query_positions,
                  const at::Tensor& weight, const at::Tensor& key_positions, int64_t window,
                  const at::Tensor& noise_table, const at::Tensor& noise_start, int64_t noise_cols, double tau,
                  at::Tensor total) {
  for (const at::Tensor* t : {&queries, &keys, &query_positions, &weight, &key_positions}) check_cpu(*t, "every input");
  check_cpu(total, "total");
  TORCH_CHECK(queries.dim() == 4 && queries.is_contiguous() && groups > 0 && queries.size(2) % groups == 0,
              "queries must be contiguous [B, Hkv, G * n, D]");
  TORCH_CHECK(keys.dim() == 5 && keys.scalar_type() == queries.scalar_type() && keys.stride(4) == 1 &&
                  keys.stride(3) == keys.size(4) && keys.size(0) == queries.size(0) && keys.size(1) == queries.size(1) &&
                  keys.size(2) * keys.size(4) == queries.size(3),
              "keys must be packed [B, Hkv, D / P, S, P] in the queries' dtype, unit strides in S and P");
  const int64_t pairs = keys.size(4);
  TORCH_CHECK(pairs == 1 || (pairs == 2 && kPairedBf16 && keys.scalar_type() == at::kBFloat16),
              "keys come in pairs only for bfloat16 on a CPU with AVX512-BF16");
  const int64_t rows = keys.size(0), heads = keys.size(1), queries_per_row = queries.size(2) / groups;
  const int64_t slots = keys.size(3);
  TORCH_CHECK(query_positions.scalar_type() == at::kLong && query_positions.is_contiguous() &&
                  query_positions.numel() == rows * queries_per_row, "query_positions must be int64 [B, n]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == rows * queries_per_row,
              "weight must be float32 [B, n]");
  TORCH_CHECK(key_positions.scalar_type() == at::kLong && key_positions.dim() == 3 && key_positions.stride(2) == 1 &&
                  key_positions.size(0) == rows && key_positions.size(2) == slots &&
                  (key_positions.size(1) == 1 || key_positions.size(1) == heads),
              "key_positions must be int64 [B, 1 or Hkv, S] with unit stride in S");
  TORCH_CHECK(total.scalar_type() == at::kFloat && total.dim() == 3 && total.stride(2) == 1 && total.size(0) == rows &&
                  total.size(1) == heads && total.size(2) == slots, "total must be float32 [B, Hkv, S]");
  check_noise(noise_table, noise_start, rows * heads * groups * queries_per_row, noise_cols, tau, "[B, Hkv, G, n]");
  if (keys.scalar_type() == at::kBFloat16) {
    if (pairs == 2)
      score_prompt_impl<c10::BFloat16, 2>(queries, groups, keys, query_positions, weight, key_positions, window,
                                          noise_table, noise_start, noise_cols, tau, total);
    else
      score_prompt_impl<c10::BFloat16, 1>(queries, groups, keys, query_positions, weight, key_positions, window,
                                          noise_table, noise_start, noise_cols, tau, total);
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kFloat, "queries and keys must be float32 or bfloat16");
    score_prompt_impl<float, 1>(queries, groups, keys, query_positions, weight, key_positions, window, noise_table,
                                noise_start, noise_cols, tau, total);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_score", &attend_score, "one decode query per row: attention output and score contribution");
  m.def("score_prompt", &score_prompt, "a chunk of prompt queries' score contributions, summed over queries");
  m.def("bf16_pairs", &bf16_pairs, "whether score_prompt takes bfloat16 keys in pairs of dimensions");
  m.def("write_slot", &write_slot, "write one token per row and KV head into its freed slot");
  m.def("lowest_unprotected", &lowest_unprotected, "per row and head, the lowest-priority slot outside the recent window");
}
