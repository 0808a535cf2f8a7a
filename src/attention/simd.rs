//! Which vector instructions attention runs with: detected once per process, capped by
//! `KVRS_SIMD` in the environment (`portable`, `avx2`, `avx512`, `avx512bf16`, or the
//! names [`simd_level`] gives), and settable at run time ([`set_simd_level`]) so that one
//! test process compares every level this CPU has against the same reference.
//!
//! Decode (few query rows per KV head, memory-bound) runs the AVX2 kernel at every level
//! above it; the tiled kernel (prefill, extend, MLA) takes AVX-512 where it is present.

use std::sync::atomic::{AtomicU8, Ordering};

/// A set of vector instructions, each level including those below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// Loops the compiler vectorises for the baseline target.
    Portable = 1,
    /// AVX2, FMA and F16C.
    Avx2 = 2,
    /// AVX-512 F, BW, VL and DQ (with the AVX2 level's instructions).
    Avx512 = 3,
    /// AVX-512 with AVX512-BF16 (`vdpbf16ps`).
    Avx512Bf16 = 4,
}

impl Level {
    const ALL: [Level; 4] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Bf16,
    ];

    /// The name [`simd_level`] reports.
    fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2+fma+f16c",
            Level::Avx512 => "avx512f+bw+vl+dq",
            Level::Avx512Bf16 => "avx512f+bw+vl+dq+bf16",
        }
    }

    /// The level a name (long or short) selects.
    fn parse(name: &str) -> Option<Level> {
        let short = ["portable", "avx2", "avx512", "avx512bf16"];
        Level::ALL
            .into_iter()
            .zip(short)
            .find(|(l, s)| name == l.name() || name == *s)
            .map(|(l, _)| l)
    }

    fn from_u8(v: u8) -> Option<Level> {
        Level::ALL.into_iter().find(|l| *l as u8 == v)
    }
}

/// The highest level this CPU (and this build: AVX-512 needs rustc 1.89) runs.
fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("fma") && has!("f16c")) {
            return Level::Portable;
        }
        #[cfg(kvrs_avx512)]
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return if has!("avx512bf16") {
                Level::Avx512Bf16
            } else {
                Level::Avx512
            };
        }
        Level::Avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    Level::Portable
}

/// The level in use (0 until first asked).
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level attention runs with now: the detected one, capped by `KVRS_SIMD` or by
/// [`set_simd_level`].
#[inline]
pub(crate) fn level() -> Level {
    if let Some(l) = Level::from_u8(LEVEL.load(Ordering::Relaxed)) {
        return l;
    }
    let cpu = detected();
    let env = std::env::var("KVRS_SIMD").ok();
    let l = env
        .as_deref()
        .and_then(Level::parse)
        .map_or(cpu, |l| l.min(cpu));
    LEVEL.store(l as u8, Ordering::Relaxed);
    l
}

/// The vector instructions attention runs with on this CPU: `"avx512f+bw+vl+dq+bf16"`
/// (AVX-512 with `vdpbf16ps` for bfloat16 scores), `"avx512f+bw+vl+dq"`,
/// `"avx2+fma+f16c"`, or `"portable"` (what the compiler vectorises for the baseline
/// target). `KVRS_SIMD` in the environment caps it (`portable`, `avx2`, `avx512`,
/// `avx512bf16`), to compare the kernels.
pub fn simd_level() -> &'static str {
    level().name()
}

/// Every level this CPU runs, lowest first (by name, as [`simd_level`] gives them).
pub fn simd_levels() -> Vec<&'static str> {
    let cpu = detected();
    Level::ALL
        .into_iter()
        .filter(|l| *l <= cpu)
        .map(Level::name)
        .collect()
}

/// Sets the level attention runs with from now on, for every thread (`None`: the
/// detected one), capped at what the CPU runs; returns the level set, or `None` for a
/// name no level has. Calls already running finish at the level they started with or
/// the new one, item by item: every level computes the same attention.
pub fn set_simd_level(name: Option<&str>) -> Option<&'static str> {
    let cpu = detected();
    let l = match name {
        None => cpu,
        Some(n) => Level::parse(n)?.min(cpu),
    };
    LEVEL.store(l as u8, Ordering::Relaxed);
    Some(l.name())
}

/// Whether this CPU (and build) runs `l`, whatever the level in use.
#[cfg(test)]
pub(super) fn detected_at_least(l: Level) -> bool {
    detected() >= l
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level parses from its long and short names, and no other name parses.
    #[test]
    fn names_parse_to_their_levels() {
        for (l, short) in Level::ALL
            .into_iter()
            .zip(["portable", "avx2", "avx512", "avx512bf16"])
        {
            assert_eq!(Level::parse(l.name()), Some(l));
            assert_eq!(Level::parse(short), Some(l));
            assert_eq!(Level::from_u8(l as u8), Some(l));
        }
        assert_eq!(Level::parse("avx512fp16"), None);
        assert_eq!(Level::from_u8(0), None);
        let levels = simd_levels();
        assert_eq!(levels[0], "portable");
        assert_eq!(*levels.last().unwrap(), detected().name());
    }
}
