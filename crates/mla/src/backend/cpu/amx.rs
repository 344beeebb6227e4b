//! AMX-BF16 products of stage 1 (`tdpbf16ps`: a 16 x 16 f32 tile += a 16 x 32 bf16 tile times
//! a 32 x 16 bf16 tile, each f32 sum over bf16 pairs). Stable Rust has no AMX intrinsics, so
//! the instructions are written with `asm!`; everything unsafe of the AMX path is in this
//! file. The public functions are safe: [`AmxBf16`] exists only where the CPU has the tiles
//! and Linux granted them, [`Tiles`] only while this thread's tiles are configured, and
//! [`product`] checks every tile it touches against its slices first.
//!
//! Layout of a product `C[m][n] += sum_k A[m][k] . B[k][n]` (`u32` = two bf16, the lower
//! one first; `m`, `n`, `k` multiples of 16, `k` in pairs):
//! - A `[m][lda]` u32: row i holds the pairs of its own values (a key row, a head's P),
//!   given as one slice a tile of 16 rows (each from the tile's first row, `lda` apart), so
//!   that a tile can be read where it lies (16 keys of a page) or from a buffer;
//! - B `[k][ldb]` u32, "VNNI" pairs: row p holds, for each column, the pair of values of
//!   rows 2p, 2p + 1 (packed q `[D/2][hp]`, packed V `[keys/2][lp]`);
//! - C `[m][ldc]` f32.
//!
//! Each 16 x 16 block of C is one tile: loaded, `k / 16` times `tdpbf16ps` with the A tile
//! (16 rows of 16 pairs, 64 bytes) and the B tile (16 pair rows of 16 columns) of that step,
//! stored back. C is walked in blocks of 2 x 2 tiles where it has them ([`Block`]): four C
//! tiles in flight, each A and B tile loaded once for two products, and four independent
//! chains of `tdpbf16ps` (one C tile alone waits for each product's latency before the next).
//! All eight tiles are configured 16 rows of 64 bytes: 0 to 3 the C tiles, 4 and 5 A, 6 and
//! 7 B.
#![allow(unsafe_code)]

use std::arch::asm;
use std::marker::PhantomData;
use std::sync::OnceLock;

use super::avx512::Avx512Bf16;

/// Rows of a tile, and its width in f32 or bf16 pairs (64 bytes).
pub const TILE: usize = 16;
/// Bytes of a tile row.
const TILE_ROW_BYTES: usize = 64;
/// Tiles of palette 1.
const TILES: usize = 8;

/// Proof that this CPU has AMX-TILE and AMX-BF16, that Linux enabled the tile state (XCR0)
/// and granted it to this process (`arch_prctl`), and the AVX-512 BF16 the rest of the path
/// runs on.
#[derive(Debug, Clone, Copy)]
pub struct AmxBf16 {
    vectors: Avx512Bf16,
}

impl AmxBf16 {
    /// The token, if the CPU has the features and Linux grants the tile state. The first
    /// call asks for the permission; the answer is kept for the process.
    pub fn detect() -> Option<Self> {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        let vectors = Avx512Bf16::detect()?;
        GRANTED
            .get_or_init(|| {
                let cpu = AmxCpuid::read();
                cpu.tile && cpu.bf16 && tile_data_permitted() && tile_state_in_xcr0()
            })
            .then_some(AmxBf16 { vectors })
    }

    /// The AVX-512 BF16 token the softmax and the packing take.
    pub fn vectors(self) -> Avx512Bf16 {
        self.vectors
    }
}

/// What CPUID says of AMX (leaf 7's EDX: AMX-TILE bit 24, AMX-BF16 bit 22; std's detection of
/// them is not stable yet). Only the CPU's word: Linux must still grant the tile state.
#[derive(Debug, Clone, Copy)]
pub struct AmxCpuid {
    pub tile: bool,
    pub bf16: bool,
}

impl AmxCpuid {
    pub fn read() -> Self {
        use std::arch::x86_64::__cpuid_count;
        let edx = if __cpuid_count(0, 0).eax >= 7 {
            __cpuid_count(7, 0).edx
        } else {
            0
        };
        AmxCpuid {
            tile: edx & (1 << 24) != 0,
            bf16: edx & (1 << 22) != 0,
        }
    }
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`);
/// without it the first tile instruction faults. True when granted.
#[cfg(target_os = "linux")]
fn tile_data_permitted() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain Linux system call with integer arguments; it touches no memory of this
    // program. `syscall` overwrites rcx and r11, declared as clobbered.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Only Linux is asked for the tile state here.
#[cfg(not(target_os = "linux"))]
fn tile_data_permitted() -> bool {
    false
}

/// XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves the tile state.
fn tile_state_in_xcr0() -> bool {
    use std::arch::x86_64::__cpuid;
    const OSXSAVE: u32 = 1 << 27;
    if __cpuid(1).ecx & OSXSAVE == 0 {
        return false;
    }
    // SAFETY: OSXSAVE set means the OS enabled XGETBV; register 0 (XCR0) always exists then.
    let xcr0 = unsafe { xgetbv0() };
    const TILE_STATE: u64 = (1 << 17) | (1 << 18);
    xcr0 & TILE_STATE == TILE_STATE
}

/// # Safety
/// The CPU has XSAVE and the OS enabled it (CPUID.1:ECX.OSXSAVE).
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    // SAFETY: the caller's contract.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

/// The 64-byte tile configuration (`ldtilecfg`): palette 1, its eight tiles of 16 rows of 64
/// bytes.
#[repr(C, align(64))]
pub struct TileConfig(pub [u8; 64]);

impl TileConfig {
    pub fn new() -> Self {
        let mut b = [0u8; 64];
        b[0] = 1; // palette 1; byte 1 (start row) 0
        for tile in 0..TILES {
            // colsb: u16 little-endian at 16 + 2 * tile; rows: u8 at 48 + tile
            b[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&(TILE_ROW_BYTES as u16).to_le_bytes());
            b[48 + tile] = TILE as u8;
        }
        TileConfig(b)
    }
}

/// This thread's configured tiles, from [`TileUnit::configure`] to drop (`tilerelease`). Not
/// `Send`: the tile state belongs to the thread that configured it.
pub struct Tiles {
    unit: TileUnit,
    _thread: PhantomData<*const ()>,
}

/// What computes the tile products: the AMX unit, or (in tests) a scalar model of
/// `tdpbf16ps` that walks the same tiles, so that the layout is checked on any CPU.
#[derive(Debug, Clone, Copy)]
pub enum TileUnit {
    Amx(AmxBf16),
    #[cfg(test)]
    Scalar,
}

impl TileUnit {
    /// Configures this thread's tiles ([`TileConfig`]) until the returned value drops.
    pub fn configure(self) -> Tiles {
        match self {
            TileUnit::Amx(_) => {
                let cfg = TileConfig::new();
                // SAFETY: the token proves AMX and the permission; `cfg` is 64 readable bytes
                // of a valid palette-1 configuration (rows <= 16, bytes <= 64, reserved 0).
                unsafe {
                    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
                }
            }
            #[cfg(test)]
            TileUnit::Scalar => {}
        }
        Tiles {
            unit: self,
            _thread: PhantomData,
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        match self.unit {
            // SAFETY: the tiles were configured by this thread (`Tiles` is not Send);
            // tilerelease returns them to the init state and touches no memory.
            TileUnit::Amx(_) => unsafe { asm!("tilerelease", options(nostack, nomem)) },
            #[cfg(test)]
            TileUnit::Scalar => {}
        }
    }
}

/// One 16 x 16 block of C: the element offset of its C, the index of its A tile (16 rows) and
/// the element offset of its first B tile, for its `k / 16` steps (A moves 16 pairs right a
/// step, B 16 pair rows down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TileJob {
    c: usize,
    a: usize,
    b: usize,
}

/// What one pass of the tile unit computes: one C tile, or a 2 x 2 block of them (C tiles
/// `[i][j]` at rows `16 i`, columns `16 j` from the first; A tile `i`, B tile `j`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    One(TileJob),
    Four(TileJob),
}

impl Block {
    /// The four C tiles of a 2 x 2 block from `job` (its first), `[i][j]` at index 2 i + j.
    fn four(job: TileJob, ldc: usize) -> [TileJob; 4] {
        std::array::from_fn(|t| {
            let (i, j) = (t / 2, t % 2);
            TileJob {
                c: job.c + i * TILE * ldc + j * TILE,
                a: job.a + i,
                b: job.b + j * TILE,
            }
        })
    }

    /// Its C tiles as jobs of their own (what the scalar model and the tests walk).
    #[cfg(test)]
    fn tiles(self, ldc: usize) -> Vec<TileJob> {
        match self {
            Block::One(job) => vec![job],
            Block::Four(job) => Block::four(job, ldc).to_vec(),
        }
    }
}

/// The blocks of an `[m, n]` C: 2 x 2 tiles where both dimensions have 32 more, single tiles
/// along the rest; rows of blocks first (A's rows stay warm across a row).
fn blocks(m: usize, n: usize, ldc: usize) -> impl Iterator<Item = Block> {
    let (m2, n2) = (m - m % (2 * TILE), n - n % (2 * TILE));
    // The C tile at row i, column j (its first A and B tiles).
    let at = move |i: usize, j: usize| TileJob {
        c: i * ldc + j,
        a: i / TILE,
        b: j,
    };
    let four = (0..m2).step_by(2 * TILE).flat_map(move |i| {
        (0..n2)
            .step_by(2 * TILE)
            .map(move |j| Block::Four(at(i, j)))
    });
    // The tiles outside the 2 x 2 blocks: the last columns of their rows, then the last rows.
    let right = (0..m2)
        .step_by(TILE)
        .flat_map(move |i| (n2..n).step_by(TILE).map(move |j| Block::One(at(i, j))));
    let below = (m2..m)
        .step_by(TILE)
        .flat_map(move |i| (0..n).step_by(TILE).map(move |j| Block::One(at(i, j))));
    four.chain(right).chain(below)
}

/// Most A tiles of a product: 128 rows (a chunk's keys, a work item's heads).
pub const MAX_A_TILES: usize = 8;

/// A product's A operand, a slice a tile of 16 rows (each from the tile's first row, its rows
/// the product's `lda` apart): the tiles of one buffer, or tiles from wherever they lie.
pub struct ATiles<'a> {
    tiles: [&'a [u32]; MAX_A_TILES],
    len: usize,
}

impl<'a> ATiles<'a> {
    /// No tiles yet.
    pub fn new() -> Self {
        ATiles {
            tiles: [&[]; MAX_A_TILES],
            len: 0,
        }
    }

    /// The `m / 16` tiles of `a` (`[m][lda]`, one buffer).
    pub fn of(a: &'a [u32], lda: usize, m: usize) -> Self {
        let mut tiles = ATiles::new();
        for t in 0..m / TILE {
            tiles.push(&a[(t * TILE * lda).min(a.len())..]);
        }
        tiles
    }

    /// Appends the next tile.
    ///
    /// # Panics
    /// Past [`MAX_A_TILES`] (internal invariant).
    pub fn push(&mut self, tile: &'a [u32]) {
        assert!(self.len < MAX_A_TILES, "ATiles: full");
        self.tiles[self.len] = tile;
        self.len += 1;
    }

    fn as_slice(&self) -> &[&'a [u32]] {
        &self.tiles[..self.len]
    }
}

/// Where a product's sums start: C's values (`c += a b`), or zero (`c = a b`: C's tiles are
/// zeroed in the tile unit, never read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CStart {
    Load,
    Zero,
}

/// `c[i][j] = start + sum_p a[i][p] . b[p][j]` (bf16 pairs, f32 sums; `start` C's value or 0,
/// [`CStart`]) for `[m, n, k]` (multiples of 16, `k` > 0 pairs), with row strides `lda`,
/// `ldb`, `ldc` in elements; A's rows `16 t ..` are those of `a[t]` (`m / 16` tiles).
///
/// # Panics
/// If a shape is not a multiple of 16 or a slice is shorter than the shapes say (internal
/// invariants).
#[allow(clippy::too_many_arguments)]
pub fn product(
    tiles: &Tiles,
    a: &ATiles,
    lda: usize,
    b: &[u32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    [m, n, k]: [usize; 3],
    start: CStart,
) {
    assert!(
        [m, n, k].iter().all(|x| x.is_multiple_of(TILE)) && m > 0 && n > 0 && k > 0,
        "product: shape"
    );
    // The last element each operand's tiles read is its [rows - 1][cols - 1].
    let a = a.as_slice();
    assert!(
        k <= lda && a.len() == m / TILE && a.iter().all(|t| t.len() >= (TILE - 1) * lda + k),
        "product: a"
    );
    assert!(n <= ldb && b.len() >= (k - 1) * ldb + n, "product: b");
    assert!(n <= ldc && c.len() >= (m - 1) * ldc + n, "product: c");
    let steps = k / TILE;
    for block in blocks(m, n, ldc) {
        match tiles.unit {
            // SAFETY: the token inside `tiles` proves AMX-BF16 and the configuration of all
            // eight tiles on this thread; the asserts above keep every tile inside its slice:
            // a block's C tiles are whole 16 x 16 tiles of the [m][n] C (`blocks`), so C rows
            // c + r * ldc + 0..16, rows 16 s + r * lda + 0..16 of A tile a[a] and B rows b +
            // (16 s + r) * ldb + 0..16 for r < 16, s < steps, for each of its tiles' (c, a, b).
            TileUnit::Amx(_) => unsafe {
                match block {
                    Block::One(job) => tile_dot(
                        start,
                        c.as_mut_ptr().add(job.c),
                        4 * ldc,
                        a[job.a].as_ptr(),
                        4 * lda,
                        b.as_ptr().add(job.b),
                        4 * ldb,
                        steps,
                    ),
                    Block::Four(job) => {
                        // Tiles [0][0] and [1][0]: the rows of C and A; the right-hand
                        // tiles are 64 bytes on.
                        let [t0, _, t1, _] = Block::four(job, ldc);
                        tile_dot_2x2(
                            start,
                            [c.as_mut_ptr().add(t0.c), c.as_mut_ptr().add(t1.c)],
                            4 * ldc,
                            [a[t0.a].as_ptr(), a[t1.a].as_ptr()],
                            4 * lda,
                            b.as_ptr().add(t0.b),
                            4 * ldb,
                            steps,
                        )
                    }
                }
            },
            #[cfg(test)]
            TileUnit::Scalar => {
                for job in block.tiles(ldc) {
                    if start == CStart::Zero {
                        for r in 0..TILE {
                            c[job.c + r * ldc..job.c + r * ldc + TILE].fill(0.0);
                        }
                    }
                    scalar_tile_dot(job, a[job.a], lda, b, ldb, c, ldc, steps);
                }
            }
        }
    }
}

/// One C tile through `steps` A and B tiles (strides in bytes).
///
/// # Safety
/// AMX-BF16 with the tiles configured 16 x 64 bytes on this thread (it uses 0, 1, 2); `steps` > 0; `c`
/// reads and writes 16 rows of 64 bytes `c_stride` apart; `a` reads 16 rows of
/// `64 * steps` bytes `a_stride` apart; `b` reads `16 * steps` rows of 64 bytes `b_stride`
/// apart.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_dot(
    start: CStart,
    c: *mut f32,
    c_stride: usize,
    a: *const u32,
    a_stride: usize,
    b: *const u32,
    b_stride: usize,
    steps: usize,
) {
    let b_step = TILE * b_stride;
    // SAFETY: the caller's contract; tileloadd/tilestored address rows as base + stride *
    // row (the stride is the SIB index), so each operand's stride register is the index. The
    // tiles keep their values from one asm block to the next (the compiler never uses them).
    unsafe {
        match start {
            CStart::Load => asm!(
                "tileloadd tmm0, [{c} + {c_stride}*1]",
                c = in(reg) c,
                c_stride = in(reg) c_stride,
                options(nostack, readonly),
            ),
            CStart::Zero => asm!("tilezero tmm0", options(nostack, nomem)),
        }
        asm!(
            "2:",
            "tileloadd tmm1, [{a} + {a_stride}*1]",
            "tileloadd tmm2, [{b} + {b_stride}*1]",
            "tdpbf16ps tmm0, tmm1, tmm2",
            "add {a}, 64",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c} + {c_stride}*1], tmm0",
            c = in(reg) c,
            c_stride = in(reg) c_stride,
            a = inout(reg) a => _,
            a_stride = in(reg) a_stride,
            b = inout(reg) b => _,
            b_stride = in(reg) b_stride,
            b_step = in(reg) b_step,
            steps = inout(reg) steps => _,
            options(nostack),
        );
    }
}

/// A 2 x 2 block of C tiles through `steps` A and B tiles (strides in bytes): C tiles
/// `[i][j]` at `c[i]` and 64 bytes right of it, A tile `i` at `a[i]`, B tile `j` at `b` and
/// 64 bytes right of it.
///
/// # Safety
/// AMX-BF16 with the eight tiles configured 16 x 64 bytes on this thread; `steps` > 0; each
/// `c[i]` reads and writes 16 rows of 128 bytes `c_stride` apart; each `a[i]` reads 16 rows of
/// `64 * steps` bytes `a_stride` apart; `b` reads `16 * steps` rows of 128 bytes `b_stride`
/// apart.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_dot_2x2(
    start: CStart,
    c: [*mut f32; 2],
    c_stride: usize,
    a: [*const u32; 2],
    a_stride: usize,
    b: *const u32,
    b_stride: usize,
    steps: usize,
) {
    let b_step = TILE * b_stride;
    // SAFETY: the caller's contract; as in tile_dot, each stride register is the SIB index,
    // and the right-hand tiles are the same rows 64 bytes on (the displacement).
    unsafe {
        match start {
            CStart::Load => asm!(
                "tileloadd tmm0, [{c0} + {c_stride}*1]",
                "tileloadd tmm1, [{c0} + {c_stride}*1 + 64]",
                "tileloadd tmm2, [{c1} + {c_stride}*1]",
                "tileloadd tmm3, [{c1} + {c_stride}*1 + 64]",
                c0 = in(reg) c[0],
                c1 = in(reg) c[1],
                c_stride = in(reg) c_stride,
                options(nostack, readonly),
            ),
            CStart::Zero => asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            ),
        }
        asm!(
            "2:",
            "tileloadd tmm4, [{a0} + {a_stride}*1]",
            "tileloadd tmm6, [{b} + {b_stride}*1]",
            "tileloadd tmm7, [{b} + {b_stride}*1 + 64]",
            "tileloadd tmm5, [{a1} + {a_stride}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c0} + {c_stride}*1], tmm0",
            "tilestored [{c0} + {c_stride}*1 + 64], tmm1",
            "tilestored [{c1} + {c_stride}*1], tmm2",
            "tilestored [{c1} + {c_stride}*1 + 64], tmm3",
            c0 = in(reg) c[0],
            c1 = in(reg) c[1],
            c_stride = in(reg) c_stride,
            a0 = inout(reg) a[0] => _,
            a1 = inout(reg) a[1] => _,
            a_stride = in(reg) a_stride,
            b = inout(reg) b => _,
            b_stride = in(reg) b_stride,
            b_step = in(reg) b_step,
            steps = inout(reg) steps => _,
            options(nostack),
        );
    }
}

/// A scalar model of [`tile_dot`] on element offsets (`a` the job's A tile): the same tiles,
/// each `tdpbf16ps` as `C[r][j] += A[r][p].lo B[p][j].lo + A[r][p].hi B[p][j].hi` over the
/// tile's 16 pairs.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn scalar_tile_dot(
    job: TileJob,
    a: &[u32],
    lda: usize,
    b: &[u32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    steps: usize,
) {
    let half = |x: u32, hi: bool| f32::from_bits(if hi { x & 0xffff_0000 } else { x << 16 });
    for s in 0..steps {
        let (a0, b0) = (TILE * s, job.b + TILE * s * ldb);
        for r in 0..TILE {
            for j in 0..TILE {
                let mut sum = c[job.c + r * ldc + j];
                for p in 0..TILE {
                    let (x, y) = (a[a0 + r * lda + p], b[b0 + p * ldb + j]);
                    sum += half(x, false) * half(y, false) + half(x, true) * half(y, true);
                }
                c[job.c + r * ldc + j] = sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn the_configuration_is_palette_1_with_eight_full_tiles() {
        let cfg = TileConfig::new().0;
        assert_eq!(cfg[0], 1, "palette");
        assert!(cfg[1..16].iter().all(|&x| x == 0), "start row, reserved");
        for t in 0..16 {
            let colsb = u16::from_le_bytes([cfg[16 + 2 * t], cfg[17 + 2 * t]]);
            let rows = cfg[48 + t];
            let want = if t < TILES { (64, 16) } else { (0, 0) };
            assert_eq!((colsb, rows), want, "tile {t}");
        }
        assert_eq!(std::mem::align_of::<TileConfig>(), 64);
    }

    /// bf16 values on a grid that keeps every product and sum exact in f32.
    fn val(i: usize) -> bf16 {
        bf16::from_f32(((i * 37 % 23) as f32 - 11.0) / 8.0)
    }

    fn pair(lo: bf16, hi: bf16) -> u32 {
        u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16
    }

    /// Both products of the AMX path through the real tile walk and operand packing, on the
    /// scalar model of `tdpbf16ps`, against a scalar sum of the unpacked values: S^T = K Q^T
    /// for 20 keys (two key tiles, the second partly padding) of D = 40 (three pair tiles,
    /// the last partly padding) and 32 heads; then acc = acc + P V for those 20 keys.
    #[test]
    fn tile_products_on_the_scalar_model_match_a_scalar_sum() {
        let tiles = TileUnit::Scalar.configure();
        let (keys, d, hp): (usize, usize, usize) = (20, 40, 32);
        let (keys_p, pairs_p) = (keys.next_multiple_of(TILE), (d / 2).next_multiple_of(TILE));
        let kv = |j: usize, i: usize| val(j * 17 + i);
        let qv = |h: usize, i: usize| val(h * 5 + i * 3 + 1);
        // K as A: a key's pairs, padding rows and pairs zero; q as B: [pairs_p][hp].
        let mut k = vec![0u32; keys_p * pairs_p];
        for j in 0..keys {
            for p in 0..d / 2 {
                k[j * pairs_p + p] = pair(kv(j, 2 * p), kv(j, 2 * p + 1));
            }
        }
        let mut q = vec![0u32; pairs_p * hp];
        for p in 0..d / 2 {
            for h in 0..hp {
                q[p * hp + h] = pair(qv(h, 2 * p), qv(h, 2 * p + 1));
            }
        }
        // S starts from zero whatever it held: NaN there would show in every score. The second
        // key tile comes from a buffer of its own (tiles are read wherever they lie).
        let mut s = vec![f32::NAN; keys_p * hp];
        let second = k[TILE * pairs_p..].to_vec();
        let mut a = ATiles::new();
        a.push(&k);
        a.push(&second);
        product(
            &tiles,
            &a,
            pairs_p,
            &q,
            hp,
            &mut s,
            hp,
            [keys_p, hp, pairs_p],
            CStart::Zero,
        );
        for j in 0..keys_p {
            for h in 0..hp {
                let want: f32 = if j < keys {
                    (0..d).map(|i| qv(h, i).to_f32() * kv(j, i).to_f32()).sum()
                } else {
                    0.0
                };
                assert_eq!(s[j * hp + h], want, "s[{j}][{h}]");
            }
        }

        // P V: P in the softmax's layout [key pairs][hp], V packed [key pairs][lp].
        let lp = 48;
        let key_pairs = keys.div_ceil(2);
        let kp_p = key_pairs.next_multiple_of(TILE);
        let pv = |h: usize, j: usize| {
            if j < keys {
                bf16::from_f32((h + 2 * j) as f32 / 64.0)
            } else {
                bf16::ZERO
            }
        };
        let vv = |j: usize, c: usize| if j < keys { kv(j, c) } else { bf16::ZERO };
        let p: Vec<u32> = (0..key_pairs * hp)
            .map(|i| pair(pv(i % hp, 2 * (i / hp)), pv(i % hp, 2 * (i / hp) + 1)))
            .collect();
        let mut pt = vec![0u32; hp * kp_p];
        for h in 0..hp {
            for jp in 0..key_pairs {
                pt[h * kp_p + jp] = p[jp * hp + h];
            }
        }
        let mut v = vec![0u32; kp_p * lp];
        for jp in 0..key_pairs {
            for c in 0..lp {
                v[jp * lp + c] = pair(vv(2 * jp, c), vv(2 * jp + 1, c));
            }
        }
        let acc0 = |h: usize, c: usize| (h * 3 + c) as f32 / 16.0;
        let mut acc: Vec<f32> = (0..hp * lp).map(|i| acc0(i / lp, i % lp)).collect();
        product(
            &tiles,
            &ATiles::of(&pt, kp_p, hp),
            kp_p,
            &v,
            lp,
            &mut acc,
            lp,
            [hp, lp, kp_p],
            CStart::Load,
        );
        for h in 0..hp {
            for c in 0..lp {
                let dot: f64 = (0..keys)
                    .map(|j| f64::from(pv(h, j).to_f32()) * f64::from(vv(j, c).to_f32()))
                    .sum();
                let want = f64::from(acc0(h, c)) + dot;
                assert!(
                    (f64::from(acc[h * lp + c]) - want).abs() < 1e-5,
                    "acc[{h}][{c}]"
                );
            }
        }
    }

    #[test]
    fn blocks_cover_c_once_in_tiles() {
        for (m, n) in [(48, 32), (64, 80), (16, 16), (32, 48), (96, 16)] {
            let ldc = n + 8;
            let all: Vec<Block> = blocks(m, n, ldc).collect();
            let fours = all.iter().filter(|b| matches!(b, Block::Four(_))).count();
            assert_eq!(fours, (m / 32) * (n / 32), "{m} x {n}: 2 x 2 blocks");
            let mut seen = vec![0u8; m * ldc];
            for job in all.iter().flat_map(|b| b.tiles(ldc)) {
                let (i, j) = (job.c / ldc, job.c % ldc);
                assert_eq!((job.a, job.b), (i / TILE, j), "{m} x {n}: tile at {i}, {j}");
                for r in 0..TILE {
                    for x in 0..TILE {
                        seen[(i + r) * ldc + j + x] += 1;
                    }
                }
            }
            for i in 0..m {
                assert!(
                    seen[i * ldc..i * ldc + n].iter().all(|&x| x == 1),
                    "{m} x {n}: row {i}"
                );
            }
        }
    }
}
