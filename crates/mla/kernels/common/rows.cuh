/**
 * @file rows.cuh
 * @brief Which keys a query row sees and which of them a split covers: the contract of
 * docs/contract.md ("Which keys a row sees", "Split-KV"), computed per row on the device so
 * that a captured graph stays right when seq_lens change between replays.
 */
#pragma once
#include "params.cuh"

struct KeyRange {
    int start, end;  // [start, end)
};

__device__ __forceinline__ void raise_error(const DecodeParams& p, u32 bits) {
    atomicOr(p.error_flag, bits);
}

/// A per-tensor scale: the device tensor's (`ptr`) when there is one (with `check`, a value
/// not finite and positive raises its error bit: the kernels fold it into the score scale
/// and need it positive), else the host's `value` (the plan checked it).
__device__ __forceinline__ float read_scale(const DecodeParams& p, const float* ptr, float value, bool check) {
    if (ptr == nullptr) return value;
    const float k = *ptr;
    if (check && !(k > 0.0f && k <= 3.40282347e38f)) raise_error(p, MLA_ERR_BAD_SCALE);
    return k;
}

/// An fp8 cache's k_scale (read_scale).
__device__ __forceinline__ float read_k_scale(const DecodeParams& p, bool check) {
    return read_scale(p, p.k_scale_ptr, p.k_scale, check);
}

/// The fp8-query mode's q_scale (read_scale).
__device__ __forceinline__ float read_q_scale(const DecodeParams& p, bool check) {
    return read_scale(p, p.q_scale_ptr, p.q_scale, check);
}

/// The KV length of `request` (a negative one read as 0). With `check`, a negative length
/// and a length beyond the block table raise their error bits.
__device__ __forceinline__ int request_len(const DecodeParams& p, int request, bool check) {
    int len = p.seq_lens[request];
    if (len < 0) {
        if (check) raise_error(p, MLA_ERR_NEGATIVE_LEN);
        len = 0;
    }
    if (check && (long long)len > (long long)p.max_blocks * p.page_size) {
        raise_error(p, MLA_ERR_BEYOND_TABLE);
    }
    return len;
}

/// Keys of query token `token` of a request of KV length `len`.
__device__ __forceinline__ KeyRange token_keys(const DecodeParams& p, int len, int token) {
    const int end = p.causal ? max(0, len - (p.query_len - 1 - token)) : len;
    const int start = p.window > 0 ? max(0, end - p.window) : 0;
    return {start, end};
}

/// Keys of query row `row`: request row / Q, token row % Q (`check` as for request_len).
__device__ __forceinline__ KeyRange row_keys(const DecodeParams& p, int row, bool check) {
    const int request = row / p.query_len;
    return token_keys(p, request_len(p, request, check), row - request * p.query_len);
}

/// 16-byte piece `k` (8 elements) of the query of row `row`, head `head`: the latent part's
/// L / 8 pieces, then the rotary part's (q_nope and q_rope may be one tensor or two).
template <int L>
__device__ __forceinline__ const u16* q_piece(const DecodeParams& p, int row, int head, int k) {
    return k < L / 8 ? (const u16*)p.q_nope + row * p.q_nope_row + head * p.q_nope_head + k * 8
                     : (const u16*)p.q_rope + row * p.q_rope_row + head * p.q_rope_head + (k - L / 8) * 8;
}

/// Keys of each split of `splits` (the last may hold fewer): per = ceil(len / splits).
__device__ __forceinline__ int split_len(KeyRange k, int splits) {
    return (k.end - k.start + splits - 1) / splits;
}

/// Split `s` of keys `k` cut into splits of `per` keys (split_len): [start + s * per, ...)
/// clipped. For a kernel that visits many splits of one row (the division once).
__device__ __forceinline__ KeyRange split_at(KeyRange k, int s, int per) {
    const int start = min(k.start + s * per, k.end);
    return {start, min(start + per, k.end)};
}

/// Split `s` of `splits`: per = ceil(len / splits), keys [start + s * per, ...) clipped.
__device__ __forceinline__ KeyRange split_keys(KeyRange k, int s, int splits) {
    return split_at(k, s, split_len(k, splits));
}

/// Where a CTA that packs query tokens tok0 .. tok0 + tokens of one request (KV length `len`)
/// reads split `s` of `splits`: the union of the tokens' split ranges (`keys`, empty when none
/// has a key there) and the keys every token sees (`common`: a tile inside it needs no
/// per-row mask). From the per-row rules above, so each row still sees exactly its keys and
/// the combine finds the same splits.
struct TokensKeys {
    KeyRange keys, common;
};

__device__ __forceinline__ TokensKeys tokens_keys(const DecodeParams& p, int len, int tok0, int tokens, int s,
                                                  int splits) {
    TokensKeys k{{0x7fffffff, 0}, {0, 0x7fffffff}};
    for (int t = tok0; t < tok0 + tokens; ++t) {
        const KeyRange r = split_keys(token_keys(p, len, t), s, splits);
        if (r.start < r.end) {
            k.keys.start = min(k.keys.start, r.start);
            k.keys.end = max(k.keys.end, r.end);
        }
        k.common.start = max(k.common.start, r.start);
        k.common.end = min(k.common.end, r.end);
    }
    return k;
}
