// SPDX-License-Identifier: Apache-2.0
//
// ESP tree attention on vLLM's CPU paged KV cache ("vec" layout).
//
// Each ESP block is one request's verification block: rows 0..Q-1 (root,
// draft nodes, mask rows) at tree positions p + offset. Every row attends to
//   * the request's committed prefix, positions 0..p-1, read in place from
//     the paged cache through its block table (no copy), and
//   * the block rows its tree mask allows (their fresh post-RoPE K/V).
// One online-softmax pass covers both parts, so each row is computed once.
//
// vec layout, per (physical block, KV head): K column-major [D][BS],
// V row-major [BS][D] (vllm_esp/attention.py checks it at start-up).
//
// Work items are (block, KV head, chunk of rows); the G = Hq / Hkv query
// heads of a KV head are processed together (grouped-query attention), so a
// chunk reads each prefix K/V tile once for chunk_rows * G query vectors.
//
// With `lse` given, the kernel stops after the prefix and writes the
// prefix-only output plus its log-sum-exp instead (the "split" design: the
// caller attends the block part itself and merges the two by log-sum-exp,
// as vLLM's cascade attention does). The fused design passes no `lse`.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int kChunkKeys = 32;     // keys per scores micro-kernel call
constexpr int kMaxTileKeys = 128;  // prefix keys per softmax tile
constexpr int kScoreRows = 8;      // query vectors padded to a multiple of this
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// vec16: 16 floats, held as native vectors: one AVX-512 register, or two
// AVX2 ones. (A plain 64-byte GCC vector on an AVX2 target is lowered
// through memory: every multiply-add loaded and stored its operands, and
// the kernel ran 3-4x slower than vLLM's on the same rows.) The
// micro-kernels keep their accumulators in fully unrolled arrays of these,
// so that they stay in registers: their tiles are sized to the register
// file (32 16-float registers with AVX-512, 16 8-float ones with AVX2).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTileRows = 8;       // scores: 8 query vectors x 32 keys
constexpr int kTileKeyVecs = 2;
// PV: rows x vectors of head_dim per pass (C = head_dim / 16 in all).
constexpr int pv_cols(int C) { return C; }
constexpr int pv_rows(int C) { return C >= 16 ? 1 : 16 / C; }
#else
constexpr int kLanes = 8;
constexpr int kTileRows = 4;       // scores: 4 query vectors x 16 keys
constexpr int kTileKeyVecs = 1;
constexpr int pv_cols(int C) { return C % 2 == 0 ? 2 : 1; }  // 2 rows x 32 columns
constexpr int pv_rows(int) { return 2; }
#endif
constexpr int kParts = 16 / kLanes;
typedef float native_vec __attribute__((vector_size(4 * kLanes)));
typedef int32_t native_ivec __attribute__((vector_size(4 * kLanes)));

// Unaligned loads and stores of one native vector (GCC's idiom; a memcpy
// of the whole struct went through the stack in 16-byte pieces, and each
// 32-byte read of them stalled on store forwarding).
typedef float unaligned_vec
    __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

struct vec16 {
  native_vec part[kParts];
};

#define ESP_VEC16_OP(op)                                           \
  inline vec16 operator op(vec16 a, const vec16& b) {              \
    for (int i = 0; i < kParts; ++i) a.part[i] = a.part[i] op b.part[i]; \
    return a;                                                      \
  }
ESP_VEC16_OP(+)
ESP_VEC16_OP(-)
ESP_VEC16_OP(*)
#undef ESP_VEC16_OP
inline vec16& operator+=(vec16& a, const vec16& b) { return a = a + b; }

inline vec16 load16(const float* p) {
  vec16 v;
  for (int i = 0; i < kParts; ++i)
    v.part[i] = *reinterpret_cast<const unaligned_vec*>(p + i * kLanes);
  return v;
}
inline void store16(float* p, const vec16& v) {
  for (int i = 0; i < kParts; ++i)
    *reinterpret_cast<unaligned_vec*>(p + i * kLanes) = v.part[i];
}
inline vec16 splat16(float x) {
  vec16 v;
  for (int i = 0; i < kParts; ++i) v.part[i] = native_vec{} + x;
  return v;
}
inline vec16 max16(vec16 a, const vec16& b) {
  for (int i = 0; i < kParts; ++i) a.part[i] = a.part[i] > b.part[i] ? a.part[i] : b.part[i];
  return a;
}
inline float hmax16(const vec16& v) {
  float x[16];
  store16(x, v);
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, x[i]);
  return m;
}
inline float hsum16(const vec16& v) {
  float x[16];
  store16(x, v);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their running max): 2^(x log2 e) split
// into 2^n * 2^f, |f| <= 1/2, 2^f by a degree-6 polynomial (relative error
// ~2e-7). Exactly 0 below -87, so masked keys (-inf) weigh nothing.
inline native_vec exp_native(native_vec x) {
  const native_vec zero = native_vec{};
  const auto underflow = x < zero - 87.0f;
  x = x > zero - 87.0f ? x : zero - 87.0f;
  const native_vec t = x * 1.44269504088896341f;
  // Round to nearest with the 1.5 * 2^23 trick (|t| < 2^22).
  const native_vec n = (t + 12582912.0f) - 12582912.0f;
  const native_vec f = t - n;
  native_vec p = zero + 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022650e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const native_ivec bits = (__builtin_convertvector(n, native_ivec) + 127) << 23;
  native_vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const native_vec result = p * scale;
  return underflow ? zero : result;
}
inline vec16 exp16(vec16 x) {
  for (int i = 0; i < kParts; ++i) x.part[i] = exp_native(x.part[i]);
  return x;
}

inline float exp1(float x) { return exp_native(native_vec{} + x)[0]; }

template <typename T>
inline float to_float(T value) { return static_cast<float>(value); }

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float value) { return static_cast<T>(value); }

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_rows;
  int64_t q_row_stride, q_head_stride, k_row_stride, k_head_stride,
      v_row_stride, v_head_stride, o_row_stride, o_head_stride;
  int64_t cache_block_stride, cache_head_stride, table_stride;
  float scale;
  int64_t sliding_window;
};

// scores[m][j] = q[m] . K[:, j] for kChunkKeys keys whose K is column-major
// with row stride k_stride (fp32); q_t is q transposed, [D][M_pad], M_pad a
// multiple of kScoreRows. Register tiles of kTileRows x (16 * kTileKeyVecs).
template <int D>
void chunk_scores(const float* q_t, int64_t M_pad, const float* k, int64_t k_stride,
                  float* scores, int64_t scores_stride) {
  static_assert(kChunkKeys % (16 * kTileKeyVecs) == 0, "key tile must divide a chunk");
  static_assert(kScoreRows % kTileRows == 0, "row tile must divide the padding");
  for (int64_t j0 = 0; j0 < kChunkKeys; j0 += 16 * kTileKeyVecs) {
    for (int64_t m0 = 0; m0 < M_pad; m0 += kTileRows) {
      vec16 block[kTileRows][kTileKeyVecs] = {};
      for (int d = 0; d < D; ++d) {
        vec16 keys[kTileKeyVecs];
#pragma GCC unroll 2
        for (int c = 0; c < kTileKeyVecs; ++c) keys[c] = load16(k + d * k_stride + j0 + 16 * c);
        const float* qd = q_t + d * M_pad + m0;
#pragma GCC unroll 8
        for (int i = 0; i < kTileRows; ++i) {
          const vec16 qb = splat16(qd[i]);
#pragma GCC unroll 2
          for (int c = 0; c < kTileKeyVecs; ++c) block[i][c] += qb * keys[c];
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < kTileRows; ++i)
#pragma GCC unroll 2
        for (int c = 0; c < kTileKeyVecs; ++c)
          store16(scores + (m0 + i) * scores_stride + j0 + 16 * c, block[i][c]);
    }
  }
}

// Online-softmax state of M query vectors (M_pad with padding rows).
template <int D>
struct SoftmaxState {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int C = D / 16;                      // vectors per row
  // PV register tile: RB rows x CB vectors of head_dim per pass.
  static constexpr int CB = pv_cols(C);
  static constexpr int RB = pv_rows(C);
  int64_t M, M_pad;
  std::vector<float> acc, row_max, row_sum;
  SoftmaxState(int64_t m, int64_t m_pad)
      : M(m), M_pad(m_pad), acc(m_pad * D, 0.0f), row_max(m_pad, kNegInf),
        row_sum(m_pad, 0.0f) {}

  // Fold in keys 0..n-1: scores [M_pad][stride], n_pad = n rounded up to 16
  // columns valid (columns >= n must be -inf); replaced by probabilities.
  // Values: row j at values + j * values_stride (fp32).
  void update(float* scores, int64_t n, int64_t n_pad, int64_t stride,
              const float* values, int64_t values_stride) {
    for (int64_t m = 0; m < M_pad; ++m) {
      float* sc = scores + m * stride;
      if (m >= M) {  // padding rows
        for (int64_t j = 0; j < n_pad; j += 16) store16(sc + j, splat16(0.0f));
        continue;
      }
      vec16 vmax = splat16(kNegInf);
      for (int64_t j = 0; j < n_pad; j += 16) vmax = max16(vmax, load16(sc + j));
      const float tile_max = hmax16(vmax);
      if (tile_max == kNegInf) {
        for (int64_t j = 0; j < n_pad; j += 16) store16(sc + j, splat16(0.0f));
        continue;
      }
      const float new_max = std::max(row_max[m], tile_max);
      const float correction = exp1(row_max[m] - new_max);  // 0 on the first tile
      const vec16 shift = splat16(new_max);
      vec16 vsum = splat16(0.0f);
      for (int64_t j = 0; j < n_pad; j += 16) {
        const vec16 p = exp16(load16(sc + j) - shift);
        store16(sc + j, p);
        vsum += p;
      }
      row_sum[m] = row_sum[m] * correction + hsum16(vsum);
      row_max[m] = new_max;
      if (correction != 1.0f) {
        float* a = acc.data() + m * D;
        const vec16 c = splat16(correction);
        for (int i = 0; i < C; ++i) store16(a + 16 * i, load16(a + 16 * i) * c);
      }
    }
    // acc[m] += sum_j p[m][j] V[j], RB query vectors at a time so that
    // their accumulators stay in registers over the keys.
    static_assert(C % CB == 0, "PV column tile must divide head_dim");
    for (int64_t m0 = 0; m0 < M; m0 += RB)
      for (int c0 = 0; c0 < C; c0 += CB) {
        vec16 local[RB][CB];
#pragma GCC unroll 16
        for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
          for (int c = 0; c < CB; ++c)
            local[i][c] = load16(acc.data() + (m0 + i) * D + (c0 + c) * 16);
        for (int64_t j = 0; j < n; ++j) {
          const float* v = values + j * values_stride + c0 * 16;
          vec16 vv[CB];
#pragma GCC unroll 16
          for (int c = 0; c < CB; ++c) vv[c] = load16(v + c * 16);
#pragma GCC unroll 16
          for (int i = 0; i < RB; ++i) {
            const vec16 p = splat16(scores[(m0 + i) * stride + j]);
#pragma GCC unroll 16
            for (int c = 0; c < CB; ++c) local[i][c] += p * vv[c];
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
          for (int c = 0; c < CB; ++c)
            store16(acc.data() + (m0 + i) * D + (c0 + c) * 16, local[i][c]);
      }
  }
};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Everything one call attends over: pointers and strides.
template <typename scalar_t>
struct Inputs {
  Shapes s;
  scalar_t* out;
  const scalar_t *query, *key, *value, *cache;
  const int32_t *block_table, *row_starts, *num_rows, *prefix_lens, *offsets;
  const bool* tree_mask;
  float* lse;
};

// The query vectors of one (block, KV head): its Q rows times the G query
// heads that share the KV head (m = row * G + g), scaled, as rows [M][D]
// and transposed [D][M_pad] (zero padding rows).
template <typename scalar_t, int D>
struct Queries {
  int64_t M, M_pad;
  std::vector<float> rows, transposed;
  std::vector<int64_t> first_visible;  // sliding window: first visible key
  bool windowed = false;

  Queries(const Inputs<scalar_t>& in, int64_t b, int64_t h) {
    const Shapes& s = in.s;
    const int64_t G = s.num_heads / s.num_kv_heads;
    const int64_t Q = in.num_rows[b];
    M = Q * G;
    // Padded for the scores tile (8) and the PV register block (RB).
    M_pad = round_up(round_up(M, kScoreRows), SoftmaxState<D>::RB);
    rows.assign(M_pad * D, 0.0f);
    transposed.assign(D * M_pad, 0.0f);
    first_visible.assign(M_pad, 0);
    const int64_t root_row = in.row_starts[b];
    const int64_t prefix = in.prefix_lens[b];
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t position = prefix + in.offsets[b * s.max_rows + r];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = r * G + g;
        const scalar_t* src = in.query + (root_row + r) * s.q_row_stride +
                              (h * G + g) * s.q_head_stride;
        for (int d = 0; d < D; ++d) {
          rows[m * D + d] = to_float(src[d]) * s.scale;
          transposed[d * M_pad + m] = rows[m * D + d];
        }
        if (s.sliding_window > 0) {
          first_visible[m] = position - s.sliding_window + 1;
          windowed |= first_visible[m] > 0;
        }
      }
    }
  }

  // First prefix key any query vector sees, rounded down to kChunkKeys.
  int64_t prefix_begin(int64_t prefix) const {
    int64_t begin = prefix;
    for (int64_t m = 0; m < M; ++m) begin = std::min(begin, first_visible[m]);
    // Tiles start on multiples of kChunkKeys inside a cache block, so a
    // chunk never reads past its block (block sizes are multiples of 32).
    return std::max<int64_t>(begin, 0) / kChunkKeys * kChunkKeys;
  }
};

// Attend prefix keys [key_begin, key_end) of block b, KV head h, read in
// place from the paged cache (key_begin a multiple of kChunkKeys).
template <typename scalar_t, int D>
void attend_prefix(const Inputs<scalar_t>& in, int64_t b, int64_t h,
                   const Queries<scalar_t, D>& q, int64_t key_begin, int64_t key_end,
                   SoftmaxState<D>& state) {
  constexpr bool kFloat = std::is_same<scalar_t, float>::value;
  const Shapes& s = in.s;
  const int64_t BS = s.block_size;
  const int32_t* table = in.block_table + b * s.table_stride;
  const int64_t stride = kMaxTileKeys;
  std::vector<float> scores(q.M_pad * stride), k_tile(D * kMaxTileKeys);
  std::vector<float> v_tile(kFloat ? 0 : kMaxTileKeys * D);
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t in_block = start % BS;
    const int64_t n = std::min<int64_t>({kMaxTileKeys, BS - in_block, key_end - start});
    const int64_t n_pad = round_up(n, kChunkKeys);
    const scalar_t* block_base = in.cache +
                                 static_cast<int64_t>(table[start / BS]) * s.cache_block_stride +
                                 h * s.cache_head_stride;
    // K: [D][BS] column-major, then V: [BS][D]. K is copied into a
    // contiguous tile: its rows are BS floats apart in the cache, which maps
    // them onto a few L1 sets.
    const scalar_t* k_src = block_base + in_block;
    const scalar_t* v_src = block_base + BS * D + in_block * D;
    for (int d = 0; d < D; ++d)
      for (int64_t j = 0; j < n_pad; ++j) k_tile[d * kMaxTileKeys + j] = to_float(k_src[d * BS + j]);
    const float* v_f;
    if constexpr (kFloat) {
      v_f = v_src;
    } else {
      for (int64_t j = 0; j < n * D; ++j) v_tile[j] = to_float(v_src[j]);
      v_f = v_tile.data();
    }
    for (int64_t c = 0; c < n_pad; c += kChunkKeys)
      chunk_scores<D>(q.transposed.data(), q.M_pad, k_tile.data() + c, kMaxTileKeys,
                      scores.data() + c, stride);
    for (int64_t m = 0; m < q.M; ++m) {
      float* sc = scores.data() + m * stride;
      for (int64_t j = n; j < n_pad; ++j) sc[j] = kNegInf;  // past the tile
      if (q.windowed)
        for (int64_t j = 0; j < n; ++j)
          if (start + j < q.first_visible[m]) sc[j] = kNegInf;
    }
    state.update(scores.data(), n, n_pad, stride, v_f, D);
    start += n;
  }
}

// Attend the block's own rows under the tree mask (fresh K/V).
template <typename scalar_t, int D>
void attend_block(const Inputs<scalar_t>& in, int64_t b, int64_t h,
                  const Queries<scalar_t, D>& q, SoftmaxState<D>& state) {
  const Shapes& s = in.s;
  const int64_t G = s.num_heads / s.num_kv_heads;
  const int64_t Q = in.num_rows[b];
  const int64_t Q_pad = round_up(Q, 16);
  const int64_t root_row = in.row_starts[b];
  const int64_t prefix = in.prefix_lens[b];
  const bool* mask = in.tree_mask + b * s.max_rows * s.max_rows;
  std::vector<float> scores(q.M_pad * Q_pad, kNegInf), values(Q * D);
  for (int64_t j = 0; j < Q; ++j) {
    const scalar_t* v = in.value + (root_row + j) * s.v_row_stride + h * s.v_head_stride;
    for (int d = 0; d < D; ++d) values[j * D + d] = to_float(v[d]);
  }
  for (int64_t j = 0; j < Q; ++j) {
    const scalar_t* k = in.key + (root_row + j) * s.k_row_stride + h * s.k_head_stride;
    float k_row[D];
    for (int d = 0; d < D; ++d) k_row[d] = to_float(k[d]);
    const int64_t key_position = prefix + in.offsets[b * s.max_rows + j];
    for (int64_t r = 0; r < Q; ++r) {
      if (!mask[r * s.max_rows + j]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = r * G + g;
        if (key_position < q.first_visible[m]) continue;
        const float* qm = q.rows.data() + m * D;
        vec16 dot = splat16(0.0f);
        for (int c = 0; c < D; c += 16) dot += load16(qm + c) * load16(k_row + c);
        scores[m * Q_pad + j] = hsum16(dot);
      }
    }
  }
  state.update(scores.data(), Q, Q_pad, Q_pad, values.data(), D);
}

// out (or, with in.lse, the prefix-only output and its log-sum-exp) from a
// final state.
template <typename scalar_t, int D>
void write_output(const Inputs<scalar_t>& in, int64_t b, int64_t h,
                  const SoftmaxState<D>& state) {
  const Shapes& s = in.s;
  const int64_t G = s.num_heads / s.num_kv_heads;
  const int64_t Q = in.num_rows[b];
  const int64_t root_row = in.row_starts[b];
  for (int64_t r = 0; r < Q; ++r) {
    const int64_t row = root_row + r;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = r * G + g;
      const int64_t head = h * G + g;
      const bool empty = state.row_sum[m] == 0.0f;
      if (in.lse != nullptr)
        in.lse[row * s.num_heads + head] =
            empty ? kNegInf : state.row_max[m] + std::log(state.row_sum[m]);
      scalar_t* dst = in.out + row * s.o_row_stride + head * s.o_head_stride;
      const float inv = empty ? 0.0f : 1.0f / state.row_sum[m];
      for (int d = 0; d < D; ++d) dst[d] = from_float<scalar_t>(state.acc[m * D + d] * inv);
    }
  }
}

// Fold `other` (the same query vectors over other keys) into `state`.
template <int D>
void merge_state(SoftmaxState<D>& state, const SoftmaxState<D>& other) {
  for (int64_t m = 0; m < state.M; ++m) {
    if (other.row_sum[m] == 0.0f) continue;
    const float new_max = std::max(state.row_max[m], other.row_max[m]);
    const float mine = exp1(state.row_max[m] - new_max);
    const float theirs = exp1(other.row_max[m] - new_max);
    state.row_sum[m] = state.row_sum[m] * mine + other.row_sum[m] * theirs;
    state.row_max[m] = new_max;
    float* a = state.acc.data() + m * D;
    const float* o = other.acc.data() + m * D;
    for (int d = 0; d < D; ++d) a[d] = a[d] * mine + o[d] * theirs;
  }
}

template <typename scalar_t, int D>
void run(const Inputs<scalar_t>& in, int64_t num_blocks) {
  const Shapes& s = in.s;
  const int64_t units = num_blocks * s.num_kv_heads;  // (block, KV head)
  const int64_t threads = at::get_num_threads();
  // Few units (small batches) leave threads idle: split each unit's prefix
  // into key ranges attended in parallel and merged by log-sum-exp
  // (flash-decoding), each range at least kMinSplitKeys long.
  constexpr int64_t kMinSplitKeys = 256;
  const int64_t want = units >= 2 * threads ? 1 : (2 * threads + units - 1) / units;
  struct Item {
    int64_t block, head, key_begin, key_end;
    bool last;
  };
  std::vector<Item> items;
  std::vector<int64_t> first_item(units + 1, 0);
  for (int64_t unit = 0; unit < units; ++unit) {
    const int64_t b = unit / s.num_kv_heads, h = unit % s.num_kv_heads;
    const int64_t prefix = in.prefix_lens[b];
    // The window bound is per row; the split only needs a cover.
    const int64_t begin = 0;
    const int64_t splits = std::max<int64_t>(
        1, std::min<int64_t>(want, (prefix - begin) / kMinSplitKeys));
    const int64_t per = round_up((prefix - begin + splits - 1) / splits, kChunkKeys);
    first_item[unit] = static_cast<int64_t>(items.size());
    for (int64_t split = 0; split < splits; ++split) {
      const int64_t lo = begin + split * per;
      const int64_t hi = split + 1 == splits ? prefix : std::min(prefix, lo + per);
      items.push_back({b, h, lo, hi, split + 1 == splits});
    }
  }
  first_item[units] = static_cast<int64_t>(items.size());
  const int64_t num_items = first_item[units];
  std::vector<std::unique_ptr<SoftmaxState<D>>> partial(num_items);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      Queries<scalar_t, D> q(in, item.block, item.head);
      auto state = std::make_unique<SoftmaxState<D>>(q.M, q.M_pad);
      const int64_t lo = std::max(item.key_begin, q.prefix_begin(item.key_end));
      attend_prefix<scalar_t, D>(in, item.block, item.head, q,
                                 lo / kChunkKeys * kChunkKeys, item.key_end, *state);
      // Split design (lse given): the caller attends the block part.
      if (item.last && in.lse == nullptr) attend_block<scalar_t, D>(in, item.block, item.head, q, *state);
      const bool alone = first_item[item.block * s.num_kv_heads + item.head + 1] -
                             first_item[item.block * s.num_kv_heads + item.head] == 1;
      if (alone)
        write_output<scalar_t, D>(in, item.block, item.head, *state);
      else
        partial[i] = std::move(state);
    }
  });
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      if (first_item[unit + 1] - first_item[unit] == 1) continue;
      SoftmaxState<D>& state = *partial[first_item[unit]];
      for (int64_t i = first_item[unit] + 1; i < first_item[unit + 1]; ++i)
        merge_state<D>(state, *partial[i]);
      write_output<scalar_t, D>(in, unit / s.num_kv_heads, unit % s.num_kv_heads, state);
    }
  });
}

void tree_attention(at::Tensor output, const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& kv_cache,
                    const at::Tensor& block_tables, const at::Tensor& row_starts,
                    const at::Tensor& num_rows, const at::Tensor& prefix_lens,
                    const at::Tensor& tree_mask, const at::Tensor& position_offsets,
                    double scale, int64_t sliding_window,
                    const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && output.dim() == 3,
              "tree_attention: query/key/value/output must be [tokens, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.stride(3) == 1 &&
                  kv_cache.stride(2) == kv_cache.size(3),
              "tree_attention: kv_cache must be [blocks, kv_heads, block_size, 2*head_dim] "
              "with contiguous rows");
  const int64_t D = query.size(2);
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 &&
                  output.stride(2) == 1,
              "tree_attention: the head_dim axis must be contiguous");
  TORCH_CHECK(kv_cache.size(3) == 2 * D, "tree_attention: kv_cache head_dim mismatch");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type() &&
                  output.scalar_type() == kv_cache.scalar_type(),
              "tree_attention: query, key, value, output and kv_cache need one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && row_starts.scalar_type() == at::kInt &&
                  num_rows.scalar_type() == at::kInt && prefix_lens.scalar_type() == at::kInt &&
                  position_offsets.scalar_type() == at::kInt,
              "tree_attention: index tensors must be int32");
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool && tree_mask.is_contiguous() &&
                  position_offsets.is_contiguous() && block_tables.stride(1) == 1,
              "tree_attention: bad tree_mask / position_offsets / block_tables layout");
  Shapes s;
  s.num_heads = query.size(1);
  s.num_kv_heads = kv_cache.size(1);
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "tree_attention: heads not a multiple of kv_heads");
  s.head_dim = D;
  s.block_size = kv_cache.size(2);
  s.max_rows = tree_mask.size(1);
  s.q_row_stride = query.stride(0);
  s.q_head_stride = query.stride(1);
  s.k_row_stride = key.stride(0);
  s.k_head_stride = key.stride(1);
  s.v_row_stride = value.stride(0);
  s.v_head_stride = value.stride(1);
  s.o_row_stride = output.stride(0);
  s.o_head_stride = output.stride(1);
  s.cache_block_stride = kv_cache.stride(0);
  s.cache_head_stride = kv_cache.stride(1);
  s.table_stride = block_tables.stride(0);
  s.scale = static_cast<float>(scale);
  s.sliding_window = sliding_window;
  float* lse_ptr = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                    lse->size(0) == query.size(0) && lse->size(1) == s.num_heads,
                "tree_attention: lse must be a contiguous float [tokens, heads]");
    lse_ptr = lse->data_ptr<float>();
  }
  const int64_t num_blocks = row_starts.size(0);
  if (num_blocks == 0) return;
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "tree_attention: only float32 and bfloat16 are supported");
  auto dispatch = [&](auto type_tag, auto head_tag) {
    using scalar_t = decltype(type_tag);
    constexpr int HD = decltype(head_tag)::value;
    Inputs<scalar_t> in{s,
                        output.data_ptr<scalar_t>(),
                        query.data_ptr<scalar_t>(),
                        key.data_ptr<scalar_t>(),
                        value.data_ptr<scalar_t>(),
                        kv_cache.data_ptr<scalar_t>(),
                        block_tables.data_ptr<int32_t>(),
                        row_starts.data_ptr<int32_t>(),
                        num_rows.data_ptr<int32_t>(),
                        prefix_lens.data_ptr<int32_t>(),
                        position_offsets.data_ptr<int32_t>(),
                        tree_mask.data_ptr<bool>(),
                        lse_ptr};
    run<scalar_t, HD>(in, num_blocks);
  };
  const bool is_float = kv_cache.scalar_type() == at::kFloat;
#define ESP_DISPATCH_HEAD(HD)                                                        \
  case HD:                                                                           \
    if (is_float)                                                                    \
      dispatch(float{}, std::integral_constant<int, HD>{});                          \
    else                                                                             \
      dispatch(c10::BFloat16{}, std::integral_constant<int, HD>{});                  \
    break;
  switch (D) {
    ESP_DISPATCH_HEAD(32)
    ESP_DISPATCH_HEAD(64)
    ESP_DISPATCH_HEAD(80)
    ESP_DISPATCH_HEAD(96)
    ESP_DISPATCH_HEAD(112)
    ESP_DISPATCH_HEAD(128)
    ESP_DISPATCH_HEAD(160)
    ESP_DISPATCH_HEAD(192)
    ESP_DISPATCH_HEAD(224)
    ESP_DISPATCH_HEAD(256)
    default:
      TORCH_CHECK(false, "tree_attention: unsupported head_dim ", D,
                  " (supported: vLLM CPU's head sizes up to 256)");
  }
#undef ESP_DISPATCH_HEAD
}

// Copy K/V token slots within vec-layout caches (one per layer): slot
// dst[i] <- slot src[i], in order. The caller orders moves so that no source
// is overwritten before it is read (vllm_esp/runner.py: accepted nodes move
// to lower rows of their own block, in increasing destination order).
void copy_slots(std::vector<at::Tensor> kv_caches, const at::Tensor& src_slots,
                const at::Tensor& dst_slots) {
  TORCH_CHECK(src_slots.scalar_type() == at::kLong && dst_slots.scalar_type() == at::kLong &&
                  src_slots.numel() == dst_slots.numel(),
              "copy_slots: slots must be int64 of equal length");
  const int64_t* src = src_slots.data_ptr<int64_t>();
  const int64_t* dst = dst_slots.data_ptr<int64_t>();
  const int64_t n = src_slots.numel();
  if (n == 0) return;
  at::parallel_for(0, static_cast<int64_t>(kv_caches.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t layer = begin; layer < end; ++layer) {
      const at::Tensor& cache = kv_caches[layer];
      TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
                  "copy_slots: kv cache blocks must be [kv_heads, block_size, 2*head_dim] with contiguous rows");
      const int64_t H = cache.size(1), BS = cache.size(2), D = cache.size(3) / 2;
      const int64_t elem = cache.element_size();
      char* base = static_cast<char*>(cache.data_ptr());
      const int64_t block_stride = cache.stride(0) * elem, head_stride = cache.stride(1) * elem;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t sb = src[i] / BS, so = src[i] % BS, db = dst[i] / BS, dof = dst[i] % BS;
        for (int64_t h = 0; h < H; ++h) {
          char* sbase = base + sb * block_stride + h * head_stride;
          char* dbase = base + db * block_stride + h * head_stride;
          for (int64_t d = 0; d < D; ++d)  // K: column-major, stride BS
            std::memcpy(dbase + (d * BS + dof) * elem, sbase + (d * BS + so) * elem, elem);
          std::memcpy(dbase + (BS * D + dof * D) * elem, sbase + (BS * D + so * D) * elem,
                      D * elem);  // V: one contiguous row
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(vllm_esp, m) {
  m.def(
      "tree_attention(Tensor(a!) output, Tensor query, Tensor key, Tensor value, "
      "Tensor kv_cache, Tensor block_tables, Tensor row_starts, Tensor num_rows, "
      "Tensor prefix_lens, Tensor tree_mask, Tensor position_offsets, float scale, "
      "int sliding_window, Tensor(b!)? lse=None) -> ()");
  m.impl("tree_attention", c10::DispatchKey::CPU, TORCH_FN(tree_attention));
  m.def("copy_slots(Tensor[] kv_caches, Tensor src_slots, Tensor dst_slots) -> ()");
  m.impl("copy_slots", c10::DispatchKey::CPU, TORCH_FN(copy_slots));
}
