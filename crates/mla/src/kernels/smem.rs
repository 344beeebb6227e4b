//! Dynamic shared memory of each stage-1 variant, laid out as its kernel lays it out. Each
//! kernel exports the same number as `mla_decode_smem_bytes`, and loading a kernel checks
//! that the two agree.

use super::family::Family;
use super::variant::{Grid, MMA_TILE_KEYS, QueryMode, Rows, Variant, WGMMA_ROWS};

/// Bytes of one chunk of the narrow kernel's ring: 128 bytes of each of a tile's 64 keys.
pub(crate) const NARROW_CHUNK: usize = 8192;

impl Variant {
    /// The narrow kernel's chunks of a tile (its `CHUNKS`): 128 bytes of each key row, 64
    /// 16-bit elements or 128 fp8 codes (the last fp8 chunk half past the 576-code row).
    pub(crate) fn narrow_chunks(&self) -> usize {
        let d = self.kv_lora_rank + self.rope_dim;
        if self.fp8() { d.div_ceil(128) } else { d / 64 }
    }

    /// Dynamic shared memory per CTA (0 for the combine and the scheduler, whose shared
    /// memory is static or set at launch).
    pub(crate) fn smem_bytes(&self) -> usize {
        let t = WGMMA_ROWS;
        let d = self.kv_lora_rank + self.rope_dim;
        match self.family {
            Family::Combine | Family::Schedule => 0,
            Family::DecodeWgmma => {
                // 1024 bytes of alignment slack, q (64 x D), two stages (swizzled 16-bit
                // tiles, or raw fp8 rows plus the converted tile), P (64 x 64), two tiles of
                // key offsets, three rows of 64 floats. The fp8-query mode keeps q as e4m3
                // codes (the 16-bit q lands in the converted tile first).
                let tile = t * d * 2;
                let (stage, converted) = if self.fp8() { (t * d, tile) } else { (tile, 0) };
                let q = if self.query == QueryMode::Fp8 {
                    t * d
                } else {
                    tile
                };
                1024 + q + 2 * stage + converted + t * t * 2 + 2 * t * 8 + 3 * t * 4
            }
            Family::DecodeSeesaw => {
                // 1024 bytes of alignment slack, q and two stages (64 x D each; P0 takes the
                // first stage's rotary chunk), P1 (64 x 64), five rows of 64 floats (the
                // running max, two rescales, two row sums), and mbarriers: one a chunk of each
                // stage, one for each of the four hand-overs between the warpgroups and one for
                // the row sums' exchange at the end; packed, each row's keys and the keys every
                // row sees (two i32 each); scheduled, the piece's job, slot and splits.
                let ranges = match (self.rows, self.grid) {
                    (Rows::PackedTokens, _) => (t + 1) * 8,
                    (Rows::OneToken, Grid::Scheduled) => 16,
                    (Rows::OneToken, Grid::Split) => 0,
                };
                1024 + 3 * t * d * 2 + t * t * 2 + 5 * t * 4 + (2 * (d / 64) + 5) * 8 + ranges
            }
            Family::DecodeWgmmaFp8 => {
                // 1024 bytes of alignment slack, q (64 x D, 16-bit), P^T (64 x 64, 16-bit) a
                // buffer, the ring of raw tiles (64 keys of D codes, rows padded by 16 bytes),
                // a tile of key offsets a stage, the four warps' column maxima and a row of 64
                // floats (the rescale factors) a buffer, a row of the final maxima, and the
                // mbarriers. Buffers: one under a 16-bit query, two in the fp8-query mode (its
                // lag schedule: 6 + 2 stages mbarriers, else one).
                let (bufs, bars) = match self.query {
                    QueryMode::Fp8 => (2, 6 + 2 * self.stages),
                    QueryMode::Model => (1, 1),
                };
                1024 + t * d * 2
                    + bufs * t * t * 2
                    + self.stages * t * (d + 16)
                    + self.stages * t * 8
                    + bufs * 4 * t * 4
                    + (bufs + 1) * t * 4
                    + 8 * bars
            }
            Family::DecodeNarrow => {
                // 1024 bytes of alignment slack, the ring of chunks (8 KB: 128 bytes of each of
                // a tile's 64 keys; fp8's codes as the products take them), q (N x D 16-bit,
                // or fp8's two e4m3 terms, 2N rows of whole chunks), for each of the two
                // consumer warpgroups P^T (N x 64, 16-bit or two e4m3 terms) and 4 x N column
                // maxima, fp8: N floats (each column's q scale); two mbarriers a slot.
                let n = 16 * self.row_warps;
                let (q, scales) = if self.fp8() {
                    (2 * n * 128 * self.narrow_chunks(), 4 * n)
                } else {
                    (n * d * 2, 0)
                };
                1024 + self.stages * NARROW_CHUNK
                    + q
                    + 2 * (n * 128 + 16 * n)
                    + scales
                    + 16 * self.stages
            }
            Family::DecodeMma => {
                // q (rows x D, padded by 8 elements), the ring (fp8: raw codes, rows padded
                // by 16 bytes, converted in registers by the products), P (rows x (BN + 8)),
                // the row groups' reduction, a tile of key offsets a stage.
                let (rows, bn) = (16 * self.row_warps, MMA_TILE_KEYS);
                let dp = d + 8;
                let stage_row = if self.fp8() { d + 16 } else { dp * 2 };
                rows * dp * 2
                    + self.stages * bn * stage_row
                    + rows * (bn + 8) * 2
                    + self.row_warps * 4 * 16 * 4
                    + self.stages * bn * 8
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::select::{
        KernelShape, mma_variant, narrow_variant, seesaw_variant, wgmma_fp8_variant, wgmma_variant,
    };
    use crate::dtype::{KvFormat, ModelDtype};

    fn bf16(kv: KvFormat) -> KernelShape {
        KernelShape::deepseek(ModelDtype::Bf16, kv)
    }

    #[test]
    fn the_mma_and_fp8_twin_layouts_match_the_kernels_by_hand() {
        // bf16 cache, 64 rows on an H200: q 64 x 584 x 2, four 32-key stages of 584 x 2,
        // P 64 x 40 x 2, the reduction 4 x 4 x 16 floats, four tiles of key offsets.
        let v = mma_variant(128, bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!((v.row_warps, v.stages), (4, 4));
        assert_eq!(
            v.smem_bytes(),
            74_752 + 4 * 37_376 + 5_120 + 1_024 + 4 * 256
        );
        // fp8: two raw stages of 592 bytes per key (576 and the padding), three CTAs an SM.
        let v = mma_variant(16, bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!((v.stages, v.ctas_per_sm), (2, 3));
        assert_eq!(
            v.smem_bytes(),
            18_688 + 2 * 32 * 592 + 1_280 + 256 + 2 * 256
        );
        // The fp8 twin: 1 KB of alignment, q 64 x 576 x 2, P^T 64 x 64 x 2, three raw stages
        // of 64 keys x 592 bytes, three tiles of key offsets, 4 x 64 column maxima, 2 x 64
        // floats and an mbarrier.
        let v = wgmma_fp8_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!(v.stages, 3);
        assert_eq!(
            v.smem_bytes(),
            1_024 + 73_728 + 8_192 + 3 * 64 * 592 + 3 * 512 + 1_024 + 512 + 8
        );
    }

    #[test]
    fn the_wgmma_layout_matches_the_kernel_by_hand() {
        // q, two key tiles and P of 64 rows, offsets and statistics, 1 KB slack.
        let v = wgmma_variant(
            KernelShape::deepseek(ModelDtype::F16, KvFormat::F16),
            232_448,
        )
        .unwrap();
        assert_eq!(v.smem_bytes(), 1024 + 3 * 73_728 + 8_192 + 1_024 + 768);
        // fp8: two raw stages of 576 bytes a key and the converted tile: the same total.
        let v = wgmma_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!(
            v.smem_bytes(),
            1024 + 73_728 + 2 * 36_864 + 73_728 + 8_192 + 1_024 + 768
        );
        assert_eq!((v.threads(), v.row_warps * 16), (256, 64));
        // The fp8-query mode: q as e4m3 codes (64 x 576 bytes), the rest as above.
        let q8 = wgmma_variant(bf16(KvFormat::Fp8E4m3).fp8_query(), 232_448).unwrap();
        assert_eq!(
            q8.smem_bytes(),
            1024 + 36_864 + 2 * 36_864 + 73_728 + 8_192 + 1_024 + 768
        );
    }

    #[test]
    fn the_seesaw_layout_matches_the_kernel_by_hand() {
        // 1 KB slack, q and two stages of 64 x 576, P1 (64 x 64), five rows of 64 floats, 23
        // mbarriers; scheduled, 16 bytes more (the piece's job, slot and split count); packed,
        // 65 x two i32 more (each row's key range and the keys every row sees).
        let v = seesaw_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!(v.smem_bytes(), 1024 + 3 * 73_728 + 8_192 + 1_280 + 184);
        assert_eq!(v.scheduled().smem_bytes(), v.smem_bytes() + 16);
        assert_eq!(v.packed().smem_bytes(), v.smem_bytes() + 65 * 8);
        assert!(v.packed().smem_bytes() <= 232_448);
    }

    #[test]
    fn the_narrow_kernel_fills_shared_memory_with_its_ring() {
        // 25 chunk slots of 8 KB on an H200 next to q (16 x 576 x 2), two P^T (16 x 64 x 2)
        // and two 4 x 16 maxima, 1 KB slack, two mbarriers a slot.
        let v = narrow_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!((v.stages, v.threads()), (25, 384));
        assert_eq!(
            v.smem_bytes(),
            1024 + 25 * 8192 + 18_432 + 2 * (2048 + 256) + 25 * 16
        );
        assert!(v.defines().contains(&"-DMLA_SLOTS=25".to_string()));
        // Only caches in the model dtype or fp8, and only where two tiles (18 slots) fit.
        assert!(narrow_variant(bf16(KvFormat::F16), 232_448).is_none());
        // fp8: four tiles of 5 raw slots of 8 KB (128 codes of each key, the last slot's half
        // past the row), q's two e4m3 terms (32 rows of 5 chunks), and 16 floats of q scales;
        // no producer warpgroup.
        let v = narrow_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!((v.stages, v.threads()), (20, 256));
        assert_eq!(
            v.smem_bytes(),
            1024 + 20 * 8192 + 20_480 + 2 * (2048 + 256) + 64 + 20 * 16
        );
        assert!(v.defines().contains(&"-DMLA_KV=2".to_string()));
        // Four tiles or none: the fp8 ring does not shrink to what a device has.
        assert_eq!(
            narrow_variant(bf16(KvFormat::Fp8E4m3), 200_000).map(|v| v.stages),
            Some(20)
        );
        assert!(narrow_variant(bf16(KvFormat::Fp8E4m3), 180_000).is_none());
        assert_eq!(
            narrow_variant(bf16(KvFormat::Bf16), 180_000)
                .unwrap()
                .stages,
            18
        );
        assert!(narrow_variant(bf16(KvFormat::Bf16), 166_912).is_none());
    }
}
