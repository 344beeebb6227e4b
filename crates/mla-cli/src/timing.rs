//! What the timing paths share: a timed run's result and the median of timings. The CPU and
//! GPU timers (`bench`, `gpu_timing`) and the DCP benchmark (`dcp_bench`) all report through
//! these, so none of them depends on another's module.

/// What one timing run gave: the plan, the checked run's outputs (dense, f32) and the time.
pub struct Timed {
    pub plan: mla::DecodePlan,
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
    pub secs: f64,
}

/// The median of timings (the upper one of an even count); NaN for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_is_the_middle_or_the_upper_middle() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(Vec::new()).is_nan());
    }
}
