//! Stage 1's work item on the bf16-product paths (AVX-512 BF16, AMX-BF16): the steps of
//! `split.rs` with bf16 products.
//!
//! Per key chunk of [`KEY_CHUNK`]:
//! 1. the chunk's key rows as bf16: a bf16 cache is read where it lies (on the tile path,
//!    whose loads take rows a fixed stride apart, only whole tiles of 16 keys that lie as the
//!    chunk's buffer would hold them, at up to 32 heads; the other rows copied into it), an
//!    f16 or fp8 cache is decoded into the chunk's buffer (the decoder's values, so the same
//!    numbers as every other path; an fp8 cache on the vector path a score tile of keys at a
//!    time, each tile's keys right before its products and its packed values,
//!    `Stage1::fp8_chunk`);
//! 2. `S^T = K Q^T` with f32 sums (`avx512::scores`, or `amx::product` on tiles);
//! 3. the online softmax, 16 heads a vector: P rounded to bf16, the row sum unrounded;
//! 4. `acc = alpha * acc + P V` with V the chunk's rows packed in key pairs
//!    (`avx512::accumulate`, or the rescale then `amx::product` on tiles).
//!
//! The two paths differ only in the order of the f32 sums of the products.
//!
//! Only the multiplied values are bf16; the sums, partials and LSE stay f32, and a row's
//! arithmetic depends only on its own keys, so batch invariance holds as on the portable path.

use std::ops::Range;

use half::bf16;

use super::amx::{self, ATiles, CStart, TILE, TileUnit};
use super::avx512::{self, Avx512Bf16, LANES, TILE_KEYS};
use super::fp8_lookup::{self, Fp8Table};
use super::inputs::HostInputs;
use super::lines::LineBuf;
use super::phases::{Clock, Phase};
use super::split::{HEAD_GROUP, SoftmaxState};
use crate::dtype::KvFormat;
use crate::plan::{DecodePlan, KeyRange};

/// Keys per softmax step. 128 beat 64 and 256 on a 2-core AVX-512 EPYC: the chunk's packed
/// values, scores and the accumulator of 128 heads stay inside its 1 MB L2.
pub const KEY_CHUNK: usize = 128;

// A chunk's keys (the scores) and a work item's heads (`P V`) are each one product's A tiles.
const _: () = assert!(
    KEY_CHUNK / TILE <= amx::MAX_A_TILES
        && HEAD_GROUP.next_multiple_of(LANES) / TILE <= amx::MAX_A_TILES
);

/// What every work item of a decode reads: the plan, the inputs, and how a key row becomes
/// bf16.
pub struct Stage1<'a> {
    token: Avx512Bf16,
    /// Where the two products run: on AMX tiles, or (None) on AVX-512 vectors.
    tiles: Option<TileUnit>,
    plan: &'a DecodePlan,
    src: &'a HostInputs<'a>,
    /// The decoder's value of each fp8 byte, as bf16 bits (an fp8 cache).
    fp8: Option<Fp8Table>,
    /// Whether key rows are read where they lie ([`Stage1::cache_row`]): a bf16 cache, whose
    /// values are what the products take, of an even D (the scores read pairs).
    rows_in_place: bool,
    /// Whether the tile path may read a bf16 cache's key tiles where they lie: its rows
    /// follow one another at the chunk buffer's stride (D a multiple of 32, the rows
    /// unpadded), so 16 keys of a page are a tile as the buffer would hold them
    /// ([`Stage1::tile_in_place`]).
    tiles_in_place: bool,
}

impl<'a> Stage1<'a> {
    /// The work items' view of a decode, with the fp8 table of its decoder (an fp8 cache).
    pub fn new(
        token: Avx512Bf16,
        tiles: Option<TileUnit>,
        plan: &'a DecodePlan,
        src: &'a HostInputs<'a>,
    ) -> Self {
        let d = plan.head_dim();
        let rows_in_place = plan.kv_format == KvFormat::Bf16 && d.is_multiple_of(2);
        Stage1 {
            token,
            tiles,
            plan,
            src,
            fp8: plan.kv_format.is_fp8().then(|| Fp8Table::of(&src.decoder)),
            rows_in_place,
            tiles_in_place: tiles.is_some()
                && rows_in_place
                && d.is_multiple_of(2 * TILE)
                && plan.kv.token_stride == d,
        }
    }

    /// One work item: heads `head0..head0 + lse.len()` of `row` over `keys`.
    pub fn attend(
        &self,
        row: usize,
        head0: usize,
        keys: KeyRange,
        sc: &mut Scratch,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        let (token, plan) = (self.token, self.plan);
        let hg = lse.len();
        let (hp, lp, pairs) = shape(plan, hg);
        let request = row / plan.query_len;
        // This thread's tiles, configured for the work item and released at its end.
        let tiles = self.tiles.map(TileUnit::configure);

        self.pack_q(row, head0, hg, hp, sc);
        sc.state.reset(hp);
        let mut clock = Clock::start();

        // An fp8 cache on the vector path decodes its keys a score tile at a time.
        let by_tile = tiles.is_none() && self.fp8.is_some();

        let shape = (hp, lp, pairs);
        for chunk in (keys.start..keys.end).step_by(KEY_CHUNK) {
            let n = KEY_CHUNK.min(keys.end - chunk);
            // 1, 2 and the packing of 4: the chunk's rows as bf16, S^T, V in key pairs
            if by_tile {
                self.fp8_chunk(request, chunk..chunk + n, keys.end, shape, sc, &mut clock);
            } else {
                let tiles = tiles.as_ref();
                self.chunk(request, chunk..chunk + n, tiles, shape, sc, &mut clock);
            }
            // 3. online softmax
            avx512::softmax(
                token,
                &sc.s,
                n,
                hp,
                plan.scale,
                &mut sc.state.m,
                &mut sc.state.l,
                &mut sc.alpha,
                &mut sc.p,
            );
            clock.lap(Phase::Softmax);
            // 4. acc = alpha * acc + P V
            let key_pairs = n.div_ceil(2);
            match &tiles {
                None => avx512::accumulate(
                    token,
                    &sc.p,
                    &sc.v,
                    key_pairs,
                    hp,
                    lp,
                    &sc.alpha,
                    &mut sc.state.acc,
                ),
                Some(tiles) => {
                    // Whole tiles of 16 key pairs: P^T and V zero past the chunk's pairs.
                    let pairs_p = key_pairs.next_multiple_of(TILE);
                    sc.v[key_pairs * lp..pairs_p * lp].fill(0);
                    let ld = KEY_CHUNK / 2;
                    avx512::transpose_pairs(token, &sc.p, key_pairs, hp, &mut sc.pt, ld);
                    // A head whose running max did not move keeps its sums as they are
                    // (x * 1 is x): most heads, after the first chunks.
                    for (acc, &a) in sc.state.acc.chunks_exact_mut(lp).zip(sc.alpha.iter()) {
                        if a != 1.0 {
                            acc.iter_mut().for_each(|x| *x *= a);
                        }
                    }
                    clock.lap(Phase::Transpose);
                    let shape = [hp, lp, pairs_p];
                    let pt = ATiles::of(&sc.pt, ld, hp);
                    let (v, acc) = (&sc.v, &mut sc.state.acc);
                    amx::product(tiles, &pt, ld, v, lp, acc, lp, shape, CStart::Load);
                }
            }
            clock.lap(Phase::Pv);
        }

        sc.state.write(1.0, plan.kv_lora_rank, o, lse);
    }

    /// Steps 1, 2 and the packing of step 4 for the `keys` of a chunk, the products on
    /// `tiles` or on vectors: the rows read in place (a bf16 cache on the vector path, and on
    /// the tile path the whole tiles of 16 keys that lie in place as the buffer would hold
    /// them, [`Stage1::tile_in_place`]) or copied or decoded into the chunk's buffer
    /// ([KEY_CHUNK][2 kp] bf16; the tiles read whole tiles of 16 keys, so the rows after the
    /// chunk's are zero there). The shape is [`shape`]'s.
    fn chunk(
        &self,
        request: usize,
        keys: Range<usize>,
        tiles: Option<&amx::Tiles>,
        (hp, lp, pairs): (usize, usize, usize),
        sc: &mut Scratch,
        clock: &mut Clock,
    ) {
        let (token, plan) = (self.token, self.plan);
        let n = keys.len();
        let kp = pairs.next_multiple_of(TILE);
        let key_buf: &mut [u16] = bytemuck::cast_slice_mut(&mut sc.keys);
        key_buf[2 * kp * n..2 * kp * n.next_multiple_of(TILE)].fill(0);
        let mut in_place: [Option<&[u32]>; KEY_CHUNK / TILE] = [None; KEY_CHUNK / TILE];
        // Only where the scores read each key tile once (up to 32 heads: one block of C tiles
        // across): read in place by more blocks, the tiles' loads wait on DRAM in the
        // products (NOTES.md, "Key tiles read where they lie").
        if self.tiles_in_place && hp <= 2 * TILE {
            for (t, tile) in in_place.iter_mut().enumerate() {
                let pos = keys.start + t * TILE;
                if pos + TILE <= keys.end {
                    *tile = self.tile_in_place(request, pos);
                }
            }
        }
        let mut in_cache: [Option<&[u16]>; KEY_CHUNK] = [None; KEY_CHUNK];
        let buffers = key_buf.chunks_exact_mut(2 * kp);
        for (i, ((r, buf), pos)) in in_cache.iter_mut().zip(buffers).zip(keys).enumerate() {
            match self.cache_row(request, pos) {
                Some(row) if tiles.is_none() || in_place[i / TILE].is_some() => *r = Some(row),
                Some(row) => {
                    let (values, pad) = buf.split_at_mut(row.len());
                    values.copy_from_slice(row);
                    pad.fill(0);
                }
                None => self.decode_row(request, pos, buf, &mut sc.row),
            }
        }
        let key_buf: &[u16] = bytemuck::cast_slice(&sc.keys);
        let mut rows: [&[u16]; KEY_CHUNK] = [&[]; KEY_CHUNK];
        let buffers = key_buf.chunks_exact(2 * kp);
        for ((r, buf), cached) in rows.iter_mut().zip(buffers).zip(&in_cache[..n]) {
            *r = cached.unwrap_or(buf);
        }
        let rows = &rows[..n];
        clock.lap(Phase::Keys);
        match tiles {
            None => avx512::scores(token, rows, &sc.q, pairs, hp, &mut sc.s),
            Some(tiles) => {
                let m = n.next_multiple_of(TILE);
                let mut a = ATiles::new();
                for (t, tile) in in_place[..m / TILE].iter().enumerate() {
                    a.push(tile.unwrap_or(&sc.keys[t * TILE * kp..]));
                }
                let (q, s) = (&sc.q, &mut sc.s);
                amx::product(tiles, &a, kp, q, hp, s, hp, [m, hp, kp], CStart::Zero);
            }
        }
        clock.lap(Phase::Scores);
        avx512::pack_values(token, rows, plan.kv_lora_rank, lp, &mut sc.v);
        clock.lap(Phase::Values);
    }

    /// Steps 1, 2 and the packing of step 4 for the fp8 `keys` of a chunk on the vector
    /// path, [`TILE_KEYS`] keys at a time: a tile's codes are decoded right before its
    /// products, into rows that stay in L1 for the scores and the values, while the codes of
    /// the tile after next are on their way, into the next chunk up to the work item's
    /// `item_end` (NOTES.md). The shape is [`shape`]'s.
    fn fp8_chunk(
        &self,
        request: usize,
        keys: Range<usize>,
        item_end: usize,
        (hp, lp, pairs): (usize, usize, usize),
        sc: &mut Scratch,
        clock: &mut Clock,
    ) {
        let (token, plan) = (self.token, self.plan);
        let d = plan.head_dim();
        let width = 2 * pairs;
        let tile_buf: &mut [u16] = bytemuck::cast_slice_mut(&mut sc.keys);
        let tile_buf = &mut tile_buf[..TILE_KEYS * width];
        for start in keys.clone().step_by(TILE_KEYS) {
            let end = keys.end.min(start + TILE_KEYS);
            let ahead = end + TILE_KEYS..end + 2 * TILE_KEYS;
            for pos in ahead.start.min(item_end)..ahead.end.min(item_end) {
                avx512::prefetch_l2(self.src.key_bytes(plan, request, pos, d));
            }
            let buffers = tile_buf.chunks_exact_mut(width);
            for (pos, buf) in (start..end).zip(buffers) {
                self.decode_row(request, pos, buf, &mut sc.row);
            }
            clock.lap(Phase::Keys);
            let mut rows: [&[u16]; TILE_KEYS] = [&[]; TILE_KEYS];
            for (r, buf) in rows.iter_mut().zip(tile_buf.chunks_exact(width)) {
                *r = buf;
            }
            let rows = &rows[..end - start];
            // A tile starts at an even key: its pairs are whole pairs of the chunk.
            let j0 = start - keys.start;
            avx512::scores(token, rows, &sc.q, pairs, hp, &mut sc.s[j0 * hp..]);
            clock.lap(Phase::Scores);
            let v = &mut sc.v[j0 / 2 * lp..];
            avx512::pack_values(token, rows, plan.kv_lora_rank, lp, v);
            clock.lap(Phase::Values);
        }
    }

    /// q of the group's heads as bf16 pairs `[pairs][hp]`, the padding heads and the odd
    /// dimension's partner zero. q holds bf16 values (this path takes a bf16 model dtype), so
    /// the bits are exact.
    /// The pairs from D / 2 to the q buffer's end stay zero (whole tiles of 16 pairs).
    fn pack_q(&self, row: usize, head0: usize, hg: usize, hp: usize, sc: &mut Scratch) {
        let d = self.plan.head_dim();
        sc.q.fill(0);
        for h in 0..hg {
            self.src.load_q(self.plan, row, head0 + h, &mut sc.row);
            for (i, &x) in sc.row[..d].iter().enumerate() {
                let bits = u32::from(bf16::from_f32(x).to_bits());
                sc.q[(i / 2) * hp + h] |= bits << (16 * (i % 2));
            }
        }
    }

    /// Keys `pos .. pos + 16` of `request` as an A tile where they lie, for a decoder whose
    /// cache allows it (`tiles_in_place`): all 16 in one page, on a 4-byte boundary. Read
    /// there, the tile skips the copy into the chunk's buffer, which waits on DRAM.
    fn tile_in_place(&self, request: usize, pos: usize) -> Option<&'a [u32]> {
        let (plan, page) = (self.plan, self.plan.kv.page_size);
        if pos % page + TILE > page {
            return None;
        }
        let bytes = self
            .src
            .key_bytes(plan, request, pos, TILE * plan.head_dim());
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// A bf16 key row as it lies in the cache, for a decoder whose cache allows it
    /// (`rows_in_place`) where the row sits on a 2-byte boundary.
    fn cache_row(&self, request: usize, pos: usize) -> Option<&'a [u16]> {
        if !self.rows_in_place {
            return None;
        }
        let d = self.plan.head_dim();
        bytemuck::try_cast_slice(self.src.key_bytes(self.plan, request, pos, d)).ok()
    }

    /// Key `pos` of `request` as the bf16 values the products take, into `dst` (2 * pairs
    /// values, the last one zero when D is odd); `f32_row` (D values) is the buffer of the rows
    /// the fast conversions cannot take.
    fn decode_row(&self, request: usize, pos: usize, dst: &mut [u16], f32_row: &mut [f32]) {
        let d = self.plan.head_dim();
        let bytes = self.src.key_bytes(self.plan, request, pos, d);
        let (values, pad) = dst.split_at_mut(d);
        pad.fill(0);
        // An fp8 cache has its table (`new`).
        if let Some(table) = &self.fp8 {
            return fp8_lookup::fp8_to_bf16(self.token, table, bytes, values);
        }
        match bytemuck::try_cast_slice(bytes) {
            Ok(f16s) if self.plan.kv_format == KvFormat::F16 => {
                avx512::f16_to_bf16(self.token, f16s, values);
            }
            _ => self.decode_through_f32(request, pos, values, f32_row),
        }
    }

    /// The decoder's f32 values (bf16 numbers for a bf16 model) as bf16 bits: for rows the
    /// fast conversions cannot take (an odd width, unaligned bytes).
    fn decode_through_f32(&self, request: usize, pos: usize, dst: &mut [u16], x: &mut [f32]) {
        let x = &mut x[..dst.len()];
        self.src.load_key(self.plan, request, pos, x);
        for (d, &x) in dst.iter_mut().zip(x.iter()) {
            *d = bf16::from_f32(x).to_bits();
        }
    }
}

/// Per-thread buffers of one work item, each from the start of a cache line (`hp` heads
/// rounded up to 16, `lp` = L rounded up to 16, `pairs` = D / 2 rounded up, `kp` = pairs
/// rounded up to 16: the tiles' whole steps).
pub struct Scratch {
    q: LineBuf<u32>,     // [kp][hp]
    row: Vec<f32>,       // [D]: a q or key row as f32
    keys: LineBuf<u32>,  // [KEY_CHUNK][kp]: bf16 pairs (u32, for the tiles' A operand)
    pt: LineBuf<u32>,    // [hp][KEY_CHUNK / 2]: P^T for the tiles
    s: LineBuf<f32>,     // [KEY_CHUNK][hp]
    p: LineBuf<u32>,     // [KEY_CHUNK / 2][hp]
    v: LineBuf<u32>,     // [KEY_CHUNK / 2][lp]
    state: SoftmaxState, // acc [hp][lp]
    alpha: LineBuf<f32>, // [hp]
}

impl Scratch {
    pub fn new(plan: &DecodePlan, heads: usize) -> Self {
        let (hp, lp, pairs) = shape(plan, heads);
        let kp = pairs.next_multiple_of(TILE);
        Scratch {
            q: LineBuf::zeroed(kp * hp),
            row: vec![0.0; plan.head_dim()],
            keys: LineBuf::zeroed(KEY_CHUNK * kp),
            pt: LineBuf::zeroed(hp * KEY_CHUNK / 2),
            s: LineBuf::zeroed(KEY_CHUNK * hp),
            p: LineBuf::zeroed(KEY_CHUNK / 2 * hp),
            v: LineBuf::zeroed(KEY_CHUNK / 2 * lp),
            state: SoftmaxState::new(hp, lp),
            alpha: LineBuf::zeroed(hp),
        }
    }
}

/// (heads rounded up to 16, L rounded up to 16, D / 2 rounded up).
fn shape(plan: &DecodePlan, heads: usize) -> (usize, usize, usize) {
    (
        heads.next_multiple_of(LANES),
        plan.kv_lora_rank.next_multiple_of(LANES),
        plan.head_dim().div_ceil(2),
    )
}
