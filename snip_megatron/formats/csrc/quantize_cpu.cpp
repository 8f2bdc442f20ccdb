// The CPU fake quantizer: `quantize_reference`'s casts, bit for bit, in one pass per block row.
//
// Called from snip_megatron/formats/fused.py (`_quantize_2d`), which has already put the operand
// in the layout the blocks run in (2D, whole blocks). One call per cast: the per-tensor scales
// from the kernel's own amax pass (unless the amax is all-reduced over a group: then fused.py
// passes them in), then per block row (br rows) it reads the input, takes the block amaxes from
// the integer bits, computes each block's scale with the reference's formulas operation for
// operation, rounds every element to the grid (nearest-even, or stochastic with noise from the
// counter-based generator of formats/sr_noise.py, computed here in registers, or the caller's
// noise tensor) and writes the dequantized values, and optionally the grid values (for codes)
// and the scales. The block row stays in cache between the amax read and the cast, so memory
// sees one read and one write. `quantize_hadamard` does the Hadamard roles (transform, cast,
// inverse transform) in one call on 16 x 16 tiles.
//
// Exactness rests on float32 arithmetic in the reference's order: no -ffast-math and
// -ffp-contract=off (an FMA would skip a rounding the reference performs). The loops are plain
// element loops on bit patterns and float32 so that gcc vectorizes them (-O3).

#include <torch/extension.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// Must match fused.py (_ELEMENT_CODES, _SCALE_CODES).
enum Element : int64_t { E2M1 = 0, E4M3 = 1, E5M2 = 2 };
enum Scale : int64_t { TENSOR = 0, FP32 = 1, POW2 = 2, E8M0 = 3, NVFP4 = 4 };

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline bool is_finite(float f) { return (bits_of(f) & 0x7F800000u) != 0x7F800000u; }

// Element loads and stores. bf16 -> float32 is exact; float32 -> bf16 is round-to-nearest-even
// with NaN kept NaN, as torch's conversion.
inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) { return float_of(static_cast<uint32_t>(v.x) << 16); }
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) {
  uint32_t u = bits_of(v);
  uint16_t h = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  p->x = (v != v) ? static_cast<uint16_t>(0x7FC0) : h;
}
inline uint32_t abs_bits(float v) { return bits_of(v) & 0x7FFFFFFFu; }
inline uint32_t abs_bits(c10::BFloat16 v) { return (static_cast<uint32_t>(v.x) << 16) & 0x7FFFFFFFu; }

// An element grid: largest magnitude, float32 bits of 2**emin (the smallest normal exponent; below
// it the grid step is the subnormal one), and (23 - mantissa bits) << 23.
struct Grid { float top; uint32_t min_exp_bits; uint32_t magic_shift; };
inline Grid grid_of(int64_t element) {
  switch (element) {
    case E2M1: return {6.0f, 127u << 23, 22u << 23};
    case E4M3: return {448.0f, (127u - 6) << 23, 20u << 23};
    default: return {57344.0f, (127u - 14) << 23, 21u << 23};
  }
}

// Round-to-nearest-even to the grid, saturating, sign kept (-0 stays -0, NaN stays NaN): adding
// 2**(e + 23 - mantissa bits) to |y| in [2**e, 2**(e+1)) leaves a float32 whose last bit is one
// grid step, so the IEEE add rounds (ties to even) and the subtraction is exact. This is what
// torch's float8 casts and round_e2m1 compute (fused.py's _round_in_place, same trick).
inline float round_nearest(float y, Grid g) {
  uint32_t sign = bits_of(y) & 0x80000000u;
  float a = float_of(bits_of(y) ^ sign);
  a = a > g.top ? g.top : a;  // NaN fails the compare and stays NaN
  uint32_t e = bits_of(a) & 0x7F800000u;
  e = e > g.min_exp_bits ? e : g.min_exp_bits;
  float magic = float_of(e + g.magic_shift);
  a = (a + magic) - magic;
  return float_of(bits_of(a) | sign);
}

// Stochastic rounding (E2M1 only, CastConfig): floor(|y| / step + u) * step with step half the
// power of two at or below max(|y|, 1), then saturate again (3 + u may round up to 4 in float32).
// The operations of round_e2m1(y, noise), in its order.
inline float round_stochastic(float y, float u, Grid g) {
  uint32_t sign = bits_of(y) & 0x80000000u;
  float a = float_of(bits_of(y) ^ sign);
  a = a > g.top ? g.top : a;
  uint32_t e = bits_of(a) & 0x7F800000u;
  e = e > g.min_exp_bits ? e : g.min_exp_bits;
  float step = float_of(e - (1u << 23));
  a = std::floor(a / step + u) * step;
  a = a > g.top ? g.top : a;
  return float_of(bits_of(a) | sign);
}

// ---- Block scales: one function per scale family, the reference's formulas (quantize.py). ----

// Each takes the amaxes of n blocks and writes their encode and decode factors (multiply by enc,
// round, multiply by dec; dec NaN where the block or tensor is not finite) and the stored scales.
// Branch-free loops over the blocks, so that gcc vectorizes them (a block of 16 elements would
// otherwise spend more time on its scale than on its elements).

// 2**k for an integer k in [-127, 127], exact (2**-127 is the float32 subnormal 1 << 22).
inline float pow2(int32_t k) { return float_of(k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 1u << 22); }

// FP32 (and pow2) scales, TE's compute_scale_from_amax: max / amax, correctly rounded as TE
// divides (__fdiv_rn; not the reciprocal times max), 1 for an all-zero block, capped at the
// largest float32; pow2 keeps only sign and exponent. Decode 1 / scale (the stored scale).
void fp32_scales(const float* amax, int64_t n, float elem_max, bool pow2_scales, float* enc,
                 float* dec, float* stored) {
  const uint32_t keep = pow2_scales ? 0xFF800000u : 0xFFFFFFFFu;
  for (int64_t k = 0; k < n; ++k) {
    float e = elem_max / amax[k];  // TE: __fdiv_rn(max_fp8, amax) (recipe_common.cuh:28-31)
    e = amax[k] == 0.0f ? 1.0f : e;
    e = e > FLT_MAX ? FLT_MAX : e;  // NaN stays NaN
    e = float_of(bits_of(e) & keep);
    const float d = 1.0f / e;
    enc[k] = e;
    stored[k] = d;
    dec[k] = is_finite(amax[k]) ? d : NAN;
  }
}

// MX scales, RCEIL (e8m0_round_up): the smallest power of two >= amax / max, from the bits;
// encode 2**(127 - e) (1 for code 0, as TE's exp2f_rcp), decode 2**(e - 127); code 255 = NaN.
void e8m0_scales(const float* amax, int64_t n, float elem_max, float* enc, float* dec,
                 uint8_t* stored) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t b = bits_of(amax[k] / elem_max);
    const int32_t exp = static_cast<int32_t>((b >> 23) & 0xFF);
    const uint32_t mant = b & 0x7FFFFFu;
    // Subnormal: above 2**-127 rounds up to 2**-126 (code 1), else code 0.
    const int32_t subnormal = static_cast<int32_t>(mant > (1u << 22));
    int32_t e = exp == 0 ? subnormal : exp + static_cast<int32_t>(mant != 0);
    e = e > 254 ? 254 : e;
    const bool finite = is_finite(amax[k]);
    stored[k] = static_cast<uint8_t>(finite ? e : 255);
    enc[k] = e == 0 ? 1.0f : pow2(127 - e);
    dec[k] = finite ? pow2(e - 127) : NAN;
  }
}

// NVFP4: an E4M3 block scale on the FP32 per-tensor scale (torchao's nvfp4_quantize):
// (amax / 6) / global, clamped to [2**-6, 448], rounded to E4M3; encode (1 / global) / scale,
// decode global * scale (NaN where the tensor or the block is not finite).
void nvfp4_scales(const float* amax, int64_t n, float elem_max, float global, float inv_global,
                  bool tensor_finite, float* enc, float* dec, uint8_t* stored) {
  const Grid e4m3 = grid_of(E4M3);
  for (int64_t k = 0; k < n; ++k) {
    float s = (amax[k] / elem_max) / global;
    s = s < 0.015625f ? 0.015625f : s;  // NaN stays NaN
    s = s > 448.0f ? 448.0f : s;
    s = round_nearest(s, e4m3);  // a positive normal E4M3 value (or NaN)
    const uint32_t b = bits_of(s);
    const uint32_t code = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7);
    stored[k] = static_cast<uint8_t>(s != s ? 0x7Fu : code);
    enc[k] = inv_global / s;
    dec[k] = (tensor_finite && is_finite(amax[k])) ? global * s : NAN;
  }
}

struct Params {
  int64_t rows, cols, br, bc;
  int64_t element, scale;
  float elem_max, enc, dec, global, inv_global;  // enc/dec: TENSOR; global: NVFP4
  bool tensor_finite;
};

// ---- Stochastic-rounding noise: formats/sr_noise.py's counter-based generator. ----

// lowbias32: a bijective 32-bit hash with full avalanche (uint32 arithmetic wraps mod 2**32).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
// U[0, 1) from 24 bits, k * 2**-24 (exact in float32; as (bits >> 8).float() * 2**-24 in torch).
inline float unit_of(uint32_t bits) { return static_cast<float>(static_cast<int32_t>(bits >> 8)) * 0x1p-24f; }

// Where a row's noise comes from: the caller's tensor (x's layout), or the counter-based generator
// of (seed, natural row, natural column + col_offset), 0 in the padding beyond the natural
// (rows, cols). `transposed`: the kernel's rows are the natural columns (the Hadamard path's GEMM
// layout). Per-row keys k0, k1 are computed once per call.
struct Noise {
  const float* u = nullptr;
  bool counter = false, transposed = false;
  uint32_t col_offset = 0;
  int64_t nat_rows = 0, nat_cols = 0;
  std::vector<uint32_t> k0, k1;
  bool on() const { return u != nullptr || counter; }
};

void row_keys(Noise& n, uint32_t seed_lo, uint32_t seed_hi) {
  n.k0.resize(n.nat_rows);
  n.k1.resize(n.nat_rows);
  for (int64_t r = 0; r < n.nat_rows; ++r) {
    const uint32_t k0 = mix32(mix32(static_cast<uint32_t>(r) ^ seed_lo) ^ seed_hi);
    n.k0[r] = k0;
    n.k1[r] = mix32(k0 ^ 0x9E3779B9u);
  }
}

// The noise of kernel row i (cols elements) into buf; returns the row's noise.
const float* noise_row(const Noise& n, int64_t i, int64_t cols, float* buf) {
  if (n.u) return n.u + i * cols;
  int64_t m = 0;
  if (!n.transposed && i < n.nat_rows) {
    const uint32_t k0 = n.k0[i], k1 = n.k1[i];
    m = cols < n.nat_cols ? cols : n.nat_cols;
    for (int64_t j = 0; j < m; ++j)
      buf[j] = unit_of(mix32(mix32((static_cast<uint32_t>(j) + n.col_offset) ^ k0) ^ k1));
  } else if (n.transposed && i < n.nat_cols) {
    const uint32_t c = static_cast<uint32_t>(i) + n.col_offset;
    const uint32_t* k0 = n.k0.data();
    const uint32_t* k1 = n.k1.data();
    m = cols < n.nat_rows ? cols : n.nat_rows;
    for (int64_t j = 0; j < m; ++j) buf[j] = unit_of(mix32(mix32(c ^ k0[j]) ^ k1[j]));
  }
  for (int64_t j = m; j < cols; ++j) buf[j] = 0.0f;
  return buf;
}

// Per-thread buffers for one block row: column amaxes, block amaxes, block encode/decode, a
// row's noise.
struct RowScratch {
  std::vector<uint32_t> colmax;
  std::vector<float> amax, enc, dec, noise;
  explicit RowScratch(int64_t cols) : colmax(cols), amax(cols), enc(cols), dec(cols), noise(cols) {}
};

// The cast of one row: y = x * enc, rounded, times dec, with enc/dec per block of bc elements
// (bc = 1: per column). The inner loops carry no division by bc, so gcc vectorizes them; BC, when
// not 0, is bc known at compile time (the 1x16 and 1x32 blocks), so a block is whole vectors.
template <typename In, typename Out, bool Stochastic, int64_t BC>
void cast_row(const In* x, Out* out, float* q, const float* u, const float* enc,
              const float* dec, int64_t cols, int64_t bc_runtime, Grid g) {
  const int64_t bc = BC ? BC : bc_runtime;
  if (bc == 1) {
    for (int64_t j = 0; j < cols; ++j) {
      const float y = load(x[j]) * enc[j];
      const float v = Stochastic ? round_stochastic(y, u[j], g) : round_nearest(y, g);
      if (q) q[j] = v;
      store(out + j, v * dec[j]);
    }
    return;
  }
  for (int64_t k = 0, j0 = 0; j0 < cols; ++k, j0 += bc) {
    const float e = enc[k], d = dec[k];
    for (int64_t j = j0; j < j0 + bc; ++j) {
      const float y = load(x[j]) * e;
      const float v = Stochastic ? round_stochastic(y, u[j], g) : round_nearest(y, g);
      if (q) q[j] = v;
      store(out + j, v * d);
    }
  }
}

// One block row: per-column amax over its br rows (bits: |x|'s bits order as the floats do, NaN
// above Inf, so the largest bits are the amax, NaN if any), per-block amax and scales, then the
// cast of each row while the block row is still in cache.
template <typename In, typename Out, bool Stochastic, int64_t BC>
void quantize_block_row(const Params& p, int64_t blk, const In* x, Out* out, float* q,
                        const Noise& noise, void* scales, RowScratch& s) {
  const int64_t cols = p.cols, bc = BC ? BC : p.bc, nc = cols / bc, r0 = blk * p.br;
  float* enc = s.enc.data();
  float* dec = s.dec.data();
  if (p.scale == TENSOR) {
    enc[0] = p.enc;
    dec[0] = p.dec;
  } else {
    float* amax = s.amax.data();
    const In* row = x + r0 * cols;
    if (p.br == 1) {  // 1 x bc blocks: straight from the row
      for (int64_t k = 0; k < nc; ++k) {
        uint32_t m = 0;
        for (int64_t j = k * bc; j < (k + 1) * bc; ++j) {
          const uint32_t a = abs_bits(row[j]);
          m = a > m ? a : m;
        }
        amax[k] = float_of(m);
      }
    } else {
      uint32_t* colmax = s.colmax.data();
      for (int64_t j = 0; j < cols; ++j) colmax[j] = abs_bits(row[j]);
      for (int64_t r = 1; r < p.br; ++r) {
        row = x + (r0 + r) * cols;
        for (int64_t j = 0; j < cols; ++j) {
          const uint32_t a = abs_bits(row[j]);
          colmax[j] = a > colmax[j] ? a : colmax[j];
        }
      }
      for (int64_t k = 0; k < nc; ++k) {
        uint32_t m = 0;
        for (int64_t j = k * bc; j < (k + 1) * bc; ++j) m = colmax[j] > m ? colmax[j] : m;
        amax[k] = float_of(m);
      }
    }
    const int64_t at = blk * nc;
    switch (p.scale) {
      case FP32:
      case POW2:
        fp32_scales(amax, nc, p.elem_max, p.scale == POW2, enc, dec, static_cast<float*>(scales) + at);
        break;
      case E8M0:
        e8m0_scales(amax, nc, p.elem_max, enc, dec, static_cast<uint8_t*>(scales) + at);
        break;
      default:
        nvfp4_scales(amax, nc, p.elem_max, p.global, p.inv_global, p.tensor_finite, enc, dec,
                     static_cast<uint8_t*>(scales) + at);
    }
  }
  const Grid g = grid_of(p.element);
  for (int64_t r = r0; r < r0 + p.br; ++r) {
    const int64_t o = r * cols;
    const float* u = Stochastic ? noise_row(noise, r, cols, s.noise.data()) : nullptr;
    if (q)
      cast_row<In, Out, Stochastic, BC>(x + o, out + o, q + o, u, enc, dec, cols, bc, g);
    else
      cast_row<In, Out, Stochastic, BC>(x + o, out + o, static_cast<float*>(nullptr), u, enc, dec,
                                        cols, bc, g);
  }
}

template <typename In, typename Out, bool Stochastic, int64_t BC>
void quantize_all(const Params& p, const In* x, Out* out, float* q, const Noise& noise,
                  void* scales) {
  const int64_t nblk = p.rows / p.br;
#pragma omp parallel
  {
    RowScratch scratch(p.cols);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk)
      quantize_block_row<In, Out, Stochastic, BC>(p, blk, x, out, q, noise, scales, scratch);
  }
}

template <typename In, typename Out, bool Stochastic>
void dispatch_block(const Params& p, const In* x, Out* out, float* q, const Noise& noise,
                    void* scales) {
  if (p.scale != TENSOR && p.bc == 16) quantize_all<In, Out, Stochastic, 16>(p, x, out, q, noise, scales);
  else if (p.scale != TENSOR && p.bc == 32) quantize_all<In, Out, Stochastic, 32>(p, x, out, q, noise, scales);
  else quantize_all<In, Out, Stochastic, 0>(p, x, out, q, noise, scales);
}

template <typename In, typename Out>
void dispatch_rounding(const Params& p, const In* x, Out* out, float* q, const Noise& noise,
                       void* scales) {
  if (noise.on()) dispatch_block<In, Out, true>(p, x, out, q, noise, scales);
  else dispatch_block<In, Out, false>(p, x, out, q, noise, scales);
}

// max |x| of a float32 or bfloat16 tensor as float32 (NaN if x holds one): the largest |x| bits.
template <typename In>
float abs_max_of(const In* x, int64_t n) {
  uint32_t best = 0;
#pragma omp parallel for reduction(max : best) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t a = abs_bits(x[i]);
    best = a > best ? a : best;
  }
  return float_of(best);
}

// The per-tensor scales from the tensor's own amax (no amax group to all-reduce over), as
// fused.py computes them with torch's 0-dim ops: NaN amax read as Inf (quantize._reduce_amax);
// tensorwise: encode max / amax (fp32_scales), decode its reciprocal (NaN if not finite);
// NVFP4: global = amax / 2688, 1 below the smallest normal float32, and its reciprocal.
// Returns the per-tensor decode scale the caller reports (tensorwise: decode; NVFP4: global).
float per_tensor_scales(Params& p, float amax) {
  if (amax != amax) amax = INFINITY;
  p.tensor_finite = is_finite(amax);
  if (p.scale == TENSOR) {
    float stored;
    fp32_scales(&amax, 1, p.elem_max, false, &p.enc, &p.dec, &stored);
    return p.dec;
  }
  float g = amax / 2688.0f;
  g = g >= FLT_MIN ? g : 1.0f;
  p.global = g;
  p.inv_global = 1.0f / g;
  return g;
}


// ---- The Hadamard roles: transform, quantize and transform back in one call. ----

// Block scales of n blocks by the scale family of p into enc, dec and stored (float32 or uint8).
void block_scales(const Params& p, const float* amax, int64_t n, float* enc, float* dec,
                  void* stored) {
  switch (p.scale) {
    case FP32:
    case POW2:
      fp32_scales(amax, n, p.elem_max, p.scale == POW2, enc, dec, static_cast<float*>(stored));
      break;
    case E8M0:
      e8m0_scales(amax, n, p.elem_max, enc, dec, static_cast<uint8_t*>(stored));
      break;
    default:
      nvfp4_scales(amax, n, p.elem_max, p.global, p.inv_global, p.tensor_finite, enc, dec,
                   static_cast<uint8_t*>(stored));
  }
}

constexpr int64_t HT = 16;  // the transform's size, the block length and the tile width

// The operand in the GEMM layout G (rows: the kernel's rows; the blocked, transformed dim last),
// padded with zeros to whole chunks, read as tiles t[l][k] = G[i0 + k][j0 + l]: k across 16
// G rows, l along one chunk, so that the butterflies over l and every per-block step (one block
// per k) run across k, 16 lanes wide. transposed: G = x^T (x natural (rows, cols)).
struct HadamardJob {
  int64_t nat_rows, nat_cols, g_rows, g_cols, g_cols_pad;
  bool transposed;
  float signs[HT], factor, signed_factor[HT];
};

template <typename In>
void load_tile(const HadamardJob& h, const In* x, int64_t i0, int64_t j0, float t[HT][HT]) {
  if (h.transposed && i0 + HT <= h.nat_cols && j0 + HT <= h.nat_rows) {  // whole tile: vectorized
    for (int64_t l = 0; l < HT; ++l) {
      const In* row = x + (j0 + l) * h.nat_cols + i0;
      for (int64_t k = 0; k < HT; ++k) t[l][k] = load(row[k]);
    }
    return;
  }
  for (int64_t l = 0; l < HT; ++l) {
    const int64_t j = j0 + l;  // G column
    if (h.transposed) {
      const bool in = j < h.nat_rows;
      const In* row = x + j * h.nat_cols;
      for (int64_t k = 0; k < HT; ++k) t[l][k] = (in && i0 + k < h.nat_cols) ? load(row[i0 + k]) : 0.0f;
    } else {
      for (int64_t k = 0; k < HT; ++k)
        t[l][k] = (j < h.nat_cols && i0 + k < h.nat_rows) ? load(x[(i0 + k) * h.nat_cols + j]) : 0.0f;
    }
  }
}

// Butterflies over l, distances 1, 2, 4, 8 (hadamard.py's order), each across the 16 k lanes.
inline void butterflies(float t[HT][HT]) {
  for (int64_t d = 1; d < HT; d *= 2)
    for (int64_t g = 0; g < HT; g += 2 * d)
      for (int64_t l = g; l < g + d; ++l)
        for (int64_t k = 0; k < HT; ++k) {
          const float a = t[l][k], b = t[l + d][k];
          t[l][k] = a + b;
          t[l + d][k] = a - b;
        }
}

inline void forward_transform(const HadamardJob& h, float t[HT][HT]) {
  for (int64_t l = 0; l < HT; ++l)
    for (int64_t k = 0; k < HT; ++k) t[l][k] = t[l][k] * h.signs[l];
  butterflies(t);
  for (int64_t l = 0; l < HT; ++l)
    for (int64_t k = 0; k < HT; ++k) t[l][k] = t[l][k] * h.factor;
}

// The tile's noise: natural (row, col) of G[i0 + k][j0 + l]; 0 in the padding.
void noise_tile(const HadamardJob& h, const Noise& n, int64_t i0, int64_t j0, float u[HT][HT]) {
  if (h.transposed && i0 + HT <= h.nat_cols && j0 + HT <= h.nat_rows) {  // whole tile: vectorized
    const uint32_t c0 = static_cast<uint32_t>(i0) + n.col_offset;
    for (int64_t l = 0; l < HT; ++l) {
      const uint32_t k0 = n.k0[j0 + l], k1 = n.k1[j0 + l];
      for (int64_t k = 0; k < HT; ++k)
        u[l][k] = unit_of(mix32(mix32((c0 + static_cast<uint32_t>(k)) ^ k0) ^ k1));
    }
    return;
  }
  for (int64_t l = 0; l < HT; ++l)
    for (int64_t k = 0; k < HT; ++k) {
      const int64_t r = h.transposed ? j0 + l : i0 + k, c = h.transposed ? i0 + k : j0 + l;
      u[l][k] = (r < h.nat_rows && c < h.nat_cols)
          ? unit_of(mix32(mix32((static_cast<uint32_t>(c) + n.col_offset) ^ n.k0[r]) ^ n.k1[r]))
          : 0.0f;
    }
}

template <typename In>
float hadamard_amax(const HadamardJob& h, const In* x) {
  uint32_t best = 0;
  const int64_t ntile = (h.g_rows + HT - 1) / HT;
#pragma omp parallel for reduction(max : best) schedule(static)
  for (int64_t it = 0; it < ntile; ++it) {
    float t[HT][HT];
    uint32_t m[HT] = {};
    for (int64_t j0 = 0; j0 < h.g_cols_pad; j0 += HT) {
      load_tile(h, x, it * HT, j0, t);
      forward_transform(h, t);
      for (int64_t l = 0; l < HT; ++l)
        for (int64_t k = 0; k < HT; ++k) {
          const uint32_t a = bits_of(t[l][k]) & 0x7FFFFFFFu;
          m[k] = a > m[k] ? a : m[k];
        }
    }
    for (int64_t k = 0; k < HT; ++k) best = m[k] > best ? m[k] : best;
  }
  return float_of(best);
}

template <typename In, bool Stochastic>
void hadamard_cast(const Params& p, const HadamardJob& h, const Noise& noise, const In* x,
                   float* out, float* q, void* scales) {
  const int64_t ntile = (h.g_rows + HT - 1) / HT, nblk = h.g_cols_pad / HT;
  const bool u8 = p.scale == E8M0 || p.scale == NVFP4;
  const Grid g = grid_of(p.element);
#pragma omp parallel for schedule(static)
  for (int64_t it = 0; it < ntile; ++it) {
    float t[HT][HT], u[HT][HT], amax[HT], enc[HT], dec[HT], stored_f[HT];
    uint8_t stored_b[HT];
    const int64_t i0 = it * HT, kn = h.g_rows - i0 < HT ? h.g_rows - i0 : HT;
    for (int64_t j0 = 0, jb = 0; j0 < h.g_cols_pad; j0 += HT, ++jb) {
      load_tile(h, x, i0, j0, t);
      forward_transform(h, t);
      uint32_t m[HT] = {};
      for (int64_t l = 0; l < HT; ++l)
        for (int64_t k = 0; k < HT; ++k) {
          const uint32_t a = bits_of(t[l][k]) & 0x7FFFFFFFu;
          m[k] = a > m[k] ? a : m[k];
        }
      for (int64_t k = 0; k < HT; ++k) amax[k] = float_of(m[k]);
      block_scales(p, amax, HT, enc, dec, u8 ? static_cast<void*>(stored_b) : stored_f);
      for (int64_t k = 0; k < kn; ++k) {
        const int64_t at = (i0 + k) * nblk + jb;
        if (u8) static_cast<uint8_t*>(scales)[at] = stored_b[k];
        else static_cast<float*>(scales)[at] = stored_f[k];
      }
      if (Stochastic) noise_tile(h, noise, i0, j0, u);
      if (q) {
        for (int64_t l = 0; l < HT; ++l)
          for (int64_t k = 0; k < HT; ++k) {
            const float y = t[l][k] * enc[k];
            t[l][k] = Stochastic ? round_stochastic(y, u[l][k], g) : round_nearest(y, g);
          }
        for (int64_t k = 0; k < kn; ++k)
          for (int64_t l = 0; l < HT; ++l) q[(i0 + k) * h.g_cols_pad + j0 + l] = t[l][k];
        for (int64_t l = 0; l < HT; ++l)
          for (int64_t k = 0; k < HT; ++k) t[l][k] = t[l][k] * dec[k];
      } else {  // one pass: scale, round, decode
        for (int64_t l = 0; l < HT; ++l)
          for (int64_t k = 0; k < HT; ++k) {
            const float y = t[l][k] * enc[k];
            const float v = Stochastic ? round_stochastic(y, u[l][k], g) : round_nearest(y, g);
            t[l][k] = v * dec[k];
          }
      }
      butterflies(t);
      const int64_t ln = h.g_cols - j0 < HT ? h.g_cols - j0 : HT;  // crop the padding
      for (int64_t l = 0; l < HT; ++l)
        for (int64_t k = 0; k < HT; ++k) t[l][k] = t[l][k] * h.signed_factor[l];
      for (int64_t k = 0; k < kn; ++k)  // each G row's 16 values: one cache line
        for (int64_t l = 0; l < ln; ++l) out[(i0 + k) * h.g_cols + j0 + l] = t[l][k];
    }
  }
}

}  // namespace

// x: (rows, cols) float32 or bfloat16, contiguous, whole blocks of (br, bc) (tensorwise: br = 1,
// bc = cols). out: float32 or bfloat16 of x's shape. q (optional): float32 grid values (before
// the decode scale), for codes. u (optional): float32 U[0, 1) noise of x's shape. scales: per
// block, float32 (FP32/POW2) or uint8 (E8M0 codes; NVFP4 E4M3 bits); ignored for TENSOR.
// tensor_amax: compute the per-tensor scales (TENSOR, NVFP4) here from x's amax, else take
// enc/dec/global/inv_global/tensor_finite as given. noise_counter: stochastic rounding with the
// counter-based noise of (seed_lo, seed_hi, col_offset) over the natural (nat_rows, nat_cols),
// transposed or not (see Noise). Returns the per-tensor decode scale (tensorwise: decode; NVFP4:
// global) when tensor_amax, else 0.
double quantize_blocks(torch::Tensor x, torch::Tensor out, c10::optional<torch::Tensor> q,
                       c10::optional<torch::Tensor> u, c10::optional<torch::Tensor> scales,
                       int64_t br, int64_t bc, int64_t element, int64_t scale, double elem_max,
                       double enc, double dec, double global, double inv_global,
                       bool tensor_finite, bool tensor_amax, bool noise_counter, int64_t seed_lo,
                       int64_t seed_hi, int64_t col_offset, bool noise_transposed,
                       int64_t nat_rows, int64_t nat_cols) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.dim() == 2, "quantize_blocks: layout");
  TORCH_CHECK(x.sizes() == out.sizes() && x.size(0) % br == 0 && x.size(1) % bc == 0,
              "quantize_blocks: shapes");
  Params p{x.size(0), x.size(1), br, bc, element, scale, static_cast<float>(elem_max),
           static_cast<float>(enc), static_cast<float>(dec), static_cast<float>(global),
           static_cast<float>(inv_global), tensor_finite};
  float* qp = nullptr;
  if (q.has_value()) {
    TORCH_CHECK(q->is_contiguous() && q->scalar_type() == at::kFloat && q->sizes() == x.sizes());
    qp = q->data_ptr<float>();
  }
  Noise noise;
  if (u.has_value()) {
    TORCH_CHECK(u->is_contiguous() && u->scalar_type() == at::kFloat && u->sizes() == x.sizes());
    noise.u = u->data_ptr<float>();
  } else if (noise_counter) {
    noise.counter = true;
    noise.transposed = noise_transposed;
    noise.col_offset = static_cast<uint32_t>(col_offset);
    noise.nat_rows = nat_rows;
    noise.nat_cols = nat_cols;
    row_keys(noise, static_cast<uint32_t>(seed_lo), static_cast<uint32_t>(seed_hi));
  }
  TORCH_CHECK(!noise.on() || element == E2M1, "stochastic rounding is E2M1 only");
  void* sp = nullptr;
  if (scale != TENSOR) {
    TORCH_CHECK(scales.has_value() && scales->is_contiguous() &&
                scales->numel() == (p.rows / br) * (p.cols / bc), "quantize_blocks: scales");
    sp = scales->data_ptr();
  }
  const bool in_bf16 = x.scalar_type() == at::kBFloat16, out_bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(in_bf16 || x.scalar_type() == at::kFloat, "quantize_blocks: x float32 or bfloat16");
  TORCH_CHECK(out_bf16 || out.scalar_type() == at::kFloat, "quantize_blocks: out float32 or bfloat16");
  float tensor_scale = 0.0f;
  if (tensor_amax) {
    TORCH_CHECK(scale == TENSOR || scale == NVFP4, "quantize_blocks: per-tensor scale");
    const float amax = in_bf16 ? abs_max_of(x.data_ptr<c10::BFloat16>(), x.numel())
                               : abs_max_of(x.data_ptr<float>(), x.numel());
    tensor_scale = per_tensor_scales(p, amax);
  }
  if (in_bf16 && out_bf16)
    dispatch_rounding(p, x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), qp, noise, sp);
  else if (in_bf16)
    dispatch_rounding(p, x.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), qp, noise, sp);
  else if (out_bf16)
    dispatch_rounding(p, x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), qp, noise, sp);
  else
    dispatch_rounding(p, x.data_ptr<float>(), out.data_ptr<float>(), qp, noise, sp);
  return tensor_scale;
}

// The Hadamard roles in one call: x natural (rows, cols), float32 or bfloat16; G its GEMM layout
// (x^T when transposed), (g_rows, g_cols) padded with zero columns to g_cols_pad (whole 16-chunks).
// out: float32 (g_rows, g_cols), the dequantized values transformed back (M^T Q(M g)) and cropped.
// q (optional): float32 (g_rows, g_cols_pad) grid values in the transformed domain. scales:
// (g_rows, g_cols_pad / 16). Blocks (1, 16), transform size 16, per-tensor scales (NVFP4) from
// the transformed tensor's amax (two passes: the transform is recomputed, not stored). Noise:
// none, or the counter-based generator. Returns NVFP4's global scale (else 0).
double quantize_hadamard(torch::Tensor x, torch::Tensor out, c10::optional<torch::Tensor> q,
                         torch::Tensor scales, torch::Tensor signs, double factor,
                         bool transposed, int64_t element, int64_t scale, double elem_max,
                         bool noise_counter, int64_t seed_lo, int64_t seed_hi,
                         int64_t col_offset) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && out.is_contiguous() &&
              out.scalar_type() == at::kFloat, "quantize_hadamard: layout");
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.numel() == HT && signs.is_contiguous(),
              "quantize_hadamard: 16 float32 signs");
  HadamardJob h;
  h.nat_rows = x.size(0);
  h.nat_cols = x.size(1);
  h.transposed = transposed;
  h.g_rows = transposed ? h.nat_cols : h.nat_rows;
  h.g_cols = transposed ? h.nat_rows : h.nat_cols;
  h.g_cols_pad = (h.g_cols + HT - 1) / HT * HT;
  TORCH_CHECK(out.size(0) == h.g_rows && out.size(1) == h.g_cols, "quantize_hadamard: out shape");
  h.factor = static_cast<float>(factor);
  const float* sp = signs.data_ptr<float>();
  for (int64_t l = 0; l < HT; ++l) {
    h.signs[l] = sp[l];
    h.signed_factor[l] = sp[l] * h.factor;
  }
  float* qp = nullptr;
  if (q.has_value()) {
    TORCH_CHECK(q->is_contiguous() && q->scalar_type() == at::kFloat &&
                q->size(0) == h.g_rows && q->size(1) == h.g_cols_pad, "quantize_hadamard: q");
    qp = q->data_ptr<float>();
  }
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == h.g_rows * (h.g_cols_pad / HT),
              "quantize_hadamard: scales");
  Params p{h.g_rows, h.g_cols_pad, 1, HT, element, scale, static_cast<float>(elem_max),
           1.0f, 1.0f, 1.0f, 1.0f, true};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "quantize_hadamard: x float32 or bfloat16");
  float tensor_scale = 0.0f;
  if (scale == NVFP4) {
    const float amax = bf16 ? hadamard_amax(h, x.data_ptr<c10::BFloat16>())
                            : hadamard_amax(h, x.data_ptr<float>());
    tensor_scale = per_tensor_scales(p, amax);
  }
  Noise noise;
  if (noise_counter) {
    TORCH_CHECK(element == E2M1, "stochastic rounding is E2M1 only");
    noise.counter = true;
    noise.col_offset = static_cast<uint32_t>(col_offset);
    noise.nat_rows = h.nat_rows;
    noise.nat_cols = h.nat_cols;
    row_keys(noise, static_cast<uint32_t>(seed_lo), static_cast<uint32_t>(seed_hi));
  }
  void* scp = scales.data_ptr();
  float* op = out.data_ptr<float>();
  if (bf16) {
    const auto* xp = x.data_ptr<c10::BFloat16>();
    if (noise_counter) hadamard_cast<c10::BFloat16, true>(p, h, noise, xp, op, qp, scp);
    else hadamard_cast<c10::BFloat16, false>(p, h, noise, xp, op, qp, scp);
  } else {
    const float* xp = x.data_ptr<float>();
    if (noise_counter) hadamard_cast<float, true>(p, h, noise, xp, op, qp, scp);
    else hadamard_cast<float, false>(p, h, noise, xp, op, qp, scp);
  }
  return tensor_scale;
}

torch::Tensor abs_max(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "abs_max: contiguous x");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "abs_max: float32 or bfloat16");
  const float m = bf16 ? abs_max_of(x.data_ptr<c10::BFloat16>(), x.numel())
                       : abs_max_of(x.data_ptr<float>(), x.numel());
  return torch::full({}, m, torch::dtype(torch::kFloat));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("quantize_blocks", &quantize_blocks, "fake-quantize a 2D tensor in whole blocks",
        py::arg("x"), py::arg("out"), py::arg("q"), py::arg("u"), py::arg("scales"), py::arg("br"),
        py::arg("bc"), py::arg("element"), py::arg("scale"), py::arg("elem_max"), py::arg("enc"),
        py::arg("dec"), py::arg("global_scale"), py::arg("inv_global"), py::arg("tensor_finite"),
        py::arg("tensor_amax") = false, py::arg("noise_counter") = false, py::arg("seed_lo") = 0,
        py::arg("seed_hi") = 0, py::arg("col_offset") = 0, py::arg("noise_transposed") = false,
        py::arg("nat_rows") = 0, py::arg("nat_cols") = 0);
  m.def("quantize_hadamard", &quantize_hadamard, "the Hadamard roles: M^T Q(M x) in one call");
  m.def("abs_max", &abs_max, "max |x| from the bits (NaN if any)");
}
