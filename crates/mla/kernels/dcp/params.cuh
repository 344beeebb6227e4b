/**
 * @file dcp/params.cuh
 * @brief The one argument of every DCP kernel (decode context parallelism: local lengths and
 * the LSE merge of the ranks' partial outputs), by value.
 *
 * Mirrored field for field by `DcpParams` in `src/dcp/params.rs`; the size is checked on both
 * sides. Self-contained on purpose (no decode header): the DCP family must not move when the
 * decode kernels' parameters do. N = world size, H = heads per rank, HN = H * N.
 */
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

struct DcpParams {
    const int* seq_lens_global;  // [requests]: each request's whole KV length
    int* seq_lens_local;         // [requests]: the keys this rank holds (written)
    const void* part_o;          // [rows, HN, L] model dtype: this rank's attention, contiguous
    const float* part_lse;       // [rows, HN]: this rank's lse (-inf: no local key)
    const float* lse_all;        // [N, rows, HN]: every rank's part_lse (all-gather)
    float* scaled_o;             // [N, rows, H, L] f32: e^(lse_r - lse) * o_r, by owner rank
    const float* summed_o;       // [rows, H, L] f32: the reduce-scatter of scaled_o
    void* packed_o;              // [N, rows, H, L] model dtype: part_o by owner rank (all-to-all)
    float* packed_lse;           // [N, rows, H]: part_lse by owner rank (all-to-all)
    const void* gathered_o;      // [N, rows, H, L] model dtype: what every rank sent us
    const float* gathered_lse;   // [N, rows, H]
    void* o;                     // [rows, H, L] model dtype: the caller's output
    i64 o_row, o_head;           // its strides (elements; multiples of 8)
    float* lse;                  // [rows, H]: the caller's lse
    i64 lse_row;
    int requests, rows;
    int heads;                   // H: heads per rank
    int world;                   // N
    int rank;
    int interleave;              // I: tokens per interleaved chunk
    int kv_lora_rank;            // L: a multiple of 8
    int pad_;
};

static_assert(sizeof(DcpParams) == 160, "DcpParams must match src/dcp/params.rs");
