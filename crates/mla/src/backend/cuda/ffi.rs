//! Every unsafe call of the CUDA backend: library presence, NVRTC to a cubin with in-memory
//! headers, tensor maps for the TMA unit, and kernel launches. Everything above this module is safe Rust.
#![allow(unsafe_code)]

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::params::{DecodeParams, ScheduleParams, TensorMap, TmaParams, TmaScheduleParams};
use crate::error::{Error, Result};
use crate::kernels::variant::TmaBox;

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise). Enough to compile.
pub fn nvrtc_present() -> std::result::Result<(), String> {
    // SAFETY: this only tries to dlopen the library by name.
    if unsafe { nvrtc_sys::is_culib_present() } {
        return Ok(());
    }
    Err(
        "NVRTC (libnvrtc.so.13) was not found; install the CUDA 13 toolkit or the \
         nvidia-cuda-nvrtc wheel and put it on the library path"
            .into(),
    )
}

/// Whether libcuda and libnvrtc can be loaded: what opening a device needs.
pub fn libraries_present() -> std::result::Result<(), String> {
    // SAFETY: this only tries to dlopen the library by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so.1) was not found".into());
    }
    nvrtc_present()
}

/// Turns cudarc's per-slice event bookkeeping off for a context: every decode runs on one
/// stream, ordered by the stream itself, and events would break graph capture.
pub fn disable_event_tracking(ctx: &Arc<cudarc::driver::CudaContext>) {
    // SAFETY: called right after the context is created, before any slice or stream exists
    // whose synchronization could depend on the tracking.
    unsafe { ctx.disable_event_tracking() };
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Compile {
            kernel: "nvrtcVersion".into(),
            log: e.to_string(),
        })?;
    Ok((major, minor))
}

/// What NVRTC produced: the cubin and the compiler's log (ptxas resource lines included).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

fn log_of(prog: nvrtc_sys::nvrtcProgram) -> String {
    // SAFETY: `prog` is a live program.
    let raw = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `source` (named `name`) with the given in-memory headers to a cubin.
///
/// # Errors
/// [`Error::Compile`] with NVRTC's log.
pub fn compile_cubin(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
) -> Result<Compiled> {
    let fail = |log: String| Error::Compile {
        kernel: name.to_string(),
        log,
    };
    let cstr = |s: &str| CString::new(s).map_err(|_| fail(format!("a NUL byte in {s:.40}")));
    let src = cstr(source)?;
    let cname = cstr(name)?;
    let header_src: Vec<CString> = headers
        .iter()
        .map(|(_, s)| cstr(s))
        .collect::<Result<_>>()?;
    let header_names: Vec<CString> = headers
        .iter()
        .map(|(n, _)| cstr(n))
        .collect::<Result<_>>()?;
    let src_ptrs: Vec<*const c_char> = header_src.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();

    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a live NUL-terminated string that outlives the program (the
    // CStrings above are dropped after destroy_program); the header arrays have equal lengths.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as c_int,
            src_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| fail(e.to_string()))?;
    // SAFETY: nvrtcCreateProgram succeeded and initialized `prog`.
    let prog = unsafe { prog.assume_init() };

    // SAFETY: `prog` is live until destroy_program below.
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    let log = log_of(prog);
    let result = compiled.map_err(|_| fail(log.clone())).and_then(|()| {
        let mut size = 0usize;
        // SAFETY: `prog` compiled; `size` and the buffer are valid for the sizes NVRTC reports.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| fail(e.to_string()))?;
        let mut cubin = vec![0u8; size];
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| fail(e.to_string()))?;
        Ok(Compiled {
            cubin,
            log: log.clone(),
        })
    });
    // SAFETY: `prog` is live and destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// The one by-value argument of a kernel family of this crate: a `#[repr(C)]` mirror, field
/// for field, of the family's parameter struct in `kernels/` (sizes checked on both sides).
///
/// # Safety
/// Implement only for such a mirror, whose every address the launching code has checked
/// (the plan and the backend for [`DecodeParams`]; `DcpDecode`'s reservation and argument
/// checks for the DCP parameters).
pub(crate) unsafe trait KernelParams {}

// SAFETY: the mirror of `kernels/params.cuh` (size asserted in params.rs and the header).
unsafe impl KernelParams for DecodeParams {}
// SAFETY: the mirror of `struct TmaParams` in kernels/common/tma.cuh (size and
// offsets asserted in params.rs and the kernel); its tensor map covers the same cache as `d`.
unsafe impl KernelParams for TmaParams {}
// SAFETY: the mirror of `struct ScheduleParams` in kernels/schedule/kernel.cu (size and
// offsets asserted in params.rs and the kernel); its output pointers are device buffers of
// the lengths the kernel writes (`CudaBackend::schedule`).
unsafe impl KernelParams for ScheduleParams {}
// SAFETY: the mirror of `struct TmaScheduleParams` in kernels/common/tma.cuh (size and
// offset asserted in params.rs and the kernel): a ScheduleParams as above and the tensor map
// of the cache of its `d`.
unsafe impl KernelParams for TmaScheduleParams {}

/// A 3-D tensor in global memory as the TMA unit reads it: `dims` (innermost first) with
/// `strides` in bytes for dims 1 and 2 (multiples of 16), copied in boxes of `boxes`
/// elements, landing as `landing` says: in the 128-byte swizzle (the innermost box is then 128
/// bytes, 64 16-bit elements or 128 fp8 codes: the wgmma operand, K-major for fp8) or as they
/// are. Parts of a box outside the tensor read as zeros.
///
/// # Errors
/// [`Error::Driver`] if the driver refuses the description.
pub(crate) fn tensor_map_3d(
    base: u64,
    element_bytes: usize,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
    landing: TmaBox,
) -> Result<TensorMap> {
    use cudarc::driver::sys;
    let dtype = if element_bytes == 2 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8
    };
    let swizzle = match landing {
        TmaBox::Swizzled128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        TmaBox::Codes64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let element_strides = [1u32; 3];
    // SAFETY: every pointer is to a live local array of the rank's length (3 dims, 2
    // strides, 3 box sizes, 3 element strides) or to `map`, which the call fills. The driver
    // only encodes the description (it checks alignment and bounds and returns an error
    // for what it refuses); nothing is read at `base` until a kernel copies with the map, and
    // the caller describes a tensor whose every address its checks cover.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            3,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(Error::driver("encode the cache's tensor map"))?;
        Ok(TensorMap(map.assume_init().opaque))
    }
}

/// Launches `func` with `params` as its one argument. Straight to the driver (cudarc's
/// launch builder collects arguments in a `Vec`): the decode path allocates nothing.
///
/// # Errors
/// [`Error::Driver`] if the launch is refused.
pub(crate) fn launch<P: KernelParams>(
    stream: &CudaStream,
    func: &CudaFunction,
    grid: (u32, u32),
    block: (u32, u32),
    smem: u32,
    params: &P,
) -> Result<()> {
    launch_with(
        stream,
        func,
        (grid.0, grid.1, 1),
        block,
        smem,
        params,
        false,
    )
}

/// [`launch`] on a grid of three dimensions, or with `dependent` a programmatic dependent
/// launch (sm_90 and up): the kernel
/// may start before the previous one on the stream has finished, once all of that one's CTAs
/// have signalled (`griddepcontrol.launch_dependents`); it must wait
/// (`griddepcontrol.wait`) before it reads what the previous one writes. Its launch latency
/// then hides behind the previous kernel.
///
/// # Errors
/// [`Error::Driver`] if the launch is refused.
pub(crate) fn launch_with<P: KernelParams>(
    stream: &CudaStream,
    func: &CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32),
    smem: u32,
    params: &P,
    dependent: bool,
) -> Result<()> {
    use cudarc::driver::sys;
    stream
        .context()
        .bind_to_thread()
        .map_err(Error::driver("bind the context"))?;
    let mut args = [params as *const P as *mut c_void];
    // SAFETY: a plain-old-data attribute: the union is zeroed, then one int member set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: dependent as u32,
    };
    // SAFETY: every kernel of this crate takes exactly one parameter struct by value, and
    // `P: KernelParams` is its mirror; `args` holds its address and `config` the attribute's,
    // both outliving the call, which copies them. The addresses in the parameters were checked
    // by the code that filled them (see KernelParams: shapes, strides, bounds, alignment,
    // buffer sizes); the kernels bound-check every block id they read. `func` belongs to the
    // stream's context, bound above.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(Error::driver("launch"))
}
