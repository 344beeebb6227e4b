//! The `#[repr(C)]` twin of `kernels/params.cuh`, filled from a plan and passed by value to
//! every decode kernel. Field order and types match the CUDA struct exactly; the size is
//! asserted on both sides (here by the test below).

use crate::plan::DecodePlan;

/// See `kernels/params.cuh` for each field's meaning and shape.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeParams {
    pub q_nope: u64,
    pub q_rope: u64,
    pub q_nope_row: i64,
    pub q_nope_head: i64,
    pub q_rope_row: i64,
    pub q_rope_head: i64,
    pub kv: u64,
    pub page_stride: i64,
    pub token_stride: i64,
    pub block_table: u64,
    pub block_table_stride: i64,
    pub seq_lens: u64,
    pub o: u64,
    pub o_row: i64,
    pub o_head: i64,
    pub lse: u64,
    pub lse_row: i64,
    pub part_o: u64,
    pub part_lse: u64,
    pub error_flag: u64,
    pub num_blocks: i32,
    pub page_size: i32,
    pub max_blocks: i32,
    pub rows: i32,
    pub query_len: i32,
    pub heads: i32,
    pub num_kv_splits: i32,
    pub causal: i32,
    pub window: i32,
    pub scale_log2: f32,
    pub k_scale: f32,
    pub tokens_per_cta: i32,
    pub k_scale_ptr: u64,
    pub q_scale_ptr: u64,
    pub q_scale: f32,
    pub _pad: i32,
}

/// Device addresses of one decode's tensors (first elements).
#[derive(Debug, Clone, Copy)]
pub struct Pointers {
    pub q_nope: u64,
    pub q_rope: u64,
    pub kv: u64,
    pub block_table: u64,
    pub seq_lens: u64,
    pub o: u64,
    pub lse: u64,
    pub workspace: u64,
    pub error_flag: u64,
    /// The device f32 holding k_scale, or 0.
    pub k_scale: u64,
    /// The device f32 holding the fp8-query mode's q_scale, or 0.
    pub q_scale: u64,
}

impl DecodeParams {
    /// The parameters of a planned decode whose stage-1 CTAs take `tokens_per_cta` query
    /// tokens of a request. Sizes were bounded by the plan's checks; the conversions to i32
    /// saturate rather than wrap as a last guard.
    pub fn new(plan: &DecodePlan, ptr: &Pointers, tokens_per_cta: usize) -> Self {
        let i = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
        let s = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
        let [ws_o, ws_lse] = plan.workspace;
        let rope_offset = if plan.q.packed {
            2 * plan.kv_lora_rank as u64
        } else {
            0
        };
        DecodeParams {
            q_nope: ptr.q_nope,
            q_rope: ptr.q_rope + rope_offset,
            q_nope_row: s(plan.q.nope_strides[0]),
            q_nope_head: s(plan.q.nope_strides[1]),
            q_rope_row: s(plan.q.rope_strides[0]),
            q_rope_head: s(plan.q.rope_strides[1]),
            kv: ptr.kv,
            page_stride: s(plan.kv.page_stride),
            token_stride: s(plan.kv.token_stride),
            block_table: ptr.block_table,
            block_table_stride: s(plan.block_table_stride),
            seq_lens: ptr.seq_lens,
            o: ptr.o,
            o_row: s(plan.o_strides[0]),
            o_head: s(plan.o_strides[1]),
            lse: ptr.lse,
            lse_row: s(plan.lse_stride),
            part_o: ptr.workspace + ws_o.offset as u64,
            part_lse: ptr.workspace + ws_lse.offset as u64,
            error_flag: ptr.error_flag,
            num_blocks: i(plan.kv.num_blocks),
            page_size: i(plan.kv.page_size),
            max_blocks: i(plan.max_blocks),
            rows: i(plan.rows),
            query_len: i(plan.query_len),
            heads: i(plan.heads),
            num_kv_splits: i(plan.num_kv_splits),
            causal: (plan.mask == crate::plan::Mask::Causal) as i32,
            window: plan.window.map_or(0, i),
            scale_log2: plan.scale * std::f32::consts::LOG2_E,
            k_scale: plan.k_scale,
            tokens_per_cta: i(tokens_per_cta),
            k_scale_ptr: ptr.k_scale,
            q_scale_ptr: ptr.q_scale,
            q_scale: plan.q_scale,
            _pad: 0,
        }
    }
}

/// The driver's tensor map of the cache (`CUtensorMap`: 128 opaque bytes, 64-byte aligned),
/// built by `tma::MapShape::encode`.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorMap(pub [u64; 16]);

/// The argument of the stage-1 kernels that copy the keys by TMA, the narrow and the seesaw
/// kernels (`struct TmaParams` in `kernels/common/tma.cuh`): the decode's parameters, then
/// the cache's tensor map at the next 64-byte boundary.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TmaParams {
    pub d: DecodeParams,
    pub kv_map: TensorMap,
}

/// The argument of the scheduled variant of a stage-1 kernel that copies the keys by TMA (the
/// seesaw kernel; `struct TmaScheduleParams` in `kernels/common/tma.cuh`): the schedule's
/// parameters, then the cache's tensor map at the next 64-byte boundary.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TmaScheduleParams {
    pub s: ScheduleParams,
    pub kv_map: TensorMap,
}

/// The argument of the scheduler kernel and of the scheduled stage-1 and combine kernels
/// (`struct ScheduleParams` in `kernels/params.cuh`): the decode's parameters, the schedule's
/// shape and where its i32 arrays go.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ScheduleParams {
    pub d: DecodeParams,
    pub head_blocks: i32,
    pub ctas: i32,
    pub segment_cost: i32,
    pub min_blocks: i32,
    pub jobs: i32,
    pub job_rows: i32,
    pub line: u64,
    pub begin: u64,
    pub first_cta: u64,
    pub splits: u64,
    pub first_slot: u64,
    pub share: u64,
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn layout_matches_params_cuh() {
        // static_assert(sizeof(DecodeParams) == 232) in kernels/params.cuh.
        assert_eq!(size_of::<DecodeParams>(), 232);
        assert_eq!(offset_of!(DecodeParams, kv), 48);
        assert_eq!(offset_of!(DecodeParams, error_flag), 152);
        assert_eq!(offset_of!(DecodeParams, num_blocks), 160);
        assert_eq!(offset_of!(DecodeParams, scale_log2), 196);
        assert_eq!(offset_of!(DecodeParams, k_scale), 200);
        assert_eq!(offset_of!(DecodeParams, tokens_per_cta), 204);
        assert_eq!(offset_of!(DecodeParams, k_scale_ptr), 208);
        assert_eq!(offset_of!(DecodeParams, q_scale_ptr), 216);
        assert_eq!(offset_of!(DecodeParams, q_scale), 224);
    }

    #[test]
    fn schedule_layout_matches_the_kernel() {
        // static_assert(sizeof(ScheduleParams) == 304) in kernels/params.cuh.
        assert_eq!(size_of::<ScheduleParams>(), 304);
        assert_eq!(offset_of!(ScheduleParams, head_blocks), 232);
        assert_eq!(offset_of!(ScheduleParams, line), 256);
        assert_eq!(offset_of!(ScheduleParams, share), 296);
    }

    #[test]
    fn tma_params_layout_matches_the_kernels() {
        // static_assert(sizeof(TmaParams) == 384) in kernels/common/tma.cuh.
        assert_eq!(size_of::<TmaParams>(), 384);
        assert_eq!(offset_of!(TmaParams, kv_map), 256);
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
        // static_assert(sizeof(TmaScheduleParams) == 384 + 64) in kernels/common/tma.cuh.
        assert_eq!(size_of::<TmaScheduleParams>(), 448);
        assert_eq!(offset_of!(TmaScheduleParams, kv_map), 320);
    }
}
