//! The on-disk cubin cache, so that a second process starts warm (like Triton's cache).
//!
//! A cubin is stored under a name made of its entry point, the architecture and a 64-bit hash
//! of everything that produced it: every source text, the options, the architecture and the
//! NVRTC version. Writes go through a temporary file and a rename, so a reader never sees a
//! partial file; any read or write failure just means compiling again.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

/// The cache folder: `MLA_CACHE_DIR`, else `$XDG_CACHE_HOME/mla`, else `~/.cache/mla`. None if
/// none of them can be found (then nothing is cached on disk).
pub fn dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("MLA_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("mla")))
        .or_else(|| var("HOME").map(|p| p.join(".cache").join("mla")))
        .or_else(|| var("LOCALAPPDATA").map(|p| p.join("mla")))
}

/// The file name of a compiled kernel. `DefaultHasher` with fixed keys is stable within one
/// Rust release; a release that changes it only costs one recompile.
pub fn file_name(
    entry: &str,
    arch: &str,
    sources: &[&str],
    options: &[String],
    nvrtc: (i32, i32),
) -> String {
    let mut h = DefaultHasher::new();
    sources.hash(&mut h);
    options.hash(&mut h);
    arch.hash(&mut h);
    nvrtc.hash(&mut h);
    format!(
        "{entry}-{arch}-nvrtc{}.{}-{:016x}.cubin",
        nvrtc.0,
        nvrtc.1,
        h.finish()
    )
}

/// The cached bytes, if present and readable.
pub fn load(dir: &Path, name: &str) -> Option<Vec<u8>> {
    std::fs::read(dir.join(name)).ok().filter(|b| !b.is_empty())
}

/// Stores bytes; failures are ignored (the cache is an optimization).
pub fn store(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let ok = std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, bytes).is_ok();
    if !ok || std::fs::rename(&tmp, dir.join(name)).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_change_with_every_input() {
        let base = file_name("k", "sm_90a", &["a", "b"], &["-DX=1".into()], (13, 0));
        assert!(base.starts_with("k-sm_90a-nvrtc13.0-"));
        assert_eq!(
            base,
            file_name("k", "sm_90a", &["a", "b"], &["-DX=1".into()], (13, 0))
        );
        for other in [
            file_name("k", "sm_80", &["a", "b"], &["-DX=1".into()], (13, 0)),
            file_name("k", "sm_90a", &["a", "c"], &["-DX=1".into()], (13, 0)),
            file_name("k", "sm_90a", &["a", "b"], &["-DX=2".into()], (13, 0)),
            file_name("k", "sm_90a", &["a", "b"], &["-DX=1".into()], (13, 1)),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn stores_and_loads_atomically() {
        let dir = std::env::temp_dir().join(format!("mla-cache-test-{}", std::process::id()));
        assert!(load(&dir, "x.cubin").is_none());
        store(&dir, "x.cubin", b"cubin bytes");
        assert_eq!(load(&dir, "x.cubin").as_deref(), Some(&b"cubin bytes"[..]));
        let leftovers = std::fs::read_dir(&dir).unwrap().filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        });
        assert_eq!(leftovers.count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
