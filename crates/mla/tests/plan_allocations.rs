//! The decode path's host work allocates nothing: planning a call (every argument check, the
//! split count, the workspace views) is counted by an allocator that tallies the allocations
//! of the thread under test (the GPU's fill rule and kernel pick are counted the same way in
//! the library's own tests, `plan::splits`). A locked decoder can then run inside CUDA-graph
//! capture and on a serving engine's hot loop without touching the heap on the host.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{Device, MlaConfig, MlaDecode};

/// The system allocator, counting the allocations of threads that opted in.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the thread-locals are
// const-initialized, so touching them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations made by `f` on this thread.
fn allocations<T>(f: impl FnOnce() -> T) -> (usize, T) {
    COUNT.with(|c| c.set(0));
    COUNTING.with(|c| c.set(true));
    let out = f();
    COUNTING.with(|c| c.set(false));
    (COUNT.with(Cell::get), out)
}

#[test]
fn planning_a_decode_allocates_nothing() {
    let problem = Problem::generate(&ProblemSpec::new(16, vec![300, 5000, 77])).unwrap();
    let mut dec = MlaDecode::new(&MlaConfig::new(16, 0.1), Device::Cpu).unwrap();
    dec.reserve_workspace(problem.rows(), 5000).unwrap();
    dec.lock_workspace();
    let inputs = problem.inputs().unwrap();
    let mut out = Outputs::poisoned(&problem);
    let views = out.views().unwrap();
    // The counter sees allocations: a Vec made inside is counted.
    let (n, v) = allocations(|| vec![0u8; 64]);
    assert_eq!((n, v.len()), (1, 64));

    let (n, plan) = allocations(|| dec.plan(&inputs, &views));
    let plan = plan.unwrap();
    assert_eq!(n, 0, "planning allocated {n} times");
    assert!(plan.num_kv_splits > 1, "the split rule ran: {plan:?}");
}
