//! The `#[repr(C)]` twin of `kernels/dcp/params.cuh`'s `DcpParams`: the one argument of every
//! DCP kernel. Sizes are checked on both sides (a `static_assert` there, a test here).

/// See `kernels/dcp/params.cuh` for each field's meaning and shape. Unused pointers are 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DcpParams {
    pub seq_lens_global: u64,
    pub seq_lens_local: u64,
    pub part_o: u64,
    pub part_lse: u64,
    pub lse_all: u64,
    pub scaled_o: u64,
    pub summed_o: u64,
    pub packed_o: u64,
    pub packed_lse: u64,
    pub gathered_o: u64,
    pub gathered_lse: u64,
    pub o: u64,
    pub o_row: i64,
    pub o_head: i64,
    pub lse: u64,
    pub lse_row: i64,
    pub requests: i32,
    pub rows: i32,
    pub heads: i32,
    pub world: i32,
    pub rank: i32,
    pub interleave: i32,
    pub kv_lora_rank: i32,
    pub pad_: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_cuda_header() {
        let header = include_str!("../../kernels/dcp/params.cuh");
        assert!(header.contains("sizeof(DcpParams) == 160"));
        assert_eq!(std::mem::size_of::<DcpParams>(), 160);
        assert_eq!(std::mem::offset_of!(DcpParams, o_row), 96);
        assert_eq!(std::mem::offset_of!(DcpParams, lse), 112);
        assert_eq!(std::mem::offset_of!(DcpParams, requests), 128);
        assert_eq!(std::mem::offset_of!(DcpParams, kv_lora_rank), 152);
    }
}
