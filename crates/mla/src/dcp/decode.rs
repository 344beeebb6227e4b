//! [`DcpDecode`]: one rank's decode under decode context parallelism (docs/dcp.md).
//!
//! The rank receives the query of all H N heads, the global `seq_lens`, and its own shard of
//! the cache (its tokens at their local positions, its block table). A decode is:
//! 1. `dcp_local_seq_lens`: the local lengths from the global ones (on the device, so a
//!    captured graph stays right when the lengths change);
//! 2. the ordinary decode ([`MlaDecode`]) of the H N heads over the local keys, into this
//!    rank's buffers: o `[rows, H N, L]` in the model dtype, lse `[rows, H N]` f32;
//! 3. the merge by LSE over NCCL, in f32, ending with this rank's H heads in the caller's o
//!    and lse: an all-to-all of (o, lse) followed by a local merge (default), or an
//!    all-gather of lse + reduce-scatter of the weighted o ([`DcpMerge`]).
//!
//! Everything runs on the decoder's stream; nothing waits for the device and nothing is
//! allocated after [`DcpDecode::reserve`].

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::ffi::DeviceBytes;
use super::group::DcpGroup;
use super::kernels::DcpKernels;
use super::params::DcpParams;
use crate::args::{DecodeInputs, DecodeOutputs};
use crate::backend::cuda::address;
use crate::backend::cuda::ffi::launch;
use crate::dtype::{CacheDtype, DType};
use crate::error::{Error, Result};
use crate::synth::device::DeviceHalf;
use crate::tensor::{Location, TensorMut, TensorRef};
use crate::{DecodePlan, Device, MlaConfig, MlaDecode};

/// How the ranks exchange their partial outputs. The all-to-all is the default: it was the
/// faster of the two in every measurement on two H200s (BENCHMARKS.md: 54 against 77 us at
/// 64 x 128k keys and 128 heads, 21 against 23 us at 8 x 512k and 16 heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DcpMerge {
    /// All-gather of lse (rows x H N f32), then a reduce-scatter (sum) of the weighted o in
    /// f32: N x rows x H x L f32 sent per rank.
    AllGatherReduceScatter,
    /// An all-to-all of each head's o (model dtype) and lse to the rank that keeps it, then
    /// a local merge: half the bytes of the reduce-scatter with a 16-bit model dtype.
    #[default]
    AllToAll,
}

/// The bytes of a model-dtype buffer, for NCCL.
fn half_bytes(h: &DeviceHalf, s: &CudaStream) -> DeviceBytes {
    match h {
        DeviceHalf::Bf16(v) => DeviceBytes::of(v, s),
        DeviceHalf::F16(v) => DeviceBytes::of(v, s),
    }
}

/// The rank's buffers, sized by [`DcpDecode::reserve`] for one merge: the other merge's
/// buffers hold one element (the all-gather + reduce-scatter's f32 partials are twice the
/// size of all of o).
#[derive(Debug)]
struct Buffers {
    merge: DcpMerge,
    max_rows: usize,
    max_requests: usize,
    local_lens: CudaSlice<i32>,
    part_o: DeviceHalf,
    part_lse: CudaSlice<f32>,
    lse_all: CudaSlice<f32>,
    scaled_o: CudaSlice<f32>,
    summed_o: CudaSlice<f32>,
    packed_o: DeviceHalf,
    packed_lse: CudaSlice<f32>,
    gathered_o: DeviceHalf,
    gathered_lse: CudaSlice<f32>,
}

/// One rank of a DCP decode: an [`MlaDecode`] for the H N heads over local keys, the DCP
/// kernels, the buffers, and the group.
#[derive(Debug)]
pub struct DcpDecode {
    group: DcpGroup,
    decoder: MlaDecode,
    kernels: DcpKernels,
    merge: DcpMerge,
    bufs: Option<Buffers>,
    /// Rows attended by [`DcpDecode::attend`] and not merged yet.
    pending_rows: Option<usize>,
}

impl DcpDecode {
    /// A rank's decoder: `config.num_heads` is H, the heads this rank keeps (the query
    /// carries H N); `config.dcp_world_size` is 1 or the group's N.
    ///
    /// # Errors
    /// The configuration errors of [`MlaDecode::new`] (sliding window with DCP among them),
    /// [`Error::InvalidConfig`] for a world size other than the group's, [`Error::Compile`].
    pub fn new(config: &MlaConfig, group: DcpGroup) -> Result<Self> {
        let n = group.world_size();
        if config.dcp_world_size != 1 && config.dcp_world_size != n {
            return Err(Error::config(
                "dcp_world_size",
                format!(
                    "{} does not match the group's world size {n}",
                    config.dcp_world_size
                ),
            ));
        }
        if !config.kv_lora_rank.is_multiple_of(8) {
            return Err(Error::config(
                "kv_lora_rank",
                "the DCP merge needs a multiple of 8",
            ));
        }
        let mut cfg = config.clone();
        cfg.dcp_world_size = n;
        let decoder = MlaDecode::new(&cfg, Device::Cuda(group.ordinal()))?;
        let cuda = decoder
            .cuda_backend()
            .ok_or_else(|| Error::NoCudaDevice("not a GPU decoder".into()))?;
        let kernels = DcpKernels::load(cuda.context(), cuda.target(), cfg.model_dtype)?;
        Ok(DcpDecode {
            group,
            decoder,
            kernels,
            merge: DcpMerge::default(),
            bufs: None,
            pending_rows: None,
        })
    }

    /// The inner decoder (its configuration, stream, device).
    pub fn decoder(&self) -> &MlaDecode {
        &self.decoder
    }

    /// The inner decoder, mutable (to check device-side errors).
    pub fn decoder_mut(&mut self) -> &mut MlaDecode {
        &mut self.decoder
    }

    /// The group.
    pub fn group(&self) -> &DcpGroup {
        &self.group
    }

    /// The stream everything is launched on.
    ///
    /// # Errors
    /// Never for a decoder made by [`DcpDecode::new`].
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        self.decoder
            .cuda_stream()
            .cloned()
            .ok_or_else(|| Error::NoCudaDevice("not a GPU decoder".into()))
    }

    /// The merge in use.
    pub fn merge_kind(&self) -> DcpMerge {
        self.merge
    }

    /// Chooses the merge (every rank of the group must choose the same). The buffers are
    /// sized for one merge: choose it before [`DcpDecode::reserve`], or reserve again.
    pub fn set_merge(&mut self, merge: DcpMerge) {
        self.merge = merge;
    }

    /// Reserves for the worst case: `max_rows` query rows over `max_requests` requests of
    /// up to `max_model_len` global keys; sizes the inner workspace (for the longest local
    /// length) and this rank's buffers, then locks both.
    ///
    /// # Errors
    /// [`Error::Overflow`], [`Error::Driver`] when the memory is not there,
    /// [`Error::WorkspaceLocked`].
    pub fn reserve(
        &mut self,
        max_rows: usize,
        max_requests: usize,
        max_model_len: usize,
    ) -> Result<()> {
        // Rank 0 holds the most keys of any length.
        let local_max =
            super::layout::DcpLayout::new(0, self.group.world_size(), self.group.interleave())?
                .local_len(max_model_len);
        self.decoder.reserve_workspace(max_rows, local_max)?;
        self.decoder.lock_workspace();
        let s = self.stream()?;
        let c = self.decoder.config();
        let (n, h, l, dtype) = (
            self.group.world_size(),
            c.num_heads,
            c.kv_lora_rank,
            c.model_dtype,
        );
        let overflow = || Error::Overflow {
            what: "dcp buffers",
            detail: format!("{max_rows} rows x {n} x {h} heads x {l}"),
        };
        let heads_all = n.checked_mul(h).ok_or_else(overflow)?;
        let lse_n = max_rows.checked_mul(heads_all).ok_or_else(overflow)?;
        let o_n = lse_n.checked_mul(l).ok_or_else(overflow)?;
        let f32s = |k: usize| -> Result<CudaSlice<f32>> {
            s.alloc_zeros::<f32>(k.max(1))
                .map_err(Error::driver("allocate a dcp buffer"))
        };
        // Only the chosen merge's buffers get their size.
        let ag = self.merge == DcpMerge::AllGatherReduceScatter;
        let (ag_n, a2a_n) = (usize::from(ag), usize::from(!ag));
        let bufs = Buffers {
            merge: self.merge,
            max_rows,
            max_requests,
            local_lens: s
                .alloc_zeros::<i32>(max_requests.max(1))
                .map_err(Error::driver("allocate a dcp buffer"))?,
            part_o: DeviceHalf::zeros(&s, dtype, o_n, "allocate a dcp buffer")?,
            part_lse: f32s(lse_n)?,
            lse_all: f32s(ag_n * lse_n.checked_mul(n).ok_or_else(overflow)?)?,
            scaled_o: f32s(ag_n * o_n)?,
            summed_o: f32s(ag_n * (o_n / n))?,
            packed_o: DeviceHalf::zeros(&s, dtype, a2a_n * o_n, "allocate a dcp buffer")?,
            packed_lse: f32s(a2a_n * lse_n)?,
            gathered_o: DeviceHalf::zeros(&s, dtype, a2a_n * o_n, "allocate a dcp buffer")?,
            gathered_lse: f32s(a2a_n * lse_n)?,
        };
        s.synchronize().map_err(Error::driver("synchronize"))?;
        self.bufs = Some(bufs);
        Ok(())
    }

    /// Compiles and loads every decode kernel forward can pick for this cache (see
    /// [`MlaDecode::register_decode_warmup`]).
    ///
    /// # Errors
    /// As [`MlaDecode::register_decode_warmup`].
    pub fn register_decode_warmup(
        &mut self,
        kv_cache: &TensorRef<'_, 3>,
        kv_cache_dtype: CacheDtype,
    ) -> Result<Vec<usize>> {
        self.decoder
            .register_decode_warmup(kv_cache, kv_cache_dtype)
    }

    /// The whole DCP decode: [`DcpDecode::attend`] then [`DcpDecode::merge`]. `inputs`
    /// carry the query of all H N heads, this rank's cache and block table, the global
    /// `seq_lens` (device, i32) and the batch's longest global length in `max_seq_len`;
    /// `outputs` receive this rank's H heads: o `[rows, H, L]` (16-byte aligned, strides
    /// multiples of 8) and lse `[rows, H]`. Every rank must call it with the same rows.
    ///
    /// # Errors
    /// As [`DcpDecode::attend`] and [`DcpDecode::merge`].
    pub fn forward(
        &mut self,
        inputs: &DecodeInputs<'_>,
        outputs: &mut DecodeOutputs<'_>,
    ) -> Result<DecodePlan> {
        // The outputs are checked once, before anything runs.
        let rows = inputs.q.rows();
        let (o_ptr, lse_ptr) = check_outputs(self, rows, outputs)?;
        let plan = self.attend(inputs)?;
        self.pending_rows = None;
        self.merge_checked(rows, outputs, o_ptr, lse_ptr)?;
        Ok(plan)
    }

    /// Steps 1 and 2: local lengths, then the decode of the H N heads over the local keys
    /// into this rank's buffers. Returns the local plan.
    ///
    /// # Errors
    /// [`Error::NotReserved`] before [`DcpDecode::reserve`] or beyond it; argument errors of
    /// the seq_lens and of [`MlaDecode::forward`] (causal multi-token decode with DCP among
    /// them).
    pub fn attend(&mut self, inputs: &DecodeInputs<'_>) -> Result<DecodePlan> {
        let s = self.stream()?;
        let layout = *self.group.layout();
        let ordinal = self.group.ordinal();
        let c = self.decoder.config();
        let (hn, l) = (c.q_heads, c.kv_lora_rank);
        let rows = inputs.q.rows();
        let bufs = self
            .bufs
            .as_mut()
            .ok_or(Error::NotReserved("DcpDecode::attend"))?;
        let requests = inputs.seq_lens.shape()[0];
        if rows > bufs.max_rows || requests > bufs.max_requests {
            return Err(Error::NotReserved(
                "DcpDecode::attend (more rows or requests than reserved)",
            ));
        }
        let global_lens = device_ptr_on(
            "seq_lens",
            inputs.seq_lens.device_ptr(),
            ordinal,
            inputs.seq_lens.location(),
        )?;
        if inputs.seq_lens.dtype() != DType::I32
            || (requests > 1 && inputs.seq_lens.strides()[0] != 1)
        {
            return Err(Error::Dtype {
                arg: "seq_lens",
                expected: "contiguous i32".into(),
                got: inputs.seq_lens.dtype().to_string(),
            });
        }
        let max_global = inputs.max_seq_len.ok_or_else(|| {
            Error::config(
                "max_seq_len",
                "a DCP decode needs the batch's longest global length (max_seq_len)",
            )
        })?;
        let params = DcpParams {
            seq_lens_global: global_lens,
            seq_lens_local: address(&bufs.local_lens, &s),
            requests: i32::try_from(requests).map_err(|_| too_many("requests", requests))?,
            world: layout.world_size() as i32,
            rank: layout.rank() as i32,
            interleave: layout.interleave() as i32,
            ..DcpParams::default()
        };
        if requests > 0 {
            let blocks = requests.div_ceil(128) as u32;
            launch(
                &s,
                &self.kernels.local_seq_lens,
                (blocks, 1),
                (128, 1),
                0,
                &params,
            )?;
        }
        let local_inputs = DecodeInputs {
            seq_lens: TensorRef::from_cuda(&bufs.local_lens, [requests], [1])?,
            max_seq_len: Some(layout.local_len(max_global)),
            ..*inputs
        };
        let mut part = DecodeOutputs {
            o: bufs.part_o.view_mut([rows, hn, l])?,
            lse: TensorMut::from_cuda(&mut bufs.part_lse, [rows, hn], [hn, 1])?,
        };
        let plan = self.decoder.forward(&local_inputs, &mut part)?;
        self.pending_rows = Some(rows);
        Ok(plan)
    }

    /// Step 3: the merge by LSE over NCCL into this rank's H heads of `outputs`.
    ///
    /// # Errors
    /// [`Error::NotReserved`] with no attended decode to merge, output argument errors,
    /// [`Error::Nccl`], [`Error::Driver`].
    pub fn merge(&mut self, outputs: &mut DecodeOutputs<'_>) -> Result<()> {
        let rows = self
            .pending_rows
            .ok_or(Error::NotReserved("DcpDecode::merge (nothing attended)"))?;
        let (o_ptr, lse_ptr) = check_outputs(self, rows, outputs)?;
        self.pending_rows = None;
        self.merge_checked(rows, outputs, o_ptr, lse_ptr)
    }

    /// The merge of `rows` attended rows into outputs already checked (their device
    /// addresses `o_ptr`, `lse_ptr`).
    fn merge_checked(
        &mut self,
        rows: usize,
        outputs: &DecodeOutputs<'_>,
        o_ptr: u64,
        lse_ptr: u64,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let s = self.stream()?;
        let c = self.decoder.config();
        let (h, l) = (c.num_heads, c.kv_lora_rank);
        let layout = *self.group.layout();
        let n = layout.world_size();
        let bufs =
            self.bufs
                .as_mut()
                .filter(|b| b.merge == self.merge)
                .ok_or(Error::NotReserved(
                    "DcpDecode::merge (for the merge chosen: reserve after set_merge)",
                ))?;
        let [o_row, o_head, _] = outputs.o.strides();
        let params = DcpParams {
            part_o: half_bytes(&bufs.part_o, &s).ptr(),
            part_lse: address(&bufs.part_lse, &s),
            lse_all: address(&bufs.lse_all, &s),
            scaled_o: address(&bufs.scaled_o, &s),
            summed_o: address(&bufs.summed_o, &s),
            packed_o: half_bytes(&bufs.packed_o, &s).ptr(),
            packed_lse: address(&bufs.packed_lse, &s),
            gathered_o: half_bytes(&bufs.gathered_o, &s).ptr(),
            gathered_lse: address(&bufs.gathered_lse, &s),
            o: o_ptr,
            o_row: o_row as i64,
            o_head: o_head as i64,
            lse: lse_ptr,
            lse_row: outputs.lse.strides()[0] as i64,
            rows: i32::try_from(rows).map_err(|_| too_many("rows", rows))?,
            heads: h as i32,
            world: n as i32,
            rank: layout.rank() as i32,
            interleave: layout.interleave() as i32,
            kv_lora_rank: l as i32,
            ..DcpParams::default()
        };
        let all_heads = ((h * n).div_ceil(4) as u32).max(1);
        let own_heads = (h.div_ceil(4) as u32).max(1);
        // A merge kernel over `y` blocks of 4 heads, a CTA per row.
        let run = |kernel, y| launch(&s, kernel, (rows as u32, y), (64, 4), 0, &params);
        let comm = &mut self.group.comm;
        match self.merge {
            DcpMerge::AllGatherReduceScatter => {
                let (part_lse, lse_all) = (
                    DeviceBytes::of(&bufs.part_lse, &s),
                    DeviceBytes::of(&bufs.lse_all, &s),
                );
                comm.all_gather_f32(part_lse, lse_all, rows * h * n, n, &s)?;
                run(&self.kernels.scale_partials, all_heads)?;
                let (scaled, summed) = (
                    DeviceBytes::of(&bufs.scaled_o, &s),
                    DeviceBytes::of(&bufs.summed_o, &s),
                );
                comm.reduce_scatter_sum_f32(scaled, summed, rows * h * l, n, &s)?;
                run(&self.kernels.finish_sum, own_heads)?;
            }
            DcpMerge::AllToAll => {
                run(&self.kernels.pack, all_heads)?;
                let slot_o = rows * h * l * 2; // 16-bit model dtype
                let slot_lse = rows * h * 4;
                let buffers = [
                    (
                        half_bytes(&bufs.packed_o, &s),
                        half_bytes(&bufs.gathered_o, &s),
                        slot_o,
                    ),
                    (
                        DeviceBytes::of(&bufs.packed_lse, &s),
                        DeviceBytes::of(&bufs.gathered_lse, &s),
                        slot_lse,
                    ),
                ];
                comm.all_to_all_bytes(n, &buffers, &s)?;
                run(&self.kernels.merge_gathered, own_heads)?;
            }
        }
        Ok(())
    }
}

fn too_many(what: &'static str, n: usize) -> Error {
    Error::Overflow {
        what,
        detail: format!("{n} does not fit in i32"),
    }
}

fn device_ptr_on(arg: &'static str, ptr: Option<u64>, ordinal: usize, at: Location) -> Result<u64> {
    match ptr {
        Some(p) if at == Location::Cuda(ordinal) => Ok(p),
        _ => Err(Error::WrongDevice {
            arg,
            expected: Location::Cuda(ordinal),
            got: at,
        }),
    }
}

/// Checks this rank's outputs for `rows` query rows and returns (o, lse) addresses.
fn check_outputs(dec: &DcpDecode, rows: usize, out: &DecodeOutputs<'_>) -> Result<(u64, u64)> {
    let c = dec.decoder.config();
    let (h, l) = (c.num_heads, c.kv_lora_rank);
    let ordinal = dec.group.ordinal();
    let o = device_ptr_on("o", out.o.device_ptr(), ordinal, out.o.location())?;
    let lse = device_ptr_on("lse", out.lse.device_ptr(), ordinal, out.lse.location())?;
    crate::plan::dtype("o", out.o.dtype(), c.model_dtype.storage())?;
    crate::plan::dtype("lse", out.lse.dtype(), DType::F32)?;
    if out.o.shape() != [rows, h, l] {
        return Err(Error::Shape {
            arg: "o",
            expected: format!("[{rows}, {h}, {l}] (this rank's heads)"),
            got: out.o.shape().to_vec(),
        });
    }
    if out.lse.shape() != [rows, h] {
        return Err(Error::Shape {
            arg: "lse",
            expected: format!("[{rows}, {h}]"),
            got: out.lse.shape().to_vec(),
        });
    }
    let [or, oh, oc] = out.o.strides();
    if oc != 1 || o % 16 != 0 || or % 8 != 0 || oh % 8 != 0 || (h > 1 && out.lse.strides()[1] != 1)
    {
        return Err(Error::Stride {
            arg: "o",
            reason: "the DCP merge writes o in 16-byte units: a 16-byte aligned address, \
                     strides multiples of 8, contiguous last dimensions of o and lse"
                .into(),
            strides: out.o.strides().to_vec(),
            shape: out.o.shape().to_vec(),
        });
    }
    Ok((o, lse))
}
