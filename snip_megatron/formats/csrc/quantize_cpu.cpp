// The CPU fake quantizer: `quantize_reference`'s casts, bit for bit, in one pass per block row.
//
// Called from snip_megatron/formats/fused.py (`_quantize_2d`), which has already put the operand
// in the layout the blocks run in (2D, whole blocks, Hadamard applied) and computed the
// per-tensor scales (tiny 0-dim torch ops, the reference's own). Per block row (br rows) this
// reads the input, takes the block amaxes from the integer bits, computes each block's scale
// with the reference's formulas operation for operation, rounds every element to the grid
// (nearest-even, or stochastic with the caller's noise) and writes the dequantized values, and
// optionally the grid values (for codes) and the scales. The block row stays in cache between
// the amax read and the cast, so memory sees one read and one write.
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

struct BlockScale { float enc; float dec; };  // multiply by enc, round, multiply by dec

// FP32 (and pow2) scales, TE's compute_scale_from_amax: max / amax as torch computes a Python
// scalar over a tensor (the reciprocal, then times the scalar), 1 for an all-zero block, capped
// at the largest float32; pow2 keeps only sign and exponent. Decode 1 / scale (the stored scale).
inline BlockScale fp32_scale(float amax, float elem_max, bool pow2, float* stored) {
  float enc = (1.0f / amax) * elem_max;
  enc = amax == 0.0f ? 1.0f : enc;
  enc = enc > FLT_MAX ? FLT_MAX : enc;  // NaN stays NaN
  if (pow2) enc = float_of(bits_of(enc) & 0xFF800000u);
  float dec = 1.0f / enc;
  *stored = dec;
  return {enc, is_finite(amax) ? dec : NAN};
}

// MX scales, RCEIL (e8m0_round_up): the smallest power of two >= amax / max, from the bits;
// encode 2**(127 - e) (1 for code 0, as TE's exp2f_rcp), decode 2**(e - 127); code 255 = NaN.
inline BlockScale e8m0_scale(float amax, float elem_max, uint8_t* stored) {
  uint32_t b = bits_of(amax / elem_max);
  int32_t exp = static_cast<int32_t>((b >> 23) & 0xFF);
  uint32_t mant = b & 0x7FFFFFu;
  int32_t e = exp == 0 ? (mant > (1u << 22) ? 1 : 0) : exp + (mant != 0 ? 1 : 0);
  e = e > 254 ? 254 : e;
  bool finite = is_finite(amax);
  *stored = static_cast<uint8_t>(finite ? e : 255);
  float enc = e == 0 ? 1.0f : std::ldexp(1.0f, 127 - e);
  float dec = std::ldexp(1.0f, e - 127);
  return {enc, finite ? dec : NAN};
}

// NVFP4: an E4M3 block scale on the FP32 per-tensor scale (torchao's nvfp4_quantize):
// (amax / 6) / global, clamped to [2**-6, 448], rounded to E4M3; encode (1 / global) / scale,
// decode global * scale (NaN where the tensor or the block is not finite).
inline BlockScale nvfp4_scale(float amax, float elem_max, float global, float inv_global,
                              bool tensor_finite, uint8_t* stored) {
  float s = (amax / elem_max) / global;
  s = s < 0.015625f ? 0.015625f : s;  // NaN stays NaN
  s = s > 448.0f ? 448.0f : s;
  s = round_nearest(s, grid_of(E4M3));  // a positive normal E4M3 value (or NaN)
  uint32_t b = bits_of(s);
  *stored = (s != s) ? static_cast<uint8_t>(0x7F)
                     : static_cast<uint8_t>(((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7));
  float dec = tensor_finite ? global * s : NAN;
  return {inv_global / s, is_finite(amax) ? dec : NAN};
}

struct Params {
  int64_t rows, cols, br, bc;
  int64_t element, scale;
  float elem_max, enc, dec, global, inv_global;  // enc/dec: TENSOR; global: NVFP4
  bool tensor_finite;
};

// One block row: per-column amax over its br rows, per-block scales spread to per-column
// encode/decode vectors, then the elementwise cast (a loop gcc vectorizes: no division by bc
// inside it).
template <typename In, typename Out, bool Stochastic>
void quantize_block_row(const Params& p, int64_t blk, const In* x, Out* out, float* q,
                        const float* u, void* scales, uint32_t* colmax, float* enc, float* dec) {
  const int64_t cols = p.cols, nc = cols / p.bc;
  const int64_t r0 = blk * p.br;
  if (p.scale != TENSOR) {
    const In* row = x + r0 * cols;
    for (int64_t j = 0; j < cols; ++j) colmax[j] = abs_bits(row[j]);
    for (int64_t r = 1; r < p.br; ++r) {
      row = x + (r0 + r) * cols;
      for (int64_t j = 0; j < cols; ++j) {
        uint32_t a = abs_bits(row[j]);
        colmax[j] = a > colmax[j] ? a : colmax[j];
      }
    }
    // |x|'s bits order as the floats do, NaN above Inf: the max bits are the amax (NaN if any).
    for (int64_t k = 0; k < nc; ++k) {
      uint32_t m = 0;
      for (int64_t j = k * p.bc; j < (k + 1) * p.bc; ++j) m = colmax[j] > m ? colmax[j] : m;
      const float amax = float_of(m);
      BlockScale s;
      const int64_t at = blk * nc + k;
      switch (p.scale) {
        case FP32: s = fp32_scale(amax, p.elem_max, false, static_cast<float*>(scales) + at); break;
        case POW2: s = fp32_scale(amax, p.elem_max, true, static_cast<float*>(scales) + at); break;
        case E8M0: s = e8m0_scale(amax, p.elem_max, static_cast<uint8_t*>(scales) + at); break;
        default:
          s = nvfp4_scale(amax, p.elem_max, p.global, p.inv_global, p.tensor_finite,
                          static_cast<uint8_t*>(scales) + at);
      }
      for (int64_t j = k * p.bc; j < (k + 1) * p.bc; ++j) { enc[j] = s.enc; dec[j] = s.dec; }
    }
  }
  const Grid g = grid_of(p.element);
  for (int64_t r = r0; r < r0 + p.br; ++r) {
    const In* xr = x + r * cols;
    Out* orow = out + r * cols;
    float* qr = q ? q + r * cols : nullptr;
    const float* ur = Stochastic ? u + r * cols : nullptr;
    if (qr) {
      for (int64_t j = 0; j < cols; ++j) {
        const float y = load(xr[j]) * enc[j];
        const float v = Stochastic ? round_stochastic(y, ur[j], g) : round_nearest(y, g);
        qr[j] = v;
        store(orow + j, v * dec[j]);
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const float y = load(xr[j]) * enc[j];
        const float v = Stochastic ? round_stochastic(y, ur[j], g) : round_nearest(y, g);
        store(orow + j, v * dec[j]);
      }
    }
  }
}

template <typename In, typename Out, bool Stochastic>
void quantize_all(const Params& p, const In* x, Out* out, float* q, const float* u, void* scales) {
  const int64_t nblk = p.rows / p.br;
#pragma omp parallel
  {
    // Per thread: the column amaxes and the per-column encode/decode of the current block row.
    std::vector<uint32_t> colmax(p.cols);
    std::vector<float> enc(p.cols, p.enc), dec(p.cols, p.dec);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk)
      quantize_block_row<In, Out, Stochastic>(p, blk, x, out, q, u, scales, colmax.data(),
                                              enc.data(), dec.data());
  }
}

template <typename In, typename Out>
void dispatch_rounding(const Params& p, const In* x, Out* out, float* q, const float* u,
                       void* scales) {
  if (u) quantize_all<In, Out, true>(p, x, out, q, u, scales);
  else quantize_all<In, Out, false>(p, x, out, q, u, scales);
}

}  // namespace

// x: (rows, cols) float32 or bfloat16, contiguous, whole blocks of (br, bc) (tensorwise: br = 1,
// bc = cols). out: float32 or bfloat16 of x's shape. q (optional): float32 grid values (before
// the decode scale), for codes. u (optional): float32 U[0, 1) noise of x's shape. scales: per
// block, float32 (FP32/POW2) or uint8 (E8M0 codes; NVFP4 E4M3 bits); ignored for TENSOR.
void quantize_blocks(torch::Tensor x, torch::Tensor out, c10::optional<torch::Tensor> q,
                     c10::optional<torch::Tensor> u, c10::optional<torch::Tensor> scales,
                     int64_t br, int64_t bc, int64_t element, int64_t scale, double elem_max,
                     double enc, double dec, double global, double inv_global,
                     bool tensor_finite) {
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
  const float* up = nullptr;
  if (u.has_value()) {
    TORCH_CHECK(element == E2M1, "stochastic rounding is E2M1 only");
    TORCH_CHECK(u->is_contiguous() && u->scalar_type() == at::kFloat && u->sizes() == x.sizes());
    up = u->data_ptr<float>();
  }
  void* sp = nullptr;
  if (scale != TENSOR) {
    TORCH_CHECK(scales.has_value() && scales->is_contiguous() &&
                scales->numel() == (p.rows / br) * (p.cols / bc), "quantize_blocks: scales");
    sp = scales->data_ptr();
  }
  const bool in_bf16 = x.scalar_type() == at::kBFloat16, out_bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(in_bf16 || x.scalar_type() == at::kFloat, "quantize_blocks: x float32 or bfloat16");
  TORCH_CHECK(out_bf16 || out.scalar_type() == at::kFloat, "quantize_blocks: out float32 or bfloat16");
  if (in_bf16 && out_bf16)
    dispatch_rounding(p, x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), qp, up, sp);
  else if (in_bf16)
    dispatch_rounding(p, x.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), qp, up, sp);
  else if (out_bf16)
    dispatch_rounding(p, x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), qp, up, sp);
  else
    dispatch_rounding(p, x.data_ptr<float>(), out.data_ptr<float>(), qp, up, sp);
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

torch::Tensor abs_max(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "abs_max: contiguous x");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "abs_max: float32 or bfloat16");
  const float m = bf16 ? abs_max_of(x.data_ptr<c10::BFloat16>(), x.numel())
                       : abs_max_of(x.data_ptr<float>(), x.numel());
  return torch::full({}, m, torch::dtype(torch::kFloat));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_blocks", &quantize_blocks, "fake-quantize a 2D tensor in whole blocks");
  m.def("abs_max", &abs_max, "max |x| from the bits (NaN if any)");
}
