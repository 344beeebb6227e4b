//! The `mla` binary as a user (and the anchors benchmark) calls it.

use std::process::Command;

fn mla(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mla"))
        .args(args)
        .output()
        .expect("run mla")
}

/// Runs mla, asserts it succeeded and returns its stdout.
fn mla_ok(args: &[&str]) -> String {
    let out = mla(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mla {args:?} failed: {err}");
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// The last JSON line of a successful `mla bench --json` run, as text and parsed.
fn bench_json(args: &[&str]) -> (String, serde_json::Value) {
    let stdout = mla_ok(args);
    let last = stdout.lines().last().expect("a JSON line").to_owned();
    let v = serde_json::from_str(&last).expect("JSON");
    (last, v)
}

/// stderr of an mla run that must fail as a usage error: exit code 2, no panic.
fn mla_usage_err(args: &[&str]) -> String {
    let out = mla(args);
    assert_eq!(out.status.code(), Some(2), "mla {args:?}");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bench_json_reports_the_fields_the_anchors_script_reads() {
    let (last, v) = bench_json(&[
        "bench",
        "--backend",
        "cpu",
        "--batch",
        "3",
        "--heads",
        "16",
        "--ctx",
        "700",
        "--page",
        "16",
        "--kv-dtype",
        "fp8",
        "--query-len",
        "2",
        "--varlen",
        "--iters",
        "2",
        "--json",
    ]);
    for key in ["us", "TBps", "TFLOPs", "err_o", "err_lse", "num_kv_splits"] {
        assert!(
            v[key].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
            "{key} in {last}"
        );
    }
    assert_eq!(v["backend"], "cpu");
    let kernel = v["kernel"].as_str().unwrap_or_default();
    assert!(kernel.starts_with("cpu-"), "the CPU path that ran: {last}");
    assert_eq!(v["kernel_choice"], "auto");
    assert!(v["err_o"].as_f64().unwrap() < 5e-3, "{last}");
    assert!(v["err_lse"].as_f64().unwrap() < 1e-3, "{last}");
    assert_eq!(v["query_len"], 2);
}

#[test]
fn bench_takes_a_fixed_split_count() {
    // 700 keys would take 1 split under the CPU's rule; 7 are asked for and the result
    // stays within the tolerances of the f64 reference.
    let (last, v) = bench_json(&[
        "bench",
        "--backend",
        "cpu",
        "--batch",
        "2",
        "--heads",
        "4",
        "--ctx",
        "700",
        "--splits",
        "7",
        "--iters",
        "1",
        "--json",
    ]);
    assert_eq!(v["num_kv_splits"], 7, "{last}");
    assert_eq!(v["fixed_splits"], 7, "{last}");
    assert!(v["err_o"].as_f64().unwrap() < 5e-3, "{last}");
    let err = mla_usage_err(&["bench", "--batch", "1", "--heads", "8", "--splits", "0"]);
    assert!(err.contains("expected a whole number >= 1"), "{err}");
    let err = mla_usage_err(&["bench", "--batch", "1", "--heads", "8", "--splits", "5000"]);
    assert!(err.contains("num_kv_splits"), "{err}");
}

#[test]
fn bench_prints_a_table() {
    let stdout = mla_ok(&[
        "bench",
        "--backend",
        "auto",
        "--batch",
        "1",
        "--heads",
        "8",
        "--ctx",
        "100",
        "--iters",
        "1",
    ]);
    assert!(
        stdout.contains("TFLOP/s") && stdout.contains("err_o"),
        "{stdout}"
    );
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let small = ["bench", "--batch", "1", "--heads", "8", "--ctx", "100"];
    let err = mla_usage_err(&[&small[..], &["--kv-dtype", "fp4"]].concat());
    assert!(err.contains("unknown name \"fp4\""), "{err}");
    let err = mla_usage_err(&["bench", "--batch", "1", "--heads", "8", "--page", "0"]);
    assert!(err.contains("expected a whole number >= 1"), "{err}");
    let err = mla_usage_err(&["bench", "--batch", "1", "--heads", "0", "--ctx", "100"]);
    assert!(err.contains("num_heads"), "{err}");
}

#[test]
fn cuda_backend_without_a_gpu_is_a_clear_error() {
    let out = mla(&[
        "bench",
        "--backend",
        "cuda",
        "--batch",
        "1",
        "--heads",
        "8",
        "--ctx",
        "100",
    ]);
    if out.status.success() {
        return; // a GPU build on a GPU machine
    }
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("cuda") || err.contains("CUDA"), "{err}");
}

#[test]
fn info_lists_the_backends_and_split_counts() {
    let stdout = mla_ok(&["info"]);
    assert!(
        stdout.contains("cpu") && stdout.contains("cuda") && stdout.contains("splits"),
        "{stdout}"
    );
}

#[test]
fn a_bench_too_large_for_memory_is_an_error_naming_its_flags() {
    for args in [
        ["bench", "--ctx", "2000000000", "--heads", "8"],
        ["bench", "--batch", "100000000", "--heads", "8"],
    ] {
        let out = mla(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "mla {args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(args[2]), "{err}");
        assert!(
            err.contains("--batch, --ctx: ") && err.contains("of host memory"),
            "{err}"
        );
    }
}

#[test]
fn bench_takes_the_benchmark_settings_as_flags() {
    // A forced GPU family, the schedule's costs and PDL off: accepted, recorded, and (on the
    // CPU backend) without effect on the result.
    let (last, v) = bench_json(&[
        "bench",
        "--backend",
        "cpu",
        "--batch",
        "2",
        "--heads",
        "16",
        "--ctx",
        "300",
        "--iters",
        "1",
        "--kernel",
        "seesaw",
        "--schedule-costs",
        "3,4",
        "--no-pdl",
        "--json",
    ]);
    assert_eq!(v["kernel_choice"], "seesaw", "{last}");
    assert!(v["err_o"].as_f64().unwrap() < 5e-3, "{last}");
    // Bad values name the flag's setting and exit with a usage error.
    for (flag, value, words) in [
        ("--kernel", "tiled", "mma, wgmma, narrow, seesaw, wgmma-fp8"),
        ("--schedule-costs", "65,1", "SEG,MIN"),
    ] {
        let err = mla_usage_err(&["bench", "--backend", "cpu", flag, value]);
        assert!(
            err.contains(flag) && err.contains(words),
            "{flag} {value}: {err}"
        );
    }
}
