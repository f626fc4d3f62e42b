// Paged attention over the KV cache, fused, for the CPU (float32 and bfloat16).
//
// pdserve/kernels/paged_attention.py owns the contract; this is a drop-in replacement for its torch
// path. Caches are
// [num_blocks, num_kv_heads, block_size, head_dim], so one block's slice for one kv head is
// a contiguous [block_size, head_dim] tile: the attention reads K/V straight from there
// through the block table and never copies a sequence's context.
//
// Attention math (same semantics as paged_attention_reference): query row j of a sequence
// with query_len q and context L sees positions <= L - q + j. Each work item is one
// (sequence, kv head, tile of query rows); it walks the context in tiles of 16 positions,
// reads each key row in place (bfloat16 keys: exact bf16 products summed in float32 by
// vdpbf16ps where the CPU has it, else converted in registers), converts each value row to
// float32 once for all query heads of the group and rows of the item, and keeps a running max
// and sum per query (online softmax), all in float32. Vector loops: AVX-512 (16 lanes) or
// AVX2 with FMA (8 lanes, a tile in two halves) for head_dim 16, 32, 64 and 128; portable
// loops otherwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// Context positions attended per step: one vector of scores (16 float32 lanes).
constexpr int64_t kTile = 16;
constexpr float kLog2e = 1.4426950408889634f;
// 2^f for |f| <= 0.5: a degree-7 Taylor series, highest coefficient first (Horner's order;
// relative error ~1e-7). Both vector exp2s use it.
constexpr float kExp2Series[] = {1.5252733e-5f, 1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f,
                                 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};

inline float bf16_bits_to_float(uint16_t bits) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16);
}

// Online-softmax state of one query (one row, one head): running max (log2 domain), sum, and
// the unnormalised output accumulator.
struct QueryState {
  const float* q;         // [head_dim] float32, pre-scaled by scale * log2(e)
  const uint16_t* q_raw;  // [head_dim] the bfloat16 input's bits (bfloat16 dot products only)
  float raw_scale;        // scale * log2(e), for scores from q_raw
  float* acc;             // [head_dim]
  float max;
  float sum;
};

// Folds `count` (1..kTile) consecutive visible positions into one query's state: key rows
// k_rows[t] (read in place from the cache) and value rows v_rows[t] (float32).
// scratch holds kTile floats.
template <typename T>
using AttendFn = void (*)(QueryState& s, const T* const* k_rows, const float* const* v_rows, int64_t count,
                          int64_t head_dim, float* scratch);

// Rescales the state to a new running max; the first call (max -inf) zeroes nothing real.
inline void raise_max(QueryState& s, float tile_max, int64_t head_dim) {
  if (tile_max <= s.max) return;
  const float correction = std::exp2(s.max - tile_max);
  s.sum *= correction;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) s.acc[d] *= correction;
  s.max = tile_max;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return bf16_bits_to_float(x.x); }

// Portable version: any head_dim, loops the compiler vectorises.
template <typename T>
void attend_portable(QueryState& s, const T* const* k_rows, const float* const* v_rows, int64_t count,
                     int64_t head_dim, float* scores) {
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < count; ++t) {
    const T* k = k_rows[t];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += s.q[d] * to_float(k[d]);
    scores[t] = dot;
    tile_max = std::max(tile_max, dot);
  }
  raise_max(s, tile_max, head_dim);
  for (int64_t t = 0; t < count; ++t) {
    const float p = std::exp2(scores[t] - s.max);
    const float* v = v_rows[t];
    s.sum += p;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) s.acc[d] += p * v[d];
  }
}

#ifdef __AVX512F__
// 16 elements -> float32 lanes (bfloat16: the bits shifted into a float's high half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// 2^x, x <= 0: 2^round(x) by vscalefps times kExp2Series of 2^f, |f| <= 0.5.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(kExp2Series[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Series[i]));
  return _mm512_scalef_ps(p, k);
}

// r[t] = sum of the lanes of a[t]: a transpose-and-add tree (45 ops instead of 16 reductions).
__attribute__((always_inline)) inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0(0+2), a1(0+2), a0(1+3), a1(1+3)]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit chunk: chunk sums of a[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Add the four 128-bit chunks of each quad: two rounds of chunk shuffles.
  const auto halve = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  return halve(halve(quads[0], quads[1]), halve(quads[2], quads[3]));
}

// Lane t: the query's log2-domain score against key row t (t < count); other lanes are junk.
template <int NV, typename T>  // head_dim == 16 * NV
inline __m512 scores16(const QueryState& s, const T* const* k_rows, int64_t count) {
  __m512 partial[16];
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16> && NV % 2 == 0) {
    // bfloat16 pairs multiplied exactly and accumulated in float32: no conversion at all.
    __m512bh q[NV / 2];
    for (int c = 0; c < NV / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(s.q_raw + 32 * c);
    for (int64_t t = 0; t < 16; ++t) {
      partial[t] = _mm512_setzero_ps();
      if (t >= count) continue;
      for (int c = 0; c < NV / 2; ++c)
        partial[t] = _mm512_dpbf16_ps(partial[t], q[c], (__m512bh)_mm512_loadu_si512(k_rows[t] + 32 * c));
    }
    return _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(s.raw_scale));
  }
#endif
  __m512 q[NV];
  for (int c = 0; c < NV; ++c) q[c] = _mm512_loadu_ps(s.q + 16 * c);
  for (int64_t t = 0; t < 16; ++t) {
    partial[t] = _mm512_setzero_ps();
    if (t >= count) continue;
    for (int c = 0; c < NV; ++c) partial[t] = _mm512_fmadd_ps(q[c], load16(k_rows[t] + 16 * c), partial[t]);
  }
  return sum_lanes16(partial);
}

template <int NV, typename T>  // head_dim == 16 * NV
void attend_avx512(QueryState& s, const T* const* k_rows, const float* const* v_rows, int64_t count, int64_t,
                   float* probs) {
  const __mmask16 visible = static_cast<__mmask16>((1u << count) - 1);
  const __m512 scores = scores16<NV>(s, k_rows, count);
  raise_max(s, _mm512_mask_reduce_max_ps(visible, scores), 16 * NV);
  const __m512 p = _mm512_maskz_mov_ps(visible, exp2_ps(_mm512_sub_ps(scores, _mm512_set1_ps(s.max))));
  s.sum += _mm512_reduce_add_ps(p);
  _mm512_storeu_ps(probs, p);
  __m512 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = _mm512_loadu_ps(s.acc + 16 * c);
  for (int64_t t = 0; t < count; ++t) {
    const __m512 pt = _mm512_set1_ps(probs[t]);
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v_rows[t] + 16 * c), acc[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s.acc + 16 * c, acc[c]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The same loops on 8 lanes: a tile of kTile positions is attended in halves of 8.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

// 2^x, x <= 0: 2^round(x) put into the exponent bits times kExp2Series of 2^f, |f| <= 0.5.
// Clamped at -126 (the smallest normal exponent): a weight of 2^-126 or less against the
// running max's 1 is below float32's precision in every sum it joins.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, k);
  __m256 p = _mm256_set1_ps(kExp2Series[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Series[i]));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

// r[t] = sum of the lanes of a[t]: pairwise horizontal adds, then the two 128-bit halves.
__attribute__((always_inline)) inline __m256 sum_lanes8(const __m256 (&a)[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 low4 = _mm256_hadd_ps(s01, s23), high4 = _mm256_hadd_ps(s45, s67);  // per half: a0..a3, a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20), _mm256_permute2f128_ps(low4, high4, 0x31));
}

inline float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Folds `count` (1..8) consecutive visible positions into the state.
template <int NV, typename T>  // head_dim == 8 * NV
inline void attend8(QueryState& s, const T* const* k_rows, const float* const* v_rows, int64_t count, float* probs) {
  __m256 q[NV], partial[8];
  for (int c = 0; c < NV; ++c) q[c] = _mm256_loadu_ps(s.q + 8 * c);
  for (int64_t t = 0; t < 8; ++t) {
    partial[t] = _mm256_setzero_ps();
    if (t >= count) continue;
    for (int c = 0; c < NV; ++c) partial[t] = _mm256_fmadd_ps(q[c], load8(k_rows[t] + 8 * c), partial[t]);
  }
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 visible = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(count)), _CMP_LT_OQ);
  const __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                         sum_lanes8(partial), visible);
  raise_max(s, reduce_max8(scores), 8 * NV);
  const __m256 p = _mm256_and_ps(visible, exp2_ps(_mm256_sub_ps(scores, _mm256_set1_ps(s.max))));
  s.sum += reduce_add8(p);
  _mm256_storeu_ps(probs, p);
  __m256 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = _mm256_loadu_ps(s.acc + 8 * c);
  for (int64_t t = 0; t < count; ++t) {
    const __m256 pt = _mm256_set1_ps(probs[t]);
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v_rows[t] + 8 * c), acc[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(s.acc + 8 * c, acc[c]);
}

template <int NV, typename T>  // head_dim == 8 * NV
void attend_avx2(QueryState& s, const T* const* k_rows, const float* const* v_rows, int64_t count, int64_t,
                 float* probs) {
  for (int64_t begin = 0; begin < count; begin += 8)
    attend8<NV>(s, k_rows + begin, v_rows + begin, std::min<int64_t>(8, count - begin), probs);
}
#endif

template <typename T>
AttendFn<T> pick_attend(int64_t head_dim) {
#ifdef __AVX512F__
  switch (head_dim) {
    case 16: return attend_avx512<1, T>;
    case 32: return attend_avx512<2, T>;
    case 64: return attend_avx512<4, T>;
    case 128: return attend_avx512<8, T>;
    default: break;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (head_dim) {
    case 16: return attend_avx2<2, T>;
    case 32: return attend_avx2<4, T>;
    case 64: return attend_avx2<8, T>;
    case 128: return attend_avx2<16, T>;
    default: break;
  }
#endif
  return attend_portable<T>;
}

// The lanes of the vector loops this build attends rows of head_dim with: 16 (AVX-512), 8
// (AVX2), or 0 (the portable loops).
int64_t attention_lanes(int64_t head_dim) {
  if (pick_attend<float>(head_dim) == attend_portable<float>) return 0;
#ifdef __AVX512F__
  return 16;
#else
  return 8;
#endif
}

// One unit of parallel work: query rows [row_begin, row_end) of sequence seq, kv head kv_head.
struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t row_begin;
  int64_t row_end;
  int64_t cost;  // ~ scores computed, to start the heavy items first
};

struct Shapes {
  int64_t num_heads, num_kv_heads, block_size, head_dim, group, max_blocks;
  int64_t q_token_stride, q_head_stride;
};

struct Pointers {
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
};

// rows[t] = where context position begin + t of one kv head lives in the cache, t < end - begin.
template <typename T>
void row_pointers(const T* cache, const int32_t* table, int64_t kv_head, int64_t begin, int64_t end,
                  const Shapes& sh, const T** rows) {
  if (begin >= end) return;  // past the context: the table may end here
  int64_t block_idx = begin / sh.block_size, offset = begin % sh.block_size;  // one division per tile
  const int64_t block = table[block_idx];
  const T* row = cache + ((block * sh.num_kv_heads + kv_head) * sh.block_size + offset) * sh.head_dim;
  for (int64_t t = 0; t < end - begin; ++t) {
    if (offset == sh.block_size) {
      offset = 0;
      const int64_t block = table[++block_idx];
      row = cache + (block * sh.num_kv_heads + kv_head) * sh.block_size * sh.head_dim;
    }
    rows[t] = row;
    row += sh.head_dim;
    ++offset;
  }
}

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < head_dim * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

// Per-thread buffers of one work item, float32: queries, accumulators, one value tile.
struct Scratch {
  std::vector<float> q, acc, v_tile, probs;
  std::vector<QueryState> states;
};

// Where one work item's rows live: tokens first_token.. of the packed batch, context positions
// row0_pos.. of the sequence (row r sees positions <= row0_pos + r).
struct ItemRows {
  int64_t first_token, row0_pos, num_rows;
};

template <typename T>
void load_queries(const WorkItem& item, const ItemRows& rows, const T* query, const Shapes& sh, float scale,
                  Scratch& buf) {
  const int64_t D = sh.head_dim, num_queries = rows.num_rows * sh.group;
  buf.q.resize(num_queries * D);
  buf.acc.assign(num_queries * D, 0.0f);
  buf.v_tile.resize(kTile * D);
  buf.probs.resize(kTile);
  buf.states.resize(num_queries);
  for (int64_t i = 0; i < num_queries; ++i) {  // i = row * group + head within the group
    const int64_t head = item.kv_head * sh.group + i % sh.group;
    const T* src = query + (rows.first_token + i / sh.group) * sh.q_token_stride + head * sh.q_head_stride;
    float* q = buf.q.data() + i * D;
    for (int64_t d = 0; d < D; ++d) q[d] = to_float(src[d]) * (scale * kLog2e);
    buf.states[i] = {q, reinterpret_cast<const uint16_t*>(src), scale * kLog2e, buf.acc.data() + i * D,
                     -std::numeric_limits<float>::infinity(), 0.0f};
  }
}

// Walks the item's context in tiles of kTile positions; each tile's K/V rows are prefetched
// while the previous tile is attended (the blocks are scattered: no hardware prefetcher
// guesses the next one).
template <typename T>
void attend_context(const WorkItem& item, const ItemRows& rows, const T* k_cache, const T* v_cache,
                    const int32_t* table, const Shapes& sh, AttendFn<T> attend, Scratch& buf) {
  const int64_t D = sh.head_dim, num_queries = rows.num_rows * sh.group;
  const int64_t context_end = rows.row0_pos + rows.num_rows;  // exclusive, for the last row
  const T* k_rows[2][kTile];
  const T* v_rows_in[2][kTile];
  const float* v_rows[kTile];
  row_pointers(k_cache, table, item.kv_head, 0, std::min(kTile, context_end), sh, k_rows[0]);
  row_pointers(v_cache, table, item.kv_head, 0, std::min(kTile, context_end), sh, v_rows_in[0]);
  for (int64_t begin = 0, cur = 0; begin < context_end; begin += kTile, cur ^= 1) {
    const int64_t end = std::min(begin + kTile, context_end), next_end = std::min(end + kTile, context_end);
    row_pointers(k_cache, table, item.kv_head, end, next_end, sh, k_rows[cur ^ 1]);
    row_pointers(v_cache, table, item.kv_head, end, next_end, sh, v_rows_in[cur ^ 1]);
    for (int64_t t = 0; t < next_end - end; ++t) {
      prefetch_row(k_rows[cur ^ 1][t], D);
      prefetch_row(v_rows_in[cur ^ 1][t], D);
    }
    for (int64_t t = 0; t < end - begin; ++t) {
      if constexpr (std::is_same_v<T, float>) {
        v_rows[t] = v_rows_in[cur][t];
      } else {  // converted once here, used by every query of the item
        float* row = buf.v_tile.data() + t * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(v_rows_in[cur][t][d]);
        v_rows[t] = row;
      }
    }
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t visible = std::min(end, rows.row0_pos + i / sh.group + 1) - begin;  // causal
      if (visible > 0) attend(buf.states[i], k_rows[cur], v_rows, visible, D, buf.probs.data());
    }
  }
}

template <typename T>
void run_item(const WorkItem& item, const T* query, const T* k_cache, const T* v_cache, T* out, const Pointers& ptr,
              const Shapes& sh, float scale, AttendFn<T> attend, Scratch& buf) {
  const int64_t D = sh.head_dim, group = sh.group;
  const int64_t query_len = ptr.query_start_loc[item.seq + 1] - ptr.query_start_loc[item.seq];
  const ItemRows rows{ptr.query_start_loc[item.seq] + item.row_begin,
                      ptr.seq_lens[item.seq] - query_len + item.row_begin, item.row_end - item.row_begin};
  load_queries(item, rows, query, sh, scale, buf);
  attend_context(item, rows, k_cache, v_cache, ptr.block_tables + item.seq * sh.max_blocks, sh, attend, buf);
  for (int64_t i = 0; i < rows.num_rows * group; ++i) {
    const float inv_sum = 1.0f / buf.states[i].sum;
    T* dst = out + ((rows.first_token + i / group) * sh.num_heads + item.kv_head * group + i % group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(buf.acc[i * D + d] * inv_sum);
  }
}

// Whether the caller attends this sequence itself (with SDPA): a chunk of at least
// sdpa_min_chunk tokens that also reads earlier context, or a whole prompt (no earlier context)
// of at least sdpa_min_prompt tokens. The Python side applies the same rule (SdpaSplit).
inline bool left_to_caller(int64_t query_len, int64_t seq_len, int64_t sdpa_min_chunk, int64_t sdpa_min_prompt) {
  return query_len >= (seq_len > query_len ? sdpa_min_chunk : sdpa_min_prompt);
}

// Work items for every sequence not left to the caller; the rows of a sequence are split into
// tiles of at most row_tile rows.
std::vector<WorkItem> make_work(const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_seqs,
                                int64_t num_kv_heads, int64_t sdpa_min_chunk, int64_t sdpa_min_prompt,
                                int64_t row_tile) {
  std::vector<WorkItem> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    if (query_len == 0 || left_to_caller(query_len, seq_lens[seq], sdpa_min_chunk, sdpa_min_prompt)) continue;
    const int64_t row0_pos = seq_lens[seq] - query_len;
    for (int64_t row = 0; row < query_len; row += row_tile) {
      const int64_t row_end = std::min(query_len, row + row_tile);
      const int64_t cost = (row_end - row) * (row0_pos + row_end);
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({seq, h, row, row_end, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void attend_all(const std::vector<WorkItem>& items, const at::Tensor& query, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& out, const Pointers& ptr, const Shapes& sh, float scale) {
  const T* q = query.const_data_ptr<T>();
  const T* k = k_cache.const_data_ptr<T>();
  const T* v = v_cache.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const AttendFn<T> attend = pick_attend<T>(sh.head_dim);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch buf;
    // Items differ in cost (prefill tiles, long contexts); dynamic scheduling balances them.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run_item(items[i], q, k, v, o, ptr, sh, scale, attend, buf);
  }
}

// The kernel trusts the metadata with raw pointers: check every length and used block id.
void check_metadata(const Pointers& ptr, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks, const Shapes& sh) {
  TORCH_CHECK(ptr.query_start_loc[0] == 0 && ptr.query_start_loc[num_seqs] == num_tokens,
              "query_start_loc must run from 0 to num_tokens");
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = ptr.query_start_loc[seq + 1] - ptr.query_start_loc[seq], seq_len = ptr.seq_lens[seq];
    TORCH_CHECK(query_len >= 0 && query_len <= seq_len, "sequence ", seq, ": query_len ", query_len,
                " outside [0, seq_len ", seq_len, "]");
    const int64_t blocks = (seq_len + sh.block_size - 1) / sh.block_size;
    TORCH_CHECK(blocks <= sh.max_blocks, "sequence ", seq, ": seq_len ", seq_len, " exceeds its block table");
    const int32_t* table = ptr.block_tables + seq * sh.max_blocks;
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", seq, ": block id ", table[b], " out of range");
  }
}

}  // namespace

// Attention for every sequence not left to the caller (see left_to_caller), written into out
// (allocated by the caller [num_tokens, num_heads, head_dim], contiguous); other rows are untouched.
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& out, double scale, int64_t sdpa_min_chunk, int64_t sdpa_min_prompt,
                     int64_t row_tile) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && query.stride(2) == 1);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt);
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.is_contiguous());
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0));
  TORCH_CHECK(row_tile > 0);
  const Shapes sh{query.size(1),      k_cache.size(1), k_cache.size(2),  k_cache.size(3),
                  query.size(1) / k_cache.size(1),     block_tables.size(1),
                  query.stride(0),    query.stride(1)};
  TORCH_CHECK(sh.num_heads % sh.num_kv_heads == 0 && query.size(2) == sh.head_dim);
  const Pointers ptr{block_tables.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int32_t>(),
                     query_start_loc.const_data_ptr<int32_t>()};
  check_metadata(ptr, seq_lens.size(0), query.size(0), k_cache.size(0), sh);
  const auto items =
      make_work(ptr.seq_lens, ptr.query_start_loc, seq_lens.size(0), sh.num_kv_heads, sdpa_min_chunk,
                sdpa_min_prompt, row_tile);
  const float fscale = static_cast<float>(scale);
  if (query.scalar_type() == at::kFloat) {
    attend_all<float>(items, query, k_cache, v_cache, out, ptr, sh, fscale);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16, "paged_attention: float32 and bfloat16 only");
    attend_all<at::BFloat16>(items, query, k_cache, v_cache, out, ptr, sh, fscale);
  }
}

// The library's one TORCH_LIBRARY block; cache_write.cpp adds its op as a fragment.
TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor(a!) out, float scale, int sdpa_min_chunk, int sdpa_min_prompt, "
      "int row_tile) -> ()");
  // The SDPA split depends on it (pdserve/kernels/paged_attention.py `SdpaSplit.for_kernel`).
  m.def("attention_lanes(int head_dim) -> int", &attention_lanes);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
