//! Every unsafe piece of the DCP code: its kernels' parameter struct as a launchable
//! argument (the launch is the backend's), and NCCL (communicator creation, all-gather,
//! reduce-scatter, grouped send/recv). Everything above is safe Rust.
#![allow(unsafe_code)]

use super::params::DcpParams;
use crate::backend::cuda::ffi::KernelParams;

// SAFETY: the mirror of `kernels/dcp/params.cuh` (size asserted in params.rs and the header);
// DcpDecode fills it with buffers sized at reserve for at least the rows and heads launched,
// and caller views checked (shape, dtype, device, alignment) before the launch.
unsafe impl KernelParams for DcpParams {}

#[cfg(feature = "nccl")]
pub(crate) use nccl::*;

#[cfg(feature = "nccl")]
mod nccl {
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
    use cudarc::nccl::{result, sys};

    use crate::error::{Error, Result};

    fn nccl_err(op: &'static str) -> impl Fn(result::NcclError) -> Error {
        move |e| Error::Nccl {
            op,
            detail: format!("{e:?}"),
        }
    }

    /// Whether an unversioned `libnccl.so` can be loaded (cudarc panics on first use
    /// otherwise; it does not look for the `libnccl.so.2` soname).
    pub(crate) fn nccl_present() -> std::result::Result<(), String> {
        // SAFETY: this only tries to dlopen the library by name.
        if unsafe { sys::is_culib_present() } {
            return Ok(());
        }
        Err(
            "NCCL (an unversioned libnccl.so) was not found on the library path; \
             for the pip wheel's libnccl.so.2, add a symlink named libnccl.so"
                .into(),
        )
    }

    /// NCCL's version code (e.g. 22809 for 2.28.9).
    pub(crate) fn nccl_version() -> Result<i32> {
        result::get_nccl_version().map_err(nccl_err("ncclGetVersion"))
    }

    /// A new unique id: what rank 0 makes and hands to the others.
    pub(crate) fn unique_id() -> Result<[u8; 128]> {
        let id = result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// A device buffer NCCL may read or write: its address and size, taken from a slice
    /// this crate owns (so the collectives below can check every count against it).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct DeviceBytes {
        ptr: u64,
        bytes: usize,
    }

    impl DeviceBytes {
        /// The whole of `slice`, ordered on `stream`.
        pub(crate) fn of<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> Self {
            DeviceBytes {
                ptr: slice.device_ptr(stream).0,
                bytes: slice.len() * std::mem::size_of::<T>(),
            }
        }

        /// The address.
        pub(crate) fn ptr(&self) -> u64 {
            self.ptr
        }

        fn check(&self, need: usize, op: &'static str) -> Result<()> {
            if need > self.bytes {
                return Err(Error::Nccl {
                    op,
                    detail: format!("{need} bytes asked of a {}-byte buffer", self.bytes),
                });
            }
            Ok(())
        }
    }

    /// An NCCL communicator, destroyed on drop.
    #[derive(Debug)]
    pub(crate) struct NcclComm(sys::ncclComm_t);

    // SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
    // overlap; `NcclComm` is only reached through `&mut self` of its one owner (a DcpGroup),
    // so moving it to another thread is sound (NCCL's docs: one thread per communicator).
    unsafe impl Send for NcclComm {}

    impl Drop for NcclComm {
        fn drop(&mut self) {
            // SAFETY: the handle came from a successful init and is destroyed once. Errors
            // cannot be reported from drop; the communicator is gone either way.
            let _ = unsafe { result::comm_destroy(self.0) };
        }
    }

    impl NcclComm {
        /// Joins the communicator of `id` as `rank` of `world` on the current device (bind its
        /// context first). Blocks until every rank has joined.
        pub(crate) fn init_rank(id: [u8; 128], world: usize, rank: usize) -> Result<NcclComm> {
            let world = i32::try_from(world).map_err(|_| Error::config("dcp", "world size"))?;
            let rank = i32::try_from(rank).map_err(|_| Error::config("dcp", "rank"))?;
            let id = sys::ncclUniqueId {
                internal: id.map(|b| b as core::ffi::c_char),
            };
            let mut comm = std::mem::MaybeUninit::uninit();
            // SAFETY: `comm` is a valid out-pointer; NCCL initializes it on success.
            unsafe { result::comm_init_rank(comm.as_mut_ptr(), world, id, rank) }
                .map_err(nccl_err("ncclCommInitRank"))?;
            // SAFETY: initialized by the successful call above.
            Ok(NcclComm(unsafe { comm.assume_init() }))
        }

        /// One communicator per device of `ordinals`, rank i on `ordinals[i]`, from one thread.
        pub(crate) fn init_all(ordinals: &[usize]) -> Result<Vec<NcclComm>> {
            let devs: Vec<i32> = ordinals
                .iter()
                .map(|&o| i32::try_from(o).map_err(|_| Error::config("dcp", "device ordinal")))
                .collect::<Result<_>>()?;
            let n = i32::try_from(devs.len()).map_err(|_| Error::config("dcp", "world size"))?;
            let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
            // SAFETY: `comms` has room for `n` handles and `devs` holds `n` ordinals.
            unsafe { result::comm_init_all(comms.as_mut_ptr(), n, devs.as_ptr()) }
                .map_err(nccl_err("ncclCommInitAll"))?;
            Ok(comms.into_iter().map(NcclComm).collect())
        }

        /// All-gathers `count` f32 from `send` into `recv` (`count` x world), on `stream`.
        /// The buffers must stay alive until the stream passes this call (the caller owns
        /// them for its whole life).
        pub(crate) fn all_gather_f32(
            &mut self,
            send: DeviceBytes,
            recv: DeviceBytes,
            count: usize,
            world: usize,
            stream: &CudaStream,
        ) -> Result<()> {
            send.check(count * 4, "ncclAllGather")?;
            recv.check(count * 4 * world, "ncclAllGather")?;
            let (send, recv) = (send.ptr, recv.ptr);
            // SAFETY: both buffers are device memory of this communicator's device, large
            // enough (checked above); the stream belongs to that device.
            unsafe {
                result::all_gather(
                    send as *const _,
                    recv as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    self.0,
                    stream.cu_stream() as _,
                )
            }
            .map(|_| ())
            .map_err(nccl_err("ncclAllGather"))
        }

        /// Sums `count` x world f32 of `send` over the ranks and keeps this rank's `count`.
        /// Buffers as for [`NcclComm::all_gather_f32`].
        pub(crate) fn reduce_scatter_sum_f32(
            &mut self,
            send: DeviceBytes,
            recv: DeviceBytes,
            count: usize,
            world: usize,
            stream: &CudaStream,
        ) -> Result<()> {
            send.check(count * 4 * world, "ncclReduceScatter")?;
            recv.check(count * 4, "ncclReduceScatter")?;
            let (send, recv) = (send.ptr, recv.ptr);
            // SAFETY: as in all_gather_f32.
            unsafe {
                result::reduce_scatter(
                    send as *const _,
                    recv as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    self.0,
                    stream.cu_stream() as _,
                )
            }
            .map(|_| ())
            .map_err(nccl_err("ncclReduceScatter"))
        }

        /// An all-to-all of byte slots: slot r of each `(send, recv, bytes)` goes to rank r, and
        /// rank r's slot of ours arrives in slot r of `recv`. One NCCL group for every buffer.
        /// Buffers as for [`NcclComm::all_gather_f32`].
        pub(crate) fn all_to_all_bytes(
            &mut self,
            world: usize,
            buffers: &[(DeviceBytes, DeviceBytes, usize)],
            stream: &CudaStream,
        ) -> Result<()> {
            for (send, recv, bytes) in buffers {
                send.check(bytes * world, "ncclSend")?;
                recv.check(bytes * world, "ncclRecv")?;
            }
            result::group_start().map_err(nccl_err("ncclGroupStart"))?;
            let mut first_error = Ok(());
            'peers: for peer in 0..world {
                for &(send, recv, bytes) in buffers {
                    let (send, recv) = (send.ptr, recv.ptr);
                    let at = (peer * bytes) as u64;
                    let p = peer as i32;
                    // SAFETY: slot `peer` lies inside both buffers (checked above), device memory of
                    // this communicator's device; the stream belongs to that device.
                    let r = unsafe {
                        result::send(
                            (send + at) as *const _,
                            bytes,
                            sys::ncclDataType_t::ncclUint8,
                            p,
                            self.0,
                            stream.cu_stream() as _,
                        )
                        .and_then(|_| {
                            result::recv(
                                (recv + at) as *mut _,
                                bytes,
                                sys::ncclDataType_t::ncclUint8,
                                p,
                                self.0,
                                stream.cu_stream() as _,
                            )
                        })
                    };
                    if let Err(e) = r {
                        first_error = Err(nccl_err("ncclSend/ncclRecv")(e));
                        break 'peers;
                    }
                }
            }
            // The group must be closed whatever happened inside it.
            let end = result::group_end().map_err(nccl_err("ncclGroupEnd"));
            first_error.and(end.map(|_| ()))
        }
    }
}
