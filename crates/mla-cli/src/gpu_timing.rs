//! Timing on the GPU the way a serving engine runs decode, and the way the side-by-side
//! anchors benchmark times every implementation (Triton's `do_bench_cudagraph`): the decode is
//! captured `n` times back to back in one CUDA graph, `n` chosen so that a replay lasts about
//! 100 ms; each replay is timed with CUDA events; the median replay over `n` is the time.

use std::sync::Arc;

use mla::cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use mla::cudarc::driver::{CudaGraph, CudaStream};
use mla::synth::Problem;
use mla::synth::device::DeviceOutputs;
use mla::{DecodeInputs, DecodePlan, Error, MlaDecode};

use crate::timing::{Timed, median};

/// Captures `n` decodes in one graph.
fn capture(
    dec: &mut MlaDecode,
    s: &Arc<CudaStream>,
    inputs: &DecodeInputs<'_>,
    out: &mut DeviceOutputs,
    n: usize,
) -> mla::Result<CudaGraph> {
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(Error::driver("begin graph capture"))?;
    let mut result = Ok(());
    for _ in 0..n {
        result = out
            .views()
            .and_then(|mut o| dec.forward(inputs, &mut o).map(|_| ()));
        if result.is_err() {
            break;
        }
    }
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(Error::driver("end graph capture"));
    result?;
    graph?.ok_or_else(|| Error::NoCudaDevice("an empty graph was captured".into()))
}

/// Milliseconds of each of `replays` replays of `graph`.
fn replay_ms(s: &Arc<CudaStream>, graph: &CudaGraph, replays: usize) -> mla::Result<Vec<f64>> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut ms = Vec::with_capacity(replays);
    for _ in 0..replays {
        let start = s
            .record_event(flags)
            .map_err(Error::driver("record an event"))?;
        graph.launch().map_err(Error::driver("replay the graph"))?;
        let end = s
            .record_event(flags)
            .map_err(Error::driver("record an event"))?;
        ms.push(
            start
                .elapsed_ms(&end)
                .map_err(Error::driver("read the events"))? as f64,
        );
    }
    Ok(ms)
}

/// Uploads the problem, warms the decoder up, checks one decode, then times graph replays.
pub fn time(dec: &mut MlaDecode, p: &Problem, replays: usize) -> mla::Result<Timed> {
    let s = dec
        .cuda_stream()
        .cloned()
        .ok_or_else(|| Error::NoCudaDevice("not a GPU decoder".into()))?;
    let dp = p.to_device(&s)?;
    let mut out = DeviceOutputs::poisoned(&s, p)?;
    // These carry the batch's longest length, as vLLM's metadata does.
    let inputs = dp.inputs(p, false)?;
    let cache_dtype = dec.config().cache_dtype;
    dec.register_decode_warmup(&inputs.kv_cache, cache_dtype)?;
    let plan: DecodePlan = dec.forward(&inputs, &mut out.views()?)?;
    dec.check_device_errors()?;
    let (o, lse) = out.download(&s)?;

    let one = capture(dec, &s, &inputs, &mut out, 1)?;
    let estimate = median(replay_ms(&s, &one, 5)?).max(1e-3);
    let n = ((100.0 / estimate) as usize).clamp(1, 1000);
    let graph = capture(dec, &s, &inputs, &mut out, n)?;
    let per_call: Vec<f64> = replay_ms(&s, &graph, replays)?
        .into_iter()
        .map(|ms| ms / n as f64)
        .collect();
    dec.check_device_errors()?;
    Ok(Timed {
        plan,
        o,
        lse,
        secs: median(per_call) / 1e3,
    })
}
