//! The scheduler kernel against its reference: on random batches (lengths from none to
//! 40k keys, negative ones, 1 to 4 causal or non-causal tokens, windows, tokens packed, one
//! or two head blocks) the device's schedule must equal `Schedule::build` of the same jobs,
//! integer for integer. Skips (saying why) without a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::{Case, gpu, spec};
use mla::Mask;
use mla::plan::schedule::{Jobs, MIN_BLOCKS, SEGMENT_COST, Schedule};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// One batch and the schedule's shape.
struct Batch {
    lens: Vec<i32>,
    query_len: usize,
    mask: Mask,
    window: Option<usize>,
    tokens_per_cta: usize,
    head_blocks: usize,
    ctas: usize,
    cost: usize,
    min_blocks: usize,
}

impl Batch {
    /// A batch of `lens` of one causal token a request, one head block, on an H200's 132
    /// CTAs with the default costs.
    fn h200(lens: Vec<i32>) -> Batch {
        Batch {
            lens,
            query_len: 1,
            mask: Mask::Causal,
            window: None,
            tokens_per_cta: 1,
            head_blocks: 1,
            ctas: 132,
            cost: SEGMENT_COST,
            min_blocks: MIN_BLOCKS,
        }
    }

    fn random(rng: &mut StdRng) -> Batch {
        let n = rng.random_range(1..600);
        let lens = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => 0,
                1 => -3,
                2 => rng.random_range(1..200),
                _ => rng.random_range(1..40_000),
            })
            .collect();
        let query_len = rng.random_range(1..5);
        Batch {
            lens,
            query_len,
            mask: if rng.random_bool(0.5) {
                Mask::Causal
            } else {
                Mask::NonCausal
            },
            window: rng.random_bool(0.3).then(|| rng.random_range(1..5000)),
            tokens_per_cta: rng.random_range(1..=query_len),
            head_blocks: rng.random_range(1..3),
            ctas: rng.random_range(1..300),
            cost: rng.random_range(0..5),
            min_blocks: rng.random_range(1..6),
        }
    }

    fn jobs(&self) -> Jobs<'_> {
        Jobs {
            seq_lens: &self.lens,
            query_len: self.query_len,
            mask: self.mask,
            window: self.window,
            tokens_per_cta: self.tokens_per_cta,
            head_blocks: self.head_blocks,
        }
    }
}

#[test]
fn the_device_schedule_is_the_reference_schedule() {
    let case = Case::new(spec(16, 64, &[100], 1, Mask::Causal));
    let Some(mut dec) = gpu::open(&case.config()) else {
        return;
    };
    let backend = dec.cuda_backend_mut().expect("a CUDA decoder");
    let mut rng = StdRng::seed_from_u64(11);
    // The shapes that matter (batch 1, a uniform batch that fills the CTAs exactly, a batch
    // with no keys at all, two tokens over two head blocks), then random ones.
    let mut batches = vec![
        Batch::h200(vec![8192]),
        Batch::h200(vec![4096; 264]),
        Batch {
            query_len: 2,
            head_blocks: 2,
            ..Batch::h200(vec![0; 7])
        },
    ];
    batches.extend((0..200).map(|_| Batch::random(&mut rng)));
    for b in &batches {
        let jobs = b.jobs();
        let want = Schedule::build(&jobs.blocks(), b.ctas, b.cost, b.min_blocks);
        let got = backend
            .schedule(&jobs, b.ctas, b.cost, b.min_blocks)
            .expect("the scheduler kernel runs");
        assert_eq!(
            got,
            want,
            "{} requests x {} tokens ({:?}, window {:?}, {} a CTA, {} head blocks) over {} CTAs, \
             cost {}, min {}",
            b.lens.len(),
            b.query_len,
            b.mask,
            b.window,
            b.tokens_per_cta,
            b.head_blocks,
            b.ctas,
            b.cost,
            b.min_blocks
        );
    }
}
