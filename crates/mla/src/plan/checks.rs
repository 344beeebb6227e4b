//! The argument checks of a decode call, each naming the argument: dtypes, devices, shapes,
//! strides and the values known on the host.

use crate::args::host_scale;
use crate::config::ValidConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Location, TensorRef};

/// A per-tensor scale (`name`, given as `value` or a one-element `tensor`): the tensor's
/// dtype, shape and device (`location`) checked; when the decode `uses` the scale, a value on
/// the host must be finite and positive (`err` otherwise), and one in device memory is read
/// and checked by the kernels, which get `value` meanwhile. 1 when unused.
pub(super) fn checked_scale(
    name: &'static str,
    uses: bool,
    value: f32,
    tensor: Option<&TensorRef<'_, 1>>,
    location: Location,
    err: fn(f32) -> Error,
) -> Result<f32> {
    if let Some(t) = tensor {
        dtype(name, t.dtype(), DType::F32)?;
        shape(name, t.shape(), [Dim::Is(1)])?;
        on_device(name, t.location(), location)?;
    }
    match (uses, host_scale(value, tensor)) {
        (false, _) => Ok(1.0),
        (true, Some(k)) if k.is_finite() && k > 0.0 => Ok(k),
        (true, Some(k)) => Err(err(k)),
        (true, None) => Ok(value),
    }
}

/// The longest length in host seq_lens; an error for a negative one.
/// The longest of host lengths, each checked: not negative, not beyond the block table's
/// `max_blocks` pages of `page_size` keys.
pub(super) fn max_seq_len(lens: &[i32], max_blocks: usize, page_size: usize) -> Result<usize> {
    let capacity = max_blocks.saturating_mul(page_size);
    let mut max = 0usize;
    for (request, &len) in lens.iter().enumerate() {
        let len = usize::try_from(len).map_err(|_| Error::NegativeSeqLen { request, len })?;
        if len > capacity {
            return Err(Error::SeqLenBeyondBlockTable {
                request,
                len,
                capacity,
                max_blocks,
                page_size,
            });
        }
        max = max.max(len);
    }
    Ok(max)
}

/// An argument's memory must be where the backend runs.
pub(super) fn on_device(arg: &'static str, got: Location, want: Location) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::WrongDevice {
            arg,
            expected: want,
            got,
        })
    }
}

/// The cache checks a decode and its warmup share: memory at `location` (the backend's),
/// the storage dtype of the configured format, the shape `[num_blocks >= 1, page_size >= 1,
/// D]`, contiguous rows, and token and page strides under which no two keys overlap.
///
/// # Errors
/// [`Error::WrongDevice`], [`Error::Dtype`], [`Error::Shape`], [`Error::Stride`] for the
/// argument `kv_cache`.
pub(crate) fn check_kv_cache(
    cfg: &ValidConfig,
    kv: &crate::tensor::TensorRef<'_, 3>,
    location: Location,
) -> Result<()> {
    on_device("kv_cache", kv.location(), location)?;
    if !cfg.kv_format.accepts(kv.dtype()) {
        return Err(Error::Dtype {
            arg: "kv_cache",
            expected: format!(
                "{} (kv_cache_dtype {})",
                cfg.kv_format.expected_storage(),
                cfg.cache_dtype
            ),
            got: kv.dtype().to_string(),
        });
    }
    let d = cfg.head_dim();
    shape(
        "kv_cache",
        kv.shape(),
        [Dim::Any("num_blocks"), Dim::Any("page_size"), Dim::Is(d)],
    )?;
    let [num_blocks, page_size, _] = kv.shape();
    if num_blocks == 0 || page_size == 0 {
        return Err(Error::Shape {
            arg: "kv_cache",
            expected: format!("[num_blocks >= 1, page_size >= 1, {d}]"),
            got: kv.shape().to_vec(),
        });
    }
    let [page_stride, token_stride, _] = kv.strides();
    last_contiguous("kv_cache", kv.shape(), kv.strides())?;
    if page_size > 1 && token_stride < d {
        return Err(stride(
            "kv_cache",
            "keys of a page overlap: token stride < row width",
            &kv.strides(),
            &kv.shape(),
        ));
    }
    if num_blocks > 1 && page_stride < (page_size - 1) * token_stride + d {
        return Err(stride(
            "kv_cache",
            "pages overlap: page stride < (page_size - 1) * token stride + row width",
            &kv.strides(),
            &kv.shape(),
        ));
    }
    Ok(())
}

/// `arg`'s dtype is `want`, or [`Error::Dtype`] naming it.
pub(crate) fn dtype(arg: &'static str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Dtype {
            arg,
            expected: want.to_string(),
            got: got.to_string(),
        })
    }
}

/// One dimension of an expected shape: free (named in the message) or fixed.
#[derive(Clone, Copy)]
pub(super) enum Dim {
    Any(&'static str),
    Is(usize),
}

pub(super) fn shape<const N: usize>(
    arg: &'static str,
    got: [usize; N],
    want: [Dim; N],
) -> Result<()> {
    let ok = got.iter().zip(&want).all(|(&g, w)| match w {
        Dim::Any(_) => true,
        Dim::Is(n) => g == *n,
    });
    if ok {
        return Ok(());
    }
    let dims: Vec<String> = want
        .iter()
        .map(|w| match w {
            Dim::Any(name) => name.to_string(),
            Dim::Is(n) => n.to_string(),
        })
        .collect();
    Err(Error::Shape {
        arg,
        expected: format!("[{}]", dims.join(", ")),
        got: got.to_vec(),
    })
}

pub(super) fn last_contiguous<const N: usize>(
    arg: &'static str,
    shape: [usize; N],
    strides: [usize; N],
) -> Result<()> {
    if shape[N - 1] > 1 && strides[N - 1] != 1 {
        return Err(stride(
            arg,
            "the last dimension must be contiguous",
            &strides,
            &shape,
        ));
    }
    Ok(())
}

pub(super) fn stride(arg: &'static str, reason: &str, strides: &[usize], shape: &[usize]) -> Error {
    Error::Stride {
        arg,
        reason: reason.into(),
        strides: strides.to_vec(),
        shape: shape.to_vec(),
    }
}
